"""A bucket of tensors in TF ops: one encode, one allgather and one finish for several tensors.

The payload is :mod:`horovod_twobit.layout`'s (the PyTorch binding's bytes). The members' residual
variables are read into one flat buffer, the codec's passes run once over it, and each member's
slice of the new residual is assigned back to its variable: every member keeps its own residual,
threshold and blocks, and its result is what it would get alone, bit for bit. A member whose
gradient held NaN or Inf on any rank gets NaN on every rank and keeps its residual.
"""

import functools

import numpy as np
import tensorflow as tf

import horovod.tensorflow.mpi_ops as mpi_ops

from .. import wire
from ..layout import Layout
from . import codec, kernels


def layout_of(compressor, keys, tensors):
    """The (cached) layout of a bucket of ``tensors`` under ``keys``."""
    numels = tuple(t.shape.num_elements() for t in tensors)
    cache = compressor._plain.eager_fns  # plain state, not a checkpoint dependency
    ck = ("layout", tuple(keys), numels)
    lay = cache.get(ck)
    if lay is None:
        lay = cache[ck] = Layout(numels, compressor.threshold == "auto", compressor.block,
                                 compressor.blocks)
    return lay


def _flat(layout, parts):
    """One flat float32 buffer: each 1-D part at its start, zeros between."""
    pieces = []
    for p, n, w in zip(parts, layout.numels, layout.member_words):
        pieces.append(p)
        if 16 * w > n:
            pieces.append(tf.zeros([16 * w - n], tf.float32))
    return tf.concat(pieces, 0)


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


def segment_levels(layout, x, rule):
    """(thresholds, magnitudes) of every segment of an "auto" layout, from the flat float32 r + g:
    equal-length segments in one reduction each, exactly as one tensor or block is reduced."""
    return grouped_levels(layout.groups, layout.seg_starts, x, rule)


def grouped_levels(groups, starts, x, rule):
    """(thresholds, magnitudes) of segments of ``x`` (segment k starts at ``starts[k]``), from
    ``groups`` of equal-length segments: (length, segment ids, contiguous start or None)."""
    name, k = wire.parse_rule(rule)
    ts, vs, order = [], [], []
    for length, ids, start in groups:
        if not length:
            t = v = tf.ones([len(ids)], tf.float32)
        else:
            if start is not None:
                rows = x[start:start + len(ids) * length]
            else:
                idx = np.concatenate([np.arange(starts[i], starts[i] + length)
                                      for i in ids]).astype(np.int32)
                rows = tf.gather(x, idx)
            t, v = codec._row_levels(tf.reshape(rows, [len(ids), length]), name, k)
        ts.append(t)
        vs.append(v)
        order += ids
    if not ts:
        return tf.zeros([0], tf.float32), tf.zeros([0], tf.float32)
    perm = np.argsort(np.asarray(order), kind="stable").astype(np.int32)
    if len(ts) == 1 and order == sorted(order):
        return ts[0], vs[0]
    return tf.gather(tf.concat(ts, 0), perm), tf.gather(tf.concat(vs, 0), perm)


