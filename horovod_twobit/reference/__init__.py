"""NumPy reference implementation of the 2-bit scheme: the oracle the tests compare against.

Written for clarity, not speed: the codec (:mod:`horovod_twobit.reference.codec`, whose names this
module re-exports) follows MXNet's ``quantize_2bit`` / ``dequantize_2bit`` kernels value by value
in float32, so its bits are MXNet's bits; :class:`Workers` simulates N ranks with it, through the
allgather exchange here or the scatter exchange of :mod:`horovod_twobit.reference.scatter`.
"""

import numpy as np

from horovod_twobit.reference import scatter as reference_scatter
from horovod_twobit.wire import scatter as scatter_wire
from horovod_twobit import wire
from horovod_twobit.wire.layout import Layout
from horovod_twobit.reference.codec import (AUTO_RULES, DEFAULT_RULE, FLT_MIN, OPT_MULTIPLES,
    auto_levels, auto_threshold, block_levels, decode, encode, lsq_scores, pack, per_value,
    quantize, ternary_errors, unpack)


def aggregate(decoded, op="average", prescale=1.0, postscale=1.0):
    """Sums decoded float32 arrays in rank order, then applies the op as the communicator does:
    divide by the number of ranks for ``average``, then multiply by prescale * postscale when that
    product is not 1."""
    out = np.zeros_like(decoded[0], dtype=np.float32)
    for d in decoded:
        out += d
    if op == "average":
        out /= np.float32(len(decoded))
    scale = float(prescale) * float(postscale)
    if scale != 1.0:
        out *= np.float32(scale)
    return out


class Workers:
    """N simulated workers with one residual per tensor name each: what N ranks of the real
    communicator compute, step by step. ``threshold`` may be ``"auto"`` (each rank picks its own
    levels every step, with ``rule``: per block of :func:`horovod_twobit.wire.block_of` values with
    :func:`block_levels`, or with :func:`auto_levels` for a tensor of one block; ``block`` and
    ``blocks`` as :class:`horovod_twobit.torch.TwoBitCompressor` takes them).
    ``last_thresholds[name]``: the value each rank put in its header at the last step (the
    magnitude it sent; with blocks, the array of block magnitudes); ``last_levels[name]``: each
    rank's (threshold, magnitude). ``exchange``: ``"allgather"`` (every rank decodes every
    payload), ``"scatter"`` (see :func:`Workers.bucket`) or ``"auto"`` (per bucket, whichever
    sends fewer bytes); ``owner_residuals[rank]``: each owner's residuals, keyed by bucket."""

    def __init__(self, nranks, threshold, rule=DEFAULT_RULE, block=None, blocks=None,
                 exchange="allgather"):
        self.nranks = nranks
        self.threshold = threshold
        self.rule = rule
        self.block, self.blocks = wire.validate_blocks(threshold, block, blocks)
        self.exchange = scatter_wire.validate_exchange(exchange)
        self.residuals = [dict() for _ in range(nranks)]
        self.owner_residuals = [dict() for _ in range(nranks)]
        self.last_thresholds = {}
        self.last_levels = {}

    def _encode(self, rank, name, g):
        """One rank's error-feedback step for one tensor: (codes, per-value magnitudes)."""
        r = self.residuals[rank].setdefault(name, np.zeros(g.size, dtype=np.float32))
        block = wire.block_of(g.size, self.block, self.blocks)  # None for numeric thresholds
        t = v = self.threshold
        if block:  # "auto" only
            t, v = block_levels(r + g, block, self.rule)
        elif t == "auto":
            t, v = auto_levels(r + g, self.rule)
        self.last_levels.setdefault(name, [None] * self.nranks)[rank] = (t, v)
        if block:
            t, v = per_value(t, block, g.size), per_value(v, block, g.size)
        codes = quantize(g, r, t, v)
        return codes, np.broadcast_to(np.asarray(v, dtype=np.float32), (g.size,))

    def allreduce(self, name, grads, op="average", prescale=1.0, postscale=1.0):
        """``grads``: one array per rank. Returns the aggregated float32 array (same shape)."""
        if self.exchange != "allgather":
            return self.bucket([name], [[g] for g in grads], op, prescale, postscale)[0]
        return self._allgather(name, grads, op, prescale, postscale)

    def _allgather(self, name, grads, op, prescale, postscale):
        shape = np.shape(grads[0])
        flat = [np.asarray(g, dtype=np.float32).reshape(-1) for g in grads]
        if not all(np.isfinite(g).all() for g in flat):
            # A non-finite gradient anywhere: every rank gets NaN, no residual changes.
            for rank, g in enumerate(flat):
                self.residuals[rank].setdefault(name, np.zeros(g.size, dtype=np.float32))
            return np.full(shape, np.nan, dtype=np.float32)
        self.last_levels[name] = [None] * self.nranks
        decoded = []
        for rank, g in enumerate(flat):
            codes, v = self._encode(rank, name, g)
            decoded.append(decode(pack(codes), g.size, v))
        self.last_thresholds[name] = [v for _, v in self.last_levels[name]]
        return aggregate(decoded, op, prescale, postscale).reshape(shape)

    def bucket(self, names, grads, op="average", prescale=1.0, postscale=1.0):
        """One step of a bucket of tensors (``grads[rank][member]``); returns each member's
        result. With the allgather exchange each member's result is what it gets alone; with the
        scatter exchange see :func:`horovod_twobit.reference.scatter.exchange`."""
        numels = [np.size(g) for g in grads[0]]
        layout = Layout(numels, self.threshold == "auto", self.block, self.blocks)
        if scatter_wire.choose(self.exchange, layout, self.nranks) == "allgather":
            return [self._allgather(n, [g[i] for g in grads], op, prescale, postscale)
                    for i, n in enumerate(names)]
        return reference_scatter.exchange(self, layout, names, grads, op, prescale, postscale)

    def plain(self, names, grads, op="average", prescale=1.0, postscale=1.0, direct=False):
        """One step of a bucket sent uncompressed (the fallback): each member's g + r summed
        over the ranks in rank order, the op applied, and every rank's residual of that member
        set to zero. A member whose gradient held NaN or Inf on any rank gets NaN and keeps its
        residuals. (Horovod's ring sums in its own order: equal to this for 2 ranks.)

        ``direct=True``: the step of a bucket settled plain whose residuals are zero, which
        goes to Horovod's own allreduce as without a compressor: the same sums, but a value
        that is not finite stays as the sums give it (NaN or Inf, value by value), and the
        residuals stay zero."""
        N, out = self.nranks, []
        for i, name in enumerate(names):
            shape = np.shape(grads[0][i])
            xs = []
            for rank in range(N):
                g = np.asarray(grads[rank][i], dtype=np.float32).reshape(-1)
                res = self.residuals[rank].setdefault(name, np.zeros(g.size, dtype=np.float32))
                xs.append(g + res)
            finite = all(np.isfinite(x).all() for x in xs)
            if direct:
                assert not any(self.residuals[rank][name].any() for rank in range(N)), \
                    "a direct step needs zero residuals"
            elif not finite:
                out.append(np.full(shape, np.nan, dtype=np.float32))
                continue
            total = np.zeros_like(xs[0])
            for x in xs:
                total += x
            scale = np.float32(float(prescale) * float(postscale))
            if scale != 1:
                total *= scale
            if op == "average":
                total /= np.float32(N)
            if finite:
                for rank in range(N):
                    self.residuals[rank][name][:] = 0
            out.append(total.reshape(shape))
        return out
