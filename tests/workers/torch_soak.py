"""The soak run of the fault-injection tests (tests/fault_cells.py): SOAK_STEPS steps of
hvd.DistributedOptimizer with TwoBitCompressor and its default buckets, faults (NaN, +Inf, -Inf on
one rank) at random steps, the optimizer step skipped where the result is not finite. The
gradients are computed in NumPy from the weights (``soak_grads``) and reach the parameters through
a real backward pass (the gradient of sum(p * G) is G, exactly). Saves the final weights, the
residuals, the groups and the number of skipped steps to OUT/<config index>/rank<r>.npz."""

import argparse
import os
import time

import numpy as np
import torch

import horovod.torch as hvd
from horovod_twobit.torch import TwoBitCompressor
import fault_cells as fc

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--steps", type=int, default=fc.SOAK_STEPS)
args = p.parse_args()

hvd.init()
rank, size = hvd.rank(), hvd.size()
torch.set_num_threads(1)
faults = fc.soak_faults(args.steps, size)

for ci, spec in enumerate(fc.SOAK_CONFIGS):
    threshold, exchange = spec.split("/")
    c = TwoBitCompressor(threshold if threshold == "auto" else float(threshold), exchange=exchange)
    shapes = [(7, 10), (7,), (3, 7), (3,)]
    params = [torch.nn.Parameter(torch.from_numpy(w.reshape(s).copy()))
              for w, s in zip(fc.soak_start(), shapes)]
    names = [n for n, _ in fc.TENSORS["torch"]]
    opt = hvd.DistributedOptimizer(torch.optim.SGD(params, lr=float(fc.SOAK_LR)),
                                   named_parameters=list(zip(names, params)), compression=c)
    groups = [b.names for b in {id(b): b for b in c._buckets.values()}.values()]
    groups += [[n] for n in names if c.bucket_of(n) is None]
    skipped, t0 = 0, time.time()
    for step in range(args.steps):
        grads = fc.soak_grads([prm.detach().numpy().reshape(-1) for prm in params], rank, step,
                              faults)
        opt.zero_grad()
        sum((prm * torch.from_numpy(g.reshape(prm.shape))).sum()
            for prm, g in zip(params, grads)).backward()
        opt.synchronize()
        with torch.no_grad():
            if all(bool(torch.isfinite(prm.grad).all()) for prm in params):
                for prm in params:  # w - lr * g, rounded as NumPy rounds it
                    prm.sub_(prm.grad * fc.SOAK_LR.item())
            else:
                skipped += 1
    rec = {"w/" + n: prm.detach().numpy().reshape(-1).copy() for n, prm in zip(names, params)}
    for k, r in c.state_dict()["residuals"].items():
        rec["res/" + k] = np.asarray(r).reshape(-1).copy()
    for k, r in c.state_dict().get("owner_residuals", {}).items():
        rec["own/" + k] = np.asarray(r).copy()
    rec["groups"] = np.array([",".join(g) for g in groups])
    rec["skipped"] = np.array(skipped)
    os.makedirs(os.path.join(args.out, str(ci)), exist_ok=True)
    np.savez(os.path.join(args.out, str(ci), "rank%d.npz" % rank), **rec)
    print("rank %d soak %s: %d steps, %d faults, %d skipped, %.1fs"
          % (rank, spec, args.steps, len(faults), skipped, time.time() - t0), flush=True)
print("rank %d done" % rank, flush=True)
