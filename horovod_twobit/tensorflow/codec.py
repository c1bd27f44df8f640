"""The 2-bit codec in TensorFlow ops: quantize with error feedback, pack, unpack.

No state, no communication, no NumPy: the same code runs eagerly and inside ``tf.function``, on CPU
and GPU. The words are built as bytes and reinterpreted with ``tf.bitcast``, so their memory layout
is the one the PyTorch and NumPy codecs produce (MXNet's): byte k of a word holds values 4k..4k+3,
the first of them in the byte's two highest bits.
"""

import tensorflow as tf

from .. import wire

_SHIFTS = (6, 4, 2, 0)


def _flat32(grad):
    g = tf.reshape(grad, [-1])
    return g if g.dtype == tf.float32 else tf.cast(g, tf.float32)


def codes(x, threshold):
    """uint8 codes of float32 values: 3 (``11``) where x >= t, 2 (``10``) where x <= -t, else 0."""
    t = tf.constant(threshold, tf.float32)
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
    t = tf.constant(threshold, tf.float32)
    zero = tf.zeros(tf.shape(c), tf.float32)
    return tf.where(tf.equal(c, wire.CODE_POS), t + zero,
                    tf.where(tf.equal(c, wire.CODE_NEG), -t + zero, zero))


def quantize_pack(grad, residual, threshold):
    """Packed words of ternary(residual + grad) without touching the residual (see :func:`commit`).
    ``residual`` is a tensor or a variable (its current value is read)."""
    x = tf.reshape(tf.convert_to_tensor(residual), [-1]) + _flat32(grad)
    return pack(codes(x, threshold))


def committed(grad, residual_value, threshold):
    """The residual after one error-feedback step: r <- (r + g) - q, with q the ternary value
    :func:`quantize_pack` sent for the same (grad, residual). The float32 operations are MXNet's,
    in its order, so the bits are MXNet's. Returns a 1-D tensor."""
    t = tf.constant(threshold, tf.float32)
    x = tf.reshape(residual_value, [-1]) + _flat32(grad)
    return tf.where(x >= t, x - t, tf.where(x <= -t, x + t, x))


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


def encode(grad, residual, threshold):
    """Quantizes ``grad`` with error feedback and packs it.

    ``residual`` (a float32 ``tf.Variable`` of any shape with as many values as ``grad``) is updated
    in place: r <- r + g; q = +t where r >= t, -t where r <= -t, else 0; r <- r - q. Returns the
    1-D int32 words, ceil(numel / 16) of them. Gradients of other float dtypes are converted to
    float32 before the add. Works eagerly and inside ``tf.function``."""
    t = wire.validate_threshold(threshold)
    if t == "auto":
        raise ValueError("encode() takes a numeric threshold; 'auto' is a TwoBitCompressor mode")
    grad = tf.convert_to_tensor(grad) if not isinstance(grad, tf.IndexedSlices) else grad
    _check(grad, residual)
    r = residual.read_value()
    words = quantize_pack(grad, r, t)
    with tf.control_dependencies([words]):
        update = residual.assign(tf.reshape(committed(grad, r, t), tf.shape(residual)))
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
