"""The fallback's measurements (:mod:`horovod_twobit.state.fallback`) in TensorFlow, as the PyTorch
binding's (:mod:`horovod_twobit.torch.exchange.link`), the step-time model's inputs for its per-bucket
decision: the link, by timed allreduces and allgathers of known size through Horovod, and the
codec rate, by one encode and the decode-sum of N payloads of known size; rank 0's figures are
broadcast, so every rank decides alike. Runs eagerly: an exchange traced inside a ``tf.function``
measures under ``tf.init_scope`` while it is being traced, which every rank does at the same
point of its program."""

import contextlib
import threading
import time

import numpy as np
import tensorflow as tf

import horovod.tensorflow.mpi_ops as mpi_ops

from horovod_twobit.state import fallback
from horovod_twobit.state.fallback import BIG, Link, allgather_values, figures


def _allreduce(process_set):
    """``run(values, i)``: one allreduce of ``values`` zeros (1 or ``BIG``), the ``i``-th."""
    xs = {n: tf.zeros([n], tf.float32) for n in (1, BIG)}

    def run(values, i):
        mpi_ops._allreduce(xs[values], name="twobit.link.%d.%d" % (values, i), op=mpi_ops.Sum,
                           process_set=process_set).numpy()
    return run


def _allgather(process_set):
    """``run(values, i)``: one allgather of ``values`` zeros per rank (1 or
    :func:`~horovod_twobit.state.fallback.allgather_values`), the ``i``-th."""
    xs = {n: tf.zeros([n], tf.float32) for n in (1, allgather_values(process_set.size()))}

    def run(values, i):
        mpi_ops.allgather(xs[values], name="twobit.link.gather.%d.%d" % (values, i),
                          process_set=process_set).numpy()
    return run


def _codec_seconds(state, nranks, values):
    """Seconds of a step's codec work on ``values`` values: one encode, and the decode-sum of
    ``nranks`` payloads (this rank's, repeated, in the place of the gathered ones)."""
    from horovod_twobit.tensorflow.exchange.single import Exchange
    scratch = type(state)(state.threshold, block=state.block,
                               blocks=state.blocks, bucket_bytes=0)  # a TwoBitState
    g = tf.random.stateless_normal([values], seed=[1, 2])

    @tf.function(autograph=False)
    def codec_pass(g):
        ex = Exchange(scratch, g, "twobit.link", mpi_ops.Sum, 1.0, 1.0, nranks)
        return ex.finish(tf.tile(ex.payload, [nranks]))

    codec_pass(g).numpy()  # traced once, untimed
    best = float("inf")
    for _ in range(3 if values >= BIG else 7):
        t0 = time.perf_counter()
        codec_pass(g).numpy()
        best = min(best, time.perf_counter() - t0)
    return best


def measure(process_set, state):
    """A :class:`Link` of ``process_set`` from rank 0's measurements. Eager only."""
    if not tf.executing_eagerly():
        raise RuntimeError("TwoBitCompressor(fallback=\"auto\") measures the link eagerly, when its "
                           "first exchange is traced; TF1 graph mode cannot: use fallback=None or "
                           "\"always\" there")
    N = process_set.size()
    got = figures(N, _allreduce(process_set),
                  lambda n: _codec_seconds(state, max(N, 1), n),
                  allgather=_allgather(process_set) if N > 1 else None)
    got = mpi_ops.broadcast(tf.constant(got, tf.float64), 0, name="twobit.link.figures",
                            process_set=process_set)
    return Link(*got.numpy().tolist())


# ----------------------------------------------------------------- the checked decision
_local = threading.local()


