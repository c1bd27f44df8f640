"""A step-time model for data-parallel training with Horovod, per gradient exchange method.

    from horovod_twobit import steptime
    prof = steptime.load_profile("cpu")
    sizes = steptime.sizes_from(25.6e6)                 # or a list of sizes, or a torch.nn.Module
    p = steptime.predict(sizes, "scatter", nranks=64, rate="25gbit", compute_s=0.104, profile=prof)
    p.step_s, p.parts

Methods (:data:`METHODS`): ``none`` (Horovod's ring allreduce of float32), ``fp16``
(``hvd.Compression.fp16``), ``twobit`` / ``auto`` (``TwoBitCompressor`` with a numeric threshold /
``"auto"``, allgather exchange), ``scatter`` / ``scatter_auto`` (the same with
``exchange="scatter"``), ``powersgd`` (PowerSGD of rank r, a reference point: no such method in
this project).

What one step is made of, on one host (the ranks are alike):

* **compute**: the forward pass (``forward_fraction`` of ``compute_s``), then backward; gradients
  become ready in the reverse order of the parameters, at a pace proportional to their sizes.
* **encode** on the training thread, when a TwoBit bucket's last gradient is ready (it delays the
  rest of backward); fp16's cast likewise.
* **exchange**, on Horovod's background thread, overlapping backward: a collective starts at a
  cycle (``cycle_s``, HOROVOD_CYCLE_TIME) after its input is ready, once the previous one is done;
  allreduces and allgathers that are ready together are fused up to ``fusion_bytes``
  (HOROVOD_FUSION_THRESHOLD); alltoalls are not fused. Each collective costs a fixed cost
  (:class:`Wire`'s ``collective_s``), a negotiation (2 ceil(log2 N) messages), its messages
  (alpha each: the link's latency plus the profile's software latency per message) and its
  bytes at the link's rate (beta: ``rate`` per host, less TCP/IP framing), by the project's own
  formats (:mod:`horovod_twobit.wire.scatter`, the allgather payload of
  :mod:`horovod_twobit.wire.layout`; an allgather between two ranks on CPU hosts pays its bytes
  twice, or at the pace a profile measured, :func:`~horovod_twobit.model.collectives.allgather_pace`);
  the ring allreduce adds its reduction (per value, for float32 and float16 sums) and the
  fusion buffer's copies. The scatter exchange's owner reduction sits between its alltoall and
  its allgather. On a host of one core (a ``serial`` profile measured with
  ``collective_loaded_s``), a collective that runs while backward computes progresses at
  ``collective_s / collective_loaded_s`` of its pace (:func:`loaded_rate`): the background
  thread waits for the core at its messages.
* **decode** (the decode-sum of N payloads and the residual update) on the training thread, bucket
  by bucket as ``synchronize`` reaches them, overlapping the collectives still running.
* the optimizer's update of every value.
* **pages mapped fresh**: a buffer of at least 32 MiB that a step allocates anew (fp16's float16
  copy and float32 result; TwoBit's gathered payloads, Horovod's allgather output) is mapped
  fresh every step, and the kernel faults in and zero-fills each of its pages
  (:func:`~horovod_twobit.model.units.fresh_pages`); each costs the profile's ``page_s``
  (measured by :func:`horovod_twobit.advisor.calibrate.calibrate` on a CPU; 0 where a profile has
  none), charged with the codec call that allocates it.
* the **framework's** own CPU work (:func:`framework_s`: Horovod's hooks, enqueueing and
  synchronize, TwoBit's buckets), per gradient tensor in backward and per step at its end, where
  the profile has it (measured on a virtual cluster's hosts; 0 otherwise).
* the **slowest host**: a synchronous step waits for the last of N hosts; the profile's
  ``straggler_s`` (:func:`straggler_s`, measured likewise) is its lead over the median host.

The step is the end of that critical path. On a profile whose host runs everything on one core
(``serial``: the CPU profiles of this project's emulation), the step is at least the host's total
CPU work as well: compute, codec, reductions and copies, the kernel's TCP work per byte sent and
received, and the optimizer.

Codec costs come from a device profile (:func:`load_profile`): JSON written by
:func:`horovod_twobit.advisor.calibrate.calibrate` (this machine's measured rates, ``python -m
horovod_twobit.advise calibrate``) or shipped under
``horovod_twobit/profiles/`` (``h200``, ``h100``: measured on one H200 and one H100; the other
GPU entries are memory-bandwidth bounds, labelled so, with their source;
:mod:`horovod_twobit.model.device`: a measured profile's codec rate depends on the bucket's size, a
bucket of many tensors pays a cost per member, and an "auto" bucket one per table of its
segments and per segment beyond one tensor's). Pure Python; importing this module imports
neither torch nor Horovod.
"""

