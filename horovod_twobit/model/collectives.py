"""What the collectives of a step cost on the links, for the step-time model
(:mod:`horovod_twobit.model.steptime`): a link's alpha-beta :class:`Wire` (with a token bucket where the
link is shaped so), the bytes one rank sends in each kind of collective, one collective's
seconds, and Horovod's background thread over a step (:func:`schedule`: cycles, fusion, one
collective at a time, collectives slowed while backward holds a one-core host's core). Units:
:class:`horovod_twobit.model.units.Unit` (its ``kind``, ``values``, ``bytes``, ``bytes2``,
``dtype_bytes``, ``ready``, ``owner``). Pure Python."""

import math
import re

# TCP payload per byte on an Ethernet link: MSS 1448 (timestamps) in a 1514-byte frame
TCP_EFFICIENCY = 1448.0 / 1514.0


def parse_rate(rate):
    """Bits per second from 1e9, "25gbit", "100mbit", "10G", "400 Gbit/s"."""
    if isinstance(rate, (int, float)):
        return float(rate)
    m = re.fullmatch(r"\s*([0-9.]+(?:e[0-9+-]+)?)\s*([kmgt]?)(?:bit|b|bps)?(?:/s)?\s*",
                     str(rate).lower())
    if not m:
        raise ValueError("a link rate like 25gbit, 100mbit or 1e9 (bits per second), got %r"
                         % (rate,))
    return float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}[m.group(2)]


class Wire:
    """What a collective costs on one link: ``alpha`` seconds per message (the link's latency
    and the software's), ``beta`` seconds per byte a rank sends, ``collective_s`` a fixed cost
    per collective beyond its messages and negotiation (the framework's op, Horovod's enqueue,
    response and callback; 0 unless a profile or the caller gives it), ``cycle_s``
    (HOROVOD_CYCLE_TIME: an idle background thread starts a collective half a cycle after its
    input is ready), ``fixed``: ``collective_s`` plus the negotiation (2 ceil(log2 N)
    messages), and ``burst``: the bytes a link shaped by a token bucket sends at once before its
    rate applies (tc's ``tbf``, the virtual cluster's links, some clouds' shaping; 0 for a plain
    link: a switch port sends everything at its rate)."""

    def __init__(self, nranks, alpha, beta, collective_s=0.0, cycle_s=0.0, burst=0.0):
        N = int(nranks)
        self.alpha, self.beta, self.burst = float(alpha), float(beta), float(burst)
        self.collective_s, self.cycle_s = float(collective_s), float(cycle_s)
        self.fixed = self.collective_s + (2 * math.ceil(math.log2(N)) * self.alpha if N > 1
                                          else 0.0)

    @classmethod
    def of_link(cls, nranks, rate, latency_s, prof, cycle_s=1e-3, collective_s=None, burst=0.0):
        """From a link's ``rate`` (bits/s or "25gbit", less TCP/IP framing) and ``latency_s``
        and the profile's software cost per message (and per collective unless given)."""
        if collective_s is None:
            collective_s = prof.get("collective_s", 0.0)
        return cls(nranks, float(latency_s) + prof["message_s"],
                   8.0 / (parse_rate(rate) * TCP_EFFICIENCY), collective_s, cycle_s, burst)


def sent_bytes(kind, nranks, nbytes):
    """The bytes one rank puts on its link in one collective of ``kind`` ("allreduce": a ring's
    2 (N - 1) / N of its ``nbytes``; "allgather": N - 1 payloads of ``nbytes`` in a ring;
    "alltoall" and "scatter_allgather": ``nbytes``, already this rank's share)."""
    N = nranks
    if kind == "allreduce":
        return 2.0 * (N - 1) / N * nbytes
    if kind == "allgather":
        return (N - 1) * nbytes
    return float(nbytes)


def collective_seconds(kind, nranks, nbytes, values, wire, prof, dtype_bytes=4, fused=1):
    """Seconds of one collective's messages and bytes once it has started (``wire.fixed``
    apart): messages x alpha + bytes x beta (+ reduction and copies)."""
    N, alpha, beta = nranks, wire.alpha, wire.beta
    if N < 2:
        return 0.0
    if kind == "allreduce":
        s = 2 * (N - 1) * alpha + sent_bytes(kind, N, nbytes) * beta
        s += (N - 1) / N * values * prof["sum_fp16_s" if dtype_bytes == 2 else "sum_fp32_s"]
        if fused > 1:  # into the fusion buffer and back
            s += 2 * nbytes * prof["copy_s_per_byte"]
        return s
    if kind == "allgather":  # nbytes: one rank's payload (sum of fused ones); ring
        return ((N - 1) * alpha
                + sent_bytes(kind, N, nbytes) * beta * allgather_pace(kind, N, prof)
                + N * nbytes * prof["copy_s_per_byte"])
    if kind == "alltoall":
        # nbytes: what this rank sends to the others. Gloo posts the N - 1 sends and receives at
        # once: one latency, and the software cost of every message; twice (the splits first)
        link_latency = alpha - prof["message_s"]
        return (2 * (link_latency + (N - 1) * prof["message_s"])
                + sent_bytes(kind, N, nbytes) * beta)
    if kind == "scatter_allgather":  # the owners' sums, ring; nbytes: this rank's share already
        return ((N - 1) * alpha
                + sent_bytes(kind, N, nbytes) * beta * allgather_pace(kind, N, prof))
    raise ValueError(kind)


