"""The communicator: allgather the 2-bit payloads, decode every rank's, sum them in rank order.

Packed words cannot go through a summing allreduce, so each rank allgathers ``header + words``
(2 bits per value plus 20 bytes), checks that every rank sent a compatible payload, decodes each one
and sums them in rank order. Every rank runs the same arithmetic on the same bytes, so the result
is bitwise identical everywhere. The residual is updated only after the gather, and only when no
rank's gradient held NaN or Inf; otherwise every rank's result is NaN (so loss scalers skip the step)
and every residual stays as it was.
"""

import torch

import horovod.torch.mpi_ops as mpi_ops

from .. import wire
from . import codec, kernels


class Exchange:
    """One tensor's part of a collective: what was sent, and what is needed to finish it."""

    __slots__ = ("tensor", "name", "residual", "threshold", "magnitude", "op", "scale", "nranks",
                 "payload", "in_place", "block")

    def __init__(self, compressor, tensor, name, op, prescale, postscale, process_set, in_place):
        if op not in (mpi_ops.Average, mpi_ops.Sum):
            raise ValueError(
                "TwoBitCompressor supports op=hvd.Average and op=hvd.Sum only (got %s): use "
                "hvd.Compression.none for Adasum, Min, Max or Product" % _op_name(op))
        if name is None:
            raise ValueError(
                "TwoBitCompressor keys its residual by tensor name, and this allreduce has none: "
                "pass name='...' (a name that stays the same every step) to hvd.allreduce, or "
                "named_parameters to hvd.DistributedOptimizer")
        self.tensor = tensor
        self.name = name
        self.threshold = compressor.threshold
        self.residual = compressor.residuals.get(name, tensor)
        self.op = op
        self.scale = float(prescale) * float(postscale)
        self.nranks = process_set.size()
        self.in_place = in_place
        self.magnitude = None  # a numeric threshold is also the magnitude sent
        n = tensor.numel()
        self.block = wire.block_of(n, compressor.block, compressor.blocks)
        nb = wire.num_blocks(n, self.block)
        auto = self.threshold == "auto"
        magnitudes = None
        if auto and self.block:  # one (threshold, magnitude) per block; magnitudes follow the header
            t, magnitudes = kernels.block_levels(self.residual.view(-1), codec.flat(tensor),
                                                 self.block, compressor.auto_rule)
            self.threshold = kernels.per_word(t, self.block, n)
            self.magnitude = kernels.per_word(magnitudes, self.block, n)
        elif auto:  # chosen from r + g on this rank; the magnitude goes in the header; no host sync
            self.threshold, self.magnitude = kernels.auto_levels(
                self.residual.view(-1), codec.flat(tensor), compressor.auto_rule)
        self.payload = torch.empty(wire.HEADER_WORDS + wire.body_words(n, self.block),
                                   dtype=torch.int32, device=tensor.device)
        header = self.payload[:wire.HEADER_WORDS]  # the words are packed straight behind it
        _, nonfinite = codec.quantize_pack(tensor, self.residual, self.threshold,
                                           out=self.payload[wire.HEADER_WORDS + nb:])
        header.copy_(torch.tensor(wire.make_header(n, 1.0 if auto else self.threshold,
                                                   wire.FLAG_AUTO if auto else 0, self.block),
                                  dtype=torch.int32))
        header[1] |= nonfinite.to(torch.int32) * wire.FLAG_NONFINITE
        if magnitudes is not None:
            self.payload[wire.HEADER_WORDS:wire.HEADER_WORDS + nb] = magnitudes.view(torch.int32)
        elif auto:
            header[4] = self.magnitude.reshape(1).view(torch.int32)[0]

    def finish(self, gathered):
        """Decodes and sums the gathered payloads; commits the residual; returns the result."""
        n = self.tensor.numel()
        parts = _split(gathered, n, self.nranks, self.name, self.block)
        if any(h.nonfinite for h, _ in parts):
            out = torch.full((n,), float("nan"), dtype=torch.float32, device=self.tensor.device)
        else:
            divisor = self.nranks if self.op == mpi_ops.Average else 1
            if self.block:  # each rank's block magnitudes, then its words
                nb = wire.num_blocks(n, self.block)
                rows = [w[nb:] for _, w in parts]
                ts = [kernels.per_word(w[:nb].view(torch.float32), self.block, n) for _, w in parts]
            else:
                rows, ts = [w for _, w in parts], [h.threshold for h, _ in parts]
            g, r = codec.flat(self.tensor), self.residual.view(-1)
            if self.in_place and self.tensor.is_contiguous() and g.dtype == self.tensor.dtype:
                # g is the tensor's own memory: commit and decode in one pass, written over it
                kernels.finish(rows, ts, r, g, self.threshold, divisor, self.scale,
                               magnitude=self.magnitude)
                return self.tensor
            out_dtype = self.tensor.dtype if self.tensor.dtype != torch.float64 else torch.float32
            out = kernels.finish(rows, ts, r, g, self.threshold, divisor, self.scale,
                                 out=torch.empty(n, dtype=out_dtype, device=self.tensor.device),
                                 magnitude=self.magnitude)
        result = out.view(self.tensor.shape).to(self.tensor.dtype)
        if self.in_place:
            self.tensor.copy_(result)
            return self.tensor
        return result


