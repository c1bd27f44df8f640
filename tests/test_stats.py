"""TwoBitCompressor.stats(), checked against values computed independently: bytes from the sizes
of the tensors each rank handed to Horovod's collectives (counted in the job), the fraction sent
and the levels from the NumPy reference's replay of the same gradients, residual norms from the
reference's residuals, the NaN step counted once, and reset=True clearing the running sums;
TensorFlow's read as one traced call made once, and the bucket benchmark's stats-reading twins."""

import json

import numpy as np
import pytest

import jobs
import sim
from horovod_twobit import reference as ref
from horovod_twobit.wire import scatter as sw
from horovod_twobit import wire
from horovod_twobit.wire.layout import Layout

pytestmark = pytest.mark.slow
STEPS, NAN_STEP, RESET_STEP = 5, 2, 3
FRAMEWORKS = {  # the groups the job's tensors travel in, and their sizes
    "torch": ([["2.bias", "2.weight", "0.bias"], ["0.weight"]],
              {"2.bias": 6, "2.weight": 240, "0.bias": 40, "0.weight": 480}),
    "tf": ([["hidden/bias", "out/kernel", "out/bias"], ["hidden/kernel"]],
           {"out/bias": 6, "out/kernel": 240, "hidden/bias": 40, "hidden/kernel": 480})}
CONFIGS = {"torch": [(0.05, "allgather"), ("auto", "scatter"), ("auto", "allgather"),
                     (0.05, "scatter")],
           "tf": [(0.05, "allgather"), ("auto", "scatter")]}


def _ranks(tmp_path_factory, framework, index):
    def job():
        out = tmp_path_factory.mktemp("stats_" + framework)
        jobs.run(2, framework + "_stats.py", "--out", out, "--steps", STEPS, "--configs",
                 *["%s:%s" % c for c in CONFIGS[framework]], timeout=600)
        return out
    return sim.load_ranks(str(jobs.shared(("stats", framework), job) / str(index)), 2)


def _expected(ranks, threshold, exchange, GROUPS):  # noqa: N803
    """Per step and rank: {sent, values, levels: [magnitudes sent], residual norms per tensor}
    from the reference."""
    N = len(ranks)
    w = ref.Workers(N, threshold, exchange=exchange)
    out = []
    for step in range(STEPS):
        before = [{n: w.residuals[r].get(n, np.zeros(0, np.float32)).copy() for g in GROUPS
                   for n in g} for r in range(N)]
        for g in GROUPS:
            w.bucket(g, [[r["local/%d/%s" % (step, n)].reshape(-1) for n in g] for r in ranks])
        per_rank = []
        for rank, r in enumerate(ranks):
            sent = values = 0
            levels = []
            for g in GROUPS:
                for n in g:
                    x = r["local/%d/%s" % (step, n)].reshape(-1)
                    values += x.size
                    lv = w.last_levels.get(n, [None] * N)[rank]
                    if lv is None:  # the NaN step: nothing committed, nothing to compare
                        continue
                    t, v = lv
                    levels += np.atleast_1d(v).tolist()
                    block = wire.block_of(x.size, w.block, w.blocks)
                    if block:
                        t, v = ref.per_value(t, block, x.size), ref.per_value(v, block, x.size)
                    res = before[rank][n] if before[rank][n].size else np.zeros(x.size, np.float32)
                    sent += int(np.count_nonzero(ref.quantize(x, res.copy(), t, v)))
            norms = {n: (float(np.sqrt((w.residuals[rank][n].astype(np.float64) ** 2).sum())),
                         float(np.abs(w.residuals[rank][n]).max()))
                     for g in GROUPS for n in g}
            per_rank.append({"sent": sent, "values": values, "levels": levels, "norms": norms})
        out.append(per_rank)
    return out


def _handed_bytes(handed):
    """Bytes per exchange of one step, from the tensors the step handed to the collectives
    (collective, name, bytes: as the job's workers count them): a bucket that goes through an
    alltoall uses the scatter exchange, its alltoall and its allgather under the alltoall's name
    plus "reduced" count as "scatter"; its allgather under the alltoall's own name is the
    agreement on its plan, which the stats leave out (PyTorch sends it at the first step,
    TensorFlow every step); any other allgather is the allgather exchange's. Nothing goes as
    "plain": the jobs have no fallback."""
    scattered = {name for kind, name, _ in handed if kind == "alltoall"}
    reduced = {s + sep + "reduced" for s in scattered for sep in "._"}
    total = {"allgather": 0, "scatter": 0, "plain": 0}
    for kind, name, nbytes in handed:
        if kind == "alltoall" or name in reduced:
            total["scatter"] += nbytes
        elif name not in scattered:
            total["allgather"] += nbytes
    for s in scattered:  # one alltoall and one reduced chunk per scatter bucket and step
        assert [k for k, name, _ in handed if name == s].count("alltoall") == 1
        assert sum(name in (s + ".reduced", s + "_reduced") for _, name, _ in handed) == 1
    return total


