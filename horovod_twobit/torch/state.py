"""``TwoBitState``: everything a PyTorch compressor keeps between steps, apart from its Horovod face.

As PyTorch's ``PowerSGDState`` holds what ``powerSGD_hook`` needs, a :class:`TwoBitState` holds
the configuration (threshold, "auto" blocks, buckets, exchange, fallback), the residuals (the
workers' by tensor name, the scatter owners' by bucket), the buckets, the fallback's link
measurements and decisions, the stats and the checkpoint. The exchanges
(:mod:`horovod_twobit.torch.exchange`) are functions of (state, bucket), imported when a state
makes its first bucket: the state itself, like the codec, imports without Horovod;
:class:`horovod_twobit.torch.TwoBitCompressor` is Horovod's ``Compressor`` face over one state.
"""

import threading

import torch

from horovod_twobit import wire
from horovod_twobit.state import checkpoint, options
from horovod_twobit.state.fallback import decide, modelled, validate_fallback
from horovod_twobit.state.stats import StatsLog
from horovod_twobit.torch.codec import stats as stats_read
from horovod_twobit.torch.residuals import Residuals
from horovod_twobit.wire import layout, scatter as scatter_wire


def horovod_rank_size():
    """(rank, size) of Horovod's global process set, or (0, 1) before ``hvd.init()``."""
    import horovod.torch as hvd
    try:
        return hvd.rank(), hvd.size()
    except ValueError:  # Horovod not initialized
        return 0, 1


