"""Whether a virtual cluster can be made here: Linux, root, the capabilities, the tools."""

import os
import shutil
import subprocess
import sys

from horovod_twobit.cluster.sshd import SSH, SSH_KEYGEN, SSHD


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
