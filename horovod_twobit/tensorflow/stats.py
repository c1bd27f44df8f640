"""``TwoBitCompressor.stats()`` for TensorFlow: every exchange (eager or traced) keeps, per
bucket, variables that the graph updates at each step: the number of steps, the number of steps
whose result was NaN, and the step's summary: the values this rank sent as +-level (a population
count of its payload's high code bits), the sum and number of its levels ("auto"), and the new
residual's norms as the step computed them after its finish (:func:`codec.norms`), while reads
come every step or every other (:meth:`Slots.norms_wanted`; otherwise, and for the scatter
exchange and the fallback, the read computes them). Updating them is a few reductions and scalar
assignments on the device: no host round trip.

Each step also hands its bucket's row (counters, whether a read watched the step, and summary:
:data:`ROW` values) to the host. On a CPU with the codec's ops built (:mod:`native_ops`) an op
copies it into a table in that library at every step (:func:`native_ops.stats_row`: no Python,
no condition), which a read takes through ``ctypes``; elsewhere (a GPU) a ``tf.cond`` on a
variable has the step hand it over through a ``tf.numpy_function`` only while reads come at
least every other step. While they do (:meth:`Slots._follow`), the steps compute their norms
and a read whose rows all came that way costs no TensorFlow call; reads that come less often
turn the watch off, so that the steps between them do no host work. Otherwise
(:meth:`Slots.snapshot`) the rows are fetched, with the residual norms the steps did not compute
(per tensor, the scatter exchange, the fallback, after the residuals were loaded or reset), in one
traced call (:func:`residual_norms`). Both are summarized as the PyTorch
binding does (:func:`horovod_twobit.state.stats.summarize`)."""

import itertools
import threading
import weakref

import numpy as np
import tensorflow as tf
from tensorflow.python.ops import resource_variable_ops

from horovod_twobit.wire import scatter as scatter_wire
from horovod_twobit.state import stats
from horovod_twobit.tensorflow.codec import native_ops
from horovod_twobit.tensorflow import codec

# a slot's row: steps, non-finite steps, stamp, whether a read watched the step (its norms were
# computed), then its summary (sent, sum of levels, number of levels, sum of squares, max |r|)
ROW = 9
_keys = itertools.count(1)  # slots' numbers in the ops' table, unique in the process


def state_variable(init):
    """A variable of the compressor's own bookkeeping, made eagerly wherever it is asked for
    (also while a tf.function traces, which refuses tf.Variable there after its first trace)."""
    with tf.init_scope():  # as residuals are made: eagerly, whatever traces first
        return resource_variable_ops.ResourceVariable(
            init, trainable=False, synchronization=tf.VariableSynchronization.NONE,
            aggregation=tf.VariableAggregation.NONE)


class _Slot:
    def __init__(self, layout, names, exchange, nbytes):
        self.layout, self.names, self.exchange, self.nbytes = layout, list(names), exchange, nbytes
        self.bucket, self.values = scatter_wire.owner_key(names), sum(layout.numels)
        self.plain = exchange == "plain"  # the fallback: no payload, every value sent
        # (sent, sum of levels, number of levels, residual sum of squares, max |r|) at the last
        # step; the norms NaN where the step left them to the read
        self.summary = state_variable(np.zeros(5, np.float64))
        self.has_norms = None  # whether the step computes its norms (set by the first record)
        self.host = None  # its ROW at its last watched step (NumPy, or a list from the table)
        self.key = next(_keys)  # its row's number in the ops' table
        self.table = False  # whether its steps hand their rows to the ops' table
        self.steps = state_variable(np.int64(0))
        self.nonfinite = state_variable(np.int64(0))
        self.stamp = state_variable(np.int64(0))  # the compressor's clock at this slot's last step
        self.base = (0, 0)  # (steps, nonfinite) at the last reset