class TwoBitState:
    """The state of one 2-bit compressor (the arguments are
    :class:`horovod_twobit.torch.TwoBitCompressor`'s). ``rank_size`` is a function giving this
    rank's (rank, number of ranks) for the checkpoint (default: Horovod's global process set)."""

    check_fallback = True  # fallback="auto" checks the model's picks on the first steps

    def __init__(self, threshold=0.5, *, min_numel=0, rule=None, block=None, blocks=None,
                 bucket_bytes=None, exchange="allgather", fallback=None, rank_size=None):
        self.threshold = wire.validate_threshold(threshold)
        self.block, self.blocks = wire.validate_blocks(self.threshold, block, blocks)
        if isinstance(min_numel, bool) or not isinstance(min_numel, int) or min_numel < 0:
            raise ValueError("min_numel must be a non-negative integer, got %r" % (min_numel,))
        self.min_numel = min_numel
        self.auto_rule = wire.auto_rule(rule)
        self.bucket_bytes = layout.validate_bucket_bytes(bucket_bytes)
        self.exchange = scatter_wire.validate_exchange(exchange)
        self.fallback = validate_fallback(fallback)
        self.rank_size = rank_size or horovod_rank_size
        self.residuals = Residuals()  # the workers' residuals, by tensor name
        # the residuals this rank keeps as owner of scatter chunks ("auto" only), keyed by
        # bucket, and the (rank, size) they belong to
        self.owners = Residuals()
        self._owner_of = None
        self.decisions = {}  # (bucket key, number of ranks) -> "compressed" / "plain"
        self._links = {}  # (process set id, size) -> the measured Link
        self._checkers = {}  # (process set id, size) -> the checked decision (fallback="auto")
        self._settled = {}  # (bucket key, process set id, size) -> plain, once its check chose
        # (bucket, process set, size) whose ranks all announced the scatter exchange
        self.agreed = set()
        self.stats_log = StatsLog()
        self.stats_reads = 0  # stats() calls: a bucket's next step after one prepares the next
        self._buckets = {}  # tensor name -> its planned Bucket
        self._singles = {}  # tensor name (or a group's key) -> a Bucket of those tensors alone
        self._lock = threading.Lock()

    def args_repr(self):
        """The arguments that differ from the defaults, as a constructor call spells them."""
        return options.args_repr(self, self.min_numel)

    def compresses(self, tensor):
        """Whether ``tensor`` goes through the 2-bit exchange (floating point, at least
        ``min_numel`` values); a sparse one is refused with the fix."""
        if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point():
            return False
        if tensor.numel() < self.min_numel:
            return False
        if tensor.is_sparse:
            raise ValueError("TwoBitCompressor cannot compress sparse gradients: pass "
                             "sparse_as_dense=True to hvd.DistributedOptimizer")
        return True

    # ------------------------------------------------------------------ buckets
    def plan(self, named_parameters):
        """Assigns buckets to the gradients of ``named_parameters`` ((name, parameter) pairs in
        the order their gradients are expected to become ready): the tensors this compressor
        will compress, cut into runs of at most ``bucket_bytes`` on the same device. A later
        plan replaces an earlier one's buckets."""
        from horovod_twobit.torch.exchange.bucket import Bucket
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
        from horovod_twobit.torch.exchange.bucket import Bucket
        b = self._singles.get(name)
        if b is None or b.layout.numels[0] != tensor.numel():
            b = self._singles[name] = Bucket(self, [name], [tensor.numel()])
        return b

    def single_of(self, name):
        """The bucket of tensor ``name`` sent alone, if it was, else None."""
        return self._singles.get(name)

    def group_bucket(self, names, tensors):
        """The bucket of a grouped allreduce's tensors (made once per group)."""
        from horovod_twobit.torch.exchange.bucket import Bucket
        key = tuple(names) + tuple(t.numel() for t in tensors)
        b = self._singles.get(key)
        if b is None:
            b = self._singles[key] = Bucket(self, names, [t.numel() for t in tensors])
        return b

    # ------------------------------------------------------------------ the fallback
    def plain(self, bucket, process_set, device, started):
        """Whether ``bucket`` goes uncompressed at this launch: never without ``fallback``;
        always with "always"; with "auto" the model's pick (from the measured link and codec,
        made once per bucket and number of ranks, logged once), checked on the job's
        first steps (:mod:`horovod_twobit.state.fallback`). ``started``: when the bucket's first
        member arrived. :attr:`decisions` holds each bucket's mode at its last launch."""
        n = process_set.size()
        exchange = bucket.exchange(n)[0]
        link = lambda: self.link(process_set, device)  # noqa: E731
        if self.fallback != "auto" or not self.check_fallback:
            return decide(self.decisions, bucket.names, bucket.layout, n, exchange, self.fallback,
                          link)
        settled = self._settled.get((bucket.key, process_set.process_set_id, n))
        if settled is not None:  # decided: the same mode at every launch from now on
            return settled
        key = (process_set.process_set_id, n)
        checker = self._checkers.get(key)
        if checker is None:
            from horovod_twobit.torch.exchange.checked import Checker
            checker = self._checkers[key] = Checker(n, self.broadcaster(process_set, device))
        pick = decide(checker.picks, bucket.names, bucket.layout, n, exchange, self.fallback, link)
        plain, (who, step) = checker.plain(bucket.key, pick,
                                           lambda: modelled(bucket.layout, n, exchange, link),
                                           started)
        self.decisions[(bucket.key, n)] = "plain" if plain else "compressed"
        if who.settled(step):
            self._settled[(bucket.key, process_set.process_set_id, n)] = plain
        return plain

    def settled_plain(self, bucket, process_set):
        """Whether every later launch of ``bucket`` on ``process_set`` goes plain: with
        "always", or once the checked decision of "auto" chose plain. (Without the check,
        ``check_fallback = False``, :attr:`decisions` may be set by hand at any step: never.)"""
        if self.fallback == "always":
            return True
        if self.fallback != "auto" or not self.check_fallback:
            return False
        key = (bucket.key, process_set.process_set_id, process_set.size())
        return self._settled.get(key) is True

    def next_plain(self, bucket):
        """Whether ``bucket``'s next launch is, by the schedule of ``fallback="auto"``'s check, a
        plain one that decides nothing (not its first launch, nor the one after the schedule,
        which decides): then it may be sent without the compressor and counted after it ran
        (:meth:`count_plain`)."""
        if self.fallback != "auto" or not self.check_fallback or bucket.seen is None:
            return False
        process_set = bucket.seen[0]
        checker = self._checkers.get((process_set.process_set_id, process_set.size()))
        return checker is not None and checker.next_plain(bucket.key)

    def count_plain(self, bucket, started):
        """Counts a launch of ``bucket`` that :meth:`next_plain` allowed, after it ran (its
        first gradient arrived at ``started``); returns whether its mode was plain."""
        process_set, device = bucket.seen
        return self.plain(bucket, process_set, device, started)

    def link(self, process_set, device):
        """The measured :class:`horovod_twobit.state.fallback.Link` of this process set (rank
        0's figures, broadcast), measured on first use."""
        key = (process_set.process_set_id, process_set.size())
        if key not in self._links:
            self._links[key] = self.measure(process_set, device)
        return self._links[key]

    def measure(self, process_set, device):
        """A :class:`~horovod_twobit.state.fallback.Link` measured through Horovod."""
        from horovod_twobit.torch.exchange.link import measure
        return measure(process_set, device, self.threshold)

    @staticmethod
    def broadcaster(process_set, device=None):
        """``broadcast(floats, name)``: rank 0's floats, through Horovod."""
        from horovod_twobit.torch.exchange.link import broadcaster
        return broadcaster(process_set)

    # ------------------------------------------------------------------ residuals
    def owner_residual(self, key, numel, device, rank, size):
        """This rank's residual as owner of a scatter chunk of bucket ``key`` (float32, ``numel``
        values). Owners' residuals belong to a rank and a number of ranks (their chunks move
        when either changes): on a change they restart from zero, with a warning."""
        if options.owners_move(self._owner_of, rank, size, len(self.owners)):
            self.owners.reset()
            self._owner_of = (rank, size)
        return self.owners.get(key, torch.empty(numel, dtype=torch.float32, device=device))

    def stats(self, reset=False, per_tensor=False):
        """What this compressor did, as a plain dict (see ``TwoBitCompressor.stats``)."""
        self.stats_reads += 1
        out = self.stats_log.snapshot(self._residual_norms, self.threshold, per_tensor)
        checks = [s for c in self._checkers.values() for s in c.summaries()]
        if checks:
            out["fallback_checks"] = checks
        if reset:
            self.stats_log.reset()
        return out

    def _residual_norms(self, names):
        return stats_read.tensor_norms(self.residuals, names)

    def state_dict(self):
        """This rank's residuals (CPU copies) keyed by tensor name, with the threshold, rank and
        number of ranks they belong to, and its scatter owners' residuals keyed by bucket."""
        return checkpoint.make(self.threshold, *self.rank_size(), self.residuals.state_dict(),
                               self.owners.state_dict())

    def load_state_dict(self, saved):
        """Restores residuals saved by :meth:`state_dict`; each is moved to its gradient's device
        on first use. Saved by another rank or with another number of ranks, they restart from
        zero with a warning."""
        residuals = checkpoint.residuals_to_load(saved, self.threshold, *self.rank_size())
        self.owners.reset()
        self._owner_of = None
        if residuals is None:
            self.residuals.reset()
        else:
            self.residuals.load_state_dict(residuals)
            self.owners.load_state_dict(checkpoint.owner_residuals_to_load(saved))
            self._owner_of = self.rank_size()

    def reset(self):
        """Forgets every residual (they restart from zero), and the fallback's link
        measurements and decisions (made again at the next step)."""
        self.residuals.reset()
        self.owners.reset()
        self.agreed.clear()
        self.decisions.clear()
        self._links.clear()
        self._checkers.clear()
        self._settled.clear()
