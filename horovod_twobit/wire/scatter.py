"""The wire format of the scatter exchange (``TwoBitCompressor(..., exchange="scatter")``), shared
by every binding.

A bucket's flat values (:class:`horovod_twobit.wire.layout.Layout`: W packed words) are cut into N
chunks of whole words, chunk c (owned by rank c) holding words ``c * W // N`` up to
``(c + 1) * W // N`` (sizes differ by at most one word; some are empty when W < N). Words never
straddle chunks, so a chunk's codes are exactly the words the allgather payload holds there.

Phase 1 (``alltoall``): every rank sends chunk c of its own encoding to rank c::

    header (HEADER_WORDS)            FLAG_SCATTER, plus FLAG_AUTO / FLAG_NONFINITE as usual
    member flags                     ceil(M / 4) words, one byte per member (bit 0: NaN/Inf)
    magnitudes ("auto" only)         float32, of the segments (blocks) whose words meet chunk c
    packed words                     the chunk's 2-bit words, in MXNet's layout

Phase 2 (``allgather``): every owner sends its summed chunk::

    header (HEADER_WORDS)            FLAG_SCATTER | FLAG_REDUCED (plus FLAG_AUTO)
    numeric threshold: b = count_bits(N) bit planes of ceil(wc / 2) words each (wc: the chunk's
        words); plane j holds bit j of u = count + N for each of the chunk's 16 * wc values, value
        k at bit k % 32 of the plane's word k // 32 (count: the sum of the ranks' codes, -N..N;
        the value is count * t, exactly what every rank sent, nothing lost)
    "auto": the owner's scales, one float32 per piece (a segment cut to the chunk), then
        OWNER_BITS = 3 planes of ceil(wc / 2) words, laid out as the count planes, holding
        u = k + 3 for each value's k in [-3, 3] (values past the chunk's real ones: k = 0). For
        x = the sum plus the owner's own residual, a piece's scale is a = max |x| / 3 in float32,
        rounded down to 22 significant bits (so every k * a is exact) and at least the smallest
        normal float32; k = round(x / a) (half to even); every rank decodes k * a and the owner
        keeps x - k * a (error feedback). A member that held NaN or Inf is sent as scale 0 and
        k = 0 in each of its pieces (every rank makes it NaN).

Header words: 0 ``MAGIC << 16 | FORMAT_VERSION`` (this module's, 2 since the 3-bit phase 2;
the allgather format keeps its own); 1 flags; 2, 3 the bucket's values (low, high);
4 the threshold as float32 bits (1.0 with FLAG_AUTO); 5 members; 6 the layout's digest; 7 the
chunk's index; 8 N. Every owner receives every rank's header, so every rank checks the same
headers and raises the same :class:`~horovod_twobit.wire.PayloadMismatchError`.
"""

from horovod_twobit.wire import checks as wire_checks
from horovod_twobit import wire
from horovod_twobit.wire import PayloadMismatchError

HEADER_WORDS = 9
FORMAT_VERSION = 2  # 1: the 2-bit phase 2 of "auto"
FLAG_SCATTER = 16
FLAG_REDUCED = 32
EXCHANGES = ("allgather", "scatter", "auto")
# "auto"'s phase 2: codes k in [-OWNER_LEVELS, OWNER_LEVELS], packed as the counts of that many
# ranks (u = k + OWNER_LEVELS in OWNER_BITS planes)
OWNER_LEVELS = 3


def validate_exchange(exchange):
    """``exchange`` as given, or a clear ValueError."""
    if not isinstance(exchange, str) or exchange not in EXCHANGES:
        raise ValueError("exchange must be one of %s ('allgather': every rank receives every "
                         "payload; 'scatter': each rank reduces one chunk; 'auto': whichever "
                         "sends fewer bytes), got %r" % (EXCHANGES, exchange))
    return exchange


def count_bits(nranks):
    """Bits of a summed code count in [-N, N]: ceil(log2(2N + 1))."""
    return (2 * int(nranks)).bit_length()


OWNER_BITS = count_bits(OWNER_LEVELS)


def plane_words(words):
    """int32 words of one count plane for a chunk of ``words`` packed words (16 values each)."""
    return (int(words) + 1) // 2


