"""The 2-bit codec for PyTorch's ``DistributedDataParallel``: a communication hook, no Horovod.

::

    from horovod_twobit.torch import ddp as twobit_ddp
    model = DDP(net)
    state = twobit_ddp.TwoBitState(threshold="auto")        # process_group=None: the default group
    twobit_ddp.register(model, state)                      # names the parameters, registers the hook
    # or: state.name_parameters(model.named_parameters()); model.register_comm_hook(state, twobit_ddp.twobit_hook)

DDP's buckets are the buckets. Each step the hook copies the bucket's flat gradient into the
codec's layout (each parameter padded to whole 16-value words, as the Horovod path's buckets),
encodes it with the codec of the Horovod path (``codec.encode_payload``, MXNet's words), gathers
every rank's payload with ``torch.distributed.all_gather``, and in its callback checks them,
decodes and sums them in rank order, divides by the number of ranks and commits this rank's
residuals (``codec.finish_payload``), then hands DDP the result. Every rank computes the same
bits, each parameter's result is what the NumPy reference gives it, and a parameter whose
gradient held NaN or Inf on any rank gets NaN on every rank and keeps its residual.

Residuals are keyed by parameter name (:meth:`TwoBitState.name_parameters`), so they follow a
parameter when DDP rebuilds its buckets after the first iteration, and ``state.state_dict()``
saves them by name, per rank, as :class:`horovod_twobit.torch.TwoBitCompressor` does.

This first version exchanges by allgather only (``exchange="scatter"`` and ``fallback`` are
refused with the fix) and compresses every floating-point parameter (``min_numel=0``).
"""

import torch
import torch.distributed as dist

from horovod_twobit.state import stats
from horovod_twobit.torch import codec, state as _state
from horovod_twobit.torch.codec import stats as stats_read
from horovod_twobit.wire.layout import Layout
from horovod_twobit.wire import scatter as scatter_wire


class TwoBitState(_state.TwoBitState):
    """What the hook keeps between steps (:class:`horovod_twobit.torch.state.TwoBitState`, with
    ``torch.distributed``'s ranks): threshold, residuals by parameter name, stats, checkpoint."""

    def __init__(self, threshold=0.5, process_group=None, *, rule=None, block=None, blocks=None,
                 min_numel=0, exchange="allgather", fallback=None):
        if exchange != "allgather":
            raise ValueError("the DDP hook exchanges by allgather only (got exchange=%r): pass "
                             "exchange='allgather', or use TwoBitCompressor with Horovod for the "
                             "scatter exchange" % (exchange,))
        if fallback is not None:
            raise ValueError("the DDP hook has no fallback (got fallback=%r): pass fallback=None, "
                             "or register DDP's own hook where compression does not pay"
                             % (fallback,))
        if min_numel:
            raise ValueError("the DDP hook compresses every parameter (got min_numel=%r): pass "
                             "min_numel=0" % (min_numel,))
        super().__init__(threshold, rule=rule, block=block, blocks=blocks, bucket_bytes=0,
                         rank_size=self._dist_rank_size)
        self.process_group = process_group
        self.names = {}  # id(parameter) -> its name
        self._ddp_buckets = {}  # the members' names -> _Bucket
        self._bound_to = {}  # name -> the _Bucket whose flat residual holds its residual now

    def _dist_rank_size(self):
        if not dist.is_available() or not dist.is_initialized():
            return 0, 1
        return dist.get_rank(self.process_group), dist.get_world_size(self.process_group)

    def name_parameters(self, named_parameters):
        """Names the residuals: ``named_parameters`` as ``model.named_parameters()`` gives them
        (DDP's ``module.`` prefix is dropped, so a checkpoint of the bare model's names fits)."""
        for name, p in named_parameters:
            self.names[id(p)] = name[len("module."):] if name.startswith("module.") else name
        return self

    def _bucket(self, params):
        try:
            names = tuple(self.names[id(p)] for p in params)
        except KeyError:
            raise ValueError("the DDP hook keys residuals by parameter name and met a parameter it "
                             "has no name for: call twobit_ddp.register(model, state), or "
                             "state.name_parameters(model.named_parameters()) before training")
        b = self._ddp_buckets.get(names)
        if b is None:
            b = self._ddp_buckets[names] = _Bucket(self, names, [p.numel() for p in params])
        return b


