"""A real Horovod training job with TwoBitCompressor; each rank saves what it saw to an .npz.

One job trains several configurations in turn, each with its own model, optimizer and compressor:
each argument is one configuration's options (e.g. "--steps 12 --threshold auto --groups 2"), and
configuration i is saved to OUT/<i>/rank<r>.npz. One launch, one torch import.
"""

import argparse
import shlex
import sys

import numpy as np
import torch

import horovod.torch as hvd
from horovod_twobit.torch import TwoBitCompressor
from configs import run_each

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=20)
p.add_argument("--threshold", type=lambda v: v if v == "auto" else float(v), default=0.5)
p.add_argument("--bpps", type=int, default=1)
p.add_argument("--groups", type=int, default=0)
p.add_argument("--op", default="average")
p.add_argument("--dtype", default="float32")
p.add_argument("--no-names", action="store_true")
p.add_argument("--block", type=int, default=None)
p.add_argument("--blocks", type=int, default=None)
out_dir, configs = sys.argv[1], sys.argv[2:]

hvd.init()
rank, size = hvd.rank(), hvd.size()


def run(args):
    """Trains one configuration: the records to save."""
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(12, 40), torch.nn.Tanh(), torch.nn.Linear(40, 6))
    # before the cast: Horovod cannot broadcast bf16 on CPU
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    model = model.to(dtype)
    names = {p: n for n, p in model.named_parameters()}
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    compressor = TwoBitCompressor(args.threshold, block=args.block, blocks=args.blocks)
    kw = dict(compression=compressor, backward_passes_per_step=args.bpps,
              op=hvd.Sum if args.op == "sum" else hvd.Average)
    if not args.no_names:
        kw["named_parameters"] = model.named_parameters()
    if args.groups:
        kw["groups"] = args.groups
    opt = hvd.DistributedOptimizer(opt, **kw)

    local = {}
    for prm, n in names.items():
        prm.register_hook(lambda g, n=n: local.__setitem__(
            n, local[n] + g.float() if n in local else g.float().clone()))

    rec = {}
    for step in range(args.steps):
        local.clear()
        opt.zero_grad()
        for k in range(args.bpps):
            rng = np.random.default_rng(1000 * rank + 10 * step + k)
            x = torch.from_numpy(rng.standard_normal((16, 12)).astype(np.float32)).to(dtype)
            y = torch.from_numpy(rng.standard_normal((16, 6)).astype(np.float32)).to(dtype)
            loss = ((model(x) - y) ** 2).mean() * 3.0
            loss.backward()
        opt.synchronize()
        for prm, n in names.items():
            rec["local/%d/%s" % (step, n)] = local[n].numpy()
            rec["agg/%d/%s" % (step, n)] = prm.grad.float().numpy().copy()
        with opt.skip_synchronize():
            opt.step()

    # An ordinary allreduce in the same job is exact and uncompressed.
    plain = torch.arange(10, dtype=torch.float32) * (rank + 1) + 0.001
    rec["plain"] = hvd.allreduce(plain, name="plain", op=hvd.Sum).numpy()
    # hvd.allreduce with the compressor, twice under the same name (the residual carries over).
    for i in range(2):
        rng = np.random.default_rng(7 + rank + 100 * i)
        t = torch.from_numpy(rng.standard_normal(50).astype(np.float32))
        rec["direct_in/%d" % i] = t.numpy()
        rec["direct_out/%d" % i] = hvd.allreduce(t, name="direct", compression=compressor).numpy()
    for n, prm in model.named_parameters():
        rec["w/" + n] = prm.detach().float().numpy()
    rec["residual_names"] = np.array(sorted(compressor.residuals.names()))
    # the controller the job really ran on (Horovod's, at run time)
    rec["controller"] = np.array("mpi" if hvd.mpi_enabled() else "gloo" if hvd.gloo_enabled()
                                 else "none")
    return rec


run_each(out_dir, configs, lambda spec: run(p.parse_args(shlex.split(spec))), rank)
print("rank %d done" % rank)
