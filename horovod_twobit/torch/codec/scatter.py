"""The codec of the scatter exchange (:mod:`horovod_twobit.wire.scatter`) in torch ops, on CPU or
GPU tensors: the communicator reaches the kernels through these three steps.

1. :func:`chunk_payloads`: cuts the payload :func:`codec.encode_payload` wrote (this rank's
   encoding of the whole bucket, as the allgather exchange sends it) into N chunk payloads.
2. :func:`owner_reduce`: after the ``alltoall``, checks every sender's chunk, sums the N payloads
   of this rank's chunk in rank order and writes the phase-2 payload: count planes (numeric
   threshold) or the sum re-encoded in 3 bits with the owner's residual ("auto",
   :mod:`owner_codec`).
3. :func:`finish_reduced`: after the ``allgather``, commits this rank's error feedback and writes
   the result, decoded from every owner's chunk.
"""

import functools

import torch

from horovod_twobit.wire import scatter as sw
from horovod_twobit import wire
from horovod_twobit.torch.codec import compiled, decode_kernels, kernels, owner as owner_codec
from horovod_twobit.torch.codec.counts import count_values, pack_counts, unpack_counts  # noqa: F401


def _cached(chunks, key, make):
    cache = chunks.__dict__.setdefault("_torch", {})
    if key not in cache:
        cache[key] = make()
    return cache[key]


def _headers(chunks, device, threshold):
    """Header words of every chunk, phase 1 and phase 2, made once per (device, threshold)."""
    def make():
        ints = lambda x: torch.tensor(x, dtype=torch.int32, device=device)  # noqa: E731
        return ([ints(chunks.header(c, threshold)) for c in range(chunks.nranks)],
                [ints(chunks.header(c, threshold, reduced=True)) for c in range(chunks.nranks)])
    return _cached(chunks, ("headers", device, threshold), make)


def _piece_words(chunks, device):
    """For each chunk, the words of each of its pieces (int64), to expand magnitudes per word."""
    return _cached(chunks, ("pieces", device), lambda: [
        owner_codec.piece_words(chunks.pieces[c], device) for c in range(chunks.nranks)])


def _parts(layout, payload):
    """(member flag words, segment magnitudes as int32, packed words) of an allgather payload."""
    if layout.single:
        flags = (payload[1:2] & wire.FLAG_NONFINITE).clone()  # byte 0 of one word: member 0
        mags = payload[4:5] if layout.auto and not layout.mag_words else payload[layout.head_words:layout.body]
    else:
        flags = payload[wire.BUCKET_HEADER_WORDS:layout.head_words]
        mags = payload[layout.head_words:layout.body]
    return flags, mags, payload[layout.body:]


def chunk_payloads(chunks, payload, threshold):
    """(the alltoall's send buffer, its splits as an int32 CPU tensor): chunk c of this rank's
    ``payload`` with its header, for owner c."""
    layout = chunks.layout
    heads, _ = _headers(chunks, payload.device, threshold)
    flags, mags, words = _parts(layout, payload)
    nonfinite = payload[1:2] & wire.FLAG_NONFINITE
    pieces = []
    for c in range(chunks.nranks):
        a, b = chunks.seg_ranges[c]
        head = heads[c].clone()
        head[1:2] |= nonfinite
        pieces += [head, flags, mags[a:b] if layout.auto else mags[:0],
                   words[chunks.word_starts[c]:chunks.word_starts[c + 1]]]
    splits = torch.tensor([chunks.sent_words(c) for c in range(chunks.nranks)], dtype=torch.int32)
    return torch.cat(pieces), splits


def _bucket_sized(fn):
    """``fn(chunks, ...)`` choosing compiled or eager bodies by the bucket's size, not each
    chunk's (:func:`compiled.sized_as`)."""
    @functools.wraps(fn)
    def sized(chunks, *args, **kwargs):
        with compiled.sized_as(chunks.layout.values):
            return fn(chunks, *args, **kwargs)
    return sized


