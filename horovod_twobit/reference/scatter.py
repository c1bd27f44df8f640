"""NumPy reference of the scatter exchange (:mod:`horovod_twobit.wire.scatter`): the oracle the
tests compare the bindings against. Written for clarity, value by value in float32.

Every rank encodes each member of a bucket exactly as the allgather exchange does (its own
residual, error feedback), so the workers' residuals are the same in both exchanges. Owner c then
sums chunk c of every rank's decoded values:

- numeric threshold t: the sum is count * t with count = (number of ranks sending +t) - (number
  sending -t), an integer in [-N, N]; the owner sends the count and every rank computes
  float32(count) * t, one correctly rounded multiplication. The allgather exchange adds the
  ranks' +-t in rank order instead: the same value whenever those partial sums are exact (always
  for N <= 3 and for thresholds with few significant bits such as 0.5), else within an ulp or two.
- "auto": S, the float32 sum of the ranks' decoded values in rank order (exactly the allgather
  exchange's sum), is re-encoded by the owner in 3 bits over each piece (a segment, i.e. a block
  of one member, cut to the chunk), with the owner's own residual e: x = e + S is sent as k * a,
  a the piece's scale (max |x| / 3, see :func:`owner_scale`) and k = round(x / a) in [-3, 3],
  and e <- x - k * a (:func:`owner_quantize`).

Then every rank divides by N (Average) and multiplies by the scale factors, as allgather does. A
member whose gradient held NaN or Inf on any rank is NaN everywhere, and neither its workers'
residuals nor its owners' change.
"""

import numpy as np

from horovod_twobit.wire import scatter as scatter_wire
from horovod_twobit import wire
from horovod_twobit.reference.codec import FLT_MIN


def signs(codes):
    """+1 / -1 / 0 for codes 11 / 10 / other."""
    return np.where(codes == wire.CODE_POS, 1, np.where(codes == wire.CODE_NEG, -1, 0))


def pack_counts(counts, nranks):
    """The bit planes of a chunk's counts (int, -N..N, 16 values a word): int32 words, see
    :mod:`horovod_twobit.wire.scatter`."""
    counts = np.asarray(counts, dtype=np.int64)
    u = (counts + nranks).astype(np.uint32)
    pad = (-u.size) % 32
    u = np.concatenate([u, np.zeros(pad, np.uint32)])
    planes = [np.packbits(((u >> j) & 1).astype(np.uint8), bitorder="little").view("<i4")
              for j in range(scatter_wire.count_bits(nranks))]
    return np.concatenate(planes).astype(np.int32) if planes else np.zeros(0, np.int32)


def unpack_counts(words, nvalues, nranks):
    """The counts (int64) of the first ``nvalues`` values of :func:`pack_counts` words."""
    b = scatter_wire.count_bits(nranks)
    planes = np.asarray(words, dtype=np.int32).reshape(b, -1)
    u = np.zeros(planes.shape[1] * 32, dtype=np.int64)
    for j in range(b):
        bits = np.unpackbits(planes[j].view(np.uint8), bitorder="little")
        u |= bits.astype(np.int64) << j
    return u[:nvalues] - nranks


def owner_scale(x):
    """The float32 scale of a piece's values ``x`` (float32): max |x| / 3, at least the smallest
    normal float32, rounded down to 22 significant bits so that k * a is exact for every code k
    (3 * a needs at most 24)."""
    m = np.max(np.abs(x)) if np.size(x) else np.float32(0)
    a = np.float32(m) / np.float32(scatter_wire.OWNER_LEVELS)
    a = np.maximum(a, FLT_MIN)  # NaN stays NaN
    return (np.asarray(a, np.float32).reshape(1).view(np.int32) & ~3).view(np.float32)[0]


