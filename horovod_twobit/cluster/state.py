"""The state file: ``up`` leaves a JSON description of the running cluster in
``/run/horovod-twobit-cluster/<iface>.json``; ``VirtualCluster.attach`` (another process) reads it
to run jobs on that cluster, show it or remove it. Teardown deletes it."""

import json
import os

from horovod_twobit.cluster.errors import ClusterError

STATE_DIR = "/run/horovod-twobit-cluster"


def state_path(iface):
    return os.path.join(STATE_DIR, "%s.json" % iface)


def write_state(iface, state):
    os.makedirs(STATE_DIR, exist_ok=True)
    with open(state_path(iface), "w") as f:
        json.dump(state, f)


def read_state(iface):
    path = state_path(iface)
    try:
        with open(path) as f:
            return json.load(f)
    except OSError:
        raise ClusterError("no virtual cluster %r is up (no %s): start one with `python -m "
                           "horovod_twobit.cluster up`" % (iface, path))
