"""Demo: an MLP on scikit-learn's digits, trained with Horovod, uncompressed vs TwoBitCompressor.

    horovodrun -np 2 -H localhost:2 --gloo python examples/digits_torch.py

Prints per epoch: loss, test accuracy, payload bytes each rank sends per step and the compression
ratio; writes a PNG of both accuracy curves to the path it prints.
"""

import argparse
import os
import time

import numpy as np
import torch

import horovod.torch as hvd
from horovod_twobit import wire
from horovod_twobit.torch import TwoBitCompressor


def data(rank, size):
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split
    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32)
    xtr, xte, ytr, yte = train_test_split(x, y, test_size=0.25, random_state=0, stratify=y)
    return (torch.from_numpy(xtr[rank::size]), torch.from_numpy(ytr[rank::size]),
            torch.from_numpy(xte), torch.from_numpy(yte))


def payload_bytes(model, compression):
    sizes = [p.numel() for p in model.parameters()]
    if compression is None:
        return 4 * sum(sizes)
    return sum(wire.payload_bytes(n) for n in sizes)


def bar(done, total, width=20):
    """A text progress bar (horovodrun forwards workers' output line by line, so it advances
    once per printed line)."""
    filled = int(round(width * done / total))
    return "[%s%s] %3d%%" % ("#" * filled, "." * (width - filled), 100 * done // total)


def train(label, compression, args, part):
    rank, size = hvd.rank(), hvd.size()
    xtr, ytr, xte, yte = data(rank, size)
    torch.manual_seed(args.seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    kw = {} if compression is None else {"compression": compression}
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(), **kw)
    nbytes = payload_bytes(model, compression)
    steps = (len(xtr) + args.batch - 1) // args.batch
    g = torch.Generator().manual_seed(args.seed + rank)
    accs = []
    for epoch in range(1, args.epochs + 1):
        perm = torch.randperm(len(xtr), generator=g)
        total = 0.0
        for s in range(steps):
            idx = perm[s * args.batch:(s + 1) * args.batch]
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(xtr[idx]), ytr[idx])
            loss.backward()
            opt.step()
            total += loss.item()
        with torch.no_grad():
            acc = float((model(xte).argmax(1) == yte).float().mean())
        loss = hvd.allreduce(torch.tensor(total / steps), name="epoch_loss").item()
        accs.append(acc)
        if rank == 0:
            print("%s %-6s epoch %2d  loss %.4f  test acc %.4f  bytes/step/rank %7d  ratio %4.1fx"
                  % (bar(part * args.epochs + epoch, 2 * args.epochs), label, epoch, loss, acc,
                     nbytes, payload_bytes(model, None) / nbytes), flush=True)
    return accs


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--epochs", type=int, default=15)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--lr", type=float, default=0.5)
    p.add_argument("--momentum", type=float, default=0.0)
    p.add_argument("--threshold", type=float, default=0.5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plot", default=os.path.join("build", "digits_torch.png"))
    args = p.parse_args()
    hvd.init()
    torch.set_num_threads(1)
    t0 = time.time()
    base = train("fp32", None, args, 0)
    two = train("twobit", TwoBitCompressor(args.threshold), args, 1)
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
        ax.set_title("digits MLP, %d workers" % hvd.size())
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.plot, dpi=100)
        print("plot written to %s" % os.path.abspath(args.plot))


if __name__ == "__main__":
    main()
