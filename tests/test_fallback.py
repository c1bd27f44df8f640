"""The fallback of TwoBitCompressor (fallback="always" / "auto") in real 2-rank jobs, PyTorch
(hvd.DistributedOptimizer) and TensorFlow (hvd.DistributedGradientTape in a tf.function), against
the NumPy reference bit for bit: a bucket sent uncompressed carries g + r exactly and leaves a
zero residual; switching between the compressed and the plain path at any step loses nothing; a
NaN step keeps the residuals; "auto" measures the link and every rank decides alike."""

import json

import numpy as np
import pytest

import jobs
import sim
from horovod_twobit import reference as ref
from horovod_twobit.state import fallback
from horovod_twobit.state.fallback import validate_fallback

pytestmark = pytest.mark.slow
SWITCH = ["compressed", "compressed", "plain", "plain", "compressed", "plain"]  # the workers'
HANDBACK = 4  # the workers' step before which "handback" loads residuals that are not zero
CONFIGS = ["0.05:allgather:always", "auto:scatter:switch", "0.05:allgather:switch",
           "0.05:allgather:auto", "auto:allgather:checked"]
# PyTorch's settled plain buckets go to Horovod's own allreduce, and come back from it
CONFIGS_OF = {"torch": CONFIGS + ["0.05:allgather:handback"], "tf": CONFIGS}
CASES = [(fw, i) for fw, configs in CONFIGS_OF.items() for i in range(len(configs))]


def _ranks(tmp_path_factory, framework, index):
    def job():
        out = tmp_path_factory.mktemp("fallback")
        res = jobs.run(2, "%s_fallback.py" % framework, "--out", out, "--configs",
                       *CONFIGS_OF[framework], timeout=600)
        return res, out
    res, out = jobs.shared(("fallback", framework), job)
    return res, sim.load_ranks(str(out / str(index)), 2)


@pytest.mark.parametrize("framework,index", CASES,
                         ids=["%s-%s" % (fw, CONFIGS_OF[fw][i]) for fw, i in CASES])
