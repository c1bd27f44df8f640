"""What the codec benchmarks share: sizes from the command line and timing in turns."""

import statistics
import time

import torch


def parse_size(s):
    s = s.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(s[-1], 1)
    return int(float(s[:-1] if s[-1] in "KMG" else s) * mult)


def time_round_robin(fns, device, min_time=0.5, max_rounds=200, min_rounds=5):
    """Median seconds of each function, timed in turns (one call of each per round), so that all
    see the same load on a shared machine: at least ``min_rounds`` rounds, more while
    ``min_time`` a function lasts."""
    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()
    for fn in fns:  # warm-up (and compilation)
        fn()
    sync()
    times = [[] for _ in fns]
    t_end = time.perf_counter() + min_time * len(fns)
    while len(times[0]) < min_rounds or (time.perf_counter() < t_end
                                         and len(times[0]) < max_rounds):
        for i, fn in enumerate(fns):
            t0 = time.perf_counter()
            fn()
            sync()
            times[i].append(time.perf_counter() - t0)
    return [statistics.median(t) for t in times]
