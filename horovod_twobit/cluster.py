"""A virtual cluster on one Linux machine: N hosts as network namespaces on a bridge, each with its
own address, a shaped link and its own ``sshd``, so that ``horovodrun -H a:1,b:1,...`` reaches them
exactly as it reaches real machines.

Layout (defaults; ``iface`` and ``subnet`` are parameters)::

    root namespace                                   namespace hvd0-h<i>  (one per host)
    bridge "hvd0" 10.77.0.1/24  --  veth "hvd0-h<i>" <====> veth "hvd0"  10.77.0.<11+i>/24
    horovodrun (rendezvous)         tc: tbf (to host)        tc: tbf (from host) [+ netem delay]
                                                             sshd (own config, host key, keys)

* The bridge in the root namespace and the veth inside every host are both named ``iface``, and
  jobs get ``--network-interface iface``: horovodrun then picks the bridge's address for its
  rendezvous server and the hosts' addresses for Gloo.
* Horovod's Gloo process-set contexts bind to the address the machine's hostname resolves to (all
  namespaces share the hostname, which resolves to 127.0.0.1). ``ip netns exec NS`` bind-mounts
  ``/etc/netns/NS/hosts`` over ``/etc/hosts``, so each host gets one mapping the hostname to its own
  address, and ``sshd`` (hence every process of a job) is started through ``ip netns exec``.
* ssh never touches root's ``~/.ssh``: a wrapper named ``ssh`` first on the jobs' PATH runs
  ``/usr/bin/ssh -F <cluster config>`` (the cluster's client key, its own known_hosts, no host-key
  prompts). Entries that show up in root's known_hosts for the cluster's addresses anyway are
  removed on teardown.
* Links are shaped on both ends of every veth with ``tbf`` at ``rate``: each host has ``rate`` up
  and ``rate`` down, like a switch port. ``delay`` (netem) is added on the host's side only, so the
  one-way latency between two hosts is ``delay``.
* Everything is torn down (processes in the namespaces, sshd, namespaces, veths, bridge,
  ``/etc/netns/NS``, temporary directory with the keys, known_hosts entries) on exit, on errors,
  on SIGINT/SIGTERM/SIGHUP and at interpreter exit.

Traffic only flows between the namespaces and the bridge address in the root namespace; the hosts
have no default route.

Python::

    from horovod_twobit.cluster import VirtualCluster
    with VirtualCluster(n_hosts=4, rate="100mbit") as c:
        res = c.horovodrun(1, [sys.executable, "train.py"], timeout=600)
        print(res.returncode, res.output, c.counters())

Command line::

    python -m horovod_twobit.cluster run --hosts 4 --rate 100mbit -- python train.py
    python -m horovod_twobit.cluster up --hosts 2 --rate 1gbit     # stays up; prints how to use it
    python -m horovod_twobit.cluster run --existing -- python train.py
    python -m horovod_twobit.cluster down                            # removes it (or leftovers)
"""

import argparse
import atexit
import ipaddress
import json
import os
import pwd
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

__all__ = ["VirtualCluster", "ClusterUnavailable", "ClusterError", "Result", "unavailable_reason",
           "iface_bytes", "parse_rate"]

SSHD = "/usr/sbin/sshd"
SSH = "/usr/bin/ssh"
SSH_KEYGEN = "/usr/bin/ssh-keygen"
STATE_DIR = "/run/horovod-twobit-cluster"



