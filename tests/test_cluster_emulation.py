"""The virtual cluster's emulation of real hosts: a hard CPU quota per host (its own CPU cgroup with
a CFS bandwidth limit, cgroup v1 or v2) and time dilation (links at rate / D, delays x D), and the
checks that they do what they claim:

(a) a fixed CPU-bound task in a host at 0.25 cores, while every other host is busy too, takes 4x
    its time at 1 core;
(b) a bulk TCP transfer between two hosts at rate R and dilation 4 takes 4x as long as at R;
(c) end to end: bench_cluster's jobs give the same real-host-equivalent steps, and the same
    ranking of methods, at two emulations of the same real-world cluster.
"""

import json
import os
import subprocess
import sys
import time

import pytest

from horovod_twobit import cluster
from horovod_twobit.cluster import cpu
from horovod_twobit.cluster.hosts import dilate

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, REPO)
from examples import bench_cluster  # noqa: E402
WORKER = os.path.join(HERE, "workers", "cluster_emulation.py")
REASON = cluster.unavailable_reason()
if REASON is None and not cpu.backends():
    CPU_REASON = "no CPU cgroup hierarchy with CFS bandwidth control (cgroup v1 cpu or v2 cpu.max)"
else:
    CPU_REASON = REASON
needs_cluster = pytest.mark.skipif(REASON is not None, reason="virtual cluster unavailable: %s"
                                   % REASON)
needs_cpu = pytest.mark.skipif(CPU_REASON is not None, reason="CPU quota unavailable: %s"
                               % CPU_REASON)
# not hvd0 / hvdtest, so that a benchmark or the other cluster tests running beside are no clash
SUBNET = "10.77.5.0/24"


# ---------------------------------------------------------------------- without root
def test_quota_is_period_times_cores():
    assert cpu.period_quota(0.25) == (100000, 25000)
    assert cpu.period_quota(1) == (100000, 100000)
    assert cpu.period_quota(2.5, 20000) == (20000, 50000)
    # under 1 ms the period stretches (Mininet's rule): 1 ms per 200 ms
    assert cpu.period_quota(0.005) == (200000, 1000)
    assert cpu.period_quota(0.05, 10000) == (20000, 1000)
    for bad in (0, -1, float("nan")):
        with pytest.raises(ValueError, match="positive"):
            cpu.period_quota(bad)
    with pytest.raises(ValueError, match="below what CFS"):
        cpu.period_quota(0.0001)
    with pytest.raises(ValueError, match="period"):
        cpu.period_quota(0.5, 500)


def test_dilation_divides_rates_and_multiplies_delays():
    assert dilate("1gbit", "5ms", 4) == ("250000000bit", "20000us")
    assert dilate("100mbit", None, 2.5) == ("40000000bit", None)
    assert dilate("12.5mbps", "200us", 2) == ("50000000bit", "400us")
    assert dilate(None, "1s", 3) == (None, "3000000us")
    assert dilate("1gbit", "5ms", 1) == ("1gbit", "5ms")
    with pytest.raises(ValueError, match="positive"):
        cluster.VirtualCluster(2, dilation=0)
    with pytest.raises(ValueError, match="positive"):
        cluster.VirtualCluster(2, cpus_per_host=0)


def _fake_hierarchy(tmp_path, version):
    """A directory laid out like a cgroup mount (plain files: what the code writes stays there)."""
    root = tmp_path / ("v%d" % version)
    root.mkdir()
    if version == 2:
        (root / "cgroup.subtree_control").write_text("memory\n")
    return str(root)


