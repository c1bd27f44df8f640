"""Elastic training with TwoBitCompressor: a worker is added, then one removed.

argv: HOSTS_FILE LOG_DIR [scatter]. The hosts file is what the discovery script prints; rank 0
rewrites it at fixed steps. Every rank appends one JSON line per step to LOG_DIR/log.jsonl. With
``scatter``: threshold "auto" and the scatter exchange, whose owners' residuals restart from zero,
with a warning (logged), when the ranks change."""

import json
import os
import sys
import time
import warnings

import torch

import horovod.torch as hvd
from horovod_twobit.torch import TwoBitCompressor

hosts_file, log_dir = sys.argv[1], sys.argv[2]
SCATTER = sys.argv[3:] == ["scatter"]
STEPS = 40
hvd.init()
torch.manual_seed(0)
model = torch.nn.Linear(16, 4)
compressor = TwoBitCompressor("auto", exchange="scatter") if SCATTER else TwoBitCompressor(0.05)
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                               named_parameters=model.named_parameters(), compression=compressor)


def owners():
    return {k: float(v.abs().sum()) for k, v in compressor.owners.state_dict().items()}


def on_warning(message, *a, **kw):
    log(event="warning", rank=hvd.rank(), size=hvd.size(), text=str(message))


warnings.showwarning = on_warning
warnings.simplefilter("always")


def log(**kw):
    with open(os.path.join(log_dir, "log.jsonl"), "a") as f:
        f.write(json.dumps(kw) + "\n")


@hvd.elastic.run
def train(state):
    synced_norm = sum(float(v.abs().sum()) for v in compressor.residuals.state_dict().values())
    log(event="sync", rank=hvd.rank(), size=hvd.size(), step=state.step, residual_norm=synced_norm)
    while state.step < STEPS:
        g = torch.Generator().manual_seed(1000 * hvd.rank() + state.step)
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
        opt.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        opt.step()
        w = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        ws = hvd.allgather(w.unsqueeze(0), name="weights_check")
        log(event="step", rank=hvd.rank(), size=hvd.size(), step=state.step,
            same=bool((ws == ws[0]).all()),
            residual_norm=sum(float(v.abs().sum()) for v in compressor.residuals.state_dict().values()),
            owners=owners(), owner_of=compressor._owner_of)
        state.step += 1
        if hvd.rank() == 0 and state.step == 10:
            open(hosts_file, "w").write("localhost:3\n")
        if hvd.rank() == 0 and state.step == 25:
            open(hosts_file, "w").write("localhost:2\n")
        time.sleep(0.3)
        state.commit()


state = hvd.elastic.TorchState(model, opt, twobit=compressor, step=0)
train(state)
log(event="done", rank=hvd.rank(), size=hvd.size())