def _split(gathered, numel, nranks, name, block=None):
    """[(header, body)] per rank, or PayloadMismatchError with the same message on every rank."""
    stride = wire.HEADER_WORDS + wire.body_words(numel, block)
    if gathered.numel() == nranks * stride:
        rows = gathered.view(nranks, stride)
        heads = rows[:, :wire.HEADER_WORDS].tolist()
        try:
            headers = [wire.Header(h) for h in heads]
        except wire.PayloadMismatchError:
            headers = None
        if headers is not None and all(h.numel == numel for h in headers):
            # Every header sits where this rank expects it and agrees on the size: the sequential
            # parse every rank would do visits exactly these offsets, so the decision is the same.
            wire.check_headers(headers, name)
            return [(h, rows[i, wire.HEADER_WORDS:]) for i, h in enumerate(headers)]
    wire.split_gathered(gathered.tolist(), nranks, name)  # raises the precise error
    raise wire.PayloadMismatchError("tensor %r: ranks sent incompatible payloads" % name)


def _op_name(op):
    for k in ("Average", "Sum", "Adasum", "Min", "Max", "Product"):
        if op == getattr(mpi_ops, k, object()):
            return "hvd." + k
    return repr(op)


class Handle:
    """A callable handle: calling it (or ``hvd.synchronize(handle)``) waits for the allgather,
    finishes every exchange and returns the result: one tensor, or a list for grouped calls."""

    def __init__(self, exchanges, gather_handle, grouped, passthrough=None, order=None):
        self._exchanges = exchanges
        self._gather = gather_handle
        self._grouped = grouped
        self._passthrough = passthrough  # (handle, count) of uncompressed tensors of a group
        self._order = order  # for mixed groups: list of ("c", i) / ("p", i)
        self._result = None
        self._done = False

    def poll(self):
        ok = self._gather is None or mpi_ops.poll(self._gather)
        if self._passthrough is not None:
            ok = ok and mpi_ops.poll(self._passthrough)
        return ok

    def __call__(self):
        if self._done:
            return self._result
        self._done = True
        compressed = []
        if self._gather is not None:
            gathered = _wait(self._gather)
            if not self._grouped:
                gathered = [gathered]
            compressed = [ex.finish(g) for ex, g in zip(self._exchanges, gathered)]
        if not self._grouped:
            self._result = compressed[0]
            return self._result
        plain = list(_wait(self._passthrough)) if self._passthrough is not None else []
        if self._order is None:
            self._result = compressed
        else:
            self._result = [compressed[i] if kind == "c" else plain[i] for kind, i in self._order]
        return self._result


def _wait(handle):
    return mpi_ops.synchronize(handle) if not isinstance(handle, Handle) else handle()
