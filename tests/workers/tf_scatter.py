"""The scatter exchange in a real TensorFlow job; each rank saves what it saw to an .npz.

1. Training with buckets (bucket_bytes=2048: a bucket of three tensors and a tensor alone), one
   model and compressor per mode: hvd.DistributedGradientTape eager and under tf.function (two
   batch sizes, two traces) and horovod.tensorflow.keras.DistributedOptimizer with model.fit;
   every rank's local and aggregated gradients per step, and the buckets' layouts.
2. hvd.allreduce of single tensors of odd sizes, and one with op=Sum and scale factors.
3. A NaN on the last rank at one step: the residuals (workers' and owners') before and after.
4. Mismatches, mixed exchanges among them (cases named after --cases): each prints the error it
   raised.
Sections 1-3 run once per configuration (--configs THRESHOLD:EXCHANGE ...), saved to
--out/<index>/rank<r>.npz; section 4 once, at the end: one launch, one TensorFlow import.
The names of the alltoalls traced per section (alltoall/<section>) show which exchange ran.
"""

import argparse
import os
import time

import numpy as np
import tensorflow as tf

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--configs", nargs="+", required=True,
               help="THRESHOLD:EXCHANGE each; sections 1-3 run once per configuration, saved "
                    "under --out/<index>/")
p.add_argument("--steps", type=int, default=4)
p.add_argument("--cases", nargs="*", default=[])
args = p.parse_args()

import horovod.tensorflow as hvd  # noqa: E402
import horovod.tensorflow.mpi_ops as mpi_ops  # noqa: E402
import horovod_twobit  # noqa: E402
from horovod_twobit.tensorflow import PayloadMismatchError, TwoBitCompressor  # noqa: E402
from configs import run_each, threshold_exchange  # noqa: E402
from tf_training import MODES, build_model, key, train  # noqa: E402

hvd.init()
rank, size = hvd.rank(), hvd.size()
print("rank %d uses %s" % (rank, os.path.dirname(horovod_twobit.__file__)), flush=True)
tf.config.threading.set_inter_op_parallelism_threads(1)
traced = []
_alltoall = mpi_ops.alltoall


def counting(tensor, *a, **kw):
    traced.append(kw.get("name"))
    return _alltoall(tensor, *a, **kw)


mpi_ops.alltoall = counting


def section(rec, name):
    rec["alltoall/" + name] = np.array([str(n) for n in traced])
    traced.clear()


def record(rec, mode, names, step, local, agg):
    for n, lg, ag in zip(names, local, agg):
        rec["%s/local/%d/%s" % (mode, step, n)] = np.asarray(lg)
        rec["%s/agg/%d/%s" % (mode, step, n)] = np.asarray(ag)


def layouts(c):
    return np.array([",".join(k[1]) for k in c.state.eager_fns if k[0] == "layout"])


