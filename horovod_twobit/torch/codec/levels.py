"""Automatic levels (``threshold="auto"``): the (threshold, magnitude) of r + g, of each block, or
of each segment of a bucket, as :func:`horovod_twobit.reference.auto_levels` computes them, bit
for bit. :mod:`horovod_twobit.torch.codec.kernels` re-exports :func:`auto_levels`, :func:`block_levels`
and :func:`auto_threshold`; :func:`horovod_twobit.torch.codec.segment_levels` calls
:func:`table_levels`.

The default rule, ``lsq``, is one body that does all of it for a table of rows: |r + g|, its
float64 mean m, the candidate thresholds m * OPT_MULTIPLES, the count and float64 sum of |r + g|
at or above each candidate, the choice and the rounding. Compiled (with the kernels' compiler,
from ``COMPILE_MIN_NUMEL // 256`` values), a table costs one call: per row, one pass for the mean
and one for every candidate. Smaller tables run eagerly, in a broadcast form of a few dozen ops.
The other rules (``opt``, ``mean``, ``rms``) use the reductions below, then the same rounding.

Sums run in float64 and each level is rounded to float32 once, so any summation order gives the
reference's bits (in all but astronomically rare cases: tests/test_auto_threshold.py checks
widely spread magnitudes). Counts are exact.
"""

import torch

from horovod_twobit import wire
from horovod_twobit.torch.codec import compiled

F32, F64 = torch.float32, torch.float64
OPT_MULTIPLES = wire.OPT_MULTIPLES
AUTO_RULES, DEFAULT_RULE = wire.AUTO_RULES, wire.DEFAULT_RULE
_FLT_MIN = torch.finfo(F32).tiny
_CONSTANTS = {}


def _constant(values, device):
    """A float64 tensor of ``values`` on ``device``, made once (no copy to the device per call)."""
    t = _CONSTANTS.get((values, device))
    if t is None:
        t = _CONSTANTS[(values, device)] = torch.tensor(values, dtype=F64, device=device)
    return t


# ----------------------------------------------------------------- bodies (last dimension: a row)

def _abs_sum_body(r, g):
    """sum |r + g| in float64 over the last dimension (the 'mean' rule)."""
    return (r + g.to(F32)).abs().to(F64).sum(-1)


def _sq_sum_body(r, g):
    """sum (r + g)^2 in float64 over the last dimension (the 'rms' rule)."""
    x = (r + g.to(F32)).to(F64)
    return (x * x).sum(-1)


def _ternary_errors_body(r, g, ts):
    """Squared error of the ternary code for each threshold in the float64 ``ts`` (last dimension:
    one per multiple; leading ones: one row of r and g each), summed over the last dimension."""
    a = (r + g.to(F32)).abs().to(F64)
    return torch.stack([torch.where(a >= ts[..., i:i + 1], (a - ts[..., i:i + 1]) ** 2, a * a).sum(-1)
                        for i in range(len(OPT_MULTIPLES))], -1)


def _masked_abs(r, g, n):
    """|r + g| in float32, 0 beyond each row's first ``n`` values (a (rows, 1) int64 tensor; None:
    every value counts). A 0 is never counted where the mean is not 0, and adds nothing."""
    x = (r + g.to(F32)).abs()
    if n is None:
        return x
    return torch.where(torch.arange(x.shape[-1], device=x.device) < n, x, 0.0)


def _rounded(t, v, factor):
    """(2, rows) float32 of the float64 levels t and v, times ``factor`` (None, or a float64 0-d
    tensor) first, never below the smallest normal float32 (NaN stays NaN)."""
    y = torch.stack([t, v])
    y = (y if factor is None else y * factor).to(F32)
    return torch.where(y < _FLT_MIN, _FLT_MIN, y)


def _chosen(ts, count, total, factor):
    """The lsq levels from the candidates ``ts`` and the count and sum of |r + g| at or above each
    (float64, (rows, multiples)): the largest total^2 / count (the first on ties), its threshold
    and its mean (the threshold where nothing reaches it)."""
    has = count > 0
    score = torch.where(has, total * total / torch.where(has, count, 1.0), 0.0)
    best = torch.argmax(score, -1, keepdim=True)
    t = ts.gather(-1, best).squeeze(-1)
    count, total = count.gather(-1, best).squeeze(-1), total.gather(-1, best).squeeze(-1)
    v = torch.where(count > 0, total / torch.where(count > 0, count, 1.0), t)
    return _rounded(t, v, factor)


