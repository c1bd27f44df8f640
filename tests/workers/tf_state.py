"""Saving after step K and restoring into fresh objects gives the same step K+1 as never stopping:
with tf.train.Checkpoint (residuals restored before they exist, filled in on creation) and with
state_dict() / load_state_dict(). Restoring without the residuals must give a different step.
Residuals belong to their rank: rank 0's checkpoint or state restored on every rank gives rank 0
its residuals and starts the others' from zero."""

import os
import sys

import numpy as np
import tensorflow as tf

import horovod.tensorflow as hvd
from horovod_twobit.tensorflow import TwoBitCompressor

out_dir = sys.argv[1]
hvd.init()
rank = hvd.rank()
K = 5


def build():
    init = lambda s: tf.keras.initializers.GlorotUniform(seed=s)  # noqa: E731
    model = tf.keras.Sequential([
        tf.keras.layers.Dense(16, activation="tanh", name="hidden", kernel_initializer=init(1)),
        tf.keras.layers.Dense(4, name="out", kernel_initializer=init(2)),
    ])
    model.build((None, 8))
    opt = tf.keras.optimizers.SGD(0.1, momentum=0.9)
    comp = TwoBitCompressor(0.1)

    @tf.function
    def train_step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x) - y))
        tape = hvd.DistributedGradientTape(tape, compression=comp)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return grads

    return model, opt, comp, train_step


def step(objs, i):
    model, _, _, train_step = objs
    rng = np.random.default_rng(100 * rank + i)
    x = rng.standard_normal((8, 8)).astype(np.float32)
    y = rng.standard_normal((8, 4)).astype(np.float32)
    grads = train_step(tf.constant(x), tf.constant(y))
    return [g.numpy() for g in grads], [v.numpy() for v in model.trainable_variables]


def same(a, b):
    return all(np.array_equal(x, y) for x, y in zip(a, b))


a = build()
for i in range(K):
    step(a, i)
prefix = tf.train.Checkpoint(model=a[0], optimizer=a[1], twobit=a[2]).save(
    os.path.join(out_dir, "rank%d" % rank, "ckpt"))
state = a[2].state_dict()
nonzero_residual = any(float(np.abs(v).sum()) > 0 for v in state["residuals"].values())
grads_a, weights_a = step(a, K)

b = build()  # tf.train.Checkpoint, restored before the residuals (and momentum slots) exist
status = tf.train.Checkpoint(model=b[0], optimizer=b[1], twobit=b[2]).restore(prefix)
grads_b, weights_b = step(b, K)
status.assert_consumed()

c = build()  # the model and optimizer restored, the residuals not: the step must differ
tf.train.Checkpoint(model=c[0], optimizer=c[1]).restore(prefix).expect_partial()
grads_c, _ = step(c, K)

d = build()  # state_dict() / load_state_dict()
tf.train.Checkpoint(model=d[0], optimizer=d[1]).restore(prefix).expect_partial()
d[2].load_state_dict(state)
grads_d, weights_d = step(d, K)

rank0_prefix = hvd.broadcast_object(prefix, root_rank=0)
rank0_state = hvd.broadcast_object(state, root_rank=0)


def residual_values(objs):
    """Creates (or gets) the residuals of the model's variables; returns their values by name."""
    model, _, comp, _ = objs
    return {v.name[:-2]: comp.residuals.get(v.name[:-2], v).numpy() for v in model.trainable_variables}


e = build()  # everyone restores rank 0's checkpoint
tf.train.Checkpoint(model=e[0], optimizer=e[1], twobit=e[2]).restore(rank0_prefix).expect_partial()
res_e = residual_values(e)
f = build()  # everyone loads rank 0's state_dict
tf.train.Checkpoint(model=f[0], optimizer=f[1]).restore(prefix).expect_partial()
f[2].load_state_dict(rank0_state)
res_f = residual_values(f)
# rank 0 gets its own residuals back; the others start from zero
want = state["residuals"] if rank == 0 else {k: np.zeros_like(v) for k, v in state["residuals"].items()}
other_rank = all(np.array_equal(res_e[k], want[k]) and np.array_equal(res_f[k], want[k]) for k in want)
grads_e, _ = step(e, K)
grads_f, _ = step(f, K)
other_rank = other_rank and same(grads_e, grads_f) and not same(grads_e, grads_a)

print("rank %d checkpoint_same=%s state_dict_same=%s without_residuals_differs=%s "
      "nonzero_residual=%s other_rank_ok=%s residuals=%s"
      % (rank, same(grads_a, grads_b) and same(weights_a, weights_b),
         same(grads_a, grads_d) and same(weights_a, weights_d),
         not same(grads_a, grads_c), nonzero_residual, other_rank, ",".join(b[2].residuals.names())))
