"""A device profile for the step-time model (:mod:`horovod_twobit.steptime`) measured on this
machine: ``python -m horovod_twobit.advise calibrate``. Each codec call is timed with the
project's own PyTorch codec functions at bucket sizes that span the cache and fitted as
``c0 + c1 N + n (a + b N)``, and as ``c0 + c1 N + n (a(n) + b(n) N)`` with a per-value rate for
each size timed (``codec_by_size``, :mod:`horovod_twobit.profile`); the other costs
the model takes per value (sums, copies, casts, the optimizer), per byte (the kernel's TCP work)
and per message are timed alike."""

import json
import os

from . import layout as _layout
from . import scatter_wire as _sw
from . import wire as _wire
from .codec_fit import (_fit, _fit_by_size, _fit_members, _fit_segments,  # noqa: F401
                        _fit_tables, _nonneg_lstsq, refit)
from .steptime import CODEC_KEYS


SIZES = (1 << 12, 1 << 16, 1 << 18, 1 << 20, 1 << 22, 1 << 24)
MEMBERS = 64  # the bucket whose members' cost is timed: this many members
TABLES = 3  # the "auto" bucket whose cost per table of segments is timed: this many tables
SEGMENT_VALUES = 1 << 16  # the "auto" tensor whose cost per segment is timed: this many values


