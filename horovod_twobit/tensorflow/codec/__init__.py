"""The 2-bit codec in TensorFlow ops: quantize with error feedback, pack, unpack.

No state, no communication, no NumPy: the same code runs eagerly and inside ``tf.function``, on CPU
and GPU. The words are built as bytes and reinterpreted with ``tf.bitcast``, so their memory layout
is the one the PyTorch and NumPy codecs produce (MXNet's): byte k of a word holds values 4k..4k+3,
the first of them in the byte's two highest bits.

Thresholds are numbers, or (for ``threshold="auto"``) 0-d float32 tensors from
:func:`auto_threshold`, or (with blocks) one per value (:func:`per_value`).
"""

import tensorflow as tf

from horovod_twobit import wire
from horovod_twobit.tensorflow.codec import lsq_pass

_SHIFTS = (6, 4, 2, 0)

AUTO_RULES, DEFAULT_RULE = wire.AUTO_RULES, wire.DEFAULT_RULE
OPT_MULTIPLES = wire.OPT_MULTIPLES
FLT_MIN = 2.0 ** -126  # the smallest normal float32


def _flat32(grad):
    g = tf.reshape(grad, [-1])
    return g if g.dtype == tf.float32 else tf.cast(g, tf.float32)


def _t(threshold):
    """The threshold as a float32 tensor: a number (fixed) or a 0-d float32 tensor (automatic)."""
    if tf.is_tensor(threshold):
        if threshold.dtype != tf.float32:
            raise TypeError("a threshold tensor must be float32, got %s" % threshold.dtype.name)
        return threshold
    return tf.constant(threshold, tf.float32)


def auto_levels(residual, grad, rule=DEFAULT_RULE):
    """``(threshold, magnitude)`` for ``residual + grad`` (the error-compensated values), two 0-d
    float32 tensors computed with TF ops (no host sync; eagerly or inside ``tf.function``): values
    at or beyond the threshold are sent as +-magnitude.

    ``lsq`` (the default): for each support threshold c * mean|x|, c in :data:`OPT_MULTIPLES`, the
    least-squares magnitude of that support (the mean of |x| over it); the pair with the smallest
    squared error wins. ``opt``: among the same thresholds, the one that minimises the error with
    magnitude = threshold; ``mean``: the mean absolute value; ``rms``: the root mean square (for
    these three the magnitude is the threshold). A ``*K`` suffix multiplies both by K (for
    studies). Sums run in float64, divisions too, and each value is rounded to float32 once; it is
    never below the smallest normal float32 (so zeros are never sent), and both are 1.0 for an
    empty tensor. It matches :func:`horovod_twobit.reference.auto_levels` (and the PyTorch binding)
    bit for bit: a float64 sum of float32 values differs between summation orders by far less than
    half a float32 ulp, so only astronomically rare ties round differently.

    ``residual`` is a tensor or a variable (its current value is read) with as many values as
    ``grad``; gradients of other float dtypes are converted to float32 before the add."""
    rule, k = wire.parse_rule(rule)
    x = _compensated(residual, grad)
    n = x.shape.num_elements()
    if n == 0:
        return tf.ones([], tf.float32), tf.ones([], tf.float32)
    t, v = _row_levels(x[None, :], rule, k)
    levels = []
    for y in (t[0], v[0]):
        if n is None:  # a length known only at run time
            y = tf.where(tf.equal(tf.size(x), 0), tf.constant(1.0, tf.float32), y)
        levels.append(y)
    return tuple(levels)


def block_levels(residual, grad, block, rule=DEFAULT_RULE):
    """Per-block :func:`auto_levels` (``TwoBitCompressor("auto", block=...)``): ``(thresholds,
    magnitudes)``, two 1-D float32 tensors of ceil(n / block) values, block b covering values
    b * block up to (b + 1) * block (the last block may be shorter); bit for bit
    :func:`horovod_twobit.reference.block_levels`. The tensor's size must be static."""
    rule, k = wire.parse_rule(rule)
    x = _compensated(residual, grad)
    n = x.shape.num_elements()
    if n is None:
        raise ValueError("block=%d needs tensors of a size known when the graph is built" % block)
    full = n - n % block
    parts = []
    if full:
        parts.append(_row_levels(tf.reshape(x[:full], [-1, block]), rule, k))
    if full < n:
        parts.append(_row_levels(x[None, full:], rule, k))
    if not parts:
        return tf.zeros([0], tf.float32), tf.zeros([0], tf.float32)
    return tuple(tf.concat([p[i] for p in parts], 0) for i in (0, 1))


