"""Where the framework's own CPU per step runs: on the training thread, or on Horovod's
background thread and Gloo's.

    python -m horovod_twobit.cluster run --iface hvdtest --hosts 4 --rate 1gbit \\
        --cpus-per-host 0.4 --dilation 2.5 --cpu-period-us 10000 -- \\
        env PYTHONPATH=$PWD OMP_NUM_THREADS=1 .venv/bin/python \\
        examples/probe_framework_threads.py --out build/emu/framework-threads-4h.json
    horovodrun -np 2 -H localhost:2 --gloo python examples/probe_framework_threads.py

The step-time model's framework cost (``framework_s`` of a virtual cluster's profile) comes from
``examples/_cluster_calibrate.framework_cpu``: the process's CPU seconds per
``DistributedOptimizer`` step on K tensors of 16 values, K = 1 and 64, less a plain optimizer
step's. This probe times the same steps (``framework_steps``: each after a barrier, medians over
``--steps`` x 2 after 3 untimed) and splits each: the process's CPU (all threads), the training
thread's alone (``time.thread_time``) and the wall time in real-host seconds (wall / D on a
dilated cluster).
The rest of the process's CPU ran on other threads while the training thread waited or
computed. Rank 0 prints the medians over the ranks (ms) and writes every rank's to ``--out``.

What bounds it: the ranks share the machine's cores (on a virtual cluster, each at its quota);
the waits sleep as bench_cluster's do; a thread's CPU clock counts what it ran, not when.
"""

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=20,
                    help="timed steps x 2 per kind and tensor count (default 20)")
    ap.add_argument("--out", default=None, help="JSON of every rank's medians (rank 0 writes it)")
    args = ap.parse_args(argv)
    import torch
    import horovod.torch as hvd
    from examples._cluster_calibrate import FRAMEWORK_KINDS, FRAMEWORK_TENSORS, framework_steps
    from examples._cluster_worker import dilation, sleeping_waits
    torch.set_num_threads(1)
    hvd.init()
    sleeping_waits()
    d = dilation()
    mine = {}
    for kind in FRAMEWORK_KINDS:
        mine[kind] = {}
        for k in FRAMEWORK_TENSORS:
            rec = framework_steps(kind, k, args.steps)
            cpu, thread, wall = (statistics.median(r[j] for r in rec) for j in range(3))
            mine[kind][k] = {"cpu_s": cpu, "thread_s": thread, "wall_s": wall / d}
    every = hvd.allgather_object({"rank": hvd.rank(), "steps": mine})
    if hvd.rank() == 0:
        print("per step, median over %d ranks (ms): process CPU / training thread / wall" % (
            len(every)))
        for kind in FRAMEWORK_KINDS:
            print("%-8s" % kind + "".join(
                "   %2d tensors %6.2f / %6.2f / %6.2f" % ((k,) + tuple(
                    1e3 * statistics.median(e["steps"][kind][k][f] for e in every)
                    for f in ("cpu_s", "thread_s", "wall_s"))) for k in FRAMEWORK_TENSORS))
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"ranks": len(every), "dilation": d, "every": every}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
