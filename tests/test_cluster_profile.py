"""The profile of a virtual cluster's hosts: the calibration's wall clock under a CPU quota
(``calibrate(clock="wall", dilation=D)``), merging the hosts' calibrations into one profile with
the measured fixed cost per collective (``cluster_profile.from_cluster``), and ``advise validate``
taking that profile from bench_cluster's JSON."""

import json
import math

import pytest

from horovod_twobit.advisor import calibrate, cluster_profile
from horovod_twobit.model import collectives, steptime
from horovod_twobit.advisor import validate


def _host(scale, n=(1024, 4096), N=(2, 4)):
    """A host's profile whose every codec point takes ``scale`` x (1e-4 + n 1e-9) s."""
    pts = [(a, b, scale * (1e-4 + a * 1e-9)) for a in n for b in N]
    prof = calibrate.refit({"name": "h", "kind": "measured", "serial": True, "source": "test",
                            "points": {k: pts for k in steptime.CODEC_KEYS}, "codec": {}})
    prof.update({k: scale * 1e-9 for k in ("sum_fp32_s", "sum_fp16_s", "cast_fp16_s",
                                           "optimizer_s", "powersgd_s")})
    prof.update(copy_s_per_byte=scale * 1e-10, kernel_s_per_byte=scale * 3e-10,
                message_s=scale * 1e-5)
    return prof


def test_from_cluster_takes_the_median_host_and_the_collective_cost():
    hosts = [_host(1.0), _host(2.0), _host(9.0)]  # the median host is the one at 2.0
    prof = cluster_profile.from_cluster(hosts, allreduce1_s=2e-3, nranks=4, cycle_s=1e-3)
    want = _host(2.0)
    for k in steptime.CODEC_KEYS:
        assert [p[:2] for p in prof["points"][k]] == [p[:2] for p in want["points"][k]]
        assert [p[2] for p in prof["points"][k]] == pytest.approx([p[2] for p in want["points"][k]])
        assert prof["codec"][k] == pytest.approx(want["codec"][k], rel=1e-6, abs=1e-15)
    assert prof["message_s"] == pytest.approx(2e-5)
    assert prof["kernel_s_per_byte"] == pytest.approx(6e-10)
    # what the model charges a one-value allreduce besides collective_s: half a cycle, the
    # negotiation's 2 ceil(log2 4) = 4 messages and the ring's 2 (4 - 1) = 6
    assert prof["collective_s"] == pytest.approx(2e-3 - 0.5e-3 - 10 * 2e-5)
    assert prof["allreduce1_s"] == 2e-3 and prof["serial"] and prof["kind"] == "measured"
    # the model, given the profile, charges a one-value allreduce what was measured
    wire = steptime.Wire.of_link(4, "1gbit", 0.0, prof, cycle_s=1e-3)
    one = wire.cycle_s / 2 + wire.fixed + collectives.collective_seconds("allreduce", 4, 4, 1, wire, prof)
    assert one == pytest.approx(2e-3, rel=1e-3)
    steptime.load_profile(prof)  # a valid profile


def test_from_cluster_never_gives_a_negative_collective_cost():
    prof = cluster_profile.from_cluster([_host(1.0)], allreduce1_s=1e-5, nranks=8)
    assert prof["collective_s"] == 0.0
    with pytest.raises(ValueError, match="at least one host"):
        cluster_profile.from_cluster([], 1e-3, 2)


def test_wall_clock_spans_many_quota_periods():
    """Under a quota a short call runs at a whole core's speed inside one period's share: the
    wall clock repeats it until the reading spans min_wall_s, and divides by the dilation."""
    t = {"now": 0.0}

    class Fake(calibrate._Timer):
        def __init__(self):
            super().__init__("wall", dilation=4.0, min_wall_s=0.25)
            self.now = lambda: t["now"] / 4.0

    calls = []

    def fn():  # 1/1024 s of wall time per call (binary fractions: exact sums)
        calls.append(1)
        t["now"] += 1.0 / 1024
    secs = calibrate._median_time(fn, 3, Fake())
    assert secs == 1.0 / 1024 / 4.0
    assert len(calls) == 1 + 3 * 256  # one warm-up call, then 0.25 s of calls per reading


@pytest.mark.parametrize("clock,dilation,match", [("tsc", 1.0, "clock must be"),
                                                  ("wall", 0, "dilation must be")])