def calibrate(path=None, sizes=SIZES, ranks=(2, 4, 8), threads=1, compiled=True,
              reps=5, name="cpu", clock="cpu", dilation=1.0, min_wall_s=0.25, device="cpu",
              members=MEMBERS, tables=TABLES, segment_values=SEGMENT_VALUES):
    """Measures this machine's codec rates with the project's own codec functions (PyTorch,
    ``threads`` threads; as a step runs them: eager below the codec's switch to its compiled
    bodies, ``COMPILE_MIN_NUMEL`` values, compiled from there, a size just below the switch
    timed too where ``sizes`` straddle it (:func:`timed_sizes`); every size eager with
    ``compiled=False``; the ones
    ``horovod_twobit.benchmarks.codec`` times, plus the "auto" and scatter ones) and the costs the
    model takes per value (sums, copies, casts, the optimizer, the kernel's TCP work per byte, the
    software latency of a message). Each codec call is fitted as ``c0 + c1 N + n (a + b N)`` from
    the sizes and rank counts timed, and by size (:func:`_fit_by_size`); its cost per member of
    a bucket from a bucket of ``members`` members (:func:`_fit_members`; 0 or 1: not timed);
    an "auto" call's cost per table of segments from a bucket of ``tables`` tables against its
    twin of one (:func:`table_numels`, :func:`_fit_tables`; 0 or 1: not timed); and its cost
    per segment from one tensor of ``segment_values`` values in blocks of 64 against the same
    tensor as the compressor cuts it (:func:`_fit_segments`; 0: not timed).
    Returns the profile and writes it to ``path`` (JSON).

    ``clock``: "cpu" (default) times each call in this process's CPU seconds, what one core of a
    host spends, which other jobs on a shared machine do not inflate; "wall" in wall seconds
    divided by ``dilation``: inside a virtual cluster's host (a CPU quota, time dilation D, see
    docs/emulation.md) that is the real-host second of the host being stood for, its quota's
    gaps, its neighbours' share of the caches and the timer's granularity included; each reading
    then spans at least ``min_wall_s`` of wall time (:class:`_Timer`).

    ``device``: where the codec's tensors live ("cuda" on a GPU host, with ``clock="wall"``: each
    reading waits for the device). A GPU's profile is not ``serial``: its codec does not share
    a core with the host's collectives. The network figures are the host's TCP either way."""
    import platform
    import torch
    from .torch import compiled as bodies
    device = torch.device(device)
    if device.type != "cpu" and clock == "cpu":
        raise ValueError("a %s device's codec runs outside this process's CPU time: calibrate "
                         "it with clock=\"wall\" (--clock wall)" % device.type)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("this torch sees no CUDA device (torch.cuda.is_available() is False): "
                         "calibrate on the GPU host with a CUDA build of torch, or with "
                         "--device cpu")
    if segment_values and int(segment_values) <= 64 * 64:
        raise ValueError("segment_values must be more than 4096 (the compressor cuts a tensor "
                         "of up to 4096 values into blocks of 64 already), e.g. %d; 0: not timed, "
                         "got %r" % (SEGMENT_VALUES, segment_values))
    timer = _Timer(clock, dilation, min_wall_s, device)
    torch.set_num_threads(threads)
    old = bodies.COMPILE_MIN_NUMEL
    if not compiled:
        bodies.COMPILE_MIN_NUMEL = 1 << 62
    sizes = timed_sizes(sizes, bodies.COMPILE_MIN_NUMEL)
    try:
        points = {k: [] for k in CODEC_KEYS}
        for n in sizes:
            for N in ranks:
                for key, secs in _time_codec(int(n), int(N), reps, timer, device).items():
                    points[key].append((int(n), int(N), secs))
        codec = {k: _fit(v) for k, v in points.items()}
        by_size = {"sizes": sorted({int(n) for n in sizes}),
                   "keys": {k: _fit_by_size(v) for k, v in points.items()}}
        bucket = None
        if members and int(members) > 1:
            n = member_values(sizes, members)
            bucket = {"members": int(members), "values": n, "points": {k: [] for k in CODEC_KEYS}}
            for N in ranks:
                for key, secs in _time_codec(n, int(N), reps, timer, device,
                                             int(members)).items():
                    bucket["points"][key].append((int(N), secs))
        def paired(more, fewer):  # "auto" only, at every N: {key: [(N, seconds, seconds)]}
            points = {}
            for N in ranks:
                a, b = (_time_codec(0, int(N), reps, timer, device, autos=(True,), **kw)
                        for kw in (more, fewer))
                for key in a:
                    points.setdefault(key, []).append((int(N), a[key], b[key]))
            return points
        by_table = by_segment = None
        if tables and int(tables) > 1:
            distinct, equal = table_numels(int(tables))
            by_table = {"tables": int(tables), "numels": distinct,
                        "points": paired({"numels": distinct}, {"numels": equal})}
        if segment_values:
            n, cuts = int(segment_values), ((64, None), _wire.validate_blocks("auto"))
            by_segment = {"values": n, "segments": [
                _layout.Layout([n], True, *c).segments for c in cuts],
                "points": paired(*({"numels": [n], "blocks": c} for c in cuts))}
        per = _time_per_value(1 << 22, reps, timer, device)
    finally:
        bodies.COMPILE_MIN_NUMEL = old
    gpu = device.type != "cpu"
    prof = {"name": name, "kind": "measured", "serial": not gpu,
            "source": "python -m horovod_twobit.advise calibrate on %s (%s, %d thread(s), %s, "
                      "torch %s, %s)" % (platform.node() or "?",
                                         torch.cuda.get_device_name(device) if gpu
                                         else _cpu_name(), threads,
                                         "codec compiled from %d values, eager below" % old
                                         if compiled else "eager codec",
                                         torch.__version__, _clock_name(clock, dilation)),
            "note": ("the codec on one %s device; the network figures are its host's TCP"
                     % device.type if gpu else
                     "one host = one core doing compute, codec and the exchange's CPU work"),
            "codec": codec, "codec_by_size": by_size, "points": points,
            "compile_min_numel": old if compiled else None}
    if bucket:
        prof["member_points"] = bucket
        prof["codec_members"] = _fit_members(points, bucket)
    if by_table:
        prof["table_points"] = by_table
        prof["codec_tables"] = _fit_tables(by_table)
    if by_segment:
        prof["segment_points"] = by_segment
        prof["codec_segments"] = _fit_segments(by_segment)
    prof.update(per)
    prof.update(_time_network(nbytes=(64 << 20) if clock == "cpu" else (256 << 20), timer=timer,
                              dilation=dilation if clock == "wall" else 1.0))
    if path:
        d = os.path.dirname(os.path.abspath(path))
        os.makedirs(d, exist_ok=True)
        with open(path, "w") as f:
            json.dump(prof, f, indent=1, sort_keys=True)
            f.write("\n")
    return prof


def _cpu_name():
    try:
        with open("/proc/cpuinfo") as f:
            return next((l.split(":", 1)[1].strip() for l in f if l.startswith("model name")), "?")
    except OSError:
        return "?"


CLOCKS = ("cpu", "wall")


class _Timer:
    """The clock the calibration reads: this process's CPU seconds ("cpu"), or wall seconds over
    ``dilation`` ("wall"). A wall-clock reading spans at least ``min_wall_s`` of wall time
    (:func:`_median_time` repeats the call until it does): under a CPU quota a call shorter than
    the quota's period can run entirely in one period's share at a whole core's speed, and only
    over many periods does wall time / D stand for the real host's seconds."""

    def __init__(self, clock, dilation=1.0, min_wall_s=0.25, device=None):
        import time
        if clock not in CLOCKS:
            raise ValueError("clock must be one of %s, got %r" % (", ".join(CLOCKS), clock))
        if not dilation or dilation <= 0:
            raise ValueError("dilation must be > 0, got %r" % (dilation,))
        self.clock, self.dilation = clock, float(dilation)
        if clock == "cpu":
            self.now, self.min_s = time.process_time, 0.0
        else:
            self.now = lambda: time.perf_counter() / self.dilation
            self.min_s = min_wall_s / self.dilation
        self.device = device  # a GPU: each reading waits for its work (see sync)

    def sync(self):
        if self.device is not None and self.device.type == "cuda":
            import torch
            torch.cuda.synchronize(self.device)

    def __call__(self):
        return self.now()


