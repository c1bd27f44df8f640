"""The step-time model: its byte counts against the project's formats, the behaviour of its terms,
profiles, calibration and the comparison with bench_cluster's output."""

import json

import pytest
import torch

from horovod_twobit.advisor import calibrate
from horovod_twobit.wire import layout, scatter as scatter_wire
from horovod_twobit.model import steptime
from horovod_twobit.torch.codec import levels

CPU = steptime.load_profile("cpu")
BOUND = steptime.load_profile("h100-bound")


@pytest.mark.parametrize("numels,auto", [([1 << 20], False), ([1 << 20], True),
                                         ([3000, 70000, 5], False), ([3000, 70000, 5], True),
                                         ([17], True)])
@pytest.mark.parametrize("nranks", [2, 3, 8, 64])
def test_scatter_words_match_chunks(numels, auto, nranks):
    lay = layout.Layout(numels, auto, *(layout.wire.validate_blocks("auto") if auto else (None, None)))
    chunks = scatter_wire.Chunks(lay, nranks)
    sent, red = steptime.scatter_words(lay, nranks)
    assert sent == sum(chunks.sent_words(c) for c in range(nranks))
    assert red == sum(chunks.reduced_words(c) for c in range(nranks))


@pytest.mark.parametrize("method,exchange,threshold", [("twobit", "allgather", 0.5),
                                                       ("auto", "allgather", "auto"),
                                                       ("scatter", "scatter", 0.5),
                                                       ("scatter_auto", "scatter", "auto")])
@pytest.mark.parametrize("nranks", [2, 8, 64])
def test_bytes_are_the_formats_own(method, exchange, threshold, nranks):
    sizes = [4096, 1 << 20, 300, 5000000, 10]
    want = scatter_wire.bytes_per_rank(layout.model_layouts(sizes, threshold), nranks, exchange)
    assert steptime.exchange_bytes(sizes, method, nranks) == pytest.approx(want, rel=1e-12)


def test_readme_bytes_table():
    one = [1 << 20]
    assert steptime.exchange_bytes(one, "none", 8) == 7340032
    assert steptime.exchange_bytes(one, "twobit", 8) == 1835148
    assert steptime.exchange_bytes(one, "scatter", 8) == 803348
    assert steptime.exchange_bytes(one, "scatter_auto", 8) == 574420
    assert steptime.exchange_bytes(one, "fp16", 8) == 7340032 / 2


def test_parsers():
    assert steptime.parse_rate("25gbit") == 25e9
    assert steptime.parse_rate("100Mbit/s") == 1e8
    assert steptime.parse_rate(1e9) == 1e9
    assert steptime.parse_count("25.6M") == 25600000
    assert steptime.parse_seconds("120ms") == pytest.approx(0.12)
    assert steptime.parse_seconds("50us") == pytest.approx(5e-5)
    with pytest.raises(ValueError):
        steptime.parse_rate("fast")
    assert steptime.sizes_from("2.5M", 1 << 20) == [1 << 20, 1 << 20, 2500000 - (2 << 20)]
    assert steptime.sizes_from([3, 4]) == [3, 4]


def test_profiles_are_labelled():
    assert CPU["kind"] == "measured" and CPU["source"]
    for name in ("h100-bound", "a100-bound", "v100-bound"):
        p = steptime.load_profile(name)
        assert p["kind"] == "bound" and "datasheet" in p["source"] and "bound" in p["note"]
    h200 = steptime.load_profile("h200")  # measured on a GPU, not a bound
    assert h200["kind"] == "measured" and not h200["serial"] and "NVIDIA H200" in h200["source"]
    assert "h200" in steptime.profile_names()
    h100 = steptime.load_profile("h100")  # measured with the cost per member of a bucket
    assert h100["kind"] == "measured" and not h100["serial"] and "NVIDIA H100" in h100["source"]
    assert h100["codec_members"]["members"] > 1 and set(h100["codec_members"]["keys"]) == set(
        h100["codec"])
    assert "h100" in steptime.profile_names() and "h100-bound" in steptime.profile_names()
    with pytest.raises(ValueError, match="no profile"):
        steptime.load_profile("no-such-device")


def test_profile_without_codec_entries_is_refused(tmp_path):
    path = tmp_path / "p.json"
    path.write_text(json.dumps({"codec": {"encode": [0, 0, 0, 0]}}))
    with pytest.raises(ValueError, match="lacks codec entries"):
        steptime.load_profile(str(path))


def test_slow_link_is_bandwidth_bound_and_fast_link_is_compute_bound():
    sizes = steptime.sizes_from("20M")
    slow = steptime.predict(sizes, "none", 8, "100mbit", 0.1, BOUND)
    link = steptime.exchange_bytes(sizes, "none", 8) * 8 / (1e8 * steptime.TCP_EFFICIENCY)
    assert link < slow.step_s < link + 0.2
    fast = steptime.predict(sizes, "none", 8, "10tbit", 0.1, BOUND)
    assert 0.1 < fast.step_s < 0.13


