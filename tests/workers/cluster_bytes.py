"""Bytes on the wire per step: trains a large linear model with hvd.DistributedOptimizer, once per
compression in --compression (twobit, scatter, scatter_auto, none, fp16), and reads this host's interface counters
(/proc/net/dev of the host's namespace) around the measured steps. Each rank writes rank%d.json to
--out: {compression: {"tx", "rx", "steps", "seconds", "numels"}, "idle": {...}}."""

import argparse
import json
import os
import time

import numpy as np
import torch

import horovod.torch as hvd
from horovod_twobit.cluster import iface_bytes
from horovod_twobit.torch import TwoBitCompressor

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--compression", default="twobit,none")
p.add_argument("--features", type=int, default=2048)
p.add_argument("--steps", type=int, default=5)
p.add_argument("--warmup", type=int, default=2)
p.add_argument("--threshold", type=float, default=0.01)
p.add_argument("--idle", type=float, default=1.0)
p.add_argument("--iface", default="hvd0")
args = p.parse_args()

torch.set_num_threads(1)
hvd.init()
rank, size = hvd.rank(), hvd.size()
f = args.features


def barrier():
    hvd.allreduce(torch.zeros(1), name="barrier", op=hvd.Sum)


result = {"rank": rank, "size": size}
for comp in args.compression.split(","):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(f, f), torch.nn.Tanh(), torch.nn.Linear(f, 16))
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    compression = {"twobit": lambda: TwoBitCompressor(args.threshold),
                   "scatter": lambda: TwoBitCompressor(args.threshold, exchange="scatter"),
                   "scatter_auto": lambda: TwoBitCompressor("auto", exchange="scatter"),
                   "none": lambda: hvd.Compression.none, "fp16": lambda: hvd.Compression.fp16}[comp]()
    named = [(comp + "." + n, prm) for n, prm in model.named_parameters()]
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                   named_parameters=named, compression=compression)
    rng = np.random.default_rng(rank)
    x = torch.from_numpy(rng.standard_normal((8, f)).astype(np.float32))
    y = torch.from_numpy(rng.standard_normal((8, 16)).astype(np.float32))

    def step():
        opt.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        opt.step()

    for _ in range(args.warmup):
        step()
    barrier()
    rx0, tx0 = iface_bytes(args.iface)
    t0 = time.time()
    for _ in range(args.steps):
        step()
    barrier()  # every rank has received all of this rank's data once the barrier returns
    rx1, tx1 = iface_bytes(args.iface)
    result[comp] = {"tx": tx1 - tx0, "rx": rx1 - rx0, "steps": args.steps,
                    "seconds": time.time() - t0, "numels": [q.numel() for q in model.parameters()]}
    print("rank %d %s: %d bytes sent in %d steps" % (rank, comp, tx1 - tx0, args.steps))

# Horovod's background loop coordinates the ranks every cycle, even when idle: control bytes/s.
barrier()
rx0, tx0 = iface_bytes(args.iface)
t0 = time.time()
time.sleep(args.idle)
rx1, tx1 = iface_bytes(args.iface)
result["idle"] = {"tx": tx1 - tx0, "seconds": time.time() - t0}
barrier()
with open(os.path.join(args.out, "rank%d.json" % rank), "w") as fh:
    json.dump(result, fh)
