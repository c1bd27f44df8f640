"""The step-time model's profile of a virtual cluster's hosts, from measurements taken on the
hosts themselves (``examples/bench_cluster.py --calibrate``, whose
``examples/_cluster_calibrate.py`` runs :func:`horovod_twobit.advisor.calibrate.calibrate` with
``clock="wall"`` on every host at once, a one-value allreduce among them and
``DistributedOptimizer`` steps on tiny tensors): :func:`from_cluster` merges them into one
profile with the fixed cost per collective (``collective_s``) and the framework's own CPU work
(``framework_s``, :func:`framework_costs`)."""

from horovod_twobit.advisor.calibrate import refit


def from_cluster(host_profiles, allreduce1_s, nranks, cycle_s=1e-3, name="cluster",
                 framework_cpu=None, rate="1gbit", straggler_s=None, half_sum=None,
                 allreduce1_loaded_s=None):
    """One profile for the hosts of a virtual cluster, from each host's
    :func:`~horovod_twobit.advisor.calibrate.calibrate` with ``clock="wall"`` (run on every host at
    once): per codec point (one tensor, and the buckets of members and of tables and the tensor
    in segments where every host timed them),
    per-value cost and message cost, the median over hosts, refitted;
    ``collective_s``, the fixed cost per collective, from ``allreduce1_s``, the seconds of a
    one-value allreduce among the ``nranks`` hosts (real-host seconds), less what the model
    charges such an allreduce besides it: half of Horovod's ``cycle_s`` and its messages
    (negotiation, 2 ceil(log2 N), and ring, 2 (N - 1)), each ``message_s`` (the emulation adds
    no link delay); and, given ``framework_cpu`` (each host's
    ``examples._cluster_calibrate.framework_cpu``), ``framework_s`` (:func:`framework_costs`);
    ``straggler_s``, the slowest host's lead over the median host on a burst of CPU work started
    together (``examples._cluster_calibrate.straggler_s``), as measured; given ``half_sum`` (each
    host's ``examples._cluster_calibrate.half_sum_s``), ``sum_fp16_s`` from Horovod's own float16
    sum (:func:`half_sum_cost`) in place of the NumPy proxy, which stays as
    ``sum_fp16_proxy_s``; given ``allreduce1_loaded_s``, the same one-value allreduce while every
    host's CPU is busy (``examples._cluster_calibrate.loaded_allreduce_s``),
    ``collective_loaded_s`` likewise: the fixed cost of a collective that runs during the
    backward pass."""
    import math
    import statistics
    profs = list(host_profiles)
    if not profs:
        raise ValueError("from_cluster needs at least one host's profile")
    keys = profs[0]["points"]
    points = {}
    for k in keys:
        at = {}
        for p in profs:
            for n, N, secs in p["points"][k]:
                at.setdefault((int(n), int(N)), []).append(secs)
        points[k] = [(n, N, statistics.median(v)) for (n, N), v in sorted(at.items())]
    # the buckets of members and of tables, the tensor in segments: per N, the hosts' median
    # of each timing (rows (N, seconds) or (N, more, fewer))
    timed = {entry: dict(profs[0][entry], points={k: [
        (row[0],) + tuple(statistics.median(r[j] for p in profs
                                            for r in p[entry]["points"][k] if r[0] == row[0])
                          for j in range(1, len(row)))
        for row in v] for k, v in profs[0][entry]["points"].items()})
        for entry in ("member_points", "table_points", "segment_points")
        if all(p.get(entry) for p in profs)}
    prof = {k: v for k, v in profs[0].items()
            if k not in ("member_points", "codec_members", "table_points", "codec_tables",
                         "segment_points", "codec_segments")}
    prof.update(timed)
    prof = refit(dict(prof, name=name, points=points))
    for k, v in profs[0].items():
        if k.endswith("_s") or k.endswith("_per_byte"):
            prof[k] = statistics.median(p[k] for p in profs)
    N = int(nranks)
    messages = 2 * math.ceil(math.log2(N)) + 2 * (N - 1) if N > 1 else 0
    fixed = lambda one: max(0.0, one - cycle_s / 2 - messages * prof["message_s"])  # noqa: E731
    prof["collective_s"] = fixed(allreduce1_s)
    prof["allreduce1_s"] = allreduce1_s
    if allreduce1_loaded_s is not None:
        prof["collective_loaded_s"] = fixed(allreduce1_loaded_s)
        prof["allreduce1_loaded_s"] = allreduce1_loaded_s
    if straggler_s is not None:
        prof["straggler_s"] = max(0.0, float(straggler_s))
    if half_sum and N > 1:  # one host sums nothing: the proxy stays
        prof["sum_fp16_proxy_s"] = prof["sum_fp16_s"]
        prof["sum_fp16_s"] = half_sum_cost(half_sum, N, prof["sum_fp32_s"])
        prof["half_sum"] = half_sum
    if framework_cpu:
        prof["framework_s"] = framework_costs(prof, framework_cpu, N, rate)
        prof["framework_cpu"] = framework_cpu
    prof["source"] = "%d hosts of a virtual cluster at once, each: %s" % (len(profs),
                                                                        profs[0]["source"])
    prof["note"] = ("one emulated host (a CPU quota, time dilation) doing compute, codec and the "
                    "exchange's CPU work; collective_s from a one-value allreduce among %d of "
                    "them" % N)
    return prof


