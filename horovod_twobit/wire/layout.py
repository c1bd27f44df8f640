"""Where a bucket's tensors sit: in a flat buffer of values, in blocks, and in the payload.

A bucket is an ordered list of tensors ("members") that go through one encode, one collective and
one finish. Shared by both bindings, so a bucket's payload is the same bytes in PyTorch and
TensorFlow.

Flat buffer: member i's values start at ``starts[i]``, a multiple of 16, and take
``num_words(n_i)`` whole words; the values between members are zero. A zero residual plus a zero
gradient is code ``00``, so each member's words are exactly the words it would send alone.

Segments: with ``threshold="auto"`` every member is cut into its own blocks (``wire.block_of``;
blocks never cross a member), each with its own (threshold, magnitude); a member of one block is one
segment. Segments of equal length are reduced together, one call per distinct length
(:attr:`groups`), whatever the number of members.

Payload: a bucket of one member sends exactly the single-tensor payload of :mod:`wire`. A bucket of
several sends :data:`wire.FLAG_BUCKET` payloads (see :func:`wire.make_bucket_header`): header,
one flags byte per member, the segments' magnitudes ("auto" only), then every member's words in
member order.
"""

import zlib

from horovod_twobit import wire

# padding values a table of segments (:meth:`Layout.tables`) may take on to save a call (about
# what one costs)
MERGE_PADDING = 8192


