"""NumPy reference implementation of the 2-bit scheme: the oracle the tests compare against.

Written for clarity, not speed: it follows MXNet's ``quantize_2bit`` / ``dequantize_2bit`` kernels
value by value in float32, so its bits are MXNet's bits.
"""

import numpy as np

from . import scatter_wire, wire

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


def aggregate(decoded, op="average", prescale=1.0, postscale=1.0):
    """Sums decoded float32 arrays in rank order, then applies the op as the communicator does:
    divide by the number of ranks for ``average``, then multiply by prescale * postscale when that
    product is not 1."""
    out = np.zeros_like(decoded[0], dtype=np.float32)
    for d in decoded:
        out += d
    if op == "average":
        out /= np.float32(len(decoded))
    scale = float(prescale) * float(postscale)
    if scale != 1.0:
        out *= np.float32(scale)
    return out


class Workers:
    """N simulated workers with one residual per tensor name each: what N ranks of the real
    communicator compute, step by step. ``threshold`` may be ``"auto"`` (each rank picks its own
    levels every step, with ``rule``: per block of :func:`horovod_twobit.wire.block_of` values with
    :func:`block_levels`, or with :func:`auto_levels` for a tensor of one block; ``block`` and
    ``blocks`` as :class:`horovod_twobit.torch.TwoBitCompressor` takes them).
    ``last_thresholds[name]``: the value each rank put in its header at the last step (the
    magnitude it sent; with blocks, the array of block magnitudes); ``last_levels[name]``: each
    rank's (threshold, magnitude). ``exchange``: ``"allgather"`` (every rank decodes every
    payload), ``"scatter"`` (see :func:`Workers.bucket`) or ``"auto"`` (per bucket, whichever
    sends fewer bytes); ``owner_residuals[rank]``: each owner's residuals, keyed by bucket."""

    def __init__(self, nranks, threshold, rule=DEFAULT_RULE, block=None, blocks=None,
                 exchange="allgather"):
        self.nranks = nranks
        self.threshold = threshold
        self.rule = rule
        self.block, self.blocks = wire.validate_blocks(threshold, block, blocks)
        self.exchange = scatter_wire.validate_exchange(exchange)
        self.residuals = [dict() for _ in range(nranks)]
        self.owner_residuals = [dict() for _ in range(nranks)]
        self.last_thresholds = {}
        self.last_levels = {}

    def _encode(self, rank, name, g):
        """One rank's error-feedback step for one tensor: (codes, per-value magnitudes)."""
        r = self.residuals[rank].setdefault(name, np.zeros(g.size, dtype=np.float32))
        block = wire.block_of(g.size, self.block, self.blocks)  # None for numeric thresholds
        t = v = self.threshold
        if block:  # "auto" only
            t, v = block_levels(r + g, block, self.rule)
        elif t == "auto":
            t, v = auto_levels(r + g, self.rule)
        self.last_levels.setdefault(name, [None] * self.nranks)[rank] = (t, v)
        if block:
            t, v = per_value(t, block, g.size), per_value(v, block, g.size)
        codes = quantize(g, r, t, v)
        return codes, np.broadcast_to(np.asarray(v, dtype=np.float32), (g.size,))

    def allreduce(self, name, grads, op="average", prescale=1.0, postscale=1.0):
        """``grads``: one array per rank. Returns the aggregated float32 array (same shape)."""
        if self.exchange != "allgather":
            return self.bucket([name], [[g] for g in grads], op, prescale, postscale)[0]
        return self._allgather(name, grads, op, prescale, postscale)

    def _allgather(self, name, grads, op, prescale, postscale):
        shape = np.shape(grads[0])
        flat = [np.asarray(g, dtype=np.float32).reshape(-1) for g in grads]
        if not all(np.isfinite(g).all() for g in flat):
            # A non-finite gradient anywhere: every rank gets NaN, no residual changes.
            for rank, g in enumerate(flat):
                self.residuals[rank].setdefault(name, np.zeros(g.size, dtype=np.float32))
            return np.full(shape, np.nan, dtype=np.float32)
        self.last_levels[name] = [None] * self.nranks
        decoded = []
        for rank, g in enumerate(flat):
            codes, v = self._encode(rank, name, g)
            decoded.append(decode(pack(codes), g.size, v))
        self.last_thresholds[name] = [v for _, v in self.last_levels[name]]
        return aggregate(decoded, op, prescale, postscale).reshape(shape)

    def bucket(self, names, grads, op="average", prescale=1.0, postscale=1.0):
        """One step of a bucket of tensors (``grads[rank][member]``); returns each member's
        result. With the allgather exchange each member's result is what it gets alone; with the
        scatter exchange see :func:`horovod_twobit.reference_scatter.exchange`."""
        from . import reference_scatter
        from .layout import Layout
        numels = [np.size(g) for g in grads[0]]
        layout = Layout(numels, self.threshold == "auto", self.block, self.blocks)
        if scatter_wire.choose(self.exchange, layout, self.nranks) == "allgather":
            return [self._allgather(n, [g[i] for g in grads], op, prescale, postscale)
                    for i, n in enumerate(names)]
        return reference_scatter.exchange(self, layout, names, grads, op, prescale, postscale)
