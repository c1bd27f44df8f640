"""The 2-bit codec's stats on TensorBoard: the digits MLP trained with PyTorch, rank 0 writing the
stats with torch.utils.tensorboard every few steps (bytes sent per step, fraction of values sent,
threshold or auto levels' mean, NaN steps, per bucket fraction sent and residual norms), from
Horovod's TwoBitCompressor, or with --ddp from DistributedDataParallel's 2-bit hook
(horovod_twobit.torch.ddp, no Horovod; the same stats() fields).

    horovodrun -np 2 -H localhost:2 --gloo python examples/stats_tensorboard.py --logdir build/tb
    torchrun --standalone --nproc_per_node 2 examples/stats_tensorboard.py --ddp --logdir build/tb
    tensorboard --logdir build/tb
"""

import argparse

import torch

from horovod_twobit.state.stats import scalars

import _digits


def setup(args, model):
    """(rank, size, the optimizer, what stats() is read from) with Horovod or, with --ddp,
    torch.distributed and DDP (model: the module to train; DDP wraps it)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    if args.ddp:
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel as DDP
        from horovod_twobit.torch import ddp as twobit_ddp
        dist.init_process_group("gloo")
        ddp_model = DDP(model)  # broadcasts rank 0's parameters
        state = twobit_ddp.TwoBitState(args.threshold, exchange=args.exchange)
        twobit_ddp.register(ddp_model, state)
        return dist.get_rank(), dist.get_world_size(), ddp_model, opt, state
    import horovod.torch as hvd
    from horovod_twobit.torch import TwoBitCompressor
    hvd.init()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    compressor = TwoBitCompressor(args.threshold, exchange=args.exchange)
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                   compression=compressor)
    return hvd.rank(), hvd.size(), model, opt, compressor


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--logdir", default="build/tb")
    p.add_argument("--threshold", type=_digits.threshold, default="auto")
    p.add_argument("--exchange", default="allgather", choices=("allgather", "scatter", "auto"))
    p.add_argument("--ddp", action="store_true",
                   help="DistributedDataParallel with the 2-bit hook (start with torchrun)")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--every", type=int, default=10, help="write the stats every N steps")
    args = p.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
    rank, size, model, opt, source = setup(args, net)
    xtr, ytr, xte, yte = [torch.from_numpy(a) for a in _digits.shards(rank, size)]
    writer = None
    if rank == 0:
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
                for tag, value in scalars(source.stats()).items():
                    writer.add_scalar(tag, value, step)
        if writer is not None:
            st = source.stats()
            with torch.no_grad():
                acc = float((net(xte).argmax(1) == yte).float().mean())
            print("epoch %d  test acc %.4f  sent %.1f %% of values  %d bytes/step/rank"
                  % (epoch + 1, acc, 100 * st["fraction_sent"], sum(st["bytes_last_step"].values())),
                  flush=True)
    if writer is not None:
        writer.close()
        print("stats written to %s (%d steps)" % (args.logdir, step))
    if args.ddp:
        from horovod_twobit.torch import ddp as twobit_ddp
        twobit_ddp.shutdown()


if __name__ == "__main__":
    main()