def _measured(r, framework, step):
    """What step ``step`` of a rank's record handed to the collectives, per exchange: PyTorch's
    counted in the step itself; TensorFlow's where the step was traced (once: the graph every
    step runs)."""
    if framework == "torch":
        return _handed_bytes(json.loads(str(r["handed/%d" % step])))
    assert int(r["traces"]) == 1
    return _handed_bytes(json.loads(str(r["handed"])))


@pytest.mark.parametrize("framework,index", [(f, i) for f in CONFIGS for i in range(len(CONFIGS[f]))],
                         ids=["%s-%s-%s" % ((f,) + c) for f in CONFIGS for c in CONFIGS[f]])
def test_stats_match_independent_counts(tmp_path_factory, framework, index):
    threshold, exchange = CONFIGS[framework][index]
    ranks = _ranks(tmp_path_factory, framework, index)
    GROUPS = FRAMEWORKS[framework][0]
    want = _expected(ranks, threshold, exchange, GROUPS)
    for rank, r in enumerate(ranks):
        for step in range(STEPS):
            st = json.loads(str(r["stats/%d" % step]))
            since = step + 1 if step <= RESET_STEP else step - RESET_STEP
            per_step = _measured(r, framework, step)
            assert sum(per_step.values()) > 0
            assert st["bytes_last_step"] == per_step
            counted = [_measured(r, framework, s) for s in range(step + 1 - since, step + 1)]
            assert st["bytes_total"] == {k: sum(c[k] for c in counted) for k in per_step}
            assert sum(st["bucket_steps"].values()) == since * len(GROUPS)
            assert st["nonfinite_steps"] == (1 if NAN_STEP <= step <= RESET_STEP else 0)
            assert sorted(b["tensors"] for b in st["buckets"].values()) == sorted(GROUPS)
            for b in st["buckets"].values():
                assert b["exchange"] == ("scatter" if exchange == "scatter" else "allgather")
            e = want[step][rank]
            # both sum squares in float32 (PyTorch a BLAS dot, TensorFlow an L2Loss)
            rel = 1e-5
            for n, (l2, mx) in e["norms"].items():
                assert st["tensors"][n]["residual_l2"] == pytest.approx(l2, rel=rel, abs=0)
                assert st["tensors"][n]["residual_max"] == mx
            whole = json.loads(str(r["bucket_stats/%d" % step]))  # per bucket, read at once
            assert "tensors" not in whole
            for key, b in whole["buckets"].items():
                l2 = float(np.sqrt(sum(e["norms"][n][0] ** 2 for n in b["tensors"])))
                assert b["residual_l2"] == pytest.approx(l2, rel=rel, abs=1e-30)
                assert b["residual_max"] == max(e["norms"][n][1] for n in b["tensors"])
                assert b["fraction_sent"] == st["buckets"][key]["fraction_sent"]
            if step == NAN_STEP:
                continue
            assert st["fraction_sent"] == pytest.approx(e["sent"] / e["values"], rel=1e-12)
            assert 0 < st["fraction_sent"] < 1
            if threshold == "auto":
                assert st["threshold"] == pytest.approx(np.mean(e["levels"]), rel=1e-9)
            else:
                assert st["threshold"] == threshold


@pytest.mark.parametrize("index", range(len(CONFIGS["tf"])), ids=["%s-%s" % c for c in CONFIGS["tf"]])
def test_keras_callback_puts_stats_in_logs(tmp_path_factory, index):
    """TwoBitStatsCallback(every=1): every batch's logs and the epoch's CSV row carry the stats."""
    threshold, exchange = CONFIGS["tf"][index]
    for rank, r in enumerate(_ranks(tmp_path_factory, "tf", index)):
        logs = json.loads(str(r["keras_logs"]))
        final = json.loads(str(r["keras_stats"]))
        assert len(logs) == 6  # 2 epochs of 3 batches
        per_step = _handed_bytes(json.loads(str(r["keras_handed"])))  # Keras' traced step
        assert sum(per_step.values()) > 0
        for i, log in enumerate(logs):
            for ex, nbytes in per_step.items():
                assert log["twobit/bytes_last_step/" + ex] == nbytes
                assert log["twobit/bytes_total/" + ex] == (i + 1) * nbytes
            assert 0 < log["twobit/fraction_sent"] < 1
        assert logs[-1]["twobit/fraction_sent"] == final["fraction_sent"]
        header, *rows = str(r["keras_csv"]).strip().splitlines()
        cols = header.split(",")
        assert len(rows) == 2 and "twobit/fraction_sent" in cols and "twobit/threshold" in cols
        last = dict(zip(cols, rows[-1].split(",")))
        assert float(last["twobit/fraction_sent"]) == pytest.approx(final["fraction_sent"])
        assert float(last["twobit/bytes_total/allgather"]) == final["bytes_total"]["allgather"]


