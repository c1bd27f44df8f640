"""One bucket's step sent uncompressed: the fallback of ``TwoBitCompressor(..., fallback=...)``,
as the PyTorch binding's (:mod:`horovod_twobit.torch.exchange.plain`).

Error feedback makes the switch exact: the members' values g + r (gradients plus residuals,
float32) go through Horovod's own allreduce as one flat buffer, so everything not yet sent is sent
now, and the residuals become zero. A member whose sum is not finite (some rank's gradient held
NaN or Inf) gets NaN and keeps its residual, as in the compressed exchanges.

What a step costs beyond Horovod's own allreduce is a fixed number of ops, whatever the number of
members: while the bucket's residuals are known to be zero (its last step went plain and every
member was finite: a flag variable per bucket), the step sends g alone, reads no residual and
assigns none; only a step after a compressed one reads and assigns each member's residual. Which
members came out finite is found for the whole buffer at once (a running count of the
non-finite values, read at the members' bounds), not with ops per member: a step pays an op
each, and the trace of a checked exchange a few ms each. (Sending g alone gives the same values; a -0.0 in g stays -0.0, as in Horovod's allreduce,
where g + 0.0 would give +0.0.)"""

import numpy as np
import tensorflow as tf

import horovod.tensorflow.mpi_ops as mpi_ops

from horovod_twobit.tensorflow import codec
from horovod_twobit.tensorflow.exchange import bucket
from horovod_twobit.wire import scatter as scatter_wire


def zero_flag(state, keys):
    """The bucket's flag variable: its residuals are known to be zero (made at False)."""
    key = scatter_wire.owner_key(keys)
    flag = state.zero_flags.get(key)
    if flag is None:
        flag = state.zero_flags[key] = state.variable(False)
    return flag


def run(state, tensors, keys, op, prescale, postscale, process_set, op_name,
        ignore_name_scope, layout, flat=None, known_zero=None):
    """Exchanges dense floating-point ``tensors`` (residual keys ``keys``, bucket ``layout``);
    returns (the results as one flat float32 buffer in ``layout``'s order and padding, a 0-d
    bool: whether some member came out NaN). ``flat``: the gradients already in that buffer
    (:func:`..bucket.flat`); ``known_zero``: whether the bucket's flag was read set (True or
    False), as the checked exchange hands its branches, or None to read it here."""
    zero = zero_flag(state, keys)
    residuals = [state.residuals.get(k, t) for k, t in zip(keys, tensors)]
    if flat is None:
        flat = bucket.flat(layout, [codec._flat32(t) for t in tensors])

    def before():
        return bucket.flat(layout, [tf.reshape(r.read_value(), [-1]) for r in residuals])

    b = None  # the residuals, read once where this step sends them without a cond
    if known_zero is None:
        known_zero = zero.read_value()
        sent = tf.cond(known_zero, lambda: flat, lambda: flat + before())
    else:  # a branch of its own: no cond holding the residuals, an op each step for each
        b = None if known_zero else before()
        sent = flat if known_zero else flat + b
    summed = mpi_ops._allreduce(sent, name=op_name + "_plain", op=mpi_ops.Sum,
                                prescale_factor=prescale, postscale_factor=postscale,
                                process_set=process_set, ignore_name_scope=ignore_name_scope)
    if op == mpi_ops.Average:
        # a run-time divisor, as the communicator's: Grappler would turn a constant one into a
        # multiplication by its reciprocal, another float32 result
        summed = summed / tf.cast(mpi_ops.size_op(process_set_id=process_set.process_set_id),
                                  tf.float32)
    finite = tf.reduce_all(tf.math.is_finite(summed))  # padding is zeros: finite

    def as_is():
        return [tf.identity(summed), tf.constant(False)]

    def members_ok():
        """(each value's member finite, in ``summed``'s order; every member finite): a few ops
        for the whole bucket, whatever its number of members."""
        if layout.single:
            ok = tf.reduce_all(tf.math.is_finite(summed))
            return tf.fill(tf.shape(summed), ok), ok
        slots = [16 * w for w in layout.member_words]  # each member's place in the buffer
        bounds = np.concatenate([[0], np.cumsum(slots)]).astype(np.int32)
        # non-finite values before each value, then before each member's start and end
        seen = tf.concat([[0], tf.cumsum(tf.cast(~tf.math.is_finite(summed), tf.int32))], 0)
        ok = tf.equal(tf.gather(seen, bounds[1:]), tf.gather(seen, bounds[:-1]))
        return tf.repeat(ok, slots), tf.reduce_all(ok)

    def per_member():
        """Not finite, or the residuals not known to be zero: each member's NaN and residual."""
        ok, all_ok = members_ok()
        out = tf.where(ok, summed, tf.constant(float("nan"), tf.float32))
        kept = tf.where(ok, tf.zeros_like(summed), before() if b is None else b)
        updates = [r.assign(tf.reshape(n, r.shape))
                   for r, n in zip(residuals, bucket.split(layout, kept))]
        updates.append(zero.assign(all_ok))
        with tf.control_dependencies(updates):
            return [tf.identity(out), tf.logical_not(all_ok)]

    def nan_members():
        """Known zero, and not finite: each member's NaN; the residuals stay zero."""
        ok, all_ok = members_ok()
        out = tf.where(ok, summed, tf.constant(float("nan"), tf.float32))
        with tf.control_dependencies([zero.assign(all_ok)]):
            return [tf.identity(out), tf.logical_not(all_ok)]

    if known_zero is True:
        return tuple(tf.cond(finite, as_is, nan_members))
    if known_zero is False:
        return tuple(per_member())
    return tuple(tf.cond(tf.logical_and(known_zero, finite), as_is, per_member))
