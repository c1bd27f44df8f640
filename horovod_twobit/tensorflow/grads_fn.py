"""The gradient reduction that ``DistributedGradientTape``, the TF1 ``DistributedOptimizer`` and
Keras' ``DistributedOptimizer`` build (Horovod's ``_make_allreduce_grads_fn``), for a
TwoBitCompressor: what Horovod's does (sparse_as_dense, groups, the process-set condition, the name
scope), plus each gradient's residual key (its variable's name) and buckets cut once from the
variables' order."""

import collections
import threading

import tensorflow as tf

import horovod.tensorflow as hvd_tf
import horovod.tensorflow.mpi_ops as mpi_ops
from horovod.common.util import split_list
from horovod.tensorflow.util import refs_to_vars, vars_to_refs

from horovod_twobit.wire import layout
from horovod_twobit.tensorflow import checks

_lock = threading.Lock()
_fns = {}


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

    def allreduce_grads(grads, vars, use_generic_names, keys, settled=0):
        """(``settled``: how many buckets checks had settled when this was called: a step
        traced anew after a check decided traces this anew too, where it is a function of its
        own, so that the step keeps the modes kept without a check)"""
        state = checks.state_of(compression)
        if not (state.fallback == "auto" and state.check_fallback and tf.inside_function()):
            return reduce_grads(grads, vars, use_generic_names, keys)
        from horovod_twobit.tensorflow.exchange import link
        present = [k for g, k in zip(grads, keys) if g is not None]
        if link.settles(state, present, process_set.size()):
            return reduce_grads(grads, vars, use_generic_names, keys)  # every mode settled
        # fallback="auto": the model's picks are checked on the first steps of this trace
        with tf.name_scope(name + "_FallbackCheck"):
            check = link.Check(state, process_set, after=grads)
        state.checks.append(check)
        with link.checking(check):
            out = reduce_grads(grads, vars, use_generic_names, keys)
        return check.end(out)

    def reduce_grads(grads, vars, use_generic_names, keys):
        with tf.name_scope(name + "_Allreduce"):
            grads = list(grads)
            if sparse_as_dense:
                grads = [_densify(g, v) for g, v in zip(grads, vars)]
            for g, k in zip(grads, keys):
                checks.refuse_sparse(g, "the gradient of %r" % (k,))

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
                    with checks.keyed([keys[i] for i in idx]):
                        res = hvd_tf._grouped_allreduce_cond(gs, **kw, **generic(gi))
                    for i, r in zip(idx, res):
                        out[i] = r
                return out

            out = [None] * len(grads)
            buckets = _buckets(compression, grads, vars)
            for bi, idx in enumerate(buckets):
                with checks.keyed([keys[i] for i in idx]):
                    res = hvd_tf._grouped_allreduce_cond([grads[i] for i in idx], **kw,
                                                         **generic(len(grads) + bi))
                for i, r in zip(idx, res):
                    out[i] = r
            alone = set(range(len(grads))) - {i for idx in buckets for i in idx}
            for i in sorted(alone):
                if grads[i] is None:
                    continue
                with checks.keyed([keys[i]]):
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
                checks.refuse_sparse(g, "the gradient of %r" % (k,))
        settled = len(checks.state_of(compression).settled)
        if not tf.executing_eagerly():
            return fn(grads, vars, use_generic_names, keys, settled)
        with checks.translated():
            return fn(grads, vars, use_generic_names, keys, settled)

    return run


def _buckets(compressor, grads, vars):
    """Buckets of gradient indices, cut from the variables' order (the same on every rank): the
    floating-point gradients of static size, in runs of at most ``compressor.bucket_bytes``."""
    if not compressor.bucket_bytes:
        return []
    entries = []
    for i, (g, v) in enumerate(zip(grads, vars)):
        if g is None or not checks.is_float(g) or g.shape.num_elements() is None:
            continue
        n = g.shape.num_elements()
        entries.append((i, n, n * tf.as_dtype(g.dtype).size, getattr(g, "device", "") or ""))
    return layout.assign_buckets(entries, compressor.bucket_bytes)


def cached(name, device_dense, device_sparse, compression, sparse_as_dense, op,
           gradient_predivide_factor, groups, process_set):
    """The gradient function for a TwoBitCompressor, cached like Horovod's (a custom loop builds a
    DistributedGradientTape every step)."""
    checks.check_op(op)
    groups = vars_to_refs(groups) if isinstance(groups, list) else groups
    key = (name, device_dense, device_sparse, compression, sparse_as_dense, op,
           gradient_predivide_factor, groups, process_set, tf.executing_eagerly())
    with _lock:
        fn = _fns.get(key)
        if fn is None:
            fn = _fns[key] = _build_grads_fn(name, device_dense, device_sparse, compression,
                                             sparse_as_dense, op, gradient_predivide_factor,
                                             groups, process_set)
    return fn


def clear():
    with _lock:
        _fns.clear()
