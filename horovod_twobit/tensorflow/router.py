"""The one place that wraps Horovod's TensorFlow API, explicitly and reversibly.

:func:`install` replaces three module-level names of ``horovod.tensorflow``:

* ``allreduce`` and ``grouped_allreduce`` (what ``hvd.allreduce`` / ``hvd.grouped_allreduce``
  resolve to, and what Horovod's own ``_allreduce_cond`` / ``_grouped_allreduce_cond`` call): a
  call with a :class:`TwoBitCompressor` goes to allgather + decode + sum; every other call goes to
  Horovod's function unchanged.
* ``_make_allreduce_grads_fn`` (what ``DistributedGradientTape``, the TF1 ``DistributedOptimizer`` and
  ``horovod.tensorflow.keras.DistributedOptimizer`` build their gradient reduction with): with a
  :class:`TwoBitCompressor` it returns :mod:`.grads_fn`'s function, which does what Horovod's does
  and also tells the router which variable each gradient belongs to, so residuals are keyed by
  variable name. Any other compression gets Horovod's own function.

What every call is checked for, and the keys handed from that function to the allreduce, are in
:mod:`.checks`.

:func:`uninstall` puts the originals back. Horovod looks these names up at call time (module
globals), so no other module needs patching.
"""

import collections
import threading

import tensorflow as tf

import horovod.tensorflow as hvd_tf
import horovod.tensorflow.mpi_ops as mpi_ops
from horovod.tensorflow.compression import Compression

from horovod_twobit.tensorflow.exchange import single as communicator
from horovod_twobit.tensorflow import checks, grads_fn

_NAMES = ("allreduce", "grouped_allreduce", "_make_allreduce_grads_fn")
_originals = {}
_lock = threading.Lock()


def _orig(name):
    return _originals.get(name) or getattr(hvd_tf, name)


def _eager_fn(state, keys, op, prescale, postscale, process_set, op_name, ignore_name_scope):
    """A cached ``tf.function`` that exchanges tensors for eager callers: one dispatch instead of
    dozens of eager ops and a host round trip per tensor."""
    cache = state.eager_fns
    ck = (tuple(keys), op, float(prescale), float(postscale), process_set, op_name,
          ignore_name_scope)
    fn = cache.get(ck)
    if fn is None:
        def exchange(tensors):
            return communicator.run(state, tensors, list(keys), op, prescale, postscale,
                                    process_set, op_name, ignore_name_scope)
        fn = cache[ck] = tf.function(exchange, autograph=False)
    return fn


def _exchange(state, tensors, keys, op, prescale, postscale, process_set, op_name,
              ignore_name_scope):
    if not tf.executing_eagerly():
        return communicator.run(state, tensors, keys, op, prescale, postscale, process_set,
                                op_name, ignore_name_scope)
    fn = _eager_fn(state, keys, op, prescale, postscale, process_set, op_name,
                   ignore_name_scope)
    with checks.translated():
        return fn(list(tensors))


@tf.autograph.experimental.do_not_convert
def allreduce(tensor, average=None, device_dense='', device_sparse='',
              compression=Compression.none, op=None, prescale_factor=1.0, postscale_factor=1.0,
              name=None, process_set=mpi_ops.global_process_set, ignore_name_scope=False):
    keys = checks.take_keys()
    checks.check_compression(compression)
    if checks.state_of(compression) is None:
        return _orig("allreduce")(tensor, average=average, device_dense=device_dense,
                                  device_sparse=device_sparse, compression=compression, op=op,
                                  prescale_factor=prescale_factor,
                                  postscale_factor=postscale_factor, name=name,
                                  process_set=process_set, ignore_name_scope=ignore_name_scope)
    checks.refuse_sparse(tensor, "tensor %r" % (keys[0] if keys else name,))
    op = mpi_ops.handle_average_backwards_compatibility(op, average)
    if not isinstance(tensor, tf.Tensor):
        tensor = tf.convert_to_tensor(tensor)
    if not checks.is_float(tensor):  # integers travel exactly, as Horovod's compressors leave them
        return _orig("allreduce")(tensor, device_dense=device_dense, device_sparse=device_sparse,
                                  op=op, prescale_factor=prescale_factor,
                                  postscale_factor=postscale_factor, name=name,
                                  process_set=process_set, ignore_name_scope=ignore_name_scope)
    checks.check_op(op)
    if keys:
        key = keys[0]
    elif name is not None:
        key = name
    else:
        raise checks.no_name_error()
    op_name = name if (name is not None and keys) else "HorovodTwoBit_" + checks.normalize(key)
    with tf.device(device_dense):
        return _exchange(checks.state_of(compression), [tensor], [key], op, prescale_factor,
                         postscale_factor, process_set, op_name, ignore_name_scope)[0]


