"""Fused codec kernels: one pass over memory for each of pack, commit and decode-sum.

The quantize/pack and commit bodies are plain torch ops. For tensors of at least
``COMPILE_MIN_NUMEL`` values they run through ``torch.compile`` (Inductor fuses each body into one
vectorized loop on CPU and GPU); below that, or where compilation is unavailable or disabled
(``HOROVOD_TWOBIT_COMPILE=0``), the same bodies run eagerly. Both paths give the same bits: the
bodies use only exact float32 operations (add, compare, subtract a threshold, select) whose results
do not depend on fusion. Decoding needs no compiler: it is a table lookup per byte (``index_select``),
which is as fast on both.

Compiled graphs are dynamic in the tensor length, so Inductor compiles once per (function, dtype,
device), never per step. The threshold and divisor travel as 0-d tensors, so a
new value does not recompile either.

Extra memory per tensor: the float32 residual (persistent), the packed payload (n/4 bytes) and the
gathered payloads (N * n/4 bytes) while a step is in flight; the eager path adds float32 and uint8
temporaries of the tensor's size.
"""

import os
import threading
import warnings

import torch

from .. import wire

COMPILE_MIN_NUMEL = int(os.environ.get("HOROVOD_TWOBIT_COMPILE_MIN_NUMEL", 1 << 16))
_lock = threading.Lock()
_compiled = {}
_disabled = os.environ.get("HOROVOD_TWOBIT_COMPILE", "1") == "0"


# ----------------------------------------------------------------- kernel bodies (m % 16 == 0)

def _codes_body(r, g, t):
    """uint8 codes of ternary(r + g) (3: +t, 2: -t, 0), and whether r + g held NaN or Inf."""
    x = r + g.to(torch.float32)
    pos = (x >= t).to(torch.uint8)
    return ((x <= -t).to(torch.uint8) | pos) * 2 + pos, ~torch.isfinite(x).all()


def _bytes_body(w):
    """Packs four codes per byte. ``w`` views each four consecutive uint8 codes as one int32
    (little-endian: the first code in the lowest byte); the first code goes to the highest bits."""
    return (((w & 3) << 6) | (((w >> 8) & 3) << 4) | (((w >> 16) & 3) << 2)
            | ((w >> 24) & 3)).to(torch.uint8)


def _commit_body(r, g, t):
    """r <- (r + g) - q in place, q the ternary value of r + g."""
    x = r + g.to(torch.float32)
    r.copy_(torch.where(x >= t, x - t, torch.where(x <= -t, x + t, x)))


def _abs_sum_body(r, g):
    """sum |r + g| in float64 (the automatic threshold's 'mean' rule)."""
    return (r + g.to(torch.float32)).abs().to(torch.float64).sum()


def _sq_sum_body(r, g):
    """sum (r + g)^2 in float64 (the 'rms' rule)."""
    x = (r + g.to(torch.float32)).to(torch.float64)
    return (x * x).sum()


OPT_MULTIPLES = (0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0)


def _ternary_errors_body(r, g, ts):
    """Squared error of the ternary code for each threshold in the float64 vector ``ts``."""
    a = (r + g.to(torch.float32)).abs().to(torch.float64)
    return torch.stack([torch.where(a >= ts[i], (a - ts[i]) ** 2, a * a).sum()
                        for i in range(len(OPT_MULTIPLES))])


_BODIES = {"codes": _codes_body, "bytes": _bytes_body, "commit": _commit_body,
           "abs_sum": _abs_sum_body, "sq_sum": _sq_sum_body, "errors": _ternary_errors_body}


def _fn(name):
    """The compiled body, or the eager one when compilation is off or failed."""
    body = _BODIES[name]
    if _disabled:
        return body
    with _lock:
        fn = _compiled.get(name)
        if fn is None:
            fn = _compiled[name] = torch.compile(body, dynamic=True)
    return fn


def _run(name, *args):
    global _disabled
    if not _disabled:
        try:
            return _fn(name)(*args)
        except Exception as e:  # no compiler, unsupported device, ...: same bits, eagerly
            _disabled = True
            warnings.warn("horovod-twobit: torch.compile is unavailable (%s: %s); using the eager "
                          "codec, which gives the same results more slowly" % (type(e).__name__, e))
    return _BODIES[name](*args)


def _pick(numel):
    return "compiled" if numel >= COMPILE_MIN_NUMEL and not _disabled else "eager"


def _call(name, numel, *args):
    if _pick(numel) == "compiled":
        return _run(name, *args)
    return _BODIES[name](*args)


# ----------------------------------------------------------------- public kernels

def _t(value, device):
    if isinstance(value, torch.Tensor):
        return value
    return torch.tensor(float(value), dtype=torch.float32, device=device)


AUTO_RULES = ("mean", "rms", "opt")
_FLT_MIN = torch.finfo(torch.float32).tiny


