"""A device profile for the step-time model (:mod:`horovod_twobit.steptime`) measured on this
machine: ``python -m horovod_twobit.advise calibrate``. Each codec call is timed with the
project's own PyTorch codec functions and fitted as ``c0 + c1 N + n (a + b N)``; the other costs
the model takes per value (sums, copies, casts, the optimizer), per byte (the kernel's TCP work)
and per message are timed alike."""

import json
import os

from . import layout as _layout
from . import scatter_wire as _sw
from .steptime import CODEC_KEYS


def calibrate(path=None, sizes=(1 << 16, 1 << 20), ranks=(2, 8), threads=1, compiled=True,
              reps=5, name="cpu"):
    """Measures this machine's codec rates with the project's own codec functions (PyTorch,
    ``threads`` threads, the compiled path unless ``compiled=False``; the ones
    ``horovod_twobit.benchmarks.codec`` times, plus the "auto" and scatter ones) and the costs the
    model takes per value (sums, copies, casts, the optimizer, the kernel's TCP work per byte, the
    software latency of a message). Each codec call is fitted as ``c0 + c1 N + n (a + b N)`` from
    the sizes and rank counts timed. Returns the profile and writes it to ``path`` (JSON)."""
    import platform
    import torch
    from .torch import kernels
    torch.set_num_threads(threads)
    old = kernels.COMPILE_MIN_NUMEL
    kernels.COMPILE_MIN_NUMEL = 0 if compiled else 1 << 62
    try:
        points = {k: [] for k in CODEC_KEYS}
        for n in sizes:
            for N in ranks:
                for key, secs in _time_codec(int(n), int(N), reps).items():
                    points[key].append((int(n), int(N), secs))
        codec = {k: _fit(v) for k, v in points.items()}
        per = _time_per_value(1 << 22, reps)
    finally:
        kernels.COMPILE_MIN_NUMEL = old
    prof = {"name": name, "kind": "measured", "serial": True,
            "source": "python -m horovod_twobit.advise calibrate on %s (%s, %d thread(s), %s "
                      "codec, torch %s)" % (platform.node() or "?", _cpu_name(), threads,
                                           "compiled" if compiled else "eager", torch.__version__),
            "note": "one host = one core doing compute, codec and the exchange's CPU work",
            "codec": codec, "points": points}
    prof.update(per)
    prof.update(_time_network())
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


def _median_time(fn, reps):
    import statistics
    import time
    fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def _time_codec(n, N, reps):
    """Seconds of each codec call on one tensor of n values among N ranks (the other ranks'
    payloads are copies of this one's)."""
    import torch
    from .torch import codec, scatter_codec
    out = {}
    for auto in (False, True):
        sfx = "_auto" if auto else ""
        thr = "auto" if auto else 0.5
        lay = _layout.Layout([n], auto)
        g = torch.randn(n) * 0.3
        r = torch.zeros(n)
        payload = torch.empty(lay.payload_words, dtype=torch.int32)
        enc = lambda: codec.encode_payload(lay, r, g, thr, "lsq", payload)
        out["encode" + sfx] = _median_time(enc, reps)
        t, v = enc()
        gathered = payload.repeat(N)
        work = g.clone()
        out["finish" + sfx] = _median_time(
            lambda: codec.finish_payload(lay, gathered, N, ["x"], r, work, t, v, N, 1.0), reps)
        chunks = _sw.Chunks(lay, N)
        send, splits = scatter_codec.chunk_payloads(chunks, payload, thr)
        out["scatter_encode" + sfx] = out["encode" + sfx] + _median_time(
            lambda: scatter_codec.chunk_payloads(chunks, payload, thr), reps)
        offs = [0]
        for s in splits.tolist():
            offs.append(offs[-1] + s)
        reduced, bads = [], []
        for c in range(N):
            mine = send[offs[c]:offs[c + 1]]
            received = mine.repeat(N)
            res = torch.zeros(chunks.values(c)) if auto else None
            fn = lambda: scatter_codec.owner_reduce(chunks, received, [int(splits[c])] * N, ["x"],
                                                    c, thr, "lsq", res)
            if c == 0:
                out["owner" + sfx] = _median_time(fn, reps)
            p, bad = fn()
            reduced.append(p)
        gathered2 = torch.cat(reduced)
        out["scatter_finish" + sfx] = _median_time(
            lambda: scatter_codec.finish_reduced(chunks, gathered2, ["x"], r, work, t, v,
                                                 [False], N, 1.0), reps)
    return out


def _fit(points):
    """Least-squares (c0, c1, a, b) of seconds = c0 + c1 N + n (a + b N), each >= 0."""
    import numpy as np
    A = np.array([[1.0, N, n, n * N] for n, N, _ in points])
    y = np.array([s for _, _, s in points])
    keep = list(range(4))
    while True:
        coef = np.zeros(4)
        sol, *_ = np.linalg.lstsq(A[:, keep], y, rcond=None)
        coef[keep] = sol
        neg = [k for k in keep if coef[k] < 0]
        if not neg:
            return [float(c) for c in coef]
        keep.remove(min(neg, key=lambda k: coef[k]))


def _time_per_value(n, reps):
    """Per-value seconds of what the exchange and the optimizer do besides the codec. The float16
    sum is timed with NumPy's float16 add, which converts each value in software as Gloo's
    ``gloo::float16`` sum does (a proxy, not Gloo itself)."""
    import numpy as np
    import torch
    a, b = torch.randn(n), torch.randn(n)
    o = torch.empty(n)
    h = np.random.rand(n // 4).astype(np.float16)
    h2, ho = h.copy(), h.copy()
    p = torch.nn.Parameter(torch.randn(n))
    p.grad = torch.randn(n)
    opt = torch.optim.SGD([p], lr=0.1)
    half = torch.empty(n, dtype=torch.float16)
    d = torch.empty(n)
    m, q = torch.randn(2048, 2048), torch.randn(2048, 4)
    return {
        "sum_fp32_s": _median_time(lambda: torch.add(a, b, out=o), reps) / n,
        "sum_fp16_s": _median_time(lambda: np.add(h, h2, out=ho), reps) / (n // 4),
        "cast_fp16_s": _median_time(lambda: half.copy_(a), reps) / n,
        "copy_s_per_byte": _median_time(lambda: d.copy_(a), reps) / (4 * n),
        "optimizer_s": _median_time(opt.step, reps) / n,
        "powersgd_s": _median_time(lambda: m @ q, reps) / (2048 * 2048 * 4),
    }


def _time_network(nbytes=64 << 20, rounds=2000):
    """The kernel's CPU seconds per byte a host sends and receives over TCP (both ends of a
    loopback connection in this process, so each byte is sent once and received once), and the
    software latency of a small message (half a round trip between two threads)."""
    import socket
    import threading
    import time
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
    c0 = time.process_time()
    th.start()
    for _ in range(nbytes // len(buf)):
        cli.sendall(buf)
    th.join()
    cpu = time.process_time() - c0

    def echo():
        for _ in range(rounds):
            con.sendall(con.recv(1))
    th = threading.Thread(target=echo)
    th.start()
    t0 = time.perf_counter()
    for _ in range(rounds):
        cli.sendall(b"x")
        cli.recv(1)
    rtt = (time.perf_counter() - t0) / rounds
    th.join()
    for s in (cli, con, srv):
        s.close()
    return {"kernel_s_per_byte": cpu / nbytes, "message_s": rtt / 2}
