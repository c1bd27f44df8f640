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
from horovod_twobit.wire import scatter as scatter_wire


def zero_flag(state, keys):
    """The bucket's flag variable: its residuals are known to be zero (made at False)."""
    key = scatter_wire.owner_key(keys)
    flag = state.zero_flags.get(key)
    if flag is None:
        flag = state.zero_flags[key] = state.variable(False)
    return flag


def run(state, tensors, keys, op, prescale, postscale, process_set, op_name,
        ignore_name_scope):
    """Exchanges dense floating-point ``tensors`` (residual keys ``keys``); returns the results."""
    sizes = [t.shape.num_elements() for t in tensors]
    zero = zero_flag(state, keys)
    residuals = [state.residuals.get(k, t) for k, t in zip(keys, tensors)]
    flat = tf.concat([codec._flat32(t) for t in tensors], 0) if len(tensors) > 1 \
        else codec._flat32(tensors[0])

    def before():
        return tf.concat([tf.reshape(r.read_value(), [-1]) for r in residuals], 0)

    known_zero = zero.read_value()
    sent = tf.cond(known_zero, lambda: flat, lambda: flat + before())
    summed = mpi_ops._allreduce(sent, name=op_name + "_plain", op=mpi_ops.Sum,
                                prescale_factor=prescale, postscale_factor=postscale,
                                process_set=process_set, ignore_name_scope=ignore_name_scope)
    if op == mpi_ops.Average:
        # a run-time divisor, as the communicator's: Grappler would turn a constant one into a
        # multiplication by its reciprocal, another float32 result
        summed = summed / tf.cast(mpi_ops.size_op(process_set_id=process_set.process_set_id),
                                  tf.float32)
    finite = tf.reduce_all(tf.math.is_finite(summed))

    def as_is():
        return [tf.identity(summed)]

    def per_member():
        """Not finite, or the residuals not known to be zero: each member's NaN and residual."""
        parts = tf.split(summed, sizes) if len(sizes) > 1 else [summed]
        old = tf.split(before(), sizes) if len(sizes) > 1 else [before()]
        out, updates, oks = [], [], []
        for r, part, b in zip(residuals, parts, old):
            ok = tf.reduce_all(tf.math.is_finite(part))
            oks.append(ok)
            out.append(tf.where(ok, part, tf.fill(tf.shape(part), float("nan"))))
            updates.append(r.assign(tf.reshape(tf.where(ok, tf.zeros_like(b), b), r.shape)))
        updates.append(zero.assign(tf.reduce_all(tf.stack(oks))))
        with tf.control_dependencies(updates):
            return [tf.concat(out, 0) if len(out) > 1 else tf.identity(out[0])]

    done = tf.cond(tf.logical_and(known_zero, finite), as_is, per_member)[0]
    parts = tf.split(done, sizes) if len(sizes) > 1 else [done]
    out = []
    for t, part in zip(tensors, parts):
        res = tf.reshape(part, t.shape)
        out.append(tf.cast(res, t.dtype) if res.dtype != t.dtype else res)
    return out