class Chunks:
    """Where every chunk of a bucket (``layout``) sits for ``nranks`` ranks, and its payloads'
    lengths. Depends only on the layout and N, so it is the same on every rank."""

    def __init__(self, layout, nranks):
        self.layout, self.nranks = layout, int(nranks)
        W, N = layout.words, self.nranks
        self.word_starts = [c * W // N for c in range(N + 1)]
        self.bits = count_bits(N)
        self.flag_words = wire.flag_words(layout.members)
        # segments (auto): word ranges, and for each chunk the segments meeting it
        seg_w = [(s // 16, s // 16 + w) for s, w in zip(layout.seg_starts, layout.seg_words)]
        self.seg_ranges, self.pieces = [], []
        for c in range(N):
            ws, we = self.word_starts[c], self.word_starts[c + 1]
            ids = [k for k, (a, b) in enumerate(seg_w) if a < we and b > ws]
            self.seg_ranges.append((ids[0], ids[-1] + 1) if ids else (0, 0))
            pieces = []  # (segment, member, first value, real values, words), chunk-local
            for k in ids:
                a = max(layout.seg_starts[k], 16 * ws)
                b = min(layout.seg_starts[k] + layout.seg_lengths[k], 16 * we)
                words = min(seg_w[k][1], we) - max(seg_w[k][0], ws)
                pieces.append((k, layout.seg_member[k], a - 16 * ws, b - a, words))
            self.pieces.append(pieces)

    def words(self, c):
        return self.word_starts[c + 1] - self.word_starts[c]

    def values(self, c):
        """Values of chunk c in the flat buffer (its last word may be partial for one tensor)."""
        a = 16 * self.word_starts[c]
        return max(0, min(16 * self.word_starts[c + 1], self.layout.values) - a)

    def value_start(self, c):
        return 16 * self.word_starts[c]

    def mags(self, c):
        a, b = self.seg_ranges[c]
        return b - a

    def sent_words(self, c):
        """Length of a phase-1 chunk payload for owner c."""
        return HEADER_WORDS + self.flag_words + self.mags(c) + self.words(c)

    def reduced_words(self, c):
        """Length of owner c's phase-2 payload."""
        if self.layout.auto:
            return HEADER_WORDS + len(self.pieces[c]) + OWNER_BITS * plane_words(self.words(c))
        return HEADER_WORDS + self.bits * plane_words(self.words(c))

    def header(self, c, threshold, reduced=False):
        """Header words (Python ints) of a chunk payload for owner ``c``: phase 1, or phase 2
        with ``reduced``. ``threshold``: the number, or "auto"."""
        lay = self.layout
        auto = threshold == "auto"
        flags = FLAG_SCATTER | (FLAG_REDUCED if reduced else 0) | (wire.FLAG_AUTO if auto else 0)
        head = wire.make_header(sum(lay.numels), 1.0 if auto else threshold, flags)
        head[0] = (wire.MAGIC << 16) | FORMAT_VERSION
        return head + [lay.members, lay.digest, c, self.nranks]

    def total_bytes(self):
        """Bytes all ranks together send per step in this exchange (ring allgather: each rank
        sends every other rank each payload once)."""
        N = self.nranks
        phase1 = sum((N - 1) * self.sent_words(c) for c in range(N))
        phase2 = sum((N - 1) * self.reduced_words(c) for c in range(N))
        return 4 * (phase1 + phase2)


def allgather_total_bytes(layout, nranks):
    """Bytes all ranks together send per step in the allgather exchange."""
    return 4 * nranks * (nranks - 1) * layout.payload_words


def rank_bytes(layout, nranks, rank, exchange):
    """Bytes rank ``rank`` hands to the collectives for one step of a bucket with ``exchange``
    ("allgather" or "scatter", as decided): its payload (allgather), or its N chunk payloads
    (alltoall) and its reduced chunk (allgather). The scatter exchange's one-time plan is not
    counted."""
    if exchange == "scatter":
        chunks = Chunks(layout, nranks)
        return 4 * (sum(chunks.sent_words(c) for c in range(nranks)) + chunks.reduced_words(rank))
    return 4 * layout.payload_words


def bytes_per_rank(layouts, nranks, exchange):
    """Bytes one rank sends per step, on average over the ranks, for these layouts (e.g.
    ``layout.model_layouts``) with ``exchange``, by the formats' own count (headers included)."""
    total = 0
    for layout in layouts:
        if choose(exchange, layout, nranks) == "scatter":
            total += Chunks(layout, nranks).total_bytes()
        else:
            total += allgather_total_bytes(layout, nranks)
    return total / nranks


def choose(exchange, layout, nranks):
    """The exchange a bucket takes: ``exchange`` itself, or for "auto" whichever of the two sends
    fewer bytes for this layout and N (allgather on a tie); the same on every rank."""
    if exchange != "auto":
        return exchange
    if nranks < 2:
        return "allgather"
    scatter = Chunks(layout, nranks).total_bytes()
    return "scatter" if scatter < allgather_total_bytes(layout, nranks) else "allgather"


class ChunkHeader:
    """A parsed scatter header (phase 1 or 2)."""

    __slots__ = ("version", "flags", "numel", "threshold", "members", "digest", "chunk", "nranks")

    def __init__(self, words):
        h = wire.Header(words[:wire.HEADER_WORDS])
        if not h.flags & FLAG_SCATTER or h.block:
            raise PayloadMismatchError("not a scatter payload")
        self.version, self.flags, self.numel, self.threshold = h.version, h.flags, h.numel, h.threshold
        self.members, self.digest, self.chunk, self.nranks = (int(w) for w in words[5:9])

    @property
    def auto(self):
        return bool(self.flags & wire.FLAG_AUTO)

    @property
    def nonfinite(self):
        return bool(self.flags & wire.FLAG_NONFINITE)


def parse_header(words, reduced=False):
    """A :class:`ChunkHeader`, or None for anything that is not a scatter payload of this phase."""
    if len(words) < HEADER_WORDS:
        return None
    try:
        h = ChunkHeader(words)
    except PayloadMismatchError:
        return None
    return h if bool(h.flags & FLAG_REDUCED) == reduced else None


def check_headers(headers, names, owner, nranks):
    """Raises :class:`PayloadMismatchError` unless every sender's chunk header (None for a payload
    that is not one) agrees. Every owner receives the same headers but for the chunk index, so
    the message is the same on every rank."""
    what = "tensor %r" % (names[0],)
    more = " (it travels in one bucket with %s%s)" % (
        ", ".join(names[1:4]), ", ..." if len(names) > 4 else "") if len(names) > 1 else ""
    bad = [i for i, h in enumerate(headers) if h is None]
    if bad:
        raise PayloadMismatchError(
            "%s: ranks %s sent something other than a scatter chunk: every rank must use "
            "TwoBitCompressor with the same exchange, bucket_bytes and model" % (what, bad) + more)
    versions = [h.version for h in headers]
    if len(set(versions)) != 1 or versions[0] != FORMAT_VERSION:
        raise PayloadMismatchError(
            "%s: ranks use scatter format versions %s, this rank understands %d: install the "
            "same horovod-twobit version on every host" % (what, versions, FORMAT_VERSION) + more)
    if all(h.members == 1 for h in headers) and len(set(h.numel for h in headers)) != 1:
        raise PayloadMismatchError(
            "%s: ranks sent tensors of different sizes %s (by rank): the tensor must have the same "
            "number of elements on every rank" % (what, [h.numel for h in headers]) + more)
    layouts = [(h.members, h.numel, h.digest) for h in headers]
    if len(set(layouts)) != 1:
        raise PayloadMismatchError(
            "%s: ranks bucketed different tensors (members, values, digest by rank: %s): the "
            "tensors must have the same sizes on every rank, and every rank must use the same "
            "bucket_bytes and block settings" % (what, layouts) + more)
    wire_checks.check_thresholds(headers, what, more)
    if any(h.nranks != nranks or h.chunk != owner for h in headers):
        raise PayloadMismatchError(
            "%s: ranks cut the bucket for different numbers of ranks %s" % (
                what, [h.nranks for h in headers]) + more)


def check_lengths(got, want, names, phase):
    """Raises unless the received pieces have the lengths this rank's layout expects (after the
    headers agreed, they always do)."""
    if list(got) != list(want):
        raise PayloadMismatchError("tensor %r: %s payloads of %s words where %s were expected"
                                   % (names[0], phase, list(got), list(want)))


def owner_key(names):
    """The key of a bucket's owner residual (``state_dict()['owner_residuals']``): its first
    member's name, with the number of the others."""
    return names[0] if len(names) == 1 else "%s (+%d)" % (names[0], len(names) - 1)
