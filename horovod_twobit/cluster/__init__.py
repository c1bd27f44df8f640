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

from .accounting import iface_bytes, parse_rate
from .cleanup import _leftovers, teardown
from .errors import ClusterError, ClusterUnavailable
from .hosts import Host
from .jobs import Result
from .processes import _pid_alive
from .sshd import SSH, SSH_KEYGEN, SSHD, _root_known_hosts
from .state import STATE_DIR
from .virtual_cluster import VirtualCluster
from .cli import _main

__all__ = ["VirtualCluster", "ClusterUnavailable", "ClusterError", "Result", "unavailable_reason",
           "iface_bytes", "parse_rate"]


def _which(name, fallback):
    return shutil.which(name) or (fallback if os.path.exists(fallback) else None)


CAP_NET_ADMIN, CAP_SYS_ADMIN = 12, 21  # veth, bridges, tc; `ip netns add` mounts


def _capabilities():
    """This process's effective capabilities (a bit mask), or None where /proc does not say."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("CapEff:"):
                    return int(line.split()[1], 16)
    except (OSError, ValueError):
        pass
    return None


def unavailable_reason():
    """None when a virtual cluster can be created here, else why not (a sentence)."""
    if not sys.platform.startswith("linux"):
        return "the virtual cluster needs Linux network namespaces (this is %s)" % sys.platform
    if os.geteuid() != 0:
        return ("the virtual cluster needs root (network namespaces, veth, tc, sshd): run as root, "
                "e.g. sudo %s -m horovod_twobit.cluster ..." % sys.executable)
    caps = _capabilities()
    missing = [name for name, bit in (("CAP_NET_ADMIN", CAP_NET_ADMIN), ("CAP_SYS_ADMIN", CAP_SYS_ADMIN))
               if caps is not None and not caps >> bit & 1]
    if missing:
        return ("the virtual cluster needs %s (network namespaces, veth, tc), which this root "
                "lacks, as in a container: run the container with --privileged"
                % " and ".join(missing))
    for tool, path in (("ip", "/usr/sbin/ip"), ("tc", "/usr/sbin/tc"), ("sshd", SSHD),
                       ("ssh", SSH), ("ssh-keygen", SSH_KEYGEN)):
        if _which(tool, path) is None:
            return ("%s is not installed: install iproute2, openssh-server and openssh-client "
                    "(bash scripts/setup.sh does)" % tool)
    try:
        p = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as e:
        return "`ip netns list` failed: %s" % e
    if p.returncode != 0:
        return "`ip netns` is unavailable here: %s" % (p.stderr.strip() or "exit %d" % p.returncode)
    return None
