"""One bucket's step through the scatter exchange (``TwoBitCompressor(..., exchange="scatter")``).

The encode is the allgather exchange's (:class:`~horovod_twobit.torch.exchange.allgather.Flight`); then

1. the payload is cut into N chunk payloads (``scatter_codec.chunk_payloads``) and sent to their
   owners with Horovod's ``alltoall``;
2. once it has arrived, this rank, owner of one chunk, checks every sender's chunk and sums them
   (``scatter_codec.owner_reduce``), and its phase-2 payload goes out with Horovod's
   ``allgather`` (:mod:`horovod_twobit.torch.exchange.progress` submits it from whichever wait comes first);
3. on the first wait every rank decodes all owners' chunks and commits its residuals
   (``scatter_codec.finish_reduced``), as the allgather exchange's finish does.

Mismatches are decided in step 2 from headers every owner receives alike, so every rank raises
the same :class:`PayloadMismatchError` and no rank submits phase 2.

Before its first step with a number of ranks (and after every elastic reset), a bucket
allgathers its plan (:func:`horovod_twobit.wire.make_plan`) under the name the allgather
exchange's payload uses, and goes on to phase 1 once every rank has sent one. A rank that uses the
allgather exchange for the same tensors (another ``exchange``, or an "auto" that decided otherwise)
submits its payload under that name instead: that collective completes, and every rank, whichever
exchange it uses, raises the same :class:`PayloadMismatchError` naming the ranks of each kind
instead of waiting forever on an alltoall the others never submit.
"""

import horovod.torch.mpi_ops as mpi_ops

import torch

from horovod_twobit.wire import scatter as scatter_wire
from horovod_twobit.torch.codec import owner as owner_codec, scatter as scatter_codec
from horovod_twobit.torch.exchange import progress
from horovod_twobit.torch import codec
from horovod_twobit.torch.exchange.allgather import Flight


class ScatterFlight(Flight):

    EXCHANGE = "scatter"

    def _submit(self, payload):
        b, c = self.bucket, self.bucket.state
        _, self.chunks = b.exchange(self.nranks)
        self.owner = self.process_set.rank()
        self.first = self.second = self.error = self.bad = None
        self.agreement = (b.names[0], self.process_set.process_set_id, self.nranks)
        if self.agreement in c.agreed:
            self._first(payload)
        else:
            self.payload = payload
            plan = torch.tensor(b.layout.plan(c.threshold), dtype=torch.int32,
                                device=payload.device)
            # under the allgather exchange's name: a rank that allgathers its payload there
            # (another exchange) meets this plan in one collective, and both raise
            self.plan = mpi_ops.allgather_async(plan, name=b.wire_name, process_set=self.process_set)
        progress.add(self)

    def _first(self, payload):
        send, splits = scatter_codec.chunk_payloads(self.chunks, payload,
                                                    self.bucket.state.threshold)
        self.first = mpi_ops.alltoall_async(send, splits=splits, name=self.bucket.wire_name,
                                            process_set=self.process_set)

    def _agree(self):
        """Phase 1 once every rank's plan has arrived; False while waiting for them."""
        if not mpi_ops.poll(self.plan):
            return False
        b = self.bucket
        try:
            codec.check_plans(b.layout, mpi_ops.synchronize(self.plan), self.nranks, b.names)
        except Exception as e:  # raised on the first wait, on every rank alike
            self.error = e
            return True
        b.state.agreed.add(self.agreement)
        self.plan = None
        self._first(self.payload)
        self.payload = None
        return True

    def advance(self):
        """Phase 2 once phase 1 has arrived; True when nothing more is to be done here."""
        if self.second is not None or self.error is not None:
            return True
        if self.first is None and not self._agree():
            return False
        if self.error is not None:
            return True
        if not mpi_ops.poll(self.first):
            return False
        b, c = self.bucket, self.bucket.state
        try:
            received, splits = mpi_ops.synchronize(self.first)
            residual = None
            if b.layout.auto:
                residual = c.owner_residual(scatter_wire.owner_key(b.names),
                                            self.chunks.values(self.owner), self.g.device,
                                            self.owner, self.nranks)
            payload, self.bad = scatter_codec.owner_reduce(
                self.chunks, received.to(self.g.device), splits.tolist(), b.names, self.owner,
                c.threshold, c.auto_rule, residual, self._scratch())
        except Exception as e:  # raised on the first wait, on every rank alike
            self.error = e
            return True
        self.second = mpi_ops.allgather_async(payload, name=b.wire_name + ".reduced",
                                              process_set=self.process_set)
        return True

    def _scratch(self):
        """The bucket's buffer for its owner's sum and counts or codes, kept from step to step: a
        new one of the chunk's size would be fresh memory every step (on a CPU, a page fault per
        4 kB: 10 K per 10 M values). ``owner_reduce`` calls run one at a time (under
        progress's lock), each is done with it when it returns, and each leaves it zero past the
        chunk's words, as the next needs it."""
        b = self.bucket
        n = owner_codec.scratch_values(self.chunks.words(self.owner))
        x = b.owner_scratch
        if x is None or x.numel() != n or x.device != self.g.device:
            x = b.owner_scratch = torch.zeros(n, device=self.g.device)
        return x

    def poll(self):
        if self.results is not None:
            return True
        progress.advance()
        return self.error is not None or (self.second is not None and mpi_ops.poll(self.second))

    def _collect(self):
        progress.wait(lambda: self.second is not None or self.error is not None)
        if self.error is not None:
            raise self.error
        progress.wait(lambda: mpi_ops.poll(self.second))
        return mpi_ops.synchronize(self.second)

    def _decode(self, gathered, divisor, out=None):
        return scatter_codec.finish_reduced(self.chunks, gathered, self.bucket.names, self.r,
                                            self.g, self.t, self.v, self.bad, divisor, self.scale,
                                            out=out), any(self.bad)