def _lsq_rows(r, g, n, mult, factor):
    """The compiled form: one reduction per candidate, written out, so that Inductor runs them
    all in one loop over each row (a broadcast over the candidates loops once per candidate).
    Rows of up to 4 K values (Inductor compiles them apart anyway) count in float32, exact there
    and faster; longer ones in float64, faster there (measured on a CPU). Returns the
    candidates too: as an output they are computed once per row, before that loop (else
    Inductor recomputes them inside it: with lengths, a division per 8 values and candidate)."""
    a = _masked_abs(r, g, n).to(F64)
    ts = a.sum(-1, keepdim=True) / (a.shape[-1] if n is None else n) * mult
    cdt = F32 if a.shape[-1] <= 4096 else F64
    sent = [a >= ts[:, i:i + 1] for i in range(len(OPT_MULTIPLES))]
    count = torch.stack([s.to(cdt).sum(-1) for s in sent], -1).to(F64)
    total = torch.stack([torch.where(s, a, 0.0).sum(-1) for s in sent], -1)
    return _chosen(ts, count, total, factor), ts


# two bodies, two code objects: Dynamo keeps (and limits) its compiled variants per code object
def _lsq_body(r, g, mult, factor):
    return _lsq_rows(r, g, None, mult, factor)


def _lsq_masked_body(r, g, n, mult, factor):
    return _lsq_rows(r, g, n, mult, factor)


def _lsq_eager(r, g, n, mult, factor):
    """The eager form: every candidate in one broadcast comparison."""
    a = _masked_abs(r, g, n).to(F64)
    ts = a.sum(-1, keepdim=True) / (a.shape[-1] if n is None else n) * mult
    a = a.unsqueeze(-2)  # (rows, 1, n)
    sent = a >= ts.unsqueeze(-1)  # (rows, multiples, n)
    return _chosen(ts, sent.sum(-1).to(F64), torch.where(sent, a, 0.0).sum(-1), factor)


compiled.BODIES.update({"abs_sum": _abs_sum_body, "sq_sum": _sq_sum_body,
                        "errors": _ternary_errors_body, "lsq_levels": _lsq_body,
                        "lsq_levels_masked": _lsq_masked_body})


# ----------------------------------------------------------------- rows, tensors, blocks

def levels(r, g, rule=DEFAULT_RULE, n=None):
    """(2, rows) float32, the thresholds then the magnitudes, of each row of r + g (2-D, on their
    device, no host sync); only the first ``n`` values of each row count when ``n`` (a (rows, 1)
    int64 tensor, none of them 0) is given. Rows of no values get 1.0. See :func:`auto_levels`."""
    if r.numel() == 0:
        return torch.ones((2, r.shape[0]), dtype=F32, device=r.device)
    rule, k = wire.parse_rule(rule)
    factor = _constant(float(k), r.device) if k else None
    numel, mult = r.numel(), _constant(OPT_MULTIPLES, r.device)
    if rule == "lsq":
        # one compiled call costs less than the eager ops from a few hundred values
        if numel < compiled.COMPILE_MIN_NUMEL // 256 or compiled.disabled:
            return _lsq_eager(r, g, n, mult, factor)
        if n is None:
            return compiled.run("lsq_levels", r, g, mult, factor)[0]
        return compiled.run("lsq_levels_masked", r, g, n, mult, factor)[0]
    if n is not None:  # zeros beyond each row's values add nothing to any of these sums
        keep = torch.arange(r.shape[-1], device=r.device) < n
        r, g = torch.where(keep, r, 0.0), torch.where(keep, g, 0.0)
    n = r.shape[-1] if n is None else n.squeeze(-1)
    if rule == "mean":
        t = compiled.call("abs_sum", numel, r, g) / n
    elif rule == "rms":
        t = (compiled.call("sq_sum", numel, r, g) / n).sqrt()
    else:  # "opt"
        ts = (compiled.call("abs_sum", numel, r, g) / n).unsqueeze(-1) * mult
        best = torch.argmin(compiled.call("errors", numel, r, g, ts), -1, keepdim=True)
        t = ts.gather(-1, best).squeeze(-1)
    return _rounded(t, t, factor)


