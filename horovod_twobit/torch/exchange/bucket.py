"""The communicator: buckets of tensors go through one encode, one allgather and one finish.

A gradient's route: the router hands it to a :class:`Bucket` (a planned one, or a bucket of its
own); when every member of the bucket has arrived, :class:`Flight` encodes them into one payload
(``codec.encode_payload``), allgathers it, and on the first wait checks every rank's payload, sums
the decoded payloads in rank order and commits the residuals (``codec.finish_payload``). Every rank
runs the same arithmetic on the same bytes, so results are bitwise identical everywhere, and each
tensor's result is what it would get alone: members keep their own residual, threshold and blocks.
A tensor whose gradient held NaN or Inf on any rank gets NaN on every rank and keeps its residual.

Bucket membership is fixed before any gradient exists (:mod:`horovod_twobit.torch.buckets`), so it
cannot depend on the order in which gradients become ready.
"""

import threading
import time
import warnings

import torch

import horovod.torch.mpi_ops as mpi_ops

from horovod_twobit.wire import scatter as scatter_wire
from horovod_twobit.wire.layout import Layout
from horovod_twobit.torch.codec import stats as stats_read
from horovod_twobit.torch import codec
from horovod_twobit.torch.exchange.allgather import Flight
from horovod_twobit.torch.exchange.horovod_ops import own as horovod
from horovod_twobit.torch.exchange.plain import PlainFlight, StreamFlight
from horovod_twobit.torch.exchange.scatter import ScatterFlight

_split = codec.split_single  # the single-tensor payload parser (tests use it by this name)


