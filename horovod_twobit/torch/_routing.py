"""The one place that wraps Horovod's PyTorch API, explicitly and reversibly.

:func:`install` replaces a few entry points of ``horovod.torch`` (where ``hvd.*`` resolves),
``horovod.torch.mpi_ops`` and ``horovod.torch.optimizer`` (which imported them by name) with thin
wrappers. A wrapper looks for tensors marked by ``TwoBitCompressor.compress`` and sends those to
allgather + decode + sum; every other call goes to the original function unchanged.
:func:`uninstall` puts the originals back.
"""

import threading

import horovod.torch as hvd_torch
import horovod.torch.mpi_ops as mpi_ops
import horovod.torch.optimizer as hvd_optimizer

from .communicator import Exchange, Handle
from .compressor import TwoBitCompressor, pending_of

_MODULES = (hvd_torch, mpi_ops, hvd_optimizer)
_NAMES = ("allreduce", "allreduce_async_", "grouped_allreduce", "grouped_allreduce_async_",
          "synchronize", "poll", "DistributedOptimizer")
_originals = {}
_lock = threading.Lock()


def _orig(name):
    return _originals.get(name) or getattr(mpi_ops, name)


def _global_ps():
    return mpi_ops.global_process_set


def _op(op, average):
    return mpi_ops.handle_average_backwards_compatibility(op, average)


def _check_compression(compression):
    if compression is TwoBitCompressor:
        raise TypeError("pass an instance, e.g. compression=TwoBitCompressor(0.5), not the class")


def _start(tensor, pending, name, op, prescale, postscale, process_set, in_place):
    pending.routed = True
    return Exchange(pending.compressor, tensor, name, op, prescale, postscale, process_set, in_place)


def allreduce_async_(tensor, average=None, name=None, op=None, prescale_factor=1.0,
                     postscale_factor=1.0, process_set=None):
    process_set = process_set or _global_ps()
    pending = pending_of(tensor)
    if pending is None:
        return _orig("allreduce_async_")(tensor, average=average, name=name, op=op,
                                         prescale_factor=prescale_factor,
                                         postscale_factor=postscale_factor, process_set=process_set)
    ex = _start(tensor, pending, name, _op(op, average), prescale_factor, postscale_factor,
                process_set, in_place=True)
    return Handle([ex], mpi_ops.allgather_async(ex.payload, name=name, process_set=process_set),
                  grouped=False)


def allreduce(tensor, average=None, name=None, compression=None, op=None, prescale_factor=1.0,
              postscale_factor=1.0, process_set=None):
    process_set = process_set or _global_ps()
    _check_compression(compression)
    if not isinstance(compression, TwoBitCompressor):
        kw = {} if compression is None else {"compression": compression}
        return _orig("allreduce")(tensor, average=average, name=name, op=op,
                                  prescale_factor=prescale_factor,
                                  postscale_factor=postscale_factor, process_set=process_set, **kw)
    compressed, ctx = compression.compress(tensor.detach())
    pending = pending_of(compressed)
    if pending is None:  # not floating point: plain allreduce
        return _orig("allreduce")(tensor, average=average, name=name, op=op,
                                  prescale_factor=prescale_factor,
                                  postscale_factor=postscale_factor, process_set=process_set)
    ex = _start(compressed, pending, name, _op(op, average), prescale_factor, postscale_factor,
                process_set, in_place=False)
    handle = Handle([ex], mpi_ops.allgather_async(ex.payload, name=name, process_set=process_set),
                    grouped=False)
    return compression.decompress(handle(), ctx)


def _grouped(tensors, name, op, prescale, postscale, process_set, in_place):
    """Splits a group into TwoBit tensors (one grouped allgather) and the rest (one grouped
    allreduce through Horovod, untouched). Returns a Handle, or None when no tensor is TwoBit."""
    marks = [pending_of(t) for t in tensors]
    if all(m is None for m in marks):
        return None
    if name is None:
        raise ValueError("TwoBitCompressor keys its residuals by tensor name, and this grouped "
                         "allreduce has none: pass name='...'")
    exchanges, plain, order = [], [], []
    for i, (t, m) in enumerate(zip(tensors, marks)):
        if m is None:
            order.append(("p", len(plain)))
            plain.append(t)
        else:
            order.append(("c", len(exchanges)))
            exchanges.append(_start(t, m, "%s.%d" % (name, i), op, prescale, postscale,
                                    process_set, in_place))
    gather = mpi_ops.grouped_allgather_async([ex.payload for ex in exchanges], name=name,
                                             process_set=process_set)
    passthrough = None
    if plain:
        fn = _orig("grouped_allreduce_async_") if in_place else mpi_ops.grouped_allreduce_async
        passthrough = fn(plain, name=name + ".uncompressed", op=op, prescale_factor=prescale,
                         postscale_factor=postscale, process_set=process_set)
    return Handle(exchanges, gather, grouped=True, passthrough=passthrough,
                  order=order if plain else None)