@_bucket_sized
def owner_reduce(chunks, received, splits, names, owner, threshold, rule=None, residual=None,
                 scratch=None):
    """Phase 2's payload of chunk ``owner`` and the bad member flags (a list of bools, the same on
    every rank), from the ``alltoall``'s output ``received`` (one chunk payload per sender, of
    ``splits`` words). Raises :class:`PayloadMismatchError` with the same message on every rank
    when the senders disagree. With "auto", ``residual`` is this owner's float32 residual of the
    chunk's values, updated in place except where a member held NaN or Inf. ``rule`` is not used
    (phase 2's levels follow each piece's largest value). ``scratch``: a float32 buffer of
    :func:`owner_codec.scratch_values` values, zero past the chunk's words, that the chunk's sum
    and counts or codes are worked in and left so (else new tensors)."""
    N, layout = chunks.nranks, chunks.layout
    splits = [int(s) for s in splits]
    offs = [sum(splits[:s]) for s in range(N)]
    if all(s >= sw.HEADER_WORDS for s in splits):  # one host round trip for every header
        heads = torch.stack([received[o:o + sw.HEADER_WORDS] for o in offs]).tolist()
    else:
        heads = [received[o:o + s].tolist() for o, s in zip(offs, splits)]
    headers = [sw.parse_header(h) for h in heads]
    sw.check_headers(headers, names, owner, N)
    sw.check_lengths(splits, [chunks.sent_words(owner)] * N, names, "chunk")
    fw, nm, wc = chunks.flag_words, chunks.mags(owner), chunks.words(owner)
    bad = [False] * layout.members
    for o, h in zip(offs, headers):
        if h.nonfinite:
            raw = received[o + sw.HEADER_WORDS:o + sw.HEADER_WORDS + fw].view(torch.uint8)
            bad = [x or bool(y) for x, y in zip(bad, raw[:layout.members].tolist())]
    body = [o + sw.HEADER_WORDS + fw for o in offs]
    rows = [received[b + nm:b + nm + wc] for b in body]
    _, reduced = _headers(chunks, received.device, threshold)
    piece_words = _piece_words(chunks, received.device)
    nvalues = chunks.values(owner)
    tk = compiled.triton_path(received.device)
    if tk is not None:  # every sender's rows in one launch (splits are equal: checked above)
        stride, skip = splits[0], sw.HEADER_WORDS + fw
    if not layout.auto:
        if tk is not None and wc:
            x = received.new_zeros(owner_codec.scratch_values(wc), dtype=torch.float32) \
                if scratch is None else scratch
            tk.decode_rows(received, N, stride, skip + nm, wc, x)
            _as_counts(x[:16 * wc], N)
            counts = x.view(torch.int32)  # zero past the chunk's words, as pack_counts pads
        else:
            counts = _counts(rows, N, wc, scratch)
        return torch.cat([reduced[owner], pack_counts(counts, chunks.bits)]), bad
    x = residual.new_zeros(owner_codec.scratch_values(wc)) if scratch is None else scratch
    if tk is not None and wc:
        S = tk.decode_rows(received, N, stride, skip + nm, wc, x[:16 * wc], skip,
                           _piece_of_word(chunks, owner, received.device))[:nvalues]
    elif wc:
        mags = [received[b:b + nm].view(torch.float32) for b in body]
        ts = [torch.repeat_interleave(m, piece_words[owner], output_size=wc) for m in mags]
        S = decode_kernels.decode_sum(rows, ts, nvalues, out=x[:16 * wc])
    else:
        S = residual.new_empty(0)
    body = owner_codec.owner_encode(chunks.pieces[owner], wc, residual, S, bad, piece_words[owner],
                                    x=x)
    return torch.cat([reduced[owner], body]), bad


def _counts(rows, nranks, wc, scratch=None):
    """The unsigned counts (int32, 0..2N) of ``wc`` words of every rank's ``rows``: their
    decode-sum at threshold 1 (exact small integers in float32) plus N, converted in the sum's own
    buffer. A conversion into new tensors would take two more of the chunk's size, fresh pages on
    every step: 10 M values at 2 ranks took 76-80 ms that way, 48 ms this way (one process).
    With ``scratch`` (as :func:`owner_reduce` takes it) the sum is made there, and the counts
    come back with its zero tail (whole plane words: :func:`pack_counts` pads with zeros)."""
    if not wc:
        return rows[0].new_empty(0)
    out = None if scratch is None else scratch[:16 * wc]
    u = _as_counts(decode_kernels.decode_sum(rows, [1.0] * nranks, 16 * wc, out=out), nranks)
    return u if scratch is None else scratch.view(torch.int32)


def _as_counts(counts, nranks):
    """The float32 sum of the ranks' signs + N as int32, converted where each value lies."""
    counts.add_(nranks)
    u = counts.view(torch.int32)
    u.copy_(counts)  # same places, same size: each value converted where it lies
    return u


