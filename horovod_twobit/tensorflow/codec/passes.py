"""A bucket's two passes as a fixed number of graph ops, whatever its number of members.

The encode (the "auto" levels of every segment, the codes, the packing, the members' NaN/Inf flags
and the payload) is one body, and the finish (the members' flags, the decode and rank-order sum of
every payload, the division and scale, the error-feedback commit) another. From
``kernels.COMPILE_MIN_NUMEL`` values each body is one XLA call (:class:`Passes`); below, or with
``HOROVOD_TWOBIT_COMPILE=0``, the same ops run as TF ops.

On a CPU, where the ops can be built, both passes are instead one op each (:class:`NativePasses`,
:mod:`native_ops`), the same bits.

"auto" levels: on a CPU the encode takes them from :mod:`native_ops`' op; elsewhere segments of
equal length are reduced as one table (rows gathered by word where they do not lie in one run), as
the PyTorch binding's ``segment_levels`` does, their divisors (the lengths) reaching XLA as
arguments, never as constants it could fold into a reciprocal.
"""

import functools

import numpy as np
import tensorflow as tf

from horovod_twobit import wire
from horovod_twobit.tensorflow.codec import kernels, native_ops
from horovod_twobit.tensorflow import codec


class Plan:
    """Static (NumPy) indices of a layout, made once: which member and which segment each packed
    word belongs to; the distinct segment lengths (the levels' divisors, :attr:`lengths`); and
    the tables of equal-length segments ("auto"): (length, word indices of the rows, or the first
    word of a contiguous run, number of rows, index of the length)."""

    def __init__(self, lay):
        self.member_of_word = np.repeat(np.arange(lay.members), lay.member_words).astype(np.int32)
        self.seg_of_word = np.repeat(np.arange(lay.segments), lay.seg_words).astype(np.int32)
        distinct = sorted({n for n in lay.seg_lengths if n})
        self.length_index = {n: i for i, n in enumerate(distinct)}
        self.lengths = np.asarray(distinct, np.float64)
        self.tables, order = [], []
        for length, ids, start in lay.groups:
            w = wire.num_words(length)
            if start is not None and length % wire.VALUES_PER_WORD == 0:
                at = start // 16  # rows lie in one run
            else:
                at = np.concatenate([np.arange(lay.seg_starts[k] // 16,
                                               lay.seg_starts[k] // 16 + w) for k in ids])
                at = at.astype(np.int32)
            self.tables.append((length, at, len(ids), self.length_index.get(length)))
            order += ids
        perm = np.argsort(np.asarray(order, np.int64), kind="stable").astype(np.int32)
        self.perm = None if order == sorted(order) else perm


def plan_of(state, lay):
    cache = state.eager_fns
    key = ("plan", id(lay))
    got = cache.get(key)
    if got is None or got[0] is not lay:
        got = cache[key] = (lay, Plan(lay))
    return got[1]


def table_levels(plan, x, rule, lengths, xla=False):
    """(thresholds, magnitudes) of every segment, from the flat r + g ``x`` (whole words), each
    segment exactly as one tensor or block is reduced alone; ``lengths``: :attr:`Plan.lengths` as
    a float64 tensor (the divisors). Each table of equal-length segments is one reduction (rows
    gathered where they do not lie in one run), so the ops do not grow with the number of segments;
    in an XLA body (``xla``) the "lsq" candidates are one reduction each (see codec._row_levels)."""
    name, k = wire.parse_rule(rule)
    ts, vs = [], []
    xw = tf.reshape(x, [-1, wire.VALUES_PER_WORD])
    for length, at, rows, li in plan.tables:
        if not length:  # empty members
            ts.append(tf.ones([rows], tf.float32))
            vs.append(tf.ones([rows], tf.float32))
            continue
        w = wire.num_words(length)
        if isinstance(at, (int, np.integer)):
            part = xw[at:at + rows * w]
        else:
            part = tf.gather(xw, at)
        part = tf.reshape(part, [rows, 16 * w])
        if 16 * w != length:
            part = part[:, :length]
        t, v = codec._row_levels(part, name, k, lengths[li], xla)
        ts.append(t)
        vs.append(v)
    if not ts:
        return tf.zeros([0], tf.float32), tf.zeros([0], tf.float32)
    t, v = (ts[0], vs[0]) if len(ts) == 1 else (tf.concat(ts, 0), tf.concat(vs, 0))
    if plan.perm is not None:
        t, v = tf.gather(t, plan.perm), tf.gather(v, plan.perm)
    return t, v


def _word_levels(plan, lay, levels):
    """Per-segment levels as one per packed word, shaped (words, 1) against (words, 16) values."""
    return tf.gather(levels, plan.seg_of_word)[:, None]


def encode_body(lay, plan, rule, head, xla, g, b, threshold, lengths, levels=None):
    """The bucket's encode: (payload, segment thresholds, segment magnitudes) -- the last two
    empty for a numeric ``threshold`` (a 0-d float32 tensor). ``g``, ``b``: the flat gradient
    and residual values (:func:`_flat`); "auto": the segments' ``levels`` when computed outside
    (:mod:`native_ops`), else ``lengths``, the levels' divisors."""
    x = b + g
    mags = []
    if lay.auto:
        ts, vs = levels if levels is not None else table_levels(plan, x, rule, lengths, xla)
        t = _word_levels(plan, lay, ts)
        mags = [tf.bitcast(vs, tf.int32)]
    else:
        ts = vs = tf.zeros([0], tf.float32)
        t = threshold
    xw = tf.reshape(x, [lay.words, wire.VALUES_PER_WORD])
    words = codec.pack(tf.reshape(codec.codes(xw, t), [-1]))
    # one flags byte per member: whether its gradient held NaN or Inf
    finite = tf.reduce_all(tf.reshape(tf.math.is_finite(g), [lay.words, 16]), 1)
    if xla:  # per member's words (a segment reduction would be a scatter there)
        bad = tf.logical_not(tf.stack([tf.reduce_all(finite[w:w + n])
                                       for w, n in lay.member_offsets()]))
    else:
        bad = tf.logical_not(tf.cast(tf.math.unsorted_segment_min(
            tf.cast(finite, tf.int32), plan.member_of_word, lay.members), tf.bool))
    nonfinite = tf.reduce_any(bad)
    fw = wire.flag_words(lay.members)
    member_bytes = tf.pad(tf.cast(bad, tf.uint8), [[0, 4 * fw - lay.members]])
    flags = tf.bitwise.bitwise_or(tf.cast(nonfinite, tf.int32) * wire.FLAG_NONFINITE, head[1])
    payload = tf.concat(
        [tf.constant(head[:1], tf.int32), tf.reshape(flags, [1]), tf.constant(head[2:], tf.int32),
         tf.bitcast(tf.reshape(member_bytes, [fw, 4]), tf.int32)] + mags + [words], 0)
    return payload, ts, vs


def finish_body(lay, plan, xla, average, scale, rows, checked, count, g, before, threshold, ts,
                vs):
    """The bucket's finish: (the flat result, the flat new residual, whether any member's result
    is NaN).
    ``rows``: the gathered payloads (nranks, payload_words); ``checked``: True once the headers
    agree; ``count``: the divisor of an average; ``g``, ``before``: as :func:`encode_body` took
    them; ``ts``/``vs``: this rank's segment levels ("auto"), else ``threshold``."""
    nranks = rows.shape[0]
    fw = wire.flag_words(lay.members)
    raw = tf.reshape(tf.bitcast(rows[:, wire.BUCKET_HEADER_WORDS:lay.head_words], tf.uint8),
                     [nranks, 4 * fw])[:, :lay.members]
    member_bad = tf.logical_or(tf.reduce_any(tf.not_equal(raw, 0), 0), tf.logical_not(checked))
    bad = tf.gather(member_bad, plan.member_of_word)[:, None]  # (words, 1)
    words = rows[:, lay.body:]
    if lay.auto:
        mags = tf.gather(tf.bitcast(rows[:, lay.head_words:lay.body], tf.float32),
                         plan.seg_of_word, axis=1)  # (nranks, words): each sender's
    else:
        mags = tf.fill([nranks, 1], threshold)
    if xla:  # one word's 16 codes a vector; the rows added in rank order
        c = tf.bitwise.bitwise_and(tf.bitwise.right_shift(
            words[:, :, None], tf.constant(wire.WORD_SHIFTS, tf.int32)), 3)
        v = codec.decoded(c, mags[:, :, None])
        out = v[0]
        for i in range(1, nranks):
            out = out + v[i]
    else:  # one row at a time, summed through selects (see codec.accumulate)
        out = None
        for i in range(nranks):
            c = tf.reshape(codec.unpack(words[i], 16 * lay.words), [lay.words, 16])
            m = mags[i][:, None]
            out = codec.values(c, m) if out is None else codec.accumulate(out, c, m)
    out = tf.where(bad, tf.constant(float("nan"), tf.float32), out)
    if average:
        out = out / count
    if scale != 1.0:
        out = out * tf.constant(scale, tf.float32)
    x = tf.reshape(before + g, [lay.words, 16])
    if lay.auto:
        t, v = _word_levels(plan, lay, ts), _word_levels(plan, lay, vs)
    else:
        t = v = threshold
    new = tf.where(bad, tf.reshape(before, [lay.words, 16]),
                   tf.where(x >= t, x - v, tf.where(x <= -t, x + v, x)))
    new = tf.reshape(new, [-1])
    return tf.reshape(out, [-1]), new, tf.reduce_any(member_bad)


class Passes:
    """A layout's two bodies for one compressor mode, plain or each one XLA call (``xla``)."""

    def __init__(self, lay, plan, rule, head, xla, average, scale):
        self.xla = xla
        enc = functools.partial(encode_body, lay, plan, rule, head, xla)
        fin = functools.partial(finish_body, lay, plan, xla, average, scale)
        if xla:
            enc = tf.function(enc, jit_compile=True, autograph=False)
            fin = tf.function(fin, jit_compile=True, autograph=False)
        self.encode, self._finish = enc, fin

    def finish(self, rows, checked, count, g, before, threshold, ts, vs, want_norms):
        """:func:`finish_body`'s outputs and the new residual's norms when ``want_norms`` (a
        0-d bool tensor), else NaN (:func:`codec.norms_if`)."""
        out, new, bad = self._finish(rows, checked, count, g, before, threshold, ts, vs)
        return out, new, bad, codec.norms_if(want_norms, new)


class NativePasses:
    """A layout's two bodies as :mod:`native_ops`' encode and finish ops, with the signatures of
    :class:`Passes`' (the levels, "auto", always given to the encode)."""

    def __init__(self, lay, head, average, scale):
        self.lay, self.head, self.average, self.scale = lay, head, average, scale

    def encode(self, g, b, threshold, lengths, levels):
        if self.lay.auto:
            ts, vs = levels
            return native_ops.bucket_encode(self.lay, self.head, g, b, ts, vs), ts, vs
        empty = tf.zeros([0], tf.float32)
        t = tf.reshape(threshold, [1])
        return native_ops.bucket_encode(self.lay, self.head, g, b, t, t), empty, empty

    def finish(self, rows, checked, count, g, before, threshold, ts, vs, want_norms):
        if not self.lay.auto:
            ts = vs = tf.reshape(threshold, [1])
        return native_ops.bucket_finish(self.lay, self.average, self.scale, rows, checked, count,
                                        g, before, ts, vs, want_norms)


def native(state, lay):
    """Whether a bucket of ``lay`` runs :class:`NativePasses`: the ops built, no GPU, and, for
    "auto", levels that the op computes (not "opt")."""
    return (not lay.single and native_ops.codec_usable()
            and (not lay.auto or native_ops.usable(state.auto_rule)))


def passes_of(state, lay, plan, head, average, scale):
    use = native(state, lay)
    xla = not use and kernels._compiled(lay.values)
    cache = state.eager_fns
    key = ("passes", id(lay), state.auto_rule, use, xla, bool(average), float(scale))
    got = cache.get(key)
    if got is None or got[0] is not lay:
        got = cache[key] = (lay, NativePasses(lay, head, average, scale) if use else
                            Passes(lay, plan, state.auto_rule, head, xla, average, scale))
    return got[1]
