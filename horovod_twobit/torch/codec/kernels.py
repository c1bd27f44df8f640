"""Codec kernels, the encode side: pack (a codes pass and a byte-packing pass, chunk by chunk) and
the plain commit; :mod:`.decode_kernels` holds the decode side (the decode-sum, and finish: one
pass after the gather, the residual update and the decode-sum).

The bodies are plain torch ops, registered in :mod:`.compiled`: for tensors of at least
``compiled.COMPILE_MIN_NUMEL`` values they run through ``torch.compile`` (Inductor fuses each body
into one vectorized loop on CPU and GPU); below that, or where compilation is unavailable or
disabled (``HOROVOD_TWOBIT_COMPILE=0``), the same bodies run eagerly. The scatter exchange's chunks
of a bucket choose by the bucket's size (:func:`compiled.sized_as`). Both paths give the same
bits: the bodies use only exact float32 operations (add, compare, subtract a threshold, select,
one division, one multiplication) whose results do not depend on fusion. (On a GPU, Triton's
float32 division is approximate: compilations ask Inductor for a correctly rounded one where it
offers it, else the division runs eagerly after the compiled pass, see
:func:`.decode_kernels._late_division`.
On a GPU :func:`pack` also packs whole words in one pass rather than in cache-sized chunks of
two.)

Compiled graphs are dynamic in the tensor length, so Inductor compiles once per (function, dtype,
device), never per step. The threshold and divisor travel as 0-d tensors, so a new value does not
recompile either.

Why the residual update is not in the encode pass: a step in which any rank's gradient held NaN or
Inf must leave every residual as it was, and that is known only after the gather. So encode reads
r and g and writes the payload; :func:`.decode_kernels.finish` reads r, g and the gathered
payloads and writes r and the result (over g itself for an in-place allreduce, which is what
``hvd.DistributedOptimizer`` does): two passes over the gradient's memory per step, as a fused
encode plus a decode would be.

Extra memory per tensor: the float32 residual (persistent), the payload (n/4 bytes), the gathered
payloads (N * n/4 bytes) while a step is in flight, the codes of one chunk (at most 4 MB, between
the two pack passes), and the float32 result for an out-of-place allreduce (an in-place one writes
over the gradient). The eager path adds float32 and integer temporaries of the tensor's size.
"""

import torch

from horovod_twobit import wire
from horovod_twobit.torch.codec import compiled



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


_SHIFTS = {}
SHIFTS = list(wire.WORD_SHIFTS)


def _shifts(device, dtype=torch.int32):
    sh = _SHIFTS.get((device, dtype))
    if sh is None:
        sh = _SHIFTS[(device, dtype)] = torch.tensor(SHIFTS, dtype=dtype, device=device)
    return sh


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