def test_sent_codes_are_counted_per_two_bit_code():
    """payload_counts' bit count against a count of the codes one by one (10 and 11: sent)."""
    from horovod_twobit.state.stats import _high_bits
    rng = np.random.default_rng(0)
    for n in (0, 1, 7, 1000):
        words = rng.integers(0, 2 ** 32, n, dtype=np.uint64).astype(np.uint32)
        want = sum(((int(w) >> (2 * k + 1)) & 1) for w in words for k in range(16))
        assert _high_bits(words) == want
    assert _high_bits(np.full(3, 0xFFFFFFFF, np.uint32)) == 48  # every code 11
    assert _high_bits(np.full(3, 0x55555555, np.uint32)) == 0  # every code 01 (never sent)


def test_tf_stats_are_read_by_one_cached_traced_call(monkeypatch):
    """TensorFlow: a compressor's slots and residual norms are read by one traced call, made once
    per ``per_tensor`` and made again only when the slots change; the norms it returns per bucket
    and per tensor against NumPy's (float32 sums of squares within 1e-6, exact max |r|)."""
    tf = pytest.importorskip("tensorflow")
    from horovod_twobit.tensorflow import stats as tf_stats
    from horovod_twobit.tensorflow.residuals import Residuals
    made, real = [], tf_stats._read_fn
    monkeypatch.setattr(tf_stats, "_read_fn", lambda *a: made.append(a) or real(*a))
    rng = np.random.default_rng(0)
    sizes = {"a": 5000, "b": 40, "c": 300, "d": 0}  # one above SMALL, the others below
    residuals, want = Residuals(), {}
    for n, k in sizes.items():
        want[n] = (rng.standard_normal(k) * 0.01).astype(np.float32)
        residuals.get(n, tf.zeros([k])).assign(want[n])
    slots, read = tf_stats.Slots(), tf_stats.residual_norms(residuals)

    def step(names):
        lay = Layout([sizes[n] for n in names], False, None, None)
        slots.record(lay, names, "allgather", 2, 0, tf.zeros([lay.payload_words], tf.int32),
                     [tf.zeros([sizes[n]]) for n in names])

    def norms(names):
        x = np.concatenate([want[n] for n in names]).astype(np.float64)
        return pytest.approx(np.sqrt((x * x).sum()), rel=1e-6), float(np.abs(x).max(initial=0))

    step(["a", "b"])
    for _ in range(3):
        st = slots.snapshot(read, 0.5)
    assert len(made) == 1
    step(["c", "d"])
    st = slots.snapshot(read, 0.5)
    assert len(made) == 2 and st["bucket_steps"]["allgather"] == 2
    for b in st["buckets"].values():
        assert (b["residual_l2"], b["residual_max"]) == norms(b["tensors"])
    st = slots.snapshot(read, 0.5, per_tensor=True)
    slots.snapshot(read, 0.5)
    assert len(made) == 3
    for n in sizes:
        assert (st["tensors"][n]["residual_l2"], st["tensors"][n]["residual_max"]) == norms([n])


def test_tf_steps_compute_the_norms_only_while_reads_watch_them():
    """TensorFlow: a step computes its new residual's norms (``codec.norms_if`` with
    ``norms_wanted``) only while reads come every step or every other; a step that no read
    watches leaves them NaN (no pass over the residual), and the read computes them from the
    residual variables. After the residuals are loaded or reset outside a step
    (``residuals_changed``) reads compute them from the variables again. The sent count is a
    population count of the payload's high code bits."""
    tf = pytest.importorskip("tensorflow")
    from horovod_twobit.tensorflow import codec
    from horovod_twobit.tensorflow import stats as tf_stats
    from horovod_twobit.tensorflow.residuals import Residuals
    residuals = Residuals()
    r = residuals.get("a", tf.zeros([40]))
    slots, traced = tf_stats.Slots(), tf_stats.residual_norms(residuals)
    asked = []  # the buckets each traced read computed norms for

    def read(*a):
        asked.append(set(a[2]))
        return traced(*a)
    lay = Layout([40], False, None, None)
    words = np.zeros(lay.payload_words, np.int32)
    words[lay.body:] = np.array([0x0000000F, 0x000000C0, 0, 0], np.uint32).astype(np.int32)[
        :lay.payload_words - lay.body]  # codes 11, 11 (sent); 11 (sent): three values sent

    @tf.function
    def step(new):  # as a finish pass: commits the residual, hands the stats its norms
        r.assign(new)
        return slots.record(lay, ["a"], "allgather", 2, 0, tf.constant(words), [tf.zeros([40])],
                            codec.norms_if(slots.norms_wanted(), new))

    def bucket():
        (b,) = slots.snapshot(read, 0.5)["buckets"].values()
        return b["residual_l2"], b["residual_max"], b["fraction_sent"]

    step(tf.fill([40], 3.0))  # before any read: not watched
    (slot,) = slots._slots.values()
    assert np.isnan(slot.summary.numpy()[3:]).all()
    assert bucket() == (pytest.approx(np.sqrt(40 * 9.0)), 3.0, 3 / 40)
    assert len(asked) == 1 and len(asked[0]) == 1  # from the residual variable
    step(tf.fill([40], -2.0))  # read after one step: watched, the step computes them
    assert slot.summary.numpy()[3:].tolist() == [160.0, 2.0]
    assert bucket() == (pytest.approx(np.sqrt(40 * 4.0)), 2.0, 3 / 40)
    assert len(asked) == 1  # the row, norms included, came with the step
    slots.residuals_changed()
    r.assign(tf.fill([40], 0.25))
    for _ in range(2):  # read from the variable, however often, until the next step
        assert bucket()[:2] == (pytest.approx(np.sqrt(40 / 16)), 0.25)
        assert len(asked[-1]) == 1
    step(tf.fill([40], 0.5))
    assert bucket()[:2] == (pytest.approx(np.sqrt(40 * 0.25)), 0.5)