def test_compression_pays_on_slow_links_only():
    sizes = steptime.sizes_from("25.6M")
    slow = steptime.predict_all(sizes, 64, "1gbit", 0.1, BOUND)
    assert slow["scatter"].step_s < slow["fp16"].step_s < slow["none"].step_s
    fast = steptime.predict_all(sizes, 64, "1tbit", 0.1, BOUND)
    assert fast["none"].step_s / fast["scatter"].step_s < 1.05  # both about the compute


def test_allgather_grows_with_n_and_scatter_stays_flat():
    """Without latency: the scatter exchange's bytes, hence its time, stay flat in N; with it, the
    ring's N - 1 messages grow."""
    sizes = steptime.sizes_from("25.6M")
    prof = dict(BOUND, message_s=0.0)
    kw = dict(latency_s=0.0)
    ag = [steptime.predict(sizes, "twobit", n, "10gbit", 0.1, prof, **kw).step_s for n in (8, 64, 512)]
    sc = [steptime.predict(sizes, "scatter", n, "10gbit", 0.1, prof, **kw).step_s for n in (8, 64, 512)]
    late = [steptime.predict(sizes, "scatter", n, "10gbit", 0.1, BOUND).step_s for n in (8, 512)]
    assert late[1] > late[0] + 0.05
    assert ag[0] < ag[1] < ag[2] and ag[2] > 4 * ag[0]
    assert sc[2] < 1.5 * sc[0]


def test_latency_and_cycle_terms():
    sizes = [1000] * 50
    a = steptime.predict(sizes, "none", 16, "10gbit", 0.01, BOUND, latency_s=1e-6)
    b = steptime.predict(sizes, "none", 16, "10gbit", 0.01, BOUND, latency_s=1e-3)
    # at least one fused allreduce of 2 (N - 1) messages pays the extra latency
    assert b.step_s - a.step_s >= 30 * (1e-3 - 1e-6)
    c = steptime.predict(sizes, "none", 16, "10gbit", 0.01, BOUND, cycle_s=0.02)
    assert c.step_s > a.step_s


@pytest.mark.parametrize("method,exchange", [("none", "plain"), ("twobit", "allgather"),
                                             ("auto", "allgather"), ("scatter", "scatter")])
@pytest.mark.parametrize("nranks", [2, 8])
def test_a_bucket_alone_is_what_the_step_charges_it(method, exchange, nranks):
    """bucket_s (what the fallback compares) is predict's step for a model of that one bucket
    with no compute, less the optimizer: the same terms, not a second model."""
    sizes = [300000]
    lay = layout.Layout(sizes, method == "auto",
                        *(layout.wire.validate_blocks("auto") if method == "auto" else (None, None)))
    for kw in ({}, {"collective_s": 2e-4, "latency_s": 1e-4, "cycle_s": 3e-3}):
        step = steptime.predict(sizes, method, nranks, "1gbit", 0.0, BOUND, **kw)
        wire = steptime.Wire.of_link(nranks, "1gbit", kw.get("latency_s", 25e-6), BOUND,
                                     kw.get("cycle_s", 1e-3), kw.get("collective_s"))
        assert steptime.bucket_s(lay, exchange, nranks, wire, BOUND) == pytest.approx(
            step.step_s - step.parts["optimizer"], rel=1e-12)


def test_fixed_cost_per_collective():
    """collective_s (a profile's, or given) is charged once per collective: one for the
    allgather exchange, two for the scatter's (alltoall, allgather), one per fused allreduce."""
    sizes = [300000]
    for method, collectives in (("twobit", 1), ("scatter", 2), ("none", 1)):
        a = steptime.predict(sizes, method, 4, "1gbit", 0.0, BOUND).step_s
        b = steptime.predict(sizes, method, 4, "1gbit", 0.0, BOUND, collective_s=1e-3).step_s
        c = steptime.predict(sizes, method, 4, "1gbit", 0.0, dict(BOUND, collective_s=1e-3))
        assert b - a == pytest.approx(collectives * 1e-3) and c.step_s == pytest.approx(b)


@pytest.mark.parametrize("method", ["none", "fp16", "twobit", "scatter"])
def test_token_bucket_sends_its_burst_at_once(method):
    """A link shaped by a token bucket (tc tbf, the virtual cluster's) sends up to its burst at
    once: an exchange that fits in it costs what it costs on an infinitely fast link; a bigger
    one saves at most the burst's bytes at the rate; burst 0 is a plain link; and a bucket that
    the step's idle link cannot refill saves less than a full one."""
    small, big = [20000] * 4, [5000000] * 4
    kw = dict(latency_s=1e-4)
    plain = steptime.predict(small, method, 8, "100mbit", 0.05, BOUND, **kw).step_s
    assert steptime.predict(small, method, 8, "100mbit", 0.05, BOUND, burst_bytes=0,
                            **kw).step_s == plain
    free = steptime.predict(small, method, 8, "100tbit", 0.05, BOUND, **kw).step_s
    bucket = steptime.predict(small, method, 8, "100mbit", 0.05, BOUND, burst_bytes=1 << 20, **kw)
    assert bucket.step_s == pytest.approx(free, rel=1e-6) and free < plain - 1e-3
    B, beta = 100000, 8 / (1e8 * steptime.TCP_EFFICIENCY)
    a = steptime.predict(big, method, 8, "100mbit", 0.05, BOUND, **kw).step_s
    b = steptime.predict(big, method, 8, "100mbit", 0.05, BOUND, burst_bytes=B, **kw).step_s
    assert a - B * beta * 1.001 <= b < a
    # no compute: the link is idle only between collectives, so the bucket refills less
    busy = [steptime.predict(small, method, 8, "100mbit", 0.0, BOUND, burst_bytes=x, **kw).step_s
            for x in (0, 30000)]
    idle = [steptime.predict(small, method, 8, "100mbit", 0.2, BOUND, burst_bytes=x, **kw).step_s
            for x in (0, 30000)]
    assert 0 < busy[0] - busy[1] < idle[0] - idle[1]


