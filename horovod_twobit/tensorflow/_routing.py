"""The one place that wraps Horovod's TensorFlow API, explicitly and reversibly.

:func:`install` replaces three module-level names of ``horovod.tensorflow``:

* ``allreduce`` and ``grouped_allreduce`` (what ``hvd.allreduce`` / ``hvd.grouped_allreduce``
  resolve to, and what Horovod's own ``_allreduce_cond`` / ``_grouped_allreduce_cond`` call): a
  call with a :class:`TwoBitCompressor` goes to allgather + decode + sum; every other call goes to
  Horovod's function unchanged.
* ``_make_allreduce_grads_fn`` (what ``DistributedGradientTape``, the TF1 ``DistributedOptimizer`` and
  ``horovod.tensorflow.keras.DistributedOptimizer`` build their gradient reduction with): with a
  :class:`TwoBitCompressor` it returns a function that does what Horovod's does (sparse_as_dense,
  groups, the process-set condition, the name scope) and also tells the router which variable each
  gradient belongs to, so residuals are keyed by variable name. Any other compression gets
  Horovod's own function.

:func:`uninstall` puts the originals back. Horovod looks these names up at call time (module
globals), so no other module needs patching.
"""

import collections
import contextlib
import re
import threading

import tensorflow as tf

import horovod.tensorflow as hvd_tf
import horovod.tensorflow.mpi_ops as mpi_ops
from horovod.common.util import split_list
from horovod.tensorflow.compression import Compression
from horovod.tensorflow.util import refs_to_vars, vars_to_refs

from .. import layout
from . import communicator
from .compressor import TwoBitCompressor

_NAMES = ("allreduce", "grouped_allreduce", "_make_allreduce_grads_fn")
_originals = {}
_lock = threading.Lock()
_local = threading.local()
_grads_fns = {}


def _orig(name):
    return _originals.get(name) or getattr(hvd_tf, name)


@contextlib.contextmanager
def _keyed(keys):
    """Residual keys for the next allreduce / grouped allreduce this thread makes."""
    prev = getattr(_local, "keys", None)
    _local.keys = list(keys)
    try:
        yield
    finally:
        _local.keys = prev


def _take_keys():
    keys = getattr(_local, "keys", None)
    _local.keys = None
    return keys


def _normalize(name):
    return re.sub("[^a-zA-Z0-9_]", "_", name)


def _check_compression(compression):
    if compression is TwoBitCompressor:
        raise TypeError("pass an instance, e.g. compression=TwoBitCompressor(0.5), not the class")


def _op_name(op):
    for k in ("Average", "Sum", "Adasum", "Min", "Max", "Product"):
        if op == getattr(mpi_ops, k, object()):
            return "hvd." + k
    return repr(op)


def _check_op(op):
    if op not in (mpi_ops.Average, mpi_ops.Sum):
        raise ValueError(
            "TwoBitCompressor supports op=hvd.Average and op=hvd.Sum only (got %s): use "
            "hvd.Compression.none for Adasum, Min, Max or Product" % _op_name(op))


def _refuse_sparse(tensor, what="this tensor"):
    if isinstance(tensor, tf.IndexedSlices):
        raise ValueError(
            "%s is a tf.IndexedSlices (a sparse gradient, e.g. of an embedding), which "
            "TwoBitCompressor cannot compress: pass sparse_as_dense=True to "
            "hvd.DistributedOptimizer / hvd.DistributedGradientTape (or densify it with "
            "tf.convert_to_tensor before hvd.allreduce)" % what)


def _no_name_error():
    return ValueError(
        "TwoBitCompressor keys its residual by tensor name, and this allreduce has none: pass "
        "name='...' (a name that stays the same every step) to hvd.allreduce / "
        "hvd.grouped_allreduce; hvd.DistributedGradientTape and hvd.DistributedOptimizer name "
        "gradients after their variables")


def _is_float(tensor):
    return tf.as_dtype(tensor.dtype).is_floating


def _eager_fn(compressor, keys, op, prescale, postscale, process_set, op_name, ignore_name_scope):
    """A cached ``tf.function`` that exchanges tensors for eager callers: one dispatch instead of
    dozens of eager ops and a host round trip per tensor."""
    cache = compressor._plain.eager_fns
    ck = (tuple(keys), op, float(prescale), float(postscale), process_set, op_name,
          ignore_name_scope)
    fn = cache.get(ck)
    if fn is None:
        def exchange(tensors):
            return communicator.run(compressor, tensors, list(keys), op, prescale, postscale,
                                    process_set, op_name, ignore_name_scope)
        fn = cache[ck] = tf.function(exchange, autograph=False)
    return fn


def _exchange(compressor, tensors, keys, op, prescale, postscale, process_set, op_name,
              ignore_name_scope):
    if not tf.executing_eagerly():
        return communicator.run(compressor, tensors, keys, op, prescale, postscale, process_set,
                                op_name, ignore_name_scope)
    fn = _eager_fn(compressor, keys, op, prescale, postscale, process_set, op_name,
                   ignore_name_scope)
    with _translated():
        return fn(list(tensors))


