"""The count planes of the scatter exchange's phase 2 in torch ops (:mod:`horovod_twobit.wire.scatter`):
unsigned counts 0..2N packed as bit planes (:func:`pack_counts`), unpacked (:func:`unpack_counts`)
and turned into values (:func:`count_values`). The scatter codec and the owner's codec both use
them.
"""

import torch

from horovod_twobit.torch.codec import compiled, decode_kernels, kernels

_LUT = {}
# x * _GATHER >> 56 moves the low bits of the 8 bytes of an int64 (each 0 or 1) to bits 0..7 of
# its top byte: the partial products of byte k land at bit 56 + k, or at or above bit 64 (gone),
# or at distinct bits below 56 (no carries reach bit 56).
_GATHER = 0x0102040810204080


def _spread(device):
    """256 int64 words: byte k of word b is bit k of b (the inverse of _GATHER)."""
    t = _LUT.get(device)
    if t is None:
        b = torch.arange(256, dtype=torch.int64)
        t = torch.zeros(256, dtype=torch.int64)
        for k in range(8):
            t |= ((b >> k) & 1) << (8 * k)
        t = _LUT[device] = t.to(device)
    return t


def _pack_counts_body(u, bits):
    """pack_counts of ``u`` (int32, a multiple of 32 values) as one pass per plane word: the sum
    of bit j of its 32 values, each shifted to its own place (an int64 below 2^32), then wrapped
    to int32."""
    js = torch.arange(bits, dtype=torch.int32, device=u.device).view(-1, 1, 1)
    ks = torch.arange(32, dtype=torch.int64, device=u.device)
    w = (((u.view(1, -1, 32) >> js) & 1).to(torch.int64) << ks).sum(-1)
    return torch.where(w >= 1 << 31, w - (1 << 32), w).to(torch.int32).reshape(-1)


def _count_values_body(words, nranks, thr, div, sc):
    """((count - nranks) * thr / div * sc) in float32 for every value of ``words``, the (bits,
    words) count planes, in that order of operations (as the eager path). The planes are unrolled
    (one compilation per number of bits): a reduction over them compiles to a slower loop."""
    ks = torch.arange(32, dtype=torch.int32, device=words.device)
    u = (words[0].unsqueeze(-1) >> ks) & 1
    for j in range(1, words.shape[0]):
        u = u | (((words[j].unsqueeze(-1) >> ks) & 1) << j)
    x = (u.reshape(-1).to(torch.float32) - nranks) * thr
    return x if div is None else x / div * sc


def _finish_counts_body(words, nranks, thr, div, sc, r, g, t, v, out):
    """One pass over an owner's chunk after phase 2: r <- (r + g) - q (as ``kernels.commit``),
    then the chunk's count values (as :func:`_count_values_body`) written into ``out``, or over
    ``g`` when ``out`` is None (every value of g is read before it is written)."""
    r.copy_(kernels.committed(r, g, t, v))
    dest = g if out is None else out
    dest.copy_(_count_values_body(words, nranks, thr, div, sc)[:dest.numel()].to(dest.dtype))


compiled.BODIES["pack_counts"] = _pack_counts_body
compiled.BODIES["count_values"] = _count_values_body
compiled.BODIES["finish_counts"] = _finish_counts_body


def pack_counts(u, bits):
    """Bit planes of the unsigned counts ``u`` (int32, 0..2N, 16 values a word): ``bits`` planes
    of ceil(n / 32) int32 words, plane j holding bit j of value k at bit k % 32 of word k // 32
    (little-endian: byte k // 8 of the word, bit k % 8 of that byte)."""
    if not u.numel():
        return u.new_empty(0)
    if u.numel() % 32:
        u = torch.nn.functional.pad(u, (0, (-u.numel()) % 32))
    if compiled.compiles(u.numel()):
        return compiled.run("pack_counts", u, bits)
    js = torch.arange(bits, dtype=torch.int32, device=u.device).view(-1, 1)
    ones = ((u.unsqueeze(0) >> js) & 1).to(torch.uint8)  # (bits, n): one byte per bit
    byte = ((ones.view(torch.int64) * _GATHER) >> 56) & 0xFF  # 8 bits into one byte
    return byte.to(torch.uint8).view(torch.int32).reshape(-1)


def unpack_counts(words, nvalues, bits, nranks):
    """The signed counts (float32) of the first ``nvalues`` values of :func:`pack_counts` words."""
    if not words.numel():
        return torch.zeros(0, dtype=torch.float32, device=words.device)
    ones = _spread(words.device)[words.view(torch.uint8).view(bits, -1).long()]
    ones = ones.view(torch.uint8).view(bits, -1)  # (bits, 32 per word): one byte per bit
    u = ones[0].clone()
    for j in range(1, bits):
        u |= ones[j] << j
    return u[:nvalues].to(torch.float32) - nranks


def count_values(words, nvalues, bits, nranks, thr, div, sc):
    """(count - nranks) * thr / div * sc, float32, for the first ``nvalues`` values of
    :func:`pack_counts` words: one compiled pass from ``COMPILE_MIN_NUMEL`` values (21 M values
    on one CPU thread: 88 ms, against 430 ms eagerly), else :func:`unpack_counts` and the same
    operations."""
    if compiled.compiles(nvalues):
        return decode_kernels.call_divided("count_values", nvalues, words.device,
                                           words.view(bits, -1), nranks, thr, divisor=div,
                                           scale=sc)[:nvalues]
    return unpack_counts(words, nvalues, bits, nranks) * (thr[:nvalues] if thr.dim() else thr) / div * sc
