"""The 2-bit codec in torch ops: quantize with error feedback, pack, unpack. No state, no
communication, no host round trip: the same code runs on CPU and CUDA tensors. The fused kernels
live in :mod:`horovod_twobit.torch.codec.kernels`. On CUDA tensors a bucket's payload
(:func:`encode_payload`, :func:`finish_payload`) goes through the Triton kernels of
:mod:`horovod_twobit.torch.codec.triton_kernels` instead (:func:`.compiled.triton_path`)."""

import torch

from horovod_twobit.wire import checks as wire_checks
from horovod_twobit import wire
from horovod_twobit.torch.codec import compiled, decode_kernels, kernels, levels


def _check(grad, residual):
    if not isinstance(grad, torch.Tensor) or not grad.is_floating_point():
        raise TypeError("grad must be a floating-point torch.Tensor, got %r"
                        % (getattr(grad, "dtype", type(grad)),))
    if grad.is_sparse:
        raise TypeError("grad is sparse: densify it first (sparse_as_dense=True in hvd.DistributedOptimizer)")
    if residual.dtype != torch.float32:
        raise TypeError("residual must be float32, got %s" % residual.dtype)
    if residual.numel() != grad.numel():
        raise ValueError("residual has %d values, grad has %d" % (residual.numel(), grad.numel()))
    if residual.device != grad.device:
        raise ValueError("residual is on %s, grad on %s: keep them on the same device"
                         % (residual.device, grad.device))


def flat(grad):
    """1-D view (or contiguous copy) of a gradient; float16/bfloat16 stay as they are (the kernels
    convert exactly), float64 is rounded to float32 first."""
    g = grad.reshape(-1)
    return g.to(torch.float32) if g.dtype == torch.float64 else g


def quantize_pack(grad, residual, threshold, out=None):
    """(words, non-finite flag) for ternary(residual + grad), without touching the residual
    (see :func:`commit`). ``residual`` must be contiguous. The words go into ``out`` (1-D int32
    of ceil(numel / 16) words) when given."""
    return kernels.pack(residual.view(-1), flat(grad), threshold, out)


def commit(grad, residual, threshold, magnitude=None):
    """Applies one error-feedback step to ``residual`` in place: r <- (r + g) - q, with q the
    ternary value :func:`quantize_pack` sent for the same (grad, residual): +-``magnitude``
    (default: the threshold) where |r + g| reaches the threshold. The float32 operations
    are MXNet's, in its order, so the bits are MXNet's. ``residual`` must be contiguous (the
    registry's are; :func:`encode` makes a contiguous copy of any other)."""
    kernels.commit(residual.view(-1), flat(grad), threshold, magnitude)


def encode(grad, residual, threshold, magnitude=None):
    """Quantizes ``grad`` with error feedback and packs it.

    ``residual`` (float32, any shape with as many values as ``grad``, same device) is updated in
    place: r <- r + g; q = +v where r >= t, -v where r <= -t, else 0; r <- r - q, with t the
    threshold and v the magnitude (default: t, MXNet's scheme; decode with v). Returns the 1-D
    int32 words, ceil(numel / 16) of them. float64 gradients are rounded to float32 first."""
    t, v = wire.encode_levels(threshold, magnitude)
    _check(grad, residual)
    r = residual if residual.is_contiguous() else residual.contiguous()
    words, _ = quantize_pack(grad, r, t)
    commit(grad, r, t, v)
    if r is not residual:
        residual.copy_(r)
    return words


def decode(words, numel, threshold):
    """float32 values of packed ``words``: +t for code 11, -t for 10, 0 otherwise. 1-D, ``numel``
    long."""
    t = wire.validate_threshold(threshold)
    if t == "auto":
        raise ValueError("decode() takes the numeric threshold the sender used")
    numel = int(numel)
    if words.dtype != torch.int32 or words.dim() != 1:
        raise TypeError("words must be a 1-D int32 tensor, got %s of shape %s"
                        % (words.dtype, tuple(words.shape)))
    if words.numel() != wire.num_words(numel):
        raise ValueError("%d values need %d words, got %d" % (numel, wire.num_words(numel), words.numel()))
    return decode_kernels.decode_sum([words.contiguous()], [t], numel)


# ----------------------------------------------------------------- payloads of a bucket (layout)
# A bucket (see horovod_twobit.wire.layout) goes through encode_payload before the collective and
# finish_payload after it: the communicator reaches the kernels only through these two.

