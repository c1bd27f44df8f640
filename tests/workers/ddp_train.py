"""A DDP job with the 2-bit hook (horovod_twobit.torch.ddp), started by torchrun: a model of 22
tensors (24 with ``unused``) in several DDP buckets, a few steps, one rank's gradient holding a
NaN at one step. Every rank records, per step and per bucket the hook saw, its members' names,
the local gradients and the results, and its residuals after the step (np.savez, one file per
rank).

    python -m torch.distributed.run --standalone --nproc_per_node N ddp_train.py OUT THRESHOLD [MODE,...]

Modes: ``view`` (gradient_as_bucket_view=True), ``static`` (static_graph=True), ``nosync`` (two
micro-batches a step, the first under ``model.no_sync()``), ``unused`` (a layer used on even steps
only, find_unused_parameters=True), ``scatter`` / ``xauto`` (exchange="scatter" / "auto"),
``min=N`` (min_numel=N), ``fault=inf`` / ``fault=-inf`` (the fault injected instead of a NaN),
``mismatch`` (the last rank uses another threshold: every rank must raise, none hang),
``cuda`` (the model and its gradients on the GPU, every rank on cuda:0, gloo moving CUDA tensors),
``fallback=checked`` (fallback="auto" with its check forced on, one round of each mode a block,
two blocks: steps sent plain and compressed, each bucket's decision recorded per step). The residuals the ranks keep
as scatter owners and the final stats are recorded too.
"""

import datetime
import json
import os
import sys

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from horovod_twobit.torch import ddp as twobit_ddp

STEPS, NAN_STEP = 6, 3

out, threshold = sys.argv[1], sys.argv[2]
modes = set(sys.argv[3].split(",")) if len(sys.argv) > 3 else set()
threshold = threshold if threshold == "auto" else float(threshold)
exchange = "scatter" if "scatter" in modes else "auto" if "xauto" in modes else "allgather"
options = dict(m.split("=") for m in modes if "=" in m)
min_numel, fault = int(options.get("min", 0)), float(options.get("fault", "nan"))
fallback_mode = options.get("fallback")
if fallback_mode == "checked":  # checked on every job, whatever the model's margin
    from horovod_twobit.state import fallback
    # one round a block (never sure: two blocks run)
    fallback.MARGIN, fallback.WARMUP, fallback.SAMPLES, fallback.BLOCKS = float("inf"), 0, 1, 2
    STEPS = fallback.start_steps() + 1  # the schedule, the step that decides and one after it
DEVICE = torch.device("cuda:0" if "cuda" in modes else "cpu")  # cuda: every rank on one GPU
torch.set_num_threads(1)
dist.init_process_group("gloo")
rank, size = dist.get_rank(), dist.get_world_size()
if "mismatch" in modes and rank == size - 1:
    threshold = 0.07
torch.manual_seed(0)
WIDTHS = [12, 40, 33, 17, 29, 8, 21, 16, 9, 30, 5, 6]


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.body = torch.nn.Sequential(*[torch.nn.Linear(a, b) for a, b in zip(WIDTHS, WIDTHS[1:])])
        self.extra = torch.nn.Linear(WIDTHS[-1], WIDTHS[-1]) if "unused" in modes else None

    def forward(self, x, step):
        y = self.body(x)
        if self.extra is not None and step % 2 == 0:
            y = y + self.extra(y)
        return y


net = Net().to(DEVICE)
rec, calls = {}, []


def recording_hook(state, bucket):
    names = [state.names[id(p)] for p in bucket.parameters()]
    numels = [p.numel() for p in bucket.parameters()]
    local = bucket.buffer().detach().clone()
    step = len(calls)

    def keep(fut):
        result = fut.value()
        calls.append((step, names, local, result.detach().clone(), numels))
        return result
    return twobit_ddp.twobit_hook(state, bucket).then(keep)


model = DDP(net, bucket_cap_mb=0.004,  # about 4 KB: several buckets
            gradient_as_bucket_view="view" in modes, static_graph="static" in modes,
            find_unused_parameters="unused" in modes)
