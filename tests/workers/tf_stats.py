"""TwoBitCompressor.stats() in a real TensorFlow job: hvd.DistributedGradientTape in a
tf.function with buckets (bucket_bytes=2048: a bucket of three tensors and a tensor alone), a NaN
in the last rank's hidden/bias gradient at step 2, stats read after every step (and reset after
step 3); then Keras fit with TwoBitStatsCallback(every=1) and CSVLogger. Saves, per configuration
(--configs THRESHOLD:EXCHANGE) and rank, the local gradients and the stats (as JSON), the logs
the callback filled and the CSV, to OUT/<index>/rank<r>.npz. And, for the tape's step and Keras'
train step, every tensor this rank hands to Horovod's allgather and alltoall (collective, name,
bytes: its static number of elements times its element size, taken where the step is traced)."""

import argparse
import json
import os

import numpy as np
import tensorflow as tf

import horovod.tensorflow as hvd
import horovod.tensorflow.mpi_ops as mpi_ops
from horovod_twobit.tensorflow import TwoBitCompressor, TwoBitStatsCallback
from configs import run_each, threshold_exchange
from tf_training import batch, build_model, key

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--configs", nargs="+", required=True)
p.add_argument("--steps", type=int, default=5)
args = p.parse_args()
hvd.init()
rank = hvd.rank()
tf.config.threading.set_inter_op_parallelism_threads(1)
handed = []  # (collective, name, bytes) of each tensor a traced step hands to the collectives


def counting(kind, collective):
    def call(tensor, *a, **kw):
        n = tensor.shape.num_elements()
        if n is None:
            raise RuntimeError("%s of %s: no static size to count" % (kind, tensor))
        handed.append((kind, kw.get("name") or "", n * tensor.dtype.size))
        return collective(tensor, *a, **kw)
    return call


mpi_ops.allgather = counting("allgather", mpi_ops.allgather)
mpi_ops.alltoall = counting("alltoall", mpi_ops.alltoall)


def run(threshold, exchange):
    rec = {}
    model = build_model()
    variables = model.trainable_variables
    names = [key(v) for v in variables]
    target = names.index("hidden/bias")
    hvd.broadcast_variables(variables, root_rank=0)
    c = TwoBitCompressor(threshold, bucket_bytes=2048, exchange=exchange)
    traces = []

    @tf.function
    def train_step(x, y, f):
        handed.clear()  # each trace counts its own collectives
        traces.append(1)
        with tf.GradientTape(persistent=True) as tape:
            loss = tf.reduce_mean(tf.square(model(x) - y)) * 3.0
            loss += tf.reduce_sum(variables[target] * f)
        local = tape.gradient(loss, variables)
        agg = hvd.DistributedGradientTape(tape, compression=c).gradient(loss, variables)
        ok = tf.reduce_all([tf.reduce_all(tf.math.is_finite(g)) for g in agg])
        for v, g in zip(variables, agg):
            v.assign_sub(tf.where(ok, 0.1 * g, tf.zeros_like(g)))
        return local

    for step in range(args.steps):
        x, y = batch(step)
        f = np.zeros(variables[target].shape, np.float32)
        if step == 2 and rank == hvd.size() - 1:
            f[5] = np.nan
        local = train_step(tf.constant(x), tf.constant(y), tf.constant(f))
        for n, g in zip(names, local):
            rec["local/%d/%s" % (step, n)] = g.numpy()
        rec["bucket_stats/%d" % step] = np.array(json.dumps(c.stats()))  # norms per bucket
        rec["stats/%d" % step] = np.array(json.dumps(c.stats(reset=step == 3, per_tensor=True)))
    rec["handed"] = np.array(json.dumps(handed))
    rec["traces"] = np.array(len(traces))

    # Keras: the callback fills logs every batch and at the epoch's end; CSVLogger writes them
    import horovod.tensorflow.keras as hvd_k
    model, ck = build_model(), TwoBitCompressor(threshold, bucket_bytes=2048, exchange=exchange)
    seen = []

    class Record(tf.keras.callbacks.Callback):
        def on_train_batch_end(self, b, logs=None):
            seen.append(dict(logs))

    model.compile(optimizer=hvd_k.DistributedOptimizer(tf.keras.optimizers.SGD(0.1),
                                                       compression=ck), loss="mse")
    xs, ys = zip(*[batch(s) for s in range(3)])
    handed.clear()
    csv = os.path.join(args.out, "log%d.csv" % rank)
    model.fit(np.concatenate(xs), np.concatenate(ys), batch_size=16, epochs=2, verbose=0,
              shuffle=False, callbacks=[hvd_k.callbacks.BroadcastGlobalVariablesCallback(0),
                                        TwoBitStatsCallback(ck, every=1), Record(),
                                        tf.keras.callbacks.CSVLogger(csv)])
    rec["keras_handed"] = np.array(json.dumps(handed))
    rec["keras_logs"] = np.array(json.dumps(seen))
    rec["keras_stats"] = np.array(json.dumps(ck.stats()))
    rec["keras_csv"] = np.array(open(csv).read())
    return rec


run_each(args.out, args.configs, lambda spec: run(*threshold_exchange(spec)), rank)
print("rank %d done" % rank, flush=True)