class _OnDevice:
    """A layout's index tensors on one device, made once."""

    def __init__(self, layout, device):
        def ints(values, dtype=torch.int64):
            return torch.tensor(values, dtype=dtype, device=device)
        self.seg_words = ints(layout.seg_words) if layout.auto else None
        self.tables = levels.Tables(layout, device) if layout.auto else None
        offs = layout.member_offsets()
        self.word_starts = ints([a for a, _ in offs])
        self.word_ends = ints([a + w for a, w in offs])
        self.headers = {}
        self.triton = None  # the Triton kernels' tables, made on their first use

    def header(self, layout, threshold):
        h = self.headers.get(threshold)
        if h is None:
            h = self.headers[threshold] = torch.tensor(layout.header(threshold), dtype=torch.int32,
                                                       device=self.word_starts.device)
        return h


def _on(layout, device):
    cache = layout.__dict__.setdefault("_torch", {})
    d = cache.get(device)
    if d is None:
        d = cache[device] = _OnDevice(layout, device)
    return d


def segment_levels(layout, r, g, rule):
    """(thresholds, magnitudes) of every segment of an "auto" layout: see
    :func:`levels.table_levels`."""
    return levels.table_levels(_on(layout, g.device).tables, r, g, rule)


def _per_word(layout, on, seg):
    if layout.segments == 1:
        return seg[0]
    return torch.repeat_interleave(seg, on.seg_words, output_size=layout.words)


def encode_payload(layout, r, g, threshold, rule, payload):
    """Writes the payload of one rank for flat residual ``r`` (float32) and gradient ``g`` (1-D,
    ``layout.values`` long) into ``payload`` (1-D int32, ``layout.payload_words``); nothing else
    is modified. Returns the (threshold, magnitude) the finish commits with: numbers, 0-d tensors
    or one per word. On CUDA the Triton kernels do it (:func:`compiled.triton_path`)."""
    tk = compiled.triton_path(g.device)
    if tk is not None:
        return tk.encode_payload(layout, _on(layout, g.device), r, g, threshold, rule, payload,
                                 segment_levels)
    on = _on(layout, g.device)
    body = payload[layout.body:]
    mags = None
    if layout.auto:
        ts, mags = segment_levels(layout, r, g, rule)
        t, v = _per_word(layout, on, ts), _per_word(layout, on, mags)
    else:
        t = v = threshold
    flags = None if layout.single else torch.empty(layout.words, dtype=torch.bool, device=g.device)
    _, nonfinite = kernels.pack(r, g, t, out=body, word_flags=flags)
    head = on.header(layout, threshold if not layout.auto else "auto")
    payload[:head.numel()].copy_(head)
    payload[1] |= nonfinite.to(torch.int32) * wire.FLAG_NONFINITE
    if flags is not None:  # one byte per member: did any of its words hold NaN or Inf
        member_bytes = payload[wire.BUCKET_HEADER_WORDS:layout.head_words].view(torch.uint8)
        member_bytes.zero_()
        if not kernels.flags_on_host(g.device) or bool(nonfinite):
            counts = torch.nn.functional.pad(flags.to(torch.int32).cumsum(0), (1, 0))
            bad = (counts[on.word_ends] - counts[on.word_starts]) > 0
            member_bytes[:layout.members].copy_(bad.to(torch.uint8))
    if mags is not None:
        if layout.mag_words:
            payload[layout.head_words:layout.body].copy_(mags.view(torch.int32))
        else:  # a single tensor of one block: its magnitude in header word 4
            payload[4:5].copy_(mags.view(torch.int32))
    return t, v


def split_single(gathered, numel, nranks, name, block=None):
    """[(header, body)] per rank of an allgathered single-tensor payload, or
    PayloadMismatchError with the same message on every rank."""
    stride = wire.HEADER_WORDS + wire.body_words(numel, block)
    if gathered.numel() == nranks * stride:
        rows = gathered.view(nranks, stride)
        heads = rows[:, :wire.HEADER_WORDS].tolist()
        try:
            headers = [wire.Header(h) for h in heads]
        except wire.PayloadMismatchError:
            headers = None
        if headers is not None and all(h.numel == numel for h in headers):
            # Every header sits where this rank expects it and agrees on the size: the sequential
            # parse every rank would do visits exactly these offsets, so the decision is the same.
            wire_checks.check_headers(headers, name)
            return [(h, rows[i, wire.HEADER_WORDS:]) for i, h in enumerate(headers)]
    wire_checks.split_gathered(gathered.tolist(), nranks, name)  # raises the precise error
    raise wire.PayloadMismatchError("tensor %r: ranks sent incompatible payloads" % name)


def check_plans(layout, gathered, nranks, names):
    """Parses an allgathered buffer of scatter plans (:func:`wire.make_plan`) as the allgather
    exchange parses payloads, so a rank that sent a payload instead makes every rank raise the
    same PayloadMismatchError."""
    if layout.single:
        wire_checks.split_gathered(gathered.tolist(), nranks, names[0])
    else:
        wire_checks.split_bucket(lambda a, b: gathered[a:b].tolist(), gathered.numel(), nranks, names)


