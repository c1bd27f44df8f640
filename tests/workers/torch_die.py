"""Rank 1 kills itself with SIGKILL in the middle of training; the survivors must not hang."""

import os
import signal
import time

import torch

import horovod.torch as hvd
from horovod_twobit.torch import TwoBitCompressor

hvd.init()
model = torch.nn.Linear(64, 64)
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                               named_parameters=model.named_parameters(),
                               compression=TwoBitCompressor(0.5))
for step in range(10 ** 6):
    if step == 5 and hvd.rank() == 1:
        print("rank 1 dies", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    opt.zero_grad()
    model(torch.randn(8, 64)).pow(2).mean().backward()
    opt.step()
    time.sleep(0.01)