class BucketExchange:
    """Several tensors' part of one collective: the payload, and what is needed to finish it."""

    def __init__(self, compressor, tensors, keys, op, prescale, postscale, nranks):
        self.layout = lay = layout_of(compressor, keys, tensors)
        self.tensors, self.keys = list(tensors), list(keys)
        self.op, self.nranks = op, int(nranks)
        self.scale = float(prescale) * float(postscale)
        self.residuals = [compressor.residuals.get(k, t) for k, t in zip(keys, tensors)]
        self.before = _flat(lay, [tf.reshape(r.read_value(), [-1]) for r in self.residuals])
        self.grad = _flat(lay, [codec._flat32(t) for t in tensors])
        head = lay.header(compressor.threshold)
        self.head = head
        mags = []
        if lay.auto:
            ts, vs = segment_levels(lay, self.before + self.grad, compressor.auto_rule)
            self.threshold, self.magnitude = spread(ts, lay.seg_words), spread(vs, lay.seg_words)
            mags = [tf.bitcast(vs, tf.int32)]
        else:
            self.threshold = self.magnitude = compressor.threshold
        words, nonfinite = kernels.encode(self.grad, self.before, self.threshold)
        # one flags byte per member: whether its gradient held NaN or Inf
        finite = tf.reduce_all(tf.reshape(tf.math.is_finite(self.grad), [lay.words, 16]), 1)
        member_of_word = np.repeat(np.arange(lay.members), lay.member_words).astype(np.int32)
        bad = tf.logical_not(tf.cast(tf.math.unsorted_segment_min(
            tf.cast(finite, tf.int32), member_of_word, lay.members), tf.bool))
        fw = wire.flag_words(lay.members)
        member_bytes = tf.pad(tf.cast(bad, tf.uint8), [[0, 4 * fw - lay.members]])
        flags = tf.bitwise.bitwise_or(tf.cast(nonfinite, tf.int32) * wire.FLAG_NONFINITE, head[1])
        self.payload = tf.concat(
            [tf.constant(head[:1], tf.int32), tf.reshape(flags, [1]),
             tf.constant(head[2:], tf.int32), tf.bitcast(tf.reshape(member_bytes, [fw, 4]),
                                                         tf.int32)] + mags + [words], 0)

    def finish(self, gathered):
        """Checks, decodes and sums the gathered payloads; commits the residuals; returns the
        results (each tensor's shape and dtype)."""
        lay, nranks = self.layout, self.nranks
        fitted, checked = _validated(gathered, lay, self.head, nranks, self.keys)
        rows = tf.reshape(fitted, [nranks, lay.payload_words])
        fw = wire.flag_words(lay.members)
        raw = tf.bitcast(rows[:, wire.BUCKET_HEADER_WORDS:lay.head_words], tf.uint8)
        member_bad = tf.reduce_any(tf.not_equal(tf.reshape(raw, [nranks, 4 * fw])[:, :lay.members],
                                                0), 0)
        bad = spread(tf.logical_or(member_bad, tf.logical_not(checked)), lay.member_words)
        if lay.auto:
            mags = tf.bitcast(rows[:, lay.head_words:lay.body], tf.float32)
            ts = spread(mags, lay.seg_words, per_word=1, axis=1)
        else:
            ts = tf.fill([nranks], tf.constant(self.threshold, tf.float32))
        if self.op == mpi_ops.Average:  # a run-time divisor (see communicator.Exchange.finish)
            count = tf.cast(tf.size(gathered) // lay.payload_words, tf.float32)
        else:
            count = tf.constant(1.0, tf.float32)
        out, new = kernels.finish(rows[:, lay.body:], ts, bad, count, self.grad, self.before,
                                  self.threshold, self.op == mpi_ops.Average, self.scale,
                                  self.magnitude)
        return commit(lay, self.residuals, new, self.tensors, out)


def commit(lay, residuals, new, tensors, out):
    """Assigns each member's slice of the flat ``new`` to its residual variable; returns each
    member's slice of the flat result ``out`` (its tensor's shape and dtype), after the updates."""
    updates = [r.assign(tf.reshape(new[s:s + n], r.shape))
               for r, s, n in zip(residuals, lay.starts, lay.numels)]
    results = []
    with tf.control_dependencies(updates):
        for t, s, n in zip(tensors, lay.starts, lay.numels):
            res = tf.reshape(out[s:s + n], t.shape)
            if res.dtype != t.dtype:
                res = tf.cast(res, t.dtype)
            results.append(tf.identity(res))
    return results


def _validated(gathered, lay, head, nranks, keys):
    """As :func:`communicator.validated`, for bucket payloads: every rank's header words (all
    but the flags word, whose FLAG_NONFINITE may differ) must equal this rank's."""
    need = nranks * lay.payload_words
    size = tf.size(gathered)
    fitted = tf.pad(gathered[:need], [[0, tf.maximum(0, need - size)]])
    h = tf.reshape(fitted, [nranks, lay.payload_words])[:, :wire.BUCKET_HEADER_WORDS]
    cols = [0, 2, 3, 4, 5, 6, 7]
    same = tf.reduce_all(tf.equal(tf.gather(h, cols, axis=1),
                                  tf.constant([[head[c] for c in cols]], tf.int32)))
    modes = wire.FLAG_AUTO | wire.FLAG_BLOCKS | wire.FLAG_BUCKET | wire.FLAG_PLAN  # a plan: scatter
    mode = tf.reduce_all(tf.equal(tf.bitwise.bitwise_and(h[:, 1], modes), head[1] & modes))
    ok = tf.logical_and(tf.equal(size, need), tf.logical_and(same, mode))
    if tf.executing_eagerly():
        if not bool(ok):
            _raise_mismatch(gathered.numpy(), nranks, keys)
        return fitted, tf.constant(True)
    checked = tf.cond(ok, lambda: tf.constant(True),
                      lambda: tf.reshape(tf.numpy_function(
                          functools.partial(_host_check, nranks, keys), [gathered], tf.bool,
                          stateful=True), []))
    return fitted, checked


def _raise_mismatch(flat, nranks, keys):
    flat = [int(x) for x in np.asarray(flat).reshape(-1)]
    wire.split_bucket(lambda a, b: flat[a:b], len(flat), nranks, list(keys))
    raise wire.PayloadMismatchError("bucket of %s: ranks sent incompatible payloads" % keys[0])


def _host_check(nranks, keys, flat):
    _raise_mismatch(flat, nranks, keys)
    return np.bool_(True)
