"""The 2-bit wire format, shared by every binding.

Codes follow MXNet: ``11`` is +t, ``10`` is -t, ``00`` is 0 (``01`` is never written and decodes
to 0, as in MXNet), t being the value in header word 4. With a numeric threshold that value is the
threshold itself; with ``threshold="auto"`` it is the magnitude the sender chose (which may exceed
the threshold that decided which values to send; receivers need only the magnitude). Sixteen values fill one 32-bit word; byte k of a word (in memory order) holds
values 4k..4k+3 of that block, the first of them in the byte's two highest bits. n values take
exactly ceil(n / 16) words and the unused codes of the last word are ``00``.

A payload on the wire is a header of :data:`HEADER_WORDS` int32 words followed by the packed words:

====  ==========================================================================
word  meaning
====  ==========================================================================
0     ``MAGIC << 16 | FORMAT_VERSION``
1     flags: :data:`FLAG_NONFINITE` (the sender's gradient held NaN or Inf),
      :data:`FLAG_AUTO` (the threshold was chosen by the sender)
2, 3  numel, low and high 32 bits
4     the value of the codes ``11`` / ``10`` (the threshold, or in "auto" mode the
      magnitude), as float32 bits; with :data:`FLAG_BLOCKS`, the block size B instead
====  ==========================================================================

With :data:`FLAG_BLOCKS` (``TwoBitCompressor("auto")``, see :func:`block_of`) the values are cut
into blocks of B consecutive values (B a power of two, at least 16, so a word never straddles two
blocks; the last block may be shorter), each with its own magnitude: ceil(n / B) float32
magnitudes follow the header, in block order, before the packed words. That is 32 / B bits per
value more; with the default limit of 64 blocks, at most 256 bytes per tensor. A tensor that
is a single block sends its one magnitude in word 4, without FLAG_BLOCKS.

What a receiver checks in the gathered payloads before it sums them is
:mod:`horovod_twobit.wire.checks`.
"""

import math
import os
import struct

MAGIC = 0x3242  # "2B"
FORMAT_VERSION = 1
HEADER_WORDS = 5
VALUES_PER_WORD = 16

FLAG_NONFINITE = 1
FLAG_AUTO = 2
FLAG_BLOCKS = 4
FLAG_BUCKET = 8
FLAG_PLAN = 64  # (16 and 32 are scatter_wire's) a scatter rank's one-time announcement, no values (see make_plan)

BUCKET_HEADER_WORDS = 8

