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

from horovod_twobit.cluster import capabilities, cleanup, cpu, jobs, sshd
from horovod_twobit.cluster.accounting import counters, parse_rate
from horovod_twobit.cluster.errors import ClusterError, ClusterUnavailable
from horovod_twobit.cluster.hosts import _DELAY, check_free, create_network, dilate, make_hosts
from horovod_twobit.cluster.state import read_state, write_state


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
        cpus_per_host: a hard CPU quota per host in cores (``0.25``), or None for none: each
            host's processes (its sshd and everything started through it, and ``ip netns exec``
            jobs) run in the host's own CPU cgroup with a CFS bandwidth limit (cpu.py).
        dilation: time dilation D (DieCast): the links run at ``rate / D`` with ``delay x D``, so
            that with ``cpus_per_host = c / D`` a host stands for a real one with ``c`` cores and
            the links ``rate`` and ``delay`` describe, everything D times slower. ``rate`` and
            ``delay`` keep meaning the real-world link.
        cpu_period_us: the CFS period of the quota (default 100 ms, the kernel's; lengthened where
            the quota would be under 1 ms).
    """

    def __init__(self, n_hosts=2, rate="1gbit", delay=None, iface="hvd0", subnet="10.77.0.0/24",
                 mtu=1500, cpus_per_host=None, dilation=1.0, cpu_period_us=None):
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
        dilation = float(dilation)
        if not dilation > 0:
            raise ValueError("dilation must be positive, got %r" % (dilation,))
        if cpus_per_host is not None:
            cpu.period_quota(cpus_per_host, cpu_period_us)  # checks both
        self.n_hosts, self.rate, self.delay, self.iface, self.mtu = n_hosts, rate, delay, iface, int(mtu)
        self.cpus_per_host = None if cpus_per_host is None else float(cpus_per_host)
        self.cpu_period_us, self.dilation = cpu_period_us, dilation
        self.cpu = None  # cpu.CpuGroups while up with a quota
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
        reason = capabilities.unavailable_reason()
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
        create_network(self.iface, self.bridge_addr, self.hosts, self.mtu, self.rate, self.delay,
                       self.dilation)
        if self.cpus_per_host is not None:
            self.cpu = cpu.CpuGroups(self.iface, [h.ns for h in self.hosts], self.cpus_per_host,
                                     self.cpu_period_us)
            self.cpu.create()
        if sshd.make_privsep_dir():
            self._created_run_sshd = True
        for h in self.hosts:
            self._sshd[h.ns] = sshd.start_sshd(self.workdir, h, self._wrap)
        for h in self.hosts:
            sshd.wait_ssh(self.workdir, h, self._sshd.get(h.ns))
        write_state(self.iface, {
            "n_hosts": self.n_hosts, "rate": self.rate, "delay": self.delay, "iface": self.iface,
            "subnet": str(self.subnet), "mtu": self.mtu, "workdir": self.workdir,
            "created_run_sshd": self._created_run_sshd,
            "known_hosts_before": self._known_hosts_before,
            "sshd_pids": {h.ns: h.sshd_pid for h in self.hosts}, "pid": os.getpid(),
            "cpus_per_host": self.cpus_per_host, "cpu_period_us": self.cpu_period_us,
            "dilation": self.dilation,
            "cgroup": [self.cpu.version, self.cpu.mount] if self.cpu else None})

    @classmethod
    def attach(cls, iface="hvd0"):
        """The cluster that ``up`` (another process) left running with this iface."""
        st = read_state(iface)
        c = cls(st["n_hosts"], st["rate"], st["delay"], st["iface"], st["subnet"], st["mtu"],
                st.get("cpus_per_host"), st.get("dilation", 1.0), st.get("cpu_period_us"))
        if st.get("cgroup"):
            version, mount = st["cgroup"]
            c.cpu = cpu.CpuGroups(c.iface, [h.ns for h in c.hosts], c.cpus_per_host,
                                  c.cpu_period_us, version, mount)
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
                self.cpu = None
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
    def _wrap(self, h, argv):
        """``argv`` (an ``ip netns exec`` command for host ``h``) joining the host's CPU cgroup
        first, where the cluster has a CPU quota."""
        return self.cpu.wrap(h.index, argv) if self.cpu is not None else list(argv)

    def set_cpus_per_host(self, cpus):
        """Changes every host's CPU quota (cores) of a cluster made with ``cpus_per_host``."""
        if self.cpu is None:
            raise ClusterError("the cluster was made without cpus_per_host: it has no CPU cgroups")
        self.cpu.set_cpus(cpus)
        self.cpus_per_host = self.cpu.cpus

    def cpu_stats(self):
        """{host ns: cpu.CpuGroups.stats} of every host (empty without a CPU quota): its quota,
        and how often and how long it was throttled so far."""
        return {h.ns: self.cpu.stats(h.index) for h in self.hosts} if self.cpu else {}

    @property
    def link_rate(self):
        """The rate and delay the links run at: the real-world ones dilated."""
        return dilate(self.rate, self.delay, self.dilation)

    def env(self, extra=None):
        """Environment for jobs: the ssh wrapper first on PATH, Open MPI allowed to run as root;
        ``HVDTB_CLUSTER_DILATION`` and ``HVDTB_CLUSTER_CPUS_PER_HOST`` say how the hosts are
        emulated (a job divides its times by the dilation for a real host's). Under dilation D,
        Horovod's background cycle (1 ms by default) is D ms unless ``HOROVOD_CYCLE_TIME`` is set:
        a real host's timers run D times slower too."""
        base = {"HVDTB_CLUSTER_DILATION": "%g" % self.dilation,
                "HVDTB_CLUSTER_CPUS_PER_HOST": "%g" % (self.cpus_per_host or 0)}
        if self.dilation != 1 and "HOROVOD_CYCLE_TIME" not in os.environ:
            # timers run slow too: Horovod's 1 ms background cycle of a real host
            base["HOROVOD_CYCLE_TIME"] = "%g" % self.dilation
        return jobs.job_env(self.bin_dir, dict(base, **(extra or {})))

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
        h = self.hosts[host]
        return self._wrap(h, ["ip", "netns", "exec", h.ns] + [str(a) for a in argv])

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
        if self.dilation != 1:
            rate, delay = self.link_rate
            lines.append("  time dilation %g: links run at %s%s (real-world time = measured / %g)"
                         % (self.dilation, rate or "unshaped",
                            ", delay %s" % delay if delay else "", self.dilation))
        if self.cpu is not None:
            lines.append("  CPU quota %g cores per host (cgroup v%d, %d us per %d us, %s)"
                         % (self.cpus_per_host, self.cpu.version, self.cpu.quota_us,
                            self.cpu.period_us, self.cpu.parent))
        stats = {}
        try:
            stats = self.cpu_stats()
        except OSError:
            pass
        for h in self.hosts:
            s = stats.get(h.ns)
            cpu_text = "" if s is None else (
                ", quota %s cores, throttled %.2f s in %d of %d periods%s" % (
                    "%g" % s["cpus"] if s["cpus"] is not None else "none", s["throttled_s"],
                    s["nr_throttled"], s["nr_periods"],
                    ", used %.2f s" % s["usage_s"] if s["usage_s"] is not None else ""))
            lines.append("  %-10s %s  (sshd pid %s%s)" % (h.ns, h.addr, h.sshd_pid, cpu_text))
        return "\n".join(lines)