def auto_threshold(r, g, rule="opt"):
    """The automatic threshold of r + g as a 0-d float32 tensor on their device (no host sync):
    the mean absolute value (``mean``) or the root mean square (``rms``), summed in float64,
    rounded to float32 once, and never below the smallest normal float32 (so zeros are never
    sent). Matches :func:`horovod_twobit.reference.auto_threshold`."""
    n = g.numel()
    if n == 0:
        return torch.ones((), dtype=torch.float32, device=g.device)
    rule, _, k = rule.partition("*")
    if rule == "mean":
        t = _call("abs_sum", n, r, g) / n
    elif rule == "opt":
        m = _call("abs_sum", n, r, g) / n
        ts = m * torch.tensor(OPT_MULTIPLES, dtype=torch.float64, device=g.device)
        t = ts[torch.argmin(_call("errors", n, r, g, ts))]
    elif rule == "rms":
        t = (_call("sq_sum", n, r, g) / n).sqrt()
    else:
        raise ValueError("unknown automatic threshold rule %r (known: %s)" % (rule, AUTO_RULES))
    t = (t * float(k) if k else t).to(torch.float32)
    return torch.where(t < _FLT_MIN, torch.full_like(t, _FLT_MIN), t)


def _pack_main(r, g, t):
    codes, bad = _call("codes", r.numel(), r, g, t)
    return _call("bytes", r.numel(), codes.view(torch.int32)), bad


def pack(r, g, threshold):
    """(int32 words, non-finite flag as a 0-d bool tensor) for ternary(r + g); r and g are 1-D
    with the same length; nothing is modified."""
    n = g.numel()
    m = n - n % wire.VALUES_PER_WORD
    t = _t(threshold, g.device)
    words = torch.empty(wire.num_words(n), dtype=torch.int32, device=g.device)
    byts = words.view(torch.uint8)
    flags = []
    if m:
        b, bad = _pack_main(r[:m], g[:m], t)
        byts[:m // 4].copy_(b)
        flags.append(bad)
    if m < n:
        pad = wire.VALUES_PER_WORD - (n - m)
        rt = torch.nn.functional.pad(r[m:], (0, pad))
        gt = torch.nn.functional.pad(g[m:].to(torch.float32), (0, pad))
        codes, bad = _codes_body(rt, gt, t)
        byts[m // 4:].copy_(_bytes_body(codes.view(torch.int32)))
        flags.append(bad)
    flag = flags[0] if len(flags) == 1 else (flags[0] | flags[1]) if flags else \
        torch.zeros((), dtype=torch.bool, device=g.device)
    return words, flag


def commit(r, g, threshold):
    """r <- (r + g) - q in place (r 1-D contiguous float32, g 1-D of the same length)."""
    if r.numel():
        _call("commit", r.numel(), r, g, _t(threshold, r.device))


_BYTE_CODES = {}
JOINT_MIN_BYTES = 1 << 16


def _lut(t, device):
    """(256, 4) float32: the four values each byte decodes to (+t for 11, -t for 10, else 0)."""
    c = _BYTE_CODES.get(device)
    if c is None:
        b = torch.arange(256, dtype=torch.int32, device=device)
        c = _BYTE_CODES[device] = torch.stack([(b >> s) & 3 for s in (6, 4, 2, 0)], dim=1)
    t = _t(t, device)
    return torch.where(c == 3, t, torch.where(c == 2, -t, torch.zeros_like(t)))


def _gather(table, idx):
    """table[idx] for a (K, 4) float32 table: rows gathered as 16-byte complex128 elements, the
    fastest native gather (bits are copied, never computed on: finite float32 pairs are never a
    NaN double)."""
    return table.view(torch.complex128).view(-1).index_select(0, idx).view(torch.float32)


def decode_sum(rows, thresholds, numel, divisor=1.0, scale=1.0):
    """float32 sum, in rank order, of the decoded ``rows`` (1-D int32 words, one per rank, each
    with ``thresholds[i]``), divided by ``divisor`` and multiplied by ``scale``.

    Decoding is a table lookup per byte: each byte gathers its four float32 values. For large
    tensors the first two ranks share one 65536-entry table of their sums (with the division and
    scale folded in when there are only two), so their bytes are read once and the output written
    once. The float32 operations and their order are those of the reference: v0 + v1 + ... then
    / divisor, then * scale."""
    dev = rows[0].device
    nbytes = wire.num_words(numel) * 4
    if numel == 0:
        return torch.empty(0, dtype=torch.float32, device=dev)
    d, s = _t(divisor, dev), _t(scale, dev)
    luts = [_lut(t, dev) for t in thresholds]
    byts = [w.view(torch.uint8)[:nbytes].to(torch.int32) for w in rows]
    last = len(rows) == 1 or (len(rows) == 2 and nbytes >= JOINT_MIN_BYTES)
    if len(rows) >= 2 and nbytes >= JOINT_MIN_BYTES:
        joint = (luts[0].unsqueeze(1) + luts[1].unsqueeze(0)).reshape(65536, 4)
        out = _gather(joint / d * s if last else joint, byts[0] * 256 + byts[1])
        rest = 2
    else:
        out = _gather(luts[0] / d * s if last else luts[0], byts[0])
        rest = 1
    for i in range(rest, len(rows)):
        out += _gather(luts[i], byts[i])
    if not last:
        out /= d
        out *= s
    return out[:numel]