@pytest.mark.parametrize("sizes", [[70000], [70000, 3000], [40, 9]], ids=["xla", "bucket", "plain"])
def test_tf_exchange_computes_its_norms_only_while_watched(sizes):
    """TensorFlow, an exchange's finish (one tensor or a bucket, XLA or plain): while no read
    watches the steps its norms are NaN (the pass is skipped); once watched, they are those of
    the residual it commits (float32 sum of squares within 1e-6, exact max |r|), and its NaN
    flag says whether its results are NaN. Every step, the NaN step and those after it included,
    gives the NumPy reference's results and residuals bit for bit (two ranks that send the same
    payload: the same gradients on both)."""
    tf = pytest.importorskip("tensorflow")
    from horovod.tensorflow import mpi_ops
    from horovod_twobit.tensorflow import TwoBitCompressor
    from horovod_twobit.tensorflow.exchange.bucket import BucketExchange
    from horovod_twobit.tensorflow.exchange.single import Exchange
    comp = TwoBitCompressor(0.5)
    rng = np.random.default_rng(3)
    keys = ["w%d" % i for i in range(len(sizes))]

    @tf.function
    def step(*gs):
        ex = (Exchange(comp, gs[0], keys[0], mpi_ops.Average, 1.0, 1.0, 2) if len(gs) == 1
              else BucketExchange(comp, list(gs), keys, mpi_ops.Average, 1.0, 1.0, 2))
        out = ex.finish(tf.concat([ex.payload] * 2, 0))
        return ex.norms, ex.bad, out

    workers = ref.Workers(2, 0.5)

    def run(scale, nan=False):
        gs = [(rng.standard_normal(n) * scale).astype(np.float32) for n in sizes]
        if nan:
            gs[-1][0] = np.nan
        norms, bad, out = step(*[tf.constant(g) for g in gs])
        out = [np.asarray(o) for o in tf.nest.flatten(out)]
        want = workers.bucket(keys, [gs, gs])
        for o, w in zip(out, want):
            np.testing.assert_array_equal(o, w)
        for k in keys:
            np.testing.assert_array_equal(comp.residuals.variable(k).numpy(),
                                          workers.residuals[0][k])
        return norms.numpy(), bool(bad), out

    norms, bad, _ = run(1.0)
    assert np.isnan(norms).all() and not bad  # not watched: no pass
    comp.stats_slots.norms_wanted()  # makes the watch variable
    comp.stats_slots._watched.assign(True)
    norms, bad, _ = run(1.0)
    r = np.concatenate([comp.residuals.variable(k).numpy().reshape(-1) for k in keys])
    assert not bad and np.abs(r).max() > 0
    assert norms[0] == pytest.approx(float((r.astype(np.float64) ** 2).sum()), rel=1e-6)
    assert norms[1] == np.abs(r).max()
    kept = comp.residuals.variable(keys[-1]).numpy().copy()
    norms, bad, out = run(1.0, nan=True)
    assert bad and np.isnan(out[-1]).all()
    assert (comp.residuals.variable(keys[-1]).numpy() == kept).all()
    r = np.concatenate([comp.residuals.variable(k).numpy().reshape(-1) for k in keys])
    assert norms[0] == pytest.approx(float((r.astype(np.float64) ** 2).sum()), rel=1e-6)
    for _ in range(2):  # after the fault: training goes on, as the reference's
        norms, bad, out = run(1.0)
        assert not bad and all(np.isfinite(o).all() for o in out)
        r = np.concatenate([comp.residuals.variable(k).numpy().reshape(-1) for k in keys])
        assert norms[0] == pytest.approx(float((r.astype(np.float64) ** 2).sum()), rel=1e-6)
        assert norms[1] == np.abs(r).max()


