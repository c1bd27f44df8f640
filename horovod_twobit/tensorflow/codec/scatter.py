"""The codec of the scatter exchange (:mod:`horovod_twobit.wire.scatter`) in TF ops, eagerly or
inside ``tf.function``: the PyTorch binding's ``scatter_codec`` (the same bytes, the same float32
operations), in three steps.

1. :func:`chunk_payloads`: cuts this rank's allgather payload (what ``Exchange`` or
   ``BucketExchange`` encoded) into N chunk payloads, one per owner, with their splits.
2. :func:`owner_reduce`: from what the ``alltoall`` delivered, checks every sender's chunk header,
   sums the N chunks of this rank's chunk in rank order and writes the phase-2 payload: count planes
   (numeric threshold) or the sum re-encoded in 3 bits with the owner's residual ("auto",
   :mod:`owner_codec`).
3. :func:`finish_reduced`: from what the ``allgather`` delivered, decodes every owner's chunk into
   the result and computes this rank's new residual.

Checks are decided by TF ops from the received bytes alone, so every rank decides alike; only a
failing check sends the bytes to the host, where :mod:`horovod_twobit.wire.scatter` raises the same
:class:`~horovod_twobit.wire.PayloadMismatchError` on every rank (in a graph: inside the
``tf.errors.UnknownError`` that carries it, as :mod:`communicator` explains). What must wait for a
check takes its result as data, and nothing before it can fail on a buffer of the wrong size.
"""

import functools

import numpy as np
import tensorflow as tf

from horovod_twobit.wire import scatter as sw
from horovod_twobit import wire
from horovod_twobit.tensorflow import codec
from horovod_twobit.tensorflow.codec import kernels, owner as owner_codec
from horovod_twobit.tensorflow.codec.counts import pack_counts, spread, unpack_counts


def guard(ok, host, inputs):
    """A boolean tensor, True once ``ok`` holds; else ``host(*inputs as NumPy)`` raises."""
    if tf.executing_eagerly():
        if not bool(ok):
            host(*[np.asarray(x) for x in inputs])
        return tf.constant(True)
    return tf.cond(ok, lambda: tf.constant(True), lambda: tf.reshape(tf.numpy_function(
        lambda *a: np.bool_(host(*a) or True), inputs, tf.bool, stateful=True), []))


def fitted(flat, need):
    """``flat`` cut or zero-padded to ``need`` words (nothing fails on a wrong size)."""
    return tf.reshape(tf.pad(flat[:need], [[0, tf.maximum(0, need - tf.size(flat))]]), [need])


def _parts(layout, payload):
    """(member flag words, segment magnitudes as int32, packed words) of an allgather payload
    (statically sliced): see ``torch.scatter_codec._parts``."""
    if layout.single:
        flags = tf.bitwise.bitwise_and(payload[1:2], wire.FLAG_NONFINITE)  # byte 0: member 0
        if layout.auto and not layout.mag_words:
            return flags, payload[4:5], payload[layout.body:]
        return flags, payload[layout.head_words:layout.body], payload[layout.body:]
    return (payload[wire.BUCKET_HEADER_WORDS:layout.head_words],
            payload[layout.head_words:layout.body], payload[layout.body:])


def chunk_payloads(chunks, payload, threshold):
    """(the alltoall's send buffer, its splits as an int32 constant): chunk c of this rank's
    ``payload`` with its header, for owner c."""
    layout = chunks.layout
    flags, mags, words = _parts(layout, payload)
    nonfinite = tf.bitwise.bitwise_and(payload[1:2], wire.FLAG_NONFINITE)
    pieces = []
    for c in range(chunks.nranks):
        a, b = chunks.seg_ranges[c]
        head = chunks.header(c, threshold)
        pieces += [tf.constant(head[:1], tf.int32),
                   tf.bitwise.bitwise_or(nonfinite, head[1]), tf.constant(head[2:], tf.int32),
                   flags, mags[a:b] if layout.auto else mags[:0],
                   words[chunks.word_starts[c]:chunks.word_starts[c + 1]]]
    splits = tf.constant([chunks.sent_words(c) for c in range(chunks.nranks)], tf.int32)
    return tf.concat(pieces, 0), splits


