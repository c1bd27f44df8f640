"""``TwoBitCompressor``: MXNet's 2-bit compression with error feedback, as a Horovod compressor.

The face only: what the compressor keeps between steps is a
:class:`horovod_twobit.torch.state.TwoBitState`, and the router
(:mod:`horovod_twobit.torch.router`) takes the tensors it marks to the exchanges.
"""

import threading
import warnings

from horovod.torch.compression import Compressor

from horovod_twobit.torch import router
from horovod_twobit.torch.state import TwoBitState


class TwoBitCompressor(Compressor):
    """2-bit gradient compression with error feedback (MXNet's ``{'type': '2bit'}``).

    For every tensor name it keeps a float32 residual r. Each step, r <- r + g; values with
    r >= t are sent as +t (code ``11``), values with r <= -t as -t (code ``10``), all others as 0
    (``00``); then r <- r - q. Sixteen values travel in one 32-bit word. Ranks allgather their
    payloads and every rank decodes and sums all of them, so nothing is lost, only delayed. The
    bytes on the wire drop 16-fold, for an extra float32 residual per tensor; the threshold must
    match the gradients' scale, unless it is ``"auto"``.

    Use it as ``hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
    compression=TwoBitCompressor(0.5))`` or ``hvd.allreduce(t, name='t',
    compression=TwoBitCompressor(0.5))``. Creating one installs a small router around Horovod's
    allreduce entry points (:func:`horovod_twobit.torch.install`) that sends these payloads to
    allgather + decode + sum and leaves every other tensor untouched.

    With ``threshold="auto"`` each rank chooses, for every block of a tensor and every step, from
    x = r + g, a support threshold among c * mean|x| and the magnitude sent for it (the mean of
    |x| over the support), the pair with the smallest squared error; the magnitudes travel with
    the payload (docs/auto_threshold.md has the rule, the evidence and the costs).

    Args:
        threshold: a positive number (MXNet's default 0.5), or ``"auto"``.
        min_numel: tensors with fewer values go through Horovod's ordinary allreduce, uncompressed
            (default 0: compress everything).
        rule: the rule of ``threshold="auto"``: ``"lsq"`` (default), ``"opt"``, ``"mean"`` or
            ``"rms"``; default: ``HOROVOD_TWOBIT_AUTO_RULE``, else ``"lsq"``.
        block: with ``threshold="auto"``, the smallest block, a power of two of at least 16
            (default 64).
        blocks: with ``threshold="auto"``, the most blocks per tensor (default 64). 1: one
            magnitude per tensor; 0: no limit, blocks of exactly ``block`` values.
        bucket_bytes: ``hvd.DistributedOptimizer`` sends its gradients in buckets of up to this
            many bytes (default 4 MiB): one encode, one collective and one finish per bucket,
            every tensor's result unchanged, bit for bit. 0: every tensor alone.
        exchange: ``"allgather"`` (default): every rank receives every rank's payload.
            ``"scatter"``: a compressed reduce-scatter whose bytes stay flat in the number of
            ranks (docs/scatter.md). ``"auto"``: per bucket, whichever sends fewer bytes. Every
            rank must use the same.
        fallback: ``None`` (default): always compress. ``"auto"``: at the first step the ranks
            time the link and the codec, and a bucket where compression would not pay goes
            through Horovod's own allreduce as g + r, exactly, its residual then zero
            (:mod:`horovod_twobit.state.fallback`). ``"always"``: every bucket that way.
            Decisions are logged once and kept in :attr:`decisions` and the stats.

    Everything else (residuals, buckets, stats, checkpoints) is :attr:`state`'s, a
    :class:`~horovod_twobit.torch.state.TwoBitState`; its attributes read through the face.
    """

    TWOBIT_FACE = True  # the routers refuse the class itself (compression=TwoBitCompressor)

    def __init__(self, threshold=0.5, **options):
        self.state = TwoBitState(threshold, **options)
        self._warned = threading.Event()
        router.install()

    def __getattr__(self, name):  # only for what the face itself lacks: the state's attributes
        if name == "state":
            raise AttributeError(name)
        return getattr(self.state, name)

    def __repr__(self):
        return "TwoBitCompressor(%s)" % self.state.args_repr()

    def compress(self, tensor):
        """Marks a floating-point tensor for 2-bit exchange; others pass through unchanged.

        The returned tensor is an alias of the input (no copy): the encoding needs the tensor's
        name, which Horovod gives only to the allreduce that follows."""
        if not self.state.compresses(tensor):
            return tensor, None
        return router.mark(self.state, tensor)

    def decompress(self, tensor, ctx):
        """Returns the aggregated tensor (the router already decoded it into the gradient's dtype)."""
        if router.unrouted(ctx) and not self._warned.is_set():
            self._warned.set()
            warnings.warn("horovod-twobit: a TwoBitCompressor tensor went through an ordinary "
                          "allreduce, uncompressed (its result is correct). Call "
                          "horovod_twobit.torch.install() if you uninstalled the router.")
        return tensor

    def plan(self, named_parameters):
        """Assigns buckets to the gradients of ``named_parameters`` (called by
        ``hvd.DistributedOptimizer``; :meth:`TwoBitState.plan`)."""
        self.state.plan(named_parameters)
        return self

    def stats(self, reset=False, per_tensor=False):
        """What this compressor did, as a plain dict: bytes this rank handed to the collectives
        at every bucket's last step and in total (per exchange), the fraction of values it sent
        at the last step, the threshold (with "auto": the mean of the levels it sent), the
        bucket steps whose result was NaN, and per bucket its exchange, fraction sent and
        residual norms (per tensor with ``per_tensor=True``); the keys are
        :meth:`horovod_twobit.state.stats.StatsLog.snapshot`'s. Recording costs no device work
        except in each bucket's first step after a read. ``reset=True`` clears the running sums
        after reading them."""
        return self.state.stats(reset, per_tensor)

    def state_dict(self):
        """This rank's residuals (CPU copies) keyed by tensor name, with the threshold, rank and
        number of ranks they belong to. Residuals are per rank: save one file per rank."""
        return self.state.state_dict()

    def load_state_dict(self, saved):
        """Restores residuals saved by :meth:`state_dict`. If they were saved by another rank or
        with another number of ranks, they restart from zero with a warning (what was not yet
        sent is dropped: at most one threshold per value and rank)."""
        self.state.load_state_dict(saved)

    def reset(self):
        """Forgets every residual (they restart from zero), and the fallback's link
        measurements and decisions (made again at the next step)."""
        self.state.reset()