@pytest.mark.parametrize("handover", ["table", "callback"])
def test_tf_steps_hand_their_rows_to_the_host_while_reads_come_every_step_or_other(
        handover, monkeypatch):
    """TensorFlow: a step traced before anyone read the stats gives the reads nothing; while
    reads come every step or every other, the same traced step hands its bucket's row (counters
    and summary) to the host, and reads take the rows without a TensorFlow call, with the same
    values a traced read gives (steps, NaN steps, codes sent, the step's norms); reads every
    third step turn the handover off, a read after one step on again. ``table``: the ops' table
    (a CPU with the ops built), which every step writes and reads use while they watch;
    ``callback``: the ``tf.numpy_function`` behind a ``tf.cond`` (a GPU)."""
    tf = pytest.importorskip("tensorflow")
    from horovod_twobit.tensorflow.codec import native_ops
    from horovod_twobit.tensorflow import codec
    from horovod_twobit.tensorflow import stats as tf_stats
    from horovod_twobit.tensorflow.residuals import Residuals
    if handover == "callback":
        monkeypatch.setattr(native_ops, "codec_usable", lambda: False)
    elif not native_ops.codec_usable():
        pytest.skip("the codec's CPU ops are not built here: %s" % native_ops.unavailable_reason())
    residuals = Residuals()
    residuals.get("a", tf.zeros([40]))
    slots, traced = tf_stats.Slots(), tf_stats.residual_norms(residuals)
    calls = []

    def read(*a):
        calls.append(1)
        return traced(*a)
    lay = Layout([40], False, None, None)
    words = np.zeros(lay.payload_words, np.int32)
    words[lay.body] = 0x3C  # codes 00 11 11 00 in the first byte's low bits: two values sent

    @tf.function
    def step(result, new):  # as a finish pass: commits the residual, hands the stats its norms
        residuals.variable("a").assign(new)
        return slots.record(lay, ["a"], "allgather", 2, 0, tf.constant(words), [result],
                            codec.norms_if(slots.norms_wanted(), new))

    step(tf.zeros([40]), tf.fill([40], 3.0))
    assert slots._slots and all(s.host is None for s in slots._slots.values())
    assert all(s.table == (handover == "table") for s in slots._slots.values())
    first = slots.snapshot(read, 0.5)
    assert len(calls) == 1 and first["bucket_steps"]["allgather"] == 1
    step(tf.fill([40], np.nan), tf.fill([40], -2.0))  # a NaN step, then a good one
    step(tf.zeros([40]), tf.fill([40], 0.5))
    st = slots.snapshot(read, 0.5)
    assert len(calls) == 1  # the rows came with the steps
    (b,) = st["buckets"].values()
    assert st["bucket_steps"]["allgather"] == 3 and st["nonfinite_steps"] == 1
    assert b["fraction_sent"] == 2 / 40
    assert (b["residual_l2"], b["residual_max"]) == (pytest.approx(np.sqrt(40 * 0.25)), 0.5)
    for s in slots._slots.values():
        s.host = None  # as if the rows were missing: the traced read gives the same values
    native_ops.forget_stats_rows([s.key for s in slots._slots.values()])
    assert slots.snapshot(read, 0.5) == st and len(calls) == 2
    for _ in range(3):  # reads every third step: the handover stops, the reads fetch the rows
        step(tf.zeros([40]), tf.fill([40], 0.5))
    assert slots.snapshot(read, 0.5)["bucket_steps"]["allgather"] == 6 and len(calls) == 2
    step(tf.zeros([40]), tf.fill([40], 0.5))
    assert all(s.host is None for s in slots._slots.values())
    assert slots.snapshot(read, 0.5)["bucket_steps"]["allgather"] == 7 and len(calls) == 3
    step(tf.zeros([40]), tf.fill([40], 0.5))  # read after one step again: handed over again
    assert slots.snapshot(read, 0.5)["bucket_steps"]["allgather"] == 8 and len(calls) == 3
    assert slots._watching
    slots.snapshot(read, 0.5, per_tensor=True)  # a read that needs the residuals: no handover
    assert not slots._watching and len(calls) == 4


