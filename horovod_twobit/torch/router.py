"""The one place that wraps Horovod's PyTorch API, explicitly and reversibly.

:func:`install` replaces a few entry points of ``horovod.torch`` (where ``hvd.*`` resolves),
``horovod.torch.mpi_ops`` and ``horovod.torch.optimizer`` (which imported them by name) with thin
wrappers. A wrapper looks for tensors marked by ``TwoBitCompressor.compress`` and sends those to
allgather + decode + sum; every other call goes to the original function unchanged.
:func:`uninstall` puts the originals back.
"""

import threading
import time

import torch

import horovod.torch as hvd_torch
import horovod.torch.mpi_ops as mpi_ops
import horovod.torch.optimizer as hvd_optimizer

from horovod_twobit.torch.exchange import horovod_ops, progress
from horovod_twobit.torch.exchange.allgather import check_call
from horovod_twobit.torch.exchange.bucket import Handle
from horovod_twobit.torch.state import TwoBitState

_MODULES = (hvd_torch, mpi_ops, hvd_optimizer)
_NAMES = ("allreduce", "allreduce_async_", "grouped_allreduce", "grouped_allreduce_async_",
          "synchronize", "poll", "DistributedOptimizer")
_originals = horovod_ops.originals  # name -> Horovod's own function, while installed
_lock = threading.Lock()
_MARK = "_horovod_twobit"


class _Pending:
    """The context ``TwoBitCompressor.compress`` hands to Horovod: the compressor's state, and
    whether the router took the tensor (``decompress`` warns when it did not)."""

    __slots__ = ("state", "routed")

    def __init__(self, state):
        self.state = state
        self.routed = False


def mark(state, tensor):
    """(an alias of ``tensor`` marked for the 2-bit exchange of ``state``, its context)."""
    alias = tensor.view_as(tensor)
    ctx = _Pending(state)
    setattr(alias, _MARK, ctx)
    return alias, ctx


def pending_of(tensor):
    """The context if ``tensor`` came from ``TwoBitCompressor.compress``, else None."""
    return getattr(tensor, _MARK, None) if isinstance(tensor, torch.Tensor) else None


def unrouted(ctx):
    """Whether ``ctx`` is a marked tensor's context that the router never took."""
    return isinstance(ctx, _Pending) and not ctx.routed


def _state_of(compression):
    """The :class:`TwoBitState` behind a ``TwoBitCompressor`` instance, else None. (The router
    knows compressors by their state: the face imports the router, not the reverse.)"""
    state = getattr(compression, "state", None)
    return state if isinstance(state, TwoBitState) else None


_orig = horovod_ops.own


def _global_ps():
    return mpi_ops.global_process_set


def _op(op, average):
    return mpi_ops.handle_average_backwards_compatibility(op, average)


def _check_compression(compression):
    if isinstance(compression, type) and getattr(compression, "TWOBIT_FACE", False):
        raise TypeError("pass an instance, e.g. compression=TwoBitCompressor(0.5), not the class")


def _alone(tensor, pending, name, call, in_place):
    """Sends one tensor in a bucket of its own."""
    check_call(call[0], name)
    pending.routed = True
    bucket = pending.state.single(name, tensor)
    if in_place and bucket.takes_direct(call):
        return bucket.send_direct(tensor, name, call)  # settled plain: Horovod's own handle
    return Handle(bucket.launch([tensor], *call, in_place=in_place), 0)


def allreduce_async_(tensor, average=None, name=None, op=None, prescale_factor=1.0,
                     postscale_factor=1.0, process_set=None):
    pending = pending_of(tensor)
    if pending is None:
        return _orig("allreduce_async_")(tensor, average=average, name=name, op=op,
                                         prescale_factor=prescale_factor,
                                         postscale_factor=postscale_factor,
                                         process_set=process_set or _global_ps())
    call = (_op(op, average), prescale_factor, postscale_factor, process_set or _global_ps())
    bucket = pending.state.bucket_of(name)
    if bucket is not None and tensor.numel() == bucket.layout.numels[bucket.index[name]]:
        check_call(call[0], name)
        pending.routed = True
        if bucket.takes_direct(call):
            return bucket.send_direct(tensor, name, call)  # settled plain: Horovod's own handle
        return bucket.arrive(tensor, name, call)
    return _alone(tensor, pending, name, call, in_place=True)


def allreduce(tensor, average=None, name=None, compression=None, op=None, prescale_factor=1.0,
              postscale_factor=1.0, process_set=None):
    process_set = process_set or _global_ps()
    _check_compression(compression)
    if _state_of(compression) is None:
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
    call = (_op(op, average), prescale_factor, postscale_factor, process_set)
    handle = _alone(compressed, pending, name, call, in_place=False)
    return compression.decompress(handle(), ctx)