ALLGATHERS = ("allgather", "scatter_allgather")


def allgather_pace(kind, nranks, prof):
    """How many times its bytes' time an allgather's transfer takes, against the allreduce's
    pace that ``Wire.beta`` holds: the profile's ``allgather_pace`` where it has one (measured
    at this N: the fallback's link, :func:`horovod_twobit.state.fallback.figures`); else 2 for Gloo's
    ring allgather between two ranks, whose one peer is both the rank it sends to and the one
    it receives from and whose send and receive then go one after the other
    (``examples/probe_allgather.py`` on 2 virtual hosts: 1.4-1.9x an allreduce sending each
    host the same bytes, at 100 Mbit/s and 1 Gbit/s; 0.6-1.1x on 4 hosts, where the ring's two
    neighbours differ), and 1 otherwise. What a link's token bucket sends at once is sent at
    once both ways (:func:`schedule`). Gloo moves Horovod's CPU tensors: the profiles of CPU
    hosts (``serial``) pay it, the GPU ones (NCCL) do not. Other kinds: 1."""
    if kind not in ALLGATHERS:
        return 1.0
    if prof.get("allgather_pace") is not None:
        return float(prof["allgather_pace"])
    return 2.0 if int(nranks) == 2 and prof.get("serial") else 1.0


def schedule(order, N, wire, prof, fusion_bytes, backward_end, busy_rate, tokens):
    """Horovod's background thread over one step: cycles, fusion, one collective at a time; sets
    each unit's ``done``. ``tokens``: the bytes the link's token bucket holds at the step's start
    (:class:`Wire`'s ``burst``), spent before the rate applies and refilled at the rate while
    the link is idle. Returns (seconds of collectives, their CPU work, when the first started,
    when the last ended, the tokens left)."""
    free, wire_s, cpu_coll, first = 0.0, 0.0, 0.0, None
    pending = [(u.ready, k, u, 1) for k, u in enumerate(order)]
    while pending:
        pending.sort(key=lambda x: (x[0], x[1]))
        ready0 = pending[0][0]
        start = max(free, ready0 + wire.cycle_s / 2) if ready0 >= free else free
        kind = phase_kind(pending[0][2], pending[0][3])
        batch, nbytes, nvalues = [], 0.0, 0
        for item in pending:
            r, _, u, phase = item
            if r > start or phase_kind(u, phase) != kind:
                continue
            b = phase_bytes(u, phase)
            if batch and (kind == "alltoall" or nbytes + b > fusion_bytes):
                break
            batch.append(item)
            nbytes += b
            nvalues += u.values
        for item in batch:
            pending.remove(item)
        dur = collective_seconds(kind, N, nbytes, nvalues, wire, prof,
                                 batch[0][2].dtype_bytes, len(batch))
        if kind == "allreduce":  # the reduction and the copies: CPU work
            cpu_coll += dur - (2 * (N - 1) * wire.alpha + sent_bytes(kind, N, nbytes) * wire.beta)
        if wire.burst:
            if first is not None:
                tokens = min(wire.burst, tokens + (start - free) / wire.beta)
            used = min(tokens, sent_bytes(kind, N, nbytes))
            tokens -= used
            # sent at once, out of the bucket
            dur -= used * wire.beta * allgather_pace(kind, N, prof)
        first = start if first is None else first
        end = collective_end(start, wire.fixed + dur, backward_end, busy_rate)
        wire_s += wire.fixed + dur
        free = end
        for _, k, u, phase in batch:
            if kind == "alltoall":
                # phase 2 is submitted by the training thread (horovod_twobit.torch.exchange.progress has
                # no thread of its own: its waits advance the flights), so not before backward
                # ends; the owner reduces its chunk there, then the allgather of the sums
                pending.append((max(end, backward_end) + u.owner, k, u, 2))
            else:
                u.done = end
    return wire_s, cpu_coll, first or 0.0, free, tokens


def loaded_rate(prof):
    """How fast a collective progresses while the host's one core runs the backward pass, as a
    share of its pace on an idle host: the profile's ``collective_s`` over ``collective_loaded_s``
    (a one-value allreduce timed on idle hosts and on hosts whose core is busy,
    ``examples/bench_cluster.py --calibrate``). 1 (no slowdown) unless the profile is ``serial``
    and has both."""
    idle, loaded = prof.get("collective_s"), prof.get("collective_loaded_s")
    if not prof.get("serial") or not idle or not loaded or loaded <= idle:
        return 1.0
    return idle / loaded


def collective_end(start, seconds, backward_end, rate):
    """When a collective of ``seconds`` (on an idle host) started at ``start`` ends, if it
    progresses at ``rate`` of that pace until ``backward_end`` and at full pace after."""
    if rate >= 1.0 or start >= backward_end:
        return start + seconds
    before = (backward_end - start) * rate
    if before >= seconds:
        return start + seconds / rate
    return backward_end + seconds - before


def phase_kind(u, phase):
    if u.kind == "scatter":
        return "alltoall" if phase == 1 else "scatter_allgather"
    return u.kind


def phase_bytes(u, phase):
    if u.kind == "allreduce":
        return u.values * u.dtype_bytes
    return u.bytes2 if phase == 2 else u.bytes
