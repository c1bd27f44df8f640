"""Demo: a Keras MLP on scikit-learn's digits, trained with horovod.tensorflow.keras, uncompressed vs
TwoBitCompressor.

    horovodrun -np 2 -H localhost:2 --gloo python examples/digits_keras.py

The only change for TwoBit is one argument:

    opt = hvd.DistributedOptimizer(opt, compression=TwoBitCompressor(0.5))

Prints per epoch: loss (averaged over ranks), test accuracy, payload bytes each rank sends per step
and the compression ratio, and for TwoBit the fraction of values sent (``TwoBitStatsCallback``);
writes a PNG of both accuracy curves to the path it prints.
"""

import time

import numpy as np
import tensorflow as tf

import horovod.tensorflow.keras as hvd
from horovod_twobit import wire
from horovod_twobit.tensorflow import TwoBitCompressor, TwoBitStatsCallback

import _digits


def data(rank, size):
    return _digits.shards(rank, size)


def payload_bytes(model, compression):
    sizes = [int(np.prod(v.shape)) for v in model.trainable_variables]
    if compression is None:
        return 4 * sum(sizes)
    return sum(wire.payload_bytes(n) for n in sizes)


class Report(tf.keras.callbacks.Callback):
    """After each epoch: the loss averaged over ranks and the test accuracy (printed by rank 0)."""

    def __init__(self, label, xte, yte, nbytes, ratio):
        super().__init__()
        self.label, self.xte, self.yte = label, xte, yte
        self.nbytes, self.ratio = nbytes, ratio
        self.accs = []

    def on_epoch_end(self, epoch, logs=None):
        loss = float(hvd.allreduce(tf.constant(logs["loss"]), name="epoch_loss"))
        pred = np.argmax(self.model.predict(self.xte, verbose=0), axis=1)
        acc = float(np.mean(pred == self.yte))
        self.accs.append(acc)
        nbytes, sent = self.nbytes, ""
        if "twobit/fraction_sent" in logs:  # TwoBitStatsCallback ran before this one
            nbytes = sum(v for k, v in logs.items() if k.startswith("twobit/bytes_last_step/"))
            sent = "  sent %4.1f %%" % (100 * logs["twobit/fraction_sent"])
        if hvd.rank() == 0:
            print("%-8s epoch %2d  loss %.4f  test acc %.4f  bytes/step/rank %9d  ratio %5.1fx%s"
                  % (self.label, epoch + 1, loss, acc, nbytes, self.ratio, sent), flush=True)


def train(label, compression, args):
    rank, size = hvd.rank(), hvd.size()
    xtr, ytr, xte, yte = data(rank, size)
    tf.keras.utils.set_random_seed(args.seed)  # the same initial weights on every rank
    model = tf.keras.Sequential([
        tf.keras.Input((64,)),
        tf.keras.layers.Dense(256, activation="relu", name="hidden"),
        tf.keras.layers.Dense(10, name="logits"),
    ])
    opt = tf.keras.optimizers.SGD(args.lr, momentum=args.momentum)
    kw = {} if compression is None else {"compression": compression}
    opt = hvd.DistributedOptimizer(opt, **kw)
    model.compile(optimizer=opt, metrics=["accuracy"],
                  loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    nbytes = payload_bytes(model, compression)
    report = Report(label, xte, yte, nbytes, payload_bytes(model, None) / nbytes)
    tf.keras.utils.set_random_seed(args.seed + rank)  # each rank shuffles its own shard
    stats = [] if compression is None else [TwoBitStatsCallback(compression)]
    model.fit(xtr, ytr, batch_size=args.batch, epochs=args.epochs, shuffle=True, verbose=0,
              callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)] + stats + [report])
    return report.accs


def main():
    args = _digits.parser(__doc__, lr=0.1, plot="digits_keras.png").parse_args()
    hvd.init()
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    t0 = time.time()
    base = train("fp32", None, args)
    two = train("twobit", TwoBitCompressor(args.threshold), args)
    if hvd.rank() == 0:
        _digits.report(base, two, args, "digits Keras MLP", time.time() - t0, hvd.size())

if __name__ == "__main__":
    main()
