"""``TwoBitCompressor``: MXNet's 2-bit compression with error feedback, as a Horovod compressor for
TensorFlow 2 and Keras."""

import threading
import warnings

import numpy as np
import tensorflow as tf

from horovod.tensorflow.compression import Compressor

from .. import layout, scatter_wire, state, wire
from ..fallback import decide, validate_fallback
from .stats import Slots, residual_norms
from .residuals import Residuals, _Plain, rank_size  # noqa: F401 (rank_size: public here too)


class _Unrouted:
    """The context ``compress`` hands to Horovod when a tensor reaches ``compress`` at all: that only
    happens when the router is not installed, and the tensor then travels uncompressed."""

    __slots__ = ()


_UNROUTED = _Unrouted()


class TwoBitCompressor(Compressor, tf.Module):
    """2-bit gradient compression with error feedback (MXNet's ``{'type': '2bit'}``), for
    ``horovod.tensorflow`` and ``horovod.tensorflow.keras``.

    What it does: for every tensor it keeps a float32 residual r. Each step, r <- r + g; values
    with r >= t are sent as +t (code ``11``), values with r <= -t as -t (code ``10``), all others as
    0 (``00``); then r <- r - q. Sixteen values travel in one 32-bit word. Ranks allgather their
    payloads and every rank decodes and sums all of them, so nothing is lost, only delayed: what
    was not sent this step stays in the residual until it has grown past the threshold. The bytes
    are the PyTorch binding's, so both frameworks read each other's payloads.

    Why: the bytes on the wire drop 16-fold, which speeds up communication-bound training (large
    dense layers, slow networks) at the cost of delaying small updates.

    Trade-offs: an extra float32 residual per tensor (the memory of the gradients once more); the
    allgather costs each rank N payloads, so traffic grows with the number of workers; the
    threshold must match the gradients' scale (MXNet's default 0.5 suits plain SGD with gradients
    of order 0.1-1; a threshold far above them delays every update), unless it is ``"auto"``.

    Use it where Horovod takes ``compression=``: ``hvd.DistributedGradientTape(tape,
    compression=TwoBitCompressor(0.5))``, ``hvd.DistributedOptimizer(opt, compression=...)`` (the
    ``horovod.tensorflow.keras`` one for ``model.fit``) or ``hvd.allreduce(t, name='t',
    compression=...)``. Importing :mod:`horovod_twobit.tensorflow` (and creating one) installs a
    small router around Horovod's TensorFlow allreduce entry points (see
    :func:`horovod_twobit.tensorflow.install`) that sends these tensors to allgather + decode + sum
    and leaves every other tensor untouched.

    Residuals are keyed by the name of the variable a gradient belongs to (without ``:0``; give
    layers explicit names if models are rebuilt in one process and restored), or by the ``name=``
    given to ``hvd.allreduce`` (``<name>.<i>`` for ``hvd.grouped_allreduce``). They are
    ``tf.Variable`` s tracked by this module, so ``tf.train.Checkpoint(model=model, optimizer=opt,
    twobit=compressor)`` saves and restores them (one checkpoint per rank: residuals are per rank);
    :meth:`state_dict` / :meth:`load_state_dict` do the same with NumPy arrays.

    Automatic threshold: with ``threshold="auto"`` each rank chooses, per block of a tensor and
    per step, from x = r + g: a support threshold t among c * mean|x| (c in 0.5 ... 8) and the
    magnitude v sent for it (the mean of |x| over the support), the pair with the smallest squared
    error. Blocks are at least ``block`` (64) values, doubled until a tensor has at most ``blocks``
    (64) of them. The magnitudes travel with the payload (float32), with no extra communication
    round; receivers decode each sender's blocks with that sender's magnitudes. The rule, the
    block sizes and the evidence for them are the PyTorch binding's
    (:class:`horovod_twobit.torch.TwoBitCompressor`; README's "Automatic threshold"). The ``rule``
    argument, else ``HOROVOD_TWOBIT_AUTO_RULE`` read when the compressor is built (``lsq``, the
    default, ``opt``, ``mean``, ``rms``, optionally ``*K``), selects another rule
    (:attr:`auto_rule`; README compares them). The levels are
    :func:`horovod_twobit.tensorflow.auto_levels` and
    :func:`horovod_twobit.tensorflow.codec.block_levels`, bit for bit the NumPy reference's and the
    PyTorch binding's, so both frameworks interoperate in "auto" mode too. They cost two extra
    read passes over r and g per step (float64 reductions; on a CPU three to nine fixed-threshold
    encodes).

    Args:
        threshold: a positive number (MXNet's default 0.5), or ``"auto"``.
        name: the module's name.
        rule: the rule of ``threshold="auto"``: ``"lsq"`` (default), ``"opt"``, ``"mean"`` or
            ``"rms"``; default: ``HOROVOD_TWOBIT_AUTO_RULE``, else ``"lsq"``.
        block: with ``threshold="auto"``, the smallest block, a power of two of at least 16
            (default 64).
        blocks: with ``threshold="auto"``, the most blocks per tensor (default 64); 1: one
            magnitude per tensor; 0: no limit, blocks of exactly ``block`` values.
        bucket_bytes: ``hvd.DistributedGradientTape`` and the ``DistributedOptimizer`` s send the
            gradients in buckets of up to this many bytes (default 4 MiB): one encode, one
            allgather and one finish per bucket instead of per tensor, every tensor's result
            unchanged, bit for bit. 0: every tensor alone. ``hvd.grouped_allreduce`` sends its
            group as one bucket.
        exchange: how ranks combine their payloads, as in the PyTorch binding. ``"allgather"``
            (default): every rank receives every rank's payload, traffic growing with N.
            ``"scatter"``: each bucket (or tensor) is cut into N chunks; each rank receives the
            2-bit chunks of the one it owns (Horovod's ``alltoall``), sums them and sends the
            sum to all (``allgather``): counts in ceil(log2(2N + 1)) bits per value with a
            numeric threshold (lossless), or re-encoded in 3 bits with the owner's own residual
            for "auto" (:mod:`horovod_twobit.tensorflow.scatter_exchange`). ``"auto"``: per
            bucket, whichever sends fewer bytes for its size and N. Every rank must use the same.
        fallback: as in the PyTorch binding. ``None`` (default): always compress. ``"auto"``:
            when a bucket's exchange is first traced (eagerly or in a ``tf.function``), the ranks
            time collectives of known size and a codec pass (once per number of ranks; again
            after :meth:`reset`); with rank 0's figures every rank decides whether compression
            pays for that bucket (:mod:`horovod_twobit.fallback`), and where it does not the
            bucket goes through Horovod's own allreduce as g + r, exactly, its residual then
            zero (:mod:`horovod_twobit.tensorflow.plain_exchange`). ``"always"``: every bucket
            that way. Decisions are logged once (logger ``horovod_twobit``) and kept in
            :attr:`decisions` and the stats (exchange ``"plain"``); a function traced before
            keeps the decision it was traced with.
    """

    def __init__(self, threshold=0.5, name=None, *, rule=None, block=None, blocks=None,
                 bucket_bytes=None, exchange="allgather", fallback=None):
        tf.Module.__init__(self, name=name or "twobit_compressor")
        threshold = wire.validate_threshold(threshold)
        self.block, self.blocks = wire.validate_blocks(threshold, block, blocks)
        self._threshold = threshold
        self.auto_rule = wire.auto_rule(rule)
        self.bucket_bytes = layout.validate_bucket_bytes(bucket_bytes)
        self.exchange = scatter_wire.validate_exchange(exchange)
        self.fallback = validate_fallback(fallback)
        self._plain = _Plain()  # the router's cache of eager exchange functions
        self._plain.decisions = {}  # (bucket key, number of ranks) -> "compressed" / "plain"
        self._plain.links = {}  # (process set id, size) -> the measured Link
        self.residuals = Residuals()
        # the residuals this rank keeps as owner of scatter chunks ("auto" only), keyed by
        # bucket, and the (rank, size) they belong to
        self.owners = Residuals(name="owner_residuals", format_version=scatter_wire.FORMAT_VERSION)
        self._plain.owner_of = None
        self._plain.stats = Slots()
        self._warned = threading.Event()
        from . import _routing
        _routing.install()

    @property
    def threshold(self):
        return self._threshold

    def __repr__(self):
        extra = wire.auto_args_repr(self._threshold, self.auto_rule, self.block, self.blocks)
        if self.bucket_bytes != layout.DEFAULT_BUCKET_BYTES:
            extra += ", bucket_bytes=%d" % self.bucket_bytes
        if self.exchange != "allgather":
            extra += ", exchange=%r" % self.exchange
        if self.fallback:
            extra += ", fallback=%r" % self.fallback
        return "TwoBitCompressor(threshold=%r%s)" % (self._threshold, extra)

    def compress(self, tensor):
        """Returns the tensor unchanged. The router takes TwoBit tensors before Horovod's
        ``allreduce`` gets to call this; a tensor that arrives here goes through an ordinary,
        uncompressed allreduce (correct, and warned about once by :meth:`decompress`)."""
        if isinstance(tensor, tf.IndexedSlices):
            raise ValueError("TwoBitCompressor cannot compress tf.IndexedSlices (sparse gradients): "
                             "pass sparse_as_dense=True to hvd.DistributedOptimizer / "
                             "hvd.DistributedGradientTape")
        if not tf.as_dtype(tensor.dtype).is_floating:
            return tensor, None
        return tensor, _UNROUTED

    def decompress(self, tensor, ctx):
        """Returns the tensor (the router already decoded it into the gradient's dtype)."""
        if ctx is _UNROUTED and not self._warned.is_set():
            self._warned.set()
            warnings.warn("horovod-twobit: a TwoBitCompressor tensor went through an ordinary "
                          "allreduce, uncompressed (its result is correct). Call "
                          "horovod_twobit.tensorflow.install() if you uninstalled the router.")
        return tensor

    @property
    def decisions(self):
        """The fallback's decisions: (bucket key, number of ranks) -> "compressed" or "plain"."""
        return self._plain.decisions

    def plain(self, layout, keys, process_set):
        """Whether the bucket of ``keys`` goes uncompressed with this process set (``fallback``):
        always, or where the measured link and codec say compression would not pay. Decided
        once per bucket and number of ranks, when its exchange is traced; logged once."""
        if not self.fallback:
            return False
        n = process_set.size()
        return decide(self._plain.decisions, keys, layout, n,
                      scatter_wire.choose(self.exchange, layout, n), self.fallback,
                      lambda: self.link(process_set))

    def link(self, process_set):
        """The measured :class:`horovod_twobit.fallback.Link` of this process set (rank 0's
        figures, broadcast), measured eagerly on first use."""
        key = (process_set.process_set_id, process_set.size())
        if key not in self._plain.links:
            from .link import measure
            with tf.init_scope():
                self._plain.links[key] = measure(process_set, self)
        return self._plain.links[key]

    def owner_residual(self, key, numel, rank, size):
        """This rank's residual variable as owner of a scatter chunk of bucket ``key`` (float32,
        ``numel`` values), created at zero on first use. Owners' residuals belong to a rank and a
        number of ranks (their chunks move when either changes): on a change they restart from
        zero, with a warning. Called when an exchange is traced, so a function traced before
        keeps the variables it captured."""
        if self._plain.owner_of != (rank, size):
            if self._plain.owner_of is not None and len(self.owners):
                warnings.warn("horovod-twobit: the ranks changed (this was rank %d of %d, now %d "
                              "of %d): the scatter owners' residuals restart from zero; the "
                              "workers' residuals are kept" % (*self._plain.owner_of, rank, size))
            self.owners.forget()
            self._plain.owner_of = (rank, size)
        with tf.init_scope():
            like = tf.zeros([numel], tf.float32)
        return self.owners.get(key, like)

    @property
    def stats_slots(self):
        return self._plain.stats

    def stats(self, reset=False, per_tensor=False):
        """What this compressor did, as a plain dict (eager only): bytes this rank handed to the
        collectives at every bucket's last step and in total (per exchange), the fraction of
        values it sent at the last step, the threshold (with "auto": the mean of the levels it
        sent), the bucket steps whose result was NaN, and per bucket its exchange, fraction sent
        and residual norms (per tensor with ``per_tensor=True``); the keys are those of
        :func:`horovod_twobit.stats.summarize`. Each step updates a few variables on the device
        (no host round trip) and hands them to the host (on a CPU an op that copies them into a
        table; with a GPU a ``tf.numpy_function``, while reads come at most two steps apart), so
        that a read right after a step costs no TensorFlow call.
        ``reset=True`` clears the running sums after reading them.
        :class:`horovod_twobit.tensorflow.TwoBitStatsCallback` puts them in Keras' logs."""
        if getattr(self._plain, "norms", None) is None:
            self._plain.norms = residual_norms(self.residuals)  # keeps its traced reader
        return self._plain.stats.snapshot(self._plain.norms, self._threshold, per_tensor, reset)

    def state_dict(self):
        """This rank's residuals (NumPy copies) keyed by tensor name, with the threshold, rank and
        number of ranks they belong to (the PyTorch binding's layout), and its scatter owners'
        residuals keyed by bucket. Residuals are per rank: save one per rank. Eager only."""
        return state.make(self._threshold, *rank_size(), self.residuals.state_dict(),
                          self.owners.state_dict())

    def load_state_dict(self, saved):
        """Restores residuals saved by :meth:`state_dict` (of either binding: values are arrays).
        Eager only.

        A residual belongs to the rank that made it. If the state was saved by another rank or
        with another number of ranks, the residuals restart from zero with a warning (what was not
        yet sent is dropped: at most one threshold per value and rank)."""
        residuals = state.residuals_to_load(saved, self._threshold, *rank_size())
        if residuals is None:
            self.residuals.reset()
            self.owners.reset()
            self._plain.owner_of = None
        else:
            self.residuals.load_state_dict({k: np.asarray(v) for k, v in residuals.items()})
            self.owners.load_state_dict({k: np.asarray(v) for k, v in
                                         state.owner_residuals_to_load(saved).items()})
            self._plain.owner_of = rank_size()
        self._plain.stats.residuals_changed()

    def reset(self):
        """Sets every residual back to zero, the scatter owners' too, and forgets the fallback's
        link measurements and decisions (made again when an exchange is next traced)."""
        self.residuals.reset()
        self.owners.reset()
        self._plain.stats.residuals_changed()
        self._plain.decisions.clear()
        self._plain.links.clear()
