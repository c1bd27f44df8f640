"""``TwoBitStatsCallback``: a compressor's stats in Keras' ``logs``; ``TwoBitFallbackCallback``:
Keras' train function traced anew once ``fallback="auto"`` has decided."""

import tensorflow as tf

from horovod_twobit.state.stats import scalars


class TwoBitStatsCallback(tf.keras.callbacks.Callback):
    """Adds ``compressor.stats()``, flattened to ``twobit/...`` numbers
    (:func:`horovod_twobit.state.stats.scalars`), to Keras' ``logs`` at the end of every epoch, and
    every ``every`` batches when given, so that ``TensorBoard``, ``CSVLogger`` and ``History``
    record them. Put it before those callbacks in the list::

        model.fit(..., callbacks=[TwoBitStatsCallback(compressor),
                                  tf.keras.callbacks.CSVLogger("log.csv")])

    With ``every`` of 1 or 2, each step hands its buckets' stats to the host, so a read costs
    about 0.1 ms; less often, a read fetches them itself and the steps between do no stats work
    (``docs/design.md`` says what it costs per step). With ``every`` unset it reads once an
    epoch."""

    def __init__(self, compressor, every=None):
        super().__init__()
        if every is not None and (isinstance(every, bool) or not isinstance(every, int)
                                  or every < 1):
            raise ValueError("every must be a positive number of batches or None, got %r"
                             % (every,))
        self.compressor, self.every = compressor, every

    def on_train_batch_end(self, batch, logs=None):
        if self.every and logs is not None and (batch + 1) % self.every == 0:
            logs.update(scalars(self.compressor.stats()))

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None:
            logs.update(scalars(self.compressor.stats()))


class TwoBitFallbackCallback(tf.keras.callbacks.Callback):
    """With ``TwoBitCompressor(..., fallback="auto")``: once the checked decision is made (every
    check of the traced train function decided, the same batch on every rank), traces Keras'
    train function anew, once, so that the steps after it run the modes the check kept without
    the check's ops (a step counter and one ``Case`` op per bucket, 3-10 % of a 52-tensor step
    on 2 CPU cores). The retrace costs about what the first step's trace did, once::

        model.fit(..., callbacks=[TwoBitFallbackCallback(compressor)])

    Results are the same, value for value, with it or without it. Without a fallback, or
    with ``fallback="always"`` (nothing checked), it does nothing."""

    def __init__(self, compressor):
        super().__init__()
        self.compressor, self.retraced = compressor, False

    def on_train_batch_end(self, batch, logs=None):
        if self.retraced or not self.compressor.state.all_settled():
            return
        self.model.make_train_function(force=True)
        self.retraced = True