def _kill_group(proc):
    """SIGKILLs the process group ``proc`` leads (started with start_new_session) and reaps it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()

class ClusterUnavailable(RuntimeError):
    """This machine cannot host a virtual cluster (not root, no ``ip netns``, no sshd, ...)."""


class ClusterError(RuntimeError):
    """Setting up or using the virtual cluster failed."""


def _which(name, fallback):
    return shutil.which(name) or (fallback if os.path.exists(fallback) else None)


def unavailable_reason():
    """None when a virtual cluster can be created here, else why not (a sentence)."""
    if not sys.platform.startswith("linux"):
        return "the virtual cluster needs Linux network namespaces (this is %s)" % sys.platform
    if os.geteuid() != 0:
        return ("the virtual cluster needs root (network namespaces, veth, tc, sshd): run as root, "
                "e.g. sudo %s -m horovod_twobit.cluster ..." % sys.executable)
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


_RATE = re.compile(r"^(\d+(?:\.\d+)?)(|k|m|g|t)(bit|bps)$", re.I)
_SCALE = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}


def parse_rate(rate):
    """Bits per second of a tc rate such as ``100mbit``, ``1gbit``, ``12.5mbps``."""
    m = _RATE.match(str(rate).strip())
    if not m:
        raise ValueError("rate must look like 100mbit, 1gbit or 12.5mbps (tc units), got %r" % (rate,))
    bits = float(m.group(1)) * _SCALE[m.group(2).lower()] * (8 if m.group(3).lower() == "bps" else 1)
    if bits <= 0:
        raise ValueError("rate must be positive, got %r" % (rate,))
    return bits


_DELAY = re.compile(r"^\d+(?:\.\d+)?(us|usec|ms|msec|s|sec)$")


def iface_bytes(iface="hvd0"):
    """(rx_bytes, tx_bytes) of ``iface`` in the calling process's network namespace, from
    /proc/net/dev (which always shows the caller's namespace). Workers of a job call it to measure
    what their host sent and received around a loop."""
    with open("/proc/net/dev") as f:
        for line in f:
            name, sep, rest = line.partition(":")
            if sep and name.strip() == iface:
                v = rest.split()
                return int(v[0]), int(v[8])
    raise ClusterError("no interface %r in this network namespace (/proc/net/dev)" % iface)


def _run(argv, check=True, timeout=60, input=None):
    p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, input=input)
    if check and p.returncode != 0:
        raise ClusterError("`%s` failed (exit %d): %s" % (" ".join(shlex.quote(a) for a in argv),
                                                          p.returncode, (p.stderr or p.stdout).strip()))
    return p


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


def _root_known_hosts():
    try:
        home = pwd.getpwuid(os.geteuid()).pw_dir
    except KeyError:
        home = os.path.expanduser("~")
    return os.path.join(home, ".ssh", "known_hosts")


class Result:
    """What a job did: returncode, combined output, wall seconds."""

    def __init__(self, returncode, output, seconds, argv):
        self.returncode = returncode
        self.output = output
        self.seconds = seconds
        self.argv = argv

    @property
    def timed_out(self):
        return self.returncode is None

    def __repr__(self):
        return "rc=%s after %.1fs\n%s" % (self.returncode, self.seconds, self.output[-6000:])


class Host:
    __slots__ = ("index", "ns", "addr", "root_veth", "sshd_pid")

    def __init__(self, index, ns, addr, root_veth, sshd_pid=None):
        self.index, self.ns, self.addr, self.root_veth, self.sshd_pid = index, ns, addr, root_veth, sshd_pid

    def __repr__(self):
        return "Host(%d, ns=%s, addr=%s)" % (self.index, self.ns, self.addr)


class VirtualCluster:
    """N hosts as network namespaces on a bridge, with shaped links and sshd; see the module doc.

    Args:
        n_hosts: number of hosts (1..200).
        rate: link rate of every host in tc units (``100mbit``, ``1gbit``), both directions; None
            leaves links unshaped.
        delay: optional one-way latency added on every host's egress with netem (``5ms``).
        iface: name of the bridge (root namespace) and of the veth inside every host; jobs get
            ``--network-interface iface``. Namespaces are named ``<iface>-h<i>``.
        subnet: a /24 such as ``10.77.0.0/24``: the bridge takes .1, host i takes .(11 + i).
        mtu: MTU of the bridge and veths.
    """

    def __init__(self, n_hosts=2, rate="1gbit", delay=None, iface="hvd0", subnet="10.77.0.0/24",
                 mtu=1500):
        n_hosts = int(n_hosts)
        if not 1 <= n_hosts <= 200:
            raise ValueError("n_hosts must be 1..200, got %d" % n_hosts)
        if rate is not None:
            parse_rate(rate)
        if delay is not None and not _DELAY.match(str(delay)):
            raise ValueError("delay must look like 5ms or 200us (tc units), got %r" % (delay,))
        if not re.match(r"^[A-Za-z][A-Za-z0-9_]{0,8}$", iface):
            raise ValueError("iface must be 1-9 letters/digits starting with a letter (it prefixes "
                             "namespace and veth names), got %r" % (iface,))
        net = ipaddress.ip_network(subnet, strict=True)
        if net.version != 4 or net.prefixlen != 24 or not net.is_private:
            raise ValueError("subnet must be a private IPv4 /24, got %r" % (subnet,))
        self.n_hosts, self.rate, self.delay, self.iface, self.mtu = n_hosts, rate, delay, iface, int(mtu)
        self.subnet = net
        base = int(net.network_address)
        self.bridge_addr = str(ipaddress.ip_address(base + 1))
        self.hosts = [Host(i, "%s-h%d" % (iface, i), str(ipaddress.ip_address(base + 11 + i)),
                           "%s-h%d" % (iface, i)) for i in range(n_hosts)]
        self.workdir = None
        self._sshd = {}
        self._known_hosts_before = None
        self._created_run_sshd = False
        self._up = False
        self._lock = threading.Lock()
        self._old_handlers = {}
        self._atexit = False
        self._detached = False

    # ------------------------------------------------------------------ paths
    @property
    def key(self):
        """The client private key (pass as ``--ssh-identity-file``)."""
        return os.path.join(self.workdir, "id_ed25519")

    @property
    def ssh_config(self):
        return os.path.join(self.workdir, "ssh_config")

    @property
    def bin_dir(self):
        """A directory holding the ``ssh`` wrapper; put it first on PATH of anything that ssh's."""
        return os.path.join(self.workdir, "bin")

    @property
    def addresses(self):
        return [h.addr for h in self.hosts]

    def _state_file(self):
        return os.path.join(STATE_DIR, "%s.json" % self.iface)

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self):
        self._install_signal_handlers()
        try:
            self.up()
        except BaseException:
            self._restore_signal_handlers()
            raise
        return self

    def __exit__(self, *exc):
        try:
            self.down()
        finally:
            self._restore_signal_handlers()
        return False

    def _install_signal_handlers(self):
        if threading.current_thread() is not threading.main_thread():
            return

        def handler(signum, frame):
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            raise SystemExit(128 + signum)

        for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            try:
                self._old_handlers[s] = signal.signal(s, handler)
            except (ValueError, OSError):
                pass

    def _restore_signal_handlers(self):
        for s, h in self._old_handlers.items():
            try:
                signal.signal(s, h)
            except (ValueError, OSError, TypeError):
                pass
        self._old_handlers.clear()

    def up(self):
        """Creates the cluster. On any failure everything created so far is removed."""
        reason = unavailable_reason()
        if reason:
            raise ClusterUnavailable(reason)
        with self._lock:
            if self._up:
                return self
            self._check_free()
            self._up = True  # from here on, down() has something to do
            if not self._atexit:
                atexit.register(self.down)
                self._atexit = True
            try:
                self._create()
            except BaseException:
                self._teardown()
                raise
        return self

    def _check_free(self):
        if os.path.exists("/sys/class/net/%s" % self.iface):
            raise ClusterError(
                "an interface named %r already exists in the root namespace (another virtual "
                "cluster, or a leftover): remove it with `python -m horovod_twobit.cluster down "
                "--iface %s`, or pick another iface" % (self.iface, self.iface))
        existing = set(_run(["ip", "netns", "list"]).stdout.split())
        clash = [h.ns for h in self.hosts if h.ns in existing]
        if clash:
            raise ClusterError("network namespaces %s already exist: remove them with `python -m "
                               "horovod_twobit.cluster down --iface %s`" % (clash, self.iface))
        routes = _run(["ip", "-4", "route", "show", "to", "match", str(self.subnet.network_address)])
        for line in routes.stdout.splitlines():
            if line.split() and line.split()[0] != "default":
                raise ClusterError("the subnet %s is already routed here (%s): pick another subnet"
                                   % (self.subnet, line.strip()))

    def _create(self):
        self.workdir = tempfile.mkdtemp(prefix="hvdtb-cluster-%s-" % self.iface)
        os.chmod(self.workdir, 0o700)
        self._known_hosts_before = self._read_known_hosts()
        self._make_keys()
        ip = ["ip"]
        _run(ip + ["link", "add", self.iface, "type", "bridge"])
        _run(ip + ["link", "set", self.iface, "mtu", str(self.mtu)])
        _run(ip + ["addr", "add", "%s/24" % self.bridge_addr, "dev", self.iface])
        _run(ip + ["link", "set", self.iface, "up"])
        for h in self.hosts:
            _run(ip + ["netns", "add", h.ns])
            _run(ip + ["link", "add", h.root_veth, "type", "veth", "peer", "name", self.iface,
                       "netns", h.ns])
            _run(ip + ["link", "set", h.root_veth, "mtu", str(self.mtu), "master", self.iface, "up"])
            _run(ip + ["-n", h.ns, "link", "set", "lo", "up"])
            _run(ip + ["-n", h.ns, "link", "set", self.iface, "mtu", str(self.mtu)])
            _run(ip + ["-n", h.ns, "addr", "add", "%s/24" % h.addr, "dev", self.iface])
            _run(ip + ["-n", h.ns, "link", "set", self.iface, "up"])
            self._no_ipv6(h)
            self._shape(h)
            self._write_netns_files(h)
        if not os.path.isdir("/run/sshd"):  # sshd's privilege separation directory
            os.makedirs("/run/sshd", mode=0o755)
            self._created_run_sshd = True
        for h in self.hosts:
            self._start_sshd(h)
        for h in self.hosts:
            self._wait_ssh(h)
        self._write_state()

    def _no_ipv6(self, h):
        """IPv6 off on the cluster's links: no router solicitations or MLD reports in the counters."""
        for path, ns in (("/proc/sys/net/ipv6/conf/%s/disable_ipv6" % h.root_veth, None),
                         ("/proc/sys/net/ipv6/conf/%s/disable_ipv6" % self.iface, self.iface),
                         ("/proc/sys/net/ipv6/conf/%s/disable_ipv6" % self.iface, h.ns)):
            if ns == h.ns:
                subprocess.run(["ip", "netns", "exec", h.ns, "sh", "-c", "echo 1 > %s" % path],
                               capture_output=True, timeout=20)
            elif os.path.exists(path):
                with open(path, "w") as f:
                    f.write("1")

    def _tbf(self, dev, ns=None, parent=None):
        bps = parse_rate(self.rate)
        burst = max(4 * (self.mtu + 100), int(bps / 8 * 0.002))  # >= 2 ms worth at the rate
        argv = ["tc"] + (["-n", ns] if ns else []) + ["qdisc", "add", "dev", dev]
        argv += ["parent", parent, "handle", "10:"] if parent else ["root", "handle", "1:"]
        _run(argv + ["tbf", "rate", str(self.rate), "burst", str(burst), "latency", "100ms"])

    def _shape(self, h):
        if self.rate is not None:
            self._tbf(h.root_veth)  # bridge -> host
        if self.delay is not None:
            try:
                _run(["tc", "-n", h.ns, "qdisc", "add", "dev", self.iface, "root", "handle", "1:",
                      "netem", "delay", str(self.delay), "limit", "100000"])
            except ClusterError as e:
                if "unknown" in str(e).lower():
                    raise ClusterError("delay needs the netem qdisc, which this kernel lacks "
                                       "(sch_netem): run without delay") from None
                raise
            if self.rate is not None:
                self._tbf(self.iface, ns=h.ns, parent="1:1")
        elif self.rate is not None:
            self._tbf(self.iface, ns=h.ns)  # host -> bridge

    def _write_netns_files(self, h):
        d = os.path.join("/etc/netns", h.ns)
        os.makedirs(d, exist_ok=True)
        hostname = socket.gethostname()
        lines = ["127.0.0.1 localhost", "::1 localhost ip6-localhost ip6-loopback",
                 "%s %s" % (h.addr, hostname)]
        lines += ["%s %s" % (o.addr, o.ns) for o in self.hosts]
        lines.append("%s %s-launcher" % (self.bridge_addr, self.iface))
        with open(os.path.join(d, "hosts"), "w") as f:
            f.write("# written by horovod_twobit.cluster for %s; removed on teardown\n" % h.ns)
            f.write("\n".join(lines) + "\n")

    def _make_keys(self):
        _run([SSH_KEYGEN, "-q", "-t", "ed25519", "-N", "", "-C", "hvdtb-cluster", "-f", self.key])
        shutil.copy(self.key + ".pub", os.path.join(self.workdir, "authorized_keys"))
        os.makedirs(self.bin_dir)
        with open(self.ssh_config, "w") as f:
            f.write("Host *\n"
                    "  User root\n"
                    "  IdentityFile %s\n"
                    "  IdentitiesOnly yes\n"
                    "  UserKnownHostsFile %s\n"
                    "  GlobalKnownHostsFile /dev/null\n"
                    "  StrictHostKeyChecking no\n"
                    "  HashKnownHosts no\n"
                    "  BatchMode yes\n"
                    "  PasswordAuthentication no\n"
                    "  ConnectTimeout 20\n"
                    "  LogLevel ERROR\n" % (self.key, os.path.join(self.workdir, "known_hosts")))
        wrapper = os.path.join(self.bin_dir, "ssh")
        with open(wrapper, "w") as f:
            f.write("#!/bin/sh\n# horovod_twobit.cluster: ssh with the cluster's own config\n"
                    "exec %s -F %s \"$@\"\n" % (SSH, shlex.quote(self.ssh_config)))
        os.chmod(wrapper, 0o755)
        for h in self.hosts:
            hk = os.path.join(self.workdir, "h%d" % h.index, "ssh_host_ed25519_key")
            os.makedirs(os.path.dirname(hk))
            _run([SSH_KEYGEN, "-q", "-t", "ed25519", "-N", "", "-C", h.ns, "-f", hk])

    def _start_sshd(self, h):
        d = os.path.join(self.workdir, "h%d" % h.index)
        cfg = os.path.join(d, "sshd_config")
        with open(cfg, "w") as f:
            f.write("Port 22\n"
                    "ListenAddress %s\n"
                    "HostKey %s\n"
                    "PidFile %s\n"
                    "AuthorizedKeysFile %s\n"
                    "PermitRootLogin prohibit-password\n"
                    "PubkeyAuthentication yes\n"
                    "PasswordAuthentication no\n"
                    "KbdInteractiveAuthentication no\n"
                    "UsePAM no\n"
                    "StrictModes no\n"
                    "PrintMotd no\n"
                    "UseDNS no\n"
                    "MaxStartups 200\n"
                    "MaxSessions 200\n"
                    "LogLevel ERROR\n"
                    % (h.addr, os.path.join(d, "ssh_host_ed25519_key"), os.path.join(d, "sshd.pid"),
                       os.path.join(self.workdir, "authorized_keys")))
        log = open(os.path.join(d, "sshd.log"), "ab")
        proc = subprocess.Popen(["ip", "netns", "exec", h.ns, SSHD, "-D", "-e", "-f", cfg],
                                stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                start_new_session=True)
        log.close()
        self._sshd[h.ns] = proc
        h.sshd_pid = proc.pid  # ip netns exec execs sshd: same pid

    def _wait_ssh(self, h, timeout=30):
        deadline = time.time() + timeout
        proc = self._sshd.get(h.ns)
        while True:
            if proc is not None and proc.poll() is not None:
                raise ClusterError("sshd in %s exited (%s): %s" % (h.ns, proc.returncode, self._sshd_log(h)))
            try:
                with socket.create_connection((h.addr, 22), timeout=2) as s:
                    s.settimeout(5)
                    if s.recv(64).startswith(b"SSH-"):
                        break
            except OSError:
                pass
            if time.time() > deadline:
                raise ClusterError("sshd in %s did not answer on %s:22 within %ds: %s"
                                   % (h.ns, h.addr, timeout, self._sshd_log(h)))
            time.sleep(0.1)
        p = subprocess.run([os.path.join(self.bin_dir, "ssh"), h.addr, "true"], capture_output=True,
                           text=True, timeout=60)
        if p.returncode != 0:
            raise ClusterError("ssh to %s (%s) failed: %s %s" % (h.ns, h.addr, p.stderr.strip(),
                                                                 self._sshd_log(h)))

    def _sshd_log(self, h):
        try:
            with open(os.path.join(self.workdir, "h%d" % h.index, "sshd.log")) as f:
                return f.read()[-2000:]
        except OSError:
            return ""

    def _write_state(self):
        os.makedirs(STATE_DIR, exist_ok=True)
        state = {"n_hosts": self.n_hosts, "rate": self.rate, "delay": self.delay, "iface": self.iface,
                 "subnet": str(self.subnet), "mtu": self.mtu, "workdir": self.workdir,
                 "created_run_sshd": self._created_run_sshd,
                 "known_hosts_before": self._known_hosts_before,
                 "sshd_pids": {h.ns: h.sshd_pid for h in self.hosts}, "pid": os.getpid()}
        with open(self._state_file(), "w") as f:
            json.dump(state, f)

    @classmethod
    def attach(cls, iface="hvd0"):
        """The cluster that ``up`` (another process) left running with this iface."""
        path = os.path.join(STATE_DIR, "%s.json" % iface)
        try:
            with open(path) as f:
                st = json.load(f)
        except OSError:
            raise ClusterError("no virtual cluster %r is up (no %s): start one with `python -m "
                               "horovod_twobit.cluster up`" % (iface, path))
        c = cls(st["n_hosts"], st["rate"], st["delay"], st["iface"], st["subnet"], st["mtu"])
        c.workdir = st["workdir"]
        c._created_run_sshd = st["created_run_sshd"]
        c._known_hosts_before = st["known_hosts_before"]
        for h in c.hosts:
            h.sshd_pid = st["sshd_pids"].get(h.ns)
        c._up = True
        return c

    def detach(self):
        """Leaves the cluster running when this object goes away (for ``up``)."""
        self._detached = True
        self._up = False

    def down(self):
        """Removes everything the cluster created. Safe to call twice; never raises for leftovers
        that are already gone."""
        with self._lock:
            if not self._up:
                return
            self._teardown()

    def _teardown(self):
        # Signals must not cut the teardown short: block them, deliver them afterwards.
        blockable = hasattr(signal, "pthread_sigmask")
        if blockable:
            old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM, signal.SIGHUP})
        try:
            errors = teardown(self.iface, [h.ns for h in self.hosts], self.workdir,
                              self._created_run_sshd, self._known_hosts_before, self.addresses)
        finally:
            self._up = False
            for proc in self._sshd.values():  # reap them
                try:
                    proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    pass
            self._sshd.clear()
            if blockable:
                signal.pthread_sigmask(signal.SIG_SETMASK, old)
        if errors:
            print("horovod_twobit.cluster: teardown left problems:\n  " + "\n  ".join(errors),
                  file=sys.stderr)

    # ------------------------------------------------------------------ known_hosts
    def _read_known_hosts(self):
        try:
            with open(_root_known_hosts()) as f:
                return f.read().splitlines()
        except OSError:
            return None

    # ------------------------------------------------------------------ using it
    def env(self, extra=None):
        """Environment for jobs: the ssh wrapper first on PATH, Open MPI allowed to run as root."""
        env = dict(os.environ)
        env.update({"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
                    "PYTHONUNBUFFERED": "1"})
        env.update(extra or {})
        path = [p for p in env.get("PATH", "/usr/bin:/bin").split(os.pathsep) if p != self.bin_dir]
        env["PATH"] = os.pathsep.join([self.bin_dir] + path)
        return env

    def _select(self, hosts):
        if hosts is None:
            return list(self.hosts)
        if isinstance(hosts, int):
            if not 1 <= hosts <= self.n_hosts:
                raise ValueError("the cluster has %d hosts, asked for %d" % (self.n_hosts, hosts))
            return self.hosts[:hosts]
        return [self.hosts[i] for i in hosts]

    def horovodrun_argv(self, np_per_host, command, mpi=False, hosts=None, extra_args=()):
        """The horovodrun command line for ``command`` (a list) on the cluster's hosts."""
        sel = self._select(hosts)
        exe = os.path.join(os.path.dirname(sys.executable), "horovodrun")
        if not os.path.exists(exe):
            exe = shutil.which("horovodrun") or "horovodrun"
        argv = [exe, "-np", str(np_per_host * len(sel)),
                "-H", ",".join("%s:%d" % (h.addr, np_per_host) for h in sel),
                "--network-interface", self.iface, "--ssh-identity-file", self.key, "--disable-cache"]
        if mpi:
            # horovodrun already sets btl_tcp_if_include; keep Open MPI's own out-of-band traffic
            # (daemons <-> mpirun) on the cluster's interface too.
            argv += ["--mpi", "--mpi-args=--oversubscribe -mca oob_tcp_if_include %s" % self.iface]
        else:
            argv += ["--gloo"]
        return argv + list(extra_args) + [str(a) for a in command]

    def horovodrun(self, np_per_host, command, mpi=False, hosts=None, timeout=None, env=None,
                   extra_args=(), stream=None):
        """Runs ``horovodrun`` from the root namespace across the hosts (``hosts``: a count of the
        first hosts, a list of indices, or None for all) with ``np_per_host`` slots each. Returns
        a Result (returncode None when it ran past ``timeout`` seconds and was killed). Processes
        it leaves in the namespaces are ended. ``stream``: a file to copy output to as it comes."""
        if not self._up:
            raise ClusterError("the cluster is not up")
        argv = self.horovodrun_argv(np_per_host, command, mpi=mpi, hosts=hosts, extra_args=extra_args)
        return self._run_job(argv, self.env(env), timeout, stream)

    def _run_job(self, argv, env, timeout, stream):
        t0 = time.time()
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env=env, start_new_session=True, stdin=subprocess.DEVNULL)
        chunks = []

        def pump():
            for line in proc.stdout:
                chunks.append(line)
                if stream is not None:
                    stream.write(line)
                    stream.flush()

        t = threading.Thread(target=pump, daemon=True)
        t.start()
        rc = None
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            chunks.append("\n[horovod_twobit.cluster: killed after %ss]\n" % timeout)
        finally:
            _kill_group(proc)  # also mpirun/ssh children left in the launcher's process group
            t.join(timeout=10)
            self.kill_stragglers()
        return Result(rc, "".join(chunks), time.time() - t0, argv)

    def kill_stragglers(self):
        """Ends every process in the hosts except their sshd listeners."""
        _kill_ns_processes([h.ns for h in self.hosts], keep={h.sshd_pid for h in self.hosts})

    def exec_argv(self, host, argv):
        """``argv`` wrapped to run inside host ``host`` (an index) through ``ip netns exec``."""
        return ["ip", "netns", "exec", self.hosts[host].ns] + [str(a) for a in argv]

    def popen(self, host, argv, **kwargs):
        """subprocess.Popen of ``argv`` inside host ``host``; the caller waits for it."""
        kwargs.setdefault("env", self.env())
        return subprocess.Popen(self.exec_argv(host, argv), **kwargs)

    def run_on_hosts(self, argv_for_host, hosts=None, timeout=None, env=None, stream=None):
        """Starts ``argv_for_host(host)`` (a list) in every selected host at once through
        ``ip netns exec`` (no ssh, no horovodrun: e.g. torch.distributed jobs) and waits for all.
        Returns a Result with the combined output; returncode is the first nonzero one (None on
        timeout)."""
        sel = self._select(hosts)
        t0 = time.time()
        procs = []
        out_dir = tempfile.mkdtemp(prefix="hvdtb-job-", dir=self.workdir)
        try:
            for h in sel:
                f = open(os.path.join(out_dir, "h%d.log" % h.index), "w+")
                p = self.popen(h.index, argv_for_host(h), stdout=f, stderr=subprocess.STDOUT,
                               stdin=subprocess.DEVNULL, env=self.env(env), text=True,
                               start_new_session=True)
                procs.append((h, p, f))
            deadline = None if timeout is None else t0 + timeout
            rcs = []
            timed_out = False
            for h, p, f in procs:
                try:
                    rcs.append(p.wait(timeout=None if deadline is None else max(0.1, deadline - time.time())))
                except subprocess.TimeoutExpired:
                    timed_out = True
                    break
                if rcs[-1] != 0:  # one failed: the others would hang in a collective
                    break
        finally:
            for h, p, f in procs:
                if p.poll() is None:
                    _kill_group(p)
            self.kill_stragglers()
        output = []
        for h, p, f in procs:
            f.seek(0)
            text = f.read()
            f.close()
            output.append("".join("[%s] %s\n" % (h.ns, line) for line in text.splitlines()))
            if stream is not None:
                stream.write(output[-1])
        shutil.rmtree(out_dir, ignore_errors=True)
        rc = None if timed_out else next((r for r in (p.returncode for _, p, _ in procs) if r != 0), 0)
        return Result(rc, "".join(output), time.time() - t0, None)

    def counters(self):
        """{host ns: {"tx": bytes the host sent, "rx": bytes it received}} on its link so far, read
        from the root-side veth (whose rx is the host's tx)."""
        out = {}
        for h in self.hosts:
            base = "/sys/class/net/%s/statistics/" % h.root_veth
            with open(base + "rx_bytes") as f:
                tx = int(f.read())
            with open(base + "tx_bytes") as f:
                rx = int(f.read())
            out[h.ns] = {"tx": tx, "rx": rx}
        return out

    def describe(self):
        lines = ["virtual cluster %s: %d hosts, rate %s%s, bridge %s %s, workdir %s" % (
            self.iface, self.n_hosts, self.rate or "unshaped",
            ", delay %s" % self.delay if self.delay else "", self.iface, self.bridge_addr, self.workdir)]
        for h in self.hosts:
            lines.append("  %-10s %s  (sshd pid %s)" % (h.ns, h.addr, h.sshd_pid))
        return "\n".join(lines)


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
    state = os.path.join(STATE_DIR, "%s.json" % iface)
    if os.path.exists(state):
        attempt(state, lambda: os.remove(state))
    try:
        os.rmdir(STATE_DIR)
    except OSError:
        pass
    return errors