def _piece_of_word(chunks, owner, device):
    """For the Triton decode: the piece (its magnitude's index) of every word of chunk ``owner``
    (int32)."""
    def make():
        words = _piece_words(chunks, device)[owner]
        return torch.repeat_interleave(torch.arange(words.numel(), dtype=torch.int32,
                                                    device=device), words)
    return _cached(chunks, ("piece_of_word", device, owner), make)


def _good_runs(layout, bad):
    """``(start, end)`` value ranges of the bucket's flat buffer, one per run of adjacent members
    without NaN or Inf, each member with its padding to a whole word: one commit per run, not per
    member (a bucket of 100 small tensors paid 100 calls). The padding is zero in g and r on every
    rank, so its codes are 00 and committing it leaves it zero, as the allgather finish does."""
    runs = []
    for i, (s, w) in enumerate(zip(layout.starts, layout.member_words)):
        if bad[i]:
            continue
        e = s + (layout.numels[i] if layout.single else 16 * w)
        if runs and runs[-1][1] == s:
            runs[-1][1] = e
        else:
            runs.append([s, e])
    return runs


@_bucket_sized
def finish_reduced(chunks, gathered, names, r, g, t, v, bad, divisor, scale, out=None):
    """After phase 2's allgather: commits this rank's error feedback (r <- r + g - q with the
    (t, v) ``codec.encode_payload`` returned, members that held NaN or Inf left alone) and writes
    the result (every owner's chunk, / ``divisor``, * ``scale``) into ``out``, or over ``g``.
    Members in ``bad`` get NaN. Returns the flat result."""
    layout, N = chunks.layout, chunks.nranks
    lengths = [chunks.reduced_words(c) for c in range(N)]
    sw.check_lengths([gathered.numel()], [sum(lengths)], names, "reduced")
    dev = g.device
    offs = [sum(lengths[:c]) for c in range(N)]
    heads = [sw.parse_header(gathered[o:o + sw.HEADER_WORDS].tolist(), reduced=True) for o in offs]
    if any(h is None or h.chunk != c for c, h in enumerate(heads)):
        raise wire.PayloadMismatchError("tensor %r: owners sent malformed reduced chunks" % names[0])
    spans = [(s, n) for s, n in zip(layout.starts, layout.numels)]
    # then each chunk's commit and decode share one pass; not where the compiled pass cannot
    # divide correctly rounded (a GPU whose Inductor lacks the option:
    # decode_kernels._late_division)
    late = decode_kernels._late_division(dev, layout.values)  # every chunk decides as the bucket
    fused = not any(bad) and not layout.auto and not late
    if not fused:  # the commit first, of the members that held no NaN or Inf (it reads g)
        for s, e in _good_runs(layout, bad):
            w0, nw = s // 16, wire.num_words(e - s)
            kernels.commit(r[s:e], g[s:e], kernels.span(t, w0, nw), kernels.span(v, w0, nw))
    # Each owner's chunk is decoded straight into its place: no full-size temporary (a fresh
    # buffer of the bucket's size costs a page fault per 4 kB on every step).
    dest = g if out is None else out
    piece_words = _piece_words(chunks, dev)
    thr = torch.tensor(heads[0].threshold or 1.0, dtype=torch.float32, device=dev)
    div = torch.tensor(float(divisor), dtype=torch.float32, device=dev)
    sc = torch.tensor(float(scale), dtype=torch.float32, device=dev)
    pos = 0
    for c, o in enumerate(offs):
        body, n, wc = gathered[o + sw.HEADER_WORDS:o + lengths[c]], chunks.values(c), chunks.words(c)
        if not n:
            continue
        span = slice(pos, pos + n)
        tc, vc = kernels.span(t, pos // 16, wc), kernels.span(v, pos // 16, wc)
        into = None if out is None else out[span]
        if layout.auto:
            owner_codec.owner_values(body, chunks.pieces[c], wc, n, div, sc, piece_words[c],
                                     out=dest[span])
        elif fused:  # compiled where compiled.compiles (by the bucket), else the same body eagerly
            compiled.call("finish_counts", n, body.view(chunks.bits, -1), N, thr, div, sc, r[span],
                          g[span], kernels._t(tc, dev), kernels._t(vc, dev), into)
        else:
            dest[span].copy_(count_values(body, n, chunks.bits, N, thr, div, sc))
        pos += n
    for i, (s, n) in enumerate(spans):
        if bad[i]:
            dest[s:s + n] = float("nan")
    return dest
