"""The CPU op for the "auto" levels (horovod_twobit/tensorflow/segment_levels.cc): the NumPy
reference's bits for every rule and segment shape, the exchanges' results unchanged by it (a
bucket's with the encode and finish ops too), and the TF ops' levels where it cannot be built.
The stats' row op and its table. The encode and finish ops alone:
tests/test_tf_native_bucket.py."""

import logging

import numpy as np
import pytest
import tensorflow as tf

from horovod_twobit import reference as ref
from horovod_twobit.reference import codec as rc
from horovod_twobit import wire
from horovod_twobit.tensorflow.codec import native_ops
from horovod_twobit.tensorflow import TwoBitCompressor
from horovod_twobit.tensorflow.exchange import bucket as bucket_mod
from horovod_twobit.tensorflow.exchange import single as communicator
from horovod_twobit.tensorflow.exchange.bucket import BucketExchange

import horovod.tensorflow.mpi_ops as mpi_ops

RULES = ["lsq", "mean", "rms", "lsq*1.5", "mean*0.7"]


@pytest.fixture(scope="module")
def op():
    mod = native_ops.module()
    assert mod is not None, native_ops.unavailable_reason()  # g++ is installed by setup.sh
    return mod


def test_stats_row_op_keeps_each_slots_last_row_for_reads_without_tensorflow(op):
    """``TwoBitStatsRow`` keeps the row of its step per slot number, the last step's; the table
    reader (ctypes) gives every asked slot's row, NaN for a slot never stepped, forgotten, or
    asked with another width; a row that is not a vector is refused."""
    a, b = 1_000_001, 1_000_002  # numbers no compressor's slots take in this process

    @tf.function
    def step(row):
        return native_ops.stats_row(row, a)
    for i in range(3):  # the same traced step, three times: the last row is kept
        assert bool(step(tf.constant([i, 0.5, -2.0, np.inf], tf.float64)))
    assert bool(native_ops.stats_row(tf.constant([7.0, 8.0, 9.0, 1.0], tf.float64), b))
    rows = native_ops.StatsRows([b, 999_999_999, a], 4).read()
    assert rows[0] == [7.0, 8.0, 9.0, 1.0] and rows[2] == [2, 0.5, -2.0, np.inf]
    assert np.isnan(rows[1]).all()
    assert np.isnan(native_ops.StatsRows([a], 5).read()).all()  # another width: not that row
    native_ops.forget_stats_rows([a])
    rows = native_ops.StatsRows([a, b], 4).read()
    assert np.isnan(rows[0]).all() and rows[1] == [7.0, 8.0, 9.0, 1.0]
    native_ops.forget_stats_rows([b])
    with pytest.raises(tf.errors.InvalidArgumentError, match="non-empty vector"):
        native_ops.stats_row(tf.zeros([2, 2], tf.float64), a)


def _values(rng, n):
    """Gradient-like values of mixed scales, with exact zeros and repeated values (ties)."""
    g = (rng.standard_normal(n) * rng.choice([1e-4, 1e-2, 1.0], n)).astype(np.float32)
    g[rng.random(n) < 0.1] = 0.0
    g[rng.random(n) < 0.05] = 0.25
    b = (rng.standard_normal(n) * 1e-3).astype(np.float32)
    return g, b


def _segments(rng):
    """Segment lengths around the op's 8-value steps, an empty one, a zero segment, long ones."""
    lengths = [1, 7, 8, 9, 15, 16, 17, 0, 64, 256, 1000, 4099, 3, 4, 8]
    lengths += list(rng.integers(1, 300, 20))
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    return starts, np.asarray(lengths, np.int64)


