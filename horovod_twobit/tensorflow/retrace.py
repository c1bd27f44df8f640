"""``fallback_function``: a custom training loop's ``tf.function``, traced anew once
``fallback="auto"`` has decided (what ``TwoBitFallbackCallback`` does for Keras' ``fit``)."""

import tensorflow as tf


class FallbackFunction:
    """A ``tf.function`` that is replaced, once, by a fresh one from ``make()`` after the
    compressor's checks have all decided (:func:`fallback_function`; ``bench_buckets`` makes
    Keras' train function this way too). ``function``: the ``tf.function`` the next call runs;
    ``retraced``: whether that one is final (traced anew, or nothing checked to wait for)."""

    def __init__(self, make, compressor, first=None):
        self._make, self._compressor = make, compressor
        self.function = make() if first is None else first
        # nothing to wait for without a checked fallback: never traced anew
        self.retraced = compressor.state.fallback != "auto"

    def __getattr__(self, name):
        # the rest of tf.function's face (get_concrete_function, experimental_get_tracing_count,
        # ...) is the current function's
        if name == "function":
            raise AttributeError(name)
        return getattr(self.function, name)

    def __call__(self, *args, **kwargs):
        out = self.function(*args, **kwargs)
        # the checks decide inside a step, at the same step on every rank (rank 0's verdict is
        # broadcast in the graph), so every rank traces anew before the same next step
        if not self.retraced and self._compressor.state.all_settled():
            self.function, self.retraced = self._make(), True
        return out


def fallback_function(fn, compressor, **tf_function_kwargs):
    """``fn`` as a ``tf.function`` (``tf_function_kwargs`` are ``tf.function``'s), traced anew,
    once, after ``compressor``'s ``fallback="auto"`` check has decided, so that the steps after
    it run the modes the check kept without the check's ops (a step counter and a ``Case`` op
    per bucket: 3-10 % of a 52-tensor step on 2 CPU cores). For a custom loop with
    ``hvd.DistributedGradientTape``::

        c = TwoBitCompressor(0.5, fallback="auto")

        def train_step(x, y):
            with tf.GradientTape() as tape:
                loss = loss_fn(y, model(x, training=True))
            tape = hvd.DistributedGradientTape(tape, compression=c)
            grads = tape.gradient(loss, model.trainable_variables)
            opt.apply_gradients(zip(grads, model.trainable_variables))
            return loss

        train_step = fallback_function(train_step, c)  # instead of tf.function(train_step)

    ``fn`` may be a ``tf.function`` already: the fresh trace then takes its options (input
    signature, ``jit_compile``, ...), and ``tf_function_kwargs`` must be empty. The retrace
    costs one trace of the step, once (2.1-2.9 s for a 52-tensor MLP on 2 CPU ranks, where its
    first call took 5.7-8.9 s); results are the same, value for value,
    with it or without it. Without a fallback, or with ``fallback="always"`` (nothing
    checked), it is ``tf.function(fn)`` and never traces anew. Keras' ``fit``:
    ``TwoBitFallbackCallback``."""
    from horovod_twobit.tensorflow.compressor import TwoBitCompressor
    if not isinstance(compressor, TwoBitCompressor):
        raise TypeError("fallback_function needs the TwoBitCompressor the step's "
                        "DistributedGradientTape uses, got %r" % (compressor,))
    python_function = getattr(fn, "python_function", None)
    if python_function is not None:  # a tf.function
        if tf_function_kwargs:
            raise ValueError("fallback_function got a tf.function and tf.function options (%s): "
                             "give the options to tf.function, or pass the Python function "
                             "with them" % ", ".join(sorted(tf_function_kwargs)))
        clone = getattr(fn, "_clone", None)
        if clone is not None:
            return FallbackFunction(lambda: clone(None), compressor, fn)
        return FallbackFunction(lambda: tf.function(python_function), compressor, fn)
    if not callable(fn):
        raise TypeError("fallback_function needs the training step's Python function (or its "
                        "tf.function), got %r" % (fn,))
    return FallbackFunction(lambda: tf.function(fn, **tf_function_kwargs), compressor)
