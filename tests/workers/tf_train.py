"""A real Horovod TensorFlow job with TwoBitCompressor; each rank saves what it saw to an .npz.

One job runs several configurations in turn (--configs, see below), each with its own model and
compressor, and saves configuration i to --out/<i>/rank<r>.npz: one launch, one TensorFlow import.

Modes:
  tape_eager     hvd.DistributedGradientTape in an eager loop
  tape_function  the same step under tf.function, called with two batch sizes (two traces)
  keras          model.fit with horovod.tensorflow.keras.DistributedOptimizer
For every step the rank records its local gradients (local/<step>/<var>) and the averaged ones it
received (agg/<step>/<var>); tests/sim.py replays them against the NumPy N-worker simulation.
"""

import argparse

import numpy as np
import tensorflow as tf

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--steps", type=int, default=20)
p.add_argument("--configs", nargs="+", required=True,
               help="MODE:THRESHOLD:GROUPS:BLOCK:BLOCKS each (BLOCK, BLOCKS: - for none); one "
                    "model and compressor per configuration, saved under --out/<index>/")
args = p.parse_args()

import horovod.tensorflow as hvd  # noqa: E402
from horovod_twobit.tensorflow import TwoBitCompressor  # noqa: E402
from configs import run_each  # noqa: E402
from tf_training import build_model, key, train  # noqa: E402

hvd.init()
rank, size = hvd.rank(), hvd.size()
tf.config.threading.set_inter_op_parallelism_threads(1)
tf.config.threading.set_intra_op_parallelism_threads(1)


def run(mode, threshold, groups, block, blocks):
    model = build_model()
    compressor = TwoBitCompressor(threshold, block=block, blocks=blocks)
    names = [key(v) for v in model.trainable_variables]
    seen, traces = train(mode, model, compressor, args.steps,
                         **({"groups": groups} if groups else {}))
    rec = {}
    for step, (local, agg) in enumerate(seen):
        for n, lg, ag in zip(names, local, agg):
            rec["local/%d/%s" % (step, n)] = lg
            rec["agg/%d/%s" % (step, n)] = ag
    if traces is not None:
        rec["traces"] = np.array(traces)

    # An ordinary allreduce in the same job is exact and uncompressed.
    plain = tf.range(10, dtype=tf.float32) * (rank + 1) + 0.001
    rec["plain"] = hvd.allreduce(plain, name="plain", op=hvd.Sum).numpy()

    # hvd.allreduce with the compressor, twice under the same name, inside a tf.function traced
    # for two signatures: the residual carries over and exists once.
    @tf.function
    def direct(t):
        return hvd.allreduce(t, name="direct", compression=compressor)

    for i in range(2):
        t = np.random.default_rng(7 + rank + 100 * i).standard_normal(50).astype(np.float32)
        rec["direct_in/%d" % i] = t
        arg = tf.constant(t) if i == 0 else tf.constant(t.reshape(5, 10))
        rec["direct_out/%d" % i] = direct(arg).numpy().reshape(-1)
    rec["direct_traces"] = np.array(direct.experimental_get_tracing_count())

    # hvd.grouped_allreduce with a name and op=Sum: the float tensors are compressed (residuals
    # "grp.0", "grp.2"), the int32 one travels exactly through Horovod's own grouped allreduce.
    rng = np.random.default_rng(50 + rank)
    ga = rng.standard_normal(30).astype(np.float32)
    gc = rng.standard_normal((3, 7)).astype(np.float32)
    gb = np.arange(6, dtype=np.int32) * (rank + 1)
    outs = hvd.grouped_allreduce([tf.constant(ga), tf.constant(gb), tf.constant(gc)], name="grp",
                                 op=hvd.Sum, compression=compressor)
    rec.update({"grp_in/0": ga, "grp_in/2": gc, "grp_out/0": outs[0].numpy(),
                "grp_out/1": outs[1].numpy(), "grp_out/2": outs[2].numpy()})
    # prescale * postscale multiplies the average
    t = rng.standard_normal(40).astype(np.float32)
    rec["scaled_in"] = t
    rec["scaled_out"] = hvd.allreduce(tf.constant(t), name="scaled", compression=compressor,
                                      prescale_factor=0.5, postscale_factor=3.0).numpy()
    for n, v in zip(names, model.trainable_variables):
        rec["w/" + n] = v.numpy()
    rec["residual_names"] = np.array(compressor.residuals.names())
    rec["tracked_variables"] = np.array(len(compressor.trainable_variables)
                                        + len(compressor.variables))
    return rec


def config(spec):
    mode, threshold, groups, block, blocks = spec.split(":")
    assert mode in ("tape_eager", "tape_function", "keras"), mode
    num = lambda v: None if v == "-" else int(v)  # noqa: E731
    return (mode, threshold if threshold == "auto" else float(threshold), int(groups), num(block),
            num(blocks))


run_each(args.out, args.configs, lambda spec: run(*config(spec)), rank)
print("rank %d done" % rank)