import math
import re

from horovod_twobit.model.collectives import (TCP_EFFICIENCY, Wire, collective_seconds,
    loaded_rate, parse_rate, phase_bytes, phase_kind, schedule, sent_bytes)
from horovod_twobit.model.units import (Unit, bucket_unit, exchange_bytes, powersgd_bytes,
    scatter_words, units)
from horovod_twobit.model.device import (CODEC_KEYS, PROFILE_DIR, bandwidth_bound_profile,
    codec_s, load_profile, profile_names)

METHODS = ("none", "fp16", "twobit", "auto", "scatter", "scatter_auto", "powersgd")
LABELS = {"none": "Horovod, no compression (ring allreduce)", "fp16": "Horovod, Compression.fp16",
          "twobit": "TwoBit, allgather", "auto": 'TwoBit "auto", allgather',
          "scatter": "TwoBit, scatter", "scatter_auto": 'TwoBit "auto", scatter',
          "powersgd": "PowerSGD rank r (reference)"}


# ------------------------------------------------------------------------------------ inputs
def parse_count(text):
    """25.6M -> 25600000; 340m, 1.5G, 4096."""
    if isinstance(text, (int, float)):
        return int(text)
    m = re.fullmatch(r"\s*([0-9.]+(?:e[0-9+-]+)?)\s*([kmgb]?)\s*", str(text).lower())
    if not m:
        raise ValueError("a count like 25.6M or 340000000, got %r" % (text,))
    return int(round(float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "b": 1e9}[m.group(2)]))


def parse_seconds(text):
    """Seconds from 0.12, "120ms", "50us", "2s"."""
    if isinstance(text, (int, float)):
        return float(text)
    m = re.fullmatch(r"\s*([0-9.]+(?:e[0-9+-]+)?)\s*(s|ms|us|ns)?\s*", str(text).lower())
    if not m:
        raise ValueError("a time like 120ms, 50us or 0.12, got %r" % (text,))
    return float(m.group(1)) * {None: 1, "s": 1, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}[m.group(2)]


def sizes_from(model, tensor_values=1 << 20):
    """Gradient tensor sizes in registration order from a torch.nn.Module (its trainable
    parameters), a list of sizes, or a parameter count (cut into tensors of ``tensor_values``)."""
    if hasattr(model, "parameters"):
        return [int(p.numel()) for p in model.parameters() if p.requires_grad]
    if isinstance(model, (list, tuple)):
        return [int(n) for n in model]
    total = parse_count(model)
    if total <= 0:
        raise ValueError("a model needs at least one value")
    full, rest = divmod(total, tensor_values)
    return [tensor_values] * full + ([rest] if rest else [])


# ---------------------------------------------------------------------------------- the model
class Prediction:
    """``step_s`` and its parts (seconds, one host)."""

    def __init__(self, method, step_s, parts):
        self.method, self.step_s, self.parts = method, step_s, parts

    def __repr__(self):
        return "Prediction(%s, %.4f s, %s)" % (self.method, self.step_s, {
            k: round(v, 4) if isinstance(v, float) else v for k, v in self.parts.items()})


def bucket_s(lay, exchange, nranks, wire, prof):
    """Seconds of one bucket of layout ``lay`` alone, from its gradients ready to its result
    decoded, as :func:`predict` charges it when nothing else is in flight: ``exchange`` "plain"
    (Horovod's ring allreduce of its float32 values, one tensor), "allgather" or "scatter"
    (TwoBit's: the encode, each collective half a cycle after its input, the owner's reduction
    between the scatter's two, the decode). The fallback compares these per bucket."""
    N = int(nranks)
    if N < 2:
        return 0.0
    u = (Unit(None, lay.values, "allreduce") if exchange == "plain"
         else bucket_unit(lay, exchange, N, prof))
    t = u.encode + u.owner + u.decode
    for phase in ((1, 2) if u.kind == "scatter" else (1,)):
        t += wire.cycle_s / 2 + wire.fixed + collective_seconds(
            phase_kind(u, phase), N, phase_bytes(u, phase), u.values, wire, prof,
            u.dtype_bytes)
    return t