def _clock_name(clock, dilation):
    return ("CPU seconds" if clock == "cpu" else
            "wall seconds / %g (a virtual cluster's real-host seconds)" % dilation
            if dilation != 1 else "wall seconds")


def _median_time(fn, reps, timer=None):
    """The median seconds of ``fn`` by ``timer`` (default this process's CPU seconds, one
    thread: what one core of a host spends on it, which the other jobs of a shared machine do
    not inflate as they do its wall time); each of the ``reps`` readings repeats ``fn`` until
    it spans the timer's ``min_s``."""
    import statistics
    import time
    timer = timer or time.process_time
    min_s = getattr(timer, "min_s", 0.0)
    sync = getattr(timer, "sync", lambda: None)
    fn()
    sync()
    ts = []
    for _ in range(reps):
        t0, calls = timer(), 0
        while True:
            fn()
            calls += 1
            sync()
            dt = timer() - t0
            if dt >= min_s:
                break
        ts.append(dt / calls)
    return statistics.median(ts)


def member_values(sizes, members):
    """The size of the bucket :func:`calibrate` times with ``members`` members: the smallest of
    ``sizes`` that gives each member at least 16 values (one word), else the largest."""
    fit = [int(n) for n in sorted(sizes) if int(n) >= 16 * int(members)]
    return fit[0] if fit else int(max(sizes))


def timed_sizes(sizes, switch):
    """``sizes`` (ascending, no repeats) and, where they straddle ``switch`` (the codec's
    ``COMPILE_MIN_NUMEL``: eager below it, compiled from it), the largest size of whole words
    below it, so that the rates by size (:func:`_fit_by_size`) step where the codec does
    rather than blend its eager and compiled rates in between."""
    sizes = sorted({int(n) for n in sizes})
    below = (int(switch) - 1) // 16 * 16
    if below > 0 and sizes[0] < switch <= sizes[-1] and below not in sizes:
        sizes = sorted(sizes + [below])
    return sizes


