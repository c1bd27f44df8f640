"""The PyTorch cells of the fault-injection matrix (tests/fault_cells.py), one after another in
one job: hvd.DistributedOptimizer (buckets planned from the parameters) and hvd.allreduce /
hvd.grouped_allreduce of named tensors. Each cell saves, per step and rank, every tensor's local
gradient (after the fault) and its aggregated result, the residuals (the workers' and the scatter
owners') after the step, the groups its tensors travelled in, and the final weights, to
OUT/<cell index>/rank<r>.npz."""

import argparse
import os

import numpy as np
import torch

import horovod.torch as hvd
from horovod_twobit.torch import TwoBitCompressor
import fault_cells as fc

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
args = p.parse_args()

hvd.init()
rank, size = hvd.rank(), hvd.size()
torch.set_num_threads(1)


def model():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(10, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))
    hvd.broadcast_parameters(m.state_dict(), root_rank=0)
    return m


def batch(step):
    rng = np.random.default_rng(1000 * rank + step)
    return (torch.from_numpy(rng.standard_normal((8, 10)).astype(np.float32)),
            torch.from_numpy(rng.standard_normal((8, 3)).astype(np.float32)))


def inject(cell, name, step, g):
    return fc.inject(cell, "torch", rank, name, step, g)


def residuals(rec, c, step):
    fc.save_residuals(rec, c.state_dict(), step)


def run_optimizer(cell, c, rec):
    m = model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1),
                                   named_parameters=m.named_parameters(), compression=c)
    local = {}
    for n, prm in m.named_parameters():
        prm.register_hook(lambda g, n=n: inject(cell, n, step, g))
        prm.register_hook(lambda g, n=n: local.__setitem__(n, g.clone()))
    planned = {id(b): b.names for b in c._buckets.values()}
    grouped = {n for names in planned.values() for n in names}
    groups = list(planned.values()) + [[n] for n, _ in m.named_parameters() if n not in grouped]
    for step in range(fc.STEPS):
        x, y = batch(step)
        opt.zero_grad()
        ((m(x) - y) ** 2).mean().mul(3.0).backward()
        opt.synchronize()
        finite = True
        for n, prm in m.named_parameters():
            rec["local/%d/%s" % (step, n)] = local[n].numpy().copy()
            rec["agg/%d/%s" % (step, n)] = prm.grad.numpy().copy()
            finite = finite and bool(torch.isfinite(prm.grad).all())
        residuals(rec, c, step)
        with opt.skip_synchronize():
            if finite:  # as a loss scaler does
                opt.step()
    for n, prm in m.named_parameters():
        rec["w/" + n] = prm.detach().numpy().copy()
    return groups


def run_allreduce(cell, c, rec):
    """The model's gradient sizes through hvd.allreduce (alone) and hvd.grouped_allreduce (the
    bucketing's groups), as a user's own loop would send them."""
    sizes = dict(fc.TENSORS["torch"])
    names = [n for n, _ in fc.TENSORS["torch"]]
    if cell.bucketing == "b0":
        plan = [[n] for n in names]
    elif cell.bucketing == "one":
        plan = [[names[0]], names[1:]]
    else:
        plan = [names]
    groups = [g if len(g) == 1 else ["grp%d.%d" % (gi, i) for i in range(len(g))]
              for gi, g in enumerate(plan)]
    w = {n: np.zeros(s, np.float32) for n, s in sizes.items()}
    for step in range(fc.STEPS):
        rng = np.random.default_rng(77 * rank + step)
        for gi, (g, keys) in enumerate(zip(plan, groups)):
            ts = [inject(cell, n, step, torch.from_numpy(
                (rng.standard_normal(sizes[n]) * 0.1).astype(np.float32))) for n in g]
            if len(g) == 1:
                outs = [hvd.allreduce(ts[0], name=g[0], compression=c)]
            else:
                outs = hvd.grouped_allreduce(ts, name="grp%d" % gi, compression=c)
            for k, t, o in zip(keys, ts, outs):
                rec["local/%d/%s" % (step, k)] = t.numpy().copy()
                rec["agg/%d/%s" % (step, k)] = o.numpy().copy()
            for n, o in zip(g, outs):
                if bool(torch.isfinite(o).all()):
                    w[n] -= 0.1 * o.numpy()
        residuals(rec, c, step)
    for n in names:
        rec["w/" + n] = w[n]
    return groups


for i, cell in enumerate(fc.cells("torch", size)):
    c = TwoBitCompressor(fc.threshold(cell), bucket_bytes=fc.BUCKETINGS[cell.bucketing],
                         exchange=cell.exchange)
    rec = {}
    groups = (run_optimizer if cell.path == "optimizer" else run_allreduce)(cell, c, rec)
    rec["groups"] = np.array([",".join(g) for g in groups])
    os.makedirs(os.path.join(args.out, str(i)), exist_ok=True)
    np.savez(os.path.join(args.out, str(i), "rank%d.npz" % rank), **rec)
    print("rank %d cell %d %s done" % (rank, i, fc.encode(cell)), flush=True)
print("rank %d done" % rank, flush=True)