def per_value(levels, block, numel):
    """Per-block values repeated over each block's values: 1-D float32, ``numel`` long (what the
    codec's ops take wherever they take a threshold or magnitude)."""
    return tf.repeat(levels, block)[:numel]


def _compensated(residual, grad):
    if isinstance(grad, tf.IndexedSlices):
        raise TypeError("grad is a tf.IndexedSlices: densify it first")
    r = tf.reshape(tf.convert_to_tensor(residual), [-1])
    if r.dtype != tf.float32:
        raise TypeError("residual must be float32, got %s" % r.dtype.name)
    return r + _flat32(tf.convert_to_tensor(grad))


def _row_levels(x, rule, k, count=None, unrolled=False):
    """(thresholds, magnitudes), float32, one per row of the float32 ``x`` (rows, m > 0).
    ``count``: the rows' lengths as a float64 tensor (inside an XLA body, a run-time value keeps
    XLA from turning the division into a multiplication by a reciprocal); default: m.
    ``unrolled``: ``lsq``'s counts and sums as one variadic reduction (XLA bodies only)."""
    a = tf.cast(tf.abs(x), tf.float64)
    total = tf.reduce_sum(a * a if rule == "rms" else a, axis=-1)
    if count is None:
        count = tf.cast(tf.shape(x, out_type=tf.int64)[-1], tf.float64)
    # Not total / count: inside a tf.function Grappler turns a division by a constant into a
    # multiplication by its reciprocal, which is not the correctly rounded quotient NumPy computes.
    # DivNoNan is left alone (and count > 0 here).
    t = tf.math.divide_no_nan(total, count)
    if rule == "rms":
        t = tf.sqrt(t)
    v = t
    if rule in ("opt", "lsq"):
        ts = t[:, None] * tf.constant(OPT_MULTIPLES, tf.float64)
        if rule == "opt":
            cuts = [ts[:, i:i + 1] for i in range(len(OPT_MULTIPLES))]
            errs = tf.stack([tf.reduce_sum(tf.where(a >= c, tf.square(a - c), a * a), -1)
                             for c in cuts], -1)
            t = v = tf.gather(ts, tf.argmin(errs, -1), batch_dims=1)
        elif unrolled:  # one loop over the values with 18 accumulators (see lsq_pass)
            counts, sums = lsq_pass.counts_and_sums(a, ts)
        else:
            # every candidate in one broadcast comparison (rows, multiples, m): a handful of ops
            sent = a[:, None, :] >= ts[:, :, None]
            counts = tf.reduce_sum(tf.cast(sent, tf.float64), -1)
            sums = tf.reduce_sum(tf.where(sent, a[:, None, :], tf.zeros_like(a[:, None, :])), -1)
        if rule == "lsq":
            best = tf.argmax(tf.math.divide_no_nan(sums * sums, counts), -1)  # 0 where nothing is sent
            t = tf.gather(ts, best, batch_dims=1)
            c, s = tf.gather(counts, best, batch_dims=1), tf.gather(sums, best, batch_dims=1)
            v = tf.where(c > 0, tf.math.divide_no_nan(s, c), t)
    levels = []
    for y in (t, v):
        if k:
            y = y * float(k)
        y = tf.cast(y, tf.float32)
        levels.append(tf.where(y < FLT_MIN, tf.constant(FLT_MIN, tf.float32), y))  # NaN stays NaN
    return tuple(levels)


def auto_threshold(residual, grad, rule=DEFAULT_RULE):
    """The threshold of :func:`auto_levels` (for ``opt``, ``mean`` and ``rms`` also the
    magnitude), a 0-d float32 tensor."""
    return auto_levels(residual, grad, rule)[0]


