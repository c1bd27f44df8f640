"""A plain step's wait (TwoBitCompressor(fallback="always")) while another rank is late: rank 1
sleeps before its backward pass at steps 0 (g + r as one buffer), 1 (members sent alone) and 3
(settled plain: Horovod's own allreduce, as without a compressor);
rank 0 records its training thread's CPU seconds and the wall seconds of ``opt.synchronize()``
at every step, and both ranks the aggregated gradients and final weights. The ranks meet at a
barrier before each step, so rank 0's own first-step costs (the compressor's setup, a loaded
machine) come out of rank 1's lateness before rank 0 starts waiting, not out of its wait. Prints
one JSON line per rank."""

import json
import sys
import time

import torch

import horovod.torch as hvd
from horovod_twobit.torch import TwoBitCompressor

LATE_S = 1.2
LATE_STEPS = (0, 1, 3)

hvd.init()
rank = hvd.rank()
torch.set_num_threads(1)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
c = TwoBitCompressor(0.05, fallback="always")
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                               named_parameters=model.named_parameters(), compression=c)
rec = {"rank": rank, "waits": [], "grads": [], "direct": []}
for step in range(6):
    g = torch.Generator().manual_seed(100 * rank + step)
    x, y = torch.randn(8, 8, generator=g), torch.randn(8, 4, generator=g)
    opt.zero_grad()
    hvd.barrier()
    loss = ((model(x) - y) ** 2).mean()
    if rank == 1 and step in LATE_STEPS:
        time.sleep(LATE_S)
    loss.backward()
    t0, c0 = time.perf_counter(), time.thread_time()
    opt.synchronize()
    rec["waits"].append([time.perf_counter() - t0, time.thread_time() - c0])
    rec["grads"].append([p.grad.reshape(-1).tolist() for p in model.parameters()])
    rec["direct"].append(opt._compression.direct is not None)
    with opt.skip_synchronize():
        opt.step()
rec["weights"] = [p.detach().reshape(-1).tolist() for p in model.parameters()]
rec["exchanges"] = c.stats()["bytes_last_step"]
print("RESULT " + json.dumps(rec), flush=True)
sys.stdout.flush()
