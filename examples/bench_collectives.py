"""What one small collective costs among a virtual cluster's hosts, by kind and size: Horovod's
allreduce (sum) of 1, 2, N, 2N and 64 N values, its allgather of 1 and 64 values per rank and its
alltoall of 16 values per peer, one at a time on idle hosts, in real-host milliseconds (wall / D).

The step-time model's fixed cost per collective (``collective_s``, docs/where_it_pays.md) comes
from a one-value allreduce. Gloo's ring splits an allreduce's buffer into segments and sends only
those that hold values, so a one-value allreduce skips most of the ring's messages, which every
gradient's allreduce sends: this shows by how much, on the same hosts as bench_cluster's
(the same quota, dilation and links; ``--hosts 4`` gives Q = 0.4 cores, D = 2.5)::

    sudo .venv/bin/python examples/bench_collectives.py --hosts 4 --rate 1gbit

Every collective is waited for as bench_cluster's steps wait (short sleeps); each figure is the
median over the hosts of each host's median over ``--rounds`` (after 2 untimed ones), every
collective after a barrier and an idle 5 ms (real-host). Bounded by the hosts' software and
wake-ups, not by bytes: the largest, 64 N float32 values, is 2 KB (N = 8) on the wire.
"""

import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, REPO)


def cases(N):
    """{name: (kind, values per rank)}, in the order they are timed."""
    out = {"allreduce 1": ("allreduce", 1), "allreduce 2": ("allreduce", 2),
           "allreduce N": ("allreduce", N), "allreduce 2N": ("allreduce", 2 * N),
           "allreduce 64N": ("allreduce", 64 * N), "allgather 1": ("allgather", 1),
           "allgather 64": ("allgather", 64), "alltoall 16/peer": ("alltoall", 16 * N)}
    return out


def worker(rounds):
    import torch
    import horovod.torch as hvd
    import horovod.torch.optimizer as hvd_optimizer
    from examples._cluster_worker import dilation, sleeping_waits
    torch.set_num_threads(1)
    hvd.init()
    sleeping_waits()
    d = dilation()
    N = hvd.size()
    calls = {"allreduce": lambda t, n: hvd.allreduce_async(t, name=n, op=hvd.Sum),
             "allgather": lambda t, n: hvd.allgather_async(t, name=n),
             "alltoall": lambda t, n: hvd.alltoall_async(t, name=n)}
    times = {name: [] for name in cases(N)}
    for i in range(rounds + 2):
        for name, (kind, values) in cases(N).items():
            t = torch.ones(values)
            hvd.allreduce(torch.zeros(1), name="probe.barrier", op=hvd.Sum)
            time.sleep(0.005 * d)
            t0 = time.perf_counter()
            hvd_optimizer.synchronize(calls[kind](t, "probe." + name))
            if i >= 2:
                times[name].append((time.perf_counter() - t0) / d)
    mine = {name: statistics.median(v) for name, v in times.items()}
    every = hvd.allgather_object(mine)
    if hvd.rank() == 0:
        print("RESULT " + json.dumps({"hosts": N, "dilation": d, "ms": {
            name: 1e3 * statistics.median(r[name] for r in every) for name in mine}}), flush=True)
    return 0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hosts", type=int, default=4)
    ap.add_argument("--rate", default="1gbit")
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--cpus-per-host", type=float, default=None,
                    help="Q, as bench_cluster's (default: cores x --headroom / hosts)")
    ap.add_argument("--dilation", type=float, default=None,
                    help="D, as bench_cluster's (default 1 / Q)")
    ap.add_argument("--headroom", type=float, default=0.8,
                    help="the cores' share the hosts get, as bench_cluster's")
    ap.add_argument("--cpu-period-us", type=int, default=10000)
    ap.add_argument("--iface", default="hvd0")
    ap.add_argument("--subnet", default="10.77.0.0/24")
    ap.add_argument("--json-out", help="also write the figures to this JSON file")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return worker(args.rounds)
    from examples.bench_cluster import emulation
    from horovod_twobit.cluster import VirtualCluster
    q, d = emulation(args)  # bench_cluster's hosts
    with VirtualCluster(n_hosts=args.hosts, rate=args.rate, iface=args.iface,
                        subnet=args.subnet, cpus_per_host=q, dilation=d,
                        cpu_period_us=args.cpu_period_us) as c:
        print(c.describe(), flush=True)
        env = {"PYTHONPATH": REPO, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": c.iface}
        res = c.horovodrun(1, [sys.executable, os.path.abspath(__file__), "--worker",
                               "--rounds", args.rounds], timeout=600 * c.dilation, env=env)
    found = [ln[ln.index("RESULT ") + 7:] for ln in res.output.splitlines() if "RESULT " in ln]
    if res.returncode != 0 or not found:
        print(res.output[-3000:], file=sys.stderr)
        return 1
    got = json.loads(found[0])
    got["rate"] = args.rate
    print("\n%d hosts at %s (Q = %s, D = %.2f), real-host ms, median of %d:" % (
        args.hosts, args.rate, "none" if q is None else "%.2f" % q, d, args.rounds))
    for name, ms in got["ms"].items():
        print("  %-18s %6.2f" % (name, ms))
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(got, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