class _Bucket:
    """One DDP bucket's members, their layout, and the flat buffers the codec works in."""

    def __init__(self, state, names, numels):
        self.state, self.names = state, list(names)
        self.layout = Layout(numels, state.threshold == "auto", state.block, state.blocks)
        self.key = scatter_wire.owner_key(self.names)
        self.r = self.g = None
        self._g_views = None  # the members' slices of g (the codec's layout, padded per member)
        self._generation = None
        self.steps, self.step_norms = 0, None  # what the stats' norms reader looks at
        self.norms = stats_read.bucket_norms(self)

    def current_residual(self):
        """The flat residual if it holds the registry's current residuals, else None."""
        if self.layout.single:
            return self.state.residuals.lookup(self.names[0])
        bound = self.state._bound_to
        ok = self._generation == self.state.residuals.generation and all(
            bound.get(n) is self for n in self.names)
        return self.r if ok else None

    def residual(self, device):
        """This bucket's flat float32 residual, its members' residuals in the state's registry
        (bound again after a reset or a load, or when another bucket held one of them)."""
        reg, lay = self.state.residuals, self.layout
        if lay.single:
            return reg.get(self.names[0], torch.empty(lay.values, device=device)).view(-1)
        if self.r is None or self.r.device != device:
            self.r = torch.zeros(lay.values, dtype=torch.float32, device=device)
            self.g = torch.zeros(lay.values, dtype=torch.float32, device=device)
            self._g_views = [self.g[s:s + n] for s, n in zip(lay.starts, lay.numels)]
            self._generation = None
        bound = self.state._bound_to
        if self._generation != reg.generation or any(bound.get(n) is not self for n in self.names):
            for name, s, n in zip(self.names, lay.starts, lay.numels):
                reg.bind(name, self.r[s:s + n])
                bound[name] = self
            self._generation = reg.generation
        return self.r

    def gradient(self, buffer):
        """The bucket's gradients as the codec's flat float32 buffer (padded per member)."""
        if self.layout.single:
            return buffer.to(torch.float32, copy=True)
        torch._foreach_copy_(self._g_views, buffer.split(self.layout.numels))
        return self.g

    def result(self, flat, buffer):
        """Copies the finished flat result back into DDP's bucket buffer."""
        if self.layout.single:
            buffer.copy_(flat)
            return buffer
        torch._foreach_copy_(list(buffer.split(self.layout.numels)), self._g_views)
        return buffer


def twobit_hook(state, bucket):
    """DDP's communication hook (``model.register_comm_hook(state, twobit_hook)``): returns a
    future of the bucket's buffer holding the average of every rank's 2-bit-compressed gradients,
    this rank's residuals committed."""
    buffer = bucket.buffer()
    b = state._bucket(bucket.parameters())
    lay, pg = b.layout, state.process_group
    nranks = dist.get_world_size(pg)
    r = b.residual(buffer.device)
    g = b.gradient(buffer)
    payload = torch.empty(lay.payload_words, dtype=torch.int32, device=buffer.device)
    t, v = codec.encode_payload(lay, r, g, state.threshold, state.auto_rule, payload)
    rank = dist.get_rank(pg)
    state.stats_log.sent(b.key, b.names, "allgather",
                         scatter_wire.rank_bytes(lay, nranks, rank, "allgather"),
                         lambda: stats.payload_counts(lay, payload.cpu().numpy(), state.threshold),
                         sum(lay.numels), b.norms)
    gathered = [torch.empty_like(payload) for _ in range(nranks)]
    work = dist.all_gather(gathered, payload, group=pg, async_op=True)

    def finish(_):
        flat, nonfinite = codec.finish_payload(lay, torch.cat(gathered), nranks, b.names, r, g,
                                               t, v, nranks, 1.0)
        state.stats_log.finished(nonfinite)
        b.steps += 1
        return b.result(flat, buffer)

    return work.get_future().then(finish)


def register(model, state, hook=twobit_hook):
    """Names ``model``'s parameters in ``state`` and registers ``hook`` on the DDP ``model``."""
    state.name_parameters(model.named_parameters())
    model.register_comm_hook(state, hook)
    return state
