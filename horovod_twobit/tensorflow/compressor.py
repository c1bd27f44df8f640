"""``TwoBitCompressor``: MXNet's 2-bit compression with error feedback, as a Horovod compressor for
TensorFlow 2 and Keras."""

import threading
import warnings

import tensorflow as tf

from horovod.tensorflow.compression import Compressor

from horovod_twobit.tensorflow import checks, router
from horovod_twobit.tensorflow.residuals import _Plain
from horovod_twobit.tensorflow.state import TwoBitState


class TwoBitCompressor(Compressor, tf.Module):
    """2-bit gradient compression with error feedback (MXNet's ``{'type': '2bit'}``), for
    ``horovod.tensorflow`` and ``horovod.tensorflow.keras``.

    For every tensor it keeps a float32 residual r. Each step, r <- r + g; values with r >= t are
    sent as +t (code ``11``), values with r <= -t as -t (code ``10``), all others as 0 (``00``);
    then r <- r - q. Sixteen values travel in one 32-bit word, the PyTorch binding's bytes. Ranks
    allgather their payloads and every rank decodes and sums all of them: nothing is lost, only
    delayed. Use it where Horovod takes ``compression=``: ``hvd.DistributedGradientTape``,
    ``hvd.DistributedOptimizer`` (Keras' for ``model.fit``) or ``hvd.allreduce(t, name='t',
    compression=...)``; importing :mod:`horovod_twobit.tensorflow` installs the router
    (:func:`horovod_twobit.tensorflow.install`) that sends these tensors to the exchanges.

    Residuals are keyed by the name of the variable a gradient belongs to (without ``:0``; give
    layers explicit names if models are rebuilt in one process and restored), or by the ``name=``
    given to ``hvd.allreduce`` (``<name>.<i>`` for ``hvd.grouped_allreduce``). They are
    ``tf.Variable`` s tracked by this module, so ``tf.train.Checkpoint(model=model, optimizer=opt,
    twobit=compressor)`` saves and restores them (one checkpoint per rank: residuals are per rank);
    :meth:`state_dict` / :meth:`load_state_dict` do the same with NumPy arrays.

    With ``threshold="auto"`` each rank chooses, per block of a tensor and per step, a support
    threshold and the magnitude sent for it, bit for bit as the PyTorch binding does
    (docs/auto_threshold.md).

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
        exchange: ``"allgather"`` (default), ``"scatter"`` (a compressed reduce-scatter whose
            bytes stay flat in the number of ranks) or ``"auto"``, as in the PyTorch binding.
        fallback: ``None`` (default), ``"auto"`` or ``"always"``, as in the PyTorch binding; the
            link is timed when a bucket's exchange is first traced, and a function traced
            before keeps the decision it was traced with.

    Everything else (residuals, caches, stats, checkpoints) is :attr:`state`'s, a
    :class:`~horovod_twobit.tensorflow.state.TwoBitState`; its attributes read through the face.
    """

    TWOBIT_FACE = True  # the routers refuse the class itself (compression=TwoBitCompressor)

    def __init__(self, threshold=0.5, name=None, **options):
        tf.Module.__init__(self, name=name or "twobit_compressor")
        state = TwoBitState(threshold, **options)
        # the checkpoint's dependencies, under the names they always had (set before the state
        # reads through the face, or tf.Module would find them there and not track them)
        self.residuals = state.residuals
        self.owners = state.owners
        self._plain = _Plain()  # untracked by tf.Module
        self._plain.state, self._plain.warned = state, threading.Event()
        router.install()

    @property
    def state(self):
        """The :class:`~horovod_twobit.tensorflow.state.TwoBitState` behind this face."""
        return self._plain.state

    def __getattr__(self, name):  # what the face lacks: the state's public attributes
        plain = self.__dict__.get("_plain")
        if plain is None or name.startswith("_"):
            raise AttributeError(name)
        return getattr(plain.state, name)

    def __repr__(self):
        return "TwoBitCompressor(%s)" % self.state.args_repr()

    def compress(self, tensor):
        """Returns the tensor unchanged. The router takes TwoBit tensors before Horovod's
        ``allreduce`` gets to call this; a tensor that arrives here goes through an ordinary,
        uncompressed allreduce (correct, and warned about once by :meth:`decompress`)."""
        if isinstance(tensor, tf.IndexedSlices):
            raise ValueError("TwoBitCompressor cannot compress tf.IndexedSlices (sparse gradients): "
                             "pass sparse_as_dense=True to hvd.DistributedOptimizer / "
                             "hvd.DistributedGradientTape")
        if not checks.is_float(tensor):
            return tensor, None
        return tensor, checks.UNROUTED

    def decompress(self, tensor, ctx):
        """Returns the tensor (the router already decoded it into the gradient's dtype)."""
        if ctx is checks.UNROUTED and not self._plain.warned.is_set():
            self._plain.warned.set()
            warnings.warn("horovod-twobit: a TwoBitCompressor tensor went through an ordinary "
                          "allreduce, uncompressed (its result is correct). Call "
                          "horovod_twobit.tensorflow.install() if you uninstalled the router.")
        return tensor

    def stats(self, reset=False, per_tensor=False):
        """What this compressor did, as a plain dict (eager only), the PyTorch binding's keys
        (:func:`horovod_twobit.state.stats.summarize`): bytes handed to the collectives, the
        fraction sent, the threshold, NaN steps, and per bucket its exchange and residual norms.
        ``reset=True`` clears the running sums after reading them."""
        return self.state.stats(reset, per_tensor)

    def state_dict(self):
        """This rank's residuals (NumPy copies) keyed by tensor name, with the threshold, rank and
        number of ranks they belong to (the PyTorch binding's layout). Residuals are per rank:
        save one per rank. Eager only."""
        return self.state.state_dict()

    def load_state_dict(self, saved):
        """Restores residuals saved by :meth:`state_dict` (of either binding). Saved by another
        rank or with another number of ranks, they restart from zero with a warning (at most one
        threshold per value and rank is dropped). Eager only."""
        self.state.load_state_dict(saved)

    def reset(self):
        """Sets every residual back to zero, the scatter owners' too, and forgets the fallback's
        link measurements and decisions (made again when an exchange is next traced)."""
        self.state.reset()
