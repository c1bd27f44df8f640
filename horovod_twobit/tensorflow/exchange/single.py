"""The communicator: allgather the 2-bit payloads, decode every rank's, sum them in rank order.

Packed words cannot go through a summing allreduce, so each rank allgathers ``header + words``
(2 bits per value plus 20 bytes), checks that every rank sent a compatible payload, decodes each one
and sums them in rank order. With ``threshold="auto"`` each rank chooses its threshold and
magnitude from its own r + g (:func:`~horovod_twobit.tensorflow.codec.auto_levels`), sends the
magnitude in header word 4 with :data:`~horovod_twobit.wire.FLAG_AUTO`, and every receiver decodes
each payload with its sender's.
Every rank runs the same float32 arithmetic on the same bytes, so the result is bitwise identical
everywhere (and equal to the PyTorch binding's and the NumPy reference's). The residual is updated
only after the gather, and only when no rank's gradient held NaN or Inf; otherwise every rank's
result is NaN (so loss scalers skip the step) and every residual stays as it was.

Everything here is TensorFlow ops and runs eagerly or inside ``tf.function`` alike. The header check
is decided by TF ops from the gathered bytes alone (so every rank decides the same way); only when
it fails does the buffer go to the host, where :mod:`horovod_twobit.wire` parses it and raises
:class:`~horovod_twobit.wire.PayloadMismatchError` with the same message on every rank. Eagerly the
error is raised as such; inside a graph it surfaces as a ``tf.errors.UnknownError`` whose message
contains ``PayloadMismatchError: <the same message>``.
"""

import contextlib
import functools

import numpy as np
import tensorflow as tf

import horovod.tensorflow.mpi_ops as mpi_ops

from horovod_twobit.wire import scatter as scatter_wire, checks as wire_checks
from horovod_twobit import wire
from horovod_twobit.tensorflow.codec import kernels, native_ops
from horovod_twobit.tensorflow import codec
from horovod_twobit.tensorflow.exchange import bucket as bucket_exchange
from horovod_twobit.tensorflow.exchange.bucket import BucketExchange, layout_of