@pytest.mark.parametrize("version", [1, 2])
def test_cgroup_files_of_both_versions(tmp_path, version, monkeypatch):
    root = _fake_hierarchy(tmp_path, version)
    monkeypatch.setattr(cpu, "backends", lambda: [(version, root)])
    g = cpu.CpuGroups("hvdx", ["hvdx-h0", "hvdx-h1"], 0.25).create()
    assert (g.version, g.mount) == (version, root)
    for i in range(2):
        d = os.path.join(root, "hvdtb-hvdx", "hvdx-h%d" % i)
        assert g.procs_file(i) == os.path.join(d, "cgroup.procs")
        if version == 2:
            assert open(os.path.join(d, "cpu.max")).read() == "25000 100000"
            with open(os.path.join(d, "cpu.stat"), "w") as f:
                f.write("usage_usec 3000000\nnr_periods 40\nnr_throttled 30\n"
                        "throttled_usec 9000000\n")
        else:
            assert open(os.path.join(d, "cpu.cfs_quota_us")).read() == "25000"
            assert open(os.path.join(d, "cpu.cfs_period_us")).read() == "100000"
            with open(os.path.join(d, "cpu.stat"), "w") as f:
                f.write("nr_periods 40\nnr_throttled 30\nthrottled_time 9000000000\n")
    weight = open(os.path.join(root, "hvdtb-hvdx", "cpu.weight" if version == 2 else "cpu.shares"))
    assert weight.read() == ("10000" if version == 2 else "262144")  # the largest weight
    if version == 2:  # the controller is handed down to the cluster's groups
        assert open(os.path.join(root, "cgroup.subtree_control")).read() == "+cpu"
        assert open(os.path.join(root, "hvdtb-hvdx", "cgroup.subtree_control")).read() == "+cpu"
    s = g.stats(1)
    assert s["cpus"] == 0.25 and s["nr_throttled"] == 30 and s["throttled_s"] == 9.0
    assert s["usage_s"] == (3.0 if version == 2 else None)
    g.set_cpus(0.004)
    assert (g.period_us, g.quota_us) == (250000, 1000)
    assert g.stats(0)["cpus"] == 0.004
    # a process joins the group before it execs the command, keeping its pid
    argv = g.wrap(1, ["ip", "netns", "exec", "hvdx-h1", "sleep", "1"])
    assert argv[:3] == ["/bin/sh", "-c", 'echo $$ > "$0" && exec "$@"']
    assert argv[3] == g.procs_file(1) and argv[4:] == ["ip", "netns", "exec", "hvdx-h1", "sleep", "1"]


def test_no_cpu_cgroup_says_what_is_missing(tmp_path, monkeypatch):
    monkeypatch.setattr(cpu, "backends", lambda: [])
    with pytest.raises(cluster.ClusterError, match=r"cpu\.cfs_quota_us.*cpu\.max.*no cgroup2 mount"):
        cpu.CpuGroups("hvdx", ["hvdx-h0"], 0.5).create()
    missing = str(tmp_path / "not-mounted")  # mkdir fails there: what failed is named
    monkeypatch.setattr(cpu, "backends", lambda: [(1, missing)])
    with pytest.raises(cluster.ClusterError, match="cgroup v1 at %s: .*No such file" % missing):
        cpu.CpuGroups("hvdx", ["hvdx-h0"], 0.5).create()


# ---------------------------------------------------------------------- on the machine
def _per_host(res):
    """{host index: the JSON line its worker printed}."""
    out = {}
    for line in res.output.splitlines():
        ns, _, rest = line.partition("] ")
        if rest.startswith("{"):
            out[int(ns.rsplit("-h", 1)[1])] = json.loads(rest)
    return out


@needs_cpu
@pytest.mark.slow
@pytest.mark.timeout(180)
def test_every_process_of_a_host_is_in_its_cpu_group_and_goes_with_it():
    iface = "hvdtq"
    with pytest.raises(RuntimeError, match="boom"):
        with cluster.VirtualCluster(2, "1gbit", iface=iface, subnet=SUBNET, cpus_per_host=0.5,
                                    dilation=2) as c:
            group = os.path.join(c.cpu.mount, "hvdtb-%s" % iface)
            for h in c.hosts:
                assert h.sshd_pid in c.cpu.pids(h.index)  # sshd, hence what it starts
            # through ssh (as horovodrun starts workers) and through ip netns exec
            p = subprocess.run(["ssh", c.hosts[1].addr, "cat /proc/self/cgroup"], env=c.env(),
                               capture_output=True, text=True, timeout=60)
            assert p.returncode == 0, p.stderr
            assert "/hvdtb-%s/%s-h1\n" % (iface, iface) in p.stdout, p.stdout
            p = subprocess.run(c.exec_argv(0, ["cat", "/proc/self/cgroup"]), capture_output=True,
                               text=True, timeout=60)
            assert "/hvdtb-%s/%s-h0\n" % (iface, iface) in p.stdout, p.stdout
            text = c.describe()
            assert "links run at 500000000bit" in text and "CPU quota 0.5 cores" in text, text
            assert text.count("quota 0.5 cores, throttled") == 2, text
            # the links run at rate / D, bucket and queue as the real link's
            qd = subprocess.run(["tc", "qdisc", "show", "dev", c.hosts[0].root_veth],
                                capture_output=True, text=True).stdout
            assert "rate 500Mbit" in qd and "lat 200ms" in qd, qd
            # jobs know the emulation; Horovod's 1 ms cycle runs D times slower too
            env = c.env()
            assert env["HVDTB_CLUSTER_DILATION"] == "2" and env["HVDTB_CLUSTER_CPUS_PER_HOST"] == "0.5"
            assert env["HOROVOD_CYCLE_TIME"] == os.environ.get("HOROVOD_CYCLE_TIME", "2")
            # a job's stray process is ended with the cluster, also where it left the netns
            stray = subprocess.Popen(c.cpu.wrap(1, ["sleep", "300"]))
            raise RuntimeError("boom")
    stray.wait(timeout=20)
    assert not os.path.exists(group) and cpu.leftovers(iface) == []