@contextlib.contextmanager
def _translated():
    """Eager callers get PayloadMismatchError itself, not the graph error that carries it."""
    try:
        yield
    except tf.errors.OpError as e:
        err = communicator.translate(e)
        if err is None:
            raise
        raise err from e


@tf.autograph.experimental.do_not_convert
def allreduce(tensor, average=None, device_dense='', device_sparse='',
              compression=Compression.none, op=None, prescale_factor=1.0, postscale_factor=1.0,
              name=None, process_set=mpi_ops.global_process_set, ignore_name_scope=False):
    keys = _take_keys()
    _check_compression(compression)
    if not isinstance(compression, TwoBitCompressor):
        return _orig("allreduce")(tensor, average=average, device_dense=device_dense,
                                  device_sparse=device_sparse, compression=compression, op=op,
                                  prescale_factor=prescale_factor,
                                  postscale_factor=postscale_factor, name=name,
                                  process_set=process_set, ignore_name_scope=ignore_name_scope)
    _refuse_sparse(tensor, "tensor %r" % (keys[0] if keys else name,))
    op = mpi_ops.handle_average_backwards_compatibility(op, average)
    if not isinstance(tensor, tf.Tensor):
        tensor = tf.convert_to_tensor(tensor)
    if not _is_float(tensor):  # integers travel exactly, as Horovod's compressors leave them
        return _orig("allreduce")(tensor, device_dense=device_dense, device_sparse=device_sparse,
                                  op=op, prescale_factor=prescale_factor,
                                  postscale_factor=postscale_factor, name=name,
                                  process_set=process_set, ignore_name_scope=ignore_name_scope)
    _check_op(op)
    if keys:
        key = keys[0]
    elif name is not None:
        key = name
    else:
        raise _no_name_error()
    op_name = name if (name is not None and keys) else "HorovodTwoBit_" + _normalize(key)
    with tf.device(device_dense):
        return _exchange(compression, [tensor], [key], op, prescale_factor, postscale_factor,
                         process_set, op_name, ignore_name_scope)[0]