def test_validation_predicts_the_emulations_token_bucket():
    """``advise validate`` gives the emulation's rows the links' own bucket (each veth end is a
    tbf of ``tbf_burst(rate, mtu)`` bytes) unless told otherwise."""
    from horovod_twobit.advisor import validate
    from horovod_twobit.cluster.hosts import tbf_burst
    assert validate._burst("100mbit", {}) == tbf_burst("100mbit", 1500) >= 64 * 1024
    assert validate._burst("1gbit", {"mtu": 9000}) == tbf_burst("1gbit", 9000)
    assert validate._burst("1gbit", {}, burst_bytes=0) == 0


def test_fusion_saves_messages():
    sizes = [1000] * 200
    fused = steptime.predict(sizes, "none", 32, "10gbit", 0.001, BOUND, latency_s=1e-4)
    alone = steptime.predict(sizes, "none", 32, "10gbit", 0.001, BOUND, latency_s=1e-4,
                             fusion_bytes=1)
    assert alone.step_s > 3 * fused.step_s


def test_codec_cost_is_charged():
    sizes = steptime.sizes_from("50M")
    fast = json.loads(json.dumps(BOUND))
    for k in fast["codec"]:
        fast["codec"][k][0] = fast["codec"][k][1] = 0.0
    cheap = steptime.predict(sizes, "twobit", 4, "100gbit", 0.05, fast)
    slow = json.loads(json.dumps(fast))
    for k in slow["codec"]:
        slow["codec"][k][2] *= 100
        slow["codec"][k][3] *= 100
    dear = steptime.predict(sizes, "twobit", 4, "100gbit", 0.05, slow)
    assert dear.parts["codec"] == pytest.approx(
        100 * cheap.parts["codec"], rel=0.05)
    assert dear.step_s > cheap.step_s + 0.5 * (dear.parts["codec"] - cheap.parts["codec"])


def test_serial_cpu_profile_is_at_least_the_hosts_cpu_work():
    sizes = steptime.sizes_from("20M")
    for m in steptime.METHODS:
        p = steptime.predict(sizes, m, 4, "100gbit", 0.2, CPU)
        assert p.step_s >= p.parts["cpu"] - 1e-12
        assert p.step_s >= 0.2


def test_break_even_rate_separates_faster_and_slower():
    sizes = steptime.sizes_from("25.6M")
    r = steptime.break_even_rate(sizes, "scatter", 64, 0.1, BOUND)
    assert r and 1e8 < r < 1e12
    below = steptime.predict_all(sizes, 64, r / 2, 0.1, BOUND, methods=("none", "scatter"))
    above = steptime.predict_all(sizes, 64, r * 2, 0.1, BOUND, methods=("none", "scatter"))
    assert below["scatter"].step_s < below["none"].step_s
    assert above["scatter"].step_s > above["none"].step_s


def test_unknown_method():
    with pytest.raises(ValueError, match="method must be one of"):
        steptime.predict([10], "zip", 2, 1e9, 0.1, BOUND)


def test_calibrate_writes_a_usable_profile(tmp_path, monkeypatch):
    from horovod_twobit.torch.codec import compiled
    run, ran = compiled.run, []
    monkeypatch.setattr(compiled, "run", lambda name, *a: ran.append(name) or run(name, *a))
    limit = compiled.COMPILE_MIN_NUMEL
    path = tmp_path / "me.json"
    prof = calibrate.calibrate(str(path), sizes=(1024, 4096), ranks=(2, 3), compiled=False,
                               reps=1, name="me")
    # the eager codec was timed, and said so; the limit is back as it was
    assert not ran and "eager codec" in prof["source"] and compiled.COMPILE_MIN_NUMEL == limit
    back = steptime.load_profile(str(path))
    assert back["name"] == "me" and back["kind"] == "measured"
    assert back["codec_by_size"]["sizes"] == [1024, 4096]
    for k in steptime.CODEC_KEYS:
        assert len(back["codec"][k]) == 4 and min(back["codec"][k]) >= 0
        assert steptime.codec_s(back, k, 4096, 2) > 0
        assert len(back["codec_by_size"]["keys"][k]["per_value"]) == 2
    for k in ("sum_fp32_s", "sum_fp16_s", "copy_s_per_byte", "kernel_s_per_byte", "message_s"):
        assert prof[k] > 0
    assert steptime.predict([4096], "scatter", 2, 1e9, 0.01, str(path)).step_s > 0.01


