"""One bucket's (or tensor's) step through the scatter exchange in TensorFlow
(``TwoBitCompressor(..., exchange="scatter")``), eagerly or inside ``tf.function``.

The encode is the allgather exchange's (:class:`~horovod_twobit.tensorflow.exchange.single.Exchange`
or :class:`~horovod_twobit.tensorflow.exchange.bucket.BucketExchange`: the same payload, the same worker
residuals); then

1. the payload is cut into N chunk payloads (:func:`scatter_codec.chunk_payloads`, the PyTorch
   binding's bytes) and sent to their owners with Horovod's ``alltoall`` (with splits);
2. this rank, owner of one chunk, checks every sender's chunk and sums them
   (:func:`scatter_codec.owner_reduce`; "auto": re-encoded with its owner residual, a
   ``tf.Variable`` of :attr:`TwoBitCompressor.owners`), and its phase-2 payload goes out with
   Horovod's ``allgather``;
3. every rank decodes all owners' chunks and commits its residuals
   (:func:`scatter_codec.finish_reduced`).

Unlike the PyTorch binding (whose asynchronous handles need someone to submit phase 2 once phase 1
has arrived, ``torch.progress``), there is no progress problem here: the exchange is one piece of
graph (eager callers run it as a cached ``tf.function``), phase 2's allgather takes phase 1's
reduced payload as input, so TensorFlow's executor runs it as soon as the alltoall is done, on
every rank, whatever else the graph waits on.

Before phase 1 the ranks agree on the exchange (:func:`agreed`: an allgather of a 32-byte plan
under the allgather exchange's name; in the graph one more dependency of phase 1, at every step),
so ranks that mix exchanges raise instead of hanging.

Mismatches are decided from headers that every owner receives alike: every rank raises the same
:class:`~horovod_twobit.wire.PayloadMismatchError` (eagerly as such; in a graph inside the
``tf.errors.UnknownError`` that carries it, see :mod:`communicator`), and since phase 2's payload
takes the check's result as data no rank submits phase 2: no hang. NaN or Inf in a member's
gradient on any rank: the member is NaN on every rank, and neither the workers' nor the owners'
residuals of that member change.
"""

import functools

import numpy as np
import tensorflow as tf

import horovod.tensorflow.mpi_ops as mpi_ops

from horovod_twobit.wire import scatter as scatter_wire, checks as wire_checks
from horovod_twobit.tensorflow.exchange import bucket
from horovod_twobit.tensorflow.codec import scatter as scatter_codec
from horovod_twobit.tensorflow import codec


def chunks_of(state, layout, nranks):
    """The (cached) :class:`~horovod_twobit.wire.scatter.Chunks` of ``layout`` for ``nranks``."""
    cache = state.eager_fns  # plain state, not a checkpoint dependency
    key = ("chunks", id(layout), layout.digest, layout.auto, int(nranks))
    got = cache.get(key)
    if got is None or got.layout is not layout:
        got = cache[key] = scatter_wire.Chunks(layout, nranks)
    return got


