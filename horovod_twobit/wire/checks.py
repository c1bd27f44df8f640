"""What a receiver checks before it sums: the gathered payloads split by rank (one tensor's,
:func:`split_gathered`; a bucket's, :func:`split_bucket`) and their headers checked against each
other (format version, sizes, members, threshold mode and value, exchange), each mismatch a
:class:`~horovod_twobit.wire.PayloadMismatchError` whose message depends only on the gathered
bytes, so the same on every rank, and names the fix. The format itself is
:mod:`horovod_twobit.wire`.
"""

from horovod_twobit.wire import (BUCKET_HEADER_WORDS, FLAG_BUCKET, FLAG_PLAN, FORMAT_VERSION,
    HEADER_WORDS, Header, PayloadMismatchError, body_words, float_bits)


def check_exchange(headers, what, more=""):
    """Raises :class:`PayloadMismatchError` when some ranks sent a plan (:func:`make_plan`) and
    others a payload: they use different exchanges for these tensors."""
    plans = [i for i, h in enumerate(headers) if h is not None and h.flags & FLAG_PLAN]
    if plans and len(plans) != len(headers):
        others = [i for i in range(len(headers)) if i not in plans]
        raise PayloadMismatchError(
            "%s: ranks %s use exchange='scatter' for it and ranks %s exchange='allgather': "
            "construct TwoBitCompressor with the same exchange and bucket_bytes on every rank "
            "(exchange='auto' decides from the number of ranks and the bucket's size, the same "
            "on every rank when the model is)" % (what, plans, others) + more)


class BucketHeader(Header):
    """A parsed bucket payload header (see :func:`horovod_twobit.wire.make_bucket_header`): a
    :class:`~horovod_twobit.wire.Header` (never with blocks) and the bucket's words."""

    __slots__ = ("members", "digest", "length")

    def __init__(self, words):
        super().__init__(words[:HEADER_WORDS])
        if not self.flags & (FLAG_BUCKET | FLAG_PLAN) or self.block:
            raise PayloadMismatchError("not a bucket payload")
        self.members = int(words[5])
        self.digest = int(words[6])
        self.length = int(words[7])


def check_bucket_headers(headers, names):
    """Raises :class:`PayloadMismatchError`, with the same message on every rank, unless every
    rank's bucket header (a :class:`BucketHeader`, or None for a payload that is not one) agrees
    on the format, the members and the threshold."""
    what = "tensor %r" % (names[0],)
    more = " (it travels in one bucket with %s%s)" % (
        ", ".join(names[1:4]), ", ..." if len(names) > 4 else "") if len(names) > 1 else ""
    check_exchange(headers, what, more)
    if any(h is None for h in headers):
        raise PayloadMismatchError(
            "%s: ranks %s sent something other than a bucket payload: every rank must use "
            "TwoBitCompressor with the same bucket_bytes and the same model"
            % (what, [i for i, h in enumerate(headers) if h is None]) + more)
    check_versions(headers, what, more)
    layouts = [(h.members, h.numel, h.digest, h.length) for h in headers]
    if len(set(layouts)) != 1:
        raise PayloadMismatchError(
            "%s: ranks bucketed different tensors (members, values, digest, words by rank: %s): the "
            "tensors must have the same sizes on every rank, and every rank must use the same "
            "bucket_bytes and block settings" % (what, layouts) + more)
    check_thresholds(headers, what, more)


def check_versions(headers, what, more=""):
    """Raises :class:`PayloadMismatchError` unless every rank's header has this rank's format
    version."""
    versions = [h.version for h in headers]
    if len(set(versions)) != 1 or versions[0] != FORMAT_VERSION:
        raise PayloadMismatchError(
            "%s: ranks use payload format versions %s, this rank understands %d: install the same "
            "horovod-twobit version on every host" % (what, versions, FORMAT_VERSION) + more)


def check_thresholds(headers, what, more=""):
    """Raises :class:`PayloadMismatchError` unless every rank's header (anything with ``auto`` and
    ``threshold``) agrees on the threshold: "auto" everywhere, or the same float32 number."""
    autos = [h.auto for h in headers]
    if len(set(autos)) != 1:
        raise PayloadMismatchError(
            "%s: some ranks use threshold='auto' and others a fixed threshold %s: construct "
            "TwoBitCompressor with the same threshold on every rank" % (what, autos) + more)
    if not autos[0]:
        ts = [h.threshold for h in headers]
        if len(set(float_bits(t) for t in ts)) != 1:
            raise PayloadMismatchError(
                "%s: ranks use different thresholds %s (by rank): construct TwoBitCompressor "
                "with the same threshold on every rank" % (what, ts) + more)


