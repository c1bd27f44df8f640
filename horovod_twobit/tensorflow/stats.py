"""``TwoBitCompressor.stats()`` for TensorFlow: every exchange (eager or traced) keeps, per
bucket, variables that the graph updates at each step: this rank's last payload, the number of
steps and the number of steps whose result was NaN. Updating them is a copy of the payload (a
sixteenth of the gradient's bytes) and two scalar additions on the device: no host round trip.
Reading (:meth:`Slots.snapshot`) fetches them and summarizes them as the PyTorch binding does
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

    def snapshot(self, residual_norms, threshold, per_tensor=False, reset=False):
        with self._lock:
            slots = list(self._slots.values())
        last, totals = {}, (dict.fromkeys(stats.EXCHANGES, 0), dict.fromkeys(stats.EXCHANGES, 0))
        nonfinite = 0
        # a bucket may have stepped in several slots (another exchange after a fallback decision,
        # another number of ranks): its last step is its slot's with the latest stamp
        slots.sort(key=lambda s: int(s.stamp.numpy()))
        for s in slots:
            steps, bad = int(s.steps.numpy()), int(s.nonfinite.numpy())
            totals[0][s.exchange] += (steps - s.base[0]) * s.nbytes
            totals[1][s.exchange] += steps - s.base[0]
            nonfinite += bad - s.base[1]
            if reset:
                s.base = (steps, bad)
            if steps:
                values = sum(s.layout.numels)
                if s.payload is None:  # uncompressed: every value sent, no levels
                    reader = lambda v=values: (v, 0.0, 0)  # noqa: E731
                else:
                    reader = lambda p=s.payload.numpy(), s=s: stats.payload_counts(  # noqa: E731
                        s.layout, p, threshold)
                last[scatter_wire.owner_key(s.names)] = stats.Step(s.names, s.exchange, s.nbytes,
                                                                  reader, values)
        return stats.summarize(last, *totals, nonfinite, residual_norms, threshold, per_tensor)


def residual_norms(residuals):
    """The ``residual_norms`` function of :func:`horovod_twobit.stats.summarize` for a
    compressor's :class:`~horovod_twobit.tensorflow.residuals.Residuals`: one traced call reads
    every residual asked for and returns their (sum of squares in float64, max |r|), one host
    transfer for all of them."""
    fns = {}

    def norms(names):
        found = []
        for n in names:
            try:
                found.append((n, residuals.variable(n)))
            except KeyError:  # not made yet (restored, never used)
                continue
        if not found:
            return {}
        key = tuple((n, id(v)) for n, v in found)
        fn = fns.get(key)
        if fn is None:
            fns.clear()  # residuals were made or replaced: the old function is stale
            fn = fns[key] = _norms_fn([v for _, v in found])
        values = fn().numpy()
        return {n: (float(values[i, 0]), float(values[i, 1])) for i, (n, _) in enumerate(found)}
    return norms


def _norms_fn(variables):
    @tf.function(autograph=False)
    def read():
        rows = []
        for v in variables:
            x = tf.cast(tf.reshape(v.read_value(), [-1]), tf.float64)
            mx = tf.reduce_max(tf.abs(x)) if x.shape.num_elements() else tf.constant(0.0, tf.float64)
            rows.append(tf.stack([tf.reduce_sum(x * x), mx]))
        return tf.stack(rows)
    return read