def test_calibrate_times_a_bucket_of_members(tmp_path, monkeypatch):
    timed, time_codec = [], calibrate._time_codec

    def recording(n, N, reps, timer=None, device="cpu", members=1, **kw):
        timed.append((n, N, members))
        return time_codec(n, N, reps, timer, device, members, **kw)
    monkeypatch.setattr(calibrate, "_time_codec", recording)
    path = tmp_path / "me.json"
    prof = calibrate.calibrate(str(path), sizes=(256, 1024, 4096), ranks=(2, 3), compiled=False,
                               reps=1, name="me", members=16, tables=1, segment_values=0)
    # every size as one tensor, then a bucket of 16 members at the smallest size that gives each
    # member a word at least, at every N
    assert timed == [(n, N, 1) for n in (256, 1024, 4096) for N in (2, 3)] + [(256, 2, 16),
                                                                            (256, 3, 16)]
    back = steptime.load_profile(str(path))
    assert back["codec_members"]["members"] == 16 and back["codec_members"]["values"] == 256
    assert sorted(back["codec_members"]["keys"]) == sorted(steptime.CODEC_KEYS)
    assert [N for N, _ in back["member_points"]["points"]["finish_auto"]] == [2, 3]
    assert all(s > 0 for v in back["member_points"]["points"].values() for _, s in v)
    # the cost per member is the fit of the timed points, and what the profile charges
    assert back["codec_members"] == calibrate._fit_members(back["points"], back["member_points"])
    assert calibrate.refit(back)["codec_members"] == back["codec_members"]
    m0, m1 = back["codec_members"]["keys"]["encode_auto"]
    assert steptime.codec_s(back, "encode_auto", 256, 3, members=16) == pytest.approx(
        steptime.codec_s(back, "encode_auto", 256, 3) + 15 * (m0 + 3 * m1), rel=1e-12)
    timed.clear()
    assert "codec_members" not in calibrate.calibrate(None, sizes=(1024,), ranks=(2,), reps=1,
                                                      compiled=False, members=1, tables=1,
                                                      segment_values=0)
    assert timed == [(1024, 2, 1)]
    assert prof["codec_members"] == back["codec_members"]


def test_member_values():
    assert calibrate.member_values((4096, 65536), 64) == 4096
    assert calibrate.member_values((512, 4096, 65536), 64) == 4096
    assert calibrate.member_values((512, 768), 64) == 768


def test_fit_members_recovers_the_cost_per_member():
    pts = [(n, N, 1e-4 + 2e-5 * N + n * 1e-9) for n in (4096, 65536) for N in (2, 4, 8)]
    one = {N: s for n, N, s in pts if n == 4096}
    bucket = {"members": 64, "values": 4096,
              "points": {"encode": [(N, one[N] + 63 * (3e-6 + 5e-7 * N)) for N in (2, 4, 8)]}}
    fit = calibrate._fit_members({"encode": pts}, bucket)
    assert fit["members"] == 64 and fit["values"] == 4096
    assert fit["keys"]["encode"] == pytest.approx([3e-6, 5e-7], rel=1e-6)
    # no one-tensor time at the bucket's size and N: said, not guessed
    with pytest.raises(ValueError, match="one tensor of 1000 values"):
        calibrate._fit_members({"encode": pts}, dict(bucket, values=1000))


def _per_member(prof, m0=4e-6, m1=1e-6):
    return dict(prof, codec_members={"members": 64, "values": 4096, "keys": {
        k: [m0 * (2 if k.endswith("auto") else 1), m1] for k in steptime.CODEC_KEYS}})


def test_codec_charges_each_member_beyond_the_first():
    prof = _per_member(CPU)
    for k in steptime.CODEC_KEYS:
        one = steptime.codec_s(CPU, k, 5000, 4)
        assert steptime.codec_s(prof, k, 5000, 4) == pytest.approx(one, rel=1e-12)
        m0 = 8e-6 if k.endswith("auto") else 4e-6
        assert steptime.codec_s(prof, k, 5000, 4, members=10) == pytest.approx(
            one + 9 * (m0 + 4e-6), rel=1e-12)
        assert steptime.codec_s(CPU, k, 5000, 4, members=10) == one
    # a model of many small tensors: its buckets' members charged in the step's codec
    sizes = [300] * 40 + [4096] * 10
    for m in ("twobit", "auto", "scatter", "scatter_auto"):
        base = steptime.predict(sizes, m, 4, "1gbit", 0.02, CPU)
        more = steptime.predict(sizes, m, 4, "1gbit", 0.02, prof)
        buckets = base.parts["collectives"]
        calls = 3 if m.startswith("scatter") else 2
        m0 = 8e-6 if m.endswith("auto") else 4e-6
        assert more.parts["codec"] - base.parts["codec"] == pytest.approx(
            calls * (len(sizes) - buckets) * (m0 + 4e-6), rel=1e-9)
        assert more.step_s > base.step_s
    for m in ("none", "fp16"):
        assert steptime.predict(sizes, m, 4, "1gbit", 0.02, prof).step_s == \
            steptime.predict(sizes, m, 4, "1gbit", 0.02, CPU).step_s