def owner_quantize(S, e, pieces, bad):
    """The owner's phase 2 of a chunk: for the chunk's sum ``S`` and its owner residual ``e``
    (float32, updated in place), the scale of every piece (float32) and the code of every value
    (int64, in [-3, 3]). ``pieces``: the chunk's (segment, member, start, length, words);
    ``bad``: each member's NaN/Inf flag. A bad member's pieces get scale 0 and codes 0, and keep
    their residual. Values in no piece (padding) get code 0."""
    L = scatter_wire.OWNER_LEVELS
    scales = np.zeros(len(pieces), np.float32)
    k = np.zeros(S.size, np.int64)
    for i, (_, member, start, length, _) in enumerate(pieces):
        if bad[member]:
            continue
        part = slice(start, start + length)
        x = e[part] + S[part]
        a = scales[i] = owner_scale(x)
        k[part] = np.clip(np.rint(x / a), -L, L).astype(np.int64)
        e[part] = x - k[part].astype(np.float32) * a
    return scales, k


def owner_values(scales, k, pieces):
    """The decoded float32 values k * a of a chunk (0 outside its pieces)."""
    out = np.zeros(k.size, np.float32)
    for a, (_, _, start, length, _) in zip(scales, pieces):
        out[start:start + length] = k[start:start + length].astype(np.float32) * a
    return out


def owner_payload(scales, k, words):
    """The body of an owner's "auto" phase-2 payload (int32 words, after the header): its scales'
    bits, then the 3-bit codes of its ``words`` * 16 values (k + 3 in count planes; codes past
    ``k`` are 0)."""
    codes = np.zeros(16 * words, np.int64)
    codes[:k.size] = k
    return np.concatenate([np.asarray(scales, np.float32).view(np.int32),
                           pack_counts(codes, scatter_wire.OWNER_LEVELS)]).astype(np.int32)


def exchange(workers, layout, names, grads, op="average", prescale=1.0, postscale=1.0):
    """One step of a bucket (``grads[rank][member]``) through the scatter exchange, on the
    simulated ``workers`` (:class:`horovod_twobit.reference.Workers`). Returns each member's
    result (float32, its shape)."""
    w, N = workers, workers.nranks
    chunks = scatter_wire.Chunks(layout, N)
    flat = [[np.asarray(g, dtype=np.float32).reshape(-1) for g in gs] for gs in grads]
    bad = [not all(np.isfinite(flat[r][i]).all() for r in range(N)) for i in range(layout.members)]
    decoded = np.zeros((N, layout.values), dtype=np.float32)
    sign = np.zeros((N, layout.values), dtype=np.int64)
    for i, name in enumerate(names):
        w.last_levels[name] = [None] * N
        for r in range(N):
            g, s = flat[r][i], layout.starts[i]
            if bad[i]:
                w.residuals[r].setdefault(name, np.zeros(g.size, dtype=np.float32))
                continue
            codes, v = w._encode(r, name, g)
            sign[r, s:s + g.size] = signs(codes)
            decoded[r, s:s + g.size] = np.where(codes == wire.CODE_POS, v,
                                                np.where(codes == wire.CODE_NEG, -v, 0))
        if not bad[i]:
            w.last_thresholds[name] = [v for _, v in w.last_levels[name]]
    if layout.auto:
        summed = np.zeros(layout.values, dtype=np.float32)
        key = scatter_wire.owner_key(names)
        for c in range(N):
            a, n = chunks.value_start(c), chunks.values(c)
            S = np.zeros(n, dtype=np.float32)
            for r in range(N):  # rank order, as the allgather exchange sums
                S += decoded[r, a:a + n]
            e = w.owner_residuals[c].get(key)
            if e is None or e.size != n:
                e = w.owner_residuals[c][key] = np.zeros(n, dtype=np.float32)
            scales, k = owner_quantize(S, e, chunks.pieces[c], bad)
            summed[a:a + n] = owner_values(scales, k, chunks.pieces[c])
    else:
        summed = sign.sum(axis=0).astype(np.float32) * np.float32(w.threshold)
    if op == "average":
        summed /= np.float32(N)
    scale = float(prescale) * float(postscale)
    if scale != 1.0:
        summed *= np.float32(scale)
    out = []
    for i, g in enumerate(grads[0]):
        s, n = layout.starts[i], np.size(g)
        res = np.full(n, np.nan, np.float32) if bad[i] else summed[s:s + n].copy()
        out.append(res.reshape(np.shape(g)))
    return out