def _rows(layout, gathered, nranks, names):
    """(headers, [int32 payload row per rank], bad member flags per rank) of a gathered buffer,
    or PayloadMismatchError with the same message on every rank. Header words the same as a
    step's before, which held no NaN or Inf, were checked then: their parse is taken again
    (the check is a function of those words alone; 16-53 us a call on 2 to 8 ranks)."""
    stride = layout.payload_words
    if gathered.numel() != nranks * stride:
        return _checked_rows(layout, gathered, nranks, names)
    rows = gathered.view(nranks, stride)
    heads = rows[:, :wire.HEADER_WORDS if layout.single else layout.head_words].tolist()
    checked = layout.__dict__.setdefault("_checked_heads", {})
    key = (nranks, tuple(names))
    seen = checked.get(key)
    if seen is not None and seen[0] == heads:
        return seen[1], rows, seen[2]  # (rows: iterated by rank where used)
    headers, out_rows, flags = _checked_rows(layout, gathered, nranks, names)
    if not any(map(any, flags)):
        checked[key] = (heads, headers, flags)
    return headers, out_rows, flags


def _checked_rows(layout, gathered, nranks, names):
    """:func:`_rows`, every header parsed and checked."""
    if layout.single:
        parts = split_single(gathered, layout.numels[0], nranks, names[0], layout.blocks[0])
        rows = gathered.view(nranks, layout.payload_words)
        return [h for h, _ in parts], list(rows), [[h.nonfinite] for h, _ in parts]
    total = gathered.numel()
    stride = layout.payload_words
    if total == nranks * stride:
        rows = gathered.view(nranks, stride)
        heads = rows[:, :layout.head_words].tolist()
        try:
            headers = [wire_checks.BucketHeader(h) for h in heads]
        except wire.PayloadMismatchError:
            headers = None
        if headers is not None and all(h.length == stride for h in headers):
            wire_checks.check_bucket_headers(headers, names)
            flags = []
            for h, words in zip(headers, heads):
                if h.nonfinite:
                    raw = torch.tensor(words[wire.BUCKET_HEADER_WORDS:], dtype=torch.int32)
                    flags.append([bool(b) for b in raw.view(torch.uint8)[:layout.members]])
                else:
                    flags.append([False] * layout.members)
            return headers, list(rows), flags
    wire_checks.split_bucket(lambda a, b: gathered[a:b].tolist(), total, nranks, names)
    raise wire.PayloadMismatchError("bucket of %s: ranks sent incompatible payloads" % names[0])


def _any_rank(layout, flags):
    """Each member's NaN/Inf flag over every rank's ``flags``."""
    if not any(map(any, flags)):
        return [False] * layout.members
    return [any(column) for column in zip(*flags)]


def finish_payload(layout, gathered, nranks, names, r, g, t, v, divisor, scale, out=None):
    """After the collective: checks every rank's payload, then in one pass commits this rank's
    error feedback (r <- r + g - q, with the (t, v) :func:`encode_payload` returned) and writes the
    decode-sum of all ranks, / ``divisor``, * ``scale``, into ``out`` (or over ``g``). A member
    that held NaN or Inf on any rank gets NaN and keeps its residual; the others are finished as
    if it were not there. Returns the flat result, and whether some member held NaN or Inf."""
    headers, rows, bad = _rows(layout, gathered, nranks, names)
    dest = g if out is None else out
    tk = compiled.triton_path(g.device)
    if tk is not None:
        bad = _any_rank(layout, bad)
        tk.finish_payload(layout, _on(layout, g.device), gathered, nranks, bad, r, g, t, v,
                          divisor, scale, out)
        return dest, any(bad)
    on = _on(layout, g.device)
    words = [row[layout.body:] for row in rows]
    if layout.auto:
        ts = [_per_word(layout, on, row[layout.head_words:layout.body].view(torch.float32))
              if layout.mag_words else row[4].view(torch.float32) for row in rows]
    else:
        ts = [h.threshold for h in headers]
    bad = _any_rank(layout, bad)
    if not any(bad):
        decode_kernels.finish(words, ts, r, g, t, divisor, scale, out=out, magnitude=v)
        return dest, False
    for i, ((w0, nw), start, n) in enumerate(zip(layout.member_offsets(), layout.starts,
                                                 layout.numels)):
        if bad[i]:
            # Only the member's own values: the padding after it in a bucket's flat gradient
            # buffer is never overwritten by the next step's gradients, and must stay zero.
            dest[start:start + n].fill_(float("nan"))
            continue
        span = slice(start, start + (n if layout.single else 16 * nw))
        decode_kernels.finish([w[w0:w0 + nw] for w in words], [kernels.span(x, w0, nw) for x in ts],
                       r[span], g[span], kernels.span(t, w0, nw), divisor, scale,
                       out=None if out is None else out[span], magnitude=kernels.span(v, w0, nw))
    return dest, True
