"""A CPU quota per host: every host's processes (its sshd and everything started through it, and
``ip netns exec`` jobs) run in the host's own CPU cgroup with a hard CFS bandwidth limit of
``cpus`` cores, as Mininet-HiFi's CPULimitedHost does: ``quota = period x cpus`` in every
``period``; where the quota would fall under the kernel's 1 ms minimum the period is lengthened.

Both cgroup versions:

* v1: the ``cpu`` controller's hierarchy (``/sys/fs/cgroup/cpu``): ``cpu.cfs_period_us``,
  ``cpu.cfs_quota_us``; ``cpu.stat`` has ``nr_periods``, ``nr_throttled``, ``throttled_time`` (ns);
* v2: a cgroup2 mount whose ``cgroup.controllers`` lists ``cpu``: ``cpu.max`` ("quota period"),
  ``cpu.stat`` with ``usage_usec``, ``nr_throttled``, ``throttled_usec``.

Layout: ``<mount>/hvdtb-<iface>/<iface>-h<i>`` (the namespaces' names), one parent per cluster, so
that clusters with different ifaces never share a group and ``down`` finds what a crashed cluster
left. The parent has the largest CPU weight, so that the hosts reach their quotas while other
processes load the machine (the quotas, adding up to less than its cores, still cap them).
A process joins its host's group before it execs ``ip netns exec`` (``wrap``), so that it
and all it starts stay there (children inherit their parent's cgroup).
"""

import errno
import math
import os
import signal
import time

from horovod_twobit.cluster.errors import ClusterError

V1_MOUNT = "/sys/fs/cgroup/cpu"
DEFAULT_PERIOD_US = 100000  # the kernel's and Mininet's default
MIN_QUOTA_US = 1000  # the kernel refuses a smaller quota
MAX_PERIOD_US = 1000000
# The cluster's parent group gets the largest CPU weight: CFS shares a machine between the groups
# at one level, so with the default weight all hosts together would weigh as much as any one
# other process on the machine and fall short of their quotas when it is busy. The quotas still
# cap what the hosts take.
WEIGHT = {1: ("cpu.shares", "262144"), 2: ("cpu.weight", "10000")}


