"""A bucket's encode and finish as CPU ops (horovod_twobit/tensorflow/bucket_encode.cc and
bucket_finish.cc, through bucket_passes.NativePasses): the payloads, results and residuals of the
TF and XLA bodies, bit for bit, over several steps and ranks, through a NaN/Inf step and the
steps after it, and the results and residuals of both those of the NumPy reference (with a
prescale, one rank, an empty member and the fault); the ops' errors; where they are not used."""

import numpy as np
import pytest
import tensorflow as tf

from horovod_twobit import reference as ref
from horovod_twobit.tensorflow.codec import passes as bucket_passes, native_ops
from horovod_twobit.tensorflow import TwoBitCompressor
from horovod_twobit.tensorflow.exchange.bucket import BucketExchange

import horovod.tensorflow.mpi_ops as mpi_ops


@pytest.fixture(scope="module")
def op():
    mod = native_ops.module()
    assert mod is not None, native_ops.unavailable_reason()  # g++ is installed by setup.sh
    return mod


SHAPES = {"xla": [(300, 257), (17,), (0,), (128, 128), (5,)],  # above kernels.COMPILE_MIN_NUMEL
          "plain": [(40, 40), (9,), (3, 7)]}


def _run(shapes, threshold, kw, nranks, graph, op, scale, steps=4, fault=1):
    """``steps`` steps of one bucket on ``nranks`` simulated ranks (each its own compressor and
    gradients; the payloads gathered in rank order); rank 1's (or 0's) second member holds NaN and
    Inf at step ``fault``. Returns every step's payloads, results and residuals, how many
    exchanges ran the ops, and every step's gradients (``grads[step][rank][member]``)."""
    comps = [TwoBitCompressor(threshold, **kw) for _ in range(nranks)]
    keys = ["t%d" % i for i in range(len(shapes))]
    used = []
    real = native_ops.bucket_encode

    def counted(*a):
        used.append(1)
        return real(*a)

    def step(*flat):
        gs = [list(flat[r * len(shapes):(r + 1) * len(shapes)]) for r in range(nranks)]
        exs = [BucketExchange(c, g, keys, op, scale, 1.0, nranks) for c, g in zip(comps, gs)]
        # opaque, as Horovod's allgather is: Grappler would otherwise fold the average's divisor
        # into a constant and the TF body's division into a multiplication by its reciprocal
        gathered = tf.numpy_function(lambda a: a, [tf.concat([ex.payload for ex in exs], 0)],
                                     tf.int32, stateful=True)
        return [ex.payload for ex in exs], [ex.finish(gathered) for ex in exs]

    step = tf.function(step, autograph=False) if graph else step
    out, inputs = [], []
    orig = native_ops.bucket_encode
    native_ops.bucket_encode = counted
    try:
        for s in range(steps):
            rng = np.random.default_rng(10 * s + nranks)
            grads = [[(rng.standard_normal(sh) * rng.choice([1e-3, 0.03, 0.4], sh))
                      .astype(np.float32) for sh in shapes] for _ in range(nranks)]
            if s == 0 and threshold != "auto":  # values on the threshold: sent, residual 0
                grads[0][0].reshape(-1)[:4] = [threshold, -threshold, threshold, 0.0]
            if s == fault:
                bad = grads[min(1, nranks - 1)][1].reshape(-1)
                bad[0], bad[-1] = np.nan, -np.inf
            inputs.append([[g.copy() for g in gs] for gs in grads])
            payloads, results = step(*[tf.constant(g) for gs in grads for g in gs])
            out.append([p.numpy() for p in payloads] + [r.numpy() for rs in results for r in rs]
                       + [c.residuals.variable(k).numpy() for c in comps for k in keys])
    finally:
        native_ops.bucket_encode = orig
    return out, len(used), inputs