class Bucket:
    """Named tensors that share one flat residual buffer and one collective per step.

    A bucket of one tensor uses that tensor's residual and memory as they are (no copies) and
    sends the single-tensor payload; a bucket of several copies the gradients into one flat
    float32 buffer, whose slices are the members' residuals in the compressor's registry."""

    def __init__(self, state, names, numels):
        self.state = state
        self.names = list(names)
        # Horovod's names for this bucket's collectives, one shape and one kind of collective
        # each: Horovod's response cache keys on the name alone and renegotiates on every rank
        # when a cached name comes with another shape or collective. A member sent alone in a
        # plain step goes under its own name, as Horovod's optimizer sends it when the
        # optimizer hands its gradients over (router._OptimizerCompression); the bucket's g + r
        # as one flat buffer, and the compressed payloads, under names of their own.
        self.plain_sum_name = self.names[0] + ".plain_sum"
        self.wire_name = self.names[0] + ".twobit"
        self.index = {n: i for i, n in enumerate(self.names)}
        c = state
        self.layout = Layout(numels, c.threshold == "auto", c.block, c.blocks)
        self._r = self._g = None
        self._views = None  # (members' shapes, views of _g shaped as them)
        self._bound = None  # the registry generation the residual views belong to
        self._lock = threading.Lock()
        self._round = None  # the step whose members are arriving
        self._started = None  # when its first member arrived (time.perf_counter)
        # the registry generation in which the residual is known to be zero (after a plain step
        # that sent every member), else None: the next plain step then sends g alone
        self.zero_residual = None
        self._flight = None  # the last step sent
        # (registry generation, call) from which this bucket's steps are Horovod's own allreduce
        # of each member's g, as without a compressor (:meth:`send_direct`): its mode is settled
        # plain and its residual zero. None until then.
        self.direct = None
        self.seen = None  # (process set, device) of its last launch that asked the fallback
        self._exchanges = {}  # number of ranks -> (exchange, its Chunks or None)
        self.owner_scratch = None  # the scatter exchange's "auto" owner buffer (ScatterFlight)
        # for the stats: its key, real values, bytes per (ranks, rank, exchange), residual norms
        self.key, self.values = scatter_wire.owner_key(self.names), sum(self.layout.numels)
        self._sent_bytes = {}
        self.norms = stats_read.bucket_norms(self)
        self.steps = 0  # steps finished
        self.step_norms = None  # (registry generation, step, norms) kept by a step after a read
        self._stats_read = 0  # the compressor's stats_reads its last such step answered

    def prepares_stats(self):
        """Whether this step should prepare the stats (the first since a ``stats()`` call)."""
        reads = self.state.stats_reads
        if reads == self._stats_read:
            return False
        self._stats_read = reads
        return True

    def residual(self, tensors):
        """This bucket's flat float32 residual, its members' residuals in the registry."""
        reg = self.state.residuals
        if self.layout.single:
            return reg.get(self.names[0], tensors[0]).view(-1)
        dev = tensors[0].device
        if self._r is None or self._r.device != dev:
            self._r = torch.zeros(self.layout.values, dtype=torch.float32, device=dev)
            self._g = torch.zeros(self.layout.values, dtype=torch.float32, device=dev)
            self._bound = self._views = None
        if self._bound != reg.generation:
            for name, view in zip(self.names, self._slices(self._r, [t.shape for t in tensors])):
                reg.bind(name, view)
            self._bound = reg.generation
        return self._r

    def current_residual(self):
        """This bucket's flat residual if it holds the registry's current residuals, else None
        (after a reset or a load, until the bucket's next step)."""
        reg = self.state.residuals
        if self.layout.single:
            return reg.lookup(self.names[0])
        return self._r if self._bound == reg.generation else None

    def views(self, tensors):
        """The members' slices of the flat gradient buffer, shaped as ``tensors`` (made once)."""
        shapes = tuple(t.shape for t in tensors)
        if self._views is None or self._views[0] != shapes:
            self._views = (shapes, self._slices(self._g, shapes))
        return self._views[1]

    def _slices(self, flat, shapes):
        return [flat[s:s + n].view(shape) for shape, s, n in
                zip(shapes, self.layout.starts, self.layout.numels)]

    def arrive(self, tensor, name, call):
        """Takes one member's gradient; launches the bucket when the last one arrives. Returns
        the member's handle."""
        with self._lock:
            rnd = self._round
            if rnd is None:
                rnd = self._round = _Round(self, call)
                self._started = time.perf_counter()
                rnd.decided = self.decide(call[3], tensor.device)
                gen = self.state.residuals.generation
                if rnd.decided and self.zero_residual == gen:
                    rnd.stream = self._stream(call)
                    rnd.settled = self.state.settled_plain(self, call[3])
            elif name in rnd.arrived:
                raise RuntimeError("tensor %r was submitted twice before its bucket was sent: "
                                   "wait for its handle before submitting it again" % name)
            elif call != rnd.call:
                raise ValueError("the tensors of one bucket must share op, scale factors and "
                                 "process set (%r differs): pass bucket_bytes=0" % name)
            rnd.arrived[name] = tensor
            if rnd.stream is not None:
                rnd.stream.add(self.index[name], tensor)
            if len(rnd.arrived) == len(self.names):
                self._round = None
                if rnd.stream is not None:
                    rnd.flight = rnd.stream
                    if rnd.settled and all(t.dtype == torch.float32 and t.is_contiguous()
                                           for t in rnd.arrived.values()):
                        self._go_direct(call)
                else:
                    rnd.flight = self.launch([rnd.arrived[n] for n in self.names], *call,
                                             in_place=True, decided=rnd.decided)
            return Handle(rnd, self.index[name])

    def _go_direct(self, call):
        """From the next step on (with ``call`` and the residuals of now), Horovod's own
        allreduce: see :meth:`send_direct`."""
        self.direct = (self.state.residuals.generation, call)

    def takes_direct(self, call):
        """Whether a member submitted with ``call`` goes through :meth:`send_direct`."""
        d = self.direct
        return d is not None and d[0] == self.state.residuals.generation and d[1] == call

    def send_direct(self, tensor, name, call):
        """Sends member ``name``'s float32 gradient through Horovod's own in-place allreduce and
        returns Horovod's handle, as without a compressor: the bucket's mode is settled plain and
        its residual zero (:attr:`direct`), so there is nothing to add, to check or to commit.
        A step whose sum is not finite gives what Horovod gives (NaN or Inf), and the residual
        stays zero. The first member of the bucket records the step in the stats."""
        if self.index[name] == 0:
            self.log_direct()
        op, prescale, postscale, process_set = call
        return horovod("allreduce_async_")(tensor, name=name, op=op,
                                           prescale_factor=prescale, postscale_factor=postscale,
                                           process_set=process_set)

    def log_direct(self):
        """Records one step of this bucket sent as Horovod's own allreduce of g (:attr:`direct`)."""
        self.steps += 1
        self.log_plain_g()

    def log_plain_g(self):
        """Records in the stats a plain step of this bucket that sends g alone (its members'
        own values: nothing sent as +-level)."""
        values = self.values
        self.state.stats_log.sent(self.key, self.names, "plain", 4 * values,
                                  lambda: (values, 0.0, 0), values, self.norms)

    def decide(self, process_set, device):
        """Whether this step goes plain, decided once per step: see the state's ``plain``."""
        c = self.state
        if not c.fallback:
            return False
        self.seen = (process_set, device)
        started, self._started = self._started or time.perf_counter(), None
        return c.plain(self, process_set, device, started)

    def _stream(self, call):
        """This step's :class:`StreamFlight`: the bucket goes plain with a zero residual."""
        prev, self._flight = self._flight, None
        if prev is not None:
            prev.wait()
        op, prescale, postscale, process_set = call
        self._flight = StreamFlight(self, op, prescale, postscale, process_set, in_place=True)
        return self._flight

    def launch(self, tensors, op, prescale, postscale, process_set, in_place, decided=None):
        prev, self._flight = self._flight, None
        if prev is not None:
            prev.wait()  # its buffers are about to be reused; it was launched, so this ends
        plain = self.decide(process_set, tensors[0].device) if decided is None else decided
        if plain:
            cls = PlainFlight
        else:
            cls = ScatterFlight if self.exchange(process_set.size())[0] == "scatter" else Flight
        self._flight = cls(self, tensors, op, prescale, postscale, process_set, in_place)
        if not plain:
            self.zero_residual = None
        elif (self.layout.single and in_place and self._flight.sum is self._flight.g
              and self.state.settled_plain(self, process_set)):
            # a tensor alone, sent in place with a zero residual
            self._go_direct((op, prescale, postscale, process_set))
        return self._flight

    def exchange(self, nranks):
        """("allgather", None) or ("scatter", the bucket's Chunks) for ``nranks`` ranks: the
        compressor's ``exchange``, "auto" decided from the layout and N alone."""
        got = self._exchanges.get(nranks)
        if got is None:
            name = scatter_wire.choose(self.state.exchange, self.layout, nranks)
            chunks = scatter_wire.Chunks(self.layout, nranks) if name == "scatter" else None
            got = self._exchanges[nranks] = (name, chunks)
        return got

    def sent_bytes(self, nranks, rank, exchange):
        """Bytes this rank hands to the collectives per step (scatter_wire's count, cached)."""
        k = (nranks, rank, exchange)
        got = self._sent_bytes.get(k)
        if got is None:
            got = self._sent_bytes[k] = scatter_wire.rank_bytes(self.layout, nranks, rank, exchange)
        return got

    def flush(self, rnd):
        """Sends the members of ``rnd`` that arrived, one by one: called when a handle of a
        bucket whose members did not all arrive is waited on (the same program does the same on
        every rank)."""
        with self._lock:
            if self._round is rnd:
                self._round = None
        missing = [n for n in self.names if n not in rnd.arrived]
        warnings.warn("horovod-twobit: tensors %s of a bucket were never submitted; sending the "
                      "other members one by one. Pass bucket_bytes=0 if the set of tensors "
                      "changes between steps" % missing[:4])
        c = self.state
        return {n: c.single(n, t).launch([t], *rnd.call, in_place=True)
                for n, t in rnd.arrived.items()}


