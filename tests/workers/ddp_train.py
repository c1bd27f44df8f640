"""A DDP job with the 2-bit hook (horovod_twobit.torch.ddp), started by torchrun: a model of 22
tensors in several DDP buckets, a few steps, one rank's gradient holding a NaN at one step.
Every rank records, per step and per bucket the hook saw, its members' names, the local
gradients and the results, and its residuals after the step (np.savez, one file per rank).

    python -m torch.distributed.run --standalone --nproc_per_node N ddp_train.py OUT THRESHOLD [view]

``view``: DDP's ``gradient_as_bucket_view=True`` (the gradients are the bucket's buffer).
"""

import os
import sys

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from horovod_twobit.torch import ddp as twobit_ddp

STEPS, NAN_STEP = 6, 3

out, threshold = sys.argv[1], sys.argv[2]
threshold = threshold if threshold == "auto" else float(threshold)
torch.set_num_threads(1)
dist.init_process_group("gloo")
rank, size = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
widths = [12, 40, 33, 17, 29, 8, 21, 16, 9, 30, 5, 6]
net = torch.nn.Sequential(*[torch.nn.Linear(a, b) for a, b in zip(widths, widths[1:])])
rec, calls = {}, []


def recording_hook(state, bucket):
    names = [state.names[id(p)] for p in bucket.parameters()]
    local = bucket.buffer().detach().clone()
    step = len(calls)

    def keep(fut):
        result = fut.value()
        calls.append((step, names, local, result.detach().clone(),
                      [p.numel() for p in bucket.parameters()]))
        return result
    return twobit_ddp.twobit_hook(state, bucket).then(keep)


view = sys.argv[3:] == ["view"]
model = DDP(net, bucket_cap_mb=0.004, gradient_as_bucket_view=view)  # about 4 KB: several buckets
state = twobit_ddp.register(model, twobit_ddp.TwoBitState(threshold), hook=recording_hook)
opt = torch.optim.SGD(model.parameters(), lr=0.05)
faulty = net[2].bias
for step in range(STEPS):
    calls.clear()
    rng = np.random.default_rng(100 * rank + step)
    x = torch.from_numpy(rng.standard_normal((8, widths[0])).astype(np.float32))
    y = torch.from_numpy(rng.standard_normal((8, widths[-1])).astype(np.float32))
    handle = None
    if step == NAN_STEP and rank == size - 1:
        handle = faulty.register_hook(lambda g: g.index_put((torch.tensor([1]),),
                                                            torch.tensor(float("nan"))))
    opt.zero_grad()
    (((model(x) - y) ** 2).mean() * 4.0).backward()
    if handle is not None:
        handle.remove()
    for i, (_, names, local, result, numels) in enumerate(calls):
        rec["names/%d/%d" % (step, i)] = np.array(names)
        offs = np.cumsum([0] + numels)
        for n, a, b in zip(names, offs, offs[1:]):
            rec["local/%d/%s" % (step, n)] = local[a:b].numpy()
            rec["agg/%d/%s" % (step, n)] = result[a:b].numpy()
    for k, r in state.state_dict()["residuals"].items():
        rec["res/%d/%s" % (step, k)] = np.asarray(r).reshape(-1).copy()
    rec["buckets/%d" % step] = np.int64(len(calls))
    if all(bool(torch.isfinite(p.grad).all()) for p in model.parameters()):
        opt.step()
st = state.stats()
rec["stats_nan_steps"] = np.int64(st.get("nonfinite_steps", -1))
rec["stats_bytes"] = np.int64(sum(st["bytes_last_step"].values()))
for n, p in net.named_parameters():
    rec["w/" + n] = p.detach().numpy().copy()
np.savez(os.path.join(out, "rank%d.npz" % rank), **rec)
dist.destroy_process_group()
