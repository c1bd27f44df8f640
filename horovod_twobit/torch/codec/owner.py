"""The scatter exchange's "auto" phase 2 in torch ops: each owner re-encodes its summed chunk in
3 bits, one scale per piece (:mod:`horovod_twobit.wire.scatter`;
:func:`horovod_twobit.reference.scatter.owner_quantize` is the reference, bit for bit).

For x = e + S (the owner's residual plus the chunk's sum), a piece's scale is a = max |x| / 3
(at least the smallest normal float32, rounded down to 22 significant bits so that every k * a
is exact), its codes k = round(x / a) in [-3, 3], sent as k + 3 in the count planes' layout; every
rank decodes k * a and the owner keeps e = x - k * a.
"""

import torch

from horovod_twobit.wire import scatter as sw
from horovod_twobit.torch.codec import compiled, counts, decode_kernels, kernels

_FLT_MIN = float(torch.finfo(torch.float32).tiny)
_LOW_BITS = ~3


def piece_words(pieces, device):
    """The words of each piece (int64), to repeat one value per piece over its words."""
    return torch.tensor([p[4] for p in pieces], dtype=torch.int64, device=device)


def scales(pieces, words, nwords, x):
    """The scale of every piece of ``x``, a chunk's r + S (its ``nwords`` * 16 values, zero past
    the real ones): max |x| / 3, then at least the smallest normal float32, then rounded down to
    22 significant bits."""
    lengths = [16 * p[4] for p in pieces]
    if len(pieces) <= 64 and all(lengths):  # one min-max pass per piece, no temporary
        mins, maxs = zip(*(torch.aminmax(t) for t in torch.split(x, lengths)))
        m = torch.maximum(torch.stack(maxs), -torch.stack(mins))
    else:
        m = torch.segment_reduce(x.abs(), "max", lengths=16 * words, initial=0.0)
    # / a tensor on m's device: CUDA multiplies by the reciprocal of a number (another rounding)
    a = (m / m.new_full((), float(sw.OWNER_LEVELS))).clamp_min_(_FLT_MIN)
    return (a.view(torch.int32) & _LOW_BITS).view(torch.float32)


def scratch_values(nwords):
    """The values of :func:`owner_encode`'s buffer for a chunk of ``nwords`` words: whole plane
    words of 32 values."""
    return 32 * sw.plane_words(nwords)


def owner_encode(pieces, nwords, residual, S, bad, words=None, x=None):
    """The body of an owner's phase-2 payload (its pieces' scales as int32 words, then the code
    planes of its ``nwords`` words) for the chunk's sum ``S`` (float32, the chunk's values) and its
    residual ``residual`` (float32, updated in place but for pieces of members in ``bad``, a list
    of bools). Those pieces are sent as scale 0 and codes 0. ``words``: :func:`piece_words`.
    Works on (words, 16) views with one scale per word: no per-value copy of the scales.
    ``x``: a buffer of :func:`scratch_values` values whose first values are ``S`` itself (the
    caller decoded the sum there) and that is zero past the chunk's words; it is worked in and
    left so. Without it a new one is made."""
    n, L = S.numel(), sw.OWNER_LEVELS
    if words is None:
        words = piece_words(pieces, S.device)
    if not pieces:
        return S.new_empty(0, dtype=torch.int32)
    if x is None:
        x = S.new_zeros(scratch_values(nwords))  # whole plane words; zero past the values
        torch.add(residual, S, out=x[:n])
    else:  # S is x[:n]: the same r + S
        x[:n].add_(residual)
    xw = x[:16 * nwords].view(nwords, 16)
    a = scales(pieces, words, nwords, x[:16 * nwords])
    hit = [(p[2], 16 * p[4]) for p in pieces if bad[p[1]]]  # whole words: padding too
    if hit:
        a[[i for i, p in enumerate(pieces) if bad[p[1]]]] = 0.0
    a_w = torch.repeat_interleave(a, words, output_size=nwords).unsqueeze(1)
    q = torch.div(xw, a_w).round_().clamp_(-L, L)
    flat = q.view(-1)
    for s, length in hit:  # 0 / 0 there: codes 0, residual kept
        flat[s:s + length] = 0.0
        x[s:min(s + length, n)] = residual[s:s + length]
    residual.copy_(xw.addcmul_(q, a_w, value=-1).view(-1)[:n])  # k * a is exact: one rounding
    # x is done with: its buffer takes the codes (its tail past the chunk's words is still 0.0,
    # whose bits are int32 0), instead of a new tensor of the chunk's size on every step
    u = x.view(torch.int32)
    u[:16 * nwords].copy_(flat.add_(L))
    return torch.cat([a.view(torch.int32), pack_counts(u)])


def pack_counts(u):
    """The code planes of ``u`` = k + 3 (int32): the count planes' packing."""
    return counts.pack_counts(u, sw.OWNER_BITS)


def _values_body(planes, a_w, nwords, div, sc):
    """k * a / div * sc for the (bits, plane words) code ``planes`` of ``nwords`` words with one
    scale per word ``a_w`` ((nwords, 1)), in that order of operations: (nwords * 16) values."""
    ks = torch.arange(32, dtype=torch.int32, device=planes.device)
    u = (planes[0].unsqueeze(-1) >> ks) & 1
    for j in range(1, planes.shape[0]):
        u = u | (((planes[j].unsqueeze(-1) >> ks) & 1) << j)
    k = u.reshape(-1)[:16 * nwords].view(nwords, 16).to(torch.float32) - sw.OWNER_LEVELS
    x = k * a_w
    return (x if div is None else x / div * sc).reshape(-1)


compiled.BODIES["owner_values"] = _values_body


def owner_values(body, pieces, nwords, nvalues, divisor, scale, words=None, out=None):
    """k * a / ``divisor`` * ``scale`` (float32, the reference's order) for the first ``nvalues``
    values of an owner's phase-2 ``body``; divisor and scale are 0-d float32 tensors. One
    compiled pass from ``COMPILE_MIN_NUMEL`` values. With ``out`` (``nvalues`` long, float32 or
    a gradient's dtype) the values are written there, ``kernels.PACK_CHUNK`` values at a time:
    each part's temporary is then small enough for the allocator to reuse it step after step,
    where one of the chunk's size would be fresh memory (a page fault per 4 kB) every step."""
    if words is None:
        words = piece_words(pieces, body.device)
    k = len(pieces)
    if not nvalues:
        return torch.zeros(0, dtype=torch.float32, device=body.device) if out is None else out
    a_w = torch.repeat_interleave(body[:k].view(torch.float32), words,
                                  output_size=nwords).unsqueeze(1)
    planes = body[k:].view(sw.OWNER_BITS, -1)
    if out is None:
        return _values(planes, a_w, nwords, nvalues, divisor, scale)
    step = max(32, kernels.PACK_CHUNK - kernels.PACK_CHUNK % 32)  # whole plane words
    for v0 in range(0, nvalues, step):
        v1 = min(nvalues, v0 + step)
        w0, nw = v0 // 16, min(nwords - v0 // 16, -(-(v1 - v0) // 16))
        out[v0:v1].copy_(_values(planes[:, v0 // 32:-(-v1 // 32)], a_w[w0:w0 + nw], nw, v1 - v0,
                                 divisor, scale))
    return out


def _values(planes, a_w, nwords, nvalues, divisor, scale):
    return decode_kernels.call_divided("owner_values", nvalues, planes.device, planes, a_w,
                                       nwords, divisor=divisor, scale=scale)[:nvalues]
