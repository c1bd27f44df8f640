"""What the router checks and carries for every TwoBit allreduce in TensorFlow: the residual keys
the gradient-function builder hands to the next allreduce on this thread, and the refusals (the
class instead of an instance, an op other than Average or Sum, a sparse gradient, no name), each
naming its fix."""

import contextlib
import re
import threading

import tensorflow as tf

import horovod.tensorflow.mpi_ops as mpi_ops

from horovod_twobit.tensorflow.exchange import single as communicator
from horovod_twobit.tensorflow.state import TwoBitState

_local = threading.local()


class _Unrouted:
    """The context ``compress`` hands to Horovod when a tensor reaches ``compress`` at all: that
    only happens when the router is not installed, and the tensor then travels uncompressed."""

    __slots__ = ()


UNROUTED = _Unrouted()


def state_of(compression):
    """The :class:`TwoBitState` behind a ``TwoBitCompressor`` instance, else None. (The router
    knows compressors by their state: the face imports the router, not the reverse.)"""
    state = getattr(compression, "state", None)
    return state if isinstance(state, TwoBitState) else None


@contextlib.contextmanager
def keyed(keys):
    """Residual keys for the next allreduce / grouped allreduce this thread makes.

    The one detour of a gradient's route, and why: ``DistributedGradientTape`` and the
    ``DistributedOptimizer`` s reach the router through Horovod's ``_allreduce_cond`` /
    ``_grouped_allreduce_cond``, which keep Horovod's process-set condition (ranks outside the
    set skip the collective) and take no residual keys. :mod:`.grads_fn` puts each gradient's
    key (its variable's name) here, and the router takes it back (:func:`take_keys`) on the same
    thread, in the same call."""
    prev = getattr(_local, "keys", None)
    _local.keys = list(keys)
    try:
        yield
    finally:
        _local.keys = prev


def take_keys():
    keys = getattr(_local, "keys", None)
    _local.keys = None
    return keys


def normalize(name):
    return re.sub("[^a-zA-Z0-9_]", "_", name)


def check_compression(compression):
    if isinstance(compression, type) and getattr(compression, "TWOBIT_FACE", False):
        raise TypeError("pass an instance, e.g. compression=TwoBitCompressor(0.5), not the class")


def _op_name(op):
    for k in ("Average", "Sum", "Adasum", "Min", "Max", "Product"):
        if op == getattr(mpi_ops, k, object()):
            return "hvd." + k
    return repr(op)


def check_op(op):
    if op not in (mpi_ops.Average, mpi_ops.Sum):
        raise ValueError(
            "TwoBitCompressor supports op=hvd.Average and op=hvd.Sum only (got %s): use "
            "hvd.Compression.none for Adasum, Min, Max or Product" % _op_name(op))


def refuse_sparse(tensor, what="this tensor"):
    if isinstance(tensor, tf.IndexedSlices):
        raise ValueError(
            "%s is a tf.IndexedSlices (a sparse gradient, e.g. of an embedding), which "
            "TwoBitCompressor cannot compress: pass sparse_as_dense=True to "
            "hvd.DistributedOptimizer / hvd.DistributedGradientTape (or densify it with "
            "tf.convert_to_tensor before hvd.allreduce)" % what)


def no_name_error():
    return ValueError(
        "TwoBitCompressor keys its residual by tensor name, and this allreduce has none: pass "
        "name='...' (a name that stays the same every step) to hvd.allreduce / "
        "hvd.grouped_allreduce; hvd.DistributedGradientTape and hvd.DistributedOptimizer name "
        "gradients after their variables")


def is_float(tensor):
    return tf.as_dtype(tensor.dtype).is_floating


@contextlib.contextmanager
def translated():
    """Eager callers get PayloadMismatchError itself, not the graph error that carries it."""
    try:
        yield
    except tf.errors.OpError as e:
        err = communicator.translate(e)
        if err is None:
            raise
        raise err from e