class Slots:
    """The stats variables of one compressor, one slot per (bucket, exchange, number of ranks)."""

    def __init__(self):
        self._slots = {}
        self._lock = threading.Lock()
        self._clock = None  # counts bucket steps: which of a bucket's slots stepped last
        self._stale = None  # the clock when the residuals were last loaded or reset
        self._watched = None  # while True, steps hand their rows to the host (see snapshot)
        self._watching = False
        self._seen = {}  # slot -> its steps at the last read
        self._keys = []  # the slots' rows in the ops' table, dropped with these slots
        self._table = None  # (the slots that use the table, their StatsRows reader)
        weakref.finalize(self, native_ops.forget_stats_rows, self._keys)

    def residuals_changed(self):
        """The residuals were loaded or reset outside a step: the norms that the slots' last
        steps computed no longer hold until each slot steps again (until then they are read)."""
        with self._lock:
            self._stale = 0 if self._clock is None else int(self._clock.numpy())

    def _made(self):
        if self._clock is None:  # under the lock
            self._clock = state_variable(np.int64(0))
            self._watched = state_variable(False)

    def norms_wanted(self):
        """A 0-d bool tensor for a step: whether to compute its new residual's norms after its
        finish (:func:`codec.norms_if`). True while reads come every step or every other (the
        steps then hand their rows to the host, norms included); otherwise the steps skip them
        and a read computes them from the residuals, so steps that nobody reads make no pass
        over their residuals."""
        with self._lock:
            self._made()
        return self._watched.value()

    def record(self, layout, names, exchange, nranks, rank, payload, results, norms=None,
               bad=None):
        """Adds the step's updates to the graph: ``results`` (the exchange's outputs) returned
        after them. ``payload``: this rank's (None for the fallback); ``norms``: the new residual's
        :func:`codec.norms` (NaN where the step skipped them: :meth:`norms_wanted`), or None to
        read them from the residuals when asked; ``bad``: a 0-d bool tensor, whether the results
        are NaN (a member's gradient held NaN or Inf on some rank), or None: then each result's
        first value tells."""
        key = (scatter_wire.owner_key(names), exchange, nranks)
        with self._lock:
            self._made()
            slot = self._slots.get(key)
            if slot is None:
                nbytes = (4 * sum(layout.numels) if exchange == "plain"
                          else scatter_wire.rank_bytes(layout, nranks, rank, exchange))
                slot = self._slots[key] = _Slot(layout, names, exchange, nbytes)
                self._keys.append(slot.key)
            if slot.has_norms is None:
                slot.has_norms = norms is not None
        if bad is None:  # a member that held NaN or Inf on some rank is NaN everywhere
            nan = [tf.math.is_nan(tf.reshape(r, [-1])[0]) for r in results
                   if r.shape.num_elements()]
            bad = tf.reduce_any(tf.stack(nan)) if nan else tf.constant(False)
        counters = [slot.steps.assign_add(1), slot.nonfinite.assign_add(tf.cast(bad, tf.int64)),
                    slot.stamp.assign(self._clock.assign_add(1))]
        if norms is None or not slot.has_norms:
            norms = tf.constant([np.nan, np.nan], tf.float64)
        summary = tf.concat([_counts(layout, payload), norms], 0)
        updates = counters + [slot.summary.assign(summary)]
        # the step hands its row to the host: a read then costs no TensorFlow call
        watched = self._watched.value()
        row = tf.concat([tf.cast(tf.stack(counters), tf.float64),
                         tf.reshape(tf.cast(watched, tf.float64), [1]), summary], 0)
        if native_ops.codec_usable():  # a copy into the ops' table, every step
            slot.table = True
            updates.append(native_ops.stats_row(row, slot.key))
        else:  # a host callback, only while read (``watched``)
            updates.append(tf.cond(watched, lambda: _to_host(slot, row),
                                   lambda: tf.constant(False)))
        with tf.control_dependencies(updates):
            return list(tf.identity_n(results))

    def snapshot(self, reader, threshold, per_tensor=False, reset=False):
        """The stats as :func:`horovod_twobit.state.stats.summarize` gives them; ``reader``: the
        compressor's :func:`residual_norms` (every slot, and the residual norms the slots do not
        hold, in one traced call)."""
        with self._lock:
            slots, stale = list(self._slots.values()), self._stale
        if self._watching and not (per_tensor or reset) and stale is None:
            out = self._from_table(slots, threshold)
            if out is not None:
                return out
        if self._watching:  # the rows the steps left in the ops' table
            table = [s for s in slots if s.table]
            if table and (self._table is None or self._table[0] != table):
                self._table = (table, native_ops.StatsRows([s.key for s in table], ROW),
                               _fast(table))
            for s, row in zip(table, self._table[1].read() if table else ()):
                s.host = row if row[3] == 1 else None  # a step that computed its norms
        # the buckets whose norms are read from the residuals: those whose steps do not compute
        # them, and, as the steps compute them only while watched (norms_wanted), those without
        # a row handed over since the watch began
        needed = {s.bucket for s in slots if per_tensor or stale is not None or not s.has_norms}
        read = needed | {s.bucket for s in slots if not self._watching or s.host is None}
        hosted = [s.host for s in slots]
        if self._watching and not read and all(h is not None for h in hosted):  # with the steps
            counters, summaries, norms = ([[int(x) for x in h[:3]] for h in hosted],
                                          [[float(x) for x in h[4:]] for h in hosted], {})
        else:
            counters, summaries, norms = reader(slots, per_tensor, read)
        self._follow(slots, counters, useful=not needed)
        if stale is not None and all(c[2] > stale for c in counters):
            with self._lock:  # every slot stepped since: its own norms hold again
                self._stale = None if self._stale == stale else self._stale
        last, totals = {}, (dict.fromkeys(stats.EXCHANGES, 0), dict.fromkeys(stats.EXCHANGES, 0))
        nonfinite = 0
        # a bucket may have stepped in several slots (another exchange after a fallback decision,
        # another number of ranks): its last step is its slot's with the latest stamp
        for i in sorted(range(len(slots)), key=lambda i: counters[i][2]):
            s, (steps, bad, _), row = slots[i], counters[i], summaries[i]
            totals[0][s.exchange] += (steps - s.base[0]) * s.nbytes
            totals[1][s.exchange] += steps - s.base[0]
            nonfinite += bad - s.base[1]
            if reset:
                s.base = (steps, bad)
            if steps:
                values, key = s.values, s.bucket
                if s.plain:  # uncompressed: every value sent, no levels
                    counts = (values, 0.0, 0)
                elif s.layout.auto:
                    counts = (int(row[0]), float(row[1]), int(row[2]))
                else:
                    counts = (int(row[0]), float(threshold), 1)
                whole = None
                if not per_tensor:  # the step's norms, unless read from the residuals
                    whole = norms[key] if key in norms else (float(row[3]), float(row[4]))
                last[key] = stats.Step(s.names, s.exchange, s.nbytes, lambda c=counts: c, values,
                                       None if whole is None else (lambda n=whole: n))
        per_name = norms if per_tensor else {}
        return stats.summarize(last, *totals, nonfinite,
                               lambda names: {n: per_name[n] for n in names if n in per_name},
                               threshold, per_tensor)

    def _from_table(self, slots, threshold):
        """:meth:`snapshot`'s common case, with less Python (a read right after a step runs
        cold: 60-80 us against 105-120 us on the MLP): while watched, every slot's row in the
        ops' table, from a watched step no more than two steps after the last read, each bucket
        in one slot; the dict that :func:`horovod_twobit.state.stats.summarize` gives, built straight from
        the rows with its parts (:func:`~horovod_twobit.state.stats.bucket_entry`,
        :func:`~horovod_twobit.state.stats.overall`). None where the case does not hold (then
        :meth:`snapshot` reads as usual)."""
        table = self._table
        if table is None or table[0] != slots or not table[2]:
            return None
        rows, seen = table[1].read(), self._seen
        for s, row in zip(slots, rows):
            if row[3] != 1 or not 0 < row[0] - seen.get(s, 0) <= 2:
                return None  # not watched, not stepped or read too long ago: the usual read
        total, steps = dict.fromkeys(stats.EXCHANGES, 0), dict.fromkeys(stats.EXCHANGES, 0)
        last = dict.fromkeys(stats.EXCHANGES, 0)
        nonfinite, sent, values, level_sum, level_count, buckets = 0, 0, 0, 0.0, 0, {}
        for i, s, key, kind in table[2]:
            row = rows[i]
            done = int(row[0]) - s.base[0]
            total[s.exchange] += done * s.nbytes
            steps[s.exchange] += done
            nonfinite += int(row[1]) - s.base[1]
            last[s.exchange] += s.nbytes
            if kind == "plain":
                nonzero, lsum, lcount = s.values, 0.0, 0
            elif kind == "auto":
                nonzero, lsum, lcount = int(row[4]), float(row[5]), int(row[6])
            else:
                nonzero, lsum, lcount = int(row[4]), float(threshold), 1
            sent, values = sent + nonzero, values + s.values
            level_sum, level_count = level_sum + lsum, level_count + lcount
            buckets[key] = stats.bucket_entry(s.names, s.exchange, s.values, s.nbytes, nonzero,
                                              lsum, lcount, float(row[7]), float(row[8]))
            s.host = row
        with self._lock:
            self._seen = {s: int(row[0]) for s, row in zip(slots, rows)}
        fraction, threshold = stats.overall(sent, values, level_sum, level_count, threshold)
        return {"bytes_total": total, "bucket_steps": steps, "nonfinite_steps": nonfinite,
                "bytes_last_step": last, "fraction_sent": fraction, "threshold": threshold,
                "buckets": buckets}

    def _follow(self, slots, counters, useful):
        """Turns the steps' handover on while reads come at least every other step of each
        bucket, off when they come less often (then each step would hand over rows that no read
        takes, and a read fetches them itself) or when the read needs the residuals anyway
        (``useful`` False: norms the steps do not compute). Rows kept from before a change are
        dropped."""
        with self._lock:
            if self._watched is None:
                return
            gaps = [c[0] - self._seen.get(s, 0) for s, c in zip(slots, counters)]
            self._seen = {s: c[0] for s, c in zip(slots, counters)}
            often = useful and max(gaps, default=0) <= 2
            if often != self._watching:
                for s in slots:  # only rows handed over from now on count
                    s.host = None
                self._watched.assign(often)
                self._watching = often


