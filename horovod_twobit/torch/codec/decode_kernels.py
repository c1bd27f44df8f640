"""Codec kernels, the decode side: the decode-sum of the gathered payloads (:func:`decode_sum`)
and :func:`finish`, one pass after the gather that commits the error-feedback step and writes the
decode-sum. The bodies are registered in :mod:`.compiled` as :mod:`.kernels`' are (the same
compiled and eager paths, the same bits); the commit is :func:`.kernels.committed`, the one
formula of the error feedback.
"""

import torch

from horovod_twobit import wire
from horovod_twobit.torch.codec import compiled
from horovod_twobit.torch.codec.kernels import _at, _commit_body, _head, _shifts, _t, committed


def _decoded(words, ts, shifts, divisor, scale):
    """(words, 16) float32: the sum over ranks, in rank order, of each rank's decoded int32 words
    (16 values a word, so the inner loop is one vector), then / divisor, * scale."""
    out = None
    for i in range(len(words)):
        c = (words[i].unsqueeze(1) >> shifts) & 3
        t = ts[i]
        v = torch.where(c == wire.CODE_POS, t,
                        torch.where(c == wire.CODE_NEG, -t, torch.zeros_like(t)))
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
    with ``thresholds[i]``: a number, or one per word), divided by ``divisor`` and multiplied by
    ``scale``: the reference's float32 operations in the reference's order (v0 + v1 + ..., then
    / divisor, then * scale).
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
    as :func:`.kernels.commit`, with ``magnitude``) and writes the decode-sum of ``rows`` (as
    :func:`decode_sum`) into ``out`` (1-D, float32 or g's dtype, rounded from the float32 sum),
    or over ``g`` itself when ``out`` is None: the in-place allreduce of a gradient then needs no
    output allocation and no copy.
    ``r`` is 1-D contiguous float32; ``g`` 1-D contiguous. Thresholds and magnitudes may be one
    per word (:func:`.kernels.per_word`). Returns the tensor written."""
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