def _grouped(tensors, name, op, prescale, postscale, process_set, in_place):
    """Splits a group into TwoBit tensors (one bucket: one encode, one allgather, one finish) and
    the rest (one grouped allreduce through Horovod, untouched). Returns a Handle, or None when
    no tensor is TwoBit."""
    marks = [pending_of(t) for t in tensors]
    if all(m is None for m in marks):
        return None
    if name is None:
        raise ValueError("TwoBitCompressor keys its residuals by tensor name, and this grouped "
                         "allreduce has none: pass name='...'")
    check_call(op, name)
    compressed, plain, order = [], [], []
    for i, (t, m) in enumerate(zip(tensors, marks)):
        if m is None:
            order.append(("p", len(plain)))
            plain.append(t)
        else:
            order.append(("c", len(compressed)))
            compressed.append(("%s.%d" % (name, i), t, m))
            m.routed = True
    state = compressed[0][2].state
    names = [n for n, _, _ in compressed]
    group = [t for _, t, _ in compressed]
    if len(group) == 1:
        bucket = state.single(names[0], group[0])
    else:
        bucket = state.group_bucket(names, group)
    flight = bucket.launch(group, op, prescale, postscale, process_set, in_place)
    passthrough = None
    if plain:
        fn = _orig("grouped_allreduce_async_") if in_place else mpi_ops.grouped_allreduce_async
        passthrough = fn(plain, name=name + ".uncompressed", op=op, prescale_factor=prescale,
                         postscale_factor=postscale, process_set=process_set)
    return Handle(flight, passthrough=passthrough, order=order if plain else None)


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
    if _state_of(compression) is None:
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
    # scatter steps in flight still get phase 2; then Horovod's own wait, unchanged
    progress.wait(lambda: _orig("poll")(handle), until_done=False)
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
    state = _state_of(compression)
    if state is not None:
        op = kwargs.get("op", args[1] if len(args) > 1 else mpi_ops.Average)
        if op == mpi_ops.Adasum:
            raise ValueError("TwoBitCompressor cannot be combined with op=hvd.Adasum (Adasum needs "
                             "the full-precision gradients): use op=hvd.Average")
    opt = original(optimizer, named_parameters, compression, *args, **kwargs)
    if state is not None and hasattr(opt, "_sparse_allreduce_grad_async"):
        def refuse_sparse(p, name):
            raise ValueError(
                "parameter %r has a sparse gradient, which TwoBitCompressor cannot compress: pass "
                "sparse_as_dense=True to hvd.DistributedOptimizer" % (name,))
        opt._sparse_allreduce_grad_async = refuse_sparse
        if state.bucket_bytes and getattr(opt, "_groups", None) is None:
            # gradients become ready roughly in the reverse order of the parameters (DDP's rule)
            names = opt._parameter_names
            params = [p for group in opt.param_groups for p in group["params"]
                      if p in opt._requires_update]
            state.plan([(names[p], p) for p in reversed(params)])
            # the gradients the compressor takes: each in a planned bucket or alone
            taken = [names[p] for p in params
                     if p.is_floating_point() and p.numel() >= max(state.min_numel, 1)]
            if taken:
                _hand_over(opt, _OptimizerCompression(compression, state, taken))
    return opt


class _OptimizerCompression:
    """The compression an ``hvd.DistributedOptimizer`` holds for a ``TwoBitCompressor``: the
    compressor itself, except for the steps that go to Horovod's own allreduce unmarked, exactly
    as with ``compression=hvd.Compression.none`` (not even the router's per-gradient work, which
    on a host short of cores delayed each gradient's collective enough to cost 5-10 % of a
    step):

    - every step, once every bucket of the optimizer's gradients is settled plain with a zero
      residual (each bucket's ``direct``, checked after each step's synchronize);
    - a step of ``fallback="auto"``'s check whose mode is plain for every bucket, their
      residuals zero (the second of a plain turn, the one the check times): so the check times
      plain steps as they will run once settled, not through the compressor. The step is
      counted in the check after it ran, with when its first gradient arrived.

    Such steps are still counted in the stats (one plain step per bucket). A change of the
    residuals' generation (``reset``, ``load_state_dict``) hands the gradients back to the
    compressor, which decides again."""

    def __init__(self, face, state, names):
        self.face, self.state, self.names = face, state, names
        self.buckets = None  # the buckets of those gradients, once every one has its bucket
        self.direct = None  # the residuals' generation from which every bucket is direct
        self.checked = None  # the generation in which this step is a check's plain step
        self.started = None  # when that step's first gradient arrived

    def __getattr__(self, name):  # the compressor's own attributes (stats, decisions, ...)
        if name == "face":
            raise AttributeError(name)
        return getattr(self.face, name)

    def __repr__(self):
        return repr(self.face)

    def compress(self, tensor):
        if self.direct is not None and self.direct == self.state.residuals.generation:
            return tensor, None
        if self.checked is not None and self.checked == self.state.residuals.generation:
            if self.started is None:
                self.started = time.perf_counter()
            return tensor, None
        return self.face.compress(tensor)

    def decompress(self, tensor, ctx):
        return self.face.decompress(tensor, ctx)

    def after_step(self):
        """Called after each synchronize of the optimizer: counts a step that went to Horovod
        directly, and decides whether the next one does."""
        c = self.state
        gen = c.residuals.generation
        if self.direct == gen:
            for b in self.buckets:
                b.log_direct()
            return
        checked, self.checked = self.checked, None
        if checked == gen:  # a check's plain step: counted now, as each bucket's launch
            for b in self.buckets:
                if not c.count_plain(b, self.started):
                    raise RuntimeError("horovod-twobit: a checked step sent plain was scheduled "
                                       "compressed for bucket %s" % b.key)
                b.log_direct()
        self.started = None
        buckets = self.buckets
        if buckets is None:  # planned buckets, and the tensors alone once they were sent
            found = [c.bucket_of(n) or c.single_of(n) for n in self.names]
            if any(b is None for b in found):
                return
            buckets = self.buckets = list({id(b): b for b in found}.values())
        if all(b.direct is not None and b.direct[0] == gen for b in buckets):
            self.direct = gen
        elif all(b.zero_residual == gen and c.next_plain(b) for b in buckets):
            self.checked = gen


def _hand_over(opt, holder):
    """Makes ``holder`` the optimizer's compression, told after each of its synchronizes."""
    synchronize = opt.synchronize

    def synchronize_then_count():
        synchronize()
        holder.after_step()
    opt._compression = holder
    opt.synchronize = synchronize_then_count


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
