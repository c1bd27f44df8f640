"""The 2-bit codec for PyTorch's ``DistributedDataParallel``: a communication hook, no Horovod.

::

    from horovod_twobit.torch import ddp as twobit_ddp
    model = DDP(net)
    state = twobit_ddp.TwoBitState(threshold="auto")        # process_group=None: the default group
    twobit_ddp.register(model, state)                      # names the parameters, registers the hook
    # or: state.name_parameters(model.named_parameters()); model.register_comm_hook(state, twobit_ddp.twobit_hook)

DDP's buckets are the buckets. Each step the hook copies the bucket's flat gradient into the
codec's layout (each parameter padded to whole 16-value words, as the Horovod path's buckets) and
encodes it with the codec of the Horovod path (``codec.encode_payload``, MXNet's words). Then,
as the bucket's exchange says (``exchange=``, "auto" decided per bucket by
:func:`horovod_twobit.wire.scatter.choose`, as ``TwoBitCompressor`` decides it):

- allgather: ``torch.distributed.all_gather`` brings every rank's payload to every rank, and the
  future's callback checks them, decodes and sums them in rank order, divides by the number of
  ranks and commits this rank's residuals (``codec.finish_payload``);
- scatter: ``all_to_all_single`` sends chunk c of every rank's payload to rank c, which checks
  and sums it (``scatter_codec.owner_reduce``, with its owner residual for "auto"), then an
  ``all_gather`` brings every owner's sum to every rank, and the callback commits this rank's
  residuals and decodes the result (``scatter_codec.finish_reduced``). The first step of a bucket
  with a number of ranks first gathers every rank's plan (``codec.check_plans``), so ranks that
  disagree raise instead of waiting on an ``all_to_all_single`` of other sizes. Phase 1 is waited
  for inside the hook: collectives must be issued in the same order on every rank, and one
  issued from a callback would race with the next bucket's hook.

Parameters with fewer than ``min_numel`` values are not compressed: the hook sums them with one
``all_reduce`` per bucket and divides by the number of ranks, as ``TwoBitCompressor`` leaves them
to Horovod's allreduce (no residual, no stats).

Every rank computes the same bits, each compressed parameter's result is what the NumPy
reference gives it, and a parameter whose gradient held NaN or Inf on any rank gets NaN on every
rank and keeps its residual. Residuals are keyed by parameter name
(:meth:`TwoBitState.name_parameters`), so they follow a parameter when DDP rebuilds its buckets
after the first iteration, and ``state.state_dict()`` saves them by name, per rank, with the
scatter owners' residuals, as :class:`horovod_twobit.torch.TwoBitCompressor` does.
``state.stats()`` gives ``TwoBitCompressor.stats()``'s fields. ``fallback="auto"`` /
``"always"`` send a bucket's compressed members uncompressed where compression would not pay, as
``TwoBitCompressor`` does (:mod:`horovod_twobit.state.fallback`): the link measured with
``torch.distributed``'s collectives, the model's pick checked on the first steps; the bucket's
g + r go through one ``all_reduce``, divided by the number of ranks.
"""

import time

import torch
import torch.distributed as dist

from horovod_twobit.state import fallback, stats
from horovod_twobit.torch import codec, state as _state
from horovod_twobit.torch.codec import owner as owner_codec, scatter as scatter_codec
from horovod_twobit.torch.codec import stats as stats_read
from horovod_twobit.torch.exchange import checked
from horovod_twobit.wire.layout import Layout
from horovod_twobit.wire import scatter as scatter_wire


