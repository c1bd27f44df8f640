"""The fallback's measurements (:mod:`horovod_twobit.state.fallback`) in TensorFlow, as the PyTorch
binding's (:mod:`horovod_twobit.torch.exchange.link`), the step-time model's inputs for its per-bucket
decision: the link, by timed allreduces and allgathers of known size through Horovod, and the
codec rate, by one encode and the decode-sum of N payloads of known size; rank 0's figures are
broadcast, so every rank decides alike. Runs eagerly: an exchange traced inside a ``tf.function``
measures under ``tf.init_scope`` while it is being traced, which every rank does at the same
point of its program."""

import time

import tensorflow as tf

import horovod.tensorflow.mpi_ops as mpi_ops

from horovod_twobit.state.fallback import BIG, Link, allgather_values, figures


def _allreduce(process_set):
    """``run(values, i)``: one allreduce of ``values`` zeros (1 or ``BIG``), the ``i``-th."""
    xs = {n: tf.zeros([n], tf.float32) for n in (1, BIG)}

    def run(values, i):
        mpi_ops._allreduce(xs[values], name="twobit.link.%d.%d" % (values, i), op=mpi_ops.Sum,
                           process_set=process_set).numpy()
    return run


def _allgather(process_set):
    """``run(values, i)``: one allgather of ``values`` zeros per rank (1 or
    :func:`~horovod_twobit.state.fallback.allgather_values`), the ``i``-th."""
    xs = {n: tf.zeros([n], tf.float32) for n in (1, allgather_values(process_set.size()))}

    def run(values, i):
        mpi_ops.allgather(xs[values], name="twobit.link.gather.%d.%d" % (values, i),
                          process_set=process_set).numpy()
    return run


def _codec_seconds(state, nranks, values):
    """Seconds of a step's codec work on ``values`` values: one encode, and the decode-sum of
    ``nranks`` payloads (this rank's, repeated, in the place of the gathered ones)."""
    from horovod_twobit.tensorflow.exchange.single import Exchange
    scratch = type(state)(state.threshold, block=state.block,
                               blocks=state.blocks, bucket_bytes=0)  # a TwoBitState
    g = tf.random.stateless_normal([values], seed=[1, 2])

    @tf.function(autograph=False)
    def codec_pass(g):
        ex = Exchange(scratch, g, "twobit.link", mpi_ops.Sum, 1.0, 1.0, nranks)
        return ex.finish(tf.tile(ex.payload, [nranks]))

    codec_pass(g).numpy()  # traced once, untimed
    best = float("inf")
    for _ in range(3 if values >= BIG else 7):
        t0 = time.perf_counter()
        codec_pass(g).numpy()
        best = min(best, time.perf_counter() - t0)
    return best


def measure(process_set, state):
    """A :class:`Link` of ``process_set`` from rank 0's measurements. Eager only."""
    if not tf.executing_eagerly():
        raise RuntimeError("TwoBitCompressor(fallback=\"auto\") measures the link eagerly, when its "
                           "first exchange is traced; TF1 graph mode cannot: use fallback=None or "
                           "\"always\" there")
    N = process_set.size()
    got = figures(N, _allreduce(process_set),
                  lambda n: _codec_seconds(state, max(N, 1), n),
                  allgather=_allgather(process_set) if N > 1 else None)
    got = mpi_ops.broadcast(tf.constant(got, tf.float64), 0, name="twobit.link.figures",
                            process_set=process_set)
    return Link(*got.numpy().tolist())