def test_bad_clock_is_an_error(clock, dilation, match):
    with pytest.raises(ValueError, match=match):
        calibrate.calibrate(sizes=(1024,), ranks=(2,), clock=clock, dilation=dilation)


def test_validate_uses_the_profile_measured_on_the_rows_hosts(tmp_path):
    def row(method, real):
        return {"model": "m", "method": method, "rate": "1gbit", "failed": False,
                "real_step_s": real, "compute_s": 0.1}
    slow = dict(_host(50.0), name="slow-hosts", collective_s=0.0)
    path = tmp_path / "bench_cluster.json"
    path.write_text(json.dumps({"args": {"hosts": 4}, "results": [row("none", 0.5),
                                                                  row("twobit", 0.5)],
                                "profiles": {"1gbit": slow}}))
    sizes = lambda model, args: [1 << 20] * 4
    got = validate.compare([str(path)], sizes_of=sizes)
    assert {r["profile"] for r in got} == {"slow-hosts"}
    want = steptime.predict([1 << 20] * 4, "twobit", 4, "1gbit", 0.1, slow, latency_s=0.0)
    assert got[1]["predicted_s"] == pytest.approx(want.step_s)
    cpu = validate.compare([str(path)], "cpu", sizes_of=sizes)  # --profile overrides it
    assert {r["profile"] for r in cpu} == {"cpu"}
    assert not math.isclose(cpu[1]["predicted_s"], got[1]["predicted_s"])


def test_framework_costs_are_what_the_model_does_not_charge():
    """Measured steps of K tiny tensors, less the plain optimizer's step and the model's own
    charges, fitted as per step + K x per tensor; the model then pays them."""
    prof = dict(_host(1.0), collective_s=0.0)
    bare = {}
    for method in ("none", "fp16", "twobit", "scatter"):
        for k in (1, 64):
            p = steptime.predict([16] * k, method, 4, "1gbit", 0.0, prof, latency_s=0.0)
            bare[method, k] = p.parts["cpu"] - p.parts["optimizer"]
    want = {"none": (1e-3, 50e-6), "fp16": (1.5e-3, 70e-6), "twobit": (2e-3, 20e-6),
            "scatter": (3e-3, 30e-6)}
    host = {"plain": {"1": 1e-4, "64": 2e-3}}  # JSON keys, as the worker's file has them
    for kind, (step, tensor) in want.items():
        host[kind] = {str(k): host["plain"][str(k)] + bare[kind, k] + step + k * tensor
                      for k in (1, 64)}
    other = {kind: {k: 10 * v for k, v in d.items()} for kind, d in host.items()}
    got = cluster_profile.framework_costs(prof, [host, host, other], 4)  # median host: `host`
    for kind, (step, tensor) in want.items():
        assert got[kind] == pytest.approx([step, tensor], rel=1e-6)
    prof["framework_s"] = got
    sizes = [1 << 16] * 10
    for method, kind in (("none", "none"), ("fp16", "fp16"), ("auto", "twobit"),
                         ("scatter_auto", "scatter")):
        with_fw = steptime.predict(sizes, method, 4, "1gbit", 0.05, prof, latency_s=0.0)
        without = steptime.predict(sizes, method, 4, "1gbit", 0.05, _host(1.0), latency_s=0.0)
        step, tensor = want[kind]
        assert with_fw.parts["framework"] == pytest.approx(step + 10 * tensor)
        assert with_fw.parts["cpu"] - without.parts["cpu"] == pytest.approx(step + 10 * tensor)
        assert with_fw.step_s > without.step_s + step
    assert steptime.framework_s(_host(1.0), "twobit") == (0.0, 0.0)
    # hosts calibrated before fp16 had a kind of its own: fp16 pays no compression's figures
    old = {kind: d for kind, d in host.items() if kind != "fp16"}
    got = cluster_profile.framework_costs(prof, [old], 4)
    assert "fp16" not in got
    assert steptime.framework_s(dict(prof, framework_s=got), "fp16") == pytest.approx(want["none"])


