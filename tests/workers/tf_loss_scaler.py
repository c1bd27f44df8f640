"""Keras mixed precision (the "mixed_float16" policy, its LossScaleOptimizer around Horovod's Keras
DistributedOptimizer) trained with model.fit, and one forced overflow: rank 1's scaled gradient of
the first layer's bias holds +Inf at step OVERFLOW (added to what the optimizer hands to Horovod).
One configuration after another (--configs: none, or a TwoBitCompressor threshold), each from the
same weights; rank 0 saves, per step, the mean loss over the ranks, the loss scale and whether the
step was skipped, to OUT/<index>.npz."""

import argparse
import os

import numpy as np
import tensorflow as tf

import horovod.tensorflow.keras as hvd
from horovod_twobit.tensorflow import TwoBitCompressor

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--configs", nargs="+", required=True)
p.add_argument("--steps", type=int, default=40)
p.add_argument("--overflow", type=int, default=10)
args = p.parse_args()

hvd.init()
rank = hvd.rank()
tf.config.threading.set_inter_op_parallelism_threads(1)
tf.config.threading.set_intra_op_parallelism_threads(1)
tf.keras.mixed_precision.set_global_policy("mixed_float16")
rng = np.random.default_rng(100 + rank)
teacher = np.random.default_rng(5).standard_normal((10, 4)).astype(np.float32)
X = rng.standard_normal((64, 10)).astype(np.float32)
Y = np.tanh(X @ teacher)

for ci, spec in enumerate(args.configs):
    init = lambda s: tf.keras.initializers.GlorotUniform(seed=s)  # noqa: E731
    model = tf.keras.Sequential([
        tf.keras.layers.Dense(12, activation="tanh", name="hidden", kernel_initializer=init(1)),
        tf.keras.layers.Dense(4, name="out", kernel_initializer=init(2)),
        tf.keras.layers.Activation("linear", dtype="float32"),
    ])
    model.build((None, 10))
    compression = hvd.Compression.none if spec == "none" else TwoBitCompressor(
        spec if spec == "auto" else float(spec))
    dist = hvd.DistributedOptimizer(tf.keras.optimizers.SGD(1.0), compression=compression)
    fault = tf.Variable(tf.zeros([12]), trainable=False)
    inner = dist._allreduce_grads

    def overflowing(grads, vars, *a, **k):
        grads = list(grads)
        grads[1] = grads[1] + tf.cast(fault, grads[1].dtype)  # hidden/bias
        return inner(grads, vars, *a, **k)

    dist._allreduce_grads = overflowing
    opt = tf.keras.mixed_precision.LossScaleOptimizer(dist, initial_scale=1024.0,
                                                      dynamic_growth_steps=5)
    losses, scales = [], []

    class Steps(tf.keras.callbacks.Callback):
        def on_train_batch_begin(self, step, logs=None):
            scales.append(float(opt.loss_scale))
            f = np.zeros(12, np.float32)
            if step == args.overflow and rank == 1:
                f[0] = np.inf
            fault.assign(f)

        def on_train_batch_end(self, step, logs=None):
            pred = tf.cast(self.model(X, training=False), tf.float32)
            loss = tf.reduce_mean(tf.square(pred - Y))
            losses.append(float(hvd.allreduce(loss, name="loss")))

    model.compile(optimizer=opt, loss="mse")
    model.fit(np.tile(X, (args.steps, 1)), np.tile(Y, (args.steps, 1)), batch_size=64, epochs=1,
              shuffle=False, verbose=0,
              callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0), Steps()])
    scales.append(float(opt.loss_scale))
    skipped = [b < a for a, b in zip(scales[:-1], scales[1:])]
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        np.savez(os.path.join(args.out, "%d.npz" % ci), loss=np.array(losses),
                 scale=np.array(scales[:-1]), skipped=np.array(skipped))
    print("rank %d %s: final loss %.5f, scale %g, %d skipped"
          % (rank, spec, losses[-1], scales[-1], sum(skipped)), flush=True)
