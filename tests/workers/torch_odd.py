"""Odd tensors and non-finite gradients through hvd.allreduce with TwoBitCompressor."""

import os
import sys

import numpy as np
import torch

import horovod.torch as hvd
from horovod_twobit.torch import TwoBitCompressor

out_dir = sys.argv[1]
hvd.init()
rank = hvd.rank()
c = TwoBitCompressor(0.5)
rec = {}


def rnd(shape, seed, dtype=torch.float32):
    a = np.array(np.random.default_rng(seed + 31 * rank).standard_normal(shape) * 0.8, dtype=np.float32)
    return torch.from_numpy(a).to(dtype)


cases = {
    "empty": rnd((0,), 1),
    "one": rnd((1,), 2),
    "scalar": rnd((), 3),
    "noncontig": rnd((6, 9), 4).t(),
    "fp16": rnd((37,), 5, torch.float16),
    "bf16": rnd((37,), 6, torch.bfloat16),
    "fp64": rnd((37,), 7, torch.float64),
}
for step in range(3):
    for name, t in cases.items():
        t = t * (step + 1)
        out = hvd.allreduce(t, name=name, compression=c)
        assert out.dtype == t.dtype and out.shape == t.shape, (name, out.dtype, out.shape)
        rec["in/%s/%d" % (name, step)] = t.float().numpy().copy()
        rec["out/%s/%d" % (name, step)] = out.float().numpy().copy()

# integers pass through uncompressed: the exact sum
ints = torch.arange(7, dtype=torch.int64) * (rank + 1)
rec["ints"] = hvd.allreduce(ints, name="ints", op=hvd.Sum, compression=c).numpy()

# non-finite: rank 1 sends NaN (and rank 0 Inf) at step 1; nobody's residual may change
for step in range(3):
    g = rnd((40,), 50 + step)
    if step == 1 and rank == 1:
        g[3] = float("nan")
    if step == 1 and rank == 0:
        g[5] = float("inf")
    before = c.residuals.get("nf", g).clone() if "nf" in c.residuals else torch.zeros(40)
    out = hvd.allreduce(g, name="nf", compression=c)
    rec["nf_in/%d" % step] = g.numpy().copy()
    rec["nf_out/%d" % step] = out.numpy().copy()
    rec["nf_res_before/%d" % step] = before.numpy()
    rec["nf_res_after/%d" % step] = c.residuals.get("nf", g).numpy().copy()
np.savez(os.path.join(out_dir, "rank%d.npz" % rank), **rec)
print("rank %d done" % rank)
