"""The calibrating side of ``examples/bench_cluster.py --calibrate``: what every host of the
virtual cluster measures of itself for the step-time model (its codec in real-host seconds, the
framework's CPU per step and per tensor, the slowest host's lead, a one-value allreduce);
``horovod_twobit.advisor.cluster_profile.from_cluster`` merges the hosts' files into one profile."""

import json
import os
import statistics
import time

from examples._cluster_worker import dilation, progress, sleeping_waits


def calibrate_worker(args):
    """Every host at once measures its codec rates and per-value costs in real-host seconds (wall
    seconds / D, :func:`horovod_twobit.advisor.calibrate.calibrate` with ``clock="wall"``), so that the
    step-time model is given the emulated host rather than an unthrottled core; then the
    framework's CPU per step and per tensor (:func:`framework_cpu`), the slowest host's lead
    (:func:`straggler_s`) and, all hosts idle again, the seconds of a one-value allreduce among
    them (waited for as the benchmark's steps wait, with short sleeps; the median of
    ``args.steps`` x 10). Writes ``<out>/rank<r>.json``: the profile, ``framework_cpu``,
    ``straggler_s``, ``half_sum`` (:func:`half_sum_s`), ``allreduce1_s`` and
    ``allreduce1_loaded_s`` (:func:`loaded_allreduce_s`)."""
    import torch
    import horovod.torch as hvd
    from horovod_twobit.advisor import calibrate
    torch.set_num_threads(args.threads)
    hvd.init()
    rank = hvd.rank()
    d = dilation()
    hvd.allreduce(torch.zeros(1), name="calibrate.start", op=hvd.Sum)
    progress(rank, "codec rates on every host (wall seconds / %g)" % d)
    prof = calibrate.calibrate(sizes=[int(s) for s in args.calibrate_sizes.split(",")],
                               ranks=(2, 4, 8), threads=args.threads, reps=3,
                               name="cluster", clock="wall", dilation=d,
                               min_wall_s=args.calibrate_min_wall)
    hvd.allreduce(torch.zeros(1), name="calibrate.codec_done", op=hvd.Sum)
    progress(rank, "the framework's CPU per step and per tensor")
    sleeping_waits()  # the benchmark's waits
    framework = framework_cpu(args.steps)
    progress(rank, "the slowest host's lead on a burst of CPU work")
    straggler = straggler_s(d, 10 * args.steps)
    progress(rank, "Gloo's float16 sum against float32's (same bytes)")
    half_sum = half_sum_s(d, max(3, args.steps))
    progress(rank, "one-value allreduces")
    idle = one_value_allreduce_s(d, 10 * args.steps + 3, "calibrate.one")
    progress(rank, "one-value allreduces while every host computes")
    loaded = loaded_allreduce_s(d, 10 * args.steps + 3)
    res = {"rank": rank, "size": hvd.size(), "profile": prof, "framework_cpu": framework,
           "straggler_s": straggler, "half_sum": half_sum,
           "allreduce1_s": idle, "allreduce1_loaded_s": loaded}
    with open(os.path.join(args.out, "rank%d.json" % rank), "w") as f:
        json.dump(res, f)
    return 0


FRAMEWORK_KINDS = ("plain", "none", "fp16", "twobit", "scatter")
FRAMEWORK_TENSORS = (1, 64)


def framework_steps(kind, k, steps):
    """``[(process CPU, training thread CPU, wall)]`` seconds of ``steps`` x 2 steps, after 3
    untimed ones, each after a barrier, of a ``DistributedOptimizer`` on ``k`` tensors of 16
    values: ``kind`` "none" (no compression), "fp16" (``hvd.Compression.fp16``: a cast each way
    per tensor), "twobit" and "scatter" (TwoBit's two exchanges), or "plain" (the optimizer
    alone). The process's CPU counts all its threads (what a 1-core host spends); the
    training thread's (``time.thread_time``) is read around it, the wall clock outermost."""
    import torch
    import horovod.torch as hvd
    from horovod_twobit.torch import TwoBitCompressor
    params = [torch.nn.Parameter(torch.zeros(16)) for _ in range(k)]
    opt = torch.optim.SGD(params, lr=0.0)
    if kind != "plain":
        comp = {"none": hvd.Compression.none, "fp16": hvd.Compression.fp16}.get(kind)
        if comp is None:
            comp = TwoBitCompressor(0.5, exchange="allgather" if kind == "twobit" else "scatter")
        opt = hvd.DistributedOptimizer(
            opt, named_parameters=[("fw.%s.%d.%d" % (kind, k, i), p)
                                   for i, p in enumerate(params)], compression=comp)
    x = torch.ones(16)
    rec = []
    for i in range(2 * steps + 3):
        hvd.allreduce(torch.zeros(1), name="fw.barrier", op=hvd.Sum)
        w0, t0, c0 = time.perf_counter(), time.thread_time(), time.process_time()
        opt.zero_grad()
        sum((p * x).sum() for p in params).backward()
        opt.step()
        c1, t1, w1 = time.process_time(), time.thread_time(), time.perf_counter()
        rec.append((c1 - c0, t1 - t0, w1 - w0))
    return rec[3:]