@needs_cpu
@pytest.mark.slow
@pytest.mark.timeout(180)
def test_cli_status_shows_quota_and_down_removes_leftover_groups():
    iface, env = "hvdtq", dict(os.environ, PYTHONPATH=REPO)

    def cli(*a):
        return subprocess.run([sys.executable, "-m", "horovod_twobit.cluster"] + list(a) +
                              ["--iface", iface], capture_output=True, text=True, timeout=120,
                              env=env, cwd=REPO)

    try:
        p = cli("up", "--hosts", "2", "--rate", "100mbit", "--subnet", SUBNET,
                "--cpus-per-host", "0.25", "--dilation", "4")
        assert p.returncode == 0, p.stdout + p.stderr
        p = cli("status")
        assert p.returncode == 0, p.stderr
        for want in ("time dilation 4: links run at 25000000bit", "CPU quota 0.25 cores per host",
                     "%s-h1" % iface):
            assert want in p.stdout, p.stdout
        assert p.stdout.count("quota 0.25 cores, throttled ") == 2, p.stdout
        # a crash leaves the groups behind (here: made by hand, with a process in one)
        p = cli("down")
        assert p.returncode == 0 and cpu.leftovers(iface) == [], p.stdout + p.stderr
        version, mount = cpu.backends()[0]
        g = cpu.CpuGroups(iface, ["%s-h0" % iface], 0.5, version=version, mount=mount)
        g._create()
        stray = subprocess.Popen(g.wrap(0, ["sleep", "300"]))
        deadline = time.time() + 10
        while stray.pid not in g.pids(0) and time.time() < deadline:
            time.sleep(0.05)
        p = cli("down")
        assert p.returncode == 0, p.stdout + p.stderr
        assert "hvdtb-%s" % iface in p.stdout, p.stdout
        assert stray.wait(timeout=20) == -9
        assert cpu.leftovers(iface) == []
    finally:
        cli("down")