class ScatterStep:
    """One step of the scatter exchange on one rank, around an encoded exchange ``ex`` (of
    ``keys``, ``layout``), as owner ``owner`` of ``nranks``. The collectives are the caller's:
    :attr:`send` / :attr:`splits` go to the alltoall, :meth:`reduce` makes the allgather's input
    from its output, :meth:`finish` the results from the allgather's output."""

    def __init__(self, state, ex, layout, keys, nranks, owner):
        self.state, self.ex, self.layout, self.keys = state, ex, layout, list(keys)
        self.nranks, self.owner = int(nranks), int(owner)
        self.chunks = chunks_of(state, layout, nranks)
        self.send, self.splits = scatter_codec.chunk_payloads(self.chunks, ex.payload,
                                                              state.threshold)
        self.divisor = tf.constant(1.0, tf.float32)
        self.bad = None

    def reduce(self, received, splits):
        """The phase-2 payload from the alltoall's output; with "auto", also commits this owner's
        residual (in a graph: a dependency of the returned payload)."""
        c, chunks = self.state, self.chunks
        residual = None
        if self.layout.auto:
            residual = c.owner_residual(scatter_wire.owner_key(self.keys),
                                        chunks.values(self.owner), self.owner, self.nranks)
        payload, self.bad, new = scatter_codec.owner_reduce(
            chunks, received, splits, self.keys, self.owner, c.threshold, c.auto_rule,
            None if residual is None else residual.read_value())
        if self.ex.op == mpi_ops.Average:
            # the number of chunk payloads received, a run-time value (see Exchange.finish)
            self.divisor = tf.cast(tf.size(received) // chunks.sent_words(self.owner), tf.float32)
        if residual is None:
            return payload
        with tf.control_dependencies([residual.assign(new)]):
            return tf.identity(payload)

    def finish(self, gathered):
        """The results (each tensor's shape and dtype) from the allgather's output; commits this
        rank's worker residuals (the allgather exchange's error feedback)."""
        ex, lay = self.ex, self.layout
        out, keep = scatter_codec.finish_reduced(self.chunks, gathered, self.keys,
                                                 self.state.threshold, self.bad,
                                                 self.divisor, ex.scale)
        before = tf.reshape(ex.before, [-1])
        new = tf.where(keep, before, codec.committed(ex.grad, before, ex.threshold, ex.magnitude))
        return bucket.commit(lay, ex.residuals, new, ex.tensors, out)


def agreed(state, layout, keys, ex_payload, process_set, op_name, ignore_name_scope):
    """A boolean tensor, True once every rank has announced the scatter exchange for this bucket:
    its plan (:meth:`Layout.plan`) allgathered under the name, and in the name scope, of the
    allgather exchange's payload. A rank that uses the allgather exchange for the same tensors
    submits its payload under that name, that collective completes, and every rank raises the
    same PayloadMismatchError naming the ranks of each kind (the wire parsers recognise plans),
    instead of waiting forever on an alltoall the others never submit.

    Unlike the PyTorch binding, which announces once per bucket and number of ranks, a graph
    announces at every step: Horovod names a collective after its node's path, and a node inside
    a ``tf.cond`` branch (what "only the first time" would need) gets a path that depends on the
    rest of the graph, so it would not meet the other rank's payload; it would hang. The cost is
    one allgather of 32 bytes per rank, bucket and step."""
    nranks = process_set.size()
    plan = layout.plan(state.threshold)
    # from a run-time value: Grappler's constant folding would run a collective of a constant
    words = tf.constant(plan, tf.int32) + tf.bitwise.bitwise_and(ex_payload[1:2], 0)
    gathered = mpi_ops.allgather(words, name=op_name,
                                 process_set=process_set, ignore_name_scope=ignore_name_scope)
    need, mine = nranks * len(plan), tf.constant(plan * nranks, tf.int32)
    ok = tf.logical_and(tf.equal(tf.size(gathered), need),
                        tf.reduce_all(tf.equal(scatter_codec.fitted(gathered, need), mine)))
    return scatter_codec.guard(ok, functools.partial(_check_plans, layout, nranks, keys),
                               [gathered])


def _check_plans(layout, nranks, keys, gathered):
    """Parses gathered plans as the allgather exchange parses payloads (see ``torch.codec``)."""
    flat = [int(x) for x in np.asarray(gathered).reshape(-1)]
    if layout.single:
        wire_checks.split_gathered(flat, nranks, keys[0])
    else:
        wire_checks.split_bucket(lambda a, b: flat[a:b], len(flat), nranks, list(keys))


def run(state, ex, layout, keys, process_set, op_name, ignore_name_scope):
    """The scatter exchange of an encoded ``ex`` over ``process_set``: the plan's agreement,
    alltoall, owner reduce, allgather, finish. Returns the results."""
    step = ScatterStep(state, ex, layout, keys, process_set.size(), process_set.rank())
    ok = agreed(state, layout, keys, ex.payload, process_set, op_name, ignore_name_scope)
    send = tf.where(ok, step.send, tf.zeros_like(step.send))  # phase 1 waits for the agreement
    received, splits = mpi_ops.alltoall(send, splits=step.splits, name=op_name,
                                        process_set=process_set,
                                        ignore_name_scope=ignore_name_scope)
    gathered = mpi_ops.allgather(step.reduce(received, splits), name=op_name + "_reduced",
                                 process_set=process_set, ignore_name_scope=ignore_name_scope)
    return step.finish(gathered)
