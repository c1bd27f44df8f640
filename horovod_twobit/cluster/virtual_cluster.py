"""VirtualCluster: brings the hosts' network (hosts.py), their sshd (sshd.py), the state file
(state.py) and the teardown (cleanup.py) together, and runs jobs on the hosts (jobs.py)."""

import atexit
import ipaddress
import os
import re
import subprocess
import sys
import tempfile
import threading

from . import cleanup, jobs, sshd
from .accounting import counters, parse_rate
from .errors import ClusterError, ClusterUnavailable
from .hosts import _DELAY, check_free, create_network, make_hosts
from .state import read_state, write_state


class VirtualCluster:
    """N hosts as network namespaces on a bridge, with shaped links and sshd; see the package doc.

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
        self.bridge_addr, self.hosts = make_hosts(n_hosts, iface, net)
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
        return sshd.client_key(self.workdir)

    @property
    def ssh_config(self):
        return sshd.client_config(self.workdir)

    @property
    def bin_dir(self):
        """A directory holding the ``ssh`` wrapper; put it first on PATH of anything that ssh's."""
        return sshd.wrapper_dir(self.workdir)

    @property
    def addresses(self):
        return [h.addr for h in self.hosts]

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self):
        self._old_handlers = cleanup.install_signal_handlers()
        try:
            self.up()
        except BaseException:
            cleanup.restore_signal_handlers(self._old_handlers)
            raise
        return self

    def __exit__(self, *exc):
        try:
            self.down()
        finally:
            cleanup.restore_signal_handlers(self._old_handlers)
        return False

    def up(self):
        """Creates the cluster. On any failure everything created so far is removed."""
        from . import unavailable_reason  # the package's, whose _which callers may replace
        reason = unavailable_reason()
        if reason:
            raise ClusterUnavailable(reason)
        with self._lock:
            if self._up:
                return self
            check_free(self.iface, self.hosts, self.subnet)
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

    def _create(self):
        self.workdir = tempfile.mkdtemp(prefix="hvdtb-cluster-%s-" % self.iface)
        os.chmod(self.workdir, 0o700)
        self._known_hosts_before = sshd.read_known_hosts()
        sshd.make_keys(self.workdir, self.hosts)
        create_network(self.iface, self.bridge_addr, self.hosts, self.mtu, self.rate, self.delay)
        if sshd.make_privsep_dir():
            self._created_run_sshd = True
        for h in self.hosts:
            self._sshd[h.ns] = sshd.start_sshd(self.workdir, h)
        for h in self.hosts:
            sshd.wait_ssh(self.workdir, h, self._sshd.get(h.ns))
        write_state(self.iface, {
            "n_hosts": self.n_hosts, "rate": self.rate, "delay": self.delay, "iface": self.iface,
            "subnet": str(self.subnet), "mtu": self.mtu, "workdir": self.workdir,
            "created_run_sshd": self._created_run_sshd,
            "known_hosts_before": self._known_hosts_before,
            "sshd_pids": {h.ns: h.sshd_pid for h in self.hosts}, "pid": os.getpid()})

    @classmethod
    def attach(cls, iface="hvd0"):
        """The cluster that ``up`` (another process) left running with this iface."""
        st = read_state(iface)
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
        with cleanup.signals_blocked():
            try:
                errors = cleanup.teardown(self.iface, [h.ns for h in self.hosts], self.workdir,
                                          self._created_run_sshd, self._known_hosts_before,
                                          self.addresses)
            finally:
                self._up = False
                for proc in self._sshd.values():  # reap them
                    try:
                        proc.wait(timeout=5)
                    except subprocess.TimeoutExpired:
                        pass
                self._sshd.clear()
        if errors:
            print("horovod_twobit.cluster: teardown left problems:\n  " + "\n  ".join(errors),
                  file=sys.stderr)

    # ------------------------------------------------------------------ using it
    def env(self, extra=None):
        """Environment for jobs: the ssh wrapper first on PATH, Open MPI allowed to run as root."""
        return jobs.job_env(self.bin_dir, extra)

    def horovodrun_argv(self, np_per_host, command, mpi=False, hosts=None, extra_args=()):
        """The horovodrun command line for ``command`` (a list) on the cluster's hosts."""
        return jobs.horovodrun_argv(jobs.select_hosts(self.hosts, hosts), np_per_host, command,
                                    self.iface, self.key, mpi=mpi, extra_args=extra_args)

    def horovodrun(self, np_per_host, command, mpi=False, hosts=None, timeout=None, env=None,
                   extra_args=(), stream=None):
        """Runs ``horovodrun`` from the root namespace across the hosts (``hosts``: a count of the
        first hosts, a list of indices, or None for all) with ``np_per_host`` slots each. Returns
        a Result (returncode None when it ran past ``timeout`` seconds and was killed). Processes
        it leaves in the namespaces are ended. ``stream``: a file to copy output to as it comes."""
        if not self._up:
            raise ClusterError("the cluster is not up")
        argv = self.horovodrun_argv(np_per_host, command, mpi=mpi, hosts=hosts, extra_args=extra_args)
        return jobs.run_job(argv, self.env(env), timeout, stream, self.kill_stragglers)

    def kill_stragglers(self):
        """Ends every process in the hosts except their sshd listeners."""
        jobs.kill_stragglers(self.hosts)

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
        def start(h, f):
            return self.popen(h.index, argv_for_host(h), stdout=f, stderr=subprocess.STDOUT,
                              stdin=subprocess.DEVNULL, env=self.env(env), text=True,
                              start_new_session=True)

        return jobs.run_on_hosts(jobs.select_hosts(self.hosts, hosts), start, self.workdir, timeout,
                                 stream, self.kill_stragglers)

    def counters(self):
        """{host ns: {"tx": bytes the host sent, "rx": bytes it received}} on its link so far, read
        from the root-side veth (whose rx is the host's tx)."""
        return counters(self.hosts)

    def describe(self):
        lines = ["virtual cluster %s: %d hosts, rate %s%s, bridge %s %s, workdir %s" % (
            self.iface, self.n_hosts, self.rate or "unshaped",
            ", delay %s" % self.delay if self.delay else "", self.iface, self.bridge_addr, self.workdir)]
        for h in self.hosts:
            lines.append("  %-10s %s  (sshd pid %s)" % (h.ns, h.addr, h.sshd_pid))
        return "\n".join(lines)