def test_layout_tables_and_the_calibration_buckets():
    # one reduction call a table (the compressor's blocks): rows far apart in length each make
    # their own; the twin, of equal members, one
    blocks = layout.wire.validate_blocks("auto")
    for T in (2, 3):
        distinct, equal = calibrate.table_numels(T)
        assert len(distinct) == len(equal) == T and sum(distinct) == sum(equal)
        assert layout.Layout(distinct, True, *blocks).table_count == T
        assert layout.Layout(equal, True, *blocks).table_count == 1
        assert layout.Layout(distinct, False).table_count == 0
    # the count is the tables the codec reduces, words or not
    cnn = [432, 16, 4608, 32, 9216, 32, 5120, 10]
    for numels in (distinct, equal, cnn, [1 << 20], [5000]):
        lay = layout.Layout(numels, True, *blocks)
        with_words = lay.tables()
        assert lay.table_count == len(with_words) == len(levels.Tables(lay, "cpu").tables)
        assert sorted(k for t in with_words for k in t[4]) == list(range(lay.segments))
    assert layout.Layout(cnn, True, *blocks).table_count == 2
    assert layout.Layout(cnn, True).table_count == 3  # one segment a member


def test_fit_tables_recovers_the_cost_per_table():
    timed = {"tables": 3, "numels": calibrate.table_numels(3)[0], "points": {
        "encode_auto": [(N, 1e-3 + 2 * (2e-4 + 3e-6 * N), 1e-3) for N in (2, 4, 8)],
        "finish_auto": [(N, 1e-3, 1e-3 + 1e-6) for N in (2, 4, 8)]}}
    fit = calibrate._fit_tables(timed)
    assert fit["tables"] == 3
    assert fit["keys"]["encode_auto"] == pytest.approx([2e-4, 3e-6], rel=1e-6)
    assert fit["keys"]["finish_auto"] == [0.0, 0.0]  # never below zero


def test_calibrate_times_a_bucket_of_tables(tmp_path, monkeypatch):
    timed, time_codec = [], calibrate._time_codec

    def recording(n, N, reps, timer=None, device="cpu", members=1, numels=None,
                  autos=(False, True), blocks=None):
        timed.append((N, numels, autos))
        return time_codec(n, N, reps, timer, device, members, numels, autos, blocks)
    monkeypatch.setattr(calibrate, "_time_codec", recording)
    path = tmp_path / "me.json"
    calibrate.calibrate(str(path), sizes=(256, 1024), ranks=(2, 3), compiled=False, reps=1,
                        members=1, tables=2, segment_values=0)
    distinct, equal = calibrate.table_numels(2)
    # each size as one tensor, then at every N the bucket of 2 tables and its twin, "auto" only
    assert timed == [(N, None, (False, True)) for _ in (256, 1024) for N in (2, 3)] + [
        (N, numels, (True,)) for N in (2, 3) for numels in (distinct, equal)]
    back = steptime.load_profile(str(path))
    auto_keys = sorted(k for k in steptime.CODEC_KEYS if k.endswith("_auto"))
    assert sorted(back["codec_tables"]["keys"]) == auto_keys
    assert [row[0] for row in back["table_points"]["points"]["encode_auto"]] == [2, 3]
    assert back["codec_tables"] == calibrate._fit_tables(back["table_points"])
    assert calibrate.refit(back)["codec_tables"] == back["codec_tables"]
    t0, t1 = back["codec_tables"]["keys"]["encode_auto"]
    assert min(t0, t1) >= 0  # fitted, never below zero (how much: a timing, not asserted)
    assert steptime.codec_s(back, "encode_auto", 5000, 3, tables=5) == pytest.approx(
        steptime.codec_s(back, "encode_auto", 5000, 3) + 4 * (t0 + 3 * t1), rel=1e-12)
    assert steptime.codec_s(back, "encode", 5000, 3, tables=5) == \
        steptime.codec_s(back, "encode", 5000, 3)  # a numeric threshold: no such cost


def _per_table(prof, t0=2e-4, t1=1e-5):
    return dict(prof, codec_tables={"tables": 8, "keys": {
        k: [t0, t1] for k in steptime.CODEC_KEYS if k.endswith("_auto")}})


def test_the_model_charges_each_table_of_an_auto_bucket():
    prof = _per_table(CPU)
    # members of three lengths far apart: three tables; the model's "auto" calls pay two more
    sizes = calibrate.table_numels(3)[0]
    tables = layout.Layout(sizes, True, *layout.wire.validate_blocks("auto")).table_count
    assert tables == 3
    for m, calls in (("auto", ("encode_auto", "finish_auto")),
                     ("scatter_auto", ("scatter_encode_auto", "owner_auto",
                                       "scatter_finish_auto"))):
        base = steptime.predict(sizes, m, 4, "1gbit", 0.02, CPU)
        more = steptime.predict(sizes, m, 4, "1gbit", 0.02, prof)
        assert base.parts["collectives"] == 1
        assert more.parts["codec"] - base.parts["codec"] == pytest.approx(
            len(calls) * (tables - 1) * (2e-4 + 4 * 1e-5), rel=1e-9)
        assert more.step_s > base.step_s
    for m in ("none", "fp16", "twobit", "scatter"):
        assert steptime.predict(sizes, m, 4, "1gbit", 0.02, prof).step_s == \
            steptime.predict(sizes, m, 4, "1gbit", 0.02, CPU).step_s


