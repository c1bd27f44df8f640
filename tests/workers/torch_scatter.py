"""The scatter exchange in a real job; each rank saves what it saw to an .npz.

1. hvd.DistributedOptimizer with buckets (bucket_bytes=2048 cuts the model into a bucket of three
   tensors and a tensor alone), the bucket membership, every rank's local and aggregated
   gradients per step, and the number of alltoalls and allgathers.
2. hvd.allreduce of single tensors of odd sizes, with op=Sum and scale factors on one of them.
3. A NaN on one rank at one step: the residuals (workers' and owners') before and after.
4. Hand-submitted tensors waited on in a different order on every rank.
All four run once per configuration (--configs THRESHOLD:EXCHANGE ...), each with its own model
and compressor, saved to --out/<index>/rank<r>.npz: one launch, one torch import.
"""

import argparse
import os

import numpy as np
import torch

import horovod.torch as hvd
import horovod.torch.mpi_ops as mpi_ops
import horovod_twobit
from horovod_twobit.torch import TwoBitCompressor
from configs import run_each, threshold_exchange

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--configs", nargs="+", required=True, help="THRESHOLD:EXCHANGE each")
p.add_argument("--steps", type=int, default=6)
args = p.parse_args()

hvd.init()
rank = hvd.rank()
print("rank %d uses %s" % (rank, os.path.dirname(horovod_twobit.__file__)))
calls = {"alltoall": 0, "allgather": 0}
for op in calls:
    def counting(*a, _orig=getattr(mpi_ops, op + "_async"), _op=op, **kw):
        calls[_op] += 1
        return _orig(*a, **kw)
    setattr(mpi_ops, op + "_async", counting)

def run(threshold, exchange):
    """Sections 1-4 with one threshold and exchange: the records to save."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(12, 40), torch.nn.Tanh(), torch.nn.Linear(40, 6))
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    c = TwoBitCompressor(threshold, bucket_bytes=2048, exchange=exchange)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), compression=c)
    names = {prm: n for n, prm in model.named_parameters()}
    local = {}
    for prm, n in names.items():
        prm.register_hook(lambda g, n=n: local.__setitem__(n, g.clone()))
    rec = {}
    buckets = {id(b): b.names for b in c._buckets.values()}
    for i, members in enumerate(buckets.values()):
        rec["bucket/%d" % i] = np.array(members)
    for step in range(args.steps):
        rng = np.random.default_rng(1000 * rank + step)
        x = torch.from_numpy(rng.standard_normal((16, 12)).astype(np.float32))
        y = torch.from_numpy(rng.standard_normal((16, 6)).astype(np.float32))
        opt.zero_grad()
        before = dict(calls)
        ((model(x) - y) ** 2).mean().mul(3.0).backward()
        opt.synchronize()
        for k in calls:
            rec["calls/%s/%d" % (k, step)] = np.array(calls[k] - before[k])
        for prm, n in names.items():
            rec["local/%d/%s" % (step, n)] = local[n].numpy().copy()
            rec["agg/%d/%s" % (step, n)] = prm.grad.numpy().copy()
        with opt.skip_synchronize():
            opt.step()
    for n, prm in model.named_parameters():
        rec["w/" + n] = prm.detach().numpy().copy()

    # single tensors of odd sizes; "sum" with op=hvd.Sum and scale factors
    for step in range(3):
        for n in (1, 17, 33, 100, 16 * 7 + 3, 3000):
            g = torch.from_numpy(np.random.default_rng(50 * rank + n + step).standard_normal(n)
                                 .astype(np.float32))
            rec["single_in/%d/%d" % (n, step)] = g.numpy().copy()
            before = calls["alltoall"]
            rec["single_out/%d/%d" % (n, step)] = hvd.allreduce(
                g, name="single%d" % n, compression=c).numpy()
            rec["single_alltoalls/%d/%d" % (n, step)] = np.array(calls["alltoall"] - before)
        g = torch.from_numpy(np.random.default_rng(9 * rank + step).standard_normal(70)
                             .astype(np.float32))
        rec["sum_in/%d" % step] = g.numpy().copy()
        rec["sum_out/%d" % step] = hvd.allreduce(g, name="sum", compression=c, op=hvd.Sum,
                                                 prescale_factor=0.5, postscale_factor=3.0).numpy()

    # non-finite: rank 1 sends NaN at step 1; no residual changes, the owners' included
    def owned(st):
        return st.get("owner_residuals", {}).get("nf", torch.zeros(0)).numpy().copy()

    for step in range(3):
        g = torch.from_numpy(np.random.default_rng(70 * rank + step).standard_normal(200)
                             .astype(np.float32))
        if step == 1 and rank == hvd.size() - 1:
            g[3] = float("nan")
        st = c.state_dict()
        rec["nf_res_before/%d" % step] = st["residuals"].get("nf", torch.zeros(200)).numpy().copy()
        rec["nf_own_before/%d" % step] = owned(st)
        rec["nf_in/%d" % step] = g.numpy().copy()
        rec["nf_out/%d" % step] = hvd.allreduce(g, name="nf", compression=c).numpy()
        st = c.state_dict()
        rec["nf_res_after/%d" % step] = st["residuals"]["nf"].numpy().copy()
        rec["nf_own_after/%d" % step] = owned(st)
    # hand-submitted steps waited on in a different order on every rank, a plain allreduce
    # among them
    for step in range(2):
        handles = {}
        for n, k in (("oa", 3000), ("ob", 500)):
            g = torch.from_numpy(np.random.default_rng(30 * rank + k + step).standard_normal(k)
                                 .astype(np.float32))
            rec["order_in/%s/%d" % (n, step)] = g.numpy().copy()
            t, _ = c.compress(g)
            handles[n] = hvd.allreduce_async_(t, name=n)
        handles["plain"] = hvd.allreduce_async(torch.ones(3) * rank, name="plain", op=hvd.Sum)
        order = sorted(handles, reverse=bool((rank + step) % 2))
        for n in order:
            rec["order_out/%s/%d" % (n, step)] = hvd.synchronize(handles[n]).numpy().copy()
    return rec


run_each(args.out, args.configs, lambda spec: run(*threshold_exchange(spec)), rank)
print("rank %d done" % rank)