state = twobit_ddp.register(model, twobit_ddp.TwoBitState(
    threshold, exchange=exchange, min_numel=min_numel,
    fallback="auto" if fallback_mode else None), hook=recording_hook)
opt = torch.optim.SGD(model.parameters(), lr=0.05)
faulty = net.body[2].bias


def batch(step, micro):
    rng = np.random.default_rng(1000 * rank + 10 * step + micro)
    x = torch.from_numpy(rng.standard_normal((8, WIDTHS[0])).astype(np.float32)).to(DEVICE)
    y = torch.from_numpy(rng.standard_normal((8, WIDTHS[-1])).astype(np.float32)).to(DEVICE)
    return x, y


try:
    for step in range(STEPS):
        calls.clear()
        handle = None
        if step == NAN_STEP and rank == size - 1:
            handle = faulty.register_hook(lambda g: g.index_put(
                (torch.tensor([1], device=g.device),), torch.tensor(fault, device=g.device)))
        opt.zero_grad()
        if "nosync" in modes:  # a first micro-batch accumulates without communication
            with model.no_sync():
                x, y = batch(step, 1)
                (((model(x, step) - y) ** 2).mean() * 4.0).backward()
            assert not calls, "the hook ran under no_sync()"
        x, y = batch(step, 0)
        loss = ((model(x, step) - y) ** 2).mean() * 4.0
        loss.backward()
        rec["loss/%d" % step] = np.float64(loss.item())
        if handle is not None:
            handle.remove()
        if fallback_mode:  # each bucket's mode at this step
            rec["decided/%d" % step] = np.array(json.dumps({k: d for (k, _), d in
                                                            state.decisions.items()}))
        for i, (_, names, local, result, numels) in enumerate(calls):
            rec["names/%d/%d" % (step, i)] = np.array(names)
            offs = np.cumsum([0] + numels)
            for n, a, b in zip(names, offs, offs[1:]):
                rec["local/%d/%s" % (step, n)] = local[a:b].cpu().numpy()
                rec["agg/%d/%s" % (step, n)] = result[a:b].cpu().numpy()
        saved = state.state_dict()
        for k, r in saved["residuals"].items():
            rec["res/%d/%s" % (step, k)] = np.asarray(r).reshape(-1).copy()
        for k, r in saved.get("owner_residuals", {}).items():
            rec["own/%d/%s" % (step, k)] = np.asarray(r).reshape(-1).copy()
        rec["buckets/%d" % step] = np.int64(len(calls))
        if all(p.grad is None or bool(torch.isfinite(p.grad).all()) for p in model.parameters()):
            opt.step()
except Exception as e:  # the mismatch mode: every rank must get here, with the same message
    msg = ("%s: %s" % (type(e).__name__, e)).replace("\n", " ")  # raised as is, or wrapped
    msg = msg[msg.find("PayloadMismatchError"):].split(" At:")[0][:400]  # the error DDP wrapped
    sys.stdout.flush()
    os.write(1, ("RAISED rank %d: %s\n" % (rank, msg)).encode())  # one write: whole lines
    try:  # every rank says it raised before any exits (torchrun ends the others at a first exit)
        dist.monitored_barrier(timeout=datetime.timedelta(seconds=60))
    except Exception:
        pass
    sys.exit(3)
st = state.stats()
rec["stats_nan_steps"] = np.int64(st["nonfinite_steps"])
rec["stats_bytes"] = np.int64(sum(st["bytes_last_step"].values()))
rec["stats"] = np.array(json.dumps(st))
rec["checks"] = np.array(json.dumps(st.get("fallback_checks")))
for n, p in net.named_parameters():
    rec["w/" + n] = p.detach().cpu().numpy().copy()
np.savez(os.path.join(out, "rank%d.npz" % rank), **rec)
twobit_ddp.shutdown()  # a barrier, then destroy_process_group