def _mounts():
    """[(mount point, fstype, options)] of the cgroup mounts, from /proc/self/mounts."""
    out = []
    try:
        with open("/proc/self/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 4 and parts[2] in ("cgroup", "cgroup2"):
                    out.append((parts[1].replace("\\040", " "), parts[2], parts[3].split(",")))
    except OSError:
        pass
    return out


def _read(path):
    with open(path) as f:
        return f.read()


def _write(path, text):
    with open(path, "w") as f:
        f.write(text)


def backends():
    """[(version, mount point)] of the hierarchies where a CPU bandwidth limit can be set: cgroup2
    mounts that offer the ``cpu`` controller first, then the v1 ``cpu`` hierarchy."""
    v2, v1 = [], []
    for mnt, fstype, opts in _mounts():
        if fstype == "cgroup2":
            try:
                if "cpu" in _read(os.path.join(mnt, "cgroup.controllers")).split():
                    v2.append((2, mnt))
            except OSError:
                pass
        elif "cpu" in opts and os.path.exists(os.path.join(mnt, "cpu.cfs_quota_us")):
            v1.append((1, mnt))
    return v2 + v1


def period_quota(cpus, period_us=None):
    """(period, quota) in microseconds for a limit of ``cpus`` cores: quota = period x cpus, with
    the period lengthened (up to 1 s) where the quota would be under 1 ms."""
    cpus = float(cpus)
    if not cpus > 0:
        raise ValueError("cpus per host must be positive, got %r" % (cpus,))
    period = int(period_us or DEFAULT_PERIOD_US)
    if not MIN_QUOTA_US <= period <= MAX_PERIOD_US:
        raise ValueError("the CPU period must be 1000..1000000 us, got %r" % (period_us,))
    if period * cpus < MIN_QUOTA_US:
        period = min(MAX_PERIOD_US, int(math.ceil(MIN_QUOTA_US / cpus)))
    quota = int(round(period * cpus))
    if quota < MIN_QUOTA_US:
        raise ValueError("%g cores per host is below what CFS can limit to (1 ms per 1 s period)"
                         % cpus)
    return period, quota


def _group_dir(mount, iface):
    return os.path.join(mount, "hvdtb-%s" % iface)


def _unavailable(details):
    return ClusterError(
        "--cpus-per-host needs a writable CPU cgroup with CFS bandwidth control, either cgroup v1's "
        "cpu controller (%s/cpu.cfs_quota_us) or a cgroup v2 mount offering the cpu controller "
        "(cgroup.controllers listing cpu, cpu.max): %s. As root, mount one (e.g. `mount -t cgroup "
        "-o cpu cgroup %s`) or run without --cpus-per-host" % (V1_MOUNT, details, V1_MOUNT))


class CpuGroups:
    """The hosts' CPU cgroups of one cluster. ``create()`` makes them; ``remove()`` ends what is
    left in them and removes them. Built with ``version``/``mount`` (from a state file) it uses
    those instead of looking for a hierarchy."""

    def __init__(self, iface, names, cpus, period_us=None, version=None, mount=None):
        self.iface, self.names = iface, list(names)
        self.cpus = float(cpus)
        self.period_us, self.quota_us = period_quota(cpus, period_us)
        self.version, self.mount = version, mount

    @property
    def parent(self):
        return _group_dir(self.mount, self.iface)

    def path(self, i):
        return os.path.join(self.parent, self.names[i])

    def procs_file(self, i):
        return os.path.join(self.path(i), "cgroup.procs")

    def wrap(self, i, argv):
        """``argv`` run by a shell that first moves itself into host ``i``'s group, then execs
        ``argv`` (same pid)."""
        return ["/bin/sh", "-c", 'echo $$ > "$0" && exec "$@"', self.procs_file(i)] + list(argv)

    def create(self):
        """Makes the groups in the first hierarchy that takes them; raises ClusterError saying what
        is missing where none does."""
        found = backends()
        if not found:
            raise _unavailable("there is no cgroup v1 cpu hierarchy and no cgroup2 mount with the cpu "
                               "controller (/proc/self/mounts)")
        problems = []
        for version, mount in found:
            self.version, self.mount = version, mount
            try:
                self._create()
                return self
            except OSError as e:
                problems.append("cgroup v%d at %s: %s" % (version, mount, e))
                self.remove()
        self.version = self.mount = None
        raise _unavailable("; ".join(problems))

    def _create(self):
        if os.path.exists(self.parent):  # no bridge of this name is up (check_free): a leftover
            errors = remove_groups(self.iface, [(self.version, self.mount)])
            if errors:
                raise ClusterError("cannot remove the leftover CPU cgroup %s: %s"
                                   % (self.parent, "; ".join(errors)))
        if self.version == 2:
            # controllers reach a group only through every ancestor's subtree_control
            ctl = os.path.join(self.mount, "cgroup.subtree_control")
            if "cpu" not in _read(ctl).split():
                _write(ctl, "+cpu")
        os.mkdir(self.parent)
        if self.version == 2:
            _write(os.path.join(self.parent, "cgroup.subtree_control"), "+cpu")
        name, value = WEIGHT[self.version]
        _write(os.path.join(self.parent, name), value)
        for i in range(len(self.names)):
            os.mkdir(self.path(i))
        self.set_cpus(self.cpus)

    def set_cpus(self, cpus, period_us=None):
        """Sets every host's quota to ``cpus`` cores (the period as in ``period_quota``)."""
        period, quota = period_quota(cpus, period_us or self.period_us)
        for i in range(len(self.names)):
            if self.version == 2:
                _write(os.path.join(self.path(i), "cpu.max"), "%d %d" % (quota, period))
            else:  # v1 checks quota against period on every write: lift the quota first
                _write(os.path.join(self.path(i), "cpu.cfs_quota_us"), "-1")
                _write(os.path.join(self.path(i), "cpu.cfs_period_us"), str(period))
                _write(os.path.join(self.path(i), "cpu.cfs_quota_us"), str(quota))
        self.cpus, self.period_us, self.quota_us = float(cpus), period, quota

    def stats(self, i):
        """Host ``i``'s group: {"cpus", "period_us", "quota_us", "nr_periods", "nr_throttled",
        "throttled_s", "usage_s" (None where the hierarchy does not count it)}."""
        d = self.path(i)
        kv = {}
        for line in _read(os.path.join(d, "cpu.stat")).splitlines():
            k, _, v = line.partition(" ")
            if v.strip().lstrip("-").isdigit():
                kv[k] = int(v)
        if self.version == 2:
            q, p = _read(os.path.join(d, "cpu.max")).split()
            quota, period = (None if q == "max" else int(q)), int(p)
            throttled = kv.get("throttled_usec", 0) / 1e6
            usage = kv["usage_usec"] / 1e6 if "usage_usec" in kv else None
        else:
            quota = int(_read(os.path.join(d, "cpu.cfs_quota_us")))
            period = int(_read(os.path.join(d, "cpu.cfs_period_us")))
            quota = None if quota < 0 else quota
            throttled = kv.get("throttled_time", 0) / 1e9
            usage = None
            acct = os.path.join(d, "cpuacct.usage")  # where cpuacct is mounted with cpu
            if os.path.exists(acct):
                usage = int(_read(acct)) / 1e9
        return {"cpus": None if quota is None else quota / period, "period_us": period,
                "quota_us": quota, "nr_periods": kv.get("nr_periods", 0),
                "nr_throttled": kv.get("nr_throttled", 0), "throttled_s": throttled,
                "usage_s": usage}

    def pids(self, i):
        try:
            return [int(p) for p in _read(self.procs_file(i)).split()]
        except OSError:
            return []

    def remove(self):
        """Ends what is left in the groups and removes them; returns a list of problems."""
        if self.mount is None:
            return []
        return remove_groups(self.iface, [(self.version, self.mount)])


def _kill_and_rmdir(d, deadline):
    """SIGKILLs every process in the group ``d`` and removes it once they are gone."""
    procs = os.path.join(d, "cgroup.procs")
    while True:
        try:
            pids = [int(p) for p in _read(procs).split()]
        except OSError:
            pids = []
        for p in pids:
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            os.rmdir(d)
            return None
        except FileNotFoundError:
            return None
        except OSError as e:
            if e.errno != errno.EBUSY or time.time() > deadline:
                return "%s: %s (pids %s)" % (d, e, pids)
        time.sleep(0.05)


def remove_groups(iface, where=None, timeout=10.0):
    """Removes ``hvdtb-<iface>`` and its hosts' groups from every CPU hierarchy (``where``: [(version,
    mount)], default all found), SIGKILLing what still runs in them; returns a list of problems.
    Nothing to do is no problem: teardown calls it for every cluster and for leftovers."""
    errors = []
    deadline = time.time() + timeout
    for _, mount in (backends() if where is None else where):
        parent = _group_dir(mount, iface)
        if not os.path.isdir(parent):
            continue
        for name in sorted(os.listdir(parent)):
            d = os.path.join(parent, name)
            if os.path.isdir(d):
                err = _kill_and_rmdir(d, deadline)
                if err:
                    errors.append(err)
        err = _kill_and_rmdir(parent, deadline)
        if err:
            errors.append(err)
    return errors


def leftovers(iface):
    """The ``hvdtb-<iface>`` groups that exist in any CPU hierarchy."""
    return [_group_dir(m, iface) for _, m in backends() if os.path.isdir(_group_dir(m, iface))]
