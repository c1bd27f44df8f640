"""Demo: an MLP on scikit-learn's digits, trained with Horovod, uncompressed vs TwoBitCompressor.

    horovodrun -np 2 -H localhost:2 --gloo python examples/digits_torch.py

Prints per epoch: loss, test accuracy, payload bytes each rank sends per step and the compression
ratio, and for TwoBit the fraction of values it sent (from ``TwoBitCompressor.stats()``); writes a PNG of both accuracy curves to the path it prints.
"""

import time

import torch

import horovod.torch as hvd
from horovod_twobit import wire
from horovod_twobit.torch import TwoBitCompressor

import _digits


def data(rank, size):
    return [torch.from_numpy(a) for a in _digits.shards(rank, size)]


def payload_bytes(model, compression):
    sizes = [p.numel() for p in model.parameters()]
    if compression is None:
        return 4 * sum(sizes)
    return sum(wire.payload_bytes(n) for n in sizes)


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
        sent = ""
        if compression is not None:  # what the compressor did (its stats), the last step
            st = compression.stats()
            nbytes = sum(st["bytes_last_step"].values())
            sent = "  sent %4.1f %%" % (100 * st["fraction_sent"])
        if rank == 0:
            print("%s %-6s epoch %2d  loss %.4f  test acc %.4f  bytes/step/rank %7d  ratio %4.1fx%s"
                  % (_digits.bar(part * args.epochs + epoch, 2 * args.epochs), label, epoch, loss, acc,
                     nbytes, payload_bytes(model, None) / nbytes, sent), flush=True)
    return accs


def main():
    args = _digits.parser(__doc__, lr=0.5, plot="digits_torch.png").parse_args()
    hvd.init()
    torch.set_num_threads(1)
    t0 = time.time()
    base = train("fp32", None, args, 0)
    two = train("twobit", TwoBitCompressor(args.threshold), args, 1)
    if hvd.rank() == 0:
        _digits.report(base, two, args, "digits MLP", time.time() - t0, hvd.size())

if __name__ == "__main__":
    main()
