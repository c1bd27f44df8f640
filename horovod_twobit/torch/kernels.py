"""Codec kernels: pack (a codes pass and a byte-packing pass, chunk by chunk), finish (one pass
after the gather: the residual update and the decode-sum), and the plain commit and decode-sum.

The bodies are plain torch ops, registered in :mod:`.compiled`: for tensors of at least
``compiled.COMPILE_MIN_NUMEL`` values they run through ``torch.compile`` (Inductor fuses each body
into one vectorized loop on CPU and GPU); below that, or where compilation is unavailable or
disabled (``HOROVOD_TWOBIT_COMPILE=0``), the same bodies run eagerly. The scatter exchange's chunks
of a bucket choose by the bucket's size (:func:`compiled.sized_as`). Both paths give the same
bits: the bodies use only exact float32 operations (add, compare, subtract a threshold, select,
one division, one multiplication) whose results do not depend on fusion. (On a GPU, Triton's
float32 division is approximate: compilations ask Inductor for a correctly rounded one where it
offers it, else the division runs eagerly after the compiled pass, see :func:`_late_division`.
On a GPU :func:`pack` also packs whole words in one pass rather than in cache-sized chunks of
two.)

Compiled graphs are dynamic in the tensor length, so Inductor compiles once per (function, dtype,
device), never per step. The threshold and divisor travel as 0-d tensors, so a new value does not
recompile either.

Why the residual update is not in the encode pass: a step in which any rank's gradient held NaN or
Inf must leave every residual as it was, and that is known only after the gather. So encode reads
r and g and writes the payload; :func:`finish` reads r, g and the gathered payloads and writes r and
the result (over g itself for an in-place allreduce, which is what ``hvd.DistributedOptimizer``
does): two passes over the gradient's memory per step, as a fused encode plus a decode would be.

Extra memory per tensor: the float32 residual (persistent), the payload (n/4 bytes), the gathered
payloads (N * n/4 bytes) while a step is in flight, the codes of one chunk (at most 4 MB, between
the two pack passes), and the float32 result for an out-of-place allreduce (an in-place one writes
over the gradient). The eager path adds float32 and integer temporaries of the tensor's size.
"""

import torch

from .. import wire
from . import compiled



# ----------------------------------------------------------------- kernel bodies (m % 16 == 0)

def _ternary_codes(x, t):
    """uint8 codes of ternary(x): 3 where x >= t, 2 where x <= -t, else 0."""
    # Float constants: Inductor blends float vectors and converts once (integer constants blend
    # int64 vectors, bool-to-uint8 arithmetic does not vectorize). 1.5x faster in cache, same codes.
    c = torch.where(x >= t, float(wire.CODE_POS),
                    torch.where(x <= -t, float(wire.CODE_NEG), float(wire.CODE_ZERO)))
    return c.to(torch.uint8)


def _nonfinite(x, dim=None):
    """Whether x held NaN or Inf: anywhere (0-d), or along ``dim``. x - x is NaN exactly where x
    is NaN or Inf, a cheaper test than isfinite."""
    bad = (x - x) != 0
    return bad.any() if dim is None else bad.any(dim)


def _codes_body(r, g, t):
    """uint8 codes of ternary(r + g) (3: +t, 2: -t, 0) for (words, 16) views, and whether any
    r + g held NaN or Inf (0-d)."""
    x = r + g.to(torch.float32)
    return _ternary_codes(x, t), _nonfinite(x)


def _word_codes_body(r, g, t):
    """As :func:`_codes_body`, with the non-finite flag of each word instead (a per-row
    reduction: on a CPU it costs about as much as the codes themselves)."""
    x = r + g.to(torch.float32)
    return _ternary_codes(x, t), _nonfinite(x, -1)


def _word_flags(r, g):
    """Whether each word (row of (words, 16) views) of r + g held NaN or Inf."""
    return _nonfinite(r + g.to(torch.float32), -1)


def _bytes_body(w):
    """Packs four codes per byte. ``w`` views each four consecutive uint8 codes as one int32
    (little-endian: the first code in the lowest byte); the first code goes to the highest bits."""
    return (((w & 3) << 6) | (((w >> 8) & 3) << 4) | (((w >> 16) & 3) << 2)
            | ((w >> 24) & 3)).to(torch.uint8)


def committed(r, g, t, v):
    """The error feedback's new residual (r + g) - q, q the ternary value of r + g: +v where
    r + g >= t, -v where r + g <= -t, else 0 (v is t itself for a numeric threshold). Every
    body that commits, or measures what a commit leaves, computes it here."""
    x = r + g.to(torch.float32)
    return torch.where(x >= t, x - v, torch.where(x <= -t, x + v, x))


