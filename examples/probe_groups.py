"""When each gradient's allreduce completes within a step, on every host of a virtual cluster:
how many collectives Horovod ran per step for no compression, and how far apart.

    python -m horovod_twobit.cluster run --iface hvdtest --hosts 4 --rate 1gbit \\
        --cpus-per-host 0.4 --dilation 2.5 --cpu-period-us 10000 -- \\
        env PYTHONPATH=$PWD OMP_NUM_THREADS=1 \\
        .venv/bin/python examples/probe_groups.py --model cnn --out build/emu/groups-4h.json

Each host trains bench_cluster's model (``--model``) with ``hvd.DistributedOptimizer`` and no
compression, a barrier before every step as bench_cluster's steps have. After backward the
training thread polls every handle (a sleep of 20 us x D between rounds) and records when each
is first seen done, in real-host seconds from the step's start. On each host, handles done
within ``--gap-ms`` of each other count as one collective (Horovod fuses the tensors that are
ready on every host at one cycle). Rank 0 writes every host's steps to ``--out`` and prints, per
step, the slowest host's backward end and the collectives' ends on the host that saw the last.

What bounds it: the polling is CPU on a host of a fraction of a core (about one wake-up per
50 us of wall time under dilation 2.5), so the steps it times are longer than bench_cluster's;
what it shows is the order and spacing of the collectives, not their exact times. A group seen
done after backward may have finished during it (nothing polls before backward ends).
"""

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def groups(done, gap_s):
    """[(end, count)]: completion times (sorted) cut where two are more than ``gap_s`` apart."""
    out = []
    for t in sorted(done):
        if out and t - out[-1][0] <= gap_s:
            out[-1] = (t, out[-1][1] + 1)
        else:
            out.append((t, 1))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="cnn", help="bench_cluster's model: mlp, cnn, resnet, "
                    "transformer (default cnn)")
    ap.add_argument("--steps", type=int, default=40, help="timed steps (default 40)")
    ap.add_argument("--warmup", type=int, default=5, help="untimed steps first (default 5)")
    ap.add_argument("--gap-ms", type=float, default=0.3,
                    help="handles done within this many real-host ms are one collective")
    ap.add_argument("--out", default=None, help="JSON of every host's steps (rank 0 writes it)")
    args = ap.parse_args(argv)
    import horovod.torch as hvd
    from examples import _cluster_worker as worker
    wargs, runs, rank, size, barrier, d = worker.probe_setup(args.model, ["none"])
    _, net, model, batch, opt = runs[0]
    names = {p: n for n, p in net.named_parameters()}
    steps = []
    for i in range(args.warmup + args.steps):
        x, y = batch(rank, i, wargs.batch)
        barrier()
        t0 = time.perf_counter()
        opt.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        t1 = time.perf_counter()
        handles = {p: h for p, (h, _) in opt._handles.items()}
        done = {}
        while len(done) < len(handles):
            now = time.perf_counter()
            for p, h in handles.items():
                if p not in done and hvd.poll(h):
                    done[p] = now
            time.sleep(20e-6 * d)
        opt.step()
        t2 = time.perf_counter()
        if i >= args.warmup:
            steps.append({"backward_s": (t1 - t0) / d, "step_s": (t2 - t0) / d,
                          "done_s": {names[p]: (t - t0) / d for p, t in done.items()}})
    every = hvd.allgather_object(steps)
    if rank != 0:
        return 0
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"hosts": size, "model": args.model, "dilation": d, "steps": every}, f)
    counts = []
    for i in range(args.steps):
        per_host = [groups(host[i]["done_s"].values(), args.gap_ms / 1e3) for host in every]
        counts.append(max(len(g) for g in per_host))
        last = max(per_host, key=lambda g: g[-1][0])
        print("step %2d: backward ends %.1f ms (slowest host); the last host's collectives end "
              "at %s ms" % (i, 1e3 * max(host[i]["backward_s"] for host in every),
                            ", ".join("%.1f (%d)" % (1e3 * t, n) for t, n in last)), flush=True)
    print("collectives per step (the most any host saw): %s" % (
        ", ".join("%d in %d steps" % (k, counts.count(k)) for k in sorted(set(counts)))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
