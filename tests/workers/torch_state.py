"""Saving after step k and restoring into fresh objects gives the same step k+1 as never stopping."""

import io
import os
import sys

import numpy as np
import torch

import horovod.torch as hvd
from horovod_twobit.torch import TwoBitCompressor

out_dir = sys.argv[1]
THRESHOLD = sys.argv[2] if len(sys.argv) > 2 else 0.1  # "auto" or a number
THRESHOLD = THRESHOLD if THRESHOLD == "auto" else float(THRESHOLD)
EXCHANGE = sys.argv[3] if len(sys.argv) > 3 else "allgather"
hvd.init()
rank = hvd.rank()
K = 5


def build():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    comp = TwoBitCompressor(THRESHOLD, exchange=EXCHANGE)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                   named_parameters=model.named_parameters(), compression=comp)
    return model, opt, comp


def step(model, opt, i):
    rng = np.random.default_rng(100 * rank + i)
    x = torch.from_numpy(rng.standard_normal((8, 8)).astype(np.float32))
    y = torch.from_numpy(rng.standard_normal((8, 4)).astype(np.float32))
    opt.zero_grad()
    ((model(x) - y) ** 2).mean().backward()
    opt.step()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


model, opt, comp = build()
for i in range(K):
    step(model, opt, i)
buf = io.BytesIO()
torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "twobit": comp.state_dict()}, buf)
grads_a = step(model, opt, K)
weights_a = {n: p.detach().clone() for n, p in model.named_parameters()}

model2, opt2, comp2 = build()
buf.seek(0)
ckpt = torch.load(buf)
model2.load_state_dict(ckpt["model"])
opt2.load_state_dict(ckpt["opt"])
comp2.load_state_dict(ckpt["twobit"])
grads_b = step(model2, opt2, K)
weights_b = {n: p.detach().clone() for n, p in model2.named_parameters()}

model3, opt3, comp3 = build()  # restored without residuals: must differ (the test can fail)
model3.load_state_dict(ckpt["model"])
opt3.load_state_dict(ckpt["opt"])
grads_c = step(model3, opt3, K)

same = all(torch.equal(grads_a[n], grads_b[n]) and torch.equal(weights_a[n], weights_b[n]) for n in grads_a)
differs = any(not torch.equal(grads_a[n], grads_c[n]) for n in grads_a)
nonzero_residual = any(float(v.abs().sum()) > 0 for v in ckpt["twobit"]["residuals"].values())
owners = any(float(v.abs().sum()) > 0 for v in ckpt["twobit"].get("owner_residuals", {}).values())
print("rank %d same=%s without_residuals_differs=%s nonzero_residual=%s owners=%s"
      % (rank, same, differs, nonzero_residual, owners))
