"""``TwoBitCompressor``: MXNet's 2-bit compression with error feedback, as a Horovod compressor for
TensorFlow 2 and Keras."""

import threading
import warnings

import numpy as np
import tensorflow as tf

from horovod.tensorflow.compression import Compressor

from .. import layout, state, wire


class _Unrouted:
    """The context ``compress`` hands to Horovod when a tensor reaches ``compress`` at all: that only
    happens when the router is not installed, and the tensor then travels uncompressed."""

    __slots__ = ()


_UNROUTED = _Unrouted()


class _Plain:
    """Holds state that must not become a checkpoint dependency."""

    def __init__(self):
        self.pending = {}
        self.variables = {}
        self.eager_fns = {}


def rank_size():
    """(rank, size) of this Horovod process, or (0, 1) before ``hvd.init()``."""
    import horovod.tensorflow as hvd
    try:
        return hvd.rank(), hvd.size()
    except ValueError:
        return 0, 1


class Residuals(tf.Module):
    """The error-feedback state of one compressor: a float32 ``tf.Variable`` per tensor name.

    A residual is created at zero on the first exchange of its tensor and lives as long as the
    compressor: a ``tf.function`` that captured it keeps working whatever happens later
    (:meth:`reset` and :meth:`load_state_dict` assign values, they never replace variables). It is
    created under ``tf.init_scope()``, so a first use inside a ``tf.function`` (on any trace, not
    only the first) makes an ordinary eager variable.

    Every residual is a checkpoint dependency of this module, saved as ``rank<r>of<n>/<name>``; a
    ``tf.train.Checkpoint`` restored before the residuals exist fills each one in when it is
    created. A residual belongs to the rank that made it, so a checkpoint written by another rank
    or with another number of ranks (the usual "save on rank 0 only") restores none of them: they
    start from zero, as with :meth:`TwoBitCompressor.load_state_dict`. Save one checkpoint per rank
    to restore them exactly.
    """

    def __init__(self, name="residuals"):
        super().__init__(name=name)
        self._tracked = {}  # tracked by tf.Module: "rank<r>of<n>/<name>" -> tf.Variable
        # Plain (untracked) state: name -> tf.Variable, and values from load_state_dict() for
        # residuals not created yet.
        self._plain = _Plain()
        self._lock = threading.RLock()

    @property
    def _by_name(self):
        return self._plain.variables

    def get(self, name, grad):
        """The residual (1-D, float32) for tensor ``name``, created at zero on first use. Raises if
        the tensor's size changed under the same name."""
        if not isinstance(name, str) or not name:
            raise ValueError("a residual needs a non-empty string name, got %r" % (name,))
        numel = grad.shape.num_elements()
        if numel is None:
            raise ValueError(
                "tensor %r has a shape that is not fully known (%s): TwoBitCompressor keeps a "
                "residual of fixed size per tensor and needs static shapes" % (name, grad.shape))
        with self._lock:
            r = self._by_name.get(name)
            if r is not None:
                if r.shape.num_elements() != numel:
                    raise ValueError(
                        "tensor %r changed size from %d to %d values; its residual cannot follow. "
                        "Give tensors of different sizes different names"
                        % (name, r.shape.num_elements(), numel))
                return r
            with tf.init_scope():
                init = tf.zeros([numel], tf.float32)
                pending = self._plain.pending.pop(name, None)
                if pending is not None:
                    pending = np.asarray(pending, dtype=np.float32).reshape(-1)
                    if pending.size != numel:
                        warnings.warn("horovod-twobit: restored residual %r has %d values but the "
                                      "gradient has %d; starting that residual from zero"
                                      % (name, pending.size, numel))
                    else:
                        init = tf.constant(pending)
                device = getattr(grad, "device", "") or ""
                with tf.device(device or None):
                    r = tf.Variable(init, trainable=False, name="twobit_residual",
                                    synchronization=tf.VariableSynchronization.NONE,
                                    aggregation=tf.VariableAggregation.NONE)
                self._by_name[name] = r
                # Tracked inside init_scope: a deferred checkpoint restore runs eagerly, once.
                self._tracked["rank%dof%d/%s" % (rank_size() + (name,))] = r
            return r

    def variable(self, name):
        """The residual variable of ``name`` (KeyError if it was never created)."""
        with self._lock:
            return self._by_name[name]

    def names(self):
        with self._lock:
            return sorted(set(self._by_name) | set(self._plain.pending))

    def __len__(self):
        return len(self.names())

    def __contains__(self, name):
        with self._lock:
            return name in self._by_name or name in self._plain.pending

    def state_dict(self):
        """A dict name -> residual value (a NumPy float32 copy), pending values included. Eager only."""
        with self._lock:
            out = {k: v.numpy().copy() for k, v in self._by_name.items()}
            out.update({k: np.array(v, dtype=np.float32).reshape(-1)
                        for k, v in self._plain.pending.items() if k not in out})
            return out

    def load_state_dict(self, state):
        """Replaces all residuals: existing variables are assigned (those absent from ``state`` are
        zeroed), the others are created with their value on first use. Eager only."""
        with self._lock:
            pending = {}
            for k, v in self._by_name.items():
                if k in state:
                    value = np.asarray(state[k], dtype=np.float32).reshape(-1)
                    if value.size != v.shape.num_elements():
                        warnings.warn("horovod-twobit: restored residual %r has %d values but the "
                                      "gradient has %d; starting that residual from zero"
                                      % (k, value.size, v.shape.num_elements()))
                        value = np.zeros(v.shape.num_elements(), np.float32)
                    v.assign(value)
                else:
                    v.assign(tf.zeros_like(v))
            for k, value in state.items():
                if k not in self._by_name:
                    pending[k] = np.asarray(value, dtype=np.float32).reshape(-1)
            self._plain.pending = pending

    def reset(self):
        """Sets every residual to zero (the variables stay, so traced functions stay valid) and
        drops values restored for residuals not created yet."""
        with self._lock:
            for v in self._by_name.values():
                v.assign(tf.zeros_like(v))
            self._plain.pending = {}


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
    """

    def __init__(self, threshold=0.5, name=None, *, rule=None, block=None, blocks=None,
                 bucket_bytes=None):
        tf.Module.__init__(self, name=name or "twobit_compressor")
        threshold = wire.validate_threshold(threshold)
        self.block, self.blocks = wire.validate_blocks(threshold, block, blocks)
        self._threshold = threshold
        self.auto_rule = wire.auto_rule(rule)
        self.bucket_bytes = layout.validate_bucket_bytes(bucket_bytes)
        self.residuals = Residuals()
        self._plain = _Plain()  # the router's cache of eager exchange functions
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

    def state_dict(self):
        """This rank's residuals (NumPy copies) keyed by tensor name, with the threshold, rank and
        number of ranks they belong to (the PyTorch binding's layout). Residuals are per rank: save
        one per rank. Eager only."""
        return state.make(self._threshold, *rank_size(), self.residuals.state_dict())

    def load_state_dict(self, saved):
        """Restores residuals saved by :meth:`state_dict` (of either binding: values are arrays).
        Eager only.

        A residual belongs to the rank that made it. If the state was saved by another rank or
        with another number of ranks, the residuals restart from zero with a warning (what was not
        yet sent is dropped: at most one threshold per value and rank)."""
        residuals = state.residuals_to_load(saved, self._threshold, *rank_size())
        if residuals is None:
            self.residuals.reset()
        else:
            self.residuals.load_state_dict({k: np.asarray(v) for k, v in residuals.items()})

    def reset(self):
        """Sets every residual back to zero."""
        self.residuals.reset()