class TwoBitState(_state.TwoBitState):
    """What the hook keeps between steps (:class:`horovod_twobit.torch.state.TwoBitState`, with
    ``torch.distributed``'s ranks): threshold, exchange, ``min_numel``, residuals by parameter
    name (and the scatter owners' by bucket), stats, checkpoint."""

    def __init__(self, threshold=0.5, process_group=None, *, rule=None, block=None, blocks=None,
                 min_numel=0, exchange="allgather", fallback=None):
        super().__init__(threshold, min_numel=min_numel, rule=rule, block=block, blocks=blocks,
                         bucket_bytes=0, exchange=exchange, fallback=fallback,
                         rank_size=self._dist_rank_size)
        self.process_group = process_group
        self.names = {}  # id(parameter) -> its name
        self._ddp_buckets = {}  # the members' names -> _Bucket
        self._bound_to = {}  # name -> the _Bucket whose flat residual holds its residual now

    def _dist_rank_size(self):
        if not dist.is_available() or not dist.is_initialized():
            return 0, 1
        return dist.get_rank(self.process_group), dist.get_world_size(self.process_group)

    # ------------------------------------------------------------ the fallback's collectives
    def measure(self, group, device):
        """The fallback's :class:`~horovod_twobit.state.fallback.Link`, measured with
        ``torch.distributed``'s collectives as the Horovod path measures it with Horovod's."""
        pg, N = self.process_group, group.size()
        xs = {n: torch.zeros(n, dtype=torch.float32, device=device)
              for n in (1, fallback.BIG, fallback.allgather_values(N))}

        def allreduce(values, i):
            dist.all_reduce(xs[values], group=pg)

        def allgather(values, i):
            dist.all_gather([torch.empty_like(xs[values]) for _ in range(N)], xs[values],
                            group=pg)
        got = fallback.figures(N, allreduce, lambda n: checked.codec_seconds(
            device, self.threshold, N, n), allgather=allgather if N > 1 else None)
        return fallback.Link(*self.broadcaster(group, device)(got, "twobit.link.figures"))

    def broadcaster(self, group, device=None):
        """``broadcast(floats, name)``: the group's first rank's floats, on every rank."""
        pg = self.process_group

        def broadcast(values, name):
            x = torch.tensor(values, dtype=torch.float64, device=device)
            src = 0 if pg is None else dist.get_global_rank(pg, 0)
            dist.broadcast(x, src, group=pg)
            return x.tolist()
        return broadcast

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
            b = _Bucket(self, names, params)
            self._forget([k for k in self._ddp_buckets if not set(k).isdisjoint(names)])
            self._ddp_buckets[names] = b
        return b

    def _forget(self, keys):
        """Drops buckets DDP no longer uses (it rebuilds them after the first iteration), and
        their stats, so that ``stats()`` shows the buckets in use."""
        log = self.stats_log
        for k in keys:
            old = self._ddp_buckets.pop(k)
            with log._lock:
                log._last.pop(old.key, None)


class _Group:
    """The process group as the fallback's decision asks for it (a Horovod process set's
    ``size()`` and ``process_set_id``)."""

    def __init__(self, pg):
        self.pg = pg
        self.process_set_id = 0 if pg is None else id(pg)

    def size(self):
        return dist.get_world_size(self.pg)


class _Bucket:
    """One DDP bucket's members, the layout of those it compresses, and the flat buffers the
    codec works in. ``names``/``layout``: the compressed members (``layout`` None when none is);
    ``plain``: the indices, among all members, of those summed uncompressed."""

    def __init__(self, state, names, params):
        self.state, self.numels = state, [p.numel() for p in params]
        packed = [i for i, p in enumerate(params)
                  if p.is_floating_point() and p.numel() >= state.min_numel]
        self.packed = packed
        self.plain = sorted(set(range(len(params))) - set(packed))
        self.names = [names[i] for i in packed]
        self.layout = (Layout([self.numels[i] for i in packed], state.threshold == "auto",
                              state.block, state.blocks) if packed else None)
        self.key = scatter_wire.owner_key(self.names) if packed else None
        self.r = self.g = None
        self._g_views = None  # the members' slices of g (the codec's layout, padded per member)
        self._generation = None
        self._exchanges = {}  # number of ranks -> (exchange, its Chunks or None)
        self._sent_bytes = {}
        self.owner_scratch = None  # the scatter exchange's owner buffer, kept from step to step
        self.steps, self.step_norms = 0, None  # what the stats' norms reader looks at
        self.norms = stats_read.bucket_norms(self)
        # the registry generation in which the residual is known to be zero (the fallback's
        # last step sent every member), else None
        self.zero_residual = None

    def exchange(self, nranks):
        """("allgather", None) or ("scatter", its Chunks) for ``nranks`` ranks, as the Horovod
        path's buckets decide it (:func:`horovod_twobit.wire.scatter.choose`: the same on every
        rank)."""
        if nranks not in self._exchanges:
            name = scatter_wire.choose(self.state.exchange, self.layout, nranks)
            self._exchanges[nranks] = (name, scatter_wire.Chunks(self.layout, nranks)
                                       if name == "scatter" else None)
        return self._exchanges[nranks]

    def sent_bytes(self, nranks, rank, exchange):
        k = (nranks, rank, exchange)
        if k not in self._sent_bytes:
            self._sent_bytes[k] = scatter_wire.rank_bytes(self.layout, nranks, rank, exchange)
        return self._sent_bytes[k]

    def scratch(self, words, device):
        """The owner's buffer of :func:`owner_codec.scratch_values` values (zero past the
        chunk's words, as ``owner_reduce`` leaves it)."""
        n = owner_codec.scratch_values(words)
        x = self.owner_scratch
        if x is None or x.numel() != n or x.device != device:
            x = self.owner_scratch = torch.zeros(n, device=device)
        return x

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

    def gradient(self, parts):
        """The compressed members' gradients (``parts``: every member's slice of DDP's buffer)
        as the codec's flat float32 buffer (padded per member)."""
        if self.layout.single:
            return parts[self.packed[0]].to(torch.float32, copy=True)
        torch._foreach_copy_(self._g_views, [parts[i] for i in self.packed])
        return self.g

    def result(self, flat, parts):
        """Copies the finished flat result of the compressed members back into DDP's buffer."""
        if self.layout.single:
            parts[self.packed[0]].copy_(flat)
        else:
            torch._foreach_copy_([parts[i] for i in self.packed], self._g_views)