def _check_chunks(chunks, names, owner, received, splits):
    """Raises PayloadMismatchError (the same on every rank) for what the alltoall delivered."""
    splits = [int(s) for s in np.asarray(splits).reshape(-1)]
    flat = [int(x) for x in np.asarray(received).reshape(-1)]
    offs = [sum(splits[:s]) for s in range(len(splits))]
    headers = [sw.parse_header(flat[o:o + s]) for o, s in zip(offs, splits)]
    sw.check_headers(headers, names, owner, chunks.nranks)
    sw.check_lengths(splits, [chunks.sent_words(owner)] * chunks.nranks, names, "chunk")


def _check_reduced(chunks, names, gathered):
    flat = [int(x) for x in np.asarray(gathered).reshape(-1)]
    lengths = [chunks.reduced_words(c) for c in range(chunks.nranks)]
    sw.check_lengths([len(flat)], [sum(lengths)], names, "reduced")
    raise wire.PayloadMismatchError("tensor %r: owners sent malformed reduced chunks" % names[0])


def piece_values(chunks, c, per_piece, per_word=False):
    """One value per piece of chunk ``c`` repeated over the piece's words (``per_word``) or over
    the chunk's values."""
    words = [p[4] for p in chunks.pieces[c]]
    if per_word:
        return spread(per_piece, words, per_word=1)
    return spread(per_piece, words)[..., :chunks.values(c)]


def owner_reduce(chunks, received, splits, names, owner, threshold, rule=None, residual=None):
    """From the alltoall's output ``received`` (one chunk payload per sender, ``splits`` words
    each): (the phase-2 payload of chunk ``owner``, the members' bad flags (a bool tensor, the
    same on every rank), the owner's new residual ("auto", else None)). ``residual``: the owner's
    float32 residual of the chunk's values ("auto"); it keeps its value for pieces of members
    that held NaN or Inf, and wherever the check failed. ``rule`` is not used (phase 2's levels
    follow each piece's largest value)."""
    N, layout = chunks.nranks, chunks.layout
    sent = chunks.sent_words(owner)
    rows = tf.reshape(fitted(received, N * sent), [N, sent])
    head = chunks.header(owner, threshold)
    got = tf.concat([rows[:, :1], tf.bitwise.bitwise_and(rows[:, 1:2], ~wire.FLAG_NONFINITE),
                     rows[:, 2:sw.HEADER_WORDS]], 1)
    ok = tf.logical_and(tf.reduce_all(tf.equal(got, tf.constant([head], tf.int32))),
                        tf.logical_and(tf.equal(tf.size(received), N * sent),
                                       tf.reduce_all(tf.equal(splits, sent))))
    checked = guard(ok, functools.partial(_check_chunks, chunks, names, owner),
                     [received, splits])
    fw, nm, wc = chunks.flag_words, chunks.mags(owner), chunks.words(owner)
    body = sw.HEADER_WORDS + fw
    raw = tf.reshape(tf.bitcast(rows[:, sw.HEADER_WORDS:body], tf.uint8), [N, 4 * fw])
    bad = tf.logical_or(tf.reduce_any(tf.not_equal(raw[:, :layout.members], 0), 0),
                        tf.logical_not(checked))
    words = rows[:, body + nm:]
    reduced = tf.constant(chunks.header(owner, threshold, reduced=True), tf.int32)
    if not layout.auto:
        sign = (_signs_xla if kernels._compiled(16 * wc) else sender_signs)(words, 16 * wc)
        payload = tf.concat([reduced, _packed(sign + N, chunks.bits)], 0)
        return tf.where(checked, payload, tf.zeros_like(payload)), bad, None
    n = chunks.values(owner)
    mags = piece_values(chunks, owner, tf.bitcast(rows[:, body:body + nm], tf.float32), True)
    S = None
    for i in range(N):  # the decoded chunks summed in rank order (see codec.accumulate)
        c, t = codec.unpack(words[i], n), tf.repeat(mags[i], 16)[:n]
        S = codec.values(c, t) if S is None else codec.accumulate(S, c, t)
    if S is None or not n:
        S = tf.zeros([n], tf.float32)
    before = tf.reshape(residual, [-1])
    body, new = owner_codec.owner_encode(chunks.pieces[owner], wc, before, S, bad)
    new = tf.where(checked, new, before)
    payload = tf.concat([reduced, body], 0)
    return tf.where(checked, payload, tf.zeros_like(payload)), bad, new