def test_extra_segments_count_what_a_bucket_adds_to_one_tensor():
    blocks = layout.wire.validate_blocks("auto")
    assert layout.Layout([1 << 20], True, *blocks).extra_segments == 0  # 64 blocks, as it
    assert layout.Layout([1 << 20], False).extra_segments == 0
    # 100 members of 4096 values: 64 blocks each; one tensor of their 409600 values: 50 blocks
    # of 8192
    lay = layout.Layout([4096] * 100, True, *blocks)
    assert layout.Layout([409600], True, *blocks).segments == 50
    assert lay.segments == 6400 and lay.extra_segments == 6400 - 50
    # members of one segment each, fewer than one tensor's blocks: none beyond it
    assert layout.Layout([64] * 10, True, *blocks).extra_segments == 0


def test_calibrate_times_a_tensor_in_segments(tmp_path, monkeypatch):
    timed, time_codec = [], calibrate._time_codec

    def recording(n, N, reps, timer=None, device="cpu", members=1, numels=None,
                  autos=(False, True), blocks=None):
        timed.append((N, numels, autos, blocks))
        return time_codec(n, N, reps, timer, device, members, numels, autos, blocks)
    monkeypatch.setattr(calibrate, "_time_codec", recording)
    path = tmp_path / "me.json"
    calibrate.calibrate(str(path), sizes=(256,), ranks=(2, 3), compiled=False, reps=1,
                        members=1, tables=1, segment_values=16384)
    cut = layout.wire.validate_blocks("auto")
    # at every N: 16384 values in blocks of 64 (256 segments) and as the compressor cuts them (64)
    assert timed[2:] == [(N, [16384], (True,), c) for N in (2, 3) for c in ((64, None), cut)]
    back = steptime.load_profile(str(path))
    assert back["segment_points"]["segments"] == [256, 64]
    assert sorted(back["codec_segments"]["keys"]) == sorted(
        k for k in steptime.CODEC_KEYS if k.endswith("_auto"))
    assert back["codec_segments"] == calibrate._fit_segments(back["segment_points"])
    assert calibrate.refit(back)["codec_segments"] == back["codec_segments"]
    s0, s1 = back["codec_segments"]["keys"]["encode_auto"]
    assert min(s0, s1) >= 0  # fitted, never below zero (how much: a timing, not asserted)
    # a tensor the compressor cuts as finely as blocks of 64: no segments to time, said
    with pytest.raises(ValueError, match="segment_values.*more than 4096"):
        calibrate.calibrate(None, sizes=(256,), ranks=(2,), reps=1, members=1, tables=1,
                            segment_values=4096)
    assert steptime.codec_s(back, "encode_auto", 5000, 3, segments=40) == pytest.approx(
        steptime.codec_s(back, "encode_auto", 5000, 3) + 40 * (s0 + 3 * s1), rel=1e-12)


def test_fit_segments_recovers_the_cost_per_segment():
    timed = {"values": 65536, "segments": [1024, 64], "points": {
        "encode_auto": [(N, 1e-3 + 960 * (3e-7 + 1e-8 * N), 1e-3) for N in (2, 4, 8)]}}
    fit = calibrate._fit_segments(timed)
    assert fit["segments"] == [1024, 64] and fit["values"] == 65536
    assert fit["keys"]["encode_auto"] == pytest.approx([3e-7, 1e-8], rel=1e-6)


def test_the_model_charges_each_segment_beyond_one_tensors():
    prof = dict(CPU, codec_segments={"values": 65536, "segments": [1024, 64], "keys": {
        k: [3e-7, 1e-8] for k in steptime.CODEC_KEYS if k.endswith("_auto")}})
    sizes = [4096] * 100  # one bucket, 6350 segments beyond one tensor's
    extra = layout.Layout(sizes, True, *layout.wire.validate_blocks("auto")).extra_segments
    for m, calls in (("auto", 2), ("scatter_auto", 3)):
        base = steptime.predict(sizes, m, 4, "1gbit", 0.02, CPU)
        more = steptime.predict(sizes, m, 4, "1gbit", 0.02, prof)
        assert base.parts["collectives"] == 1
        assert extra == 6350 and more.parts["codec"] - base.parts["codec"] == pytest.approx(
            calls * extra * (3e-7 + 4e-8), rel=1e-9)
    for m in ("none", "twobit", "scatter"):
        assert steptime.predict(sizes, m, 4, "1gbit", 0.02, prof).step_s == \
            steptime.predict(sizes, m, 4, "1gbit", 0.02, CPU).step_s


@pytest.mark.parametrize("entry", ["codec_tables", "codec_segments"])
def test_costs_per_table_and_segment_are_checked(tmp_path, entry):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(dict(CPU, **{entry: {"keys": {"encode_auto": [1e-6, -1.0]}}})))
    with pytest.raises(ValueError, match=entry + ".*calibrate again"):
        steptime.load_profile(str(path))


