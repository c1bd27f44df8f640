"""One bucket's step in flight through the allgather exchange: encoded, its allgather
submitted, finished on the first wait (:class:`Flight`), and the checks every collective call of
a TwoBitCompressor goes through first (:func:`check_call`).
:class:`~horovod_twobit.torch.exchange.scatter.ScatterFlight` replaces the collective."""

import torch

import horovod.torch.mpi_ops as mpi_ops

from horovod_twobit.state import stats
from horovod_twobit.torch.exchange import progress
from horovod_twobit.torch.codec import stats as stats_read
from horovod_twobit.torch import codec


def check_call(op, name):
    if op not in (mpi_ops.Average, mpi_ops.Sum):
        raise ValueError(
            "TwoBitCompressor supports op=hvd.Average and op=hvd.Sum only (got %s): use "
            "hvd.Compression.none for Adasum, Min, Max or Product" % _op_name(op))
    if name is None:
        raise ValueError(
            "TwoBitCompressor keys its residual by tensor name, and this allreduce has none: "
            "pass name='...' (a name that stays the same every step) to hvd.allreduce, or "
            "named_parameters to hvd.DistributedOptimizer")


def _op_name(op):
    for k in ("Average", "Sum", "Adasum", "Min", "Max", "Product"):
        if op == getattr(mpi_ops, k, object()):
            return "hvd." + k
    return repr(op)


class Flight:
    """One bucket's step in flight: encoded, its allgather submitted; finished on first wait.
    (:class:`~horovod_twobit.torch.exchange.scatter.ScatterFlight` replaces the collective.)"""

    EXCHANGE = "allgather"
    check = None  # the fallback's checked decision and this launch's step (Bucket.launch)

    def __init__(self, bucket, tensors, op, prescale, postscale, process_set, in_place):
        layout, c = bucket.layout, bucket.state
        self._take(bucket, tensors, op, prescale, postscale, process_set, in_place)
        payload = torch.empty(layout.payload_words, dtype=torch.int32, device=self.g.device)
        self.t, self.v = codec.encode_payload(layout, self.r, self.g, c.threshold, c.auto_rule,
                                              payload)
        self.prepares_stats = bucket.prepares_stats()
        self._stats_payload, counted = payload, []
        reader = lambda: counted[0] if counted else stats.payload_counts(  # noqa: E731
            layout, payload.cpu().numpy(), c.threshold)  # on a GPU: one copy to the host, read
        self._counted = counted
        c.stats_log.sent(bucket.key, bucket.names, self.EXCHANGE,
                         bucket.sent_bytes(self.nranks, process_set.rank(), self.EXCHANGE),
                         reader, bucket.values, bucket.norms)
        self._submit(payload)

    def _take(self, bucket, tensors, op, prescale, postscale, process_set, in_place):
        """What every flight does first: the checks, the bucket's residual and its flat
        gradient (the tensor itself when alone, else the bucket's buffer, filled)."""
        check_call(op, bucket.names[0])
        self.bucket, self.tensors, self.in_place = bucket, tensors, in_place
        self.prepares_stats = False  # whether it prepares the next stats() read (Flight sets it)
        self.op, self.scale, self.nranks = op, float(prescale) * float(postscale), process_set.size()
        self.process_set, self.results = process_set, None
        self.r = bucket.residual(tensors)
        if bucket.layout.single:
            self.g = codec.flat(tensors[0])
        else:
            self.g = bucket._g
            torch._foreach_copy_(bucket.views(tensors), [t.detach() for t in tensors])

    def _submit(self, payload):
        self.handle = mpi_ops.allgather_async(payload, name=self.bucket.wire_name,
                                              process_set=self.process_set)

    def poll(self):
        return self.results is not None or mpi_ops.poll(self.handle)

    def wait(self):
        if self.results is None:
            self._norms = None
            if self.prepares_stats and not self.poll():  # the rank would sleep: prepare now
                self._prepare_stats(self.r, self.g)
            self.results = self._finish(self._collect())
        return self.results

    def _prepare_stats(self, r, g=None):
        """What the next ``stats()`` read takes: on a CPU the payload's code counts, and the
        residual's norms: with ``g``, before the finish, of the residual it is about to commit
        (:func:`stats_read.committed_norms`, a pass over r and g: done while the collective is
        in flight), else of ``r`` as the finish left it (cheaper, but on the step's path)."""
        b, payload = self.bucket, self._stats_payload
        if payload.device.type == "cpu" and not self._counted:
            self._counted.append(stats.payload_counts(b.layout, payload.numpy(),
                                                      b.state.threshold))
        if g is None:
            self._norms = stats_read.pair(r.detach().reshape(-1))
        else:
            self._norms = stats_read.committed_norms(r, g, self.t, self.v)

    def _collect(self):
        progress.wait(lambda: mpi_ops.poll(self.handle))
        return mpi_ops.synchronize(self.handle)

    def _decode(self, gathered, divisor, out=None):
        """The flat result (into ``out``, or over the flat gradient) and the residual commit;
        returns it with whether some member held NaN or Inf."""
        b = self.bucket
        return codec.finish_payload(b.layout, gathered, self.nranks, b.names, self.r, self.g,
                                    self.t, self.v, divisor, self.scale, out=out)

    def result(self, index):
        return self.wait()[index]

    def _finish(self, gathered):
        res = self._results(gathered)
        b = self.bucket
        b.state.stats_log.finished(self.nonfinite)
        b.steps += 1
        if self.prepares_stats and not self.nonfinite:  # else read from the residuals
            if self._norms is None:  # the collective was done before the wait
                self._prepare_stats(self.r)
            stats_read.step_norms(b, self._norms)
        return res

    def _results(self, gathered):
        layout = self.bucket.layout
        divisor = self.nranks if self.op == mpi_ops.Average else 1
        if layout.single:
            t = self.tensors[0]
            own = self.in_place and t.is_contiguous() and self.g.dtype == t.dtype
            out = None if own else torch.empty(layout.values, dtype=_out_dtype(t), device=t.device)
            res, self.nonfinite = self._decode(gathered, divisor, out)
            if own:
                return [t]
            res = res.view(t.shape).to(t.dtype)
            if self.in_place:
                t.copy_(res)
                return [t]
            return [res]
        _, self.nonfinite = self._decode(gathered, divisor)  # over the flat gradient buffer
        views = self.bucket.views(self.tensors)
        if self.in_place:
            torch._foreach_copy_(self.tensors, views)
            return self.tensors
        return [v.to(t.dtype, copy=True) for v, t in zip(views, self.tensors)]


def _out_dtype(t):
    return t.dtype if t.dtype != torch.float64 else torch.float32