class Exchange:
    """One tensor's part of a collective: its payload, and what is needed to finish it."""

    def __init__(self, state, tensor, key, op, prescale, postscale, nranks):
        self.tensor = tensor
        self.key = key
        self.tensors, self.keys = [tensor], [key]  # as BucketExchange's (scatter_exchange)
        self.mode = state.threshold  # a number, or "auto"
        self.op = op
        self.scale = float(prescale) * float(postscale)
        self.nranks = int(nranks)
        self.numel = tensor.shape.num_elements()
        self.residual = state.residuals.get(key, tensor)
        self.residuals = [self.residual]
        self.stats_slots = state.stats_slots
        self.grad = codec._flat32(tensor)
        self.before = self.residual.read_value()
        self.auto = self.mode == "auto"
        n = self.numel
        self.block = wire.block_of(n, state.block, state.blocks)  # n is static
        head = layout_of(state, self.keys, self.tensors).header(self.mode)  # Layout.single's
        if self.block:
            # one (threshold, magnitude) per block of values; the magnitudes follow the header
            tb, vb = self._levels(state, self.block)
            self.threshold = codec.per_value(tb, self.block, n)
            self.magnitude = codec.per_value(vb, self.block, n)
            tbits = tf.concat([tf.constant(head[4:], tf.int32), tf.bitcast(vb, tf.int32)], 0)
        elif self.auto:
            # chosen from r + g on this rank; the magnitude is carried in the header (word 4,
            # float32 bits) and the residual commit uses both. Tensors: no host sync.
            self.threshold, self.magnitude = self._levels(state)
            tbits = tf.reshape(tf.bitcast(self.magnitude, tf.int32), [1])
        else:
            self.threshold = self.magnitude = self.mode
            tbits = tf.constant(head[4:], tf.int32)
        words, nonfinite = kernels.encode(self.grad, tf.reshape(self.before, [-1]), self.threshold)
        flags = tf.bitwise.bitwise_or(tf.cast(nonfinite, tf.int32) * wire.FLAG_NONFINITE, head[1])
        self.payload = tf.concat([tf.constant(head[:1], tf.int32), tf.reshape(flags, [1]),
                                  tf.constant(head[2:4], tf.int32), tbits, words], axis=0)

    def _levels(self, state, block=None):
        """This rank's (threshold, magnitude) of r + g, per block with ``block``: from the CPU op
        (:mod:`native_ops`) over the segments of the tensor's layout where the op serves, else
        as :func:`codec.auto_levels` and :func:`codec.block_levels` compute them with TF ops, the
        same bits."""
        rule = state.auto_rule
        if self.numel is None or not native_ops.usable(rule):
            if block:
                return codec.block_levels(self.before, self.grad, block, rule)
            return codec.auto_levels(self.before, self.grad, rule)
        lay = layout_of(state, self.keys, self.tensors)  # its blocks are the segments
        t, v = native_ops.segment_levels(self.grad, tf.reshape(self.before, [-1]),
                                         *native_ops.layout_ints(lay)[2:], rule=rule)
        return (t, v) if block else (t[0], v[0])

    def finish(self, gathered):
        """Checks, decodes and sums the gathered payloads; commits the residual; returns the result
        (the tensor's shape and dtype)."""
        n, t = self.numel, self.threshold
        raw = gathered
        gathered, checked = validated(raw, n, self.mode, self.nranks, self.key, self.block)
        rows = tf.reshape(gathered, [self.nranks, wire.HEADER_WORDS + wire.body_words(n, self.block)])
        nb = wire.num_blocks(n, self.block)
        if self.block:  # each sender's block magnitudes, one per word of its block
            ts = tf.repeat(tf.bitcast(rows[:, wire.HEADER_WORDS:wire.HEADER_WORDS + nb], tf.float32),
                           self.block // wire.VALUES_PER_WORD, axis=1)[:, :wire.num_words(n)]
        elif self.auto:  # each sender's payload is decoded with that sender's magnitude (word 4)
            ts = tf.bitcast(rows[:, 4], tf.float32)
        else:
            ts = tf.fill([self.nranks], tf.constant(t, tf.float32))
        # ``checked`` is True once the header check passed (it raises otherwise). Using it as data
        # makes the result and the residual update wait for the check in a graph.
        bad = tf.logical_or(tf.logical_not(checked), tf.reduce_any(tf.not_equal(
            tf.bitwise.bitwise_and(rows[:, 1], wire.FLAG_NONFINITE), 0)))
        if self.op == mpi_ops.Average:
            # Divided by the number of payloads gathered, a run-time value: Grappler rewrites a
            # division by a constant into a multiplication by its reciprocal, which is not the same
            # float32 result (x / 3 != x * (1 / 3) for some x), and every binding must divide.
            count = tf.cast(tf.size(raw) // (wire.HEADER_WORDS + wire.body_words(n, self.block)),
                            tf.float32)
        else:
            count = tf.constant(1.0, tf.float32)
        out, new = kernels.finish(
            rows[:, wire.HEADER_WORDS + nb:], ts, bad, count, self.grad,
            tf.reshape(self.before, [-1]), t, self.op == mpi_ops.Average, self.scale,
            self.magnitude)
        self.norms = codec.norms_if(self.stats_slots.norms_wanted(), new)
        self.bad = bad
        update = self.residual.assign(new)
        with tf.control_dependencies([update]):
            result = tf.reshape(out, self.tensor.shape)
            if result.dtype != self.tensor.dtype:
                result = tf.cast(result, self.tensor.dtype)
            return tf.identity(result)


def validated(gathered, numel, threshold, nranks, key, block=None):
    """Returns ``(fitted, checked)``: ``gathered`` cut or padded to ``nranks`` payloads of this
    rank's size, and a boolean tensor that is True once every rank's header is known to agree with
    this rank's (``threshold``: this rank's number, or ``"auto"``: then every header must carry
    :data:`~horovod_twobit.wire.FLAG_AUTO`, and the thresholds may differ; with ``block``, every
    header must carry the same block size and :data:`~horovod_twobit.wire.FLAG_BLOCKS`). Raises
    PayloadMismatchError on every rank otherwise (eagerly: here; in a graph: when the check op
    runs).

    In a graph the check is a stateful op (so it always runs), but TensorFlow does not reliably run
    it before ops that merely carry a control dependency on it: so nothing downstream may fail on a
    buffer of the wrong size and pre-empt the check's error (hence the fitted buffer), and what must
    wait for the check takes ``checked`` as data."""
    stride = wire.HEADER_WORDS + wire.body_words(numel, block)
    auto = isinstance(threshold, str) and threshold == "auto"
    head = wire.make_header(numel, 1.0 if auto else threshold, wire.FLAG_AUTO if auto else 0, block)

    # If every header equals this rank's (format, size, fixed threshold or "auto") then every
    # rank's own header, being among them, equals this one and every rank decides True; if not,
    # every rank decides False and parses the same bytes on the host. The decision is the same on
    # every rank.
    need = nranks * stride
    size = tf.size(gathered)
    fitted = tf.pad(gathered[:need], [[0, tf.maximum(0, need - size)]])
    h = tf.reshape(fitted, [nranks, stride])[:, :wire.HEADER_WORDS]
    cols = [0, 2, 3] if auto and not block else [0, 2, 3, 4]
    same = tf.reduce_all(tf.equal(tf.gather(h, cols, axis=1),
                                  tf.constant([[head[c] for c in cols]], tf.int32)))
    modes = wire.FLAG_AUTO | wire.FLAG_BLOCKS | wire.FLAG_PLAN  # these flags must be this rank's
    mode = tf.reduce_all(tf.equal(tf.bitwise.bitwise_and(h[:, 1], modes), head[1] & modes))
    ok = tf.logical_and(tf.equal(size, need), tf.logical_and(same, mode))
    if tf.executing_eagerly():
        if not bool(ok):
            _raise_mismatch(gathered.numpy(), nranks, key)
        return fitted, tf.constant(True)
    checked = tf.cond(ok, lambda: tf.constant(True),
                      lambda: tf.reshape(tf.numpy_function(
                          functools.partial(_host_check, nranks, key), [gathered], tf.bool,
                          stateful=True), []))
    return fitted, checked


def _raise_mismatch(flat, nranks, key):
    wire_checks.split_gathered([int(x) for x in np.asarray(flat).reshape(-1)], nranks, key)
    raise wire.PayloadMismatchError("tensor %r: ranks sent incompatible payloads" % (key,))


def _host_check(nranks, key, flat):
    _raise_mismatch(flat, nranks, key)
    return np.bool_(True)


MARKER = "PayloadMismatchError: "


def translate(error):
    """The PayloadMismatchError that a graph-mode ``tf.errors.OpError`` carries, or None."""
    msg = getattr(error, "message", "") or str(error)
    pos = msg.find(MARKER)
    if pos < 0:
        return None
    text = msg[pos + len(MARKER):].split("\n", 1)[0].strip()
    return wire.PayloadMismatchError(text)


def run(state, tensors, keys, op, prescale, postscale, process_set, op_name,
        ignore_name_scope):
    """Exchanges a list of dense floating-point tensors: one tensor alone, several as one bucket
    (:mod:`horovod_twobit.tensorflow.exchange.bucket`); one allgather either way, or with
    ``exchange="scatter"`` (or "auto" choosing it) an alltoall and an allgather
    (:mod:`horovod_twobit.tensorflow.exchange.scatter`). Returns the results."""
    nranks = process_set.size()
    layout = layout_of(state, keys, tensors)
    plain = state.plain(layout, keys, process_set)  # the fallback's decision
    if plain is True:
        return _plain(state, tensors, keys, op, prescale, postscale, process_set, op_name,
                      ignore_name_scope, layout)
    if plain is False:
        return _compressed(state, tensors, keys, op, prescale, postscale, process_set, op_name,
                           ignore_name_scope, layout)
    # checked on the first steps: this step's mode, the same on every rank
    if len(tensors) == 1 or scatter_wire.choose(state.exchange, layout, nranks) != "allgather":
        return _unlowered_cond(plain,
                               lambda: _plain(state, tensors, keys, op, prescale, postscale,
                                              process_set, op_name, ignore_name_scope, layout),
                               lambda: _compressed(state, tensors, keys, op, prescale, postscale,
                                                   process_set, op_name, ignore_name_scope,
                                                   layout))
    # a bucket: one Case of three branches, compressed, plain with the residuals known to be
    # zero, plain with them added; the gradients go in as one flat buffer and the results come
    # out as one. Every tensor into or out of a branch is an op of its own each step (an
    # argument or a return value of the branch run; a Switch or a Merge when lowered), and
    # the ops, not their work, are what a step of many small tensors pays for (about 5 us each
    # on a 2-core host): no cond inside the plain branches holds the members' residuals
    from horovod_twobit.tensorflow.exchange.plain import zero_flag
    grads = bucket_exchange.flat(layout, [codec._flat32(t) for t in tensors])
    known_zero = zero_flag(state, keys).read_value()
    index = tf.where(plain, tf.where(known_zero, 1, 2), 0)

    def plain_branch(known):
        return lambda: _plain(state, tensors, keys, op, prescale, postscale, process_set,
                              op_name, ignore_name_scope, layout, grads, known)
    with _unlowered():
        out = tf.switch_case(index, [
            lambda: _compressed(state, tensors, keys, op, prescale, postscale, process_set,
                                op_name, ignore_name_scope, layout, grads),
            plain_branch(True), plain_branch(False)])
    return bucket_exchange.members(layout, out[0], tensors)


@contextlib.contextmanager
def _unlowered():
    """Conds and cases built here stay one op that runs only the branch taken (their conds
    inside likewise). Lowered to Switch and Merge, as TensorFlow does by default in a
    function, every op of a branch not taken would still pass a dead tensor on, every step:
    for the fallback's two exchanges of a 52-tensor bucket, 5-13 % of a 10 ms step."""
    from tensorflow.python.ops import control_flow_util_v2 as cf_util
    prev = cf_util._DISABLE_LOWER_USING_SWITCH_MERGE
    cf_util._DISABLE_LOWER_USING_SWITCH_MERGE = True
    try:
        yield
    finally:
        cf_util._DISABLE_LOWER_USING_SWITCH_MERGE = prev


def _unlowered_cond(pred, true_fn, false_fn):
    """``tf.cond`` kept as one ``If`` op (:func:`_unlowered`)."""
    with _unlowered():
        return tf.cond(pred, true_fn, false_fn)


def _plain(state, tensors, keys, op, prescale, postscale, process_set, op_name,
           ignore_name_scope, layout, grads=None, known_zero=None):
    """The fallback: uncompressed, g + r. ``grads``: the gradients as one flat buffer, given
    by the checked exchange, which then takes the results as one flat buffer too, and tells
    ``known_zero`` (:func:`..plain.run`)."""
    from horovod_twobit.tensorflow.exchange import plain as plain_exchange
    out, bad = plain_exchange.run(state, tensors, keys, op, prescale, postscale, process_set,
                                  op_name, ignore_name_scope, layout, grads, known_zero)
    out = [out] if grads is not None else bucket_exchange.members(layout, out, tensors)
    return state.stats_slots.record(layout, keys, "plain", process_set.size(), process_set.rank(),
                                    None, out, bad=bad)


def _compressed(state, tensors, keys, op, prescale, postscale, process_set, op_name,
                ignore_name_scope, layout, grads=None):
    """The 2-bit exchange. ``grads``: a bucket's gradients as one flat buffer, given by the
    checked exchange (allgather only), which then takes the results as one flat buffer too."""
    nranks = process_set.size()
    if len(tensors) == 1:
        ex = Exchange(state, tensors[0], keys[0], op, prescale, postscale, nranks)
    else:
        ex = BucketExchange(state, tensors, keys, op, prescale, postscale, nranks, grads)
    exchange = scatter_wire.choose(state.exchange, layout, nranks)
    if exchange == "scatter":
        from horovod_twobit.tensorflow.exchange import scatter as scatter_exchange
        out = scatter_exchange.run(state, ex, layout, keys, process_set, op_name,
                                   ignore_name_scope)
        norms = bad = None  # the stats read this exchange's residuals when asked
    else:
        gathered = mpi_ops.allgather(ex.payload, name=op_name, process_set=process_set,
                                     ignore_name_scope=ignore_name_scope)
        if grads is not None:  # a bucket of the checked exchange: one flat buffer
            out = [ex.finish(gathered, as_flat=True)]
        else:
            out = ex.finish(gathered)
            out = out if len(tensors) > 1 else [out]
        norms, bad = ex.norms, ex.bad
    if state.fallback:  # the residuals move again: the plain exchange must add them
        from horovod_twobit.tensorflow.exchange.plain import zero_flag
        with tf.control_dependencies([zero_flag(state, keys).assign(False)]):
            out = list(tf.identity_n(out))
    return state.stats_slots.record(layout, keys, exchange, nranks, process_set.rank(),
                                    ex.payload, out, norms, bad)