class Check:
    """``fallback="auto"``'s checked decision (:mod:`horovod_twobit.state.fallback`) for one
    traced gradient reduction: made when :mod:`..grads_fn` traces it, so a retrace (a new step
    shape, new buckets) checks anew the buckets no check has settled yet; a bucket a check has
    settled (``state.settled``) keeps its mode in the retraced step without one, and where
    every gradient's bucket is settled the retraced step has no check at all
    (:func:`settles`). The step's mode is decided in the graph from the number
    of steps run, the same on every rank: the model's picks at step 0, the schedule's modes in
    turns after it (set when the trace ends, from every bucket's pick; another block of them at
    a time while rank 0's rounds are not sure), then the mode that rank 0's medians chose,
    broadcast at the first step after the schedule. A step's figure runs
    from the start of its traced gradient reduction (its gradients there) to the next step's
    (the whole step)."""

    def __init__(self, state, process_set, after=()):
        self.state, self.process_set = state, process_set
        self.firsts = {}  # bucket key -> (model pick, modelled (compressed s, plain s))
        self.members = set()  # the keys of its buckets' members
        self.steps = None
        self.serial = state.checks_made
        state.checks_made += 1
        self.count = state.variable(np.int64(0))
        self.length = state.variable(np.int64(0))
        # the longest schedule with the settings of now (read at each trace)
        self.max_steps = fallback.start_steps() - 2
        self.ends = None  # where a block of the schedule may end (set at the trace's end)
        self.sched = state.variable(np.zeros(self.max_steps, np.int32))
        self.starts = state.variable(np.full(self.max_steps, np.nan))  # of scheduled steps
        self.chosen = state.variable(np.int32(fallback.MODEL))
        self.figures = state.variable(np.full(len(fallback.MODE_NAMES), np.nan))
        self.step = self.count.read_value()
        # the step's start: once its gradients (``after``) are there, whatever the mode. Without
        # a dependency the timestamp runs wherever the executor puts it, which can differ
        # between the modes' graphs and bias one mode's figure against another's
        with tf.control_dependencies([t for t in after if isinstance(t, tf.Tensor)]):
            self.t0 = tf.timestamp()
        n = self.length.read_value()
        decide_now = tf.logical_and(tf.equal(self.step, n + 1), n > 0)
        # (the schedule's length now, the mode kept): a decision keeps a mode, or makes the
        # schedule a block longer, this step its next
        self.n, chosen = tf.cond(decide_now, self._decide,
                                 lambda: (tf.identity(n), self.chosen.read_value()))
        scheduled = tf.gather(self.sched.read_value(),
                              tf.clip_by_value(self.step - 1, 0, self.max_steps - 1))
        # the exchanges take their mode from here, so none starts before the step's start was
        # read: else the executor may read it after some of one mode's work (the compressed
        # encode, about 1 ms of a 52-tensor MLP's step), which that mode's figure then misses
        # and the mode before it pays
        with tf.control_dependencies([self.t0]):
            self.mode = tf.where(tf.equal(self.step, 0), fallback.MODEL,
                                 tf.where(self.step <= self.n, scheduled, chosen))

    def _decide(self):
        n = self.length.read_value()
        got = tf.numpy_function(self._assess, [self.sched.read_value(), self.starts.read_value(),
                                               n, self.t0], tf.float64, stateful=True)
        got = tf.reshape(got, [len(fallback.MODE_NAMES) + 1])
        if self.process_set.size() > 1:
            got = mpi_ops.broadcast(got, 0, name="twobit.fallback.checked.%d" % self.serial,
                                    process_set=self.process_set)
        n_then, chosen = tf.numpy_function(self._choose, [got, n], [tf.int64, tf.int32],
                                           stateful=True)
        n_then, chosen = tf.reshape(n_then, []), tf.reshape(chosen, [])
        figures = got[:len(fallback.MODE_NAMES)]
        done = got[-1] > 0.5
        updates = [self.length.assign(n_then),
                   self.figures.assign(tf.where(done, figures, self.figures.read_value())),
                   self.chosen.assign(chosen)]
        with tf.control_dependencies(updates):
            return tf.identity(n_then), tf.identity(chosen)

    def _assess(self, sched, starts, n, now):
        """:func:`fallback.assess` from the scheduled steps' starts and ``now``, the next
        step's."""
        n = int(n)
        return np.array(fallback.assess([int(m) for m in sched[:n]],
                                        [float(s) for s in starts[:n]] + [float(now)],
                                        n >= self.ends[-1]), np.float64)

    def _choose(self, got, n):
        """(The schedule's length from now, the mode kept: the model's pick while the check goes
        on) from rank 0's verdict ``got``, after ``n`` scheduled steps."""
        _, chosen, length = fallback.verdict(got, int(n), self.ends,
                                             "%d buckets" % len(self.firsts))
        if chosen is None:
            return np.int64(length), np.int32(fallback.MODEL)
        self._settle(chosen)
        return np.int64(length), np.int32(chosen)

    def _settle(self, chosen):
        """Every bucket's mode, now that the check kept ``chosen``: a retrace keeps it."""
        n = self.process_set.size()
        for key, (pick, _) in self.firsts.items():
            self.state.settled[(key, n)] = fallback.is_plain(chosen, pick)
        self.state.settled_keys.setdefault(n, set()).update(self.members)

    def plain(self, key, pick, times, members=()):
        """Whether bucket ``key`` (model pick ``pick``, its members' keys ``members``) goes plain
        this step: a 0-d bool tensor. ``times()``: the model's (compressed, plain) seconds for
        it."""
        self.members.update(members)
        if key not in self.firsts:
            self.firsts[key] = (bool(pick), times())
        return tf.logical_or(tf.equal(self.mode, fallback.PLAIN),
                             tf.logical_and(tf.equal(self.mode, fallback.MODEL), bool(pick)))

    def end(self, results):
        """After the step's buckets were traced: sets the schedule (now, eagerly), and records the
        step's start and count in the graph; returns ``results`` after them."""
        self.steps, self.ends = fallback.blocks(list(self.firsts.values()))
        if not self.steps:  # nothing to check: the model's picks hold, in a retrace too
            self._settle(fallback.MODEL)
        with tf.init_scope():
            padded = self.steps + [0] * (self.max_steps - len(self.steps))
            self.sched.assign(np.array(padded, np.int32))
            self.length.assign(self.ends[0])
        timed = tf.logical_and(self.step >= 1, self.step <= self.n)
        index = tf.reshape(tf.clip_by_value(self.step - 1, 0, self.max_steps - 1), [1, 1])
        updates = [tf.cond(timed,
                           lambda: self.starts.scatter_nd_update(index, [self.t0]).value()[0],
                           lambda: self.t0),
                   self.count.assign_add(1)]
        present = [i for i, r in enumerate(results) if r is not None]
        if not present:
            return list(results)
        with tf.control_dependencies(updates):  # one op for all of them, not one each
            after = tf.identity_n([results[i] for i in present])
        out = list(results)
        for i, r in zip(present, after):
            out[i] = r
        return out

    def last_modes(self):
        """{bucket key: "plain" / "compressed"} of the last step run (eager), or None before one."""
        step = int(self.count.numpy()) - 1
        if step < 0:
            return None
        n = int(self.length.numpy())
        mode = (fallback.MODEL if step == 0 else
                int(self.sched.numpy()[step - 1]) if step <= n else int(self.chosen.numpy()))
        return {k: "plain" if fallback.is_plain(mode, p) else "compressed"
                for k, (p, _) in self.firsts.items()}

    def ran(self):
        """Whether a step of this check's trace has run (eager)."""
        return int(self.count.numpy()) > 0

    def summary(self):
        """The check for the stats: None until decided."""
        n = int(self.length.numpy())
        if not n or int(self.count.numpy()) <= n + 1:
            return None
        return fallback.summary(n, int(self.chosen.numpy()), self.figures.numpy().tolist())


@contextlib.contextmanager
def checking(check):
    """The :class:`Check` the exchanges this thread traces next take their mode from."""
    prev = getattr(_local, "check", None)
    _local.check = check
    try:
        yield
    finally:
        _local.check = prev


def current():
    return getattr(_local, "check", None)


def settles(state, keys, nranks):
    """Whether decided checks have settled the buckets of every gradient of ``keys`` with
    ``nranks`` ranks: a gradient reduction traced then needs no check."""
    return bool(keys) and set(keys) <= state.settled_keys.get(nranks, set())