def codes(x, threshold):
    """uint8 codes of float32 values: 3 (``11``) where x >= t, 2 (``10``) where x <= -t, else 0."""
    t = _t(threshold)
    zero = tf.zeros_like(x, dtype=tf.uint8)
    return tf.where(x >= t, tf.constant(wire.CODE_POS, tf.uint8) + zero,
                    tf.where(x <= -t, tf.constant(wire.CODE_NEG, tf.uint8) + zero, zero))


def pack(c):
    """Packs 1-D uint8 codes (values 0..3) into 1-D int32 words in MXNet's layout."""
    n = tf.size(c)
    nw = (n + wire.VALUES_PER_WORD - 1) // wire.VALUES_PER_WORD
    padded = tf.pad(c, [[0, nw * wire.VALUES_PER_WORD - n]])
    q = tf.reshape(padded, [-1, 4])
    byts = (tf.bitwise.left_shift(q[:, 0], tf.constant(6, tf.uint8))
            | tf.bitwise.left_shift(q[:, 1], tf.constant(4, tf.uint8))
            | tf.bitwise.left_shift(q[:, 2], tf.constant(2, tf.uint8))
            | q[:, 3])
    return tf.bitcast(tf.reshape(byts, [-1, 4]), tf.int32)


def unpack(words, numel):
    """uint8 codes of the first ``numel`` values of 1-D int32 ``words``."""
    byts = tf.reshape(tf.bitcast(words, tf.uint8), [-1, 1])
    c = tf.bitwise.bitwise_and(
        tf.bitwise.right_shift(byts, tf.constant(_SHIFTS, tf.uint8)), tf.constant(3, tf.uint8))
    return tf.reshape(c, [-1])[:numel]


def values(c, threshold):
    """float32 values of codes: +t for ``11``, -t for ``10``, 0 otherwise."""
    t = _t(threshold)
    zero = tf.zeros(tf.shape(c), tf.float32)
    return tf.where(tf.equal(c, wire.CODE_POS), t + zero,
                    tf.where(tf.equal(c, wire.CODE_NEG), -t + zero, zero))


def decoded(c, level):
    """:func:`values` for XLA bodies: +level for ``11``, -level for ``10``, 0 otherwise (any level,
    NaN and infinities included), as one select of the sign (the low bit) times the level where
    the high bit is set. XLA's CPU loops run it 1.1-1.3x faster than two nested selects."""
    sign = tf.cast(tf.bitwise.bitwise_and(c, 1) * 2 - 1, tf.float32)
    return tf.where(c >= 2, sign * level, 0.0)


def accumulate(acc, c, threshold):
    """``acc`` plus the float32 values of codes ``c`` (:func:`values`), one rounding per element:
    acc + t for ``11``, acc - t for ``10``, acc otherwise (acc is never -0, so this equals acc + 0).

    Summing decoded rows as a chain of Adds would let Grappler's ``combine_add_to_addn`` regroup
    them into an AddN (which itself adds in chunks of 8): float32 rounding then differs from the
    reference's sum in rank order, with one threshold per sender (``"auto"``, from 3 ranks on) or
    with a fixed one (from 10 ranks on). Each Add here feeds a Select, which nothing regroups."""
    t = _t(threshold)
    return tf.where(tf.equal(c, wire.CODE_POS), acc + t,
                    tf.where(tf.equal(c, wire.CODE_NEG), acc - t, acc))


def quantize_pack(grad, residual, threshold):
    """Packed words of ternary(residual + grad) without touching the residual (see :func:`commit`).
    ``residual`` is a tensor or a variable (its current value is read)."""
    x = tf.reshape(tf.convert_to_tensor(residual), [-1]) + _flat32(grad)
    return pack(codes(x, threshold))


def committed(grad, residual_value, threshold, magnitude=None):
    """The residual after one error-feedback step: r <- (r + g) - q, with q the ternary value
    :func:`quantize_pack` sent for the same (grad, residual): +-``magnitude`` (default: the
    threshold) where |r + g| reaches the threshold. The float32 operations are MXNet's, in its
    order, so the bits are MXNet's. Returns a 1-D tensor."""
    t = _t(threshold)
    v = t if magnitude is None else _t(magnitude)
    x = tf.reshape(residual_value, [-1]) + _flat32(grad)
    return tf.where(x >= t, x - v, tf.where(x <= -t, x + v, x))


