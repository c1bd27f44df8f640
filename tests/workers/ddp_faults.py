"""The DDP cells of the fault-injection matrix (tests/fault_cells.py), one after another in one
torchrun job: DistributedDataParallel with the 2-bit hook (horovod_twobit.torch.ddp), DDP's
buckets capped by the cell's bucketing. Each cell saves, per step and rank, every parameter's
local gradient (after the fault) and its result, the residuals (the workers' and the scatter
owners') after the step, the buckets the hook saw at each step, and the final weights, to
OUT/<cell index>/rank<r>.npz.

    python -m torch.distributed.run --standalone --nproc_per_node N ddp_faults.py --out OUT
"""

import argparse
import os

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from horovod_twobit.torch import ddp as twobit_ddp
import fault_cells as fc

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
args = p.parse_args()

torch.set_num_threads(1)
dist.init_process_group("gloo")
rank, size = dist.get_rank(), dist.get_world_size()


def batch(step):
    rng = np.random.default_rng(1000 * rank + step)
    return (torch.from_numpy(rng.standard_normal((8, 10)).astype(np.float32)),
            torch.from_numpy(rng.standard_normal((8, 3)).astype(np.float32)))


def run(cell, rec):
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(10, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))
    model = DDP(net, bucket_cap_mb=fc.DDP_BUCKET_MB[cell.bucketing])  # broadcasts rank 0's
    seen = []  # (step, the bucket's parameter names) per hook call

    def hook(state, bucket):
        seen.append((step, [state.names[id(q)] for q in bucket.parameters()]))
        return twobit_ddp.twobit_hook(state, bucket)

    state = twobit_ddp.register(model, twobit_ddp.TwoBitState(fc.threshold(cell),
                                                              exchange=cell.exchange), hook=hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    local = {}
    for n, prm in net.named_parameters():
        prm.register_hook(lambda g, n=n: fc.inject(cell, "ddp", rank, n, step, g))
        prm.register_hook(lambda g, n=n: local.__setitem__(n, g.clone()))
    for step in range(fc.STEPS):
        x, y = batch(step)
        opt.zero_grad()
        ((model(x) - y) ** 2).mean().mul(3.0).backward()
        finite = True
        for n, prm in net.named_parameters():
            rec["local/%d/%s" % (step, n)] = local[n].numpy().copy()
            rec["agg/%d/%s" % (step, n)] = prm.grad.numpy().copy()
            finite = finite and bool(torch.isfinite(prm.grad).all())
        rec["groups/%d" % step] = np.array([",".join(g) for s, g in seen if s == step])
        fc.save_residuals(rec, state.state_dict(), step)
        if finite:  # as a loss scaler does
            opt.step()
    for n, prm in net.named_parameters():
        rec["w/" + n] = prm.detach().numpy().copy()


for i, cell in enumerate(fc.cells("ddp", size)):
    rec = {}
    run(cell, rec)
    os.makedirs(os.path.join(args.out, str(i)), exist_ok=True)
    np.savez(os.path.join(args.out, str(i), "rank%d.npz" % rank), **rec)
    print("rank %d cell %d %s done" % (rank, i, fc.encode(cell)), flush=True)
twobit_ddp.shutdown()  # a barrier, then destroy_process_group
print("rank %d done" % rank, flush=True)