def half_sum_cost(per_host, nranks, sum_fp32_s):
    """CPU seconds per value of Horovod's float16 sum, from allreduces of n float16 and of n / 2
    float32 values among ``nranks`` hosts (``per_host``: each host's {"values": n, "fp16_cpu_s",
    "fp32_cpu_s"}, the process's CPU seconds per allreduce): the same bytes and messages, so the
    medians' difference is the ring's sums alone, (N - 1) / N x (n x fp16 - n / 2 x fp32) per
    value (``steptime``'s charge for an allreduce's reduction); ``sum_fp32_s``: float32's, from
    the profile. CPU rather than wall time: Gloo's ring overlaps its sums with its transfers, so
    on a slow link they hide in the wall time, yet a 1-core host spends them. Never below 0."""
    import statistics
    N = int(nranks)
    if N < 2:
        raise ValueError("the float16 sum is measured among at least 2 hosts, got %d" % N)
    n = int(per_host[0]["values"])
    t16 = statistics.median(h["fp16_cpu_s"] for h in per_host)
    t32 = statistics.median(h["fp32_cpu_s"] for h in per_host)
    return max(0.0, (t16 - t32) * N / ((N - 1) * n) + sum_fp32_s / 2)


FRAMEWORK_METHODS = {"none": "none", "fp16": "fp16", "twobit": "twobit", "scatter": "scatter"}


def framework_costs(prof, per_host, nranks, rate="1gbit"):
    """{kind: [seconds per step, seconds per tensor]}: the framework's CPU work that the model
    does not charge otherwise (hooks, enqueueing, negotiation, synchronize, the compressor's
    buckets; ``steptime.framework_s`` adds it), from the CPU seconds per step of
    ``DistributedOptimizer`` steps on K tensors of 16 values measured on every host
    (``per_host``: [{kind: {K: seconds}}], kind "plain" for the optimizer alone): the median
    host's, less the plain step's and less the CPU the model charges those steps already (their
    codec, reductions, copies, TCP), fitted as per step + K x per tensor through the two K."""
    import statistics
    from horovod_twobit.model import steptime
    bare = {k: v for k, v in prof.items() if k != "framework_s"}

    hosts = [{kind: {int(k): float(v) for k, v in d.items()} for kind, d in h.items()}
             for h in per_host]  # keys are strings once the worker's JSON is read

    def median(kind, k):
        return statistics.median(h[kind][k] for h in hosts)
    ks = sorted(hosts[0]["plain"])
    if len(ks) < 2:
        raise ValueError("framework costs need steps timed at two tensor counts, got %s" % ks)
    lo, hi = ks[0], ks[-1]
    out = {}
    for kind, method in FRAMEWORK_METHODS.items():
        if kind not in hosts[0]:  # measured before this kind was (fp16 falls back to none's)
            continue
        extra = {}
        for k in (lo, hi):
            p = steptime.predict([16] * k, method, nranks, rate, 0.0, bare, latency_s=0.0)
            charged = p.parts["cpu"] - p.parts["optimizer"]
            extra[k] = median(kind, k) - median("plain", k) - charged
        per_tensor = max(0.0, (extra[hi] - extra[lo]) / (hi - lo))
        out[kind] = [max(0.0, extra[lo] - lo * per_tensor), per_tensor]
    return out
