"""The fallback (TwoBitCompressor(..., fallback=...)) in a real job. hvd.DistributedOptimizer
with buckets (bucket_bytes=2048: a bucket of three tensors and a tensor alone), a NaN in the last
rank's 0.bias gradient at step 2. Per configuration (--configs THRESHOLD:EXCHANGE:MODE):
MODE "always" sends every bucket uncompressed; "switch" sets the decisions by hand, step by step
(compressed, compressed, plain, plain, compressed, plain): both paths and the switches between
them; "auto" measures the link and decides; "handback" is "always" with residuals that are not
zero loaded at step HANDBACK, after the buckets went to Horovod's own allreduce. Saves local and
aggregated gradients, residuals after each step, the decisions, the stats' exchanges and the final
weights to OUT/<index>/rank<r>.npz."""

import json
import logging

import numpy as np
import torch

import horovod.torch as hvd
from horovod_twobit.torch import TwoBitCompressor
from configs import HANDBACK, SWITCH, checked_schedule, parse_args, run_each

args = parse_args()
hvd.init()

# Every collective the exchanges submit, by Horovod's name: the collectives, shapes and dtypes it
# was given. Horovod's response cache keys on the name alone and renegotiates whenever a cached
# name comes with another shape or collective, so one name must keep one of each.
import horovod.torch.mpi_ops as mpi_ops  # noqa: E402
from horovod_twobit.torch.exchange import horovod_ops  # noqa: E402

collectives = {}


def recording(op, fn):
    def call(tensor, *a, **kw):
        got = collectives.setdefault(kw.get("name"), [])
        sig = [op, list(tensor.shape), str(tensor.dtype)]
        if sig not in got:
            got.append(sig)
        return fn(tensor, *a, **kw)
    return call


horovod_ops.originals["allreduce_async_"] = recording("allreduce",
                                                      horovod_ops.own("allreduce_async_"))
for _op in ("allgather_async", "alltoall_async"):
    setattr(mpi_ops, _op, recording(_op.split("_")[0], getattr(mpi_ops, _op)))
rank = hvd.rank()
torch.set_num_threads(1)
logging.basicConfig(level=logging.INFO, format="rank %d %%(message)s" % rank)


def run(spec):
    threshold, exchange, mode = spec.split(":")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(12, 40), torch.nn.Tanh(), torch.nn.Linear(40, 6))
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    c = TwoBitCompressor(threshold if threshold == "auto" else float(threshold),
                         bucket_bytes=2048, exchange=exchange,
                         fallback="always" if mode in ("always", "handback") else "auto")
    steps = checked_schedule(mode)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), compression=c)
    if mode == "switch":
        c.state.check_fallback = False  # the decisions set by hand below hold as they are
    names = [n for n, _ in model.named_parameters()]
    local, step = {}, 0

    def hook(g, n):
        if n == "0.bias" and step == 2 and rank == hvd.size() - 1:
            g = g.clone()
            g[5] = float("nan")
        local[n] = g.clone()
        return g

    for n, prm in model.named_parameters():
        prm.register_hook(lambda g, n=n: hook(g, n))
    groups = [["2.bias", "2.weight", "0.bias"], ["0.weight"]]
    keys = ["2.bias (+2)", "0.weight"]
    rec = {}
    for step in range(steps):
        if mode == "switch":
            for k in keys:
                c.decisions[(k, hvd.size())] = SWITCH[step]
        rng = np.random.default_rng(1000 * rank + step)
        x = torch.from_numpy(rng.standard_normal((16, 12)).astype(np.float32))
        y = torch.from_numpy(rng.standard_normal((16, 6)).astype(np.float32))
        if mode == "handback" and step == HANDBACK:
            # residuals that are not zero, while the buckets are settled plain: the step must
            # leave Horovod's direct path and send g + r again
            saved = c.state_dict()
            saved["residuals"] = {n: torch.full_like(r, 0.01 * (rank + 1))
                                  for n, r in saved["residuals"].items()}
            c.load_state_dict(saved)
        # whether this step goes to Horovod's own allreduce as a check's plain step
        rec["handed/%d" % step] = np.bool_(opt._compression.checked == c.state.residuals.generation)
        opt.zero_grad()
        ((model(x) - y) ** 2).mean().mul(3.0).backward()
        opt.synchronize()
        for n, prm in model.named_parameters():
            rec["local/%d/%s" % (step, n)] = local[n].numpy().copy()
            rec["agg/%d/%s" % (step, n)] = prm.grad.numpy().copy()
        for k, r in c.state_dict()["residuals"].items():
            rec["res/%d/%s" % (step, k)] = np.asarray(r).reshape(-1).copy()
        rec["decisions/%d" % step] = np.array([c.decisions[(k, hvd.size())] for k in keys])
        # whether the optimizer hands its gradients to Horovod's own allreduce from now on
        rec["direct/%d" % step] = np.bool_(opt._compression.direct == c.state.residuals.generation)
        st = c.stats()
        rec["exchanges/%d" % step] = np.array([st["buckets"][k]["exchange"] for k in keys])
        rec["plain_bytes/%d" % step] = np.int64(st["bytes_last_step"].get("plain", 0))
        with opt.skip_synchronize():
            if all(bool(torch.isfinite(prm.grad).all()) for prm in model.parameters()):
                opt.step()
    for n, prm in model.named_parameters():
        rec["w/" + n] = prm.detach().numpy().copy()
    rec["groups"] = np.array([",".join(g) for g in groups])
    rec["link"] = np.array(json.dumps([repr(v) for v in c._links.values()]))
    rec["link_allgather"] = np.array([v.allgather for v in c._links.values()], dtype=np.float64)
    rec["repr"] = np.array(repr(c))
    rec["checks"] = np.array(json.dumps(c.stats().get("fallback_checks")))
    rec["collectives"] = np.array(json.dumps({k: v for k, v in collectives.items()
                                              if not k.startswith("twobit.")}))
    rec["names"] = np.array(names)
    collectives.clear()
    return rec


run_each(args.out, args.configs, run, rank)
print("rank %d done" % rank, flush=True)