def _fast(slots):
    """Per slot (its place in ``slots``, the slot, its bucket's key, "plain", "auto" or
    "fixed"), in the order of the buckets' keys, for :meth:`Slots._from_table`; empty where a
    bucket has several slots or a slot's steps compute no norms (those reads go the usual
    way)."""
    if len({s.bucket for s in slots}) < len(slots) or not all(s.has_norms for s in slots):
        return ()
    kinds = [(i, s, s.bucket, "plain" if s.plain else "auto" if s.layout.auto else "fixed")
             for i, s in enumerate(slots)]
    return tuple(sorted(kinds, key=lambda k: k[2]))


def _to_host(slot, row):
    """A host callback in the step: keeps ``row`` (float64 [ROW]) as ``slot.host``."""
    def keep(r):
        slot.host = r.copy()
        return np.bool_(True)
    return tf.numpy_function(keep, [row], tf.bool, stateful=True)


def _counts(layout, payload):
    """(values sent as +-level, sum of the levels, number of levels) of this rank's ``payload``
    (a bucket or tensor of ``layout``), float64 in the graph, as
    :func:`horovod_twobit.state.stats.payload_counts` counts them: the codes 10 and 11 (high bit set)
    of its packed words; the magnitudes it carries with "auto" (else zeros: the threshold is
    known). The fallback (``payload`` None) sends every value."""
    if payload is None:
        return tf.constant([sum(layout.numels), 0.0, 0.0], tf.float64)
    high = tf.bitwise.bitwise_and(payload[layout.body:], tf.constant(-0x55555556, tf.int32))
    sent = tf.reduce_sum(tf.cast(tf.raw_ops.PopulationCount(x=high), tf.float64))
    if not layout.auto:
        return tf.stack([sent, tf.constant(0.0, tf.float64), tf.constant(0.0, tf.float64)])
    mags = payload[layout.head_words:layout.body] if layout.mag_words else payload[4:5]
    mags = tf.cast(tf.bitcast(mags, tf.float32), tf.float64)
    return tf.stack([sent, tf.reduce_sum(mags), tf.constant(float(mags.shape[0]), tf.float64)])