def framework_cpu(steps):
    """CPU seconds per step (this process, all threads: what a 1-core host spends) of
    :func:`framework_steps` of every kind in :data:`FRAMEWORK_KINDS` on K tensors, K in
    :data:`FRAMEWORK_TENSORS`: the framework's own work per step and per tensor (hooks,
    enqueueing, negotiation, synchronize, the compressor's buckets) against the plain step's,
    which :func:`horovod_twobit.advisor.cluster_profile.framework_costs` separates from what the model
    charges already. {kind: {K: seconds}}; each a median over ``steps`` x 2 steps."""
    return {kind: {k: statistics.median(c for c, _, _ in framework_steps(kind, k, steps))
                   for k in FRAMEWORK_TENSORS} for kind in FRAMEWORK_KINDS}


def straggler_s(dilation, rounds, burst_s=0.01):
    """How far the slowest host lags the median host on the same CPU work started together: every
    host, after a barrier, runs a fixed burst of about ``burst_s`` real-host seconds (calibrated
    on this host first); the hosts' real-host times are allgathered and each round gives the
    slowest's lead over the median. The median over ``rounds``, in real-host seconds: what a
    synchronous step pays for its slowest host (the quota's periods, the shared cores)."""
    import torch
    import horovod.torch as hvd
    a = torch.randn(64, 64)

    def work(n):
        for _ in range(n):
            torch.mm(a, a)
    t0 = time.perf_counter()
    work(200)
    per = max((time.perf_counter() - t0) / dilation / 200, 1e-7)
    n = int(hvd.allreduce(torch.tensor([burst_s / per]), name="straggler.n", op=hvd.Average)[0])
    leads = []
    for i in range(rounds):
        hvd.allreduce(torch.zeros(1), name="straggler.barrier", op=hvd.Sum)
        t0 = time.perf_counter()
        work(max(n, 1))
        t = (time.perf_counter() - t0) / dilation
        ts = hvd.allgather(torch.tensor([t], dtype=torch.float64), name="straggler.t").tolist()
        leads.append(max(ts) - statistics.median(ts))
    return statistics.median(leads)


def loaded_allreduce_s(dilation, rounds):
    """The median real-host seconds of a one-value allreduce among the hosts while each host's
    CPU is busy with other work, as during a backward pass: a busy loop in a child process (in
    the host's cgroup, so under its quota; a process, not a thread, so that it holds no GIL the
    waits need) runs for as long as the allreduces take. On a host with one core, Horovod's
    background thread then waits for the core at its messages; the model charges this fixed cost
    (``collective_loaded_s``) to the collectives that start before the backward pass ends. The
    first 3 of ``rounds`` are not counted."""
    import subprocess
    busy = subprocess.Popen(["sh", "-c", "while :; do :; done"])
    try:
        return one_value_allreduce_s(dilation, rounds, "calibrate.loaded")
    finally:
        busy.kill()
        busy.wait()


def one_value_allreduce_s(dilation, rounds, name):
    """The median real-host seconds of ``rounds`` one-value allreduces among the hosts, the
    first 3 not counted."""
    import torch
    one = torch.zeros(1)
    times = [timed_allreduce(one, name, dilation)[0] for _ in range(rounds)]
    return statistics.median(times[3:])


HALF_SUM_VALUES = 1 << 21


def half_sum_s(dilation, rounds, n=HALF_SUM_VALUES):
    """An allreduce (sum) of ``n`` float16 values and one of n / 2 float32 values, the same bytes
    on the wire, taking turns ``rounds`` times after one untimed pair: {"values": n, "fp16_s",
    "fp32_s": median real-host seconds, "fp16_cpu_s", "fp32_cpu_s": median CPU seconds of this
    process, all its threads}. The CPU difference is what Horovod's float16 sum (a software
    conversion per value) costs beyond float32's, which
    ``horovod_twobit.advisor.cluster_profile.from_cluster`` turns into the profile's ``sum_fp16_s``; the
    wall difference is smaller where the ring's sums overlap its transfers."""
    import torch
    import horovod.torch as hvd
    half = torch.ones(n, dtype=torch.float16)
    single = torch.ones(n // 2, dtype=torch.float32)
    times = {k: [] for k in ("fp16_s", "fp32_s", "fp16_cpu_s", "fp32_cpu_s")}
    for i in range(rounds + 1):
        for key, t in (("fp16", half), ("fp32", single)):
            hvd.allreduce(torch.zeros(1), name="halfsum.barrier", op=hvd.Sum)
            wall, cpu = timed_allreduce(t, "halfsum." + key, dilation)
            if i:
                times[key + "_s"].append(wall)
                times[key + "_cpu_s"].append(cpu)
    return dict({k: statistics.median(v) for k, v in times.items()}, values=n)


def timed_allreduce(t, name, dilation):
    """(real-host seconds, CPU seconds of this process) of one allreduce (sum) of ``t`` among
    the hosts, waited for as the benchmark's steps wait (``sleeping_waits``' synchronize)."""
    import horovod.torch as hvd
    import horovod.torch.optimizer as hvd_optimizer
    t0, c0 = time.perf_counter(), time.process_time()
    hvd_optimizer.synchronize(hvd.allreduce_async(t, name=name, op=hvd.Sum))
    return (time.perf_counter() - t0) / dilation, time.process_time() - c0