def test_calibrate_times_either_side_of_the_compiled_switch(tmp_path, monkeypatch):
    from horovod_twobit.torch.codec import compiled
    switch = compiled.COMPILE_MIN_NUMEL
    assert calibrate.timed_sizes((4096, 1 << 20), switch) == [4096, switch - 16, 1 << 20]
    assert calibrate.timed_sizes((1 << 20, 4096, 4096), switch) == [4096, switch - 16, 1 << 20]
    assert calibrate.timed_sizes((4096, switch), 1 << 20) == [4096, switch]  # not straddled
    assert calibrate.timed_sizes((switch, 1 << 20), switch) == [switch, 1 << 20]
    # the codec is timed as a step runs it: at the runtime's switch (or every size eager)
    seen, time_codec = [], calibrate._time_codec

    def recording(n, *a, **kw):
        seen.append((n, compiled.COMPILE_MIN_NUMEL))
        return time_codec(n, *a, **kw)
    monkeypatch.setattr(calibrate, "_time_codec", recording)
    monkeypatch.setattr(compiled, "COMPILE_MIN_NUMEL", 2048)
    prof = calibrate.calibrate(None, sizes=(1024, 4096), ranks=(2,), reps=1, members=1, tables=1,
                               segment_values=0)
    assert seen == [(1024, 2048), (2032, 2048), (4096, 2048)]
    assert compiled.COMPILE_MIN_NUMEL == 2048 and prof["compile_min_numel"] == 2048
    assert prof["codec_by_size"]["sizes"] == [1024, 2032, 4096]
    assert "compiled from 2048 values, eager below" in prof["source"]
    seen.clear()
    prof = calibrate.calibrate(None, sizes=(1024, 4096), ranks=(2,), reps=1, members=1, tables=1,
                               segment_values=0, compiled=False)
    assert seen == [(1024, 1 << 62), (4096, 1 << 62)] and prof["compile_min_numel"] is None
    assert compiled.COMPILE_MIN_NUMEL == 2048


def test_costs_per_member_are_checked(tmp_path):
    path = tmp_path / "bad.json"
    bad = _per_member(CPU)
    bad["codec_members"]["keys"]["encode"] = [1e-6]
    path.write_text(json.dumps(bad))
    with pytest.raises(ValueError, match="codec_members.*calibrate again"):
        steptime.load_profile(str(path))


def test_calibrate_on_a_gpu_needs_the_wall_clock():
    with pytest.raises(ValueError, match=r"clock=\"wall\" \(--clock wall\)"):
        calibrate.calibrate(None, sizes=(1024,), ranks=(2,), reps=1, device="cuda")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="sees no CUDA device.*--device cpu"):
            calibrate.calibrate(None, sizes=(1024,), ranks=(2,), reps=1, device="cuda",
                                clock="wall")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_calibrate_on_a_gpu_writes_a_usable_profile(tmp_path):
    path = tmp_path / "gpu.json"
    prof = calibrate.calibrate(str(path), sizes=(1 << 16, 1 << 18), ranks=(2, 3), reps=1,
                               name="gpu", clock="wall", min_wall_s=0.01, device="cuda")
    back = steptime.load_profile(str(path))
    assert back["kind"] == "measured" and back["serial"] is False
    assert torch.cuda.get_device_name() in back["source"]
    for k in steptime.CODEC_KEYS:
        assert min(back["codec"][k]) >= 0 and steptime.codec_s(back, k, 1 << 18, 2) > 0
    assert prof["sum_fp16_s"] > 0 and prof["optimizer_s"] > 0


def test_fit_recovers_coefficients():
    pts = [(n, N, 1e-3 + 2e-5 * N + n * (3e-9 + 4e-10 * N)) for n in (1e4, 1e6) for N in (2, 8)]
    assert calibrate._fit(pts) == pytest.approx([1e-3, 2e-5, 3e-9, 4e-10], rel=1e-6)


def test_fit_by_size_recovers_each_sizes_rate():
    rate = {1 << 16: (2e-9, 1e-10), 1 << 20: (2e-9, 1e-10), 1 << 24: (5e-9, 3e-10)}
    pts = [(n, N, 1e-3 + 2e-5 * N + n * (a + b * N)) for n, (a, b) in rate.items() for N in (2, 4, 8)]
    fit = calibrate._fit_by_size(pts)
    assert fit["fixed"] == pytest.approx([1e-3, 2e-5], rel=1e-6)
    assert fit["per_value"] == [pytest.approx(list(rate[n]), rel=1e-6) for n in sorted(rate)]
    again = calibrate.refit({"points": {k: pts for k in steptime.CODEC_KEYS}, "codec": {}})
    assert again["codec_by_size"]["keys"]["encode"] == fit


def _two_sizes(prof):
    """``prof`` with every codec call at 1e-4 s + 2e-5 s N fixed and a per-value rate of
    (1 + 0.1 N) ns at 1 M values and (3 + 0.3 N) ns at 4 M."""
    return dict(prof, codec_by_size={"sizes": [1 << 20, 1 << 22], "keys": {
        k: {"fixed": [1e-4, 2e-5], "per_value": [[1e-9, 1e-10], [3e-9, 3e-10]]}
        for k in steptime.CODEC_KEYS}})