def _commit_body(r, g, t, v):
    """r <- (r + g) - q in place (:func:`committed`)."""
    r.copy_(committed(r, g, t, v))


# levels.py and others add their own
compiled.BODIES.update({"codes": _codes_body, "word_codes": _word_codes_body,
                        "commit": _commit_body})


# ----------------------------------------------------------------- public kernels

def _t(value, device):
    if isinstance(value, torch.Tensor):
        return value
    return torch.tensor(float(value), dtype=torch.float32, device=device)


def _head(level, w):
    """A threshold or magnitude for the first ``w`` words' (w, 16) view: a 0-d one as it is, a
    per-word one (see :func:`per_word`) as a (w, 1) column."""
    return level[:w].unsqueeze(1) if level.dim() else level


def _at(level, i):
    """A threshold or magnitude for word ``i`` alone."""
    return level[i] if level.dim() else level


def flags_on_host(device):
    """Whether reading a flag on the host is free for tensors on ``device`` (a CPU), so that work
    needed only when a flag is set can be skipped; elsewhere it would wait for the device."""
    return device.type == "cpu"


def span(level, w0, nw):
    """A threshold or magnitude (a number, a 0-d or a per-word tensor) for words w0 .. w0 + nw:
    a per-word one cut to them, any other as it is."""
    return level[w0:w0 + nw] if isinstance(level, torch.Tensor) and level.dim() else level


