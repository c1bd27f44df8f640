"""Commands and processes: ``ip``/``tc``/``ssh-keygen`` calls that raise ClusterError when they
fail, and ending processes, by process group (a job's launcher) or by network namespace (everything
that runs in the hosts)."""

import os
import shlex
import signal
import subprocess
import time

from horovod_twobit.cluster.errors import ClusterError


def _run(argv, check=True, timeout=60, input=None):
    p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, input=input)
    if check and p.returncode != 0:
        raise ClusterError("`%s` failed (exit %d): %s" % (" ".join(shlex.quote(a) for a in argv),
                                                          p.returncode, (p.stderr or p.stdout).strip()))
    return p


def _kill_group(proc):
    """SIGKILLs the process group ``proc`` leads (started with start_new_session) and reaps it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def _pid_alive(pid):
    """True while ``pid`` runs (zombies count as gone)."""
    try:
        with open("/proc/%d/stat" % pid) as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _ns_pids(ns):
    p = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, timeout=20)
    return [int(x) for x in p.stdout.split()] if p.returncode == 0 else []


def _kill_ns_processes(namespaces, keep=(), grace=3.0):
    """Ends every process in the namespaces (all started by the cluster: sshd and what it ran),
    except pids in ``keep``: SIGTERM, then SIGKILL to those still there after ``grace`` seconds."""
    me = os.getpid()

    def pids():
        return [p for ns in namespaces for p in _ns_pids(ns) if p not in keep and p != me]

    todo = pids()
    for p in todo:
        try:
            os.kill(p, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.time() + grace
    while todo and time.time() < deadline:
        todo = [p for p in todo if _pid_alive(p)]
        time.sleep(0.05)
    for p in pids():
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