@tf.autograph.experimental.do_not_convert
def grouped_allreduce(tensors, average=None, device_dense='', device_sparse='',
                      compression=Compression.none, op=None, prescale_factor=1.0,
                      postscale_factor=1.0, process_set=mpi_ops.global_process_set,
                      ignore_name_scope=False, name=None):
    keys = checks.take_keys()
    checks.check_compression(compression)
    if checks.state_of(compression) is None or not tensors:
        return _orig("grouped_allreduce")(tensors, average=average, device_dense=device_dense,
                                          device_sparse=device_sparse, compression=compression,
                                          op=op, prescale_factor=prescale_factor,
                                          postscale_factor=postscale_factor,
                                          process_set=process_set,
                                          ignore_name_scope=ignore_name_scope, name=name)
    op = mpi_ops.handle_average_backwards_compatibility(op, average)
    tensors = list(tensors)
    if keys is None:
        if name is None:
            raise checks.no_name_error()
        keys = ["%s.%d" % (name, i) for i in range(len(tensors))]
    if len(keys) != len(tensors):
        raise RuntimeError("horovod-twobit: %d residual keys for %d tensors" % (len(keys), len(tensors)))
    for t, k in zip(tensors, keys):
        checks.refuse_sparse(t, "tensor %r" % (k,))
    tensors = [t if isinstance(t, tf.Tensor) else tf.convert_to_tensor(t) for t in tensors]
    dup = [k for k, c in collections.Counter(keys).items() if c > 1]
    if dup:
        raise ValueError("tensors %s appear more than once in one grouped allreduce" % dup)
    comp = [i for i, t in enumerate(tensors) if checks.is_float(t)]
    plain = [i for i, t in enumerate(tensors) if not checks.is_float(t)]
    if comp:
        checks.check_op(op)
    out = [None] * len(tensors)
    with tf.device(device_dense):
        if comp:
            op_name = name if name is not None else "HorovodTwoBitGroup_%s_%s" % (
                checks.normalize(keys[comp[0]]), checks.normalize(keys[comp[-1]]))
            res = _exchange(checks.state_of(compression), [tensors[i] for i in comp],
                            [keys[i] for i in comp],
                            op, prescale_factor, postscale_factor, process_set, op_name,
                            ignore_name_scope)
            for i, r in zip(comp, res):
                out[i] = r
        if plain:
            res = _orig("grouped_allreduce")(
                [tensors[i] for i in plain], device_dense=device_dense, device_sparse=device_sparse,
                op=op, prescale_factor=prescale_factor, postscale_factor=postscale_factor,
                process_set=process_set, ignore_name_scope=ignore_name_scope,
                name=None if name is None else name + "_uncompressed")
            for i, r in zip(plain, res):
                out[i] = r
    return out


def _make_allreduce_grads_fn(name, device_dense, device_sparse, compression, sparse_as_dense, op,
                             gradient_predivide_factor, groups,
                             process_set=mpi_ops.global_process_set):
    checks.check_compression(compression)
    if checks.state_of(compression) is None:
        return _orig("_make_allreduce_grads_fn")(name, device_dense, device_sparse, compression,
                                                 sparse_as_dense, op, gradient_predivide_factor,
                                                 groups, process_set=process_set)
    return grads_fn.cached(name, device_dense, device_sparse, compression, sparse_as_dense, op,
                           gradient_predivide_factor, groups, process_set)


_WRAPPERS = {"allreduce": allreduce, "grouped_allreduce": grouped_allreduce,
             "_make_allreduce_grads_fn": _make_allreduce_grads_fn}


def install():
    """Routes TwoBitCompressor tensors through allgather + decode + sum. Idempotent."""
    with _lock:
        if _originals:
            return
        for name in _NAMES:
            _originals[name] = getattr(hvd_tf, name)
            setattr(hvd_tf, name, _WRAPPERS[name])


def uninstall():
    """Puts Horovod's original functions back."""
    with _lock:
        for name in _NAMES:
            if getattr(hvd_tf, name, None) is _WRAPPERS[name]:
                setattr(hvd_tf, name, _originals[name])
        _originals.clear()
    grads_fn.clear()


def installed():
    return bool(_originals)
