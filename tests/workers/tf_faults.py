"""The TensorFlow cells of the fault-injection matrix (tests/fault_cells.py), one after another in
one job: hvd.DistributedGradientTape eagerly and under tf.function, and the Keras
DistributedOptimizer with model.fit. The fault enters the faulty tensor's gradient before Horovod
sees it (a loss term for the tape, the gradients the optimizer hands to Horovod for Keras); the
update is skipped where the aggregated gradients are not finite. Each cell saves what
tests/workers/torch_faults.py saves, to OUT/<cell index>/rank<r>.npz."""

import argparse
import os

import numpy as np
import tensorflow as tf

import horovod.tensorflow as hvd
from horovod_twobit.tensorflow import TwoBitCompressor
import fault_cells as fc

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
args = p.parse_args()

hvd.init()
rank, size = hvd.rank(), hvd.size()
tf.config.threading.set_inter_op_parallelism_threads(1)
tf.config.threading.set_intra_op_parallelism_threads(1)


def build_model():
    init = lambda s: tf.keras.initializers.GlorotUniform(seed=s)  # noqa: E731
    model = tf.keras.Sequential([
        tf.keras.layers.Dense(7, activation="tanh", name="hidden", kernel_initializer=init(1)),
        tf.keras.layers.Dense(3, name="out", kernel_initializer=init(2)),
    ])
    model.build((None, 10))
    return model


def key(v):
    return v.name[:-2] if v.name.endswith(":0") else v.name


def batch(step):
    rng = np.random.default_rng(1000 * rank + step)
    return (rng.standard_normal((8, 10)).astype(np.float32),
            rng.standard_normal((8, 3)).astype(np.float32))


def fault(cell, step, shape):
    """What the fault adds to the faulty tensor's gradient at ``step`` on this rank (zeros, or one
    non-finite value)."""
    f = np.zeros(int(np.prod(shape)), np.float32)
    if step == fc.FAULT_STEP and rank == int(cell.rank):
        f[fc.INDEX] = fc.KINDS[cell.kind]
    return f.reshape(shape)


def finite(grads):
    return tf.reduce_all([tf.reduce_all(tf.math.is_finite(g)) for g in grads])


def residuals(rec, c, step):
    fc.save_residuals(rec, c.state_dict(), step)


def run_tape(cell, c, model, names, rec):
    variables = model.trainable_variables
    target = names.index(fc.faulty("tf", cell.bucketing))
    hvd.broadcast_variables(variables, root_rank=0)

    def train_step(x, y, f):
        with tf.GradientTape(persistent=True) as tape:
            loss = tf.reduce_mean(tf.square(model(x) - y)) * 3.0
            loss += tf.reduce_sum(variables[target] * f)  # adds f to that gradient
        local = tape.gradient(loss, variables)
        agg = hvd.DistributedGradientTape(tape, compression=c).gradient(loss, variables)
        ok = finite(agg)
        for v, g in zip(variables, agg):
            v.assign_sub(tf.where(ok, 0.1 * g, tf.zeros_like(g)))  # skipped when not finite
        return local, agg

    if cell.path == "tape_function":
        train_step = tf.function(train_step)
    for step in range(fc.STEPS):
        x, y = batch(step)
        f = fault(cell, step, variables[target].shape)
        local, agg = train_step(tf.constant(x), tf.constant(y), tf.constant(f))
        for n, lg, ag in zip(names, local, agg):
            rec["local/%d/%s" % (step, n)] = lg.numpy()
            rec["agg/%d/%s" % (step, n)] = ag.numpy()
        residuals(rec, c, step)


def run_keras(cell, c, model, names, rec):
    import horovod.tensorflow.keras as hvd_k
    variables = model.trainable_variables
    target = names.index(fc.faulty("tf", cell.bucketing))
    f = tf.Variable(tf.zeros_like(variables[target]), trainable=False)
    opt = hvd_k.DistributedOptimizer(tf.keras.optimizers.SGD(0.1), compression=c)
    inner, seen = opt._allreduce_grads, []

    def faulty_allreduce(grads, vars, *a, **k):
        grads = list(grads)
        grads[target] = grads[target] + f
        out = inner(grads, vars, *a, **k)

        def save(*arrays):
            half = len(arrays) // 2
            seen.append(([x.copy() for x in arrays[:half]], [x.copy() for x in arrays[half:]]))
            return np.int32(0)
        done = tf.numpy_function(save, grads + list(out), tf.int32, stateful=True)
        ok = finite(out)
        with tf.control_dependencies([done]):
            return [tf.where(ok, o, tf.zeros_like(o)) for o in out]  # skipped when not finite

    class Steps(tf.keras.callbacks.Callback):
        def on_train_batch_begin(self, step, logs=None):
            f.assign(fault(cell, step, f.shape))

        def on_train_batch_end(self, step, logs=None):
            residuals(rec, c, step)

    opt._allreduce_grads = faulty_allreduce
    model.compile(optimizer=opt, loss=lambda y, p: tf.reduce_mean(tf.square(p - y)) * 3.0)
    xs, ys = zip(*[batch(s) for s in range(fc.STEPS)])
    model.fit(np.concatenate(xs), np.concatenate(ys), batch_size=8, epochs=1, shuffle=False,
              verbose=0, callbacks=[hvd_k.callbacks.BroadcastGlobalVariablesCallback(0), Steps()])
    assert len(seen) == fc.STEPS, len(seen)
    for step, (local, agg) in enumerate(seen):
        for n, lg, ag in zip(names, local, agg):
            rec["local/%d/%s" % (step, n)] = lg
            rec["agg/%d/%s" % (step, n)] = ag


for i, cell in enumerate(fc.cells("tf", size)):
    c = TwoBitCompressor(fc.threshold(cell), bucket_bytes=fc.BUCKETINGS[cell.bucketing],
                         exchange=cell.exchange)
    model = build_model()
    names = [key(v) for v in model.trainable_variables]
    assert names == [n for n, _ in fc.TENSORS["tf"]], names
    rec = {}
    (run_keras if cell.path == "keras" else run_tape)(cell, c, model, names, rec)
    for n, v in zip(names, model.trainable_variables):
        rec["w/" + n] = v.numpy()
    # buckets of several tensors have a layout; the tensors in none went alone
    buckets = [list(k[1]) for k in c.state.eager_fns if k[0] == "layout" and len(k[1]) > 1]
    groups = buckets + [[n] for n in names if all(n not in b for b in buckets)]
    rec["groups"] = np.array([",".join(g) for g in groups])
    os.makedirs(os.path.join(args.out, str(i)), exist_ok=True)
    np.savez(os.path.join(args.out, str(i), "rank%d.npz" % rank), **rec)
    print("rank %d cell %d %s done" % (rank, i, fc.encode(cell)), flush=True)
print("rank %d done" % rank, flush=True)
