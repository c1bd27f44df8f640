"""``TwoBitCompressor.stats()`` for TensorFlow: every exchange (eager or traced) keeps, per
bucket, variables that the graph updates at each step: this rank's last payload, the number of
steps and the number of steps whose result was NaN. Updating them is a copy of the payload (a
sixteenth of the gradient's bytes) and two scalar additions on the device: no host round trip.
Reading (:meth:`Slots.snapshot`) fetches them, with the residuals' norms, in one traced call
(:func:`residual_norms`) and summarizes them as the PyTorch binding does
(:func:`horovod_twobit.stats.summarize`)."""

import threading

import numpy as np
import tensorflow as tf
from tensorflow.python.ops import resource_variable_ops

from .. import scatter_wire, stats


def _variable(init):
    with tf.init_scope():  # as residuals are made: eagerly, whatever traces first
        return resource_variable_ops.ResourceVariable(
            init, trainable=False, synchronization=tf.VariableSynchronization.NONE,
            aggregation=tf.VariableAggregation.NONE)


class _Slot:
    def __init__(self, layout, names, exchange, nbytes):
        self.layout, self.names, self.exchange, self.nbytes = layout, list(names), exchange, nbytes
        plain = exchange == "plain"  # the fallback: no payload, every value sent
        self.payload = None if plain else _variable(np.zeros(layout.payload_words, np.int32))
        self.steps = _variable(np.int64(0))
        self.nonfinite = _variable(np.int64(0))
        self.stamp = _variable(np.int64(0))  # the compressor's clock at this slot's last step
        self.base = (0, 0)  # (steps, nonfinite) at the last reset


class Slots:
    """The stats variables of one compressor, one slot per (bucket, exchange, number of ranks)."""

    def __init__(self):
        self._slots = {}
        self._lock = threading.Lock()
        self._clock = None  # counts bucket steps: which of a bucket's slots stepped last

    def record(self, layout, names, exchange, nranks, rank, payload, results):
        """Adds the step's updates to the graph: ``results`` (the exchange's outputs) returned
        after them."""
        key = (scatter_wire.owner_key(names), exchange, nranks)
        with self._lock:
            if self._clock is None:
                self._clock = _variable(np.int64(0))
            slot = self._slots.get(key)
            if slot is None:
                nbytes = (4 * sum(layout.numels) if exchange == "plain"
                          else scatter_wire.rank_bytes(layout, nranks, rank, exchange))
                slot = self._slots[key] = _Slot(layout, names, exchange, nbytes)
        # a member that held NaN or Inf on some rank is NaN everywhere: its first value tells
        nan = [tf.math.is_nan(tf.reshape(r, [-1])[0]) for r in results if r.shape.num_elements()]
        bad = tf.reduce_any(tf.stack(nan)) if nan else tf.constant(False)
        updates = [slot.steps.assign_add(1), slot.nonfinite.assign_add(tf.cast(bad, tf.int64)),
                   slot.stamp.assign(self._clock.assign_add(1))]
        if slot.payload is not None:
            updates.append(slot.payload.assign(payload))
        with tf.control_dependencies(updates):
            return [tf.identity(r) for r in results]

    def snapshot(self, reader, threshold, per_tensor=False, reset=False):
        """The stats as :func:`horovod_twobit.stats.summarize` gives them; ``reader``: the
        compressor's :func:`residual_norms` (every slot and residual norm in one traced call)."""
        with self._lock:
            slots = list(self._slots.values())
        counters, payloads, norms = reader(slots, per_tensor)
        last, totals = {}, (dict.fromkeys(stats.EXCHANGES, 0), dict.fromkeys(stats.EXCHANGES, 0))
        nonfinite = 0
        # a bucket may have stepped in several slots (another exchange after a fallback decision,
        # another number of ranks): its last step is its slot's with the latest stamp
        for i in sorted(range(len(slots)), key=lambda i: counters[i][2]):
            s, (steps, bad, _) = slots[i], counters[i]
            totals[0][s.exchange] += (steps - s.base[0]) * s.nbytes
            totals[1][s.exchange] += steps - s.base[0]
            nonfinite += bad - s.base[1]
            if reset:
                s.base = (steps, bad)
            if steps:
                values, key = sum(s.layout.numels), scatter_wire.owner_key(s.names)
                if s.payload is None:  # uncompressed: every value sent, no levels
                    reader = lambda v=values: (v, 0.0, 0)  # noqa: E731
                else:
                    reader = lambda p=payloads[i], s=s: stats.payload_counts(  # noqa: E731
                        s.layout, p, threshold)
                whole = None if per_tensor else (lambda n=norms[key]: n)
                last[key] = stats.Step(s.names, s.exchange, s.nbytes, reader, values, whole)
        per_name = norms if per_tensor else {}
        return stats.summarize(last, *totals, nonfinite,
                               lambda names: {n: per_name[n] for n in names if n in per_name},
                               threshold, per_tensor)


