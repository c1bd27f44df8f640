"""What Horovod's background thread costs a host while it waits, and whether no compression's
step changes when its gradients go as one allreduce after backward.

    python -m horovod_twobit.cluster run --iface hvdtest --hosts 4 --rate 1gbit \\
        --cpus-per-host 0.4 --dilation 2.5 --cpu-period-us 10000 -- \\
        env PYTHONPATH=$PWD OMP_NUM_THREADS=1 \\
        .venv/bin/python examples/probe_cycles.py --model cnn --out build/emu/cycles-4h.json
    horovodrun -np 2 -H localhost:2 --gloo python examples/probe_cycles.py   # 2 local ranks

First every rank sleeps (``--idle-s`` real-host seconds, a barrier before) while Horovod runs:
its background thread wakes every cycle (``HOROVOD_CYCLE_TIME``) and synchronises its response
cache with every rank (``CoordinateCacheAndState``: bitwise allreduces), tensors or not. The
process's CPU seconds over that time are what a host spends on it per second (``idle_cpu``, per
rank). Then bench_cluster's model (``--model``) trains with three ``DistributedOptimizer`` s
taking turns step by step, each step after a barrier: no compression as bench_cluster runs it
("none"), no compression with every gradient in one group (``groups=1``: one allreduce after
backward, "none_one_group"), and TwoBit's allgather ("twobit"). Per method, the median over the
steps of the slowest rank's step and backward, and each rank's CPU per step, in real-host
seconds (wall / D on a dilated cluster). Rank 0 prints them and writes every rank's to ``--out``.

What bounds it: the ranks share the machine's cores (on a virtual cluster, each at its quota);
the waits sleep as bench_cluster's do. The idle figure is the background thread's and Gloo's
threads' CPU with nothing to send; a step's own cycles are inside its CPU.
"""

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

METHODS = ("none", "none_one_group", "twobit")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="cnn", help="bench_cluster's model (default cnn)")
    ap.add_argument("--steps", type=int, default=30, help="timed steps per method (default 30)")
    ap.add_argument("--warmup", type=int, default=5, help="untimed steps first (default 5)")
    ap.add_argument("--idle-s", type=float, default=2.0,
                    help="real-host seconds every rank sleeps while Horovod cycles (default 2)")
    ap.add_argument("--out", default=None, help="JSON of every rank's figures (rank 0 writes it)")
    args = ap.parse_args(argv)
    import torch
    import horovod.torch as hvd
    from examples import _cluster_worker as worker
    wargs, runs, rank, size, barrier, d = worker.probe_setup(args.model, ["none", "twobit"])
    net, batch = worker.build(args.model, wargs)
    net.load_state_dict(runs[0][1].state_dict())
    grouped = hvd.DistributedOptimizer(
        torch.optim.SGD(net.parameters(), lr=wargs.lr), compression=hvd.Compression.none,
        named_parameters=[("none_one_group." + n, p) for n, p in net.named_parameters()],
        groups=1)
    runs.insert(1, ("none_one_group", net, net, batch, grouped))

    barrier()
    c0, t0 = time.process_time(), time.perf_counter()
    time.sleep(args.idle_s * d)
    idle = (time.process_time() - c0) / ((time.perf_counter() - t0) / d)

    rec = {m: {"step_s": [], "backward_s": [], "cpu_s": [], "loss": []} for m in METHODS}
    for i in range(args.warmup + args.steps):
        k = i % len(runs)
        for method, _, model, batch, opt in runs[k:] + runs[:k]:
            x, y = batch(rank, i, wargs.batch)
            barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            opt.zero_grad()
            loss = ((model(x) - y) ** 2).mean()
            loss.backward()
            t1 = time.perf_counter()
            opt.step()
            t2, c2 = time.perf_counter(), time.process_time()
            if i >= args.warmup:
                r = rec[method]
                r["step_s"].append((t2 - t0) / d)
                r["backward_s"].append((t1 - t0) / d)
                r["cpu_s"].append(c2 - c0)
                r["loss"].append(float(loss.detach()))
    every = hvd.allgather_object({"rank": rank, "idle_cpu": idle, "methods": rec})
    if rank != 0:
        return 0
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"ranks": size, "model": args.model, "dilation": d, "every": every}, f)
    print("idle: CPU seconds per real-host second, per rank: %s" % ", ".join(
        "%.3f" % e["idle_cpu"] for e in every))
    for m in METHODS:
        slowest = lambda key: statistics.median(  # noqa: E731
            max(e["methods"][m][key][j] for e in every) for j in range(args.steps))
        print("%-15s step %.2f ms, backward %.2f ms (slowest rank, median); CPU per step %s ms" % (
            m, 1e3 * slowest("step_s"), 1e3 * slowest("backward_s"), ", ".join(
                "%.2f" % (1e3 * statistics.median(e["methods"][m]["cpu_s"])) for e in every)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
