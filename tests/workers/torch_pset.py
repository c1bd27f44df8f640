"""TwoBit within a process set: ranks 0 and 1 of 3 exchange, rank 2 stays out."""

import os
import sys

import numpy as np
import torch

import horovod.torch as hvd
from horovod_twobit.torch import TwoBitCompressor

out_dir = sys.argv[1]
ps = hvd.ProcessSet([0, 1])
hvd.init(process_sets=[ps])
rank = hvd.rank()
rec = {}
if ps.included():
    c = TwoBitCompressor(0.5)
    for i in range(3):
        t = torch.from_numpy(np.random.default_rng(10 * rank + i).standard_normal(37).astype(np.float32))
        rec["in/%d" % i] = t.numpy()
        rec["out/%d" % i] = hvd.allreduce(t, name="ps", compression=c, process_set=ps).numpy()
    torch.manual_seed(0)  # the same initial weights on both ranks
    model = torch.nn.Linear(5, 3)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), compression=c,
                                   process_set=ps)
    for i in range(3):
        opt.zero_grad()
        model(torch.randn(4, 5, generator=torch.Generator().manual_seed(rank + 7 * i))).pow(2).mean().backward()
        opt.step()
    rec["w"] = model.weight.detach().numpy()
hvd.barrier()
np.savez(os.path.join(out_dir, "rank%d.npz" % rank), **rec)
print("rank %d done" % rank)