def residual_norms(residuals):
    """The reader :meth:`Slots.snapshot` takes, for a compressor's
    :class:`~horovod_twobit.tensorflow.residuals.Residuals`: ``reader(slots, per_tensor, read)``
    -> (each slot's (steps, non-finite steps, stamp), each slot's summary row, {bucket key in
    ``read`` or, with ``per_tensor``, tensor name: (sum of squares in float64, max |r|)} of the
    current residuals), all read by one traced call and one host transfer per output. The call is
    made once and kept per (``per_tensor``, ``read``); it is traced again only when the slots or
    the residual variables change (the residuals' ``generation``)."""
    made = {}

    def read(slots, per_tensor, wanted):
        mode, key = (per_tensor, frozenset(wanted)), (tuple(map(id, slots)), residuals.generation)
        if made.get(mode, (None,))[0] != key:  # slots or residuals were made or replaced
            groups = {}  # bucket key (or tensor name) -> its residual variables
            for s in slots:
                bucket = scatter_wire.owner_key(s.names)
                if bucket not in wanted:
                    continue
                for n in s.names:
                    g = groups.setdefault(n if per_tensor else bucket, {})
                    try:
                        g[n] = residuals.variable(n)
                    except KeyError:  # not made yet (restored, never used)
                        pass
            made[mode] = (key, list(groups),
                          _read_fn(slots, [list(g.values()) for g in groups.values()]))
        _, names, fn = made[mode]
        out = fn()
        rows = out[0].numpy()  # per slot: its 3 counters, then its 5 summary values
        norms = out[1].numpy() if names else None
        return (rows[:, :3].astype(np.int64).tolist(), rows[:, 3:].tolist(),
                {k: (float(norms[i, 0]), float(norms[i, 1])) for i, k in enumerate(names)})
    return read