def twobit_hook(state, bucket):
    """DDP's communication hook (``model.register_comm_hook(state, twobit_hook)``): returns a
    future of the bucket's buffer holding the average of every rank's 2-bit-compressed gradients,
    this rank's residuals committed (parameters under ``min_numel``: their plain average)."""
    buffer = bucket.buffer()
    b = state._bucket(bucket.parameters())
    pg = state.process_group
    nranks, rank = dist.get_world_size(pg), dist.get_rank(pg)
    parts = buffer.split(b.numels)
    futures = []
    if b.plain:  # issued first, on every rank alike
        summed = torch.cat([parts[i] for i in b.plain])
        futures.append(dist.all_reduce(summed, group=pg, async_op=True).get_future())
    if b.layout is not None:
        futures.append(_compressed(state, b, parts, pg, nranks, rank))

    def finish(fut):
        done = fut.value() if len(futures) > 1 else [fut]
        if b.plain:
            total = done[0].value()[0]
            total.div_(torch.tensor(float(nranks), dtype=total.dtype, device=total.device))
            torch._foreach_copy_([parts[i] for i in b.plain], total.split(
                [b.numels[i] for i in b.plain]))
        if b.layout is not None:
            b.result(done[-1].value(), parts)
        return buffer

    fut = futures[0] if len(futures) == 1 else torch.futures.collect_all(futures)
    return fut.then(finish)


def _compressed(state, b, parts, pg, nranks, rank):
    """Encodes the bucket's compressed members and starts their exchange (or, where the
    fallback sends them plain, their allreduce): a future of the flat float32 result, this
    rank's residuals committed when it is done."""
    lay = b.layout
    r = b.residual(parts[0].device)
    g = b.gradient(parts)
    if state.fallback and state.plain(b, _Group(pg), g.device, time.perf_counter()):
        return _plain(state, b, r, g, pg, nranks)
    b.zero_residual = None
    return _encoded(state, b, r, g, pg, nranks, rank)


def _plain(state, b, r, g, pg, nranks):
    """The fallback: the members' g + r (g alone while the residual is known to be zero) summed
    by one ``all_reduce``, divided by the number of ranks; the residuals become zero, but a
    member that held NaN or Inf on some rank gets NaN and keeps its residual."""
    lay, reg = b.layout, state.residuals
    zero = b.zero_residual == reg.generation
    sent = g if zero else g.add_(r)  # g: the bucket's own copy of the gradients
    values = sum(lay.numels)
    state.stats_log.sent(b.key, b.names, "plain", 4 * sent.numel(), lambda: (values, 0.0, 0),
                         values, b.norms)
    fut = dist.all_reduce(sent, group=pg, async_op=True).get_future()

    def finish(_):
        sent.div_(torch.tensor(float(nranks), dtype=sent.dtype, device=sent.device))
        nonfinite = not bool(torch.isfinite(sent).all())
        if not nonfinite:
            if not zero:
                r.zero_()
            b.zero_residual = reg.generation
        else:
            for s, n in zip(lay.starts, lay.numels):
                if bool(torch.isfinite(sent[s:s + n]).all()):
                    r[s:s + n].zero_()
                else:
                    sent[s:s + n] = float("nan")
            if not zero:
                b.zero_residual = None
        state.stats_log.finished(nonfinite)
        b.steps += 1
        return sent
    return fut.then(finish)


def _encoded(state, b, r, g, pg, nranks, rank):
    """The compressed exchange of the bucket's members."""
    lay = b.layout
    payload = torch.empty(lay.payload_words, dtype=torch.int32, device=g.device)
    t, v = codec.encode_payload(lay, r, g, state.threshold, state.auto_rule, payload)
    exchange, chunks = b.exchange(nranks)
    state.stats_log.sent(b.key, b.names, exchange, b.sent_bytes(nranks, rank, exchange),
                         lambda: stats.payload_counts(lay, payload.cpu().numpy(), state.threshold),
                         sum(lay.numels), b.norms)
    if exchange == "scatter":
        fut, gathered, bad = _scatter(state, b, chunks, payload, pg, nranks, rank)
    else:
        gathered = [torch.empty_like(payload) for _ in range(nranks)]
        fut = dist.all_gather(gathered, payload, group=pg, async_op=True).get_future()

    def finish(_):
        if exchange == "scatter":
            flat = scatter_codec.finish_reduced(chunks, gathered(), b.names, r, g, t, v, bad,
                                                nranks, 1.0)
            nonfinite = any(bad)
        else:
            flat, nonfinite = codec.finish_payload(lay, torch.cat(gathered), nranks, b.names, r,
                                                   g, t, v, nranks, 1.0)
        state.stats_log.finished(nonfinite)
        b.steps += 1
        return flat

    return fut.then(finish)


