"""The small Keras model both TensorFlow workers train, and the three ways they train it with
Horovod's own API: hvd.DistributedGradientTape eagerly and under tf.function (two batch sizes,
two traces), and horovod.tensorflow.keras.DistributedOptimizer with model.fit."""

import numpy as np
import tensorflow as tf

import horovod.tensorflow as hvd

MODES = ("tape_eager", "tape_function", "keras")


def build_model():
    init = lambda s: tf.keras.initializers.GlorotUniform(seed=s)  # noqa: E731
    model = tf.keras.Sequential([
        tf.keras.layers.Dense(40, activation="tanh", name="hidden", kernel_initializer=init(1)),
        tf.keras.layers.Dense(6, name="out", kernel_initializer=init(2)),
    ])
    model.build((None, 12))
    return model


def batch(step, rows=16):
    rng = np.random.default_rng(1000 * hvd.rank() + step)
    return (rng.standard_normal((rows, 12)).astype(np.float32),
            rng.standard_normal((rows, 6)).astype(np.float32))


def key(v):
    return v.name[:-2] if v.name.endswith(":0") else v.name


def train(mode, model, compressor, steps, **kw):
    """Trains ``model`` for ``steps`` steps in ``mode`` with ``compressor`` (``kw``: more arguments
    for the tape or the optimizer). Returns, per step, (the local gradients, the aggregated ones)
    as NumPy arrays in the order of ``model.trainable_variables``, and the number of traces of the
    tf.function step (None in the other modes)."""
    variables = model.trainable_variables
    if mode == "keras":
        return _fit(model, compressor, steps, **kw), None
    hvd.broadcast_variables(variables, root_rank=0)

    def train_step(x, y):
        with tf.GradientTape(persistent=True) as tape:
            loss = tf.reduce_mean(tf.square(model(x) - y)) * 3.0
        local = tape.gradient(loss, variables)
        agg = hvd.DistributedGradientTape(tape, compression=compressor, **kw).gradient(
            loss, variables)
        for v, g in zip(variables, agg):
            v.assign_sub(0.1 * g)
        return local, agg

    if mode == "tape_function":
        train_step = tf.function(train_step)
    seen = []
    for step in range(steps):
        x, y = batch(step, rows=16 if step % 2 == 0 else 8)  # two signatures: two traces
        local, agg = train_step(tf.constant(x), tf.constant(y))
        seen.append(([g.numpy() for g in local], [g.numpy() for g in agg]))
    traces = train_step.experimental_get_tracing_count() if mode == "tape_function" else None
    return seen, traces


def _fit(model, compressor, steps, **kw):
    """model.fit; what the optimizer hands to Horovod and gets back, recorded inside Keras' train
    function."""
    import horovod.tensorflow.keras as hvd_k
    opt = hvd_k.DistributedOptimizer(tf.keras.optimizers.SGD(0.1), compression=compressor, **kw)
    seen, inner = [], opt._allreduce_grads

    def recording(grads, vars, *a, **k):
        out = inner(grads, vars, *a, **k)

        def save(*arrays):
            half = len(arrays) // 2
            seen.append(([x.copy() for x in arrays[:half]], [x.copy() for x in arrays[half:]]))
            return np.int32(0)
        done = tf.numpy_function(save, list(grads) + list(out), tf.int32, stateful=True)
        with tf.control_dependencies([done]):
            return [tf.identity(o) for o in out]

    opt._allreduce_grads = recording
    model.compile(optimizer=opt, loss=lambda y, p: tf.reduce_mean(tf.square(p - y)) * 3.0)
    xs, ys = zip(*[batch(s) for s in range(steps)])
    model.fit(np.concatenate(xs), np.concatenate(ys), batch_size=16, epochs=1, shuffle=False,
              verbose=0, callbacks=[hvd_k.callbacks.BroadcastGlobalVariablesCallback(0)])
    assert len(seen) == steps, len(seen)
    return seen