def predict(sizes, method, nranks, rate, compute_s, profile, latency_s=25e-6, cycle_s=1e-3,
            fusion_bytes=64 << 20, bucket_bytes=None, forward_fraction=1.0 / 3,
            powersgd_rank=4, collective_s=None, burst_bytes=0):
    """Predicted step time of ``method`` (see :data:`METHODS`) on ``nranks`` hosts with links of
    ``rate`` (bits/s or "25gbit") and ``latency_s``, for a model of gradient ``sizes`` whose
    forward and backward take ``compute_s`` on one host without communication.
    ``collective_s``: the fixed cost of each collective (:class:`Wire`; default the profile's,
    else 0). ``burst_bytes``: the links' token bucket (:class:`Wire`'s ``burst``; 0, a plain
    link, unless they are shaped), full at a step's start as the step before left it."""
    if method not in METHODS:
        raise ValueError("method must be one of %s, got %r" % (", ".join(METHODS), method))
    prof = load_profile(profile)
    N = int(nranks)
    sizes = [int(n) for n in sizes]
    total = float(sum(sizes))
    wire = Wire.of_link(N, rate, latency_s, prof, cycle_s, collective_s, burst_bytes)
    fwd = compute_s * forward_fraction
    per_value = compute_s * (1 - forward_fraction) / max(total, 1.0)
    opt = total * prof["optimizer_s"]
    if method == "powersgd":
        return _predict_powersgd(sizes, N, wire, compute_s, opt, prof, powersgd_rank)
    fw_step, fw_tensor = framework_s(prof, method)
    per_value_s = lambda i: sizes[i] * per_value + fw_tensor  # noqa: E731
    step_units = units(sizes, method, N, prof, bucket_bytes)
    # training thread: backward, with each unit's encode when its last gradient is ready
    t, done = fwd, set()
    pos = {i: k for k, i in enumerate(reversed(range(len(sizes))))}
    order = sorted(step_units, key=lambda u: max(pos[i] for i in u.members))
    for u in order:
        for i in sorted(u.members, key=pos.get):
            if i not in done:
                t += per_value_s(i)
                done.add(i)
        t += u.encode
        u.ready = t
    backward_end = t + sum(per_value_s(i) for i in range(len(sizes)) if i not in done)
    busy_rate = loaded_rate(prof)
    tokens = wire.burst  # the link's token bucket at the step's start (steady state: below)
    for _ in range(4 if wire.burst else 1):
        wire_s, cpu_coll, first, last, left = schedule(order, N, wire, prof, fusion_bytes,
                                                       backward_end, busy_rate, tokens)
        # training thread: synchronize, unit by unit, decoding each when its collective is done
        t = backward_end
        for u in order:
            t = max(t, u.done) + u.decode
        step_end = t + opt + fw_step
        # the next step starts with what this one left, refilled while its link is idle
        again = min(wire.burst, left + (step_end - last + first) / wire.beta) if order else 0.0
        if abs(again - tokens) < 1.0:
            break
        tokens = again
    framework = fw_step + fw_tensor * len(sizes)
    step = step_end + straggler_s(prof, N)
    codec = sum(u.encode + u.decode + u.owner for u in step_units)
    sent = exchange_bytes(sizes, method, N, bucket_bytes)
    cpu = (compute_s + codec + cpu_coll + opt + framework
           + 2 * sent * prof["kernel_s_per_byte"])
    bound = "path"
    if prof.get("serial") and cpu > step:
        step, bound = cpu, "cpu"
    return Prediction(method, step, {
        "compute": compute_s, "codec": codec, "exchange": wire_s, "optimizer": opt,
        "framework": framework, "bytes_sent": sent, "cpu": cpu, "bound": bound,
        "collectives": len(step_units), "fresh_pages": sum(u.pages for u in step_units)})


def straggler_s(prof, nranks):
    """The slowest host's lead over the median host on a step's work, which a synchronous step
    waits for: the profile's ``straggler_s`` (measured on a virtual cluster's N hosts by
    ``examples/bench_cluster.py --calibrate``: a burst of CPU work started together on every
    host), 0 on one host or where the profile has none. It is measured at the profile's own
    number of hosts (its ``cluster`` entry) and given as it is at any other N."""
    return float(prof.get("straggler_s", 0.0)) if int(nranks) > 1 else 0.0