def norms(residual):
    """(sum of squares, max |r|) of a residual's values, as a float64 pair: the stats' residual
    norms. Norms are for watching, not for arithmetic: the sum of squares is a float32 ``L2Loss``
    (about 1e-6 relative, as the PyTorch binding's float32 dot), the largest |r| exact. Plain
    TF ops, not inside an XLA body: TensorFlow's own CPU reductions are vectorised, XLA's CPU
    reductions are several times slower (docs/tf_step_cost.md)."""
    x = tf.reshape(residual, [-1])
    if x.shape.num_elements() == 0:
        return tf.zeros([2], tf.float64)
    return tf.cast(tf.stack([2 * tf.raw_ops.L2Loss(t=x),
                             tf.maximum(tf.reduce_max(x), -tf.reduce_min(x))]), tf.float64)


def no_norms():
    """NaN for both norms: what a step hands the stats when no read watches it."""
    return tf.constant([float("nan"), float("nan")], tf.float64)


def norms_if(want, residual):
    """:func:`norms` when the 0-d bool tensor ``want`` is True, else :func:`no_norms`: a step
    computes them only while the stats are read every step or every other (a conditional, so
    the steps between rarer reads skip the pass; those reads compute them from the residuals)."""
    return tf.cond(want, lambda: norms(residual), no_norms)


def _check(grad, residual):
    if isinstance(grad, tf.IndexedSlices):
        raise TypeError("grad is a tf.IndexedSlices: densify it first (tf.convert_to_tensor, or "
                        "sparse_as_dense=True in hvd.DistributedOptimizer / DistributedGradientTape)")
    if not isinstance(residual, tf.Variable):
        raise TypeError("residual must be a float32 tf.Variable (it is updated in place), got %r"
                        % (type(residual).__name__,))
    if residual.dtype != tf.float32:
        raise TypeError("residual must be float32, got %s" % residual.dtype.name)
    dtype = tf.as_dtype(grad.dtype)
    if not dtype.is_floating:
        raise TypeError("grad must be a floating-point tensor, got %s" % dtype.name)
    gn, rn = grad.shape.num_elements(), residual.shape.num_elements()
    if gn is not None and rn is not None and gn != rn:
        raise ValueError("residual has %d values, grad has %d" % (rn, gn))


def encode(grad, residual, threshold, magnitude=None):
    """Quantizes ``grad`` with error feedback and packs it.

    ``residual`` (a float32 ``tf.Variable`` of any shape with as many values as ``grad``) is updated
    in place: r <- r + g; q = +v where r >= t, -v where r <= -t, else 0; r <- r - q, with t the
    threshold and v the magnitude (default: t, MXNet's scheme; decode with v). Returns the 1-D
    int32 words, ceil(numel / 16) of them. Gradients of other float dtypes are converted to
    float32 before the add. Works eagerly and inside ``tf.function``."""
    t, v = wire.encode_levels(threshold, magnitude)
    grad = tf.convert_to_tensor(grad) if not isinstance(grad, tf.IndexedSlices) else grad
    _check(grad, residual)
    r = residual.read_value()
    words = quantize_pack(grad, r, t)
    with tf.control_dependencies([words]):
        update = residual.assign(tf.reshape(committed(grad, r, t, v), tf.shape(residual)))
    with tf.control_dependencies([update]):
        return tf.identity(words)


def decode(words, numel, threshold):
    """float32 values of packed ``words``: +t for code ``11``, -t for ``10``, 0 otherwise. 1-D,
    ``numel`` long."""
    t = wire.validate_threshold(threshold)
    if t == "auto":
        raise ValueError("decode() takes the numeric threshold the sender used")
    numel = int(numel)
    words = tf.convert_to_tensor(words)
    if words.dtype != tf.int32 or words.shape.rank != 1:
        raise TypeError("words must be a 1-D int32 tensor, got %s of shape %s"
                        % (words.dtype.name, words.shape))
    have = words.shape[0]
    if have is not None and have != wire.num_words(numel):
        raise ValueError("%d values need %d words, got %d" % (numel, wire.num_words(numel), have))
    return values(unpack(words, numel), t)
