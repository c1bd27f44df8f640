"""Tearing a cluster down. Everything is removed (processes in the namespaces, sshd, the hosts' CPU
cgroups, namespaces, veths, bridge, ``/etc/netns/NS``, temporary directory with the keys, known_hosts entries, state
file) on exit, on errors, on SIGINT/SIGTERM/SIGHUP and at interpreter exit: ``VirtualCluster``
turns those signals into exceptions while it is up and blocks them during the teardown itself;
``python -m horovod_twobit.cluster down`` also removes what a crashed cluster left behind."""

import contextlib
import os
import re
import shutil
import signal
import subprocess
import threading

from horovod_twobit.cluster import cpu
from horovod_twobit.cluster.processes import _kill_ns_processes, _run
from horovod_twobit.cluster.sshd import _clean_known_hosts
from horovod_twobit.cluster.state import STATE_DIR, state_path

_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def teardown(iface, namespaces, workdir=None, created_run_sshd=False, known_hosts_before=None,
             addresses=()):
    """Removes a cluster's pieces; returns a list of problems (empty when all went well)."""
    errors = []

    def attempt(what, fn):
        try:
            fn()
        except Exception as e:  # keep going: remove as much as possible
            errors.append("%s: %s" % (what, e))

    existing = set(subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
                   .stdout.split())
    live = [ns for ns in namespaces if ns in existing]
    attempt("processes in %s" % live, lambda: _kill_ns_processes(live))
    errors += cpu.remove_groups(iface)  # the hosts' CPU cgroups, if any (also leftovers)
    for ns in namespaces:
        if ns in existing:
            attempt("netns %s" % ns, lambda ns=ns: _run(["ip", "netns", "del", ns]))
        if os.path.exists("/sys/class/net/%s" % ns):  # root-side veth (goes with its peer normally)
            p = subprocess.run(["ip", "link", "del", ns], capture_output=True, text=True)
            if p.returncode != 0 and os.path.exists("/sys/class/net/%s" % ns):
                errors.append("veth %s: %s" % (ns, p.stderr.strip()))
        d = os.path.join("/etc/netns", ns)
        if os.path.isdir(d):
            attempt(d, lambda d=d: shutil.rmtree(d))
    if os.path.isdir("/etc/netns"):
        try:
            os.rmdir("/etc/netns")  # only when empty
        except OSError:
            pass
    if os.path.exists("/sys/class/net/%s/bridge" % iface):
        attempt("bridge %s" % iface, lambda: _run(["ip", "link", "del", iface]))
    if addresses:
        attempt("known_hosts", lambda: _clean_known_hosts(known_hosts_before, addresses))
    if workdir and os.path.basename(workdir).startswith("hvdtb-cluster-") and os.path.isdir(workdir):
        attempt(workdir, lambda: shutil.rmtree(workdir))
    if created_run_sshd:
        try:
            os.rmdir("/run/sshd")
        except OSError:
            pass
    state = state_path(iface)
    if os.path.exists(state):
        attempt(state, lambda: os.remove(state))
    try:
        os.rmdir(STATE_DIR)
    except OSError:
        pass
    return errors


def _leftovers(iface):
    """Names ``<iface>-h<i>`` of namespaces and /etc/netns entries (what ``down`` removes when no
    state file describes the cluster)."""
    names = [n for n in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
             .stdout.split() if re.match(r"^%s-h\d+$" % re.escape(iface), n)]
    if os.path.isdir("/etc/netns"):
        names += [n for n in os.listdir("/etc/netns")
                  if re.match(r"^%s-h\d+$" % re.escape(iface), n) and n not in names]
    return names


def install_signal_handlers():
    """SIGINT raises KeyboardInterrupt, SIGTERM and SIGHUP SystemExit(128 + signal), so that the
    cluster's ``with`` block unwinds and tears it down; returns the old handlers (none outside the
    main thread)."""
    old = {}
    if threading.current_thread() is not threading.main_thread():
        return old

    def handler(signum, frame):
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        raise SystemExit(128 + signum)

    for s in _SIGNALS:
        try:
            old[s] = signal.signal(s, handler)
        except (ValueError, OSError):
            pass
    return old


def restore_signal_handlers(old):
    """Puts back the handlers install_signal_handlers returned, and empties ``old``."""
    for s, h in old.items():
        try:
            signal.signal(s, h)
        except (ValueError, OSError, TypeError):
            pass
    old.clear()


@contextlib.contextmanager
def signals_blocked():
    """Signals must not cut a teardown short: blocks them, delivers them afterwards."""
    blockable = hasattr(signal, "pthread_sigmask")
    if blockable:
        old = signal.pthread_sigmask(signal.SIG_BLOCK, set(_SIGNALS))
    try:
        yield
    finally:
        if blockable:
            signal.pthread_sigmask(signal.SIG_SETMASK, old)
