"""XLA-compiled codec passes for the TensorFlow binding.

The encode pass (r + g, threshold, pack; and whether g held NaN or Inf) and the finish pass (decode
and sum every rank's payload in rank order, divide, scale; commit the residual) are the codec's TF
ops in two functions. For tensors of at least ``COMPILE_MIN_NUMEL`` values with a static size, each
runs as one ``tf.function(jit_compile=True)`` call: XLA fuses the element-wise chain into a few
loops instead of one kernel and one full-size temporary per op. Smaller tensors, tensors whose size
is known only at run time, and every tensor when ``HOROVOD_TWOBIT_COMPILE=0`` run the same ops
without XLA. Both paths give the same bits: only exact float32 operations (add, compare, subtract
a threshold, select, one division, one multiplication) are involved, and the divisor and the
thresholds reach XLA as arguments, never as constants it could fold into a reciprocal.

XLA compiles once per tensor size (gradient sizes do not change between steps), on the first step.
"""

import os

import tensorflow as tf

from horovod_twobit import wire
from horovod_twobit.tensorflow import codec

COMPILE_MIN_NUMEL = int(os.environ.get("HOROVOD_TWOBIT_COMPILE_MIN_NUMEL", 1 << 16))
DISABLED = os.environ.get("HOROVOD_TWOBIT_COMPILE", "1") == "0"


def _encode_body(grad, before, threshold):
    """(int32 words of ternary(before + grad), whether grad held NaN or Inf)."""
    words = codec.quantize_pack(grad, before, threshold)
    return words, tf.logical_not(tf.reduce_all(tf.math.is_finite(grad)))


def _decode_sum_plain(words, ts, n):
    """Without XLA: one row at a time, summed through selects (see codec.accumulate)."""
    out = None
    for i in range(words.shape[0]):
        c = codec.unpack(words[i], n)
        t = ts[i] if ts.shape.rank == 1 else tf.repeat(ts[i], wire.VALUES_PER_WORD)[:n]
        out = codec.values(c, t) if out is None else codec.accumulate(out, c, t)
    return out


def _decode_sum_xla(words, ts, n):
    """With XLA: every row's words as (nranks, words, 16) codes, one word's 16 values a vector,
    then the rows added in rank order (XLA does not regroup float additions)."""
    c = tf.bitwise.bitwise_and(
        tf.bitwise.right_shift(words[:, :, None], tf.constant(wire.WORD_SHIFTS, tf.int32)), 3)
    t = ts[:, None, None] if ts.shape.rank == 1 else ts[:, :, None]
    v = codec.decoded(c, t)
    out = v[0]
    for i in range(1, words.shape[0]):
        out = out + v[i]
    return tf.reshape(out, [-1])[:n]


def _finish_body(words, ts, bad, count, grad, before, threshold, magnitude, average, scale,
                 xla=False):
    """(result, new residual): the rank-order sum of the decoded rows of ``words``
    (nranks, W), row i with magnitude ``ts[i]`` (with blocks, ``ts`` is (nranks, W): one per
    word); NaN everywhere and the residual unchanged when ``bad``."""
    out = (_decode_sum_xla if xla else _decode_sum_plain)(words, ts, grad.shape[0])
    out = tf.where(bad, tf.constant(float("nan"), tf.float32), out)
    if average:
        out = out / count
    if scale != 1.0:
        out = out * tf.constant(scale, tf.float32)
    new = tf.where(bad, before, codec.committed(grad, before, threshold, magnitude))
    return out, new


_encode_xla = tf.function(_encode_body, jit_compile=True, autograph=False)
_finish_xla = tf.function(_finish_body, jit_compile=True, autograph=False)


def _compiled(numel):
    return not DISABLED and numel is not None and numel >= COMPILE_MIN_NUMEL


def encode(grad, before, threshold):
    """``grad``: 1-D float32; ``before``: the residual's value, 1-D; ``threshold``: a number, a
    0-d float32 tensor, or one per value (blocks). Returns (words, non-finite flag)."""
    if _compiled(grad.shape.num_elements()):
        return _encode_xla(grad, before, codec._t(threshold))
    return _encode_body(grad, before, threshold)


def finish(words, ts, bad, count, grad, before, threshold, average, scale, magnitude=None):
    """``words``: (nranks, num_words) int32; ``ts``: (nranks,) float32 magnitudes of the senders
    (with blocks: (nranks, num_words), each word's block magnitude);
    ``bad``: 0-d bool; ``count``: 0-d float32 divisor (used when ``average``); ``scale``: a
    Python float; ``threshold`` and ``magnitude`` (default: the threshold): this rank's, for its
    residual update. Returns (1-D float32 result, 1-D new residual)."""
    magnitude = threshold if magnitude is None else magnitude
    if _compiled(grad.shape.num_elements()) and words.shape[0] is not None:
        return _finish_xla(words, ts, bad, count, grad, before, codec._t(threshold),
                           codec._t(magnitude), bool(average), float(scale), True)
    return _finish_body(words, ts, bad, count, grad, before, threshold, magnitude, average, scale)
