"""Demo: a Keras MLP on scikit-learn's digits, trained with horovod.tensorflow.keras, uncompressed vs
TwoBitCompressor.

    horovodrun -np 2 -H localhost:2 --gloo python examples/digits_keras.py

The only change for TwoBit is one argument:

    opt = hvd.DistributedOptimizer(opt, compression=TwoBitCompressor(0.5))

Prints per epoch: loss (averaged over ranks), test accuracy, payload bytes each rank sends per step
and the compression ratio; writes a PNG of both accuracy curves to the path it prints.
"""

import argparse
import os
import time

import numpy as np
import tensorflow as tf

import horovod.tensorflow.keras as hvd
from horovod_twobit import wire
from horovod_twobit.tensorflow import TwoBitCompressor


def data(rank, size):
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split
    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32)
    xtr, xte, ytr, yte = train_test_split(x, y, test_size=0.25, random_state=0, stratify=y)
    # Every rank gets a shard of the same length, so every rank runs the same number of steps
    # (Horovod pairs the ranks' collectives step by step).
    n = len(xtr) // size
    return xtr[rank::size][:n], ytr[rank::size][:n], xte, yte


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
        if hvd.rank() == 0:
            print("%-8s epoch %2d  loss %.4f  test acc %.4f  bytes/step/rank %9d  ratio %5.1fx"
                  % (self.label, epoch + 1, loss, acc, self.nbytes, self.ratio), flush=True)


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
    model.fit(xtr, ytr, batch_size=args.batch, epochs=args.epochs, shuffle=True, verbose=0,
              callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0), report])
    return report.accs


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--epochs", type=int, default=15)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--momentum", type=float, default=0.0)
    p.add_argument("--threshold", type=float, default=0.5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plot", default=os.path.join("build", "digits_keras.png"))
    args = p.parse_args()
    hvd.init()
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    t0 = time.time()
    base = train("fp32", None, args)
    two = train("twobit", TwoBitCompressor(args.threshold), args)
    if hvd.rank() == 0:
        print("final test accuracy: uncompressed %.4f, TwoBit(%g) %.4f  (%.0fs, %d ranks)"
              % (base[-1], args.threshold, two[-1], time.time() - t0, hvd.size()))
        try:
            import matplotlib
            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            print("matplotlib is not installed: no plot")
            return
        os.makedirs(os.path.dirname(os.path.abspath(args.plot)), exist_ok=True)
        fig, ax = plt.subplots(figsize=(6, 4))
        ep = range(1, args.epochs + 1)
        ax.plot(ep, base, "o-", label="Horovod, no compression")
        ax.plot(ep, two, "s-", label="TwoBitCompressor(%g)" % args.threshold)
        ax.set_xlabel("epoch")
        ax.set_ylabel("test accuracy")
        ax.set_title("digits Keras MLP, %d workers" % hvd.size())
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.plot, dpi=100)
        print("plot written to %s" % os.path.abspath(args.plot))


if __name__ == "__main__":
    main()