def test_fallback_matches_reference(tmp_path_factory, framework, index):
    res, ranks = _ranks(tmp_path_factory, framework, index)
    threshold, exchange, mode = CONFIGS_OF[framework][index].split(":")
    w = ref.Workers(2, threshold if threshold == "auto" else float(threshold), exchange=exchange)
    groups = [g.split(",") for g in ranks[0]["groups"].tolist()]
    plain_steps, zero = 0, {}  # zero: bucket -> its residuals are known to be zero
    # PyTorch, a bucket settled plain ("always"): once a step went plain with its residuals
    # known to be zero, the next ones are Horovod's own allreduce of g ("direct"), until
    # residuals are loaded
    settles = framework == "torch" and mode in ("always", "handback")
    streamed = {}  # bucket -> its last step sent g alone (residuals known to be zero)
    hand_steps = 0  # steps of the check sent plain through Horovod's own allreduce
    steps = sum(1 for k in ranks[0] if k.startswith("decisions/"))
    # "checked": the longest two blocks of one round (3 modes), its step 0, the step that
    # decides and one after it
    assert steps == (len(fallback.MODE_NAMES) * fallback.TURN * 2 + 3 if mode == "checked"
                     else len(SWITCH))
    for step in range(steps):
        if mode == "handback" and step == HANDBACK:
            for rank in range(2):
                for n in w.residuals[rank]:
                    w.residuals[rank][n][:] = np.float32(0.01 * (rank + 1))
            zero, streamed = {}, {}
        # "checked": from the step that decides, a bucket kept plain is settled plain too
        settled = settles or (framework == "torch" and mode == "checked"
                              and step > len(_schedule(ranks[0])))
        direct = [settled and streamed.get(gi, False) for gi in range(len(groups))]
        if framework == "torch":
            # a check's plain step after a plain one (its residuals zero) goes to Horovod's own
            # allreduce: "checked" knows its schedule; "auto" at least keeps to the rule
            handed = [bool(r["handed/%d" % step]) for r in ranks]
            assert handed[0] == handed[1], step
            all_plain = all(d == "plain" for d in ranks[0]["decisions/%d" % step].tolist())
            may = (mode in ("auto", "checked") and step >= 2 and all_plain
                   and all(zero.get(gi, False) for gi in range(len(groups))))
            if mode == "checked":
                assert handed[0] == (may and step <= len(_schedule(ranks[0]))), step
            else:
                assert may or not handed[0], step
            hand_steps += handed[0]
            direct = [d or handed[0] for d in direct]
        decisions = ranks[0]["decisions/%d" % step].tolist()
        assert all(r["decisions/%d" % step].tolist() == decisions for r in ranks)
        if mode in ("always", "handback"):
            assert decisions == ["plain", "plain"]
        elif mode == "switch":
            assert decisions == [SWITCH[step]] * 2
        elif mode == "checked":
            assert decisions == _checked(ranks[0], step), step
        for g, d, straight in zip(groups, decisions, direct):
            local = [[r["local/%d/%s" % (step, n)] for n in g] for r in ranks]
            want = w.plain(g, local, direct=straight) if d == "plain" else w.bucket(g, local)
            plain_steps += d == "plain"
            for n, x in zip(g, want):
                for rank, r in enumerate(ranks):
                    np.testing.assert_array_equal(r["agg/%d/%s" % (step, n)], x,
                                                  err_msg="step %d %s rank %d" % (step, n, rank))
                    np.testing.assert_array_equal(r["res/%d/%s" % (step, n)],
                                                  w.residuals[rank][n].reshape(-1))
                    if d == "plain" and np.isfinite(x).all():
                        assert not r["res/%d/%s" % (step, n)].any()
        for r in ranks:
            want_ex = ["plain" if d == "plain" else exchange for d in decisions]
            assert r["exchanges/%d" % step].tolist() == want_ex
            # the float32 values a plain bucket hands to Horovod's allreduce (0 where no bucket
            # went plain): PyTorch sends a bucket of several tensors as its flat buffer, each
            # member padded to whole 16-value words, unless its residuals are known to be zero
            # (its last step went plain): then each member as it arrives; TensorFlow and a
            # tensor alone, the values
            plain_values = 0
            for gi, (g, d) in enumerate(zip(groups, decisions)):
                sizes = [r["agg/%d/%s" % (step, n)].size for n in g]
                if d != "plain":
                    continue
                padded = framework == "torch" and len(g) > 1 and not zero.get(gi)
                plain_values += sum(-(-n // 16) * 16 for n in sizes) if padded else sum(sizes)
            assert int(r["plain_bytes/%d" % step]) == 4 * plain_values
        for gi, (g, d) in enumerate(zip(groups, decisions)):
            finite = all(np.isfinite(ranks[0]["agg/%d/%s" % (step, n)]).all() for n in g)
            streamed[gi] = d == "plain" and zero.get(gi, False)
            zero[gi] = d == "plain" and (zero.get(gi, False) or finite)
        if framework == "torch":  # the optimizer hands its steps to Horovod from the next on
            handed = settled and all(streamed.values())
            assert all(bool(r["direct/%d" % step]) == handed for r in ranks), step
    if settles:
        assert any(bool(ranks[0]["direct/%d" % s]) for s in range(len(SWITCH)))
    if framework == "torch" and mode == "checked":
        assert hand_steps > 0
    if mode != "auto":
        assert plain_steps > 0
    if framework == "tf" and mode in ("auto", "checked"):
        # the check's step start waits for the gradients (the ops of the backward pass that
        # make them among its control inputs; none without the dependency)
        for r in ranks:
            starts = r["check_starts"].tolist()
            assert len(starts) == 1 and starts[0] >= 2, starts
            # and the checked exchanges start after it, whatever their mode
            after = r["mode_after_start"].tolist()
            assert after and all(after), after
            if mode == "checked":  # its last step traced anew: the kept mode, no check made
                assert int(r["retraced_check_ops"]) == 0 and int(r["checks_made"]) == 1
    if mode == "checked":  # the schedule ran, and rank 0's medians chose one mode for all
        checks = [json.loads(str(r["checks"])) for r in ranks]
        assert checks[0] == checks[1] and len(checks[0]) == 1, checks
        assert checks[0][0]["kept"] == "plain", checks  # (the workers' check keeps plain)
        assert checks[0][0]["steps"] == len(_schedule(ranks[0])), checks
        assert res.output.count("fallback checked over") == 2, res
        assert res.output.count("fallback check not sure after") == 2, res  # one round is not
    for n in ranks[0]:
        if n.startswith("w/"):
            np.testing.assert_array_equal(ranks[1][n], ranks[0][n])
            assert np.isfinite(ranks[0][n]).all()
    if mode == "auto":
        assert "Link(" in str(ranks[0]["link"]) and "bytes/s" in str(ranks[0]["link"])
        # the allgather was timed (an untimed one leaves the pace at exactly 1), rank 0's pace
        # on every rank
        paces = [r["link_allgather"].tolist() for r in ranks]
        assert paces[0] and all(p == paces[0] for p in paces), paces
        assert all(np.isfinite(p) and p > 0 and p != 1.0 for p in paces[0]), paces
        # logged once per bucket and rank: 2 buckets in the "always", "auto", "checked" (and
        # "handback") configurations
        logged = [c for c in CONFIGS_OF[framework] if c.split(":")[2] != "switch"]
        assert res.output.count("horovod-twobit: bucket") == 4 * len(logged), res
    want = "fallback=%r" % ("always" if mode in ("always", "handback") else "auto")
    assert all(want in str(r["repr"]) for r in ranks), ranks[0]["repr"]


@pytest.mark.parametrize("index", range(len(CONFIGS_OF["torch"])), ids=CONFIGS_OF["torch"])
def test_torch_collectives_keep_one_shape_per_name(tmp_path_factory, index):
    """Every collective a bucket submits keeps one collective, shape and dtype under its name,
    whatever the steps switch between: Horovod's response cache keys on the name alone, and a
    cached name that comes with another shape or collective is renegotiated by every rank in
    that cycle. (A plain step's g + r sent as one flat buffer once shared its name with the
    bucket's first member sent alone; a compressed payload's allgather, with that member's
    allreduce once the optimizer hands its gradients to Horovod.)"""
    _, ranks = _ranks(tmp_path_factory, "torch", index)
    for r in ranks:
        got = json.loads(str(r["collectives"]))
        assert got, "no collective recorded"
        if CONFIGS_OF["torch"][index].endswith(("always", "handback")):
            # members alone, under their own names, once the residuals are zero
            assert set(r["names"].tolist()) <= set(got), sorted(got)
        for name, shapes in got.items():
            if CONFIGS_OF["torch"][index].split(":")[1] == "scatter" and name.endswith(".twobit"):
                # the scatter exchange's plan, allgathered once under the name its ranks would
                # allgather payloads under with the other exchange (so a disagreement meets)
                shapes = [s for s in shapes if s[0] != "allgather"]
            assert len(shapes) == 1, (name, shapes)


def test_plain_wait_sleeps_while_another_rank_is_late():
    """A plain step waits as the compressed ones do, polling with sleeps: Horovod's own wait
    spins on sched_yield, and on a host held to a CPU quota (the emulated cluster's) that took
    the CPU the collective needed (plain steps at 3-5x no compression's). Rank 1 is 1.2 s late
    at a step sent as g + r and at one sent member by member; rank 0's training thread spends
    little CPU waiting, and the steps after agree on every rank. (From the step after that one,
    the buckets are settled plain and the optimizer's steps are Horovod's own, which waits as
    Horovod does: rank 1 is late there too, and the results still agree.)"""
    res = jobs.run(2, "torch_plain_wait.py", timeout=240)
    recs = sorted((json.loads(line.split("RESULT ", 1)[1]) for line in res.output.splitlines()
                   if "RESULT " in line), key=lambda r: r["rank"])
    assert len(recs) == 2, res
    waits = recs[0]["waits"]
    for step in (0, 1, 3):
        wall, cpu = waits[step]
        assert wall > 0.6, waits  # it did wait for rank 1 (about 1.2 s; not 5 ms)
        if step < 3:
            assert cpu < 0.25 * wall, waits  # sleeping, not spinning
    assert recs[0]["direct"] == [False, True, True, True, True, True], recs[0]["direct"]
    assert recs[0]["grads"] == recs[1]["grads"]  # every step, the late ones and those after
    assert recs[0]["weights"] == recs[1]["weights"]
    assert all(np.isfinite(w).all() for w in recs[0]["weights"])
    assert recs[0]["exchanges"].get("plain", 0) > 0, recs[0]["exchanges"]


def _schedule(rank):
    """The checked configuration's schedule, from the model's picks at step 0 (its workers
    check every job: one round of each mode a block, no warmup; one round is never sure, so
    both blocks run)."""
    picks = [d == "plain" for d in rank["decisions/0"].tolist()]
    modes = fallback.candidates(picks, 1.0, 1.0)
    assert len(modes) >= 2, picks
    return fallback.schedule(modes, 0, 2)


def _checked(rank, step):
    """The decisions the checked configuration's step must have made: the picks at step 0, the
    schedule's modes after it, then the mode kept."""
    picks = [d == "plain" for d in rank["decisions/0"].tolist()]
    sched = _schedule(rank)
    if step == 0:
        mode = fallback.MODEL
    elif step <= len(sched):
        mode = sched[step - 1]
    else:
        kept = json.loads(str(rank["checks"]))[0]["kept"]
        mode = fallback.MODE_NAMES.index(kept)
    return ["plain" if fallback.is_plain(mode, p) else "compressed" for p in picks]


def test_fallback_argument_is_checked():
    for ok in (None, "auto", "always"):
        assert validate_fallback(ok) == ok
    with pytest.raises(ValueError, match="fallback must be None"):
        validate_fallback("yes")


def test_fallback_function_arguments_and_no_check():
    """fallback_function refuses what is not a TwoBitCompressor, tf.function options beside a
    tf.function, and what is not callable, naming the fix; with no checked fallback it is the
    tf.function it was given, or tf.function(fn), and never traced anew."""
    tf = pytest.importorskip("tensorflow")
    from horovod_twobit.tensorflow import TwoBitCompressor, fallback_function
    double = lambda x: 2.0 * x  # noqa: E731
    with pytest.raises(TypeError, match="needs the TwoBitCompressor"):
        fallback_function(double, object())
    c = TwoBitCompressor(0.5)
    with pytest.raises(ValueError, match="give the options to tf.function"):
        fallback_function(tf.function(double), c, jit_compile=True)
    with pytest.raises(TypeError, match="Python function"):
        fallback_function(42, c)
    given = tf.function(double)
    for fn, always in ((double, c), (given, TwoBitCompressor(0.5, fallback="always"))):
        step = fallback_function(fn, always)
        first = step.function
        assert step.retraced and (first is given) == (fn is given)
        assert float(step(tf.constant(1.5))) == 3.0 and float(step(tf.constant(2.0))) == 4.0
        assert step.function is first  # never traced anew
        assert step.experimental_get_tracing_count() == 1  # tf.function's face, forwarded
    with_options = fallback_function(double, c, reduce_retracing=True)
    assert with_options.function._reduce_retracing


def test_model_decides_by_bytes_and_codec():
    from horovod_twobit.state.fallback import Link, compress_pays, times
    from horovod_twobit.wire.layout import Layout
    lay = Layout([1 << 20])
    slow = Link(rate=12.5e6, latency=1e-3, codec=1e9)  # 100 Mbit/s, a fast codec
    fast = Link(rate=50e9, latency=1e-3, codec=1e8)  # 400 Gbit/s, a slow codec
    assert compress_pays(lay, 8, "allgather", slow) and compress_pays(lay, 8, "scatter", slow)
    assert not compress_pays(lay, 8, "allgather", fast)
    comp, plain = times(lay, 2, "allgather", slow)
    # plain: 4 MB at 12.5 MB/s and one collective; compressed: about a sixteenth of the bytes
    assert plain == pytest.approx(4 * (1 << 20) / 12.5e6 + 1e-3)
    assert comp < plain / 10


def test_fixed_codec_cost_decides_small_buckets():
    """A bucket small enough that its codec's fixed cost outweighs the bytes saved goes plain;
    the fixed cost is what a pass on few values costs beyond its share of the per-value rate."""
    from horovod_twobit.state.fallback import Link, codec_figures, compress_pays
    from horovod_twobit.wire.layout import Layout
    rate, fixed = codec_figures(lambda n: 1e-4 + n / 1e8, 1 << 20, 1 << 10)
    assert rate == pytest.approx((1 << 20) / (1e-4 + (1 << 20) / 1e8))
    assert fixed == pytest.approx(1e-4 + (1 << 10) / 1e8 - (1 << 10) / rate)
    small, big = Layout([1000]), Layout([1 << 20])
    link = Link(rate=125e6, latency=1e-4, codec=1e9)  # 1 Gbit/s
    assert compress_pays(small, 4, "allgather", link) and compress_pays(big, 4, "allgather", link)
    link = Link(rate=125e6, latency=1e-4, codec=1e9, codec_fixed=2e-4)
    assert not compress_pays(small, 4, "allgather", link)
    assert compress_pays(big, 4, "allgather", link)
    assert "s/bucket" in repr(link)


def test_decide_follows_the_step_time_model():
    """decide() compresses a bucket exactly where the step-time model, fed with the measured
    link, predicts its exchange faster than the plain ring allreduce; the model's terms are the
    alpha-beta arithmetic by hand with the formats' bytes."""
    from horovod_twobit.wire import scatter as scatter_wire
    from horovod_twobit.model import steptime
    from horovod_twobit.state.fallback import Link, decide
    from horovod_twobit.wire.layout import Layout
    big, small = Layout([1 << 20]), Layout([3000, 700, 5])
    cases = [  # layout, N, exchange, measured link, compressed?
        (big, 4, "allgather", Link(12.5e6, 1e-3, 1e8, 2e-4), True),     # 100 Mbit/s
        (big, 2, "allgather", Link(125e6, 2e-4, 1e8, 2e-4), True),      # 1 Gbit/s
        (big, 8, "scatter", Link(125e6, 2e-4, 1e8, 2e-4), True),
        (small, 2, "allgather", Link(2e9, 1e-4, 2e8, 3e-4), False),     # loopback-fast, small
        (big, 2, "allgather", Link(50e9, 5e-5, 1e8, 2e-4), False),      # 400 Gbit/s, slow codec
    ]
    for lay, N, exchange, link, want in cases:
        prof, wire = link.profile(), link.wire(N)
        comp = steptime.bucket_s(lay, exchange, N, wire, prof)
        plain = steptime.bucket_s(lay, "plain", N, wire, prof)
        assert plain == pytest.approx(link.latency + 2 * (N - 1) / N * 4 * lay.values / link.rate)
        if exchange == "allgather":
            sent = scatter_wire.rank_bytes(lay, N, 0, "allgather")
            assert comp == pytest.approx(link.latency + (N - 1) * sent / link.rate
                                         + link.codec_fixed + lay.values / link.codec)
        decisions = {}
        plain_now = decide(decisions, ["a", "b"], lay, N, exchange, "auto", lambda: link)
        assert plain_now == (not comp < plain) == (not want), (lay.numels, N, link, comp, plain)
        assert list(decisions.values()) == ["compressed" if want else "plain"]


def test_link_figures_from_allreduces_in_turns(monkeypatch):
    """The 1-value and BIG-value allreduces take turns and the best of each counts: a round
    slowed by load (here the first) does not make the link look faster or slower."""
    from horovod_twobit.state import fallback
    clock, calls = [0.0], []

    def allreduce(values, i):
        calls.append(values)
        clock[0] += (1e-3 if values == 1 else 5e-3) + (0.05 if i == 0 else 0.0)
    monkeypatch.setattr(fallback.time, "perf_counter", lambda: clock[0])
    rate, latency, codec, fixed, pace = fallback.figures(4, allreduce, lambda n: 1e-4 + n / 1e8)
    assert calls == [1, fallback.BIG] * 5
    assert pace == 1.0  # no allgather timed
    assert latency == pytest.approx(1e-3)
    assert rate == pytest.approx(2 * 3 / 4 * 4 * fallback.BIG / 4e-3)
    assert codec == pytest.approx(fallback.BIG / (1e-4 + fallback.BIG / 1e8))


def test_link_times_an_allgather_of_the_allreduces_bytes(monkeypatch):
    """With an allgather to time, the link takes turns over four collectives, and the allgather's
    pace is its time beyond a one-value allgather's over the allreduce's beyond a one-value
    allreduce's, for the same bytes sent per rank: (N - 1) x 2 BIG / N float32 values, as the
    BIG-value ring allreduce's 2 (N - 1) / N x 4 BIG bytes."""
    from horovod_twobit.state import fallback
    clock, calls = [0.0], []

    def timed(kind, fixed, per_value):
        def run(values, i):
            calls.append((kind, values))
            clock[0] += fixed + per_value * values + (0.05 if i == 0 else 0.0)
        return run
    monkeypatch.setattr(fallback.time, "perf_counter", lambda: clock[0])
    for N, sent_pace in ((2, 1.8), (4, 0.9)):
        calls.clear()
        ag = fallback.allgather_values(N)
        assert (N - 1) * 4 * ag == 2 * (N - 1) / N * 4 * fallback.BIG
        # the allreduce: 4 ms per BIG values; the allgather: its bytes at sent_pace x that pace
        ar_per_value = 4e-3 / fallback.BIG
        ag_per_value = sent_pace * 4e-3 / ag  # its ag values carry the allreduce's bytes
        got = fallback.figures(N, timed("allreduce", 1e-3, ar_per_value),
                               lambda n: 1e-4 + n / 1e8,
                               allgather=timed("allgather", 3e-3, ag_per_value))
        assert calls == [("allreduce", 1), ("allreduce", fallback.BIG), ("allgather", 1),
                         ("allgather", ag)] * 5
        rate, latency, _, _, pace = got
        assert latency == pytest.approx(1e-3 + ar_per_value)
        assert pace == pytest.approx(sent_pace)
        assert "allgather %.2fx" % sent_pace in repr(fallback.Link(*got))
    calls.clear()
    assert fallback.figures(1, timed("allreduce", 1e-3, 0.0), lambda n: 1e-4 + n / 1e8,
                            allgather=timed("allgather", 3e-3, 0.0))[4] == 1.0
    assert ("allgather", 1) not in calls  # one rank: nothing to gather


def test_measured_allgather_pace_decides_a_close_bucket():
    """A bucket whose compressed exchange wins by less than its payload's time at the link's
    pace goes plain where the link measured the allgather at twice the allreduce's time per
    byte (two ranks over Gloo): the model charges the payload's bytes at the measured pace,
    for the allgather exchange and for the scatter exchange's allgather of the owners' sums."""
    from horovod_twobit.wire import scatter as scatter_wire
    from horovod_twobit.model import steptime
    from horovod_twobit.state.fallback import Link, compress_pays, times
    from horovod_twobit.wire.layout import Layout
    lay, N, rate, latency = Layout([1 << 20]), 2, 125e6, 2e-4
    sent = scatter_wire.rank_bytes(lay, N, 0, "allgather") * (N - 1)
    plain = latency + 4 * lay.values / rate
    # the codec takes what leaves compression ahead by half the payload's time at pace 1
    codec = lay.values / (plain - latency - 1.5 * sent / rate)
    once, twice = Link(rate, latency, codec), Link(rate, latency, codec, allgather=2.0)
    assert compress_pays(lay, N, "allgather", once)
    assert not compress_pays(lay, N, "allgather", twice)
    assert times(lay, N, "allgather", twice)[0] - times(lay, N, "allgather", once)[0] == \
        pytest.approx(sent / rate)
    assert times(lay, N, "allgather", twice)[1] == times(lay, N, "allgather", once)[1]
    # the scatter exchange: its second phase is an allgather, its alltoall is not
    u = steptime.bucket_unit(lay, "scatter", N, once.profile())
    extra = times(lay, N, "scatter", twice)[0] - times(lay, N, "scatter", once)[0]
    assert extra == pytest.approx(steptime.sent_bytes("scatter_allgather", N, u.bytes2) / rate)
    assert once.profile()["allgather_pace"] == 1.0 and twice.profile()["allgather_pace"] == 2.0


def test_checked_candidates_and_schedule():
    """The modes checked: the model's picks, then every bucket compressed and every bucket
    plain where those differ from the picks; none beyond the picks where the model has one side
    MARGIN times faster; the schedule takes them in turns, warmup rounds first."""
    M, C, P = fallback.MODEL, fallback.COMPRESSED, fallback.PLAIN
    assert fallback.candidates([False, False], 1.0, 1.2) == [M, P]
    assert fallback.candidates([True, True], 1.0, 1.2) == [M, C]
    assert fallback.candidates([True, False], 1.0, 1.2) == [M, C, P]
    assert fallback.candidates([True, False], 1.0, 3.0) == [M]  # the model is sure
    assert fallback.candidates([True, False], 3.0, 1.0) == [M]
    assert fallback.candidates([True, False], 1.0, 2.9) == [M, C, P]
    assert fallback.candidates([False], 1.0, 10.0, margin=float("inf")) == [M, P]
    assert fallback.schedule([M]) == []  # nothing to check
    assert fallback.TURN == 2
    assert fallback.schedule([M, P], 1, 2) == [M, M, P, P] * 3
    # the blocks: the first, then as many again (without the warmup) while not sure
    full, ends = fallback.blocks([(True, (1.0, 1.2)), (False, (1.0, 1.0))])  # all 3 modes
    assert (fallback.WARMUP, fallback.SAMPLES, fallback.BLOCKS) == (0, 7, 3)
    assert ends == [42, 84, 126] and full == fallback.schedule([M, C, P], 0, 21)
    assert full[:42] == fallback.schedule([M, C, P]) and len(full) + 2 == fallback.start_steps()
    assert fallback.blocks([(False, (1.0, 1.2))]) == (fallback.schedule([M, P], 0, 21),
                                                      [28, 56, 84])
    assert fallback.blocks([(False, (1.0, 10.0))]) == ([], [0])  # the model is sure
    for pick in (False, True):
        assert fallback.is_plain(M, pick) is pick
        assert fallback.is_plain(C, pick) is False and fallback.is_plain(P, pick) is True


def test_checked_medians_and_choice():
    """The model pick's figure is the median of its timed steps (the last of each turn; the
    warmup rounds, a turn's first step and missing spans left out), another mode's that median
    times the median ratio of its span to the pick's in the same round; the fastest is kept,
    the model's pick unless another is faster by more than TIE."""
    M, C, P = fallback.MODEL, fallback.COMPRESSED, fallback.PLAIN
    steps = fallback.schedule([M, P], 1, 3)
    # the first round is warmup; each turn's first step (the switch: 7.0) is not timed
    spans = [9.0, 9.0, 9.0, 9.0, 7.0, 1.0, 7.0, 2.0, 7.0, 1.2, 7.0, 2.1, 7.0, 5.0, 7.0, None]
    figures = fallback.medians(steps, spans, warmup=1)
    assert figures[M] == pytest.approx(1.2) and figures[P] == pytest.approx(1.2 * 1.875)
    # a load that doubles from round to round falls on both: plain 10 % slower in each round
    steps = fallback.schedule([M, P], 0, 3)
    figures = fallback.medians(steps, [0, 1.0, 0, 1.1, 0, 2.0, 0, 2.2, 0, 4.0, 0, 4.4], warmup=0)
    assert figures[P] == pytest.approx(2.0 * 1.1) and fallback.choose(figures) == M
    assert np.isnan(figures[C])
    assert fallback.choose(figures) == M
    assert fallback.choose([2.0, float("nan"), 1.0]) == P
    assert fallback.choose([1.0, float("nan"), 0.995]) == M  # within TIE: the model's pick
    assert fallback.choose([float("nan"), 2.0, 1.0]) == P
    assert fallback.choose([float("nan")] * 3) == M


def test_checked_sign_test_and_verdict():
    """A check is sure of a mode where, round by round, no other is faster than it by more
    than TIE at the sign test's confidence: the k-th smallest ratio of n paired rounds bounds
    their median from below (at 93.75 %: the 2nd of 7, the 4th of 14, the 7th of 21; nothing
    below 4 rounds). The verdict after a block: the medians and whether they hold."""
    from math import comb
    M, C, P = fallback.MODEL, fallback.COMPRESSED, fallback.PLAIN
    for n, k in ((4, 1), (7, 2), (14, 4), (21, 7)):
        xs = list(np.random.default_rng(n).permutation(np.arange(1.0, n + 1)))
        assert fallback.lower_bound(xs) == k, n
        # at most k - 1 of n below the median: within 1 - CONFIDENCE; k of them: beyond it
        assert sum(comb(n, j) for j in range(k)) / 2 ** n <= 1 - fallback.CONFIDENCE
        assert sum(comb(n, j) for j in range(k + 1)) / 2 ** n > 1 - fallback.CONFIDENCE
    assert fallback.lower_bound([1.0, 2.0, 3.0]) == 0.0 and fallback.lower_bound([]) == 0.0

    def rounds(plain):  # the model pick 1.0 a round, plain as given
        return [{M: 1.0, P: p} for p in plain]
    assert fallback.sure(rounds([1.1] * 7), M)  # plain 10 % slower every round
    assert fallback.sure(rounds([0.5] + [1.1] * 6), M)  # one round against: still sure
    assert not fallback.sure(rounds([0.5, 0.9] + [1.1] * 5), M)  # two: not
    assert fallback.sure(rounds([0.995] * 7), M)  # within TIE: as good
    assert not fallback.sure(rounds([0.98] * 7), M)
    assert fallback.sure(rounds([0.8] * 7), P) and not fallback.sure(rounds([1.1] * 7), P)
    assert not fallback.sure(rounds([1.1] * 3), M)  # too few rounds to be sure of anything
    three = [{M: 1.0, C: 1.2, P: 1.1}] * 7
    assert fallback.sure(three, M) and not fallback.sure(three, P)

    steps = fallback.schedule([M, P], 0, 7)

    def starts(plain):  # every step takes 1 s, but the timed plain ones take as given
        t, out = 0.0, []
        for i, mode in enumerate(steps):
            out.append(t)
            t += plain[i // 4] if mode == P and i % 2 == 1 else 1.0
        return out + [t]
    got = fallback.assess(steps, starts([1.1] * 7), last=False)
    assert got == pytest.approx([1.0, float("nan"), 1.1, 1.0], nan_ok=True)
    noisy = [0.8, 1.2, 0.9, 1.15, 1.05, 0.95, 1.1]  # median 1.05, but 3 of 7 rounds faster
    assert fallback.assess(steps, starts(noisy), last=False)[-1] == 0.0
    assert fallback.assess(steps, starts(noisy), last=True)[-1] == 1.0  # the last block
    assert fallback.choose(fallback.assess(steps, starts(noisy), last=True)[:-1]) == M


def test_torch_checker_follows_each_buckets_launches(monkeypatch):
    """PyTorch's checker on one rank: each bucket's mode is a function of its own launch count
    (the model's pick, the schedule, the mode kept); a step's figure runs from its first
    arrival to the next step's (the whole step), only the second step of each turn timed; a
    bucket first seen after the schedule was made is checked anew by a later checker, while the
    others keep their mode."""
    from horovod_twobit.torch.exchange.checked import Checker
    monkeypatch.setattr(fallback, "WARMUP", 0)
    monkeypatch.setattr(fallback, "SAMPLES", 2)
    clock = [0.0]
    monkeypatch.setattr("time.perf_counter", lambda: clock[0])

    checker = Checker(1, None)
    picks = {"a": False, "b": True}  # a compressed, b plain: three modes to check
    times = lambda: (1.0, 1.0)  # noqa: E731
    # the span each mode's steps take: plain fastest
    cost = {fallback.MODEL: 3.0, fallback.COMPRESSED: 5.0, fallback.PLAIN: 1.0}
    seen = []

    def step(keys, mode_of):
        start = clock[0]
        got = {}
        for k in keys:
            plain, (who, n) = checker.plain(k, picks[k], times, start)
            got[k] = plain
            # a turn's first step (the switch) takes long, and is not timed
            clock[0] = start + cost[mode_of(n)] * (50.0 if n % fallback.TURN == 1 else 1.0)
        seen.append(got)
        return got

    # two rounds a block are never sure (a sign test needs 4): the schedule goes on for a
    # second block, whose 4 rounds, every one of them plain fastest, are
    full, ends = fallback.blocks([(False, (1.0, 1.0)), (True, (1.0, 1.0))])
    assert ends == [12, 24, 36]
    sched = full[:ends[1]]
    assert step("ab", lambda n: fallback.MODEL) == {"a": False, "b": True}
    for s, mode in enumerate(sched, start=1):
        want = {k: fallback.is_plain(mode, picks[k]) for k in "ab"}
        assert step("ab", lambda n: sched[n - 1]) == want, s
        assert checker.chosen is None and checker.steps == sched[:ends[s > ends[0]]], s
    assert not any(checker.settled(n) for n in range(len(sched) + 1))
    assert step("ab", lambda n: fallback.PLAIN) == {"a": True, "b": True}  # plain kept
    assert checker.settled(len(sched) + 1)  # from here on every launch takes the kept mode
    assert checker.summary()["kept"] == "plain" and checker.summary()["steps"] == ends[1]
    assert checker.summary()["median_span_ms"]["plain"] == pytest.approx(1e3)
    # a new bucket: checked anew on its own launches (a compressed pick: model and plain)
    picks["c"] = False
    full, ends = fallback.blocks([(False, (1.0, 1.0))])
    late = full[:ends[1]]
    assert step("abc", lambda n: fallback.PLAIN)["c"] is False  # its model pick first
    for s, mode in enumerate(late, start=1):
        got = step("abc", lambda n: mode)
        assert got == {"a": True, "b": True, "c": fallback.is_plain(mode, False)}, s
    assert step("abc", lambda n: fallback.PLAIN) == {"a": True, "b": True, "c": True}
    assert [s["kept"] for s in checker.summaries()] == ["plain", "plain"]


def test_one_rank_goes_plain_without_a_link():
    """On one rank nothing crosses a link: no link is measured (it would have no rate), not for
    the decision nor for the check's model, and every bucket goes plain, in both frameworks, the results the gradients themselves."""
    from horovod_twobit.state.fallback import candidates, decide, modelled
    from horovod_twobit.wire.layout import Layout

    def no_link():
        raise AssertionError("measured a link on one rank")
    picks = {}
    assert decide(picks, ["a"], Layout([1 << 20]), 1, "allgather", "auto", no_link)
    assert picks == {("a", 1): "plain"}
    assert modelled(Layout([10]), 1, "allgather", no_link) == (float("inf"), 0.0)
    assert candidates([True], float("inf"), 0.0) == [fallback.MODEL]  # nothing to check
    for fw in ("torch", "tf"):
        res = jobs.run(1, "one_rank_fallback.py", fw, timeout=300)
        line = [x for x in res.output.splitlines() if "RESULT " in x][-1]
        got = json.loads(line.split("RESULT ", 1)[1])
        assert got["size"] == 1 and got["same"] and all(got["same"]), (fw, got)
        assert got["decisions"] == ["plain"], (fw, got)
        assert got["links"] == 0, (fw, got)  # nothing measured, the check's model included


def test_tf_plain_exchange_paths_on_one_rank():
    """TensorFlow's plain exchange, every path (residuals read in the graph, or told known
    zero or not as the checked exchange's branches are), with members finite, NaN or Inf, in a
    bucket with padding between its members and alone: g + r sent, a member not finite NaN
    with its residual kept, the others' residuals zero, the zero flag and the stats' NaN flag
    set as the members came out; the step after sends what a member kept and leaves every
    residual zero."""
    res = jobs.run(1, "tf_plain_nan.py", timeout=300)
    line = [x for x in res.output.splitlines() if "RESULT " in x][-1]
    got = json.loads(line.split("RESULT ", 1)[1])
    assert len(got) == 24
    bad = {k: v for k, v in got.items() if not all(v)}
    assert not bad, bad


STEPS_OF_TAPE = 16  # tests/workers/tf_fit_settle.py's STEPS
TAPE_WRAPPED = {"plain": "python", "compressed": "function"}  # what its tape loops wrap


def test_tf_fallback_callback_retraces_keras_once_decided(tmp_path):
    """TwoBitFallbackCallback: a 2-rank Keras fit whose check keeps plain, or compressed, traces
    its train function anew once the check decided, with no new check; the steps after it keep
    the mode kept; every loss and final weight is the same as without the callback, bit for
    bit, and the same on both ranks. A tape loop through ``fallback_function`` (given the
    Python function where plain is kept, a ``tf.function`` of it where compressed is) is
    traced anew once the check decided, even where its first call traced twice, with the same
    results as without it."""
    res = jobs.run(2, "tf_fit_settle.py", tmp_path, timeout=400)
    got = {int(p.stem[4:]): json.loads(p.read_text()) for p in tmp_path.glob("rank*.json")}
    assert sorted(got) == [0, 1], res.output[-2000:]
    for kept in ("plain", "compressed"):
        for r in (0, 1):
            with_cb, without = got[r]["%s/True" % kept], got[r]["%s/False" % kept]
            assert with_cb["functions"] == 2 and without["functions"] == 1, kept
            # the train function traced after the decision has no check in it, nor in the
            # gradient function it calls (a function of its own, traced anew with it)
            assert with_cb["check_ops"][0] > 0 and with_cb["check_ops"][1] == 0, with_cb
            assert without["check_ops"] == with_cb["check_ops"][:1], kept
            assert with_cb["checks_made"] == without["checks_made"] == 1, kept
            assert with_cb["kept"] == without["kept"] == [kept], kept
            assert set(with_cb["exchanges"]) == {"plain" if kept == "plain" else "allgather"}
            assert with_cb["losses"] == without["losses"], kept
            assert with_cb["weights"] == without["weights"], kept
            assert with_cb["weights"] == got[0]["%s/True" % kept]["weights"], kept
            # a tape loop through fallback_function whose first call traced twice (a Keras
            # optimizer making its variable): the first trace's check never ran, and the loop
            # is still traced anew once every check decided, right after the deciding step,
            # with no check in the new trace; the same losses and weights as the loop left
            # as it was traced first, on both ranks
            plain_tape = got[r]["tape/%s/None" % kept]
            assert plain_tape["functions"] == 1 and plain_tape["check_ops"][0] > 0, plain_tape
            for wrap in (TAPE_WRAPPED[kept],):
                tape = got[r]["tape/%s/%s" % (kept, wrap)]
                assert tape["first_traces"] == 2 and tape["checks_made"] == 2, tape
                assert tape["functions"] == 2, tape
                assert tape["check_ops"][1] == 0 < tape["check_ops"][0], tape
                assert tape["retraced_at"] == plain_tape["settled_at"] < STEPS_OF_TAPE - 1, tape
                assert set(tape["exchanges"]) == {"plain" if kept == "plain" else "allgather"}
                assert tape["losses"] == plain_tape["losses"], (kept, wrap)
                assert tape["weights"] == plain_tape["weights"], (kept, wrap)
                assert tape["weights"] == got[0]["tape/%s/%s" % (kept, wrap)]["weights"]
