"""TwoBitCompressor.stats() on TensorBoard: the digits MLP trained with PyTorch and
TwoBitCompressor, rank 0 writing the compressor's stats with torch.utils.tensorboard every few
steps (bytes sent per step, fraction of values sent, threshold or auto levels' mean, NaN steps,
per bucket fraction sent and residual norms).

    horovodrun -np 2 -H localhost:2 --gloo python examples/stats_tensorboard.py --logdir build/tb
    tensorboard --logdir build/tb
"""

import argparse

import torch

import horovod.torch as hvd
from horovod_twobit.state.stats import scalars
from horovod_twobit.torch import TwoBitCompressor

import _digits


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--logdir", default="build/tb")
    p.add_argument("--threshold", type=_digits.threshold, default="auto")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--every", type=int, default=10, help="write the stats every N steps")
    args = p.parse_args()
    hvd.init()
    torch.set_num_threads(1)
    xtr, ytr, xte, yte = [torch.from_numpy(a) for a in _digits.shards(hvd.rank(), hvd.size())]
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    compressor = TwoBitCompressor(args.threshold)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5),
                                   named_parameters=model.named_parameters(),
                                   compression=compressor)
    writer = None
    if hvd.rank() == 0:
        from torch.utils.tensorboard import SummaryWriter
        writer = SummaryWriter(args.logdir)
    step = 0
    for epoch in range(args.epochs):
        for s in range(0, len(xtr) - 31, 32):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(xtr[s:s + 32]), ytr[s:s + 32]).backward()
            opt.step()
            step += 1
            if writer is not None and step % args.every == 0:
                for tag, value in scalars(compressor.stats()).items():
                    writer.add_scalar(tag, value, step)
        if writer is not None:
            st = compressor.stats()
            acc = float((model(xte).argmax(1) == yte).float().mean())
            print("epoch %d  test acc %.4f  sent %.1f %% of values  %d bytes/step/rank"
                  % (epoch + 1, acc, 100 * st["fraction_sent"], sum(st["bytes_last_step"].values())),
                  flush=True)
    if writer is not None:
        writer.close()
        print("stats written to %s (%d steps)" % (args.logdir, step))


if __name__ == "__main__":
    main()
