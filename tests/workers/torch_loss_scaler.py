"""torch.amp.GradScaler with hvd.DistributedOptimizer, and one forced overflow: rank 1's scaled
gradient of the first layer's bias (12 values: its words end in padding) holds +Inf at step
OVERFLOW. One configuration after another (--configs: none, or a TwoBitCompressor threshold), each from the same weights; rank 0 saves, per
step, the mean loss over the ranks, the scale and whether the step was skipped, to
OUT/<index>.npz. Runs on CUDA with --device cuda."""

import argparse
import os

import numpy as np
import torch

import horovod.torch as hvd
from horovod_twobit.torch import TwoBitCompressor

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--configs", nargs="+", required=True)
p.add_argument("--steps", type=int, default=40)
p.add_argument("--overflow", type=int, default=10)
p.add_argument("--device", default="cpu")
args = p.parse_args()

hvd.init()
rank = hvd.rank()
torch.set_num_threads(1)
dev = torch.device(args.device)
rng = np.random.default_rng(100 + rank)
teacher = np.random.default_rng(5).standard_normal((10, 4)).astype(np.float32)
X = rng.standard_normal((64, 10)).astype(np.float32)
x, y = torch.from_numpy(X).to(dev), torch.from_numpy(np.tanh(X @ teacher)).to(dev)

for ci, spec in enumerate(args.configs):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(10, 12), torch.nn.Tanh(),
                                torch.nn.Linear(12, 4)).to(dev)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    compression = hvd.Compression.none if spec == "none" else TwoBitCompressor(
        spec if spec == "auto" else float(spec))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0),
                                   named_parameters=model.named_parameters(),
                                   compression=compression)
    scaler = torch.amp.GradScaler(args.device, init_scale=1024.0, growth_interval=5)
    step = 0

    def overflow(g):
        if step == args.overflow and rank == 1:
            g = g.clone()
            g[0] = float("inf")
        return g

    model[0].bias.register_hook(overflow)
    losses, scales, skipped = [], [], []
    for step in range(args.steps):
        opt.zero_grad()
        loss = ((model(x) - y) ** 2).mean()
        scaler.scale(loss).backward()
        opt.synchronize()
        scaler.unscale_(opt)
        scale = scaler.get_scale()
        with opt.skip_synchronize():
            scaler.step(opt)
        scaler.update()
        skipped.append(scaler.get_scale() < scale)
        scales.append(scale)
        losses.append(hvd.allreduce(loss.detach().cpu(), name="loss").item())
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        np.savez(os.path.join(args.out, "%d.npz" % ci), loss=np.array(losses),
                 scale=np.array(scales), skipped=np.array(skipped))
    print("rank %d %s: final loss %.5f, scale %g, %d skipped"
          % (rank, spec, losses[-1], scaler.get_scale(), sum(skipped)), flush=True)
