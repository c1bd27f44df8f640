"""Runs the given cases one after another in one job. Each must raise the documented error on every
rank, quickly and without a hang (or, for the cases that must work, print OK). Every case is
symmetric across ranks, so the job stays in step after each error."""

import sys
import time
import traceback

import numpy as np
import tensorflow as tf

import horovod.tensorflow as hvd
from horovod_twobit import reference as ref
from horovod_twobit.tensorflow import PayloadMismatchError, TwoBitCompressor

hvd.init()
rank, size = hvd.rank(), hvd.size()


def tape_grads(compression, loss_fn, variables, **kw):
    with tf.GradientTape() as tape:
        loss = loss_fn()
    tape = hvd.DistributedGradientTape(tape, compression=compression, **kw)
    return tape.gradient(loss, variables)


def case_threshold():
    c = TwoBitCompressor(0.5 if rank == 0 else 0.25)
    hvd.allreduce(tf.ones([40]), name="x", compression=c)


def case_threshold_function():
    c = TwoBitCompressor(0.5 if rank == 0 else 0.25)
    tf.function(lambda t: hvd.allreduce(t, name="x", compression=c))(tf.ones([40]))


def case_threshold_tape():
    c = TwoBitCompressor(0.5 if rank == 0 else 0.25)
    v = tf.Variable(tf.ones([40]), name="v")
    tape_grads(c, lambda: tf.reduce_sum(v * v), [v])


def case_threshold_keras():
    import horovod.tensorflow.keras as hvd_k
    c = TwoBitCompressor(0.5 if rank == 0 else 0.25)
    model = tf.keras.Sequential([tf.keras.layers.Dense(3, name="d")])
    model.compile(optimizer=hvd_k.DistributedOptimizer(tf.keras.optimizers.SGD(0.1), compression=c),
                  loss="mse")
    model.fit(np.ones((8, 4), np.float32), np.ones((8, 3), np.float32), batch_size=8, verbose=0)


def case_auto_mixed():
    c = TwoBitCompressor("auto" if rank == 0 else 0.5)
    hvd.allreduce(tf.ones([40]), name="x", compression=c)


def case_auto_mixed_tape():
    c = TwoBitCompressor(0.5 if rank == 0 else "auto")
    v = tf.Variable(tf.ones([40]), name="v")
    tape_grads(c, lambda: tf.reduce_sum(v * v), [v])


def case_auto_nonfinite():
    """threshold="auto" with an Inf on one rank: every rank gets NaN, no residual moves, and the
    next step equals the simulation's as if the Inf step never happened."""
    c = TwoBitCompressor("auto")
    sim = ref.Workers(size, "auto")
    gs = [np.random.default_rng(r).standard_normal(20).astype(np.float32) * (r + 1)
          for r in range(size)]
    fn = tf.function(lambda t: hvd.allreduce(t, name="anf", compression=c))
    np.testing.assert_array_equal(fn(tf.constant(gs[rank])).numpy(), sim.allreduce("anf", gs))
    bad = gs[rank].copy()
    if rank == size - 1:
        bad[3] = np.inf
    before = c.residuals.variable("anf").numpy().copy()
    out = fn(tf.constant(bad))
    assert np.isnan(out.numpy()).all(), out
    np.testing.assert_array_equal(c.residuals.variable("anf").numpy(), before)
    np.testing.assert_array_equal(fn(tf.constant(gs[rank])).numpy(), sim.allreduce("anf", gs))
    return "OK"


def case_size():
    hvd.allreduce(tf.ones([40 + 20 * rank]), name="x", compression=TwoBitCompressor(0.5))


def case_size_same_words():
    hvd.allreduce(tf.ones([33 + rank]), name="x", compression=TwoBitCompressor(0.5))


def case_noname():
    hvd.allreduce(tf.ones([4]), compression=TwoBitCompressor(0.5))


def case_class():
    hvd.allreduce(tf.ones([4]), name="x", compression=TwoBitCompressor)


def case_op():
    hvd.allreduce(tf.ones([4]), name="x", op=hvd.Max, compression=TwoBitCompressor(0.5))


def case_adasum():
    hvd.DistributedGradientTape(tf.GradientTape(), op=hvd.Adasum, compression=TwoBitCompressor(0.5))


