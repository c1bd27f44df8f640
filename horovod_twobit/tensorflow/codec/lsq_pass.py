"""The "lsq" rule's counts and sums in one pass over the values, inside an XLA body.

For every row and every candidate threshold the rule needs how many |x| reach it and their
float64 sum: 2 x 9 reductions. Written as 18 reductions, XLA on a CPU loops over the values once
for each; as one variadic reduction (``XlaVariadicReduceV2``) it loops once with 18 accumulators
(figures in docs/tf_step_cost.md). Both sum in float64 and round each level to float32 once, so
the bits are the NumPy reference's (``tests/test_tf_codec.py``). Only for XLA bodies: the op has
no kernel outside XLA."""

import tensorflow as tf
from tensorflow.compiler.tf2xla.python import xla as tfxla

_REDUCERS = {}


def _reducer(k):
    """The reducer of k int32 and k float64 accumulators (sums), made once per k."""
    fn = _REDUCERS.get(k)
    if fn is None:
        specs = [tf.TensorSpec([], tf.int32)] * k + [tf.TensorSpec([], tf.float64)] * k

        def add(*args):
            return tuple(x + y for x, y in zip(args[:2 * k], args[2 * k:]))

        fn = _REDUCERS[k] = tf.function(add, autograph=False).get_concrete_function(
            *(specs + specs))
    return fn


def counts_and_sums(a, ts):
    """(counts, sums), float64 (rows, k): how many of each row's values of the float64 ``a``
    (rows, m) are >= each of its k thresholds ``ts`` (rows, k), and their sum."""
    k = ts.shape[-1]
    sent = [a >= ts[:, i:i + 1] for i in range(k)]
    inputs = [tf.cast(s, tf.int32) for s in sent] + [tf.where(s, a, tf.zeros_like(a)) for s in sent]
    inits = [tf.constant(0, tf.int32)] * k + [tf.constant(0.0, tf.float64)] * k
    out = tfxla.variadic_reduce(inputs, inits, [a.shape.rank - 1], _reducer(k))
    return tf.cast(tf.stack(out[:k], -1), tf.float64), tf.stack(out[k:], -1)