@tf.autograph.experimental.do_not_convert
def grouped_allreduce(tensors, average=None, device_dense='', device_sparse='',
                      compression=Compression.none, op=None, prescale_factor=1.0,
                      postscale_factor=1.0, process_set=mpi_ops.global_process_set,
                      ignore_name_scope=False, name=None):
    keys = _take_keys()
    _check_compression(compression)
    if not isinstance(compression, TwoBitCompressor) or not tensors:
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
            raise _no_name_error()
        keys = ["%s.%d" % (name, i) for i in range(len(tensors))]
    if len(keys) != len(tensors):
        raise RuntimeError("horovod-twobit: %d residual keys for %d tensors" % (len(keys), len(tensors)))
    for t, k in zip(tensors, keys):
        _refuse_sparse(t, "tensor %r" % (k,))
    tensors = [t if isinstance(t, tf.Tensor) else tf.convert_to_tensor(t) for t in tensors]
    dup = [k for k, c in collections.Counter(keys).items() if c > 1]
    if dup:
        raise ValueError("tensors %s appear more than once in one grouped allreduce" % dup)
    comp = [i for i, t in enumerate(tensors) if _is_float(t)]
    plain = [i for i, t in enumerate(tensors) if not _is_float(t)]
    if comp:
        _check_op(op)
    out = [None] * len(tensors)
    with tf.device(device_dense):
        if comp:
            op_name = name if name is not None else "HorovodTwoBitGroup_%s_%s" % (
                _normalize(keys[comp[0]]), _normalize(keys[comp[-1]]))
            res = _exchange(compression, [tensors[i] for i in comp], [keys[i] for i in comp],
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


def _densify(grad, var):
    if not isinstance(grad, tf.IndexedSlices):
        return grad
    dense = tf.convert_to_tensor(grad)
    if not dense.shape.is_fully_defined() and var.shape.is_fully_defined():
        dense = tf.reshape(dense, var.shape)  # the residual needs the static shape
    return dense


def _var_keys(vars):
    """Residual keys for a list of variables: each variable's name without ``:0``; a name that
    occurs again gets ``#2``, ``#3``... in list order (deterministic, so the same on every rank)."""
    seen = collections.Counter()
    keys = []
    for v in vars:
        name = getattr(v, "name", None)
        if not name:
            raise ValueError("TwoBitCompressor keys residuals by variable name, and %r has none" % (v,))
        if name.endswith(":0"):
            name = name[:-2]
        seen[name] += 1
        keys.append(name if seen[name] == 1 else "%s#%d" % (name, seen[name]))
    return tuple(keys)


def _build_grads_fn(name, device_dense, device_sparse, compression, sparse_as_dense, op,
                    gradient_predivide_factor, groups, process_set):
    """Horovod's allreduce_grads (horovod/tensorflow/__init__.py, _make_cached_allreduce_grads_fn)
    for a TwoBitCompressor, telling the router each gradient's variable."""
    groups = refs_to_vars(groups) if isinstance(groups, tuple) else groups
    if op == mpi_ops.Average:
        prescale_factor = 1.0 / gradient_predivide_factor
        postscale_factor = gradient_predivide_factor
    else:
        prescale_factor = postscale_factor = 1.0
    kw = dict(device_dense=device_dense, device_sparse=device_sparse, compression=compression,
              op=op, prescale_factor=prescale_factor, postscale_factor=postscale_factor,
              process_set=process_set)

    def allreduce_grads(grads, vars, use_generic_names, keys):
        with tf.name_scope(name + "_Allreduce"):
            grads = list(grads)
            if sparse_as_dense:
                grads = [_densify(g, v) for g, v in zip(grads, vars)]
            for g, k in zip(grads, keys):
                _refuse_sparse(g, "the gradient of %r" % (k,))

            def generic(i):
                return dict(name="grad_%d" % i if use_generic_names else None,
                            ignore_name_scope=use_generic_names)

            if groups is not None:
                if isinstance(groups, list):
                    by_name = {}
                    for i in range(len(vars)):
                        if grads[i] is not None:
                            by_name[vars[i].name] = (i, grads[i])
                    split = []
                    for group in groups:
                        part = []
                        for var in group:
                            if var.name in by_name:
                                part.append(by_name.pop(var.name))
                        split.append(part)
                    for item in by_name.values():
                        split.append([item])
                else:
                    split = split_list([(i, g) for i, g in enumerate(grads) if g is not None], groups)
                out = [None] * len(vars)
                for gi, group in enumerate(split):
                    if not group:
                        continue
                    idx, gs = [list(t) for t in zip(*group)]
                    with _keyed([keys[i] for i in idx]):
                        res = hvd_tf._grouped_allreduce_cond(gs, **kw, **generic(gi))
                    for i, r in zip(idx, res):
                        out[i] = r
                return out

            out = [None] * len(grads)
            buckets = _buckets(compression, grads, vars)
            for bi, idx in enumerate(buckets):
                with _keyed([keys[i] for i in idx]):
                    res = hvd_tf._grouped_allreduce_cond([grads[i] for i in idx], **kw,
                                                         **generic(len(grads) + bi))
                for i, r in zip(idx, res):
                    out[i] = r
            alone = set(range(len(grads))) - {i for idx in buckets for i in idx}
            for i in sorted(alone):
                if grads[i] is None:
                    continue
                with _keyed([keys[i]]):
                    out[i] = hvd_tf._allreduce_cond(grads[i], **kw, **generic(i))
            return out

    # Horovod wraps its function in tf.function when built eagerly (_make_subgraph); so do we.
    # Not autograph: nothing here branches on tensor values.
    eager = tf.executing_eagerly()
    fn = tf.function(allreduce_grads, autograph=False) if eager else allreduce_grads

    def run(grads, vars=None, use_generic_names=False):
        if vars is None:
            raise ValueError("TwoBitCompressor keys residuals by variable: this allreduce_grads call "
                             "has no variables")
        vars = list(vars)
        keys = _var_keys(vars)  # a Python value: a different list of variables retraces
        if not sparse_as_dense:
            for g, k in zip(grads, keys):
                _refuse_sparse(g, "the gradient of %r" % (k,))
        if not tf.executing_eagerly():
            return fn(grads, vars, use_generic_names, keys)
        with _translated():
            return fn(grads, vars, use_generic_names, keys)

    return run


def _buckets(compressor, grads, vars):
    """Buckets of gradient indices, cut from the variables' order (the same on every rank): the
    floating-point gradients of static size, in runs of at most ``compressor.bucket_bytes``."""
    if not compressor.bucket_bytes:
        return []
    entries = []
    for i, (g, v) in enumerate(zip(grads, vars)):
        if g is None or not _is_float(g) or g.shape.num_elements() is None:
            continue
        n = g.shape.num_elements()
        entries.append((i, n, n * tf.as_dtype(g.dtype).size, getattr(g, "device", "") or ""))
    return layout.assign_buckets(entries, compressor.bucket_bytes)


def _make_allreduce_grads_fn(name, device_dense, device_sparse, compression, sparse_as_dense, op,
                             gradient_predivide_factor, groups,
                             process_set=mpi_ops.global_process_set):
    _check_compression(compression)
    if not isinstance(compression, TwoBitCompressor):
        return _orig("_make_allreduce_grads_fn")(name, device_dense, device_sparse, compression,
                                                 sparse_as_dense, op, gradient_predivide_factor,
                                                 groups, process_set=process_set)
    _check_op(op)
    groups = vars_to_refs(groups) if isinstance(groups, list) else groups
    # Cached like Horovod's (a custom loop builds a DistributedGradientTape every step).
    key = (name, device_dense, device_sparse, compression, sparse_as_dense, op,
           gradient_predivide_factor, groups, process_set, tf.executing_eagerly())
    with _lock:
        fn = _grads_fns.get(key)
        if fn is None:
            fn = _grads_fns[key] = _build_grads_fn(name, device_dense, device_sparse, compression,
                                                   sparse_as_dense, op, gradient_predivide_factor,
                                                   groups, process_set)
    return fn


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
        _grads_fns.clear()


def installed():
    return bool(_originals)