def _scatter(state, b, chunks, payload, pg, nranks, rank):
    """Phase 1 of the scatter exchange (waited for here) and phase 2's ``all_gather`` (started):
    (its future, a function giving every owner's reduced chunk end to end once it is done, the
    members that held NaN or Inf on some rank)."""
    lay, dev = b.layout, payload.device
    agreement = (tuple(b.names), nranks)
    if agreement not in state.agreed:  # once per bucket and number of ranks
        plan = torch.tensor(lay.plan(state.threshold), dtype=torch.int32, device=dev)
        plans = [torch.empty_like(plan) for _ in range(nranks)]
        dist.all_gather(plans, plan, group=pg)
        codec.check_plans(lay, torch.cat(plans), nranks, b.names)
        state.agreed.add(agreement)
    send, splits = scatter_codec.chunk_payloads(chunks, payload, state.threshold)
    mine = [chunks.sent_words(rank)] * nranks
    received = torch.empty(sum(mine), dtype=torch.int32, device=dev)
    dist.all_to_all_single(received, send, mine, splits.tolist(), group=pg)
    residual = None
    if lay.auto:
        residual = state.owner_residual(b.key, chunks.values(rank), dev, rank, nranks)
    reduced, bad = scatter_codec.owner_reduce(chunks, received, mine, b.names, rank,
                                              state.threshold, state.auto_rule, residual,
                                              b.scratch(chunks.words(rank), dev))
    # all_gather takes tensors of one size: each owner's reduced chunk padded to the longest
    lengths = [chunks.reduced_words(c) for c in range(nranks)]
    sent = reduced.new_zeros(max(lengths))
    sent[:reduced.numel()] = reduced
    parts = [torch.empty_like(sent) for _ in range(nranks)]
    fut = dist.all_gather(parts, sent, group=pg, async_op=True).get_future()
    return fut, lambda: torch.cat([x[:n] for x, n in zip(parts, lengths)]), bad


def register(model, state, hook=twobit_hook):
    """Names ``model``'s parameters in ``state`` and registers ``hook`` on the DDP ``model``."""
    state.name_parameters(model.named_parameters())
    model.register_comm_hook(state, hook)
    return state


def shutdown(process_group=None, timeout=10.0):
    """Ends torch.distributed on every rank at the end of a job that trained with the hook, in
    place of ``dist.destroy_process_group()``: a barrier, then a wait (at most ``timeout``
    seconds) until gloo's worker threads wait for work, then ``destroy_process_group``.

    A gloo thread completes a collective, wakes the rank that waits for it, and only then frees
    what the collective held: the hook's Python callbacks and the tensors that Python let go of
    first, both of which take the GIL. If the rank reaches the interpreter's exit in the meantime,
    the thread aborts the process ("terminate called without an active exception"); if it frees
    the process group while holding the GIL (the DDP model freed as ``main()`` returns), the rank
    hangs. DDP's own Python hooks (fp16, PowerSGD) do the same on gloo, and the barrier's own
    work holds the collectives before it; hence the wait, with the GIL released."""
    dist.barrier(group=process_group)
    _wait_gloo_idle(timeout)
    dist.destroy_process_group(process_group)


_FUTEX = {"x86_64": "202", "aarch64": "98", "arm64": "98"}


def _gloo_threads_idle(pid="self"):
    """True when every gloo worker thread of process ``pid`` waits for work (in an untimed futex
    wait; one that runs, or waits for the GIL with its timed wait, is not idle); None where
    /proc cannot tell or there are none."""
    import glob
    import platform
    futex = _FUTEX.get(platform.machine())
    tasks = glob.glob("/proc/%s/task/*" % pid)
    if futex is None or not tasks:
        return None
    seen = False
    for task in tasks:
        try:
            with open(task + "/comm") as f:
                if f.read().strip() != "pt_gloo_runloop":
                    continue
            with open(task + "/syscall") as f:
                call = f.read().split()
        except OSError:  # the thread ended
            continue
        seen = True
        if len(call) < 5 or call[0] != futex or int(call[4], 16) != 0:
            return False
    return True if seen else None


def _wait_gloo_idle(timeout):
    deadline = time.monotonic() + timeout
    calm = 0
    while time.monotonic() < deadline:
        idle = _gloo_threads_idle()
        if idle is None:  # no /proc, or no gloo threads found by name: a pause instead
            time.sleep(0.2)
            return
        calm = calm + 1 if idle else 0
        if calm == 3:  # three looks in a row, 5 ms apart
            return
        time.sleep(0.005)