def _read_fn(slots, groups):
    """One traced call: per slot its counters (steps, non-finite steps, stamp) and its summary,
    as one [slots, 8] float64 output; with ``groups``, a second output: per group of residual
    variables its (sum of squares in float64, max |r|) ([groups, 2] float64). Fewer outputs,
    fewer host transfers: a read costs about a call."""
    @tf.function(autograph=False)
    def read():
        rows = [tf.concat([tf.cast(tf.stack([s.steps.value(), s.nonfinite.value(),
                                             s.stamp.value()]), tf.float64),
                           s.summary.value()], 0) for s in slots]
        rows = tf.stack(rows) if rows else tf.zeros([0, 8], tf.float64)
        if not groups:
            return (rows,)
        return rows, tf.stack([_norms([v.value() for v in g if v.shape.num_elements()])
                               for g in groups])
    return read.get_concrete_function()


SMALL = 4096  # residuals of fewer values are reduced as one concatenation: fewer ops per read


def _norms(xs):
    """(sum of squares, max |r|) of the residuals ``xs``, as a float64 pair: :func:`codec.norms`
    per large residual (per concatenation of the small ones), their sums of squares added in
    float64, the largest of their max |r|."""
    small = [tf.reshape(x, [-1]) for x in xs if x.shape.num_elements() < SMALL]
    xs = [x for x in xs if x.shape.num_elements() >= SMALL] + ([tf.concat(small, 0)] if small
                                                                else [])
    if not xs:
        return tf.zeros([2], tf.float64)
    each = tf.stack([codec.norms(x) for x in xs])
    return tf.stack([tf.reduce_sum(each[:, 0]), tf.reduce_max(each[:, 1])])