def _reference(shapes, threshold, kw, nranks, op, scale, inputs):
    """The NumPy reference's results and residuals of the same steps: per step, each rank's
    results (``[rank][member]``, each member's shape) and each rank's residuals
    (``[rank][member]``, flat)."""
    w = ref.Workers(nranks, threshold, **kw)
    keys = ["t%d" % i for i in range(len(shapes))]
    mode = "average" if op == mpi_ops.Average else "sum"
    out = []
    for grads in inputs:
        want = w.bucket(keys, grads, op=mode, prescale=scale)
        out.append(([[np.reshape(x, sh) for x, sh in zip(want, shapes)]] * nranks,
                    [[w.residuals[r][k].copy() for k in keys] for r in range(nranks)]))
    return out


def _same_bits(got, want, msg):
    """Bit for bit: NaN where the reference has NaN, every other value's float32 bits equal."""
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert got.shape == want.shape, msg
    nan = np.isnan(want)
    np.testing.assert_array_equal(np.isnan(got), nan, err_msg=msg)
    np.testing.assert_array_equal(got[~nan].view(np.int32), want[~nan].view(np.int32), err_msg=msg)


@pytest.mark.parametrize("shapes", list(SHAPES), ids=list(SHAPES))
@pytest.mark.parametrize("graph,op_,scale",
                         [(True, mpi_ops.Average, 1.0), (False, mpi_ops.Sum, 0.5)],
                         ids=["graph-avg", "eager-sum"])
@pytest.mark.parametrize("nranks", [1, 3])
@pytest.mark.parametrize("threshold,kw", [(0.05, {}), ("auto", {}), ("auto", dict(block=16)),
                                          ("auto", dict(blocks=4))],
                         ids=["fixed", "auto", "auto-block16", "auto-blocks4"])
def test_bucket_ops_match_the_bodies_through_a_fault(op, monkeypatch, shapes, graph, op_, scale,
                                                     nranks, threshold, kw):
    with_ops, used, inputs = _run(SHAPES[shapes], threshold, kw, nranks, graph, op_, scale)
    assert used, "the bucket did not run the ops"
    monkeypatch.setattr(bucket_passes, "native", lambda *a: False)
    bodies, used, again = _run(SHAPES[shapes], threshold, kw, nranks, graph, op_, scale)
    assert not used
    # both against the NumPy reference (the prescale, one rank, the empty member, the fault)
    nmembers = len(SHAPES[shapes])
    for s, (results, residuals) in enumerate(_reference(SHAPES[shapes], threshold, kw, nranks,
                                                        op_, scale, inputs)):
        for name, arrays, grads in (("ops", with_ops[s], inputs[s]), ("bodies", bodies[s],
                                                                       again[s])):
            assert all(np.array_equal(a, b, equal_nan=True)
                       for ga, gb in zip(grads, inputs[s]) for a, b in zip(ga, gb))
            got = arrays[nranks:nranks + nranks * nmembers]
            res = arrays[nranks + nranks * nmembers:]
            for rank in range(nranks):
                for i in range(nmembers):
                    msg = "%s, step %d, rank %d, member %d" % (name, s, rank, i)
                    _same_bits(got[rank * nmembers + i], results[rank][i], "result: " + msg)
                    _same_bits(res[rank * nmembers + i].reshape(-1), residuals[rank][i],
                               "residual: " + msg)
    for s, (a, b) in enumerate(zip(with_ops, bodies)):
        for i, (x, y) in enumerate(zip(a, b)):
            np.testing.assert_array_equal(x.view(np.int32), y.view(np.int32),
                                          err_msg="step %d, array %d" % (s, i))
    # the faulty member is NaN on every rank at the fault and finite at every step after it
    for s, arrays in enumerate(with_ops):
        results = arrays[nranks:nranks + nranks * nmembers]
        for rank in range(nranks):
            member = results[rank * nmembers + 1]
            assert np.isnan(member).all() == (s == 1) and (s == 1 or np.isfinite(member).all())