# which of a profile's measured framework costs (``framework_s``) each method pays, the first
# the profile has: profiles measured before fp16 had a kind of its own give it no compression's
FRAMEWORK_KINDS = {"none": ("none",), "fp16": ("fp16", "none"), "twobit": ("twobit",),
                   "auto": ("twobit",), "scatter": ("scatter",), "scatter_auto": ("scatter",)}


def framework_s(prof, method):
    """(seconds per step, seconds per gradient tensor) of the framework's own CPU work on the
    training thread that the other terms do not hold (Horovod's hooks, enqueueing and
    synchronize; TwoBit's buckets), from the profile's ``framework_s`` (measured on a virtual
    cluster's hosts by ``examples/bench_cluster.py --calibrate``); (0, 0) where it has none.
    Per tensor it is paid in backward as each gradient is ready, per step at its end. fp16 takes
    no compression's figures where the profile has none of its own (its casts per tensor then
    go uncharged)."""
    measured = prof.get("framework_s", {})
    got = next((measured[k] for k in FRAMEWORK_KINDS.get(method, ()) if k in measured), None)
    return (float(got[0]), float(got[1])) if got else (0.0, 0.0)


def _predict_powersgd(sizes, N, wire, compute_s, opt, prof, r):
    """PowerSGD rank r as DDP's hook runs it with one bucket: after backward, P = M Q and its
    allreduce, Q = M^T P and its allreduce, M ~ P Q^T and the error feedback; 1-D and small
    tensors allreduced uncompressed alongside."""
    comp = [n for n in sizes if powersgd_bytes(n, r) < 4 * n]
    plain = sum(n for n in sizes if powersgd_bytes(n, r) == 4 * n)
    pq = sum(powersgd_bytes(n, r) for n in comp) / 2.0
    codec = sum(comp) * r * 3 * prof["powersgd_s"] + sum(comp) * 3 * prof["optimizer_s"] / 2
    wire_s = 0.0
    for nbytes, values in ((pq + 4 * plain, pq / 4 + plain), (pq, pq / 4)):
        wire_s += wire.fixed + collective_seconds("allreduce", N, nbytes, values, wire, prof, 4, 2)
    step = compute_s + codec + wire_s + opt
    sent = exchange_bytes(sizes, "powersgd", N, powersgd_rank=r)
    cpu = compute_s + codec + opt + 2 * sent * prof["kernel_s_per_byte"]
    bound = "path"
    if prof.get("serial") and cpu > step:
        step, bound = cpu, "cpu"
    return Prediction("powersgd", step, {"compute": compute_s, "codec": codec, "exchange": wire_s,
                                         "optimizer": opt, "bytes_sent": sent, "cpu": cpu,
                                         "bound": bound, "collectives": 2})


def predict_all(sizes, nranks, rate, compute_s, profile, methods=METHODS, **kw):
    """{method: Prediction}."""
    return {m: predict(sizes, m, nranks, rate, compute_s, profile, **kw) for m in methods}


# how close two methods' predicted steps lie before the model cannot say which is faster: about
# its median error against the emulation's measured steps (docs/where_it_pays.md)
CLOSE_CALL = 0.10


def close_calls(steps, margin=CLOSE_CALL):
    """The methods of ``steps`` ({method: predicted step seconds}) within ``margin`` of the
    fastest, fastest first: the ones the model cannot tell apart, to be timed on the cluster."""
    best = min(steps.values())
    return sorted((m for m, s in steps.items() if s <= best * (1 + margin)), key=steps.get)


def break_even_rate(sizes, method, nranks, compute_s, profile, lo=1e7, hi=1e13, **kw):
    """The link rate (bits/s) below which ``method`` is faster than no compression (None if it
    is faster at every rate from ``lo`` to ``hi``, 0.0 if at none). Bisection in log(rate)."""
    def gain(rate):
        p = predict(sizes, method, nranks, rate, compute_s, profile, **kw).step_s
        q = predict(sizes, "none", nranks, rate, compute_s, profile, **kw).step_s
        return q - p
    if gain(lo) <= 0:
        return 0.0
    if gain(hi) > 0:
        return None
    a, b = math.log(lo), math.log(hi)
    for _ in range(30):
        m = (a + b) / 2
        if gain(math.exp(m)) > 0:
            a = m
        else:
            b = m
    return math.exp((a + b) / 2)