def residual_norms(residuals):
    """The reader :meth:`Slots.snapshot` takes, for a compressor's
    :class:`~horovod_twobit.tensorflow.residuals.Residuals`: ``reader(slots, per_tensor)`` ->
    (each slot's (steps, non-finite steps, stamp), each slot's payload or None, {bucket key or,
    with ``per_tensor``, tensor name: (sum of squares in float64, max |r|)} of the current
    residuals), all read by one traced call and one host transfer per output. The call is made
    once and kept (one per ``per_tensor``); it is traced again only when the slots or the
    residual variables change (the residuals' ``generation``)."""
    made = {}

    def read(slots, per_tensor):
        key = (tuple(map(id, slots)), residuals.generation)
        if made.get(per_tensor, (None,))[0] != key:  # slots or residuals were made or replaced
            groups = {}  # bucket key (or tensor name) -> its residual variables
            for s in slots:
                bucket = scatter_wire.owner_key(s.names)
                for n in s.names:
                    g = groups.setdefault(n if per_tensor else bucket, {})
                    try:
                        g[n] = residuals.variable(n)
                    except KeyError:  # not made yet (restored, never used)
                        pass
            made[per_tensor] = (key, list(groups),
                                _read_fn(slots, [list(g.values()) for g in groups.values()]))
        _, names, fn = made[per_tensor]
        counters, payloads, norms = fn()
        payloads = iter([p.numpy() for p in payloads])
        norms = norms.numpy()
        return (counters.numpy().tolist(),
                [None if s.payload is None else next(payloads) for s in slots],
                {k: (float(norms[i, 0]), float(norms[i, 1])) for i, k in enumerate(names)})
    return read


def _read_fn(slots, groups):
    """One traced call: the slots' counters ([slots, 3] int64), their payloads, and per group of
    residual variables its (sum of squares in float64, max |r|) ([groups, 2] float64)."""
    @tf.function(autograph=False)
    def read():
        counters = [tf.stack([s.steps.value(), s.nonfinite.value(), s.stamp.value()])
                    for s in slots]
        payloads = [s.payload.value() for s in slots if s.payload is not None]
        rows = [_norms([v.value() for v in g if v.shape.num_elements()]) for g in groups]
        counters = tf.stack(counters) if counters else tf.zeros([0, 3], tf.int64)
        return counters, payloads, tf.stack(rows) if rows else tf.zeros([0, 2], tf.float64)
    return read.get_concrete_function()


SMALL = 4096  # residuals of fewer values are reduced as one concatenation: fewer ops per read


def _norms(xs):
    """(sum of squares in float64, max |r|) of the residuals ``xs``, as a float64 pair: per large
    residual (per concatenation of the small ones) one float64 L2Loss (a single pass, exact
    squares), one max and one min."""
    small = [tf.reshape(x, [-1]) for x in xs if x.shape.num_elements() < SMALL]
    xs = [x for x in xs if x.shape.num_elements() >= SMALL] + ([tf.concat(small, 0)] if small
                                                                else [])
    if not xs:
        return tf.zeros([2], tf.float64)
    sq = 2 * tf.add_n([tf.raw_ops.L2Loss(t=tf.cast(x, tf.float64)) for x in xs])
    hi = tf.reduce_max(tf.stack([tf.reduce_max(x) for x in xs]))
    lo = tf.reduce_min(tf.stack([tf.reduce_min(x) for x in xs]))
    return tf.stack([sq, tf.cast(tf.maximum(hi, -lo), tf.float64)])