def split_bucket(read, total, nranks, names):
    """Parses an allgathered buffer of ``total`` int32 words holding one bucket payload per rank,
    reading header words with ``read(start, stop)`` (a list of ints). Returns the headers, or
    raises :class:`PayloadMismatchError` with a message that depends only on the gathered bytes,
    so the same on every rank."""
    headers, off = [], 0
    for rank in range(nranks):
        h = None
        if off + BUCKET_HEADER_WORDS <= total:
            try:
                h = BucketHeader(read(off, off + BUCKET_HEADER_WORDS))
            except PayloadMismatchError:
                h = None
        if h is None or h.length < BUCKET_HEADER_WORDS:
            check_bucket_headers(headers + [None], names)  # names what rank sent no bucket
        headers.append(h)
        off += h.length
    check_bucket_headers(headers, names)
    if off != total:
        raise PayloadMismatchError(
            "tensor %r and its bucket: the gathered buffer holds %d words, the headers account "
            "for %d; ranks sent payloads of different sizes" % (names[0], total, off))
    return headers


def split_gathered(flat_words, nranks, name):
    """Parses an allgathered int32 buffer (a sequence of Python ints or a 1-D array) into
    ``nranks`` (header, start, stop) triples, where ``flat_words[start:stop]`` are that rank's body
    (its block magnitudes, if any, then its packed words). Raises :class:`PayloadMismatchError`,
    with the same message on every rank, when the ranks disagree on anything that makes the sum
    meaningless."""
    out, off = [], 0
    total = len(flat_words)
    for rank in range(nranks):
        if off + HEADER_WORDS > total:
            raise PayloadMismatchError(
                "tensor %r: the gathered buffer ends before rank %d's header; ranks sent payloads of "
                "different sizes: the tensor must have the same number of elements on every rank"
                % (name, rank))
        h = Header(flat_words[off:off + HEADER_WORDS])
        if h.flags & FLAG_BUCKET:
            check_headers([h], name)  # names the mix of buckets and single tensors
        start = off + HEADER_WORDS
        stop = off + BUCKET_HEADER_WORDS if h.flags & FLAG_PLAN else start + body_words(h.numel, h.block)
        out.append((h, start, stop))
        off = stop
    if off != total:
        raise PayloadMismatchError(
            "tensor %r: the gathered buffer holds %d words, the headers account for %d; ranks sent "
            "payloads of different sizes" % (name, total, off))
    check_headers([h for h, _, _ in out], name)
    return out


def check_headers(headers, name):
    """Raises :class:`PayloadMismatchError` unless all ranks' headers agree."""
    check_exchange(headers, "tensor %r" % (name,))
    bucketed = [i for i, h in enumerate(headers) if h.flags & FLAG_BUCKET]
    if bucketed:
        raise PayloadMismatchError(
            "tensor %r: ranks %s sent it in a bucket of several tensors, the others alone: every "
            "rank must use TwoBitCompressor with the same bucket_bytes and the same model"
            % (name, bucketed))
    check_versions(headers, "tensor %r" % (name,))
    sizes = [h.numel for h in headers]
    if len(set(sizes)) != 1:
        raise PayloadMismatchError(
            "tensor %r: ranks sent tensors of different sizes %s (by rank): the tensor must have the "
            "same number of elements on every rank" % (name, sizes))
    autos = [h.auto for h in headers]
    if len(set(autos)) != 1:
        raise PayloadMismatchError(
            "tensor %r: some ranks use threshold='auto' and others a fixed threshold %s: construct "
            "TwoBitCompressor with the same threshold on every rank" % (name, autos))
    blocks = [h.block for h in headers]
    if len(set(blocks)) != 1:
        raise PayloadMismatchError(
            "tensor %r: ranks use different block sizes %s (by rank; None: one magnitude per tensor): "
            "construct TwoBitCompressor with the same block on every rank" % (name, blocks))
    if not autos[0]:
        ts = [h.threshold for h in headers]
        if len(set(float_bits(t) for t in ts)) != 1:
            raise PayloadMismatchError(
                "tensor %r: ranks use different thresholds %s (by rank): construct TwoBitCompressor "
                "with the same threshold on every rank" % (name, ts))
