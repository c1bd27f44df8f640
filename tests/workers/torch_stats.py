"""TwoBitCompressor.stats() in a real job: hvd.DistributedOptimizer with buckets (bucket_bytes=
2048: a bucket of three tensors and a tensor alone), a NaN on the last rank at step 2, stats read
after every step (and reset after step 3). Saves, per configuration (--configs THRESHOLD:EXCHANGE)
and rank, the local gradients, the residuals before each step, the stats (as JSON) and, per step,
every tensor this rank handed to Horovod's allgather and alltoall (collective, name, bytes: its
number of elements times its element size, as JSON) to OUT/<index>/rank<r>.npz."""

import argparse
import json

import numpy as np
import torch

import horovod.torch as hvd
import horovod.torch.mpi_ops as mpi_ops
from horovod_twobit.torch import TwoBitCompressor
from configs import run_each, threshold_exchange

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--configs", nargs="+", required=True)
p.add_argument("--steps", type=int, default=5)
args = p.parse_args()
hvd.init()
rank = hvd.rank()
torch.set_num_threads(1)
handed = []  # (collective, name, bytes) of each tensor handed to the collectives


def counting(kind, collective):
    def call(tensor, *a, **kw):
        handed.append((kind, kw.get("name") or "", tensor.numel() * tensor.element_size()))
        return collective(tensor, *a, **kw)
    return call


mpi_ops.allgather_async = counting("allgather", mpi_ops.allgather_async)
mpi_ops.alltoall_async = counting("alltoall", mpi_ops.alltoall_async)


def run(threshold, exchange):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(12, 40), torch.nn.Tanh(), torch.nn.Linear(40, 6))
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    c = TwoBitCompressor(threshold, bucket_bytes=2048, exchange=exchange)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), compression=c)
    names = [n for n, _ in model.named_parameters()]
    local, step = {}, 0

    def hook(g, n):
        if n == "0.bias" and step == 2 and rank == hvd.size() - 1:
            g = g.clone()
            g[5] = float("nan")
        local[n] = g.clone()
        return g

    for n, prm in model.named_parameters():
        prm.register_hook(lambda g, n=n: hook(g, n))
    rec = {"groups": np.array([",".join(b.names) for b in
                               {id(b): b for b in c._buckets.values()}.values()])}
    for step in range(args.steps):
        rng = np.random.default_rng(1000 * rank + step)
        x = torch.from_numpy(rng.standard_normal((16, 12)).astype(np.float32))
        y = torch.from_numpy(rng.standard_normal((16, 6)).astype(np.float32))
        opt.zero_grad()
        handed.clear()
        ((model(x) - y) ** 2).mean().mul(3.0).backward()
        opt.synchronize()
        rec["handed/%d" % step] = np.array(json.dumps(handed))
        for n in names:
            rec["local/%d/%s" % (step, n)] = local[n].numpy().copy()
        rec["bucket_stats/%d" % step] = np.array(json.dumps(c.stats()))  # norms per bucket
        rec["stats/%d" % step] = np.array(json.dumps(c.stats(reset=step == 3, per_tensor=True)))
        with opt.skip_synchronize():
            if all(bool(torch.isfinite(prm.grad).all()) for prm in model.parameters()):
                opt.step()
    return rec


run_each(args.out, args.configs, lambda spec: run(*threshold_exchange(spec)), rank)
print("rank %d done" % rank, flush=True)