def per_word(levels, block, numel):
    """Per-block values repeated for each packed word of their block: 1-D, ceil(numel / 16) long.
    The kernels take these wherever they take a threshold or magnitude."""
    return levels.repeat_interleave(block // wire.VALUES_PER_WORD)[:wire.num_words(numel)]


PACK_CHUNK = 1 << 22  # values per codes pass: 4 MB of codes, written and read back from cache


def _bytes_into_body(w, out):
    out.copy_(_bytes_body(w))


def _words_into_body(r, g, t, shifts, out):
    """One pass for (words, 16) views: each word's 16 codes of ternary(r + g), each shifted to
    its place (wire.WORD_SHIFTS, disjoint bits: their int64 sum is their OR) and wrapped to int32,
    written into ``out``; returns whether each word held NaN or Inf."""
    x = r + g.to(torch.float32)
    w = (_ternary_codes(x, t).to(torch.int64) << shifts).sum(-1)
    out.copy_(torch.where(w >= 1 << 31, w - (1 << 32), w).to(torch.int32))
    return _nonfinite(x, -1)


compiled.BODIES["bytes_into"] = _bytes_into_body
compiled.BODIES["words_into"] = _words_into_body


def _one_pass(device):
    """Whether :func:`pack` packs whole words in one compiled pass (a GPU: its codes pass and
    packing pass cost a call each per chunk, and the calls, not the bytes, bound it) rather than
    in cache-sized chunks of two passes (a CPU)."""
    return device.type != "cpu"


def pack(r, g, threshold, out=None, word_flags=None):
    """(int32 words, non-finite flag as a 0-d bool tensor) for ternary(r + g); r and g are 1-D
    with the same length; nothing is modified. The words go into ``out`` (1-D int32,
    ceil(n / 16) long) when given, else into a new tensor. ``threshold``: a number, a 0-d tensor,
    or one per word (:func:`per_word`). ``word_flags`` (1-D bool, one per word), when given,
    receives whether each word's values held NaN or Inf.

    Whole words run in chunks of PACK_CHUNK values, each a codes pass and a packing pass: the
    chunk's codes (one byte per value) stay in cache between the two and their buffer is reused,
    never a full-size temporary; the last, partial word is packed eagerly.

    On a CPU the codes pass computes one non-finite flag per chunk, and the flags of its words
    only when it is set (a second pass, in a step that sends NaN anyway): the per-word reduction
    would cost as much as the codes. On other devices, where reading the flag on the host would
    wait for the device, the codes pass writes the word flags itself."""
    n = g.numel()
    words = out if out is not None else torch.empty(wire.num_words(n), dtype=torch.int32, device=g.device)
    byts = words.view(torch.uint8)
    t = _t(threshold, g.device)
    m = n - n % wire.VALUES_PER_WORD
    per_word = word_flags is not None and not flags_on_host(g.device)
    flag = None
    if compiled.compiles(m) and _one_pass(g.device):
        w = m // 16
        bad = compiled.run("words_into", r[:m].view(w, 16), g[:m].view(w, 16), _head(t, w),
                   _shifts(g.device, torch.int64), words[:w])
        if word_flags is not None:
            word_flags[:w].copy_(bad)
        flag, m_done = bad.any(), m
    else:
        m_done = 0
    for a in range(m_done, m, PACK_CHUNK):
        b = min(m, a + PACK_CHUNK)
        # (words, 16) views against a 0-d threshold or a (words, 1) column of per-word ones
        rv, gv = r[a:b].view(-1, 16), g[a:b].view(-1, 16)
        codes, bad = compiled.call("word_codes" if per_word else "codes", m, rv, gv,
                           t[a // 16:b // 16].unsqueeze(1) if t.dim() else t)
        compiled.call("bytes_into", m, codes.reshape(-1).view(torch.int32), byts[a // 4:b // 4])
        if per_word:
            word_flags[a // 16:b // 16].copy_(bad)
            bad = bad.any()
        elif word_flags is not None:
            if bad:
                word_flags[a // 16:b // 16].copy_(_word_flags(rv, gv))
            else:
                word_flags[a // 16:b // 16].zero_()
        flag = bad if flag is None else flag | bad
    if m < n:
        pad = wire.VALUES_PER_WORD - (n - m)
        rt = torch.nn.functional.pad(r[m:], (0, pad)).view(1, 16)
        gt = torch.nn.functional.pad(g[m:].to(torch.float32), (0, pad)).view(1, 16)
        codes, bad = _word_codes_body(rt, gt, _at(t, m // 16))
        byts[m // 4:].copy_(_bytes_body(codes.reshape(-1).view(torch.int32)))
        if word_flags is not None:
            word_flags[m // 16:].copy_(bad)
        bad = bad.any()
        flag = bad if flag is None else flag | bad
    if flag is None:
        flag = torch.zeros((), dtype=torch.bool, device=g.device)
    return words, flag


def commit(r, g, threshold, magnitude=None):
    """r <- (r + g) - q in place (r 1-D contiguous float32, g 1-D of the same length); q is
    +-magnitude (default: the threshold) where |r + g| reaches the threshold. Either may be one
    per word (:func:`per_word`)."""
    if r.numel():
        over_words("commit", r, g, threshold, magnitude)


def over_words(name, r, g, threshold, magnitude=None):
    """The results of body ``name`` (r, g, threshold, magnitude; elementwise over r and g) over
    1-D ``r`` and ``g`` (non-empty): one call when the threshold and magnitude are numbers or 0-d,
    else one over the whole words' (w, 16) views with per-word columns and one, eager, over the
    last partial word."""
    n = r.numel()
    t = _t(threshold, r.device)
    v = t if magnitude is None else _t(magnitude, r.device)
    if not (t.dim() or v.dim()):
        return [compiled.call(name, n, r, g, t, v)]
    m = n - n % wire.VALUES_PER_WORD
    w = m // wire.VALUES_PER_WORD
    out = []
    if m:
        out.append(compiled.call(name, n, r[:m].view(w, 16), g[:m].view(w, 16), _head(t, w),
                         _head(v, w)))
    if m < n:
        out.append(compiled.BODIES[name](r[m:], g[m:], _at(t, w), _at(v, w)))
    return out


_SHIFTS = {}
SHIFTS = list(wire.WORD_SHIFTS)


def _shifts(device, dtype=torch.int32):
    sh = _SHIFTS.get((device, dtype))
    if sh is None:
        sh = _SHIFTS[(device, dtype)] = torch.tensor(SHIFTS, dtype=dtype, device=device)
    return sh


def _decoded(words, ts, shifts, divisor, scale):
    """(words, 16) float32: the sum over ranks, in rank order, of each rank's decoded int32 words
    (16 values a word, so the inner loop is one vector), then / divisor, * scale."""
    out = None
    for i in range(len(words)):
        c = (words[i].unsqueeze(1) >> shifts) & 3
        t = ts[i]
        v = torch.where(c == wire.CODE_POS, t, torch.where(c == wire.CODE_NEG, -t, torch.zeros_like(t)))
        out = v if out is None else out + v
    return out if divisor is None else out / divisor * scale


def _decode_body(words, ts, shifts, divisor, scale):
    return _decoded(words, ts, shifts, divisor, scale).reshape(-1)


def _finish_body(words, ts, shifts, divisor, scale, r, g, t, v, out):
    """One pass after the gather: r <- (r + g) - q (the commit), then the decode-sum written once,
    into ``out``, or over ``g`` when ``out`` is None (every value of g is read before it is
    written). r, g and out are (words, 16) views."""
    r.copy_(committed(r, g, t, v))
    dest = g if out is None else out
    dest.copy_(_decoded(words, ts, shifts, divisor, scale).to(dest.dtype))


def _decode_into_body(words, ts, shifts, divisor, scale, out):
    out.copy_(_decoded(words, ts, shifts, divisor, scale))


compiled.BODIES["decode"] = _decode_body
compiled.BODIES["decode_into"] = _decode_into_body
compiled.BODIES["finish"] = _finish_body


def decode_sum(rows, thresholds, numel, divisor=1.0, scale=1.0, out=None):
    """float32 sum, in rank order, of the decoded ``rows`` (1-D int32 words, one per rank, each
    with ``thresholds[i]``: a number, or one per word), divided by ``divisor`` and multiplied by ``scale``: the reference's
    float32 operations in the reference's order (v0 + v1 + ..., then / divisor, then * scale).
    The padding codes of the last word are 00, so decoding whole words and keeping the first
    ``numel`` values is exact. ``out`` (1-D float32 of the whole words' 16 * ceil(numel / 16)
    values) receives them, padding included (+0.0), instead of a new tensor."""
    dev = rows[0].device
    if numel == 0:
        return torch.empty(0, dtype=torch.float32, device=dev)
    nw = wire.num_words(numel)
    divisor, scale = _t(divisor, dev), _t(scale, dev)
    args = ([w[:nw] for w in rows], [_head(_t(t, dev), nw) for t in thresholds], _shifts(dev))
    if out is None:
        return call_divided("decode", numel, dev, *args, divisor=divisor, scale=scale)[:numel]
    call_divided("decode_into", numel, dev, *args, divisor=divisor, scale=scale,
                 out=out.view(nw, 16))
    return out[:numel]


def call_divided(name, numel, device, *args, divisor, scale, out=None):
    """:func:`compiled.call` of a body that takes a divisor and a scale after ``args`` (then
    ``out``, where given) and gives x / divisor * scale (returned, or written into ``out``):
    where the division must be late (:func:`_late_division`), the body runs without them and an
    eager, correctly rounded division follows. Returns the result (``out`` where given)."""
    tail = () if out is None else (out,)
    if _late_division(device, numel):
        x = compiled.call(name, numel, *args, None, None, *tail)
        return (x if out is None else out).div_(divisor).mul_(scale)
    x = compiled.call(name, numel, *args, divisor, scale, *tail)
    return x if out is None else out


def _late_division(device, numel):
    """Whether the division by the number of ranks must run outside the compiled body: on a GPU
    where Inductor cannot divide correctly rounded (:func:`compiled.exact_division`), the
    compiled pass sums and an eager division, correctly rounded, follows (two more passes over
    the result)."""
    return device.type == "cuda" and compiled.compiles(numel) and not compiled.exact_division()


def finish(rows, thresholds, r, g, threshold, divisor=1.0, scale=1.0, out=None, magnitude=None):
    """After the gather, in one pass: commits this rank's error-feedback step (r <- (r + g) - q,
    as :func:`commit`, with ``magnitude``) and writes the decode-sum of ``rows`` (as
    :func:`decode_sum`) into ``out`` (1-D, float32 or g's dtype, rounded from the float32 sum),
    or over ``g`` itself when ``out`` is None: the in-place allreduce of a gradient then needs no output allocation and no copy.
    ``r`` is 1-D contiguous float32; ``g`` 1-D contiguous. Thresholds and magnitudes may be one
    per word (:func:`per_word`). Returns the tensor written."""
    n = g.numel()
    dest = g if out is None else out
    if n == 0:
        return dest
    dev = g.device
    m = n - n % wire.VALUES_PER_WORD
    ts = [_t(t, dev) for t in thresholds]
    t, divisor, scale = _t(threshold, dev), _t(divisor, dev), _t(scale, dev)
    v = t if magnitude is None else _t(magnitude, dev)
    if m:
        w = m // wire.VALUES_PER_WORD
        if _late_division(dev, m):  # the sum into a float32 buffer, then / divisor, * scale
            tmp = torch.empty((w, 16), dtype=torch.float32, device=dev)
            compiled.call("finish", m, [row[:w] for row in rows], [_head(x, w) for x in ts],
                          _shifts(dev), None, scale, r[:m].view(w, 16), g[:m].view(w, 16),
                          _head(t, w), _head(v, w), tmp)
            dest[:m].view(w, 16).copy_(tmp.div_(divisor).mul_(scale))
        else:
            compiled.call("finish", m, [row[:w] for row in rows], [_head(x, w) for x in ts],
                          _shifts(dev), divisor, scale, r[:m].view(w, 16), g[:m].view(w, 16),
                          _head(t, w), _head(v, w), None if out is None else out[:m].view(w, 16))
    if m < n:  # the last, partial word: commit its values, decode it whole, keep what is real
        w = m // wire.VALUES_PER_WORD
        _commit_body(r[m:], g[m:], _at(t, w), _at(v, w))
        last = [row[w:wire.num_words(n)] for row in rows]
        dest[m:].copy_(_decode_body(last, [_at(x, w) for x in ts], _shifts(dev), divisor,
                                    scale)[:n - m].to(dest.dtype))
    return dest