def _embedding(sparse_as_dense):
    emb = tf.Variable(tf.ones([10, 4]), name="emb")
    return tape_grads(TwoBitCompressor(0.5),
                      lambda: tf.reduce_sum(tf.gather(emb, [1, 2]) * (rank + 1.0)), [emb],
                      sparse_as_dense=sparse_as_dense)


def case_sparse():
    _embedding(False)


def case_sparse_as_dense():
    g = _embedding(True)[0]
    assert isinstance(g, tf.Tensor), type(g)
    # rows 1 and 2 carry (1 + 2) / 2 = 1.5 on average, quantized to one threshold (0.5) per step
    want = np.zeros((10, 4), np.float32)
    want[1:3] = 0.5
    np.testing.assert_array_equal(g.numpy(), want)
    return "OK"


def case_nonfinite():
    """A NaN on one rank: every rank gets NaN and no residual moves; the next step is as if the
    NaN step never happened."""
    c = TwoBitCompressor(0.5)
    sim = ref.Workers(size, 0.5)
    rng = np.random.default_rng(rank)
    g = rng.standard_normal(20).astype(np.float32)
    gs = [np.random.default_rng(r).standard_normal(20).astype(np.float32) for r in range(size)]
    first = hvd.allreduce(tf.constant(g), name="nf", compression=c)
    sim.allreduce("nf", gs)
    bad = g.copy()
    if rank == size - 1:
        bad[3] = np.inf
    before = c.residuals.variable("nf").numpy().copy()
    out = tf.function(lambda t: hvd.allreduce(t, name="nf", compression=c))(tf.constant(bad))
    assert np.isnan(out.numpy()).all(), out
    np.testing.assert_array_equal(c.residuals.variable("nf").numpy(), before)
    again = hvd.allreduce(tf.constant(g), name="nf", compression=c)
    np.testing.assert_array_equal(again.numpy(), sim.allreduce("nf", gs))
    assert first is not None
    return "OK"


def case_uninstalled():
    """Without the router a TwoBitCompressor tensor takes Horovod's ordinary allreduce: exact,
    uncompressed, with one warning; install() brings the router back."""
    import warnings
    import horovod_twobit.tensorflow as htf
    c = TwoBitCompressor(0.5)
    htf.uninstall()
    try:
        assert not htf.installed()
        x = tf.constant([0.1, 0.2, 0.3]) * (rank + 1)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            out = hvd.allreduce(x, name="u", compression=c)
        assert any("ordinary allreduce, uncompressed" in str(w.message) for w in seen), seen
        want = sum(np.array([0.1, 0.2, 0.3], np.float32) * (r + 1) for r in range(size)) / size
        np.testing.assert_allclose(out.numpy(), want, rtol=1e-6)
        assert "u" not in c.residuals
    finally:
        htf.install()
    assert htf.installed()
    out = hvd.allreduce(tf.constant([0.7, -0.7, 0.1]), name="u", compression=c)
    np.testing.assert_array_equal(out.numpy(), [0.5, -0.5, 0.0])
    assert "u" in c.residuals
    return "OK"


def run(case):
    t0 = time.time()
    try:
        res = globals()["case_" + case]()
    except (PayloadMismatchError, ValueError, TypeError, tf.errors.OpError) as e:
        msg = getattr(e, "message", None) or str(e)
        if isinstance(e, tf.errors.OpError) and "PayloadMismatchError: " in msg:
            # a graph error: TensorFlow puts the node's Python traceback first
            msg = msg[msg.index("PayloadMismatchError: "):].split("\n", 1)[0]
        msg = msg.replace("\n", " | ")
        print("CASE %s rank %d RAISED after %.1fs: %s: %s"
              % (case, rank, time.time() - t0, type(e).__name__, msg[:2000]), flush=True)
        return
    except Exception:
        traceback.print_exc()
        print("CASE %s rank %d UNEXPECTED" % (case, rank), flush=True)
        return
    print("CASE %s rank %d %s" % (case, rank, res if res == "OK" else "NO ERROR"), flush=True)


for name in sys.argv[1:]:
    run(name)
    hvd.join()
print("rank %d finished" % rank, flush=True)
