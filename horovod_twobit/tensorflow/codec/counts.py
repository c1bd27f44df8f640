"""Counts and spreads in TF ops, shared by the scatter codec and the owner's codec: the bit planes
of phase 2's unsigned counts (:func:`pack_counts`, :func:`unpack_counts`), and per-entry values
repeated over their words (:func:`spread`).
"""

import numpy as np
import tensorflow as tf

from horovod_twobit import wire


def pack_counts(u, bits):
    """Bit planes of the unsigned counts ``u`` (int32, 0..2N, 16 values a word): ``bits`` planes
    of ceil(n / 32) int32 words, plane j holding bit j of value k at bit k % 32 of word k // 32
    (:func:`horovod_twobit.reference.scatter.pack_counts`)."""
    u = tf.reshape(tf.pad(u, [[0, (-u.shape[0]) % 32]]), [-1, 32])
    weights = tf.bitwise.left_shift(tf.ones([32], tf.int32), tf.range(32, dtype=tf.int32))
    planes = [tf.reduce_sum(tf.bitwise.bitwise_and(tf.bitwise.right_shift(u, j), 1) * weights, 1)
              for j in range(bits)]
    return tf.concat(planes, 0) if planes else tf.zeros([0], tf.int32)


def unpack_counts(words, nvalues, bits, nranks):
    """The signed counts (float32) of the first ``nvalues`` values of :func:`pack_counts` words."""
    planes = tf.reshape(words, [bits, -1])
    shifts = tf.range(32, dtype=tf.int32)
    u = tf.zeros([planes.shape[1], 32], tf.int32)
    for j in range(bits):
        u += tf.bitwise.left_shift(tf.bitwise.bitwise_and(
            tf.bitwise.right_shift(planes[j][:, None], shifts), 1), j)
    return tf.cast(tf.reshape(u, [-1])[:nvalues] - nranks, tf.float32)


def spread(x, words, per_word=wire.VALUES_PER_WORD, axis=-1):
    """Entry i of ``x`` (along ``axis``) repeated ``words[i] * per_word`` times; ``words`` is
    static (NumPy). One gather of a per-word index, then a tile: ``tf.repeat`` with a vector of
    counts is dozens of graph ops and builds a (len(words), max count) mask and tile, many times
    the bucket's size when many small blocks share a bucket with one large one."""
    words = np.asarray(words, np.int64)
    if words.size and not (words == words[0]).all():
        x = tf.gather(x, np.repeat(np.arange(words.size, dtype=np.int32), words), axis=axis)
        reps = per_word
    else:
        reps = int(words[0]) * per_word if words.size else 0
    return x if reps == 1 else tf.repeat(x, reps, axis=axis)