@pytest.mark.parametrize("threshold", [0.5, "auto"])
def test_tf_reads_from_the_table_give_what_the_usual_read_gives(threshold, monkeypatch):
    """TensorFlow on a CPU: while reads come every step or every other, a read builds the
    stats straight from the ops' table (Slots._from_table); it gives what the usual read gives
    from the same rows, for two buckets (one of two tensors), over a NaN step and after a reset,
    and steps aside where the case does not hold (a read with per_tensor, after the residuals
    were reset, or three steps after the last)."""
    tf = pytest.importorskip("tensorflow")
    from horovod_twobit.tensorflow.codec import native_ops
    from horovod_twobit.tensorflow import codec
    from horovod_twobit.tensorflow import stats as tf_stats
    from horovod_twobit.tensorflow.residuals import Residuals
    if not native_ops.codec_usable():
        pytest.skip("the codec's CPU ops are not built here: %s" % native_ops.unavailable_reason())
    auto = threshold == "auto"
    residuals = Residuals()
    for n, size in (("a", 40), ("b", 70), ("c", 9)):
        residuals.get(n, tf.zeros([size]))
    slots, reader = tf_stats.Slots(), tf_stats.residual_norms(residuals)
    buckets = [(["a"], Layout([40], auto, None, None)), (["b", "c"], Layout([70, 9], auto, None,
                                                                             None))]
    payloads = []
    for i, (_, lay) in enumerate(buckets):
        words = np.zeros(lay.payload_words, np.int32)
        words[lay.body:lay.body + 2] = [0x3C, 0xF0 << i]  # codes 11 11, then 11 11 or 11 10
        if auto:
            mags = np.full(lay.mag_words or 1, 0.25 + i, np.float32).view(np.int32)
            if lay.mag_words:
                words[lay.head_words:lay.body] = mags
            else:
                words[4] = mags[0]
        payloads.append(tf.constant(words))

    @tf.function
    def step_fn(scale):  # both buckets' finish passes: commit the residuals, record the stats
        out = []
        for (names, lay), payload in zip(buckets, payloads):
            new = []
            for n in names:
                v = residuals.variable(n)
                new.append(tf.fill(v.shape, scale) * tf.range(1.0, v.shape[0] + 1.0) / 7.0)
                v.assign(new[-1])
            result = tf.fill([3], tf.where(tf.math.is_nan(scale), np.nan, 0.0))  # NaN: NaN
            out += slots.record(lay, names, "allgather", 2, 0, payload, [result],
                                codec.norms_if(slots.norms_wanted(), tf.concat(new, 0)))
        return out

    def step(scale):
        return step_fn(tf.constant(scale, tf.float32))

    fast = []
    made = slots._from_table

    def counted(*a):
        got = made(*a)
        fast.append(got is not None)
        return got
    monkeypatch.setattr(slots, "_from_table", counted)

    def both(**kw):  # the read, then the usual read of the same rows
        st = slots.snapshot(reader, threshold, **kw)
        monkeypatch.setattr(slots, "_from_table", lambda *a: None)
        try:
            usual = slots.snapshot(reader, threshold, **kw)
        finally:
            monkeypatch.setattr(slots, "_from_table", counted)
        return st, usual

    def same(a, b):
        assert json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)
    step(1.0)
    slots.snapshot(reader, threshold)
    for k, scale in enumerate([2.0, np.nan, 3.0, 4.0]):
        step(scale)
        st, usual = both()
        same(st, usual)
        if k >= 1:  # watched since the second read
            assert fast[-1] and st["bucket_steps"]["allgather"] == 2 * (k + 2)
    assert st["nonfinite_steps"] == 2 and len(st["buckets"]) == 2
    b = st["buckets"][sw.owner_key(["b", "c"])]
    assert b["fraction_sent"] == 4 / 79 and b["values"] == 79
    x = 4.0 * np.concatenate([np.arange(1, 71), np.arange(1, 10)]) / 7.0
    assert b["residual_l2"] == pytest.approx(np.sqrt((x.astype(np.float32) ** 2).sum()))
    assert b["level_mean"] == (1.25 if auto else 0.5)
    slots.snapshot(reader, threshold, reset=True)
    step(5.0)
    st, usual = both()
    same(st, usual)
    # one step's bytes from first principles (2 bits per value in whole 32-bit words): "a" alone,
    # the header and its 40 values (with "auto" its one magnitude in the header); the bucket of
    # "b" and "c", its header, a word of its two members' flag bytes, with "auto" one float32
    # magnitude per member (each a single block), and each member's values in words of its own
    words = lambda n: (2 * n + 31) // 32  # noqa: E731
    handed = (4 * (wire.HEADER_WORDS + words(40))
              + 4 * (wire.BUCKET_HEADER_WORDS + 1 + 2 * auto + words(70) + words(9)))
    assert sum(4 * int(p.shape[0]) for p in payloads) == handed  # the payloads the step hands
    assert fast[-1] and st["bytes_total"]["allgather"] == handed and st["nonfinite_steps"] == 0
    fast.clear()
    for _ in range(3):
        step(6.0)
    slots.snapshot(reader, threshold)  # three steps after the last read: the usual read
    assert fast == [False] and not slots._watching
    step(6.0)
    slots.snapshot(reader, threshold)
    step(6.0)
    same(*both())
    assert fast == [False, True]
    slots.snapshot(reader, threshold, per_tensor=True)  # the usual read; the watch stops
    slots.residuals_changed()
    step(7.0)
    slots.snapshot(reader, threshold)  # the residuals changed: the usual read
    assert fast == [False, True]