def table_numels(tables):
    """(distinct, equal): the members of a bucket whose "auto" segments (the compressor's
    blocks, :func:`horovod_twobit.wire.validate_blocks`) make ``tables`` tables
    (:meth:`horovod_twobit.layout.Layout.tables`), and its twin of one table: as many members, of
    one length, as many values. Member j is 64 blocks of 64 x 4^j values: rows too far apart in
    length to share a table."""
    distinct = [64 * 64 * 4 ** j for j in range(int(tables))]
    return distinct, [sum(distinct) // len(distinct)] * len(distinct)


def _time_codec(n, N, reps, timer=None, device="cpu", members=1, numels=None,
                autos=(False, True), blocks=None):
    """Seconds of each codec call on a bucket of n values among N ranks (the other ranks'
    payloads are copies of this one's), its tensors on ``device``: one tensor, or ``members``
    members of (nearly) equal size, or members of the sizes ``numels`` (n and members unused);
    with a numeric threshold and "auto" (``autos``: which), "auto" cut into the compressor's
    blocks or ``blocks`` = (block, blocks)."""
    import torch
    from .torch import codec, scatter_codec
    out = {}
    if numels is None:
        numels = [n // members + (1 if i < n % members else 0) for i in range(members)]
    n, members = sum(numels), len(numels)
    names = ["x%d" % i for i in range(members)]
    for auto in autos:
        sfx = "_auto" if auto else ""
        thr = "auto" if auto else 0.5
        lay = _layout.Layout(numels, auto, *(blocks if auto and blocks
                                             else _wire.validate_blocks(thr)))
        g = torch.randn(lay.values, device=device) * 0.3  # members padded to whole words
        r = torch.zeros(lay.values, device=device)
        payload = torch.empty(lay.payload_words, dtype=torch.int32, device=device)
        enc = lambda: codec.encode_payload(lay, r, g, thr, "lsq", payload)
        out["encode" + sfx] = _median_time(enc, reps, timer)
        t, v = enc()
        gathered = payload.repeat(N)
        work = g.clone()
        out["finish" + sfx] = _median_time(
            lambda: codec.finish_payload(lay, gathered, N, names, r, work, t, v, N, 1.0), reps,
            timer)
        chunks = _sw.Chunks(lay, N)
        send, splits = scatter_codec.chunk_payloads(chunks, payload, thr)
        out["scatter_encode" + sfx] = out["encode" + sfx] + _median_time(
            lambda: scatter_codec.chunk_payloads(chunks, payload, thr), reps, timer)
        offs = [0]
        for s in splits.tolist():
            offs.append(offs[-1] + s)
        reduced, bads = [], []
        for c in range(N):
            mine = send[offs[c]:offs[c + 1]]
            received = mine.repeat(N)
            res = torch.zeros(chunks.values(c), device=device) if auto else None
            fn = lambda: scatter_codec.owner_reduce(chunks, received, [int(splits[c])] * N, names,
                                                    c, thr, "lsq", res)
            if c == 0:
                out["owner" + sfx] = _median_time(fn, reps, timer)
            p, bad = fn()
            reduced.append(p)
        gathered2 = torch.cat(reduced)
        out["scatter_finish" + sfx] = _median_time(
            lambda: scatter_codec.finish_reduced(chunks, gathered2, names, r, work, t, v,
                                                 [False] * members, N, 1.0), reps, timer)
    return out


def _time_per_value(n, reps, timer=None, device="cpu"):
    """Per-value seconds of what the exchange and the optimizer do besides the codec, on
    ``device``. On a CPU the float16 sum is timed with NumPy's float16 add, which converts each
    value in software as Gloo's ``gloo::float16`` sum does (a proxy, not Gloo itself; on a
    virtual cluster ``horovod_twobit.cluster_profile.from_cluster`` replaces it with Horovod's
    own, measured); on a GPU, where NCCL sums, with torch's float16 add there."""
    import numpy as np
    import torch
    a, b = torch.randn(n, device=device), torch.randn(n, device=device)
    o = torch.empty(n, device=device)
    if torch.device(device).type == "cpu":
        h = np.random.rand(n // 4).astype(np.float16)
        h2, ho = h.copy(), h.copy()
        add16 = lambda: np.add(h, h2, out=ho)
    else:
        h = torch.rand(n // 4, device=device, dtype=torch.float16)
        ho = h.clone()
        add16 = lambda: torch.add(h, h, out=ho)
    p = torch.nn.Parameter(torch.randn(n, device=device))
    p.grad = torch.randn(n, device=device)
    opt = torch.optim.SGD([p], lr=0.1)
    half = torch.empty(n, dtype=torch.float16, device=device)
    d = torch.empty(n, device=device)
    m, q = torch.randn(2048, 2048, device=device), torch.randn(2048, 4, device=device)
    return {
        "sum_fp32_s": _median_time(lambda: torch.add(a, b, out=o), reps, timer) / n,
        "sum_fp16_s": _median_time(add16, reps, timer) / (n // 4),
        "cast_fp16_s": _median_time(lambda: half.copy_(a), reps, timer) / n,
        "copy_s_per_byte": _median_time(lambda: d.copy_(a), reps, timer) / (4 * n),
        "optimizer_s": _median_time(opt.step, reps, timer) / n,
        "powersgd_s": _median_time(lambda: m @ q, reps, timer) / (2048 * 2048 * 4),
    }


def _time_network(nbytes=64 << 20, rounds=2000, timer=None, dilation=1.0):
    """The kernel's CPU seconds per byte a host sends and receives over TCP (both ends of a
    loopback connection in this process, so each byte is sent once and received once; by
    ``timer``, default CPU seconds), and the software latency of a small message (half a round
    trip between two threads; wall seconds, over the dilation where ``timer`` has one)."""
    import socket
    import threading
    import time
    timer = timer or time.process_time
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    cli = socket.create_connection(srv.getsockname())
    con, _ = srv.accept()
    buf = bytearray(1 << 20)
    recv = bytearray(1 << 20)

    def sink(total):
        view = memoryview(recv)
        while total > 0:
            total -= con.recv_into(view)
    th = threading.Thread(target=sink, args=(nbytes,))
    c0 = timer()
    th.start()
    for _ in range(nbytes // len(buf)):
        cli.sendall(buf)
    th.join()
    cpu = timer() - c0

    def echo():
        for _ in range(rounds):
            con.sendall(con.recv(1))
    th = threading.Thread(target=echo)
    th.start()
    t0 = time.perf_counter()
    for _ in range(rounds):
        cli.sendall(b"x")
        cli.recv(1)
    rtt = (time.perf_counter() - t0) / rounds / dilation
    th.join()
    for s in (cli, con, srv):
        s.close()
    return {"kernel_s_per_byte": cpu / nbytes, "message_s": rtt / 2}