def run(threshold, exchange):
    """Sections 1-3 with one threshold and exchange: the records to save."""
    rec = {}
    traced.clear()

    def compressor():
        return TwoBitCompressor(threshold, bucket_bytes=2048, exchange=exchange)

    for mode in MODES:
        model, c = build_model(), compressor()
        names = [key(v) for v in model.trainable_variables]
        for step, (local, agg) in enumerate(train(mode, model, c, args.steps)[0]):
            record(rec, mode, names, step, local, agg)
        for n, v in zip(names, model.trainable_variables):
            rec["%s/w/%s" % (mode, n)] = v.numpy()
        rec[mode + "/layouts"] = layouts(c)
        section(rec, mode)

    # single tensors of odd sizes (eager); "sum" with op=hvd.Sum and scale factors in a tf.function
    c = compressor()
    summed = tf.function(lambda t: hvd.allreduce(t, name="sum", compression=c, op=hvd.Sum,
                                                 prescale_factor=0.5, postscale_factor=3.0))
    for step in range(3):
        for n in (1, 17, 100, 16 * 7 + 3, 3000):
            g = np.random.default_rng(50 * rank + n + step).standard_normal(n).astype(np.float32)
            rec["single_in/%d/%d" % (n, step)] = g
            rec["single_out/%d/%d" % (n, step)] = hvd.allreduce(
                tf.constant(g), name="single%d" % n, compression=c).numpy()
        g = np.random.default_rng(9 * rank + step).standard_normal(70).astype(np.float32)
        rec["sum_in/%d" % step] = g
        rec["sum_out/%d" % step] = summed(tf.constant(g)).numpy()
    section(rec, "single")

    # non-finite: the last rank sends NaN at step 1; no residual changes, the owners' included
    nf = tf.function(lambda t: hvd.allreduce(t, name="nf", compression=c))

    def residuals():
        st = c.state_dict()
        return (st["residuals"].get("nf", np.zeros(200, np.float32)),
                st.get("owner_residuals", {}).get("nf", np.zeros(0, np.float32)))

    for step in range(3):
        g = np.random.default_rng(70 * rank + step).standard_normal(200).astype(np.float32)
        if step == 1 and rank == size - 1:
            g[3] = np.nan
        rec["nf_res_before/%d" % step], rec["nf_own_before/%d" % step] = residuals()
        rec["nf_in/%d" % step] = g
        rec["nf_out/%d" % step] = nf(tf.constant(g)).numpy()
        rec["nf_res_after/%d" % step], rec["nf_own_after/%d" % step] = residuals()
    return rec


run_each(args.out, args.configs, lambda spec: run(*threshold_exchange(spec)), rank)


def case_size_same_words():
    hvd.allreduce(tf.ones([33 + rank]), name="x", compression=TwoBitCompressor(
        0.5, exchange="scatter"))


def case_threshold_function():
    cc = TwoBitCompressor(0.5 if rank == 0 else 0.25, exchange="scatter")
    tf.function(lambda t: hvd.allreduce(t, name="x", compression=cc))(tf.ones([40]))


def case_auto_mixed_tape():
    v = tf.Variable(tf.ones([40]), name="v")
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(v * v)
    cc = TwoBitCompressor("auto" if rank == 0 else 0.5, exchange="scatter")
    hvd.DistributedGradientTape(tape, compression=cc).gradient(loss, [v])


def case_exchange():  # rank 0 uses the allgather exchange, the others scatter
    cc = TwoBitCompressor(0.5, exchange="allgather" if rank == 0 else "scatter")
    hvd.allreduce(tf.ones([40]), name="x", compression=cc)


def case_exchange_tape():  # a bucket of two, where rank 0 is the one that scatters
    a, b = tf.Variable(tf.ones([40]), name="a"), tf.Variable(tf.ones([30]), name="b")
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(a * a) + tf.reduce_sum(b * b)
    cc = TwoBitCompressor(0.5, exchange="scatter" if rank == 0 else "allgather")
    hvd.DistributedGradientTape(tape, compression=cc).gradient(loss, [a, b])


def case_auto_exchange_function():  # "auto" decides from the size: allgather on rank 0 only
    cc = TwoBitCompressor(0.5, exchange="auto")
    tf.function(lambda t: hvd.allreduce(t, name="x", compression=cc))(
        tf.ones([40 if rank == 0 else 3000]))


for case in args.cases:
    t0 = time.time()
    try:
        globals()["case_" + case]()
        print("CASE %s rank %d NO ERROR" % (case, rank), flush=True)
    except (PayloadMismatchError, tf.errors.OpError) as e:
        msg = getattr(e, "message", None) or str(e)
        if "PayloadMismatchError: " in msg:
            msg = msg[msg.index("PayloadMismatchError: "):].split("\n", 1)[0]
        print("CASE %s rank %d RAISED after %.1fs: %s: %s"
              % (case, rank, time.time() - t0, type(e).__name__, msg.replace("\n", " | ")[:2000]),
              flush=True)
    hvd.join()
print("rank %d done" % rank, flush=True)
