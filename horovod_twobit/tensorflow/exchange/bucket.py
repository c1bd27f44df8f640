"""A bucket of tensors in TF ops: one encode, one allgather and one finish for several tensors.

The payload is :mod:`horovod_twobit.wire.layout`'s (the PyTorch binding's bytes). The members' residual
variables are read into one flat buffer, the codec's passes run once over it, and each member's
slice of the new residual is assigned back to its variable: every member keeps its own residual,
threshold and blocks, and its result is what it would get alone, bit for bit. A member whose
gradient held NaN or Inf on any rank gets NaN on every rank and keeps its residual.

A bucket costs a fixed number of graph ops, whatever its number of members: the encode (the flat
buffers, the "auto" levels of every segment, the codes, the packing, the members' NaN/Inf flags
and the payload) is one body, and the finish (the members' flags, the decode and rank-order sum
of every payload, the division and scale, the error-feedback commit and the members' results,
split and reshaped) another (:mod:`horovod_twobit.tensorflow.codec.passes`). What remains per
member is reading and assigning its residual variable, and its reshapes.
"""

import functools

import numpy as np
import tensorflow as tf

import horovod.tensorflow.mpi_ops as mpi_ops

from horovod_twobit.wire import checks as wire_checks
from horovod_twobit import wire
from horovod_twobit.wire.layout import Layout
from horovod_twobit.tensorflow.codec import native_ops
from horovod_twobit.tensorflow import codec
from horovod_twobit.tensorflow.codec.counts import spread
from horovod_twobit.tensorflow.codec.passes import passes_of, plan_of


def layout_of(state, keys, tensors):
    """The (cached) layout of a bucket of ``tensors`` under ``keys``."""
    numels = tuple(t.shape.num_elements() for t in tensors)
    cache = state.eager_fns  # plain state, not a checkpoint dependency
    ck = ("layout", tuple(keys), numels)
    lay = cache.get(ck)
    if lay is None:
        lay = cache[ck] = Layout(numels, state.threshold == "auto", state.block,
                                 state.blocks)
    return lay


def flat(layout, parts):
    """One flat float32 buffer: each 1-D part at its start, zeros between. A layout of one
    member has no padding (its flat buffer is the tensor's values)."""
    if layout.single:
        return parts[0]
    pieces = []
    for p, n, w in zip(parts, layout.numels, layout.member_words):
        pieces.append(p)
        if 16 * w > n:
            pieces.append(tf.zeros([16 * w - n], tf.float32))
    return tf.concat(pieces, 0)


def split(lay, flat):
    """Each member's 1-D slice of a flat buffer, in one op (slices of its memory, not copies). A
    layout of one member has no padding (its flat buffer is the tensor's values)."""
    if lay.single:
        return [flat]
    sizes, keep = [], []
    for n, w in zip(lay.numels, lay.member_words):
        keep.append(len(sizes))
        sizes.append(n)
        if 16 * w > n:
            sizes.append(16 * w - n)
    parts = tf.split(flat, sizes)
    return [parts[i] for i in keep]


class BucketExchange:
    """Several tensors' part of one collective: the payload, and what is needed to finish it.

    ``threshold`` and ``magnitude`` (the per-value levels the scatter exchange's finish takes) are
    made only when asked for."""

    def __init__(self, state, tensors, keys, op, prescale, postscale, nranks, grad=None):
        self.layout = lay = layout_of(state, keys, tensors)
        self.plan = plan_of(state, lay)
        self.tensors, self.keys = list(tensors), list(keys)
        self.op, self.nranks = op, int(nranks)
        self.scale = float(prescale) * float(postscale)
        self.residuals = [state.residuals.get(k, t) for k, t in zip(keys, tensors)]
        self.stats_slots = state.stats_slots
        self.head = head = lay.header(state.threshold)
        self.passes = passes_of(state, lay, self.plan, head, op == mpi_ops.Average,
                                self.scale)
        with tf.name_scope("twobit_encode"):
            self.befores = [r.read_value() for r in self.residuals]
            self.grad = flat(lay, [codec._flat32(t) for t in self.tensors]) if grad is None \
                else grad
            self.before = flat(lay, [tf.reshape(r, [-1]) for r in self.befores])
            self.fixed = None if lay.auto else tf.constant(state.threshold, tf.float32)
            lengths = levels = None
            if lay.auto and native_ops.usable(state.auto_rule):
                levels = native_ops.segment_levels(self.grad, self.before,
                                                   *native_ops.layout_ints(lay)[2:],
                                                   rule=state.auto_rule)
            elif lay.auto:  # the levels' divisors, from outside the compiled body
                lengths = tf.constant(self.plan.lengths, tf.float64)
            self.payload, self.ts, self.vs = self.passes.encode(self.grad, self.before,
                                                                self.fixed, lengths, levels)

    @property
    def threshold(self):
        if self.layout.auto:
            return spread(self.ts, self.layout.seg_words)
        return self.fixed

    @property
    def magnitude(self):
        if self.layout.auto:
            return spread(self.vs, self.layout.seg_words)
        return self.fixed

    def finish(self, gathered, as_flat=False):
        """Checks, decodes and sums the gathered payloads; commits the residuals; returns the
        results (each tensor's shape and dtype), or with ``as_flat`` the flat float32 buffer of
        them (:func:`members` makes them from it)."""
        lay, nranks = self.layout, self.nranks
        with tf.name_scope("twobit_finish"):
            fitted, checked = _validated(gathered, lay, self.head, nranks, self.keys)
            rows = tf.reshape(fitted, [nranks, lay.payload_words])
            if self.op == mpi_ops.Average:  # a run-time divisor (see communicator.Exchange.finish)
                count = tf.cast(tf.size(gathered) // lay.payload_words, tf.float32)
            else:
                count = tf.constant(1.0, tf.float32)
            out, new, self.bad, self.norms = self.passes.finish(
                rows, checked, count, self.grad, self.before, self.fixed, self.ts, self.vs,
                self.stats_slots.norms_wanted())
            return commit(lay, self.residuals, new, self.tensors, out, as_flat)


def members(lay, out, tensors):
    """Each member's slice of the flat result ``out``, in its tensor's shape and dtype."""
    results = []
    for t, res in zip(tensors, split(lay, out)):
        res = tf.reshape(res, t.shape)
        results.append(res if res.dtype == t.dtype else tf.cast(res, t.dtype))
    return results


def commit(lay, residuals, new, tensors, out, as_flat=False):
    """Assigns each member's slice of the flat ``new`` to its residual variable; returns each
    member's slice of the flat result ``out`` (its tensor's shape and dtype), or with
    ``as_flat`` ``out`` itself, after the updates."""
    updates = [r.assign(tf.reshape(n, r.shape)) for r, n in zip(residuals, split(lay, new))]
    with tf.control_dependencies(updates):
        return tf.identity(out) if as_flat else tf.identity_n(members(lay, out, tensors))


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
    wire_checks.split_bucket(lambda a, b: flat[a:b], len(flat), nranks, list(keys))
    raise wire.PayloadMismatchError("bucket of %s: ranks sent incompatible payloads" % keys[0])


def _host_check(nranks, keys, flat):
    _raise_mismatch(flat, nranks, keys)
    return np.bool_(True)