@pytest.mark.parametrize("rule", RULES)
def test_op_gives_the_references_levels(op, rule):
    rng = np.random.default_rng(len(rule))
    starts, lengths = _segments(rng)
    n = int(starts[-1] + lengths[-1]) + 5  # values after the last segment are not read
    g, b = _values(rng, n)
    g[starts[8]:starts[8] + lengths[8]] = 0.0  # all zeros: the smallest normal, never 0
    b[starts[8]:starts[8] + lengths[8]] = 0.0
    for i in (13, 14):  # values on a candidate threshold: "lsq" picks 1.5, not 1.0 as with >
        g[starts[i]:starts[i] + lengths[i]] = np.tile([1.0, -1.0, 2.0, 4.0], lengths[i] // 4)
        b[starts[i]:starts[i] + lengths[i]] = 0.0
    t, v = native_ops.segment_levels(tf.constant(g), tf.constant(b), starts, lengths, rule)
    x = b + g
    want = [rc.auto_levels(x[s:s + k], rule) for s, k in zip(starts, lengths)]
    np.testing.assert_array_equal(t.numpy().view(np.int32),
                                  np.array([w[0] for w in want], np.float32).view(np.int32))
    np.testing.assert_array_equal(v.numpy().view(np.int32),
                                  np.array([w[1] for w in want], np.float32).view(np.int32))
    assert t.numpy()[8] == np.finfo(np.float32).tiny and t.numpy()[7] == v.numpy()[7] == 1.0
    if rule == "lsq":
        assert list(t.numpy()[13:15]) == [1.5, 1.5] and list(v.numpy()[13:15]) == [3.0, 3.0]


def test_op_refuses_segments_outside_the_values(op):
    g = tf.zeros([10])
    with pytest.raises(tf.errors.InvalidArgumentError, match="segment 1 lies outside the 10"):
        native_ops.segment_levels(g, g, [0, 8], [4, 4], "lsq")
    with pytest.raises(tf.errors.InvalidArgumentError, match="g and b differ in size"):
        native_ops.segment_levels(g, tf.zeros([9]), [0], [4], "lsq")


def test_op_is_not_used_for_the_opt_rule_nor_with_a_gpu(op, monkeypatch):
    assert native_ops.usable("lsq") and native_ops.usable("rms*2")
    assert not native_ops.usable("opt")
    monkeypatch.setattr(tf.config, "list_logical_devices", lambda kind=None: ["GPU:0"])
    assert not native_ops.usable("lsq")


def _bucket_step(shapes, threshold, blocks, seed, graph, exchange=BucketExchange):
    """Two steps of one bucket through a BucketExchange (or one tensor through an ``exchange``
    of the communicator), 2 ranks simulated by this rank's payload twice: each step's payload,
    result and residuals. Each step's results and residuals are also checked, bit for bit,
    against the NumPy reference's two workers given the same gradients."""
    rng = np.random.default_rng(seed)
    comp = TwoBitCompressor(threshold, blocks=blocks)
    workers = ref.Workers(2, threshold, blocks=blocks)
    keys = ["t%d" % i for i in range(len(shapes))]
    out = []
    for _ in range(2):
        xs = [(rng.standard_normal(s) * 0.01).astype(np.float32) for s in shapes]
        gs = [tf.constant(x) for x in xs]

        def step(gs):
            if exchange is BucketExchange:
                ex = BucketExchange(comp, gs, keys, mpi_ops.Average, 1.0, 1.0, 2)
            else:
                ex = exchange(comp, gs[0], keys[0], mpi_ops.Average, 1.0, 1.0, 2)
            res = ex.finish(tf.concat([ex.payload] * 2, 0))
            return ex.payload, res if isinstance(res, (list, tuple)) else [res]

        payload, res = tf.function(step, autograph=False)(gs) if graph else step(gs)
        out.append([payload.numpy()] + [r.numpy() for r in res]
                   + [comp.residuals.get(k, g).numpy() for k, g in zip(keys, gs)])
        want = workers.bucket(keys, [xs, xs])
        for i, (k, w) in enumerate(zip(keys, want)):
            np.testing.assert_array_equal(out[-1][1 + i].view(np.int32), w.view(np.int32),
                                          err_msg="result of %s" % k)
            np.testing.assert_array_equal(out[-1][1 + len(keys) + i].reshape(-1).view(np.int32),
                                          workers.residuals[0][k].view(np.int32),
                                          err_msg="residual of %s" % k)
    return out


def _assert_same(steps, others):
    """Every array of every step equal, bit for bit."""
    for a, b in zip(steps, others):
        for x, y in zip(a, b):
            np.testing.assert_array_equal(x.view(np.int32), y.view(np.int32))


@pytest.mark.parametrize("graph", [False, True])
@pytest.mark.parametrize("blocks", [None, 1])
@pytest.mark.parametrize("shapes", [[(300, 257), (17,), (128, 128), (5,)], [(40, 40), (9,)]],
                         ids=["xla", "plain"])  # above and below kernels.COMPILE_MIN_NUMEL
def test_bucket_exchange_is_the_same_with_and_without_the_op(op, monkeypatch, graph, blocks,
                                                             shapes):
    calls = []
    real = native_ops.segment_levels
    monkeypatch.setattr(native_ops, "segment_levels",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    with_op = _bucket_step(shapes, "auto", blocks, 3, graph)
    assert calls, "the bucket did not use the op"
    monkeypatch.setattr(native_ops, "usable", lambda rule: False)
    without = _bucket_step(shapes, "auto", blocks, 3, graph)
    _assert_same(with_op, without)


@pytest.mark.parametrize("blocks", [None, 1])
def test_one_tensors_exchange_is_the_same_with_and_without_the_op(op, monkeypatch, blocks):
    calls = []
    real = native_ops.segment_levels
    monkeypatch.setattr(native_ops, "segment_levels",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    with_op = _bucket_step([(300, 257)], "auto", blocks, 4, True, communicator.Exchange)
    assert calls, "the exchange did not use the op"
    monkeypatch.setattr(native_ops, "usable", lambda rule: False)
    without = _bucket_step([(300, 257)], "auto", blocks, 4, True, communicator.Exchange)
    _assert_same(with_op, without)


def test_without_a_compiler_the_levels_come_from_tf_ops(op, monkeypatch, tmp_path, caplog):
    with_op = _bucket_step([(40, 40), (9,)], "auto", None, 5, False)
    monkeypatch.setattr(native_ops, "_loaded", {})
    monkeypatch.setenv("HOROVOD_TWOBIT_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    with caplog.at_level(logging.WARNING, logger=native_ops.__name__):
        assert native_ops.module() is None and not native_ops.usable("lsq")
    assert "Install a C++ compiler" in caplog.text and "/nonexistent/c++" in caplog.text
    calls = []
    monkeypatch.setattr(bucket_mod.native_ops, "segment_levels", lambda *a: calls.append(1))
    without = _bucket_step([(40, 40), (9,)], "auto", None, 5, False)
    assert not calls
    _assert_same(with_op, without)
    monkeypatch.setattr(native_ops, "_loaded", {})
    monkeypatch.setenv("HOROVOD_TWOBIT_NATIVE", "0")
    caplog.clear()
    assert native_ops.module() is None and not caplog.text
