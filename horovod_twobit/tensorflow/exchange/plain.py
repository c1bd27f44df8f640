"""One bucket's step sent uncompressed: the fallback of ``TwoBitCompressor(..., fallback=...)``,
as the PyTorch binding's (:mod:`horovod_twobit.torch.exchange.plain`).

Error feedback makes the switch exact: each member's values g + r (its gradient plus its
residual, float32) go through Horovod's own allreduce, one collective for the bucket, so
everything not yet sent is sent now, and the residuals become zero. A member whose sum is not
finite (some rank's gradient held NaN or Inf) gets NaN and keeps its residual, as in the
compressed exchanges."""

import tensorflow as tf

import horovod.tensorflow.mpi_ops as mpi_ops

from horovod_twobit.tensorflow import codec


def run(state, tensors, keys, op, prescale, postscale, process_set, op_name,
        ignore_name_scope):
    """Exchanges dense floating-point ``tensors`` (residual keys ``keys``); returns the results."""
    residuals = [state.residuals.get(k, t) for k, t in zip(keys, tensors)]
    before = [tf.reshape(r.read_value(), [-1]) for r in residuals]
    flat = tf.concat([codec._flat32(t) + b for t, b in zip(tensors, before)], 0)
    summed = mpi_ops._allreduce(flat, name=op_name + "_plain", op=mpi_ops.Sum,
                                prescale_factor=prescale, postscale_factor=postscale,
                                process_set=process_set, ignore_name_scope=ignore_name_scope)
    if op == mpi_ops.Average:
        # a run-time divisor, as the communicator's: Grappler would turn a constant one into a
        # multiplication by its reciprocal, another float32 result
        summed = summed / tf.cast(mpi_ops.size_op(process_set_id=process_set.process_set_id),
                                  tf.float32)
    out, start = [], 0
    for t, r, b in zip(tensors, residuals, before):
        n = t.shape.num_elements()
        part = summed[start:start + n]
        start += n
        ok = tf.reduce_all(tf.math.is_finite(part))
        part = tf.where(ok, part, tf.fill([n], float("nan")))
        update = r.assign(tf.reshape(tf.where(ok, tf.zeros_like(b), b), r.shape))
        with tf.control_dependencies([update]):
            res = tf.reshape(part, t.shape)
            out.append(tf.identity(tf.cast(res, t.dtype) if res.dtype != t.dtype else res))
    return out