def _clean_known_hosts(before, addresses):
    """Removes from root's known_hosts the lines for ``addresses`` that were not there before."""
    path = _root_known_hosts()
    if not os.path.exists(path):
        return
    before = set(before or [])
    with open(path) as f:
        lines = f.read().splitlines()
    drop = set()
    for addr in addresses:
        p = subprocess.run([SSH_KEYGEN, "-F", addr, "-f", path], capture_output=True, text=True)
        for line in p.stdout.splitlines():
            if line and not line.startswith("#"):
                drop.add(line)
    keep = [line for line in lines if line in before or line not in drop]
    if not keep and not before:  # the file is ours alone
        os.remove(path)
    elif len(keep) != len(lines):
        tmp = path + ".hvdtb-tmp"
        with open(tmp, "w") as f:
            f.write("".join(line + "\n" for line in keep))
        os.chmod(tmp, os.stat(path).st_mode & 0o777)
        os.replace(tmp, path)


def _leftovers(iface):
    names = [n for n in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
             .stdout.split() if re.match(r"^%s-h\d+$" % re.escape(iface), n)]
    if os.path.isdir("/etc/netns"):
        names += [n for n in os.listdir("/etc/netns")
                  if re.match(r"^%s-h\d+$" % re.escape(iface), n) and n not in names]
    return names