def auto_levels(r, g, rule=DEFAULT_RULE):
    """``(threshold, magnitude)`` for r + g, two 0-d float32 tensors on their device (no host
    sync): values at or beyond the threshold are sent as +-magnitude. The rules are those of
    :func:`horovod_twobit.reference.auto_levels` (``lsq``: the least-squares magnitude of the
    error-minimising support; ``opt``, ``mean``, ``rms``: magnitude = threshold), with sums in
    float64, each value rounded to float32 once and never below the smallest normal float32 (so
    zeros are never sent). Matches the reference bit for bit. For 2-D r and g, one pair per row
    (two 1-D tensors)."""
    if g.dim() == 1:
        y = levels(r.view(1, -1), g.view(1, -1), rule)
        return y[0, 0], y[1, 0]
    y = levels(r, g, rule)
    return y[0], y[1]


def block_levels(r, g, block, rule=DEFAULT_RULE):
    """Per-block :func:`auto_levels` of 1-D r + g: ``(thresholds, magnitudes)``, two 1-D float32
    tensors of ceil(n / block) values (the last block may be shorter), as
    :func:`horovod_twobit.reference.block_levels`."""
    n = g.numel()
    full = n - n % block
    parts = []
    if full:
        parts.append(levels(r[:full].view(-1, block), g[:full].view(-1, block), rule))
    if full < n:
        parts.append(levels(r[full:].view(1, -1), g[full:].view(1, -1), rule))
    if not parts:
        empty = torch.empty(0, dtype=F32, device=g.device)
        return empty, empty
    y = parts[0] if len(parts) == 1 else torch.cat(parts, 1)
    return y[0], y[1]


def auto_threshold(r, g, rule=DEFAULT_RULE):
    """The threshold of :func:`auto_levels` (for ``opt``, ``mean`` and ``rms`` also the
    magnitude), as a 0-d float32 tensor."""
    return auto_levels(r, g, rule)[0]


# ----------------------------------------------------------------- the segments of a bucket

class Tables:
    """:meth:`horovod_twobit.wire.layout.Layout.tables` on one device, made once: tables of (rows,
    width, lengths, flat start or word indices), one segment a row, one call a table.
    ``lengths`` (None where every row is full) is a (rows, 1) int64 tensor of the rows' real
    lengths; a gathered table's word indices an int64 tensor."""

    def __init__(self, layout, device):
        def ints(values):
            return torch.tensor(values, dtype=torch.int64, device=device)
        self.tables, order = [], []
        for rows, width, lengths, at, ids in layout.tables():
            gathered = isinstance(at, list)
            self.tables.append((rows, width, None if lengths is None else
                                ints(lengths).view(-1, 1), ints(at) if gathered else at))
            order += ids
        # segment k's levels are column inverse[k] of the tables' levels side by side
        inverse = [0] * len(order)
        for i, k in enumerate(order):
            inverse[k] = i
        self.inverse = None if order == sorted(order) else ints(inverse)


def table_levels(tab, r, g, rule):
    """(thresholds, magnitudes) of every segment of an "auto" layout (each member's blocks), two
    1-D float32 tensors, each segment exactly as :func:`auto_levels` reduces one tensor or block.
    ``tab`` is the layout's :class:`Tables` on the device of ``r`` and ``g``, its flat values
    (contiguous); :func:`horovod_twobit.torch.codec.segment_levels` keeps one per layout and
    device."""
    parts = []
    for k, w, n, at in tab.tables:
        if isinstance(at, int):
            x, y = r[at:at + k * w], g[at:at + k * w]
        else:
            x, y = r.view(-1, 16).index_select(0, at), g.view(-1, 16).index_select(0, at)
        parts.append(levels(x.view(k, w), y.view(k, w), rule, n))
    y = parts[0] if len(parts) == 1 else torch.cat(parts, 1)
    if tab.inverse is not None:
        y = y.index_select(1, tab.inverse)
    return y[0], y[1]
