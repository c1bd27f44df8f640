"""How long Horovod's allgather takes against an allreduce that sends each host the same bytes,
by the size of each rank's part: does a large allgather move at the link's rate?

    python -m horovod_twobit.cluster run --iface hvdtest --hosts 2 --rate 100mbit \\
        --cpus-per-host 0.8 --dilation 1.25 --cpu-period-us 10000 -- \\
        env PYTHONPATH=$PWD OMP_NUM_THREADS=1 .venv/bin/python examples/probe_allgather.py \\
        --out build/emu/allgather-2h-100mbit.json
    horovodrun -np 2 -H localhost:2 --gloo python examples/probe_allgather.py   # 2 local ranks

TwoBit's allgather sends every rank's payload to every other, (N-1) parts per host; Horovod's
ring allreduce of B bytes sends 2 (N-1)/N B per host. For each part size S (``--sizes``, MB per
rank) the probe times, in turns and each after a barrier and a short idle (as a training step
starts), an allgather of S bytes per rank and an allreduce of N S / 2 bytes of float32: the
same bytes per host, so on links that run at their rate the two take about as long. Per size,
the median over ``--rounds`` (less the first) of the slowest rank's real-host seconds (wall / D
on a dilated cluster) and their ratio. Every rank checks what it gathered (each rank's part
holds its rank) and rank 0 prints the figures and writes every rank's to ``--out``.

What bounds it: the ranks share the machine's cores (on a virtual cluster, each at its quota)
and its links; Horovod's one background thread runs one collective at a time.
"""

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="1,2,3,4,6",
                    help="MB (10^6 bytes) each rank's part holds, comma-separated (default "
                         "%(default)s)")
    ap.add_argument("--rounds", type=int, default=8, help="timed rounds per size (default 8)")
    ap.add_argument("--idle-s", type=float, default=0.05,
                    help="real-host seconds every rank idles before each collective "
                         "(default %(default)s)")
    ap.add_argument("--out", default=None, help="JSON of every rank's times (rank 0 writes it)")
    args = ap.parse_args(argv)
    import torch
    import horovod.torch as hvd
    from examples._cluster_worker import dilation
    hvd.init()
    d = dilation()
    rank, n = hvd.rank(), hvd.size()
    sizes = [int(float(s) * 1e6) // 4 * 4 for s in args.sizes.split(",")]
    times = {s: {"allgather": [], "allreduce": []} for s in sizes}

    def timed(fn):
        hvd.allreduce(torch.zeros(1), name="probe.barrier", op=hvd.Sum)
        time.sleep(args.idle_s * d)
        t0 = time.perf_counter()
        out = fn()
        return (time.perf_counter() - t0) / d, out

    for s in sizes:
        part = torch.full((s,), rank, dtype=torch.uint8)
        values = torch.ones(n * s // 8)  # float32: n s / 2 bytes
        for _ in range(args.rounds + 1):
            t, got = timed(lambda: hvd.allgather(part, name="probe.allgather.%d" % s))
            if not torch.equal(got, torch.arange(n, dtype=torch.uint8).repeat_interleave(s)):
                raise SystemExit("allgather of %d bytes per rank returned wrong parts" % s)
            times[s]["allgather"].append(t)
            t, _ = timed(lambda: hvd.allreduce(values, name="probe.allreduce.%d" % s,
                                               op=hvd.Sum))
            times[s]["allreduce"].append(t)
    every = hvd.allgather_object({"rank": rank, "times": {str(s): v for s, v in times.items()}})
    if rank != 0:
        return 0
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"ranks": n, "dilation": d, "sizes": sizes, "every": every}, f)
    for s in sizes:
        slowest = {k: statistics.median(max(e["times"][str(s)][k][j] for e in every)
                                        for j in range(1, args.rounds + 1))
                   for k in ("allgather", "allreduce")}
        print("%.2f MB per rank: allgather %.1f ms, allreduce of the same bytes per host %.1f ms "
              "(slowest rank, median): %.2fx" % (
                  s / 1e6, 1e3 * slowest["allgather"], 1e3 * slowest["allreduce"],
                  slowest["allgather"] / slowest["allreduce"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