# ---------------------------------------------------------------------- command line
def _main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m horovod_twobit.cluster",
                                 description="A virtual multi-host cluster (network namespaces, "
                                             "shaped links, sshd) for horovodrun jobs.")
    sub = ap.add_subparsers(dest="cmd", required=True)

    def common(p):
        p.add_argument("--iface", default="hvd0", help="bridge/veth name (default hvd0)")

    def shape(p):
        p.add_argument("--hosts", type=int, default=2, help="number of hosts (default 2)")
        p.add_argument("--rate", default="1gbit", help="link rate per host, tc units; 'none' for "
                                                       "unshaped (default 1gbit)")
        p.add_argument("--delay", default=None, help="one-way latency added per host, e.g. 5ms")
        p.add_argument("--subnet", default="10.77.0.0/24")
        p.add_argument("--mtu", type=int, default=1500)

    p_up = sub.add_parser("up", help="create a cluster and leave it running")
    common(p_up)
    shape(p_up)
    p_run = sub.add_parser("run", help="run horovodrun across the hosts (creating a cluster for "
                                       "the job unless --existing)")
    common(p_run)
    shape(p_run)
    p_run.add_argument("--existing", action="store_true", help="use the cluster `up` left running")
    p_run.add_argument("--np-per-host", type=int, default=1)
    p_run.add_argument("--mpi", action="store_true", help="horovodrun --mpi (default: --gloo)")
    p_run.add_argument("--timeout", type=float, default=None, help="seconds")
    p_run.add_argument("command", nargs=argparse.REMAINDER, help="-- CMD ARGS...")
    p_down = sub.add_parser("down", help="remove the cluster (or the leftovers of one)")
    common(p_down)
    p_st = sub.add_parser("status", help="show the cluster that is up")
    common(p_st)
    args = ap.parse_args(argv)

    if args.cmd in ("up", "run"):
        rate = None if str(args.rate).lower() == "none" else args.rate
    try:
        if args.cmd == "up":
            c = VirtualCluster(args.hosts, rate, args.delay, args.iface, args.subnet, args.mtu)
            with c:
                print(c.describe())
                print("\nrun a job:  %s -m horovod_twobit.cluster run --existing --iface %s -- "
                      "python train.py" % (sys.executable, args.iface))
                print("or by hand: PATH=%s:$PATH %s" % (c.bin_dir, " ".join(
                    shlex.quote(a) for a in c.horovodrun_argv(1, ["python", "train.py"]))))
                print("remove it:  %s -m horovod_twobit.cluster down --iface %s"
                      % (sys.executable, args.iface))
                c.detach()
            return 0
        if args.cmd == "run":
            cmd = args.command[1:] if args.command[:1] == ["--"] else args.command
            if not cmd:
                ap.error("run needs a command after --")
            if args.existing:
                c = VirtualCluster.attach(args.iface)
                res = c.horovodrun(args.np_per_host, cmd, mpi=args.mpi, timeout=args.timeout,
                                   stream=sys.stdout)
            else:
                with VirtualCluster(args.hosts, rate, args.delay, args.iface, args.subnet, args.mtu) as c:
                    print(c.describe(), flush=True)
                    res = c.horovodrun(args.np_per_host, cmd, mpi=args.mpi, timeout=args.timeout,
                                       stream=sys.stdout)
                    print("bytes per host (tx/rx): " + ", ".join(
                        "%s %d/%d" % (k, v["tx"], v["rx"]) for k, v in c.counters().items()))
            if res.timed_out:
                print("timed out after %ss" % args.timeout, file=sys.stderr)
                return 124
            return res.returncode
        if args.cmd == "down":
            if os.geteuid() != 0:
                raise ClusterUnavailable("removing a virtual cluster needs root")
            try:
                c = VirtualCluster.attach(args.iface)
                c.down()
                print("removed virtual cluster %s" % args.iface)
            except ClusterError:
                names = _leftovers(args.iface)
                errors = teardown(args.iface, names)
                print("removed leftovers of %s: %s" % (args.iface, names or "none"))
                if errors:
                    print("\n".join(errors), file=sys.stderr)
                    return 1
            return 0
        if args.cmd == "status":
            c = VirtualCluster.attach(args.iface)
            c.detach()
            print(c.describe())
            return 0
    except (ClusterUnavailable, ClusterError, ValueError) as e:
        print("horovod_twobit.cluster: %s" % e, file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted; the cluster was removed", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(_main())
