"""Real multi-host horovodrun jobs on a virtual cluster (network namespaces on a bridge, shaped
links, one sshd per host): training with TwoBitCompressor over Gloo and MPI matches the NumPy
N-worker simulation, and the bytes the hosts put on the wire are what the 2-bit format predicts."""

import glob
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time

import numpy as np
import pytest

import jobs
import sim
from horovod_twobit.wire import layout
from horovod_twobit import cluster, wire
from horovod_twobit import reference as ref
from horovod_twobit.wire import scatter as sw

REASON = cluster.unavailable_reason()
pytestmark = [pytest.mark.skipif(REASON is not None, reason="virtual cluster unavailable: %s" % REASON),
              pytest.mark.slow]

# Not hvd0 / 10.77.0.0/24, so that a benchmark or `cluster up` running beside the tests is no clash.
IFACE, SUBNET = "hvdtest", "10.77.1.0/24"
REPO = os.path.dirname(jobs.HERE)


def job_env(**extra):
    env = {"PYTHONPATH": os.pathsep.join([REPO, jobs.HERE]), "OMP_NUM_THREADS": "1",
           "TF_CPP_MIN_LOG_LEVEL": "3", "HOROVOD_STALL_CHECK_TIME_SECONDS": "10",
           "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "60"}
    env.update(extra)
    return env


@pytest.fixture(scope="module")
def vc():
    with cluster.VirtualCluster(n_hosts=4, rate="1gbit", iface=IFACE, subnet=SUBNET) as c:
        yield c


def _run(c, hosts, script, *args, mpi=False, timeout=200, env=None):
    before = c.counters()
    res = c.horovodrun(1, [sys.executable, os.path.join(jobs.WORKERS, script)] + [str(a) for a in args],
                       hosts=hosts, mpi=mpi, timeout=timeout, env=job_env(**(env or {})))
    if res.returncode != 0:
        pytest.fail("%s on %d hosts failed: %r" % (script, hosts, res))
    after = c.counters()
    sent = [after[h.ns]["tx"] - before[h.ns]["tx"] for h in c.hosts]
    return res, sent


def _check_train(c, tmp_path, hosts, mpi=False):
    steps = 12
    res, sent = _run(c, hosts, "torch_train.py", tmp_path, "--steps %d --threshold 0.5" % steps,
                     mpi=mpi)
    ranks = sim.load_ranks(str(tmp_path / "0"), hosts)
    assert [str(r["controller"]) for r in ranks] == ["mpi" if mpi else "gloo"] * hosts
    sim.check_training(ranks, 0.5, steps)  # aggregated grads = simulation's; weights identical
    want = sum(np.arange(10, dtype=np.float32) * (r + 1) + np.float32(0.001) for r in range(hosts))
    for r in ranks:
        np.testing.assert_allclose(r["plain"], want, rtol=1e-6)  # summed in Gloo's order
    # every rank ran in its own host: each used host's link carried the job, the others' did not
    assert all(s > 2000 for s in sent[:hosts]), sent
    assert all(s < 2000 for s in sent[hosts:]), sent
    return res


@pytest.mark.timeout(240)
def test_gloo_two_hosts_training_matches_simulation(vc, tmp_path):
    _check_train(vc, tmp_path, 2)


@pytest.mark.timeout(300)
def test_gloo_four_hosts_training_matches_simulation(vc, tmp_path):
    _check_train(vc, tmp_path, 4)


@pytest.mark.timeout(240)
def test_mpi_two_hosts_training_matches_simulation(vc, tmp_path):
    _check_train(vc, tmp_path, 2, mpi=True)  # the ranks say they ran on MPI


def _bytes_job(c, tmp_path, hosts, compressions, mpi=False, features=2048, steps=5):
    # A slow coordination cycle keeps Horovod's idle control traffic (hundreds of KB/s at the
    # default cycle time) out of the measurement; what is left on the wire is the payload.
    _run(c, hosts, "cluster_bytes.py", "--out", tmp_path, "--compression", ",".join(compressions),
         "--features", features, "--steps", steps, "--iface", IFACE, mpi=mpi,
         env={"HOROVOD_CYCLE_TIME": "50"})
    files = sorted(glob.glob(os.path.join(str(tmp_path), "rank*.json")))
    assert len(files) == hosts, files
    return [json.load(open(f)) for f in files]


@pytest.mark.timeout(300)
def test_bytes_on_the_wire_match_the_format(vc, tmp_path):
    n = 2
    ranks = _bytes_job(vc, tmp_path, n, ["twobit", "none"])
    numels = ranks[0]["twobit"]["numels"]
    assert sum(numels) > 4_000_000
    # Gloo's allgather is a ring: every rank sends the N-1 payloads it does not receive last.
    predicted_2bit = (n - 1) * sum(wire.payload_bytes(k) for k in numels)
    # Gloo's ring allreduce sends 2 (N-1)/N of the float32 buffer.
    predicted_none = 2 * (n - 1) / n * 4 * sum(numels)
    report = []
    for r in ranks:
        two = r["twobit"]["tx"] / r["twobit"]["steps"]
        none = r["none"]["tx"] / r["none"]["steps"]
        report.append("rank %d: 2-bit %.0f B/step (predicted %d, x%.4f), none %.0f B/step "
                      "(predicted %d, x%.4f), ratio 1/%.2f, idle control %.0f B/s"
                      % (r["rank"], two, predicted_2bit, two / predicted_2bit, none, predicted_none,
                         none / predicted_none, none / two, r["idle"]["tx"] / r["idle"]["seconds"]))
    print("\n".join(report))
    for r in ranks:
        two = r["twobit"]["tx"] / r["twobit"]["steps"]
        none = r["none"]["tx"] / r["none"]["steps"]
        assert abs(two / predicted_2bit - 1) < 0.10, report
        assert abs(none / predicted_none - 1) < 0.10, report
        assert 16 * 0.9 < none / two < 16 * 1.1, report


@pytest.mark.timeout(300)
def test_scatter_bytes_on_the_wire_match_the_format(vc, tmp_path):
    """4 hosts: each host sends what the scatter exchange's format predicts, 0.75 (numeric) and
    about 0.63 ("auto": 2-bit chunks, a 3-bit phase 2) of the allgather exchange's bytes
    (README's table)."""
    n, t = 4, 0.01
    ranks = _bytes_job(vc, tmp_path, n, ["twobit", "scatter", "scatter_auto"])
    numels = ranks[0]["twobit"]["numels"]
    predicted = {"twobit": sw.bytes_per_rank(layout.model_layouts(numels, t), n, "allgather"),
                 "scatter": sw.bytes_per_rank(layout.model_layouts(numels, t), n, "scatter"),
                 "scatter_auto": sw.bytes_per_rank(layout.model_layouts(numels, "auto"), n,
                                                   "scatter")}
    report = ["rank %d %s: %.0f B/step, predicted %.0f" % (r["rank"], k, r[k]["tx"] / r[k]["steps"],
                                                           predicted[k])
              for r in ranks for k in sorted(predicted)]
    print("\n".join(report))
    for r in ranks:
        for k, want in predicted.items():
            assert abs(r[k]["tx"] / r[k]["steps"] / want - 1) < 0.10, report
    assert predicted["scatter"] < 0.8 * predicted["twobit"]
    assert predicted["scatter_auto"] < 0.67 * predicted["twobit"]


@pytest.mark.timeout(300)
def test_scatter_four_hosts_matches_reference(vc, tmp_path):
    """The scatter exchange across 4 hosts ("auto": owners' residuals) gives the NumPy
    reference's results, bit for bit, on every host."""
    from test_torch_scatter import STEPS, _check_training
    _run(vc, 4, "torch_scatter.py", "--out", tmp_path, "--configs", "auto:scatter",
         "--steps", STEPS)
    ranks = sim.load_ranks(str(tmp_path / "0"), 4)
    _check_training(ranks, ref.Workers(4, "auto", exchange="scatter"), "auto")


@pytest.mark.timeout(240)
def test_mpi_moves_the_payload_over_the_links(vc, tmp_path):
    """Open MPI sees every host under the same hostname; the payload must still cross the links
    (TCP on the cluster's interface), not shared memory."""
    ranks = _bytes_job(vc, tmp_path, 2, ["twobit"], mpi=True, features=1024, steps=3)
    predicted = sum(wire.payload_bytes(k) for k in ranks[0]["twobit"]["numels"])
    for r in ranks:
        per_step = r["twobit"]["tx"] / r["twobit"]["steps"]
        assert abs(per_step / predicted - 1) < 0.10, (per_step, predicted)


# ---------------------------------------------------------------------- the harness itself
def _leftovers(iface):
    out = []
    ns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    out += [n for n in ns if n.startswith(iface + "-h")]
    out += [p for p in glob.glob("/sys/class/net/%s*" % iface)]
    out += [p for p in glob.glob("/etc/netns/%s-h*" % iface)]
    out += [p for p in glob.glob("/tmp/hvdtb-cluster-%s-*" % iface)]
    return out


def _known_hosts():
    try:
        with open(cluster._root_known_hosts()) as f:
            return f.read()
    except OSError:
        return None


@pytest.mark.timeout(120)
def test_teardown_on_error_leaves_nothing():
    iface = "hvdtd"
    kh = _known_hosts()
    # A failure while setting up (netem is missing from some kernels) removes what was made.
    try:
        with cluster.VirtualCluster(n_hosts=2, rate="10mbit", delay="1ms", iface=iface,
                                    subnet="10.77.2.0/24"):
            pass
    except cluster.ClusterError as e:
        assert "netem" in str(e)
    assert _leftovers(iface) == []
    # A failure in the body removes everything too.
    with pytest.raises(RuntimeError, match="boom"):
        with cluster.VirtualCluster(n_hosts=2, rate="10mbit", iface=iface,
                                    subnet="10.77.2.0/24") as c:
            pids = [h.sshd_pid for h in c.hosts]
            assert _leftovers(iface)
            # ssh through the cluster's wrapper reaches the host, which sees its own namespace
            p = subprocess.run(["ssh", c.hosts[1].addr, "cat /proc/net/dev; getent hosts $(hostname)"],
                               env=c.env(), capture_output=True, text=True, timeout=60)
            assert p.returncode == 0, p.stderr
            assert (iface + ":") in p.stdout and "eth0" not in p.stdout  # the host's own netns
            assert c.hosts[1].addr in p.stdout  # the hostname resolves to the host's own address
            raise RuntimeError("boom")
    assert _leftovers(iface) == []
    assert not any(cluster._pid_alive(pid) for pid in pids)  # sshd ended
    assert _known_hosts() == kh


def _sleeping(ns):
    """pids of `sleep` processes in namespace ns."""
    out = []
    for pid in subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split():
        try:
            with open("/proc/%s/comm" % pid) as f:
                if f.read().strip() == "sleep":
                    out.append(int(pid))
        except OSError:
            pass
    return out


@pytest.mark.timeout(150)
def test_ctrl_c_tears_down():
    iface = "hvdtc"
    kh = _known_hosts()
    proc = subprocess.Popen([sys.executable, "-m", "horovod_twobit.cluster", "run", "--hosts", "2",
                             "--rate", "100mbit", "--iface", iface, "--subnet", "10.77.3.0/24",
                             "--", "sleep", "300"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, cwd=REPO)
    try:
        line = proc.stdout.readline()
        assert "virtual cluster %s" % iface in line, line + proc.stdout.read()
        deadline = time.time() + 90
        job = []
        while not job and time.time() < deadline:  # wait until the job runs in both hosts
            time.sleep(0.5)
            job = [_sleeping(iface + "-h0"), _sleeping(iface + "-h1")]
            job = sum(job, []) if all(job) else []
        assert job, "the job never started in the hosts"
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, out
    assert _leftovers(iface) == []
    assert not any(cluster._pid_alive(pid) for pid in job)  # the job's processes are gone too
    assert _known_hosts() == kh


def test_links_take_whole_tso_segments(vc):
    """Every link's token bucket holds a 64 KiB TSO segment with its headers, so tbf passes it
    whole instead of cutting it into MTU-size packets on the CPU (and 2 ms at the rate)."""
    from horovod_twobit.cluster.hosts import tbf_burst
    assert tbf_burst("100mbit", 1500) >= 65536 + 45 * 100
    assert tbf_burst("10gbit", 1500) == 10e9 / 8 * 0.002
    for h in vc.hosts:
        for argv in (["tc", "qdisc", "show", "dev", h.root_veth],
                     ["tc", "-n", h.ns, "qdisc", "show", "dev", IFACE]):
            out = subprocess.run(argv, capture_output=True, text=True, check=True).stdout
            m = re.search(r"tbf .*burst (\d+(?:\.\d+)?)([KM]?)b", out)
            assert m, out
            burst = float(m.group(1)) * {"": 1, "K": 1024, "M": 1 << 20}[m.group(2)]
            assert burst >= 0.99 * 1e9 / 8 * 0.002, out  # 2 ms at the fixture's 1 Gbit/s


def test_refuses_clearly_without_root_or_ip_netns(monkeypatch, capsys):
    monkeypatch.setattr(cluster.os, "geteuid", lambda: 1000)
    with pytest.raises(cluster.ClusterUnavailable, match="needs root"):
        cluster.VirtualCluster(n_hosts=2).up()
    assert cluster._main(["up", "--hosts", "2"]) == 2
    assert "needs root" in capsys.readouterr().err
    monkeypatch.undo()
    monkeypatch.setattr(cluster.capabilities, "_capabilities", lambda: 0x1fffeffffff & ~(1 << 12))  # a container
    with pytest.raises(cluster.ClusterUnavailable, match=r"needs CAP_NET_ADMIN \(.*which this root lacks.*--privileged"):
        cluster.VirtualCluster(n_hosts=2).up()
    monkeypatch.undo()
    real = cluster.capabilities._which
    monkeypatch.setattr(cluster.capabilities, "_which", lambda name, path: None if name == "ip" else real(name, path))
    with pytest.raises(cluster.ClusterUnavailable, match="ip is not installed"):
        cluster.VirtualCluster(n_hosts=2).up()


def test_cluster_benchmark_reports_every_method(tmp_path):
    """examples/bench_cluster.py: the Horovod methods in one job taking turns, a DDP method in its
    own (DDP's fp16 hook and this project's 2-bit hook); every method gets a row with its step time, CPU time and bytes, and TwoBit's bytes are
    the format's fraction of no compression's; a fallback's row holds its decision per bucket
    and the link it measured; ``twobit#2`` is another instance of TwoBit in the same job (its own
    names and row), a tag on a DDP method is refused."""
    out = tmp_path / "bench"
    bad = subprocess.run([sys.executable, os.path.join(REPO, "examples", "bench_cluster.py"),
                          "--methods", "none,ddp_fp16#2", "--out", str(out)],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "unknown methods ['ddp_fp16#2']" in bad.stderr, bad.stderr
    proc = subprocess.run(
        [sys.executable, os.path.join(REPO, "examples", "bench_cluster.py"), "--hosts", "2",
         "--rates", "1gbit", "--models", "cnn", "--methods",
         "none,twobit,twobit_fallback,ddp_fp16,ddp_twobit,twobit#2",
         "--steps", "3", "--warmup", "1", "--iface", "hvdbench", "--subnet", "10.77.2.0/24",
         "--out", str(out)],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {r["method"]: r for r in json.load(open(out / "bench_cluster.json"))["results"]}
    assert sorted(rows) == ["ddp_fp16", "ddp_twobit", "none", "twobit", "twobit#2",
                            "twobit_fallback"]
    from horovod_twobit.cluster import cpu
    q = os.cpu_count() * 0.8 / 2 if cpu.backends() else None  # the default emulation
    for r in rows.values():
        assert not r["failed"] and r["median_step_s"] > 0 and r["cpu_step_s"] > 0
        assert r["cpus_per_host"] == pytest.approx(q)
        assert r["quota_from"] == ("measured" if q else None)  # not over the warm-up
        assert r["dilation"] == pytest.approx(1 / q if q else 1)
        assert r["real_step_s"] == pytest.approx(r["median_step_s"] / r["dilation"])
        assert len(r["step_s"]) == 3 and r["real_step_s"] == pytest.approx(sorted(r["step_s"])[1])
    # per host and step: compute, codec (TwoBit's alone), waiting
    assert rows["none"]["codec_s"] == 0 and rows["twobit"]["codec_s"] > 0
    for m in ("none", "twobit"):
        assert rows[m]["compute_s"] > 0 and rows[m]["wait_s"] >= 0
        assert rows[m]["compute_s"] + rows[m]["codec_s"] < 1.5 * rows[m]["real_step_s"]
    assert rows["ddp_fp16"]["compute_s"] is None  # DDP communicates inside backward
    fb = rows["twobit_fallback"]["fallback"]  # the CNN's one bucket, decided once
    assert list(fb["decisions"]) == ["twobit_fallback.10.bias (+7), 2 ranks"], fb
    assert list(fb["decisions"].values())[0] in ("compressed", "plain")
    assert len(fb["links"]) == 1 and "allgather" in fb["links"][0] and "Link(" in fb["links"][0]
    assert rows["none"]["fallback"] is None and rows["twobit"]["fallback"] is None
    assert "step 3/3: " in proc.stdout  # progress while it runs
    assert rows["none"]["job_s"] == rows["twobit"]["job_s"]  # one job for both
    # 19.5 k gradients: 78 kB in fp32 against 4.9 kB in 2 bits, plus headers and control traffic
    assert rows["twobit"]["bytes_per_step"] < rows["none"]["bytes_per_step"] / 3
    assert rows["ddp_fp16"]["bytes_per_step"] < rows["none"]["bytes_per_step"]
    # the DDP hook sends the 2-bit payloads too: within 10 % of Horovod's TwoBit bytes
    assert rows["ddp_twobit"]["bytes_per_step"] < 1.1 * rows["twobit"]["bytes_per_step"]
    md = (out / "bench_cluster.md").read_text()
    assert "| 1gbit | cnn (19.5k params) | Horovod, TwoBitCompressor (t=0.01) |" in md
    # the A/A instance: the same method in the same job, sending as much
    assert "| 1gbit | cnn (19.5k params) | Horovod, TwoBitCompressor #2 (t=0.01) |" in md
    assert rows["twobit#2"]["job_s"] == rows["twobit"]["job_s"]
    assert rows["twobit#2"]["codec_s"] > 0 and rows["twobit#2"]["fallback"] is None
    assert abs(rows["twobit#2"]["bytes_per_step"] / rows["twobit"]["bytes_per_step"] - 1) < 0.2


def test_cluster_benchmark_calibrates_its_hosts(tmp_path):
    """bench_cluster --calibrate: every host's codec rates in real-host seconds, a one-value
    allreduce among them, the framework's CPU per step and tensor and Horovod's float16 sum
    become the profile of these hosts, written beside the rows and taken by `advise validate`."""
    out = tmp_path / "bench"
    proc = subprocess.run(
        [sys.executable, os.path.join(REPO, "examples", "bench_cluster.py"), "--hosts", "2",
         "--rates", "1gbit", "--models", "", "--calibrate", "--calibrate-sizes", "16384,65536",
         "--calibrate-min-wall", "0.02", "--steps", "5", "--iface", "hvdbench", "--subnet",
         "10.77.2.0/24", "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    from horovod_twobit.model import steptime
    prof = steptime.load_profile(str(out / "profile-2h-1gbit.json"))
    assert json.load(open(out / "bench_cluster.json"))["profiles"]["1gbit"] == prof
    # the sizes asked for, and the size just below the codec's switch to its compiled bodies
    assert prof["codec_by_size"]["sizes"] == [16384, 65520, 65536]
    assert prof["cluster"]["hosts"] == 2 and len(prof["cluster"]["allreduce1_per_host_s"]) == 2
    assert 0 < prof["collective_s"] < prof["allreduce1_s"] < 1.0
    assert sorted(prof["framework_s"]) == ["fp16", "none", "scatter", "twobit"]
    # Horovod's float16 sum, from each host's float16 and float32 allreduces of the same bytes
    from horovod_twobit.advisor import cluster_profile
    assert len(prof["half_sum"]) == 2 and all(h["fp16_cpu_s"] > 0 and h["fp32_cpu_s"] > 0
                                              for h in prof["half_sum"])
    assert prof["sum_fp16_s"] == cluster_profile.half_sum_cost(prof["half_sum"], 2,
                                                               prof["sum_fp32_s"])
    assert prof["sum_fp16_proxy_s"] > 0
    assert 0 <= prof["straggler_s"] < 1.0
    # the same allreduce while every host's core is busy: it waits for the core
    assert len(prof["cluster"]["allreduce1_loaded_per_host_s"]) == 2
    assert prof["allreduce1_loaded_s"] > prof["allreduce1_s"]
    assert prof["collective_loaded_s"] > prof["collective_s"]
    assert all(v[0] >= 0 and v[1] >= 0 for v in prof["framework_s"].values())
    for k in steptime.CODEC_KEYS:
        assert steptime.codec_s(prof, k, 65536, 2) > 0
    # every host timed a bucket of 64 members (of 256 values: the smallest size, 16 K): the
    # hosts' median cost per member, for every codec call
    assert prof["codec_members"]["members"] == 64 and prof["codec_members"]["values"] == 16384
    assert sorted(prof["codec_members"]["keys"]) == sorted(steptime.CODEC_KEYS)
    assert [N for N, _ in prof["member_points"]["points"]["encode_auto"]] == [2, 4, 8]
    # and an "auto" bucket of tables against its twin, a tensor in segments: the hosts' median
    # cost per table and per segment
    auto = sorted(k for k in steptime.CODEC_KEYS if k.endswith("_auto"))
    for entry, points in (("codec_tables", "table_points"), ("codec_segments", "segment_points")):
        assert sorted(prof[entry]["keys"]) == auto
        assert [row[0] for row in prof[points]["points"]["encode_auto"]] == [2, 4, 8]
    assert "calibrated 2 hosts" in proc.stdout


def test_probe_groups_records_every_handle_after_backward(vc, tmp_path, monkeypatch):
    """examples/probe_groups.py: on every host and step, every gradient's allreduce is seen done
    once, not before backward ended; the printed count of collectives per step is what the
    handles' completion times give, and one step's handles of one collective count once."""
    monkeypatch.syspath_prepend(os.path.join(REPO, "examples"))
    from probe_groups import groups
    assert groups([0.0010, 0.0011, 0.0030, 0.0012], 0.0003) == [(0.0012, 3), (0.0030, 1)]
    assert groups([], 0.0003) == []
    out = tmp_path / "groups.json"
    res = vc.horovodrun(1, [sys.executable, os.path.join(REPO, "examples", "probe_groups.py"),
                            "--model", "cnn", "--steps", "3", "--warmup", "1", "--out", str(out)],
                        hosts=2, timeout=200, env=job_env())
    assert res.returncode == 0, res
    data = json.load(open(out))
    assert data["hosts"] == 2 and len(data["steps"]) == 2
    for host in data["steps"]:
        assert len(host) == 3
        for step in host:
            assert len(step["done_s"]) == 8  # the CNN's 4 weights and 4 biases
            assert min(step["done_s"].values()) >= step["backward_s"]
            assert step["step_s"] >= max(step["done_s"].values())
    printed = re.search(r"collectives per step \(the most any host saw\): (.*)", res.output)
    counts = [max(len(groups(host[i]["done_s"].values(), 0.0003)) for host in data["steps"])
              for i in range(3)]
    assert printed.group(1).strip() == ", ".join(
        "%d in %d steps" % (k, counts.count(k)) for k in sorted(set(counts)))


def test_probe_cycles_times_the_idle_thread_and_three_optimizers(vc, tmp_path):
    """examples/probe_cycles.py: every host reports its idle Horovod's CPU, and per method the
    steps it timed; no compression in one group trains exactly as no compression (the same
    losses, step by step: the same sums of 2 ranks), and the printed medians are the records'."""
    out = tmp_path / "cycles.json"
    res = vc.horovodrun(1, [sys.executable, os.path.join(REPO, "examples", "probe_cycles.py"),
                            "--model", "cnn", "--steps", "3", "--warmup", "1", "--idle-s", "0.3",
                            "--out", str(out)], hosts=2, timeout=200, env=job_env())
    assert res.returncode == 0, res
    data = json.load(open(out))
    assert data["ranks"] == 2 and len(data["every"]) == 2
    for e in data["every"]:
        assert e["idle_cpu"] > 0  # the background thread cycles with nothing to send
        for m in ("none", "none_one_group", "twobit"):
            r = e["methods"][m]
            assert len(r["step_s"]) == 3 and all(
                b <= s for b, s in zip(r["backward_s"], r["step_s"]))
        assert e["methods"]["none_one_group"]["loss"] == e["methods"]["none"]["loss"]
    slowest = statistics.median(max(e["methods"]["none_one_group"]["step_s"][j]
                                    for e in data["every"]) for j in range(3))
    assert "none_one_group  step %.2f ms" % (1e3 * slowest) in res.output


def test_probe_allgather_times_both_collectives_per_size(vc, tmp_path):
    """examples/probe_allgather.py: on 2 virtual hosts, per part size, every host records one
    allgather and one allreduce per round (the first untimed), the gathered parts are checked on
    every host, and the printed medians are the slowest host's of the records."""
    out = tmp_path / "allgather.json"
    res = vc.horovodrun(1, [sys.executable, os.path.join(REPO, "examples", "probe_allgather.py"),
                            "--sizes", "0.1,0.3", "--rounds", "3", "--idle-s", "0.01",
                            "--out", str(out)], hosts=2, timeout=200, env=job_env())
    assert res.returncode == 0, res
    data = json.load(open(out))
    assert data["ranks"] == 2 and data["sizes"] == [100000, 300000]
    assert sorted(e["rank"] for e in data["every"]) == [0, 1]
    for s in data["sizes"]:
        for e in data["every"]:
            assert [len(e["times"][str(s)][k]) for k in ("allgather", "allreduce")] == [4, 4]
            assert all(t > 0 for k in ("allgather", "allreduce") for t in e["times"][str(s)][k])
        med = {k: statistics.median(max(e["times"][str(s)][k][j] for e in data["every"])
                                    for j in range(1, 4)) for k in ("allgather", "allreduce")}
        assert ("%.2f MB per rank: allgather %.1f ms, allreduce of the same bytes per host %.1f ms"
                % (s / 1e6, 1e3 * med["allgather"], 1e3 * med["allreduce"])) in res.output


def test_probe_framework_threads_splits_each_step_by_thread(vc, tmp_path):
    """examples/probe_framework_threads.py: on 2 virtual hosts, every host times every kind of
    optimizer at both tensor counts; the training thread's CPU is part of the process's, the
    Horovod steps spend CPU on other threads (the plain step has none to speak of beside its
    own), and the printed figures are the medians over the hosts of the records."""
    out = tmp_path / "threads.json"
    res = vc.horovodrun(1, [sys.executable,
                            os.path.join(REPO, "examples", "probe_framework_threads.py"),
                            "--steps", "2", "--out", str(out)], hosts=2, timeout=200,
                        env=job_env())
    assert res.returncode == 0, res
    data = json.load(open(out))
    assert data["ranks"] == 2 and sorted(e["rank"] for e in data["every"]) == [0, 1]
    kinds = ("plain", "none", "fp16", "twobit", "scatter")
    for e in data["every"]:
        assert sorted(e["steps"]) == sorted(kinds)
        for kind in kinds:
            assert sorted(e["steps"][kind]) == ["1", "64"]
            for r in e["steps"][kind].values():
                assert 0 < r["thread_s"] <= r["cpu_s"] + 1e-4 and r["wall_s"] > 0
        # Horovod's background thread works for every collective: CPU off the training thread
        assert all(e["steps"][k]["1"]["cpu_s"] - e["steps"][k]["1"]["thread_s"]
                   > e["steps"]["plain"]["1"]["cpu_s"] - e["steps"]["plain"]["1"]["thread_s"]
                   for k in kinds[1:])
    med = lambda kind, k, f: 1e3 * statistics.median(  # noqa: E731
        e["steps"][kind][k][f] for e in data["every"])
    for kind in kinds:
        assert ("%-8s" % kind + "".join("   %2d tensors %6.2f / %6.2f / %6.2f" % (
            int(k), med(kind, k, "cpu_s"), med(kind, k, "thread_s"), med(kind, k, "wall_s"))
            for k in ("1", "64"))) in res.output