def test_torch_norms_computed_by_the_step_are_read_until_the_residuals_change():
    """PyTorch: a bucket's first step after a ``stats()`` call keeps its new residual's norms
    (``step_norms``), and a read right after takes them without a pass over the residual; after
    a later step, a reset or a load (a new registry generation) the read computes them from the
    current residual again. Only one step per read prepares them."""
    torch = pytest.importorskip("torch")
    from types import SimpleNamespace
    from horovod_twobit.state.residuals import ResidualRegistry
    from horovod_twobit.torch.codec import stats as stats_read
    from horovod_twobit.torch import TwoBitCompressor
    from horovod_twobit.torch.exchange.bucket import Bucket
    reg = ResidualRegistry(zeros_like=torch.zeros_like, numel=lambda r: r.numel())
    current = torch.full([40], 0.25)
    bucket = SimpleNamespace(state=SimpleNamespace(residuals=reg), step_norms=None, steps=0,
                             current_residual=lambda: current)
    read = stats_read.bucket_norms(bucket)
    assert read() == (pytest.approx(40 / 16), 0.25)  # nothing kept: the residual itself
    stats_read.step_norms(bucket, stats_read.pair(torch.full([40], -3.0)))  # the step's norms
    assert read() == (pytest.approx(40 * 9.0), 3.0)
    bucket.steps += 1  # a later step that kept nothing: they are stale
    assert read() == (pytest.approx(40 / 16), 0.25)
    stats_read.step_norms(bucket, stats_read.pair(torch.full([40], 2.0)))
    assert read() == (pytest.approx(40 * 4.0), 2.0)
    reg.reset()
    for _ in range(2):  # stale: read from the residual, however often, until the next step
        assert read() == (pytest.approx(40 / 16), 0.25)

    real = Bucket(TwoBitCompressor(0.5).state, ["a"], [40])
    assert not real.prepares_stats()  # never read: no stats work in any step
    real.state.stats()
    assert [real.prepares_stats() for _ in range(3)] == [True, False, False]
    real.state.stats()
    real.state.stats()
    assert [real.prepares_stats() for _ in range(2)] == [True, False]


@pytest.mark.parametrize("numel", [5000, 70001])  # eager and compiled; a partial last word
@pytest.mark.parametrize("per_word", [False, True])
def test_torch_committed_norms_are_those_of_the_residual_the_commit_leaves(numel, per_word):
    """PyTorch: the norms a step prepares before its finish (``committed_norms``, from the
    residual and gradient it encoded) are those of the residual ``kernels.commit`` then leaves:
    its largest |r| exactly, its sum of squares to float32 summation; nothing is written."""
    torch = pytest.importorskip("torch")
    from horovod_twobit import wire
    from horovod_twobit.torch.codec import kernels, stats as stats_read
    gen = torch.Generator().manual_seed(numel)
    r = torch.randn(numel, generator=gen) * 0.3
    g = torch.randn(numel, generator=gen)
    t, v = 0.5, None
    if per_word:  # "auto": a threshold and a magnitude per word
        words = wire.num_words(numel)
        t = torch.rand(words, generator=gen) + 0.25
        v = t * 1.5
    r0, g0 = r.clone(), g.clone()
    sq, mx = stats_read.committed_norms(r, g, t, v)
    assert torch.equal(r, r0) and torch.equal(g, g0)
    kernels.commit(r, g, t, v)
    assert not torch.equal(r, r0)
    assert float(mx) == float(r.abs().max())
    assert float(sq) == pytest.approx(float(r.double().square().sum()), rel=1e-5)


def test_bucket_benchmark_times_a_stats_reading_twin_of_each_compressed_method():
    """bench_buckets --read-stats: a ``+stats`` twin after each compressed method, a second
    instance of it (its own compressor: the method's own never gets read), which runs its step
    and then reads the stats (timed), and the table of what that costs."""
    from horovod_twobit.benchmarks import stats_cost
    calls, stepped, built = [], [], []

    class Compressor:
        def stats(self):
            calls.append(self)
            return {}

    def build(method):
        comp = Compressor()
        built.append((method, comp))
        return (lambda: stepped.append(comp)), 51, comp
    steps = {m: (lambda m=m: stepped.append(m)) for m in ("none", "twobit", "auto_fallback/alone")}
    counts = dict.fromkeys(steps, 52)
    reads = stats_cost.add_reads(steps, counts, build)
    assert list(steps) == ["none", "twobit", "twobit+stats", "auto_fallback/alone",
                           "auto_fallback/alone+stats"]
    assert [m for m, _ in built] == ["twobit", "auto_fallback/alone"]
    assert counts["twobit+stats"] == 51 and counts["twobit"] == 52
    for fn in steps.values():
        fn()
    twins = [c for _, c in built]
    assert calls == twins and stepped == ["none", "twobit", twins[0], "auto_fallback/alone",
                                          twins[1]]
    assert [len(d) for d in reads.values()] == [1, 1]
    results = {("mlp", "twobit"): (0.020, 52), ("mlp", "twobit+stats"): (0.021, 52)}
    table = stats_cost.table(results, {("mlp", "twobit+stats"): 0.0004}, "torch")
    assert "| mlp | twobit | 20.0 | 21.0 | +5.0 % | 0.40 | 2.0 % |" in table


