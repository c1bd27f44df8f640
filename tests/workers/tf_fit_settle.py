"""TwoBitFallbackCallback in a real 2-rank Keras job: fit with fallback="auto" checked on every
job (one round a block, two blocks: tests/workers/configs.py), the check made to keep KEPT
("plain" or "compressed"), with and without the callback; and a tape loop through
fallback_function (given the Python function, or a tf.function of it) and without it. Writes, per run, the final weights,
the losses, how many train functions fit ran and how many checks were made, and each bucket's
exchange on the last step, as JSON in rank<r>.json in the folder it is given."""

import json
import os
import sys

import numpy as np
import tensorflow as tf

import horovod.tensorflow.keras as hvd
import horovod.tensorflow as hvd_tf
from horovod_twobit.state import fallback
from horovod_twobit.tensorflow import TwoBitCompressor, TwoBitFallbackCallback, fallback_function
from configs import checked_schedule

hvd.init()
rank = hvd.rank()
tf.config.threading.set_inter_op_parallelism_threads(1)
tf.config.threading.set_intra_op_parallelism_threads(1)
STEPS = 16


class Functions(tf.keras.callbacks.Callback):
    """The train functions fit ran, and the loss after each batch."""

    def __init__(self):
        super().__init__()
        self.seen, self.losses = [], []

    def on_train_batch_end(self, batch, logs=None):
        if not self.seen or self.seen[-1] is not self.model.train_function:
            self.seen.append(self.model.train_function)
        self.losses.append(float(logs["loss"]))


def check_ops(fn):
    """The ops of fallback="auto"'s check (its step counter, the checked exchanges' Case ops)
    in the traced function ``fn`` and the functions it calls."""
    n = 0
    for cf in fn._list_all_concrete_functions():
        gd = cf.graph.as_graph_def()
        nodes = list(gd.node) + [nd for f in gd.library.function for nd in f.node_def]
        n += sum("FallbackCheck" in nd.name or nd.op == "Case" for nd in nodes)
    return n


def setup(kept, prefix):
    """The check made to keep ``kept`` (checked on every job, tests/workers/configs.py), a
    2-layer model named after ``prefix`` and ``kept``, and a TwoBitCompressor with the fallback."""
    checked_schedule("checked")
    fallback.choose = lambda figures, tie=None: fallback.MODE_NAMES.index(kept)
    tf.keras.utils.set_random_seed(0)
    model = tf.keras.Sequential([
        tf.keras.Input((12,)),
        tf.keras.layers.Dense(40, activation="tanh", name="%s%s_l0" % (prefix, kept)),
        tf.keras.layers.Dense(6, name="%s%s_l1" % (prefix, kept))])
    return model, TwoBitCompressor(0.05, bucket_bytes=2048, fallback="auto")


def run(kept, callback):
    model, c = setup(kept, "")
    model.compile(optimizer=hvd.DistributedOptimizer(tf.keras.optimizers.SGD(0.1), compression=c),
                  loss="mse")
    data = np.random.default_rng(rank)
    x = data.standard_normal((16 * STEPS, 12)).astype(np.float32)
    y = data.standard_normal((16 * STEPS, 6)).astype(np.float32)
    seen = Functions()
    callbacks = [hvd.callbacks.BroadcastGlobalVariablesCallback(0), seen]
    if callback:
        callbacks.insert(1, TwoBitFallbackCallback(c))
    model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0, callbacks=callbacks)
    st = c.stats()
    return {"weights": [w.tolist() for w in model.get_weights()], "losses": seen.losses,
            "functions": len(seen.seen), "checks_made": c.state.checks_made,
            "check_ops": [check_ops(f) for f in seen.seen],
            "kept": [k["kept"] for k in st.get("fallback_checks", [])],
            "exchanges": sorted(b["exchange"] for b in st["buckets"].values())}


def run_tape(kept, wrap):
    """A tf.function of DistributedGradientTape and a Keras optimizer, which makes a variable
    at its first call (so the function's first call traces twice, and runs the second):
    ``wrap`` "python", fallback_function(train_step, c); "function",
    fallback_function(tf.function(train_step), c) (traced anew as a clone); None,
    tf.function(train_step), never traced anew."""
    model, c = setup(kept, {"python": "t", "function": "u", None: "v"}[wrap])
    opt = tf.keras.optimizers.SGD(0.1)
    hvd_tf.broadcast_variables(model.variables, root_rank=0)

    def train_step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x) - y))
        grads = hvd_tf.DistributedGradientTape(tape, compression=c).gradient(
            loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    if wrap is None:
        step = tf.function(train_step)
    else:
        step = fallback_function(train_step if wrap == "python" else tf.function(train_step), c)
    fns, losses, retraced_at, settled_at = [], [], None, None
    data = np.random.default_rng(rank)
    for i in range(STEPS):
        fn = step if wrap is None else step.function
        if not fns or fns[-1] is not fn:
            fns.append(fn)
        losses.append(float(step(data.standard_normal((16, 12)).astype(np.float32),
                                 data.standard_normal((16, 6)).astype(np.float32))))
        if wrap is not None and step.retraced and retraced_at is None:
            retraced_at = i
        if settled_at is None and c.state.all_settled():
            settled_at = i  # the step after whose call every check had decided
    return {"functions": len(fns), "check_ops": [check_ops(f) for f in fns],
            "first_traces": len(fns[0]._list_all_concrete_functions()),
            "checks_made": c.state.checks_made, "losses": losses, "retraced_at": retraced_at,
            "settled_at": settled_at,
            "weights": [w.tolist() for w in model.get_weights()],
            "exchanges": sorted(b["exchange"] for b in c.stats()["buckets"].values())}


out = {"%s/%s" % (kept, cb): run(kept, cb) for kept in ("plain", "compressed")
       for cb in (True, False)}
# the Python function where the check keeps plain, a tf.function of it where it keeps compressed
out.update({"tape/%s/%s" % (kept, wrap): run_tape(kept, wrap)
            for kept, wraps in (("plain", ("python", None)), ("compressed", ("function", None)))
            for wrap in wraps})
# a file per rank: two ranks' lines of over 64 KB each came out of horovodrun interleaved
with open(os.path.join(sys.argv[1], "rank%d.json" % rank), "w") as f:
    json.dump(out, f)
sys.exit(0)