def _spin(c, n, q):
    """Host 0 spins n iterations at q cores while every other host spins longer; (wall, cpu)."""
    c.set_cpus_per_host(q)
    res = c.run_on_hosts(lambda h: [sys.executable, WORKER, "spin", n if h.index == 0 else n * 13 // 10],
                         timeout=300)
    assert res.returncode == 0, res
    r = _per_host(res)[0]
    return r["wall"], r["cpu"]


@needs_cpu
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_validation_a_cpu_quota_slows_a_busy_host_by_its_fraction():
    """(a) 2 hosts (this machine's 2 cores at 1 core per host), all spinning: host 0's fixed task
    takes 4x as long at 0.25 cores as at 1 core (+-10%). Each host gets its quota however busy the
    machine is (1 s of CPU per s at 1 core, 0.25 at 0.25 cores); what other load can still change
    is the speed of the cores themselves (a VM's cores slow down when their neighbours work).
    So every attempt asserts the quota in a form the cores' speed cannot move, the wall time per
    CPU second (at most 1.1 at 1 core, 4 +-10 % at 0.25 cores), and an attempt whose task took the same CPU
    time in both runs (within 5 %) also asserts the task's own wall-time ratio; one whose CPU time
    moved is repeated, up to four attempts, for that second check."""
    attempts = []
    with cluster.VirtualCluster(2, None, iface="hvdtq", subnet=SUBNET, cpus_per_host=1) as c:
        n = 3_000_000
        wall, cpu_s = _spin(c, n, 1)
        n = int(n * 0.8 / max(cpu_s, 1e-3))  # about 0.8 s of CPU
        for _ in range(4):
            w1, c1 = _spin(c, n, 1)
            w4, c4 = _spin(c, n, 0.25)
            attempts.append("1 core: wall %.3f s, CPU %.3f s; 0.25 cores: wall %.3f s, CPU %.3f s; "
                            "ratio %.3f (load %.1f)" % (w1, c1, w4, c4, w4 / w1, os.getloadavg()[0]))
            # every host gets its quota, however busy the machine is and whatever its cores' speed
            assert w1 / c1 < 1.1 and 3.6 < w4 / c4 < 4.4, attempts
            if 0.95 < c4 / c1 < 1.05:  # the cores ran at one speed: the task itself took 4x
                assert 3.6 < w4 / w1 < 4.4, attempts
                break
    print("\n".join(attempts))


def _transfer(rate, dilation, nbytes, cpus=None):
    with cluster.VirtualCluster(2, rate, iface="hvdtq", subnet=SUBNET, dilation=dilation,
                                cpus_per_host=cpus) as c:
        res = c.run_on_hosts(lambda h: [sys.executable, WORKER, "recv", 5001, nbytes] if h.index
                             else [sys.executable, WORKER, "send", c.hosts[1].addr, 5001, nbytes],
                             timeout=120)
        assert res.returncode == 0, res
        r = _per_host(res)
        assert r[1]["bytes"] == nbytes
        return r[0]["wall"]


@needs_cluster
@pytest.mark.slow
@pytest.mark.timeout(180)
def test_validation_b_dilation_stretches_a_transfer_by_its_factor():
    """(b) 12.5 MB from host 0 to host 1 at 100 Mbit/s: 1 s; at dilation 4, 4 s (+-10%)."""
    nbytes = 12_500_000
    t1 = _transfer("100mbit", 1, nbytes)
    t4 = _transfer("100mbit", 4, nbytes)
    print("100mbit: %.3f s; dilation 4: %.3f s; ratio %.3f" % (t1, t4, t4 / t1))
    assert 0.9 < t1 / (nbytes * 8 / 100e6) < 1.2, t1  # the link's rate, headers included
    assert 3.6 < t4 / t1 < 4.4, (t1, t4)


# (c): 2 hosts at 1 Gbit/s, the 21 M-value MLP; two emulations of the same real-world cluster that
# both leave this machine's cores headroom (their quotas add up to 1 and 0.5 of its 2 cores)
E2E_EMULATIONS = ((0.5, 2.0), (0.25, 4.0))
E2E_METHODS = ("none", "twobit", "auto")  # about 3 : 1 : 1.6 in real-host step
E2E_RATE = "1gbit"


def _bench(args, cpus, dilation):
    """bench_cluster's job (its Horovod methods taking turns step by step in one job) on a fresh
    2-host cluster at ``cpus`` cores per host and dilation ``dilation``: {method: its row}."""
    with cluster.VirtualCluster(2, E2E_RATE, iface="hvdtq", subnet=SUBNET, cpus_per_host=cpus,
                                dilation=dilation, cpu_period_us=args.cpu_period_us) as c:
        with open(os.path.join(args.work, "bench_cluster.log"), "a") as log:
            rows = bench_cluster.run_job(c, args, "mlp", list(E2E_METHODS), E2E_RATE, log)
    failed = [r for r in rows if r["failed"]]
    assert not failed, failed[0]["error"]
    return {r["method"]: r for r in rows}


def _e2e_figures(runs):
    return "; ".join("Q=%g,D=%g: %s" % (q, d, ", ".join(
        "%s %.3f s real-host (measured %.3f, CPU %.3f s/step)" % (
            m, r[m]["real_step_s"], r[m]["median_step_s"], r[m]["cpu_step_s"])
        for m in E2E_METHODS)) for (q, d), r in runs)


def _listed(figures):
    return ", ".join("%s %.3f" % (m, figures[m]) for m in E2E_METHODS)


def _ranked_apart(x, y, tolerance):
    """The pairs of methods that ``x`` and ``y`` order oppositely, where one of them has the
    two more than ``tolerance`` apart (closer pairs are ties at the steps' noise)."""
    return [(m1, m2) for m1 in x for m2 in x if x[m1] < x[m2] and y[m1] > y[m2]
            and (x[m2] > (1 + tolerance) * x[m1] or y[m1] > (1 + tolerance) * y[m2])]


def test_the_ranking_compares_only_pairs_apart():
    """What (c) asserts of the ranking: ties are not ranks, a swapped pair far apart is."""
    assert _ranked_apart({"x": 0.25, "y": 0.32}, {"x": 0.41, "y": 0.34}, 0.5) == []
    assert _ranked_apart({"x": 0.25, "y": 0.82}, {"x": 0.83, "y": 0.41}, 0.5) == [("x", "y")]
    assert _ranked_apart({"x": 0.2, "y": 0.3}, {"x": 0.31, "y": 0.29}, 0.15) == [("x", "y")]
    assert _ranked_apart({"x": 0.2, "y": 0.3}, {"x": 0.2, "y": 0.3}, 0.15) == []


@needs_cpu
@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_validation_c_two_emulations_give_the_same_real_host_steps(tmp_path):
    """(c) bench_cluster's MLP job (no compression, TwoBit and "auto", taking turns step by step)
    on 2 hosts at 1 Gbit/s, at (Q=0.5, D=2) and at (Q=0.25, D=4). No compression's step, which is
    its bytes on the dilated link, gives the same real-host step within 15 % in both, and the
    methods rank the same wherever their steps are more than 1.5x apart (no compression against
    the 2-bit methods, about 3x at this link). Asserted every time: no host's CPU per step exceeds
    its quota over the step's wall time, and no step is shorter in real-host time than its bytes
    take on the real-world link.

    The compressed methods' steps are CPU-bound, and what a step's CPU costs is what the
    emulation does not control (docs/emulation.md, Limits): TwoBit's CPU per step was 1.0-2.1x
    as much at a quarter core as at half a core (1.7x in one attempt and 1.0x in the next on a
    quiet machine, 1.1-1.9x in all five of a CI run's, most of it system time, its page faults the
    same in number), and its wall time beyond that CPU stretched too (at one CPU cost its step
    was still 1.22x). Their ratios are printed with the figures, not asserted: an earlier gate
    that repeated attempts until the CPU per step matched failed a CI run five times out of five.
    Five timed steps per method leave the medians some noise: an attempt that misses is repeated
    once (the two emulations take turns at running first), and a second miss fails the test with
    the figures. One attempt takes about 115 s on a quiet 2-core machine. (Q=1, D=1), the literal
    reference, is not one of the two: two 1-core hosts fill this machine's 2 cores, which then
    run slower per CPU second (docs/emulation.md, (c))."""
    args = bench_cluster.parser().parse_args(["--hosts", "2", "--steps", "5", "--warmup", "1"])
    args.work = str(tmp_path)
    rate_bps = 1e9
    attempts = []
    for attempt in range(2):
        # the two take turns at going first: a load that rises or falls falls on both alike
        order = E2E_EMULATIONS[::-1] if attempt % 2 else E2E_EMULATIONS
        runs = [((q, d), _bench(args, q, d)) for q, d in order]
        a, b = (dict(runs)[e] for e in E2E_EMULATIONS)
        real = [{m: r[m]["real_step_s"] for m in E2E_METHODS} for r in (a, b)]
        ratios = {m: real[1][m] / real[0][m] for m in E2E_METHODS}
        attempts.append("%s; real-host step ratios %s; CPU per step ratios %s (load %.1f)" % (
            _e2e_figures(runs), _listed(ratios),
            _listed({m: b[m]["cpu_step_s"] / a[m]["cpu_step_s"] for m in E2E_METHODS}),
            os.getloadavg()[0]))
        for (q, d), r in runs:  # what the emulation controls, every time
            for m in E2E_METHODS:
                assert r[m]["quota_from"] == "measured"
                assert r[m]["cpu_step_s"] <= 1.1 * q * r[m]["median_step_s"], attempts
                assert r[m]["real_step_s"] >= 0.9 * r[m]["bytes_per_step"] * 8 / rate_bps, attempts
        assert real[0]["none"] > 1.5 * max(real[0]["twobit"], real[0]["auto"]), attempts
        if abs(ratios["none"] - 1) <= 0.15 and not _ranked_apart(real[0], real[1], 0.5):
            break
    else:
        pytest.fail("\n".join(attempts))
    print("\n".join(attempts))