def sender_signs(words, nvalues):
    """Per value of the (senders, words) 2-bit ``words``: how many senders sent +t minus how many
    sent -t (int32)."""
    sign = tf.zeros([nvalues], tf.int32)
    for i in range(words.shape[0]):
        c = tf.cast(codec.unpack(words[i], nvalues), tf.int32)
        sign += tf.where(tf.equal(c, wire.CODE_POS), 1, tf.where(tf.equal(c, wire.CODE_NEG), -1, 0))
    return sign


# One XLA call each from COMPILE_MIN_NUMEL values; one CPU thread, 8 ranks: the signs of an
# owner's 2.6 M-value chunk 98 -> 21 ms, packing its counts 34 -> 9 ms.
_signs_xla = tf.function(sender_signs, jit_compile=True, autograph=False)
_pack_xla = tf.function(pack_counts, jit_compile=True, autograph=False)
_unpack_xla = tf.function(unpack_counts, jit_compile=True, autograph=False)


def _packed(u, bits):
    """:func:`pack_counts`, one XLA call from ``COMPILE_MIN_NUMEL`` values."""
    return (_pack_xla if kernels._compiled(u.shape[0]) else pack_counts)(u, bits)


def _counts(words, nvalues, bits, nranks):
    """:func:`unpack_counts`, one XLA call from ``COMPILE_MIN_NUMEL`` values (21 M values at 8
    ranks, one CPU thread, then scaled by the threshold in graph ops: 421 -> 93 ms)."""
    return (_unpack_xla if kernels._compiled(nvalues) else unpack_counts)(words, nvalues, bits,
                                                                           nranks)


def finish_reduced(chunks, gathered, names, threshold, bad, divisor, scale):
    """The flat float32 result (``layout.values`` long) from the allgather's output ``gathered``
    (every owner's phase-2 payload in owner order): each chunk decoded, divided by ``divisor`` (a
    0-d float32 tensor, never a constant: see ``communicator.Exchange.finish``), times ``scale``;
    NaN for the members in ``bad`` (bools, from :func:`owner_reduce`). Also returns, per value,
    whether this rank's residual must keep its value (a bad member, or a failed check)."""
    layout, N = chunks.layout, chunks.nranks
    lengths = [chunks.reduced_words(c) for c in range(N)]
    need, offs = sum(lengths), [sum(lengths[:c]) for c in range(N)]
    flat = fitted(gathered, need)
    heads = np.concatenate([chunks.header(c, threshold, reduced=True) for c in range(N)])
    got = tf.gather(flat, np.concatenate([np.arange(o, o + sw.HEADER_WORDS) for o in offs]))
    ok = tf.logical_and(tf.equal(tf.size(gathered), need),
                        tf.reduce_all(tf.equal(got, tf.constant(heads, tf.int32))))
    checked = guard(ok, functools.partial(_check_reduced, chunks, names), [gathered])
    parts = []
    for c, o in enumerate(offs):
        body, n, wc = flat[o + sw.HEADER_WORDS:o + lengths[c]], chunks.values(c), chunks.words(c)
        if not n:
            continue
        if layout.auto:
            part = owner_codec.owner_values(body, chunks.pieces[c], wc, n)
        else:
            part = _counts(body, n, chunks.bits, N) * tf.constant(threshold, tf.float32)
        parts.append(part)
    out = tf.concat(parts, 0) if parts else tf.zeros([0], tf.float32)
    out = out / divisor
    if scale != 1.0:
        out = out * tf.constant(scale, tf.float32)
    keep = spread(tf.logical_or(bad, tf.logical_not(checked)),
                  layout.member_words)[:layout.values]
    return tf.where(keep, tf.constant(float("nan"), tf.float32), out), keep
