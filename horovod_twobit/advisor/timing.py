"""How :mod:`horovod_twobit.advisor.calibrate` reads its clocks and what it times: the clock
(:class:`_Timer`: this process's CPU seconds, or wall seconds over a dilation, each reading
spanning at least a given wall time), the median of repeated readings (:func:`_median_time`), and the
workloads: each codec call on a bucket (:func:`_time_codec`), the exchange's and optimizer's
per-value work (:func:`_time_per_value`) and the kernel's TCP work and a message's latency
(:func:`_time_network`). The fits of what they return are in :mod:`horovod_twobit.advisor.codec_fit`."""

from horovod_twobit.wire import layout as _layout
from horovod_twobit.wire import scatter as _sw
from horovod_twobit import wire as _wire

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


def _time_codec(n, N, reps, timer=None, device="cpu", members=1, numels=None,
                autos=(False, True), blocks=None):
    """Seconds of each codec call on a bucket of n values among N ranks (the other ranks'
    payloads are copies of this one's), its tensors on ``device``: one tensor, or ``members``
    members of (nearly) equal size, or members of the sizes ``numels`` (n and members unused);
    with a numeric threshold and "auto" (``autos``: which), "auto" cut into the compressor's
    blocks or ``blocks`` = (block, blocks)."""
    import torch
    from horovod_twobit.torch.codec import scatter as scatter_codec
    from horovod_twobit.torch import codec
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
    virtual cluster ``horovod_twobit.advisor.cluster_profile.from_cluster`` replaces it with Horovod's
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
    per = {
        "sum_fp32_s": _median_time(lambda: torch.add(a, b, out=o), reps, timer) / n,
        "sum_fp16_s": _median_time(add16, reps, timer) / (n // 4),
        "cast_fp16_s": _median_time(lambda: half.copy_(a), reps, timer) / n,
        "copy_s_per_byte": _median_time(lambda: d.copy_(a), reps, timer) / (4 * n),
        "optimizer_s": _median_time(opt.step, reps, timer) / n,
        "powersgd_s": _median_time(lambda: m @ q, reps, timer) / (2048 * 2048 * 4),
    }
    if torch.device(device).type == "cpu":  # a GPU's caching allocator maps nothing per step
        per["page_s"] = _time_page(reps, timer)
    return per


def _time_page(reps, timer=None, nbytes=64 << 20):
    """Seconds per page of a buffer allocated anew, written once and freed, beyond writing a kept
    buffer of the same size: the kernel's fault, zero-fill and unmap of each page, which a step
    pays for every buffer of at least 32 MiB it allocates (:func:`horovod_twobit.model.units.
    fresh_pages`)."""
    import torch
    from horovod_twobit.model.units import PAGE_BYTES
    kept = torch.empty(nbytes, dtype=torch.uint8)
    fresh = _median_time(lambda: torch.empty(nbytes, dtype=torch.uint8).fill_(1), reps, timer)
    reused = _median_time(lambda: kept.fill_(1), reps, timer)
    return max(0.0, fresh - reused) / (nbytes // PAGE_BYTES)


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
