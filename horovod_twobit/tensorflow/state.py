"""``TwoBitState``: everything a TensorFlow compressor keeps between steps, apart from its Horovod
face.

It holds the configuration (threshold, "auto" blocks, buckets, exchange, fallback), the
residuals (the workers' by tensor name and the scatter owners' by bucket, ``tf.Variable`` s in
:class:`~horovod_twobit.tensorflow.residuals.Residuals`), the caches of traced functions, the
fallback's link measurements and decisions, the stats slots and the checkpoint. The exchanges
(:mod:`horovod_twobit.tensorflow.exchange`) are functions of (state, tensors);
:class:`horovod_twobit.tensorflow.TwoBitCompressor` is Horovod's ``Compressor`` face over one
state, and the ``tf.Module`` that tracks the residuals for ``tf.train.Checkpoint``.
"""

import numpy as np
import tensorflow as tf

from horovod_twobit import wire
from horovod_twobit.state import checkpoint, options
from horovod_twobit.state.fallback import decide, modelled, validate_fallback
from horovod_twobit.tensorflow.residuals import Residuals, rank_size
from horovod_twobit.tensorflow.stats import Slots, residual_norms, state_variable
from horovod_twobit.wire import layout, scatter as scatter_wire


class TwoBitState:
    """The state of one 2-bit compressor (the arguments are
    :class:`horovod_twobit.tensorflow.TwoBitCompressor`'s). A plain Python object: only its
    residuals are checkpoint dependencies, through the face."""

    check_fallback = True  # fallback="auto" checks the model's picks on the first steps

    def __init__(self, threshold=0.5, *, rule=None, block=None, blocks=None, bucket_bytes=None,
                 exchange="allgather", fallback=None):
        self.threshold = wire.validate_threshold(threshold)
        self.block, self.blocks = wire.validate_blocks(self.threshold, block, blocks)
        self.auto_rule = wire.auto_rule(rule)
        self.bucket_bytes = layout.validate_bucket_bytes(bucket_bytes)
        self.exchange = scatter_wire.validate_exchange(exchange)
        self.fallback = validate_fallback(fallback)
        self.residuals = Residuals()
        # the residuals this rank keeps as owner of scatter chunks ("auto" only), keyed by
        # bucket, and the (rank, size) they belong to
        self.owners = Residuals(name="owner_residuals", format_version=scatter_wire.FORMAT_VERSION)
        self.owner_of = None
        self.eager_fns = {}  # traced functions and layouts, by what they were made for
        self.picks = {}  # the model's: (bucket key, number of ranks) -> "compressed" / "plain"
        self.links = {}  # (process set id, size) -> the measured Link
        self.checks = []  # the checked decisions of traced gradient reductions (fallback="auto")
        self.checks_made = 0  # names each check's broadcast, alike on every rank
        # (bucket key, number of ranks) -> whether it goes plain, as a decided check kept it:
        # a retraced step keeps it without a check (a Keras callback can retrace for that)
        self.settled = {}
        self.settled_keys = {}  # number of ranks -> the member keys of the buckets settled
        self.zero_flags = {}  # bucket key -> variable: its residuals are known to be zero
        self.stats_slots = Slots()
        self.norms = None  # the residual norms' reader, made on the first stats() call

    def args_repr(self):
        """The arguments that differ from the defaults, as a constructor call spells them."""
        return options.args_repr(self)

    @staticmethod
    def variable(init):
        """A variable of this state's own bookkeeping (the fallback's checks and flags), made
        eagerly wherever it is asked for."""
        return state_variable(init)

    def plain(self, layout, keys, process_set):
        """Whether the bucket of ``keys`` goes uncompressed with this process set (``fallback``):
        never without it; always with "always"; with "auto" the model's pick (made once per
        bucket and number of ranks, when its exchange is traced; logged once), and, in a
        gradient reduction traced with a :class:`~horovod_twobit.tensorflow.exchange.link.Check`,
        that pick checked on the first steps: then a 0-d bool tensor, this step's mode."""
        if not self.fallback:
            return False
        n = process_set.size()
        exchange = scatter_wire.choose(self.exchange, layout, n)
        link = lambda: self.link(process_set)  # noqa: E731
        from horovod_twobit.tensorflow.exchange.link import current
        check = current() if self.fallback == "auto" and self.check_fallback else None
        settled = self.settled.get((scatter_wire.owner_key(keys), n))
        if settled is not None and self.fallback == "auto":
            return settled  # a check decided it: a step traced since keeps it, unchecked
        if check is None:
            return decide(self.picks, keys, layout, n, exchange, self.fallback, link)
        pick = decide(self.picks, keys, layout, n, exchange, self.fallback, link)
        return check.plain(scatter_wire.owner_key(keys), pick,
                           lambda: modelled(layout, n, exchange, link), keys)

    def all_settled(self):
        """Whether ``fallback="auto"`` has checks that ran and every one of them has decided
        (read eagerly): a step traced now needs none. A check whose step never ran (a
        ``tf.function`` traces twice where its first call makes variables, and runs the
        second) does not count."""
        if self.fallback != "auto":
            return False
        ran = [c for c in self.checks if c.ran()]
        return bool(ran) and all(not c.steps or c.summary() is not None for c in ran)

    @property
    def decisions(self):
        """(bucket key, number of ranks) -> "compressed" / "plain": the model's picks, and for
        the buckets of a checked gradient reduction the mode of its last step (read eagerly)."""
        out = dict(self.picks)
        for check in self.checks:
            modes = check.last_modes()
            for key, mode in (modes or {}).items():
                out[(key, check.process_set.size())] = mode
        return out

    @decisions.setter
    def decisions(self, value):
        self.picks = value

    def link(self, process_set):
        """The measured :class:`horovod_twobit.state.fallback.Link` of this process set (rank 0's
        figures, broadcast), measured eagerly on first use."""
        key = (process_set.process_set_id, process_set.size())
        if key not in self.links:
            from horovod_twobit.tensorflow.exchange.link import measure
            with tf.init_scope():
                self.links[key] = measure(process_set, self)
        return self.links[key]

    def owner_residual(self, key, numel, rank, size):
        """This rank's residual variable as owner of a scatter chunk of bucket ``key`` (float32,
        ``numel`` values), created at zero on first use. Owners' residuals belong to a rank and a
        number of ranks (their chunks move when either changes): on a change they restart from
        zero, with a warning. Called when an exchange is traced, so a function traced before
        keeps the variables it captured."""
        if options.owners_move(self.owner_of, rank, size, len(self.owners)):
            self.owners.forget()
            self.owner_of = (rank, size)
        with tf.init_scope():
            like = tf.zeros([numel], tf.float32)
        return self.owners.get(key, like)

    def stats(self, reset=False, per_tensor=False):
        """What this compressor did, as a plain dict (eager only; see ``TwoBitCompressor.stats``)."""
        if self.norms is None:
            self.norms = residual_norms(self.residuals)  # keeps its traced reader
        out = self.stats_slots.snapshot(self.norms, self.threshold, per_tensor, reset)
        checks = [c.summary() for c in self.checks]
        if any(checks):
            out["fallback_checks"] = [c for c in checks if c]
        return out

    def state_dict(self):
        """This rank's residuals (NumPy copies) keyed by tensor name, with the threshold, rank and
        number of ranks they belong to (the PyTorch binding's layout), and its scatter owners'
        residuals keyed by bucket. Eager only."""
        return checkpoint.make(self.threshold, *rank_size(), self.residuals.state_dict(),
                               self.owners.state_dict())

    def load_state_dict(self, saved):
        """Restores residuals saved by :meth:`state_dict` (of either binding). Saved by another
        rank or with another number of ranks, they restart from zero with a warning."""
        residuals = checkpoint.residuals_to_load(saved, self.threshold, *rank_size())
        if residuals is None:
            self.residuals.reset()
            self.owners.reset()
            self.owner_of = None
        else:
            self.residuals.load_state_dict({k: np.asarray(v) for k, v in residuals.items()})
            self.owners.load_state_dict({k: np.asarray(v) for k, v in
                                         checkpoint.owner_residuals_to_load(saved).items()})
            self.owner_of = rank_size()
        self.stats_slots.residuals_changed()
        self._residuals_replaced()

    def _residuals_replaced(self):
        """The plain exchange's "residuals known to be zero" flags no longer hold."""
        for flag in self.zero_flags.values():
            flag.assign(False)

    def reset(self):
        """Sets every residual back to zero, the scatter owners' too, and forgets the fallback's
        link measurements and decisions (made again when an exchange is next traced)."""
        self.residuals.reset()
        self.owners.reset()
        self.stats_slots.residuals_changed()
        self._residuals_replaced()
        self.picks.clear()
        self.links.clear()
