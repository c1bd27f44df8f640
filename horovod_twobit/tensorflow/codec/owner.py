"""The scatter exchange's "auto" phase 2 in TF ops: each owner re-encodes its summed chunk in 3
bits, one scale per piece; the PyTorch binding's ``owner_codec`` (the same bytes, the same
float32 operations) and :func:`horovod_twobit.reference.scatter.owner_quantize`, bit for bit.

For x = e + S (the owner's residual plus the chunk's sum), a piece's scale is a = max |x| / 3
(at least the smallest normal float32, rounded down to 22 significant bits so that every k * a
is exact), its codes k = round(x / a) in [-3, 3] (half to even), sent as k + 3 in the count
planes' layout; every rank decodes k * a and the owner keeps e = x - k * a.
"""

import numpy as np
import tensorflow as tf

from horovod_twobit.wire import scatter as sw
from horovod_twobit.tensorflow.codec import counts

_FLT_MIN = float(np.finfo(np.float32).tiny)


def _per_value(per_piece, pieces, nvalues):
    """One value per piece, repeated over the piece's 16 * words values, cut to ``nvalues``."""
    reps = np.asarray([16 * p[4] for p in pieces], np.int32)
    return tf.repeat(per_piece, reps)[:nvalues]


def scales(pieces, nwords, x):
    """The scale of every piece of ``x`` (a chunk's r + S, zero past its real values): max |x| / 3,
    then at least the smallest normal float32, then rounded down to 22 significant bits."""
    padded = tf.pad(x, [[0, 16 * nwords - x.shape[0]]])
    per_word = tf.reduce_max(tf.abs(tf.reshape(padded, [nwords, 16])), 1)
    ids = np.repeat(np.arange(len(pieces), dtype=np.int32), [p[4] for p in pieces])
    m = tf.maximum(tf.math.unsorted_segment_max(per_word, ids, len(pieces)), 0.0)  # empty: 0
    # 3 as a run-time value: Grappler turns a division by a constant into a multiplication by
    # its rounded reciprocal, which is not the same float32
    levels = tf.bitwise.bitwise_or(tf.bitwise.bitwise_and(tf.bitcast(m[:1], tf.int32), 0),
                                   sw.OWNER_LEVELS)
    a = tf.maximum(m / tf.cast(levels, tf.float32), _FLT_MIN)
    return tf.bitcast(tf.bitwise.bitwise_and(tf.bitcast(a, tf.int32), ~3), tf.float32)


def owner_encode(pieces, nwords, residual, S, bad):
    """(the body of an owner's phase-2 payload: its pieces' scales as int32 words, then the code
    planes of its ``nwords`` words; the owner's new residual) for the chunk's sum ``S`` and its
    ``residual`` (float32, the chunk's values). ``bad``: a bool tensor, one per member; pieces
    of bad members are sent as scale 0 and codes 0 and keep their residual."""
    n, L = S.shape[0], sw.OWNER_LEVELS
    if not pieces:
        return tf.zeros([0], tf.int32), residual
    x = residual + S
    piece_bad = tf.gather(bad, np.asarray([p[1] for p in pieces], np.int32))
    a = tf.where(piece_bad, 0.0, scales(pieces, nwords, x))
    a_v, bad_v = _per_value(a, pieces, n), _per_value(piece_bad, pieces, n)
    q = tf.where(bad_v, 0.0, tf.clip_by_value(tf.round(x / a_v), -L, L))
    new = tf.where(bad_v, residual, x - q * a_v)
    u = tf.pad(tf.cast(q, tf.int32) + L, [[0, 16 * nwords - n]], constant_values=L)
    return tf.concat([tf.bitcast(a, tf.int32), counts.pack_counts(u, sw.OWNER_BITS)], 0), new


def owner_values(body, pieces, nwords, nvalues, divisor=None, scale=None):
    """k * a (float32) for the first ``nvalues`` values of an owner's phase-2 ``body``, then
    / ``divisor`` and * ``scale`` when given (the reference's order)."""
    k = len(pieces)
    a_v = _per_value(tf.bitcast(body[:k], tf.float32), pieces, nvalues)
    out = counts.unpack_counts(body[k:], nvalues, sw.OWNER_BITS, sw.OWNER_LEVELS) * a_v
    if divisor is not None:
        out = out / divisor
    if scale is not None:
        out = out * scale
    return out