@pytest.mark.parametrize("values,a,b", [(1 << 20, 1e-9, 1e-10),          # at the points
                                        (1 << 22, 3e-9, 3e-10),
                                        (1 << 21, 2e-9, 2e-10),          # between: log-midpoint
                                        (1 << 16, 1e-9, 1e-10),          # beyond: the end points
                                        (1 << 26, 3e-9, 3e-10)])
def test_rate_by_size_at_between_and_beyond_the_points(values, a, b):
    prof = _two_sizes(CPU)
    assert steptime.codec_s(prof, "encode_auto", values, 4) == pytest.approx(
        1e-4 + 2e-5 * 4 + values * (a + b * 4), rel=1e-12)


def test_profile_without_rates_by_size_predicts_as_its_codec_says(tmp_path):
    old = {k: v for k, v in CPU.items() if k != "codec_by_size"}
    path = tmp_path / "old.json"
    path.write_text(json.dumps(old))
    back = steptime.load_profile(str(path))
    for k in steptime.CODEC_KEYS:
        c0, c1, a, b = old["codec"][k]
        assert steptime.codec_s(back, k, 5 << 20, 8) == pytest.approx(
            max(0.0, c0 + 8 * c1 + (5 << 20) * (a + 8 * b)), rel=1e-12)
    sizes = [1 << 24, 1 << 22, 4096, 300]
    for m in ("twobit", "auto", "scatter", "scatter_auto"):
        flat = steptime.predict(sizes, m, 4, "1gbit", 0.2, back)
        same = _two_sizes(back)
        same["codec_by_size"]["keys"] = {k: {"fixed": old["codec"][k][:2],
                                             "per_value": [old["codec"][k][2:]] * 2}
                                         for k in steptime.CODEC_KEYS}
        assert steptime.predict(sizes, m, 4, "1gbit", 0.2, same).step_s == pytest.approx(
            flat.step_s, rel=1e-12)
        assert steptime.predict(sizes, m, 4, "1gbit", 0.2, _two_sizes(back)).step_s != flat.step_s


def test_rates_by_size_are_checked(tmp_path):
    path = tmp_path / "bad.json"
    bad = _two_sizes({k: v for k, v in CPU.items() if k != "codec_by_size"})
    bad["codec_by_size"]["keys"]["encode"]["per_value"].pop()
    path.write_text(json.dumps(bad))
    with pytest.raises(ValueError, match="codec_by_size"):
        steptime.load_profile(str(path))


def test_two_ranks_allgather_sends_then_receives_on_cpu_hosts():
    """Gloo's ring allgather between two ranks (one peer on both sides) sends and then receives:
    on a CPU profile its bytes cost twice their time at 2 ranks, and only there: not at 3 or 4,
    not for the allreduce or the alltoall, not on a GPU profile (NCCL). A 2-rank TwoBit step
    rises by one payload's time more, and no compression's not at all."""
    from horovod_twobit.model import collectives
    gpu = steptime.load_profile("h200")
    assert CPU["serial"] and not gpu["serial"]
    nbytes = 4 << 20

    for kind in ("allgather", "scatter_allgather"):
        assert collectives.allgather_pace(kind, 2, CPU) == 2.0
        assert collectives.allgather_pace(kind, 2, gpu) == 1.0
        assert [collectives.allgather_pace(kind, n, CPU) for n in (3, 4, 64)] == [1.0] * 3
        wire = collectives.Wire.of_link(2, "1gbit", 0.0, CPU)
        both = collectives.collective_seconds(kind, 2, nbytes, 1, wire, CPU)
        once = collectives.collective_seconds(kind, 2, nbytes, 1, wire, dict(CPU, serial=False))
        assert both - once == pytest.approx(nbytes * wire.beta, rel=1e-9)
    for kind in ("allreduce", "alltoall"):
        assert collectives.allgather_pace(kind, 2, CPU) == 1.0
        assert collectives.allgather_pace(kind, 2, dict(CPU, allgather_pace=3.0)) == 1.0
    # a pace the profile measured (the fallback's link) stands for the rule, at any N
    for n in (2, 4):
        for prof in (CPU, gpu):
            assert collectives.allgather_pace("allgather", n, dict(prof, allgather_pace=1.5)) \
                == 1.5
    sizes = [1 << 22]
    payload = steptime.exchange_bytes(sizes, "twobit", 2)
    wire = collectives.Wire.of_link(2, "100mbit", 0.0, CPU)
    step = lambda m, p: steptime.predict(sizes, m, 2, "100mbit", 0.01, p).step_s  # noqa: E731
    assert step("twobit", CPU) - step("twobit", dict(CPU, serial=False)) == pytest.approx(
        payload * wire.beta, rel=1e-6)
    assert step("none", CPU) == step("none", dict(CPU, serial=False))
    # a payload the links' token buckets hold (refilled during a long compute) goes at once,
    # both ways
    wire_s = lambda p, burst: steptime.predict(  # noqa: E731
        sizes, "twobit", 2, "100mbit", 1.0, p, burst_bytes=burst).parts["exchange"]
    assert wire_s(CPU, 2 * payload) == pytest.approx(wire_s(dict(CPU, serial=False), 2 * payload))
    assert wire_s(CPU, payload / 2) - wire_s(dict(CPU, serial=False), payload / 2) == pytest.approx(
        payload / 2 * wire.beta, rel=1e-6)
