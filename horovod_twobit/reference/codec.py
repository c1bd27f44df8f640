"""NumPy reference of the 2-bit codec: error feedback, MXNet's packing, the automatic levels.

Written for clarity, not speed: it follows MXNet's ``quantize_2bit`` / ``dequantize_2bit`` kernels
value by value in float32, so its bits are MXNet's bits. :mod:`horovod_twobit.reference` builds the
simulated workers on it, and :mod:`horovod_twobit.reference.scatter` the scatter exchange.
"""

import numpy as np

from horovod_twobit import wire

_SHIFTS = np.array([6, 4, 2, 0], dtype=np.uint8)


FLT_MIN = np.float32(np.finfo(np.float32).tiny)
OPT_MULTIPLES = wire.OPT_MULTIPLES
AUTO_RULES, DEFAULT_RULE = wire.AUTO_RULES, wire.DEFAULT_RULE


def ternary_errors(a, ts):
    """Squared error of the ternary code with threshold (and magnitude) t, for each t in ``ts``,
    over absolute values ``a`` (float64): sum (a - t)^2 where a >= t, plus sum a^2 elsewhere."""
    return [float(np.where(a >= t, (a - t) ** 2, a * a).sum()) for t in ts]


def lsq_scores(a, ts):
    """For each support threshold t in ``ts``: (count, sum) of the absolute values ``a`` (float64)
    with a >= t. The least-squares magnitude of that support is sum / count, and its squared
    error is sum(a^2) - sum^2 / count: the largest sum^2 / count is the smallest error."""
    return [(int((a >= t).sum()), float(np.where(a >= t, a, 0.0).sum())) for t in ts]


def auto_levels(x, rule=DEFAULT_RULE):
    """``(threshold, magnitude)``, both float32, for float32 values ``x`` (the error-compensated
    r + g): values with x >= threshold are sent as +magnitude, x <= -threshold as -magnitude.

    ``lsq`` (the default of ``threshold="auto"``): for each support threshold c * mean|x|, c in
    ``OPT_MULTIPLES``, the magnitude that minimises the squared error on that support is the mean of
    |x| over it; the pair with the smallest error wins (the first on ties). ``opt``: among the same
    thresholds, the one that minimises the error when the magnitude equals the threshold (MXNet's
    code); ``mean``: the mean absolute value; ``rms``: the root mean square; for these three the
    magnitude is the threshold. A ``*K`` suffix multiplies both by K. Sums run in float64 and each
    value is rounded to float32 once, so any summation order gives the same bits (in all but
    astronomically rare cases). Never below the smallest normal float32, so zeros are never sent."""
    x = np.asarray(x, dtype=np.float32).reshape(-1)
    if x.size == 0:
        return np.float32(1.0), np.float32(1.0)
    a = np.abs(x).astype(np.float64)
    rule, k = wire.parse_rule(rule)
    if rule == "mean":
        t = v = a.sum() / x.size
    elif rule in ("opt", "lsq"):
        m = a.sum() / x.size
        ts = [c * m for c in OPT_MULTIPLES]
        if rule == "opt":
            t = v = ts[int(np.argmin(ternary_errors(a, ts)))]
        else:
            scores = lsq_scores(a, ts)
            best = int(np.argmax([s * s / c if c else 0.0 for c, s in scores]))
            c, s = scores[best]
            t = ts[best]
            v = s / c if c else t
    else:  # "rms"
        t = v = np.sqrt((a * a).sum() / x.size)
    levels = []
    for y in (t, v):
        y = np.float32(y * float(k)) if k else np.float32(y)
        levels.append(y if not (y < FLT_MIN) else FLT_MIN)  # NaN stays NaN
    return tuple(levels)


def block_levels(x, block, rule=DEFAULT_RULE):
    """Per-block :func:`auto_levels`: ``(thresholds, magnitudes)``, two float32 arrays of
    ceil(n / block) values, block b covering values b * block up to (b + 1) * block (the last
    block may be shorter)."""
    x = np.asarray(x, dtype=np.float32).reshape(-1)
    levels = [auto_levels(x[a:a + block], rule) for a in range(0, x.size, block)]
    return (np.array([t for t, _ in levels], dtype=np.float32),
            np.array([v for _, v in levels], dtype=np.float32))


def per_value(levels, block, numel):
    """Per-block values repeated over each block's values: a float32 array of ``numel``."""
    return np.repeat(np.asarray(levels, dtype=np.float32), block)[:numel]


def auto_threshold(x, rule=DEFAULT_RULE):
    """The threshold of :func:`auto_levels` (for ``mean``, ``rms`` and ``opt`` also the
    magnitude)."""
    return auto_levels(x, rule)[0]


def quantize(grad, residual, threshold, magnitude=None):
    """One step of error feedback on float32 arrays: r += g; q = ternary(r); r -= q, where q is
    +magnitude for r >= threshold, -magnitude for r <= -threshold, else 0 (magnitude defaults to
    the threshold: MXNet's scheme). Both may be per-value float32 arrays (blocks, see
    :func:`per_value`).

    Updates ``residual`` in place and returns the codes (uint8, one per value: 0, 2 or 3)."""
    t = np.asarray(threshold, dtype=np.float32)
    v = t if magnitude is None else np.asarray(magnitude, dtype=np.float32)
    g = np.asarray(grad, dtype=np.float32).reshape(-1)
    r = residual.reshape(-1)
    assert r.dtype == np.float32
    t, v = np.broadcast_to(t, r.shape), np.broadcast_to(v, r.shape)
    r += g
    pos = r >= t
    neg = r <= -t
    codes = np.zeros(r.shape, dtype=np.uint8)
    codes[pos] = wire.CODE_POS
    codes[neg] = wire.CODE_NEG
    r[pos] -= v[pos]
    r[neg] -= -v[neg]
    return codes


def pack(codes):
    """Packs 2-bit codes into int32 words in MXNet's layout."""
    n = codes.size
    padded = np.zeros(wire.num_words(n) * 16, dtype=np.uint8)
    padded[:n] = codes
    quads = padded.reshape(-1, 4)
    byts = (quads << _SHIFTS).sum(axis=1).astype(np.uint8)
    return byts.view(np.int32).copy()


def unpack(words, numel):
    """The codes (uint8) of the first ``numel`` values of packed ``words``."""
    byts = np.ascontiguousarray(words, dtype=np.int32).view(np.uint8)
    codes = (byts[:, None] >> _SHIFTS) & 3
    return codes.reshape(-1)[:numel]


def encode(grad, residual, threshold, magnitude=None):
    """Quantizes with error feedback and packs: returns int32 words, updates ``residual``."""
    return pack(quantize(grad, residual, threshold, magnitude))


def decode(words, numel, threshold):
    """float32 values of packed words: +t for ``11``, -t for ``10``, 0 otherwise (t may be a
    per-value float32 array)."""
    t = np.broadcast_to(np.asarray(threshold, dtype=np.float32), (numel,))
    codes = unpack(words, numel)
    out = np.zeros(numel, dtype=np.float32)
    out[codes == wire.CODE_POS] = t[codes == wire.CODE_POS]
    out[codes == wire.CODE_NEG] = -t[codes == wire.CODE_NEG]
    return out
