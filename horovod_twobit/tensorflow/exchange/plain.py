"""One bucket's step sent uncompressed: the fallback of ``TwoBitCompressor(..., fallback=...)``,
as the PyTorch binding's (:mod:`horovod_twobit.torch.exchange.plain`).

Error feedback makes the switch exact: the members' values g + r (gradients plus residuals,
float32) go through Horovod's own allreduce as one flat buffer, so everything not yet sent is sent
now, and the residuals become zero. A member whose sum is not finite (some rank's gradient held
NaN or Inf) gets NaN and keeps its residual, as in the compressed exchanges.

What a step costs beyond Horovod's own allreduce is a fixed number of ops, whatever the number of
members: while the bucket's residuals are known to be zero (its last step went plain and every
member was finite: a flag variable per bucket), the step sends g alone, reads no residual and
assigns none; only a step after a compressed one, or one with NaN or Inf, does the per-member
work. (Sending g alone gives the same values; a -0.0 in g stays -0.0, as in Horovod's allreduce,
where g + 0.0 would give +0.0.)"""

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

    if known_zero is None:
        known_zero = zero.read_value()
        sent = tf.cond(known_zero, lambda: flat, lambda: flat + before())
    else:  # a branch of its own: no cond holding the residuals, an op each step for each
        sent = flat if known_zero else flat + before()
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

    def per_member():
        """Not finite, or the residuals not known to be zero: each member's NaN and residual."""
        out, updates, oks = [], [], []
        for r, part, b in zip(residuals, bucket.split(layout, summed),
                              bucket.split(layout, before())):
            ok = tf.reduce_all(tf.math.is_finite(part))
            oks.append(ok)
            out.append(tf.where(ok, part, tf.fill(tf.shape(part), float("nan"))))
            updates.append(r.assign(tf.reshape(tf.where(ok, tf.zeros_like(b), b), r.shape)))
        all_ok = tf.reduce_all(tf.stack(oks))
        updates.append(zero.assign(all_ok))
        with tf.control_dependencies(updates):
            return [bucket.flat(layout, out), tf.logical_not(all_ok)]

    def nan_members():
        """Known zero, and not finite: each member's NaN; the residuals stay zero."""
        out, oks = [], []
        for part in bucket.split(layout, summed):
            ok = tf.reduce_all(tf.math.is_finite(part))
            oks.append(ok)
            out.append(tf.where(ok, part, tf.fill(tf.shape(part), float("nan"))))
        all_ok = tf.reduce_all(tf.stack(oks))
        with tf.control_dependencies([zero.assign(all_ok)]):
            return [bucket.flat(layout, out), tf.logical_not(all_ok)]

    if known_zero is True:
        return tuple(tf.cond(finite, as_is, nan_members))
    if known_zero is False:
        return tuple(per_member())
    return tuple(tf.cond(tf.logical_and(known_zero, finite), as_is, per_member))
