"""``TwoBitCompressor``: MXNet's 2-bit compression with error feedback, as a Horovod compressor."""

import threading
import warnings

import torch

from horovod.torch.compression import Compressor

from .. import layout, scatter_wire, state, wire
from ..registry import ResidualRegistry
from ..fallback import decide, validate_fallback
from ..stats import StatsLog
from . import stats_read

_MARK = "_horovod_twobit"


class _Pending:
    """The context ``compress`` hands to Horovod; the router marks it when it takes the tensor."""

    __slots__ = ("compressor", "routed")

    def __init__(self, compressor):
        self.compressor = compressor
        self.routed = False


def _to_state(r):
    return r.detach().to("cpu", copy=True)


def _from_state(value, like):
    return like.copy_(torch.as_tensor(value).reshape(like.shape))


class TwoBitCompressor(Compressor):
    """2-bit gradient compression with error feedback (MXNet's ``{'type': '2bit'}``).

    What it does: for every tensor name it keeps a float32 residual r. Each step, r <- r + g; values
    with r >= t are sent as +t (code ``11``), values with r <= -t as -t (code ``10``), all others as
    0 (``00``); then r <- r - q. Sixteen values travel in one 32-bit word. Ranks allgather their
    payloads and every rank decodes and sums all of them, so nothing is lost, only delayed: what
    was not sent this step stays in the residual until it has grown past the threshold.

    Why: the bytes on the wire drop 16-fold, which speeds up communication-bound training (large
    fully connected layers, slow networks) at the cost of delaying small updates.

    Trade-offs: an extra float32 residual per tensor (the memory of the gradients once more); the
    allgather costs each rank N payloads, so traffic grows with the number of workers; the
    threshold must match the gradients' scale (MXNet's default 0.5 suits plain SGD with gradients
    of order 0.1-1; a threshold far above them delays every update).

    Use it as ``hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
    compression=TwoBitCompressor(0.5))`` or ``hvd.allreduce(t, name='t',
    compression=TwoBitCompressor(0.5))``. Creating one installs a small router around Horovod's
    allreduce entry points (see :func:`horovod_twobit.torch.install`) that sends these payloads to
    allgather + decode + sum and leaves every other tensor untouched.

    Automatic threshold: with ``threshold="auto"`` each rank chooses, for every block of a tensor
    and every step, from its error-compensated values x = r + g, a support threshold t among
    c * mean|x| (c in 0.5, 0.75, 1, 1.5, 2, 3, 4, 6, 8) and the magnitude v sent for it: values with
    |x| >= t are sent as +-v, where v is the mean of |x| over them (the least-squares value for
    that support), and the pair with the smallest squared error wins. A block is at least 64
    consecutive values, doubled until the tensor has at most 64 blocks (a tensor of 64 values or
    fewer is one block; 1 M values make blocks of 16 K). The magnitudes travel with the payload
    (float32: in the header for a single block, else after it, at most 256 bytes per tensor),
    with no extra communication round; receivers decode each sender's block with that sender's
    v. The codes and their layout are MXNet's, and the residual keeps what was not sent (x - v
    where sent, which may be negative). Why: a fixed threshold only works when it happens to
    match the gradients' scale, which differs per layer and drifts during training; tying the
    value sent to the threshold (MXNet's code) caps what a large value can send per step, a
    backlog that momentum amplifies; and one magnitude per tensor fits tensors whose rows differ
    in scale (an LSTM's gates, embeddings, output projections) badly. The rule and the block
    sizes were chosen by measurement (``examples/convergence.py``, README's "Automatic
    threshold"): with these defaults, over twelve seeds of the study, the char-LSTM's loss is
    on average 1.4 % (momentum) and 1.0 % (Adam) above fp32's, against 2-4 % and 9-12 % with one
    magnitude per tensor (``blocks=1``), and the digits MLP with Adam 0.37 points below fp32's
    accuracy (``rule="opt"`` closes that, but does not suit momentum); SGD matches fp32
    there. Cost: 2 bits per value plus at most 64 magnitudes per tensor (0.5 bits per value in
    blocks of 64 values, 0.03 in blocks of 1 K), and two extra read passes over r and g per
    step, one of them keeping 18 float64 sums per value: on a CPU three to nine fixed-threshold
    encodes (README's "Automatic threshold" has figures). ``HOROVOD_TWOBIT_AUTO_RULE`` (``lsq``,
    ``opt``, ``mean``, ``rms``, optionally ``*K``), read when the compressor is built, or the
    ``rule`` argument, selects another rule (README compares them).

    Args:
        threshold: a positive number (MXNet's default 0.5), or ``"auto"``.
        min_numel: tensors with fewer values go through Horovod's ordinary allreduce, uncompressed
            (default 0: compress everything). Small tensors (biases, norms) save few bytes but pay
            a fixed cost per call (about 0.1 ms on a CPU; see README's "Codec speed").
        rule: the rule of ``threshold="auto"``: ``"lsq"`` (default), ``"opt"`` (the threshold is
            also the magnitude), ``"mean"`` or ``"rms"``; default: ``HOROVOD_TWOBIT_AUTO_RULE``,
            else ``"lsq"``.
        block: with ``threshold="auto"``, the smallest block, a power of two of at least 16
            (default 64).
        blocks: with ``threshold="auto"``, the most blocks per tensor (default 64); the block
            size doubles from ``block`` until the tensor fits. 1: one magnitude per tensor, a
            constant 20-byte header; 0: no limit, blocks of exactly ``block`` values.
        bucket_bytes: ``hvd.DistributedOptimizer`` sends its gradients in buckets of up to this
            many bytes (default 4 MiB): one encode, one allgather and one finish per bucket
            instead of per tensor, with every tensor's result unchanged, bit for bit. Buckets
            are cut once from the parameters' order, so they are the same on every rank. 0: every
            tensor alone.
        exchange: how ranks combine their payloads. ``"allgather"`` (default): every rank
            receives every rank's payload, (N - 1) * n / 4 bytes per step for n values, growing
            with N. ``"scatter"``: each bucket is cut into N chunks; each rank receives the
            2-bit chunks of the one it owns (Horovod's alltoall), sums them, and sends the sum
            to all (allgather): the counts in ceil(log2(2N + 1)) bits per value with a numeric
            threshold (lossless), or re-encoded in 2 bits with its own residual for "auto"; about
            (N - 1) / N * (2 + b) / 8 bytes per value, flat in N. ``"auto"``: per bucket,
            whichever sends fewer bytes for its size and N. Every rank must use the same.
        fallback: ``None`` (default): always compress. ``"auto"``: at the first step (and
            after :meth:`reset`) the ranks time collectives of known size and a codec pass;
            with rank 0's figures every rank decides, per bucket, whether compression pays
            (:mod:`horovod_twobit.fallback`), and a bucket where it does not goes through
            Horovod's own allreduce as g + r, exactly, its residual then zero. ``"always"``:
            every bucket that way. Decisions are logged once (logger ``horovod_twobit``) and
            kept in :attr:`decisions` and the stats (exchange ``"plain"``).
    """

    def __init__(self, threshold=0.5, *, min_numel=0, rule=None, block=None, blocks=None,
                 bucket_bytes=None, exchange="allgather", fallback=None):
        self.threshold = wire.validate_threshold(threshold)
        self.block, self.blocks = wire.validate_blocks(self.threshold, block, blocks)
        if isinstance(min_numel, bool) or not isinstance(min_numel, int) or min_numel < 0:
            raise ValueError("min_numel must be a non-negative integer, got %r" % (min_numel,))
        self.min_numel = min_numel
        self.auto_rule = wire.auto_rule(rule)
        self.residuals = ResidualRegistry(
            zeros_like=lambda g: torch.zeros(g.shape, dtype=torch.float32, device=g.device),
            numel=lambda r: r.numel(), to_state=_to_state, from_state=_from_state)
        self.bucket_bytes = layout.validate_bucket_bytes(bucket_bytes)
        self.exchange = scatter_wire.validate_exchange(exchange)
        self.fallback = validate_fallback(fallback)
        self.decisions = {}  # (bucket key, number of ranks) -> "compressed" / "plain"
        self._links = {}  # (process set id, size) -> the measured Link
        # the residuals this rank keeps as owner of scatter chunks ("auto" only), keyed by
        # bucket, and the (rank, size) they belong to
        self.owners = ResidualRegistry(
            zeros_like=lambda g: torch.zeros(g.shape, dtype=torch.float32, device=g.device),
            numel=lambda r: r.numel(), to_state=_to_state, from_state=_from_state)
        self._owner_of = None
        # (bucket, process set, size) whose ranks all announced the scatter exchange
        self.agreed = set()
        self.stats_log = StatsLog()
        self.stats_reads = 0  # stats() calls: a bucket's next step after one prepares the next
        self._buckets = {}  # tensor name -> its planned Bucket
        self._singles = {}  # tensor name -> a Bucket of that tensor alone
        self._lock = threading.Lock()
        self._warned = threading.Event()
        from . import _routing
        _routing.install()

    def __repr__(self):
        extra = ", min_numel=%d" % self.min_numel if self.min_numel else ""
        extra += wire.auto_args_repr(self.threshold, self.auto_rule, self.block, self.blocks)
        if self.bucket_bytes != layout.DEFAULT_BUCKET_BYTES:
            extra += ", bucket_bytes=%d" % self.bucket_bytes
        if self.exchange != "allgather":
            extra += ", exchange=%r" % self.exchange
        return "TwoBitCompressor(threshold=%r%s)" % (self.threshold, extra)

    def compress(self, tensor):
        """Marks a floating-point tensor for 2-bit exchange; others pass through unchanged.

        The returned tensor is an alias of the input (no copy): the encoding needs the tensor's
        name, which Horovod gives only to the allreduce that follows."""
        if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point():
            return tensor, None
        if tensor.numel() < self.min_numel:
            return tensor, None
        if tensor.is_sparse:
            raise ValueError("TwoBitCompressor cannot compress sparse gradients: pass "
                             "sparse_as_dense=True to hvd.DistributedOptimizer")
        alias = tensor.view_as(tensor)
        ctx = _Pending(self)
        setattr(alias, _MARK, ctx)
        return alias, ctx

    def plan(self, named_parameters):
        """Assigns buckets to the gradients of ``named_parameters`` ((name, parameter) pairs in
        the order their gradients are expected to become ready): the tensors this compressor
        will compress, cut into runs of at most ``bucket_bytes`` on the same device. Called by
        ``hvd.DistributedOptimizer``; a later plan replaces an earlier one's buckets."""
        from .communicator import Bucket
        entries = [(n, p.numel(), p.numel() * p.element_size(), p.device)
                   for n, p in named_parameters
                   if p.is_floating_point() and p.numel() >= self.min_numel]
        sizes = {n: numel for n, numel, _, _ in entries}
        with self._lock:
            for names in layout.assign_buckets(entries, self.bucket_bytes):
                b = Bucket(self, names, [sizes[n] for n in names])
                self._buckets.update((n, b) for n in names)
        return self

    def bucket_of(self, name):
        """The planned bucket of tensor ``name``, or None."""
        return self._buckets.get(name)

    def single(self, name, tensor):
        """The bucket of ``tensor`` alone, under ``name``."""
        from .communicator import Bucket
        b = self._singles.get(name)
        if b is None or b.layout.numels[0] != tensor.numel():
            b = self._singles[name] = Bucket(self, [name], [tensor.numel()])
        return b

    def group_bucket(self, names, tensors):
        """The bucket of a grouped allreduce's tensors (made once per group)."""
        from .communicator import Bucket
        key = tuple(names) + tuple(t.numel() for t in tensors)
        b = self._singles.get(key)
        if b is None:
            b = self._singles[key] = Bucket(self, names, [t.numel() for t in tensors])
        return b

    def decompress(self, tensor, ctx):
        """Returns the aggregated tensor (the router already decoded it into the gradient's dtype)."""
        if isinstance(ctx, _Pending) and not ctx.routed and not self._warned.is_set():
            self._warned.set()
            warnings.warn("horovod-twobit: a TwoBitCompressor tensor went through an ordinary "
                          "allreduce, uncompressed (its result is correct). Call "
                          "horovod_twobit.torch.install() if you uninstalled the router.")
        return tensor

    def plain(self, bucket, process_set, device):
        """Whether ``bucket`` goes uncompressed with this process set (``fallback``): always,
        or where the measured link and codec say compression would not pay. Decided once per
        bucket and number of ranks, logged once, and kept in :attr:`decisions`."""
        n = process_set.size()
        return decide(self.decisions, bucket.names, bucket.layout, n, bucket.exchange(n)[0],
                      self.fallback, lambda: self.link(process_set, device))

    def link(self, process_set, device):
        """The measured :class:`horovod_twobit.fallback.Link` of this process set (rank 0's
        figures, broadcast), measured on first use."""
        key = (process_set.process_set_id, process_set.size())
        if key not in self._links:
            from .link import measure
            self._links[key] = measure(process_set, device, self.threshold)
        return self._links[key]

    def owner_residual(self, key, numel, device, rank, size):
        """This rank's residual as owner of a scatter chunk of bucket ``key`` (float32, ``numel``
        values). Owners' residuals belong to a rank and a number of ranks (their chunks move
        when either changes): on a change they restart from zero, with a warning."""
        if self._owner_of != (rank, size):
            if self._owner_of is not None and len(self.owners):
                warnings.warn("horovod-twobit: the ranks changed (this was rank %d of %d, now %d "
                              "of %d): the scatter owners' residuals restart from zero; the "
                              "workers' residuals are kept" % (*self._owner_of, rank, size))
            self.owners.reset()
            self._owner_of = (rank, size)
        return self.owners.get(key, torch.empty(numel, dtype=torch.float32, device=device))

    def stats(self, reset=False, per_tensor=False):
        """What this compressor did, as a plain dict: bytes this rank handed to the collectives
        at every bucket's last step and in total (per exchange), the fraction of values it sent
        at the last step, the threshold (with "auto": the mean of the levels it sent), the
        bucket steps whose result was NaN, and per bucket its exchange, fraction sent and
        residual norms (per tensor with ``per_tensor=True``). See
        :meth:`horovod_twobit.stats.StatsLog.snapshot` for the keys.

        Recording costs no device work, except in each bucket's first step after a call: that
        step also computes its residual's norms (three reductions, no host transfer) and, on a
        CPU, counts its payload's codes, so that a read right after it only fetches them (a host
        round trip). A read later than that computes them from the last payloads and the
        residuals. ``reset=True`` clears the running sums after reading them."""
        self.stats_reads += 1
        out = self.stats_log.snapshot(self._residual_norms, self.threshold, per_tensor)
        if reset:
            self.stats_log.reset()
        return out

    def _residual_norms(self, names):
        return stats_read.tensor_norms(self.residuals, names)

    def state_dict(self):
        """This rank's residuals (CPU copies) keyed by tensor name, with the threshold, rank and
        number of ranks they belong to, and its scatter owners' residuals keyed by bucket.
        Residuals are per rank: save one file per rank."""
        return state.make(self.threshold, *_rank_size(), self.residuals.state_dict(),
                          self.owners.state_dict())

    def load_state_dict(self, saved):
        """Restores residuals saved by :meth:`state_dict`; each is moved to its gradient's device
        on first use.

        A residual belongs to the rank that made it. If the state was saved by another rank or
        with another number of ranks, the residuals restart from zero with a warning (what was
        not yet sent is dropped: at most one threshold per value and rank)."""
        residuals = state.residuals_to_load(saved, self.threshold, *_rank_size())
        self.owners.reset()
        self._owner_of = None
        if residuals is None:
            self.residuals.reset()
        else:
            self.residuals.load_state_dict(residuals)
            self.owners.load_state_dict(state.owner_residuals_to_load(saved))
            self._owner_of = _rank_size()

    def reset(self):
        """Forgets every residual (they restart from zero), and the fallback's link
        measurements and decisions (made again at the next step)."""
        self.residuals.reset()
        self.owners.reset()
        self.agreed.clear()
        self.decisions.clear()
        self._links.clear()


def _rank_size():
    import horovod.torch as hvd
    try:
        return hvd.rank(), hvd.size()
    except ValueError:  # Horovod not initialized
        return 0, 1


def pending_of(tensor):
    """The compressor's context if ``tensor`` came from ``TwoBitCompressor.compress``, else None."""
    return getattr(tensor, _MARK, None) if isinstance(tensor, torch.Tensor) else None