# value k of a word sits in byte k // 4 (memory order; little-endian, so bits 8 * (k // 4) up), in
# that byte's bits 7-6, 5-4, 3-2, 1-0 for k % 4 = 0, 1, 2, 3: word >> WORD_SHIFTS[k] & 3 is its code
WORD_SHIFTS = tuple(8 * (k // 4) + 6 - 2 * (k % 4) for k in range(VALUES_PER_WORD))

AUTO_RULES = ("lsq", "opt", "mean", "rms")  # see horovod_twobit.reference.auto_levels
DEFAULT_RULE = "lsq"
# the candidate thresholds of the "opt" and "lsq" rules, as multiples of mean |r + g|
OPT_MULTIPLES = (0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0)

CODE_ZERO = 0b00
CODE_NEG = 0b10
CODE_POS = 0b11


def num_words(numel):
    """Packed words for ``numel`` values: ceil(numel / 16)."""
    return (int(numel) + VALUES_PER_WORD - 1) // VALUES_PER_WORD


def num_blocks(numel, block):
    """Blocks (one magnitude each) of ``numel`` values in blocks of ``block``; 0 without blocks."""
    return (int(numel) + block - 1) // block if block else 0


def body_words(numel, block=None):
    """int32 words after the header: the block magnitudes (if any), then the packed words."""
    return num_blocks(numel, block) + num_words(numel)


def payload_bytes(numel, block=None):
    """Bytes one rank sends for a tensor of ``numel`` values, header included."""
    return 4 * (HEADER_WORDS + body_words(numel, block))


# threshold="auto" cuts a tensor into blocks of at least DEFAULT_BLOCK values, at most DEFAULT_BLOCKS
# of them (README's "Automatic threshold" has the measurements behind these two numbers)
DEFAULT_BLOCK = 64
DEFAULT_BLOCKS = 64


def validate_blocks(threshold, block=None, blocks=None):
    """``(block, blocks)`` for a compressor built with these arguments, or a clear error.

    With ``threshold="auto"``: ``block`` (default :data:`DEFAULT_BLOCK`) is the smallest block, a
    power of two of at least 16; ``blocks`` (default :data:`DEFAULT_BLOCKS`) the most blocks per
    tensor, 0 for no limit (returned as None), 1 for one magnitude per tensor. A numeric threshold
    takes neither: (None, None)."""
    if threshold != "auto":
        for arg, value in (("block", block), ("blocks", blocks)):
            if value is not None:
                raise ValueError("%s=%r gives blocks of values their own automatic magnitude: use it "
                                 "with threshold='auto' (a numeric threshold is one value for the "
                                 "whole tensor)" % (arg, value))
        return None, None
    block = DEFAULT_BLOCK if block is None else block
    blocks = DEFAULT_BLOCKS if blocks is None else blocks
    if isinstance(block, bool) or not isinstance(block, int) or block < VALUES_PER_WORD or block & (block - 1):
        raise ValueError("block must be a power of two of at least %d values (e.g. %d), got %r"
                         % (VALUES_PER_WORD, DEFAULT_BLOCK, block))
    if isinstance(blocks, bool) or not isinstance(blocks, int) or blocks < 0:
        raise ValueError("blocks must be a positive integer (e.g. %d), 1 for one magnitude per "
                         "tensor, or 0 for no limit; got %r" % (DEFAULT_BLOCKS, blocks))
    return block, blocks or None


def auto_args_repr(threshold, rule, block, blocks):
    """The ``threshold="auto"`` arguments that differ from their defaults, as a compressor's repr
    spells them (``", rule='opt', block=256, blocks=0"``); empty for numeric thresholds."""
    extra = ""
    if threshold == "auto" and rule != DEFAULT_RULE:
        extra += ", rule=%r" % rule
    if block and (block, blocks) != (DEFAULT_BLOCK, DEFAULT_BLOCKS):
        extra += ", block=%d, blocks=%d" % (block, blocks or 0)
    return extra


def block_of(numel, block=None, blocks=None):
    """The block size a tensor of ``numel`` values is cut into: ``block`` (16 when not given),
    doubled until there are at most ``blocks`` blocks (when given). None (one magnitude per tensor,
    in the header) when that is a single block, or with neither."""
    if not block and not blocks:
        return None
    size = block or VALUES_PER_WORD
    while blocks and size * blocks < numel:
        size *= 2
    return size if size < numel else None


def float_bits(x):
    """The float32 bit pattern of ``x`` as a signed int32."""
    return struct.unpack("<i", struct.pack("<f", x))[0]


def bits_float(i):
    """The float32 whose bit pattern is the signed int32 ``i``."""
    return struct.unpack("<f", struct.pack("<i", int(i)))[0]


def make_header(numel, threshold, flags=0, block=None):
    """The header words (a list of Python ints) for a payload of ``numel`` values; with ``block``,
    word 4 is the block size (and FLAG_BLOCKS is set) instead of the threshold."""
    numel = int(numel)
    lo = numel & 0xFFFFFFFF
    hi = numel >> 32
    as_i32 = lambda u: u - (1 << 32) if u >= (1 << 31) else u  # noqa: E731
    if block:
        return [(MAGIC << 16) | FORMAT_VERSION, int(flags) | FLAG_BLOCKS, as_i32(lo), as_i32(hi),
                int(block)]
    return [(MAGIC << 16) | FORMAT_VERSION, int(flags), as_i32(lo), as_i32(hi), float_bits(threshold)]


class PayloadMismatchError(RuntimeError):
    """Ranks sent payloads that cannot be summed: different sizes, thresholds or formats."""


class Header:
    """A parsed payload header."""

    __slots__ = ("version", "flags", "numel", "threshold", "block")

    def __init__(self, words):
        w = [int(x) & 0xFFFFFFFF for x in words]
        if (w[0] >> 16) != MAGIC:
            raise PayloadMismatchError(
                "received a payload that is not a horovod-twobit payload (bad magic word 0x%08x): "
                "every rank must use TwoBitCompressor for the same tensors" % w[0])
        self.version = w[0] & 0xFFFF
        self.flags = w[1]
        self.numel = w[2] | (w[3] << 32)
        self.block = w[4] if self.flags & FLAG_BLOCKS else None
        self.threshold = None if self.block else bits_float(words[4])

    @property
    def nonfinite(self):
        return bool(self.flags & FLAG_NONFINITE)

    @property
    def auto(self):
        return bool(self.flags & FLAG_AUTO)


def flag_words(members):
    """int32 words holding one flags byte per member of a bucket payload."""
    return (int(members) + 3) // 4


def make_bucket_header(numels, threshold, auto, digest, payload_words):
    """The fixed words of a bucket payload (:data:`FLAG_BUCKET`, several tensors in one payload):

    ====  ======================================================================
    word  meaning
    ====  ======================================================================
    0     ``MAGIC << 16 | FORMAT_VERSION``
    1     flags: FLAG_BUCKET, FLAG_AUTO, FLAG_NONFINITE (some member held NaN/Inf)
    2, 3  the members' values in all, low and high 32 bits
    4     the threshold as float32 bits (1.0 with FLAG_AUTO: magnitudes follow)
    5     the number of members M
    6     a digest of the members' sizes and block sizes (see :mod:`layout`)
    7     the payload's length in int32 words, this header included
    ====  ======================================================================

    Then ceil(M / 4) words of one flags byte per member (bit 0: that member held NaN/Inf), with
    FLAG_AUTO the float32 magnitude of every segment (each member's blocks in order, one for a
    member of one block), then each member's ceil(n / 16) packed words, member by member."""
    total = sum(int(n) for n in numels)
    head = make_header(total, threshold, FLAG_BUCKET | (FLAG_AUTO if auto else 0))
    return head + [len(numels), int(digest), int(payload_words)]


def make_plan(numels, threshold, auto, digest):
    """The words a rank using the scatter exchange allgathers, once per bucket and number of ranks,
    under the name the allgather exchange's payload would use: a bucket header with
    :data:`FLAG_PLAN` (instead of FLAG_BUCKET) and no body. Ranks using the allgather exchange
    for the same tensors receive it in place of a payload, and every parser of gathered payloads
    raises the same :class:`PayloadMismatchError` on every rank
    (:func:`horovod_twobit.wire.checks.check_exchange`) instead of the ranks waiting forever on
    collectives of different kinds (allgather / alltoall)."""
    head = make_bucket_header(numels, threshold, auto, digest, BUCKET_HEADER_WORDS)
    head[1] = FLAG_PLAN | (FLAG_AUTO if auto else 0)
    return head


def validate_threshold(threshold):
    """Returns the threshold as a float (or the string ``"auto"``), or raises a clear error."""
    if isinstance(threshold, str):
        if threshold == "auto":
            return threshold
        raise ValueError("threshold must be a positive number or the string 'auto', got %r" % (threshold,))
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) and not hasattr(threshold, "__float__"):
        raise ValueError("threshold must be a positive number or the string 'auto', got %r" % (threshold,))
    t = float(threshold)
    if not math.isfinite(t) or t <= 0:
        raise ValueError("threshold must be a positive, finite number (MXNet's default is 0.5), got %r"
                         % (threshold,))
    t32 = bits_float(float_bits(t))
    if t32 <= 0 or not math.isfinite(t32):
        raise ValueError("threshold %r is not representable as a positive float32" % (threshold,))
    return t


def encode_levels(threshold, magnitude=None):
    """(threshold, magnitude) as floats for the codec's ``encode``: numbers only (``"auto"`` is a
    compressor mode); the magnitude defaults to the threshold."""
    t = validate_threshold(threshold)
    if t == "auto":
        raise ValueError("encode() takes a numeric threshold; 'auto' is a TwoBitCompressor mode")
    v = t if magnitude is None else validate_threshold(magnitude)
    if v == "auto":
        raise ValueError("encode() takes a numeric magnitude")
    return t, v


def parse_rule(rule):
    """``(name, factor)`` of an automatic threshold rule ``NAME`` or ``NAME*K`` (factor: the string
    K, empty without one), or ValueError for an unknown name."""
    name, _, k = rule.partition("*")
    if name not in AUTO_RULES:
        raise ValueError("unknown automatic threshold rule %r (known: %s)" % (name, AUTO_RULES))
    return name, k


def auto_rule(rule=None):
    """The rule ``threshold="auto"`` uses: ``rule`` when given, else ``HOROVOD_TWOBIT_AUTO_RULE``,
    else :data:`DEFAULT_RULE`; one of :data:`AUTO_RULES`, optionally with a ``*K`` factor."""
    source = "rule"
    if rule is None:
        rule, source = os.environ.get("HOROVOD_TWOBIT_AUTO_RULE", DEFAULT_RULE), "HOROVOD_TWOBIT_AUTO_RULE"
    ok = isinstance(rule, str) and rule.partition("*")[0] in AUTO_RULES
    if ok and "*" in rule:
        try:
            ok = float(rule.partition("*")[2]) > 0
        except ValueError:
            ok = False
    if not ok:
        raise ValueError("%s must be one of %s (optionally followed by *K, K > 0), got %r"
                         % (source, AUTO_RULES, rule))
    return rule