def test_a_traced_payload_has_its_static_length(op):
    """Graph mode: the op's payload has the layout's length as its static shape (the stats read
    its parts by static slices)."""
    comp = TwoBitCompressor("auto")
    gs = [tf.TensorSpec([40], tf.float32), tf.TensorSpec([9], tf.float32)]

    @tf.function(input_signature=gs)
    def f(a, b):
        ex = BucketExchange(comp, [a, b], ["a", "b"], mpi_ops.Sum, 1.0, 1.0, 2)
        assert isinstance(ex.passes, bucket_passes.NativePasses)
        assert ex.payload.shape.as_list() == [ex.layout.payload_words]
        return ex.payload

    f.get_concrete_function()


def test_a_payload_flags_its_nonfinite_members(op):
    """Header word 1 gets FLAG_NONFINITE and the member's flag byte is 1, from the op."""
    comp = TwoBitCompressor(0.05)
    g = [np.zeros(40, np.float32), np.ones(9, np.float32), np.zeros(3, np.float32)]
    g[1][4] = np.inf
    ex = BucketExchange(comp, [tf.constant(x) for x in g], ["a", "b", "c"], mpi_ops.Sum, 1.0,
                        1.0, 1)
    assert isinstance(ex.passes, bucket_passes.NativePasses)
    p = ex.payload.numpy()
    assert p[1] & 1 and p[8] == 1 << 8  # members a, b, c: flag bytes 0, 1, 0


def test_ops_refuse_inputs_that_do_not_fit(op):
    g = tf.zeros([32])
    ints = lambda *v: tf.constant(np.asarray(v, np.int64))
    head = tf.zeros([8], tf.int32)
    t = tf.constant([0.5])
    with pytest.raises(tf.errors.InvalidArgumentError, match="must add up to 2"):
        op.two_bit_bucket_encode(g, g, t, t, ints(1, 2), ints(), head, mags_at=9,
                                 body_at=9)
    with pytest.raises(tf.errors.InvalidArgumentError, match="same whole words"):
        op.two_bit_bucket_encode(g, tf.zeros([31]), t, t, ints(2), ints(), head,
                                 mags_at=9, body_at=9)
    with pytest.raises(tf.errors.InvalidArgumentError, match="head must hold 8"):
        op.two_bit_bucket_encode(g, g, t, t, ints(2), ints(), head[:7], mags_at=9,
                                 body_at=9)
    with pytest.raises(tf.errors.InvalidArgumentError, match="flags and magnitudes overrun"):
        op.two_bit_bucket_encode(g, g, t, t, ints(2), ints(), head, mags_at=8, body_at=9)
    rows = tf.zeros([2, 11], tf.int32)
    with pytest.raises(tf.errors.InvalidArgumentError, match="do not fit 2 packed words"):
        op.two_bit_bucket_finish(rows, True, 2.0, g, g, t, t, ints(2), ints(), False, mags_at=9,
                                 body_at=8, average=True, scale=1.0)
    with pytest.raises(tf.errors.InvalidArgumentError, match="one threshold and magnitude"):
        op.two_bit_bucket_finish(rows, True, 2.0, g, g, tf.constant([0.5, 0.5]), t, ints(2),
                                 ints(), False, mags_at=9, body_at=9, average=True, scale=1.0)


def test_ops_are_not_used_with_a_gpu_nor_for_the_opt_rule(op, monkeypatch):
    keys, gs = ["a", "b"], [tf.zeros([40]), tf.zeros([9])]
    assert isinstance(BucketExchange(TwoBitCompressor("auto"), gs, keys, mpi_ops.Sum, 1.0, 1.0,
                                     2).passes, bucket_passes.NativePasses)
    opt = BucketExchange(TwoBitCompressor("auto", rule="opt"), gs, keys, mpi_ops.Sum, 1.0, 1.0, 2)
    assert isinstance(opt.passes, bucket_passes.Passes)
    monkeypatch.setattr(tf.config, "list_logical_devices", lambda kind=None: ["GPU:0"])
    assert not native_ops.codec_usable()
    gpu = BucketExchange(TwoBitCompressor(0.5), gs, keys, mpi_ops.Sum, 1.0, 1.0, 2)
    assert isinstance(gpu.passes, bucket_passes.Passes)
