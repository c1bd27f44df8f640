"""A virtual cluster on one Linux machine: N hosts as network namespaces on a bridge, each with its
own address, a shaped link and its own ``sshd``, so that ``horovodrun -H a:1,b:1,...`` reaches them
exactly as it reaches real machines.

The pieces:

* ``hosts.py``: namespaces, veth pairs on the bridge, addresses, ``/etc/netns`` files, ``tc``
  shaping of the links (with the layout and why it looks that way);
* ``sshd.py``: keys, one ``sshd`` per host, the ``ssh`` wrapper, root's known_hosts;
* ``jobs.py``: ``horovodrun`` across the hosts, commands in every host, ending what jobs leave;
* ``cpu.py``: a hard CPU quota per host (its own cgroup, CFS bandwidth limit; cgroup v1 and v2);
* ``accounting.py``: link rates and byte counters;
* ``state.py``: the state file ``up`` leaves for ``attach``;
* ``cleanup.py``: teardown, also on errors, signals and interpreter exit, and of leftovers;
* ``virtual_cluster.py``: ``VirtualCluster``, which puts these together;
* ``cli.py``: the command line.

Python::

    from horovod_twobit.cluster import VirtualCluster
    with VirtualCluster(n_hosts=4, rate="100mbit") as c:
        res = c.horovodrun(1, [sys.executable, "train.py"], timeout=600)
        print(res.returncode, res.output, c.counters())

Command line::

    python -m horovod_twobit.cluster run --hosts 4 --rate 100mbit -- python train.py
    python -m horovod_twobit.cluster up --hosts 2 --rate 1gbit     # stays up; prints how to use it
    python -m horovod_twobit.cluster run --existing -- python train.py
    # hosts that stand for 1-core machines on 1 Gbit/s links, everything 4x slower:
    python -m horovod_twobit.cluster run --hosts 4 --rate 1gbit --cpus-per-host 0.25 \\
        --dilation 4 -- python train.py
    python -m horovod_twobit.cluster down                            # removes it (or leftovers)
"""

import os
import shutil
import subprocess
import sys

from horovod_twobit.cluster.accounting import iface_bytes, parse_rate
from horovod_twobit.cluster.cleanup import _leftovers, teardown
from horovod_twobit.cluster.errors import ClusterError, ClusterUnavailable
from horovod_twobit.cluster.hosts import Host
from horovod_twobit.cluster.jobs import Result
from horovod_twobit.cluster.processes import _pid_alive
from horovod_twobit.cluster.sshd import SSH, SSH_KEYGEN, SSHD, _root_known_hosts
from horovod_twobit.cluster.state import STATE_DIR
from horovod_twobit.cluster.virtual_cluster import VirtualCluster
from horovod_twobit.cluster.cli import _main
from horovod_twobit.cluster.capabilities import _capabilities, _which, unavailable_reason  # noqa: F401

__all__ = ["VirtualCluster", "ClusterUnavailable", "ClusterError", "Result", "unavailable_reason",
           "iface_bytes", "parse_rate"]
