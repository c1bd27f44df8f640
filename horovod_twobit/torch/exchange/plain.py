"""One bucket's step sent uncompressed: the fallback of ``TwoBitCompressor(..., fallback=...)``.

Error feedback makes the switch exact: the bucket's values g + r (its gradients plus its
residuals, float32) go through Horovod's own allreduce, so everything not yet sent is sent now,
and the residuals become zero. Nothing is lost either way, and a later step may compress again
from a zero residual. While the residuals are known to be zero (the bucket's last step went
plain) the step sends g alone, member by member as they arrive (:class:`StreamFlight`), as
Horovod's own allreduce would (the same values; a -0.0 in g stays -0.0, where g + 0.0 gives
+0.0). A step whose result is not finite (some rank's gradient held NaN or Inf) keeps the
residuals as they were, as the compressed exchanges do.
"""

import torch

from horovod_twobit.torch.exchange import progress
from horovod_twobit.torch.exchange.horovod_ops import own as horovod
from horovod_twobit.torch.exchange.allgather import Flight


class PlainFlight(Flight):
    """The bucket's g + r as one flat buffer. It waits as :class:`Flight` does, polling with
    sleeps in between (``progress.wait``), not in Horovod's own wait, which spins on
    ``sched_yield``: on a host held to a CPU quota that spinning took the CPU the collective
    needed (plain steps at 3-5x no compression's on the emulated 4-host cluster)."""

    EXCHANGE = "plain"

    def __init__(self, bucket, tensors, op, prescale, postscale, process_set, in_place):
        c = bucket.state
        self._take(bucket, tensors, op, prescale, postscale, process_set, in_place)
        # A residual known to be zero (the last step went plain and sent everything) adds
        # nothing: g itself is sent, in place where it is this bucket's own float32 buffer.
        self.zero = bucket.zero_residual == c.residuals.generation
        if not self.zero:
            self.sum = self.g.to(torch.float32) + self.r  # a new buffer: the gradient is kept
        elif bucket.layout.single and not (in_place and self.g.dtype == torch.float32
                                           and tensors[0].is_contiguous()):
            self.sum = self.g.to(torch.float32, copy=True)
        else:  # the bucket's flat buffer (filled by _take), or the tensor, reduced in place
            self.sum = self.g
        values = bucket.values
        c.stats_log.sent(bucket.key, bucket.names, self.EXCHANGE, 4 * self.sum.numel(),
                         lambda: (values, 0.0, 0), values, bucket.norms)
        self.handle = horovod("allreduce_async_")(self.sum, name=bucket.plain_sum_name, op=op,
                                               prescale_factor=prescale,
                                               postscale_factor=postscale,
                                               process_set=process_set)

    def _decode(self, summed, divisor, out=None):
        """Horovod applied the op and the scale factors. A member whose result is finite has
        its residual set to zero; one that is not (some rank's gradient held NaN or Inf) gets
        NaN and keeps its residual, as in the compressed exchanges."""
        dest = self.g if out is None else out
        if summed.data_ptr() != dest.data_ptr():
            dest.copy_(summed)
        b = self.bucket
        if bool(torch.isfinite(summed).all()):
            if not self.zero:
                self.r.zero_()
            b.zero_residual = b.state.residuals.generation
            return dest, False
        lay = b.layout
        for s, n in zip(lay.starts, lay.numels):
            if bool(torch.isfinite(summed[s:s + n]).all()):
                self.r[s:s + n].zero_()
            else:
                dest[s:s + n] = float("nan")
        if not self.zero:
            b.zero_residual = None  # a member that held NaN or Inf kept its residual
        return dest, True


class StreamFlight(PlainFlight):
    """A bucket's plain step while its residuals are known to be zero: each member goes to
    Horovod's allreduce as it arrives, as it would without a compressor (Horovod fuses them in
    its own cycles, and the collective overlaps the backward pass); a float32 member in place.
    Nothing to add, nothing to commit: a member whose result is not finite gets NaN, and its
    residual stays zero."""

    def __init__(self, bucket, op, prescale, postscale, process_set, in_place):
        self.bucket, self.op, self.in_place = bucket, op, in_place
        self.scale, self.nranks = float(prescale) * float(postscale), process_set.size()
        self.process_set, self.results, self.prepares_stats = process_set, None, False
        self.call = (op, prescale, postscale, process_set)
        n = len(bucket.names)
        self.tensors, self.sums, self.handles = [None] * n, [None] * n, [None] * n
        self._names, self._allreduce = bucket.names, horovod("allreduce_async_")
        bucket.log_plain_g()

    def add(self, index, tensor):
        """Sends member ``index``'s gradient now: a float32 one in place, as Horovod's own
        allreduce would (called directly, so the router's mark on it does not matter), others
        as a float32 copy. This runs once per member on the backward pass, where each
        microsecond delays the member's collective: keep it short."""
        own = self.in_place and tensor.dtype == torch.float32 and tensor.is_contiguous()
        x = tensor if own else tensor.detach().to(torch.float32, copy=True)
        self.tensors[index], self.sums[index] = tensor, (x, own)
        op, prescale, postscale, process_set = self.call
        self.handles[index] = self._allreduce(x, name=self._names[index], op=op,
                                              prescale_factor=prescale,
                                              postscale_factor=postscale, process_set=process_set)

    def poll(self):
        poll = horovod("poll")
        return self.results is not None or all(h is None or poll(h) for h in self.handles)

    def wait(self):
        if self.results is None:
            progress.wait(self.poll)  # sleeping between polls, not spinning (PlainFlight)
            sent = [i for i, h in enumerate(self.handles) if h is not None]
            synchronize = horovod("synchronize")
            for i in sent:
                synchronize(self.handles[i])
            # one check for the bucket (a norm is finite only if its values are; one that
            # overflows is checked member by member), then each member only if it failed
            xs = [self.sums[i][0] for i in sent]
            norms = torch.stack(torch._foreach_norm(xs)) if xs else None
            suspect = norms is not None and not bool(torch.isfinite(norms).all())
            out, nonfinite = [None] * len(self.handles), False
            for i in sent:
                t, (x, own) = self.tensors[i], self.sums[i]
                if suspect and not bool(torch.isfinite(x).all()):
                    x.fill_(float("nan"))
                    nonfinite = True
                if own:
                    x = t
                elif self.in_place:
                    t.copy_(x.view(t.shape))
                    x = t
                else:
                    x = x.view(t.shape).to(t.dtype if t.dtype != torch.float64 else torch.float32)
                out[i] = x
            self.nonfinite = nonfinite
            b = self.bucket
            b.state.stats_log.finished(nonfinite)
            b.steps += 1
            self.results = out
        return self.results