def grouped_allreduce_async_(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                             postscale_factor=1.0, process_set=None):
    process_set = process_set or _global_ps()
    h = _grouped(tensors, name, _op(op, average), prescale_factor, postscale_factor, process_set,
                 in_place=True)
    if h is not None:
        return h
    return _orig("grouped_allreduce_async_")(tensors, average=average, name=name, op=op,
                                             prescale_factor=prescale_factor,
                                             postscale_factor=postscale_factor,
                                             process_set=process_set)


def grouped_allreduce(tensors, average=None, name=None, compression=None, op=None,
                      prescale_factor=1.0, postscale_factor=1.0, process_set=None):
    process_set = process_set or _global_ps()
    _check_compression(compression)
    if not isinstance(compression, TwoBitCompressor):
        kw = {} if compression is None else {"compression": compression}
        return _orig("grouped_allreduce")(tensors, average=average, name=name, op=op,
                                          prescale_factor=prescale_factor,
                                          postscale_factor=postscale_factor,
                                          process_set=process_set, **kw)
    compressed, ctxs = zip(*[compression.compress(t.detach()) for t in tensors])
    h = _grouped(list(compressed), name, _op(op, average), prescale_factor, postscale_factor,
                 process_set, in_place=False)
    if h is None:
        return _orig("grouped_allreduce")(tensors, average=average, name=name, op=op,
                                          prescale_factor=prescale_factor,
                                          postscale_factor=postscale_factor,
                                          process_set=process_set)
    return [compression.decompress(t, c) for t, c in zip(h(), ctxs)]


def synchronize(handle):
    if isinstance(handle, Handle):
        return handle()
    return _orig("synchronize")(handle)


def poll(handle):
    if isinstance(handle, Handle):
        return handle.poll()
    return _orig("poll")(handle)


def DistributedOptimizer(optimizer, named_parameters=None, compression=None, *args, **kwargs):
    """Horovod's own ``DistributedOptimizer``, after refusing what TwoBit cannot do correctly."""
    original = _originals["DistributedOptimizer"]
    _check_compression(compression)
    if compression is None:
        return original(optimizer, named_parameters, *args, **kwargs)
    if isinstance(compression, TwoBitCompressor):
        op = kwargs.get("op", args[1] if len(args) > 1 else mpi_ops.Average)
        if op == mpi_ops.Adasum:
            raise ValueError("TwoBitCompressor cannot be combined with op=hvd.Adasum (Adasum needs "
                             "the full-precision gradients): use op=hvd.Average")
    opt = original(optimizer, named_parameters, compression, *args, **kwargs)
    if isinstance(compression, TwoBitCompressor) and hasattr(opt, "_sparse_allreduce_grad_async"):
        def refuse_sparse(p, name):
            raise ValueError(
                "parameter %r has a sparse gradient, which TwoBitCompressor cannot compress: pass "
                "sparse_as_dense=True to hvd.DistributedOptimizer" % (name,))
        opt._sparse_allreduce_grad_async = refuse_sparse
    return opt


_WRAPPERS = {"allreduce": allreduce, "allreduce_async_": allreduce_async_,
             "grouped_allreduce": grouped_allreduce,
             "grouped_allreduce_async_": grouped_allreduce_async_,
             "synchronize": synchronize, "poll": poll,
             "DistributedOptimizer": DistributedOptimizer}


def _patches(module, name):
    # Horovod's broadcast_optimizer_state compares an optimizer's module with that of
    # horovod.torch.optimizer.DistributedOptimizer: only the hvd.DistributedOptimizer name is wrapped.
    return name != "DistributedOptimizer" or module is hvd_torch


def install():
    """Routes TwoBit payloads through allgather + decode + sum. Idempotent."""
    with _lock:
        if _originals:
            return
        for name in _NAMES:
            _originals[name] = getattr(hvd_optimizer if name == "DistributedOptimizer" else mpi_ops, name)
        for module in _MODULES:
            for name in _NAMES:
                if hasattr(module, name) and _patches(module, name):
                    setattr(module, name, _WRAPPERS[name])


def uninstall():
    """Puts Horovod's original functions back."""
    with _lock:
        for module in _MODULES:
            for name in _NAMES:
                if hasattr(module, name) and getattr(module, name) is _WRAPPERS[name]:
                    setattr(module, name, _originals[name])
        _originals.clear()


def installed():
    return bool(_originals)
