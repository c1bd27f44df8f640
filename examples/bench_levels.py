"""CPU cost of choosing a bucket's per-block levels with threshold="auto" (codec.segment_levels),
on the buckets hvd.DistributedOptimizer builds for examples/bench_buckets.py's PyTorch models, and
of levels.auto_levels / block_levels on one small tensor. One thread; CPU time (process_time)
and wall time per call, min and median over ``--calls`` calls after ``--warmup``.

    .venv/bin/python -m examples.bench_levels --models transformer,cnn --calls 50
"""

import argparse
import statistics
import time

import torch

from examples.bench_buckets import torch_model
from horovod_twobit.wire import layout as lay
from horovod_twobit import wire
from horovod_twobit.torch.codec import levels
from horovod_twobit.torch import codec


def model_layouts(name):
    """The "auto" bucket layouts of the model, as TwoBitCompressor.plan cuts them (parameters in
    reverse order, the default bucket size and blocks)."""
    net, _, _ = torch_model(name)
    params = [(n, p) for n, p in net.named_parameters() if p.requires_grad]
    entries = [(n, p.numel(), p.numel() * p.element_size(), p.device) for n, p in reversed(params)]
    sizes = {n: numel for n, numel, _, _ in entries}
    block, blocks = wire.validate_blocks("auto")
    return [lay.Layout([sizes[n] for n in names], True, block, blocks)
            for names in lay.assign_buckets(entries, lay.validate_bucket_bytes(None))]


def bucket_data(layout, seed=0):
    """A residual and a gradient for the bucket: each member with its own scale, zeros between
    members (as the flat buffer holds)."""
    gen = torch.Generator().manual_seed(seed)
    r = torch.zeros(layout.values)
    g = torch.zeros(layout.values)
    for i, (s, n) in enumerate(zip(layout.starts, layout.numels)):
        scale = 10.0 ** (-4 + 3 * torch.rand((), generator=gen).item())
        g[s:s + n] = torch.randn(n, generator=gen) * scale
        r[s:s + n] = torch.randn(n, generator=gen) * scale * 0.1
    return r, g


def timed(fn, calls, warmup):
    """(min, median) of CPU ms and (min, median) of wall ms per call."""
    for _ in range(warmup):
        fn()
    cpu, wall = [], []
    for _ in range(calls):
        c0, w0 = time.process_time(), time.perf_counter()
        fn()
        cpu.append(1e3 * (time.process_time() - c0))
        wall.append(1e3 * (time.perf_counter() - w0))
    return (min(cpu), statistics.median(cpu)), (min(wall), statistics.median(wall))


def report(label, figures):
    (cmin, cmed), (wmin, wmed) = figures
    print("%-40s cpu ms min %7.3f median %7.3f | wall ms min %7.3f median %7.3f"
          % (label, cmin, cmed, wmin, wmed), flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="transformer,cnn")
    ap.add_argument("--rule", default=wire.DEFAULT_RULE)
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--small", type=int, default=9216, help="values of the small tensor")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    for name in args.models.split(","):
        for i, layout in enumerate(model_layouts(name)):
            r, g = bucket_data(layout, i)
            label = "%s bucket %d (%d values, %d segments, %d lengths)" % (
                name, i, layout.values, layout.segments, len(layout.groups))
            report(label, timed(lambda: codec.segment_levels(layout, r, g, args.rule),
                                args.calls, args.warmup))
    n = args.small
    gen = torch.Generator().manual_seed(1)
    r, g = torch.randn(n, generator=gen) * 1e-3, torch.randn(n, generator=gen) * 1e-2
    block = wire.block_of(n, *wire.validate_blocks("auto"))
    report("auto_levels, %d values" % n,
           timed(lambda: levels.auto_levels(r, g, args.rule), args.calls, args.warmup))
    report("block_levels, %d values, block %s" % (n, block),
           timed(lambda: levels.block_levels(r, g, block, args.rule), args.calls, args.warmup))


if __name__ == "__main__":
    main()