def test_stats_step_benchmark_rotates_the_roles_among_the_instances():
    """examples/bench_stats.py: four instances take turns, every instance stepping once a round;
    the roles rotate among them block by block, each instance playing each role once in four
    blocks. Before a block an ``every`` or ``once`` instance is read after two steps in a row
    (the watch on), a ``never`` one after three unread steps (the watch off); in the block only
    ``every`` is read, after each of its steps; the durations go to the role."""
    import os
    import sys
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from examples import bench_stats
    log = []

    class Compressor:
        def __init__(self, name):
            self.name = name

        def stats(self):
            log.append(("read", self.name))
    names = ["a", "b", "c", "d"]
    steps = {k: ((lambda k=k: log.append(("step", k))), Compressor(k)) for k in names}
    cpu = {}
    times = bench_stats.measure(steps, rounds=8, warmup=1, cpu=cpu, blocks=4)
    assert {k: len(t) for k, t in times.items()} == dict.fromkeys(bench_stats.INSTANCES, 8)
    assert {k: len(t) for k, t in cpu.items()} == dict.fromkeys(bench_stats.INSTANCES, 8)
    assert all(c >= 0 for t in cpu.values() for c in t)
    assert log[:4] == [("step", k) for k in names]  # the warm-up
    log = log[4:]
    settle = {"every": ["read", "step", "read"], "once": ["read", "step", "read"],
              "never": ["step"] * 3 + ["read"], "never2": ["step"] * 3 + ["read"]}
    played = {k: [] for k in names}
    for block in range(4):
        role = {names[(j + block) % 4]: r for j, r in enumerate(bench_stats.INSTANCES)}
        for k in names:
            n = len(settle[role[k]])
            assert log[:n] == [(what, k) for what in settle[role[k]]], (block, k)
            log = log[n:]
        every = next(k for k in names if role[k] == "every")
        timed = log[:8 + 2]  # two rounds: four steps each, and the read after every's step
        log = log[8 + 2:]
        assert [k for what, k in timed if what == "read"] == [every, every]
        assert all(timed[i + 1] == ("read", every) for i, e in enumerate(timed)
                   if e == ("step", every))
        assert sorted(k for what, k in timed if what == "step") == sorted(names * 2)
        for k in names:
            played[k].append(role[k])
    assert log == []
    assert all(sorted(r) == sorted(bench_stats.INSTANCES) for r in played.values())
    # turns of 3 steps in a row: each instance's steps (and every's reads) come together
    times = bench_stats.measure(steps, rounds=2, warmup=0, blocks=1, turn=3)
    assert {k: len(t) for k, t in times.items()} == dict.fromkeys(bench_stats.INSTANCES, 6)
    timed = log[14:]  # after settling: 2 x 3 entries for every and once, 2 x 4 for the others
    assert timed.count(("read", "b")) == 6 and len(timed) == 24 + 6  # b plays every in block 0
    assert all(timed[i + 1] == ("read", "b") for i, e in enumerate(timed) if e == ("step", "b"))
    steps_only = [k for what, k in timed if what == "step"]
    assert all(len(set(steps_only[i:i + 3])) == 1 for i in range(0, 24, 3)), steps_only


def test_stats_loop_benchmark_reads_one_block_of_each_pair_after_every_step():
    """bench_stats.loop: pairs of blocks, one read after each of its steps (after reads that
    turn the watch on), the other unread (after a read that turns it off); with ``pause`` a
    busy wait instead of the reads in the timed steps."""
    import os
    import sys
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from examples import bench_stats
    log = []

    class Compressor:
        def stats(self):
            log.append("read")
    unread, read, spent = bench_stats.loop(lambda: log.append("step"), Compressor(), rounds=2,
                                           block=3)
    assert len(unread) == len(read) == 2 and len(spent) == 6
    settle_unread = ["step"] * 3 + ["read", "step"]
    settle_read = ["read", "step", "read", "step", "read"]
    want = (settle_unread + ["step"] * 3 + settle_read + ["step", "read"] * 3 +
            settle_read + ["step", "read"] * 3 + settle_unread + ["step"] * 3)
    assert log == want
    log.clear()
    unread, read, spent = bench_stats.loop(lambda: log.append("step"), Compressor(), rounds=1,
                                           block=2, pause=1e-4)
    assert log.count("read") == 3 and all(p >= 1e-4 for p in spent) and len(spent) == 2  # settling


def test_stats_step_benchmark_pairs_the_rounds():
    """bench_stats.differences: the differences of the medians, then the median over groups of
    rounds of the difference of the groups' means."""
    import os
    import sys
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from examples import bench_stats
    # a drift that the pairs remove: every is 1 slower than never in each group of 2 rounds
    per = {"never": [10, 12, 20, 22, 30, 32, 40, 42, 50, 52],
           "every": [11, 13, 22, 22, 31, 33, 41, 43, 51, 53],
           "never2": [30, 30, 30, 30, 30, 30, 30, 30, 60, 62]}
    assert bench_stats.differences(per, "every", group=2) == [1.0, 2.0, 1.0, -8.0]
    # groups of 5: never 18.8 and 43.2, never2 30 and 42.4
    assert bench_stats.differences(per, "never", group=5) == pytest.approx([0, 1, 0, -5.2])
