"""What the digits demos share: data shards, command line, the final report and plot."""

import argparse
import os

import numpy as np


def shards(rank, size):
    """(x_train, y_train) of this rank, and the full test set, as float32 / int64 arrays. Every
    rank gets a shard of the same length, so every rank runs the same number of steps (Horovod
    pairs the ranks' collectives step by step)."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split
    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32)
    xtr, xte, ytr, yte = train_test_split(x, y, test_size=0.25, random_state=0, stratify=y)
    n = len(xtr) // size
    return xtr[rank::size][:n], ytr[rank::size][:n], xte, yte


def threshold(value):
    return value if value == "auto" else float(value)


def parser(doc, lr, plot):
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--epochs", type=int, default=15)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--lr", type=float, default=lr)
    p.add_argument("--momentum", type=float, default=0.0)
    p.add_argument("--threshold", type=threshold, default=0.5, help="a number, or 'auto'")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plot", default=os.path.join("build", plot))
    return p


def bar(done, total, width=20):
    """A text progress bar (horovodrun forwards workers' output line by line, so it advances
    once per printed line)."""
    filled = int(round(width * done / total))
    return "[%s%s] %3d%%" % ("#" * filled, "." * (width - filled), 100 * done // total)


def report(base, two, args, title, seconds, size):
    """Prints the final accuracies and writes the plot of both curves (rank 0 only)."""
    print("final test accuracy: uncompressed %.4f, TwoBit(%s) %.4f  (%.0fs, %d ranks)"
          % (base[-1], args.threshold, two[-1], seconds, size))
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot")
        return
    os.makedirs(os.path.dirname(os.path.abspath(args.plot)), exist_ok=True)
    fig, ax = plt.subplots(figsize=(6, 4))
    ep = range(1, len(base) + 1)
    ax.plot(ep, base, "o-", label="Horovod, no compression")
    ax.plot(ep, two, "s-", label="TwoBitCompressor(%s)" % args.threshold)
    ax.set_xlabel("epoch")
    ax.set_ylabel("test accuracy")
    ax.set_title("%s, %d workers" % (title, size))
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.plot, dpi=100)
    print("plot written to %s" % os.path.abspath(args.plot))