def test_the_float16_sum_is_measured_against_float32_of_the_same_bytes():
    """n float16 values and n / 2 float32 values are the same bytes and messages; the ring sums
    (N - 1) / N of each: the medians' difference in CPU seconds gives the float16 sum per value,
    and the model then charges an allreduce of float16 what was measured."""
    N, n, s16, s32 = 4, 1 << 20, 25e-9, 1e-9
    wire_s = 0.05  # the TCP stack's CPU, the same for both
    per_host = [{"values": n, "fp16_cpu_s": wire_s + (N - 1) / N * n * s16 * f,
                 "fp32_cpu_s": wire_s + (N - 1) / N * n / 2 * s32 * f,
                 "fp16_s": 0.0, "fp32_s": 0.0} for f in (1.0, 1.0, 3.0)]  # wall: not used
    assert cluster_profile.half_sum_cost(per_host, N, s32) == pytest.approx(s16)
    prof = cluster_profile.from_cluster([_host(1.0)], 2e-3, N, half_sum=per_host)
    assert prof["sum_fp16_s"] == pytest.approx(s16)  # the host profile's float32 sum is s32
    assert prof["sum_fp16_proxy_s"] == _host(1.0)["sum_fp16_s"] and prof["half_sum"] == per_host
    wire = steptime.Wire.of_link(N, "1gbit", 0.0, prof)
    half = collectives.collective_seconds("allreduce", N, 2 * n, n, wire, prof, dtype_bytes=2)
    single = collectives.collective_seconds("allreduce", N, 2 * n, n // 2, wire, prof)
    assert half - single == pytest.approx(per_host[0]["fp16_cpu_s"] - per_host[0]["fp32_cpu_s"])
    # a float16 allreduce measured cheaper than float32's is clamped, never a negative cost
    fast = [dict(h, fp16_cpu_s=h["fp32_cpu_s"] - 1.0) for h in per_host]
    assert cluster_profile.half_sum_cost(fast, N, s32) == 0.0
    with pytest.raises(ValueError, match="at least 2 hosts"):
        cluster_profile.half_sum_cost(per_host, 1, s32)
    assert "sum_fp16_proxy_s" not in cluster_profile.from_cluster([_host(1.0)], 2e-3, N)
    one = cluster_profile.from_cluster([_host(1.0)], 2e-3, 1, half_sum=per_host[:1])
    assert one["sum_fp16_s"] == _host(1.0)["sum_fp16_s"] and "sum_fp16_proxy_s" not in one


def test_the_slowest_host_is_waited_for_once_per_step():
    prof = cluster_profile.from_cluster([_host(1.0)], 2e-3, 4, straggler_s=0.004)
    assert prof["straggler_s"] == 0.004
    bare = dict(prof, straggler_s=0.0)
    sizes = [1 << 16] * 10
    for method in ("none", "twobit", "scatter_auto"):
        got = steptime.predict(sizes, method, 4, "1gbit", 0.05, prof, latency_s=0.0)
        want = steptime.predict(sizes, method, 4, "1gbit", 0.05, bare, latency_s=0.0)
        assert got.step_s == pytest.approx(want.step_s + 0.004)
        assert got.parts["cpu"] == pytest.approx(want.parts["cpu"])  # waiting, not CPU
    assert steptime.straggler_s(prof, 1) == 0.0  # one host waits for no other
    assert "straggler_s" not in cluster_profile.from_cluster([_host(1.0)], 2e-3, 4)


def test_a_collective_during_backward_waits_for_the_core():
    """On a one-core host a collective that runs while backward computes progresses at
    collective_s / collective_loaded_s of its pace (both from one-value allreduces, idle and with
    the core busy), and at full pace once backward ends."""
    prof = cluster_profile.from_cluster([_host(1.0)], 2e-3, 4, cycle_s=1e-3,
                                        allreduce1_loaded_s=20e-3)
    extra = 0.5e-3 + 10 * 1e-5  # half a cycle and 10 messages, as for collective_s
    assert prof["collective_loaded_s"] == pytest.approx(20e-3 - extra)
    assert prof["allreduce1_loaded_s"] == 20e-3
    rate = steptime.loaded_rate(prof)
    assert rate == pytest.approx((2e-3 - extra) / (20e-3 - extra))
    # all of it after backward, all of it before, and across the end of backward
    assert collectives.collective_end(5.0, 1.0, 4.0, 0.25) == 6.0
    assert collectives.collective_end(0.0, 1.0, 8.0, 0.25) == 4.0
    assert collectives.collective_end(2.0, 1.0, 4.0, 0.25) == pytest.approx(4.5)
    # no slowdown without the loaded figure, on a host that is not one core, or measured faster
    assert "collective_loaded_s" not in cluster_profile.from_cluster([_host(1.0)], 2e-3, 4)
    assert steptime.loaded_rate(dict(prof, serial=False)) == 1.0
    assert steptime.loaded_rate(dict(prof, collective_loaded_s=1e-4)) == 1.0
    # the model: Horovod's per-tensor allreduces run during backward and end later; one TwoBit
    # bucket, ready when backward ends, does not
    bare = dict(prof)
    del bare["collective_loaded_s"]
    sizes = [1 << 14] * 40
    for method, slower in (("none", True), ("twobit", False)):
        got = steptime.predict(sizes, method, 4, "1gbit", 0.05, prof, latency_s=0.0)
        want = steptime.predict(sizes, method, 4, "1gbit", 0.05, bare, latency_s=0.0)
        assert (got.step_s > want.step_s + 1e-3) == slower, method
        assert got.parts["cpu"] == pytest.approx(want.parts["cpu"])  # waiting, not CPU


def _with_members(prof, scale, M=64, n=1024, N=(2, 4)):
    """``prof`` (a :func:`_host`) with a bucket of ``M`` members of ``n`` values timed: each call
    ``scale`` x (5e-6 + 1e-6 N) s per member beyond the first over one tensor's."""
    one = {b: s for a, b, s in prof["points"]["encode"] if a == n}
    bucket = {"members": M, "values": n, "points": {
        k: [(b, one[b] + (M - 1) * scale * (5e-6 + 1e-6 * b)) for b in N]
        for k in steptime.CODEC_KEYS}}
    return calibrate.refit(dict(prof, member_points=bucket))


def test_from_cluster_takes_the_median_hosts_cost_per_member():
    hosts = [_with_members(_host(s), s) for s in (1.0, 2.0, 9.0)]
    prof = cluster_profile.from_cluster(hosts, allreduce1_s=2e-3, nranks=4)
    for k in steptime.CODEC_KEYS:
        assert prof["codec_members"]["keys"][k] == pytest.approx([1e-5, 2e-6], rel=1e-6)
    steptime.load_profile(prof)
    # a host that timed no bucket of members: the merged profile has no cost per member
    mixed = cluster_profile.from_cluster(hosts[:2] + [_host(9.0)], 2e-3, 4)
    assert "codec_members" not in mixed and "member_points" not in mixed


def _with_tables(prof, scale, T=8, N=(2, 4)):
    """``prof`` with an "auto" bucket of ``T`` tables timed against its twin of one: each call
    ``scale`` x (2e-4 + 1e-5 N) s per table beyond the first."""
    keys = [k for k in steptime.CODEC_KEYS if k.endswith("_auto")]
    timed = {"tables": T, "numels": calibrate.table_numels(T)[0], "points": {
        k: [(b, 1e-3 + (T - 1) * scale * (2e-4 + 1e-5 * b), 1e-3) for b in N] for k in keys}}
    return calibrate.refit(dict(prof, table_points=timed))


def _with_segments(prof, scale, N=(2, 4)):
    """``prof`` with a tensor timed in 1024 segments against 64: each call ``scale`` x (3e-7 +
    1e-8 N) s per segment beyond."""
    keys = [k for k in steptime.CODEC_KEYS if k.endswith("_auto")]
    timed = {"values": 65536, "segments": [1024, 64], "points": {
        k: [(b, 1e-3 + 960 * scale * (3e-7 + 1e-8 * b), 1e-3) for b in N] for k in keys}}
    return calibrate.refit(dict(prof, segment_points=timed))


def test_from_cluster_takes_the_median_hosts_cost_per_table():
    hosts = [_with_segments(_with_tables(_host(s), s), s) for s in (1.0, 2.0, 9.0)]
    prof = cluster_profile.from_cluster(hosts, allreduce1_s=2e-3, nranks=4)
    assert sorted(prof["codec_tables"]["keys"]) == sorted(
        k for k in steptime.CODEC_KEYS if k.endswith("_auto"))
    for v in prof["codec_tables"]["keys"].values():
        assert v == pytest.approx([4e-4, 2e-5], rel=1e-6)
    for v in prof["codec_segments"]["keys"].values():
        assert v == pytest.approx([6e-7, 2e-8], rel=1e-6)
    steptime.load_profile(prof)
    # a host that timed neither: the merged profile has no cost per table nor per segment
    mixed = cluster_profile.from_cluster(hosts[:2] + [_host(9.0)], 2e-3, 4)
    assert not {"codec_tables", "table_points", "codec_segments", "segment_points"} & set(mixed)
