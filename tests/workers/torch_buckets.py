"""Buckets in a real job: the same training bucketed and unbucketed gives the same bits, whatever
order the gradients are submitted in on each rank; each rank saves what it saw to an .npz.

1. Two copies of one model (conv + BatchNorm + linear layers, one layer unused on odd steps, one
   float64 parameter), one trained with the default buckets, one with bucket_bytes=0; both with
   hvd.DistributedOptimizer and the same data. Per run and step: each parameter's local gradient
   (as its hook saw it; none where it got no gradient), its aggregated gradient and its residual
   after the step; per run, the tensors of each bucket.
2. Hand-submitted hvd.allreduce_async_ on a planned compressor, in a different order on every rank
   and step.
"""

import argparse
import os

import numpy as np
import torch

import horovod.torch as hvd
import horovod.torch.mpi_ops as mpi_ops
from horovod_twobit.torch import TwoBitCompressor

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--threshold", type=lambda v: v if v == "auto" else float(v), default=0.05)
p.add_argument("--steps", type=int, default=6)
p.add_argument("--bucket-bytes", type=int, default=4096)
args = p.parse_args()

hvd.init()
rank = hvd.rank()
calls = {"allgather": 0}
_allgather = mpi_ops.allgather_async


def counting_allgather(*a, **kw):
    calls["allgather"] += 1
    return _allgather(*a, **kw)


mpi_ops.allgather_async = counting_allgather


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.bn = torch.nn.BatchNorm2d(8)
        self.fc = torch.nn.Linear(16, 20)
        self.unused = torch.nn.Linear(20, 20)  # no gradient on odd steps
        self.head = torch.nn.Linear(20, 5)
        self.scale = torch.nn.Parameter(torch.ones(5, dtype=torch.float64))

    def forward(self, x, step):
        h = torch.relu(self.bn(self.conv(x))).mean(1)
        h = torch.tanh(self.fc(h.reshape(len(x), -1)))
        if step % 2 == 0:
            h = h + self.unused(h)
        return self.head(h) * self.scale.float()


local = {}


def make(key, bucket_bytes):
    torch.manual_seed(0)
    model = Net()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    mine = local.setdefault(key, {})
    for n, prm in model.named_parameters():  # what each rank computed, before the exchange
        prm.register_hook(lambda g, n=n, mine=mine: mine.__setitem__(n, g.detach().clone()))
    c = TwoBitCompressor(args.threshold, bucket_bytes=bucket_bytes)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                   named_parameters=model.named_parameters(), compression=c)
    return model, opt, c


rec = {}
runs = {"bucketed": make("bucketed", args.bucket_bytes), "alone": make("alone", 0)}
rec["buckets"] = np.array(len({id(b) for b in runs["bucketed"][2]._buckets.values()}))
for key, (_, _, c) in runs.items():
    rec["groups/" + key] = np.array([",".join(b.names) for b in
                                     {id(b): b for b in c._buckets.values()}.values()])
for step in range(args.steps):
    rng = np.random.default_rng(100 * rank + step)
    x = torch.from_numpy(rng.standard_normal((4, 3, 4, 4)).astype(np.float32))
    y = torch.from_numpy(rng.standard_normal((4, 5)).astype(np.float32))
    for key, (model, opt, c) in runs.items():
        opt.zero_grad()
        mine = local[key]
        mine.clear()
        before = calls["allgather"]
        ((model(x, step) - y) ** 2).mean().backward()
        opt.synchronize()
        rec["allgathers/%s/%d" % (key, step)] = np.array(calls["allgather"] - before)
        for n, prm in model.named_parameters():
            rec["agg/%s/%d/%s" % (key, step, n)] = prm.grad.double().numpy().copy()
            if n in mine:
                rec["local/%s/%d/%s" % (key, step, n)] = mine[n].numpy().copy()
        for n, r in c.state_dict()["residuals"].items():
            rec["res/%s/%d/%s" % (key, step, n)] = np.asarray(r).reshape(-1).copy()
        with opt.skip_synchronize():
            opt.step()
for key, (model, _, c) in runs.items():
    for n, prm in model.named_parameters():
        rec["w/%s/%s" % (key, n)] = prm.detach().double().numpy().copy()
    for n, r in c.state_dict()["residuals"].items():
        rec["residual/%s/%s" % (key, n)] = r.numpy().copy()

# hand-submitted, in a different order on every rank and step
sizes = {"a": 40, "b": 17, "c": 300, "d": 1}
planned = TwoBitCompressor(args.threshold).plan(
    [(n, torch.zeros(k)) for n, k in sizes.items()])
alone = TwoBitCompressor(args.threshold, bucket_bytes=0)
for step in range(3):
    order = list(sizes)
    np.random.default_rng(rank * 10 + step).shuffle(order)
    grads = {n: torch.from_numpy(np.random.default_rng(1000 * rank + 10 * step + i)
                                 .standard_normal(k).astype(np.float32) * 0.1)
             for i, (n, k) in enumerate(sizes.items())}
    handles = {}
    for n in order:
        t, _ = planned.compress(grads[n].clone())
        handles[n] = hvd.allreduce_async_(t, name=n)
    got = {n: hvd.synchronize(h).numpy().copy() for n, h in handles.items()}
    for n in sizes:
        want = hvd.allreduce(grads[n].clone(), name="ref." + n, compression=alone)
        rec["hand/%d/%s" % (step, n)] = got[n]
        rec["handref/%d/%s" % (step, n)] = want.numpy().copy()
np.savez(os.path.join(args.out, "rank%d.npz" % rank), **rec)
print("rank %d done" % rank)