class _Round:
    """One step of a bucket: the members that arrived, then its flight."""

    def __init__(self, bucket, call):
        self.bucket, self.call = bucket, call
        self.arrived = {}
        self.flight = None
        self.singles = None
        self.decided = False  # the fallback's decision for this step: plain
        self.stream = None  # a StreamFlight: the members sent as they arrive
        self.settled = False  # plain at every later step too (the state's settled_plain)

    def poll(self):
        return self.flight is not None and self.flight.poll()

    def result(self, index):
        if self.flight is None and self.stream is not None:
            self.flight = self.stream  # the members that arrived were sent as they did
            with self.bucket._lock:
                if self.bucket._round is self:
                    self.bucket._round = None
        if self.flight is not None:
            return self.flight.result(index)
        if self.singles is None:
            self.singles = self.bucket.flush(self)
        return self.singles[self.bucket.names[index]].result(0)


class Handle:
    """A callable handle: calling it (or ``hvd.synchronize(handle)``) waits for the collective,
    finishes the bucket and returns the result: one tensor (``index`` given), or a list."""

    def __init__(self, flight, index=None, passthrough=None, order=None):
        self._flight = flight
        self._index = index
        self._passthrough = passthrough  # Horovod handle of a group's uncompressed tensors
        self._order = order  # for mixed groups: list of ("c", i) / ("p", i)
        self._result = None
        self._done = False

    def poll(self):
        ok = self._flight is None or self._flight.poll()
        if self._passthrough is not None:
            ok = ok and mpi_ops.poll(self._passthrough)
        return ok

    def __call__(self):
        if self._done:
            return self._result
        self._done = True
        if self._index is not None:
            self._result = self._flight.result(self._index)
            return self._result
        compressed = self._flight.wait() if self._flight is not None else []
        plain = list(mpi_ops.synchronize(self._passthrough)) if self._passthrough is not None else []
        if self._order is None:
            self._result = list(compressed)
        else:
            self._result = [compressed[i] if kind == "c" else plain[i] for kind, i in self._order]
        return self._result