class Layout:
    """Offsets of a bucket of tensors with ``numels`` values, for a compressor's threshold mode
    (``auto``, ``block``, ``blocks`` as :class:`TwoBitCompressor` takes them)."""

    def __init__(self, numels, auto=False, block=None, blocks=None):
        self.numels = [int(n) for n in numels]
        if not self.numels:
            raise ValueError("a bucket needs at least one tensor")
        self.auto = bool(auto)
        self.cut = (block, blocks)  # how "auto" cuts a member into blocks (wire.block_of)
        self.single = len(self.numels) == 1
        self.blocks = [wire.block_of(n, block, blocks) if auto else None for n in self.numels]
        self.member_words = [wire.num_words(n) for n in self.numels]
        self.starts, off = [], 0  # value offset of each member in the flat buffer
        for w in self.member_words:
            self.starts.append(off)
            off += 16 * w
        self.values = self.numels[0] if self.single else off  # flat buffer length
        self.words = off // 16
        # segments (auto): flat start, real length and words of every block, member by member
        self.seg_starts, self.seg_lengths, self.seg_words, self.seg_member = [], [], [], []
        if self.auto:
            for i, (n, b, s) in enumerate(zip(self.numels, self.blocks, self.starts)):
                size = b or max(n, 1)
                for a in range(0, max(n, 1), size):
                    length = min(size, n - a)
                    self.seg_starts.append(s + a)
                    self.seg_lengths.append(length)
                    self.seg_words.append(wire.num_words(length))
                    self.seg_member.append(i)
        self.segments = len(self.seg_starts)
        # groups of equal-length segments: (length, segment ids, contiguous start or None)
        by_len = {}
        for k, length in enumerate(self.seg_lengths):
            by_len.setdefault(length, []).append(k)
        self.groups = []
        for length, ids in sorted(by_len.items()):
            first = self.seg_starts[ids[0]]
            run = all(self.seg_starts[k] == first + j * length for j, k in enumerate(ids))
            self.groups.append((length, ids, first if run else None))
        self.digest = _digest(self.numels, self.blocks)
        if self.single:
            nb = wire.num_blocks(self.numels[0], self.blocks[0])
            self.head_words = wire.HEADER_WORDS
            self.mag_words = nb  # magnitudes after the header; one block: in header word 4
        else:
            self.head_words = wire.BUCKET_HEADER_WORDS + wire.flag_words(len(self.numels))
            self.mag_words = self.segments
        self.body = self.head_words + self.mag_words  # first packed word
        self.payload_words = self.body + self.words

    @property
    def members(self):
        return len(self.numels)

    def header(self, threshold):
        """The static header words (Python ints) for a numeric threshold or "auto"."""
        if self.single:
            n = self.numels[0]
            if self.auto:
                return wire.make_header(n, 1.0, wire.FLAG_AUTO, self.blocks[0])
            return wire.make_header(n, threshold)
        return wire.make_bucket_header(self.numels, 1.0 if self.auto else threshold, self.auto,
                                       self.digest, self.payload_words)

    def plan(self, threshold):
        """The words of this bucket's one-time scatter announcement (:func:`wire.make_plan`)."""
        return wire.make_plan(self.numels, 1.0 if self.auto else threshold, self.auto, self.digest)

    def tables(self, words=True):
        """How an "auto" layout's segments are reduced: one call a table, one segment a row, as
        (rows, width, lengths, at, segment ids): ``lengths`` the rows' real lengths (None where
        every row is full), ``at`` the flat start of a run of equal segments where they lie (an
        int) or the word of the flat buffer each row's words start at, row after row (a list:
        the table is gathered, each row padded to ``width`` by repeating its first word, never
        counted; None with ``words=False``). A tensor alone, and each run of equal-length
        segments of a bucket, is a table where it lies; a bucket's other segments are gathered,
        consecutive groups (by length) sharing a table, rows padded to the longest, while that
        adds at most :data:`MERGE_PADDING` values. ``[]`` for a layout without "auto"."""
        out, pending = [], []

        def close():
            width = 16 * wire.num_words(max(n for _, n in pending))
            at = [] if words else None
            for k, n in pending if words else ():
                w = self.seg_starts[k] // 16
                at += list(range(w, w + wire.num_words(n)))
                at += [w] * (width // 16 - wire.num_words(n))
            lengths = [n for _, n in pending]
            out.append((len(pending), width, None if all(n == width for n in lengths)
                        else lengths, at, [k for k, _ in pending]))
            pending.clear()

        for length, ids, start in self.groups:  # by increasing length
            if self.single or not length:  # where they lie; empty members: a table of their own
                out.append((len(ids), length, None, start or 0, list(ids)))
                continue
            width = 16 * wire.num_words(length)
            if pending and (len(pending) + len(ids)) * width - sum(n for _, n in pending) \
                    - length * len(ids) > MERGE_PADDING:
                close()
            pending.extend((k, length) for k in ids)
        if pending:
            close()
        return out

    @property
    def extra_segments(self):
        """The segments of an "auto" layout beyond those of one tensor of as many values cut
        alike (its members' own blocks and levels, which a bucket adds); 0 without "auto"."""
        if not self.auto:
            return 0
        size = wire.block_of(self.values, *self.cut) or max(self.values, 1)
        return max(0, self.segments - -(-max(self.values, 1) // size))

    @property
    def table_count(self):
        """How many tables (:meth:`tables`) an "auto" encode reduces: one call each; 0 without
        "auto"."""
        return len(self.tables(words=False))

    def member_offsets(self):
        """(first word, word count) of each member inside the packed words."""
        return [(s // 16, w) for s, w in zip(self.starts, self.member_words)]


def _digest(numels, blocks):
    """crc32 of the members' sizes and block sizes, as a signed int32: ranks that cut a bucket
    differently send different digests."""
    text = ";".join("%d/%d" % (n, b or 0) for n, b in zip(numels, blocks)).encode()
    d = zlib.crc32(text)
    return d - (1 << 32) if d >= (1 << 31) else d


# Buckets of at most this many gradient bytes (README's "Buckets" has the measurements behind it).
DEFAULT_BUCKET_BYTES = 4 << 20


def validate_bucket_bytes(bucket_bytes):
    """``bucket_bytes`` as an int (0: no buckets, every tensor alone), or a clear error."""
    if bucket_bytes is None:
        return DEFAULT_BUCKET_BYTES
    if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes < 0:
        raise ValueError("bucket_bytes must be a non-negative integer (e.g. %d; 0 sends every "
                         "tensor alone), got %r" % (DEFAULT_BUCKET_BYTES, bucket_bytes))
    return bucket_bytes


def assign_buckets(entries, bucket_bytes):
    """Cuts ``entries`` -- (name, numel, nbytes, key) in the order their gradients are expected
    (the reverse of the parameters' order) -- into buckets: runs of consecutive entries with the
    same ``key`` (the device) and at most ``bucket_bytes`` gradient bytes in all. Returns lists of
    names, one per bucket of two or more; tensors left alone (larger than a bucket, empty, or
    with no neighbour) are not listed. Depends only on ``entries``, so it is the same on every
    rank whatever order gradients become ready in."""
    buckets, cur, size, cur_key = [], [], 0, None
    for name, numel, nbytes, key in entries:
        if numel == 0 or nbytes > bucket_bytes:
            continue
        if cur and (key != cur_key or size + nbytes > bucket_bytes):
            buckets.append(cur)
            cur, size = [], 0
        cur.append(name)
        size += nbytes
        cur_key = key
    buckets.append(cur)
    return [b for b in buckets if len(b) > 1]


def model_layouts(numels, threshold=0.5, bucket_bytes=None):
    """The layouts a TwoBitCompressor(threshold, bucket_bytes=...) sends each step for float32
    parameters of these sizes (in registration order): its buckets, then the tensors it sends
    alone. For counting bytes (``scatter_wire.bytes_per_rank``), without Horovod."""
    auto = threshold == "auto"
    block, blocks = wire.validate_blocks(threshold)
    names = list(range(len(numels)))
    entries = [(i, int(numels[i]), 4 * int(numels[i]), "") for i in reversed(names)]
    buckets = assign_buckets(entries, validate_bucket_bytes(bucket_bytes))
    alone = sorted(set(i for i in names if numels[i]) - {i for b in buckets for i in b})
    return [Layout([numels[i] for i in b], auto, block, blocks) for b in buckets] + \
        [Layout([numels[i]], auto, block, blocks) for i in alone]

