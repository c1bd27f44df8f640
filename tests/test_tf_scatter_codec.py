"""The scatter exchange in the TensorFlow binding: N ranks simulated in one process (one compressor
per rank; the alltoall and the allgather are concatenations), against the NumPy reference, bit for
bit, eagerly and inside tf.function."""

import numpy as np
import pytest
import tensorflow as tf

import horovod.tensorflow.mpi_ops as mpi_ops
from horovod_twobit import reference as ref
from horovod_twobit.reference import scatter as rs
from horovod_twobit.wire import scatter as sw
from horovod_twobit import wire
from horovod_twobit.tensorflow.codec import scatter as scatter_codec
from horovod_twobit.tensorflow import TwoBitCompressor
from horovod_twobit.tensorflow.exchange.bucket import BucketExchange, layout_of
from horovod_twobit.tensorflow.exchange.single import Exchange, translate
from horovod_twobit.tensorflow.exchange.scatter import ScatterStep

SIZES = [1, 15, 16, 17, 40, 480, 1000, 5003]


def _grads(sizes, nranks, step, scale=0.3):
    rng = np.random.default_rng(100 * step + 7)
    return [[(rng.standard_normal(n) * scale * rng.choice([0.1, 0.7, 3.0], n)).astype(np.float32)
             for n in sizes] for _ in range(nranks)]


def exchange(comps, keys, grads, op=mpi_ops.Average, prescale=1.0, postscale=1.0):
    """One step on every simulated rank (``comps[rank]``); returns each rank's results and the
    phase payloads."""
    N = len(comps)
    steps = []
    for rank, c in enumerate(comps):
        ts = [tf.constant(g) for g in grads[rank]]
        if len(ts) == 1:
            ex = Exchange(c, ts[0], keys[0], op, prescale, postscale, N)
        else:
            ex = BucketExchange(c, ts, keys, op, prescale, postscale, N)
        steps.append(ScatterStep(c, ex, layout_of(c, keys, ts), keys, N, rank))
    chunks = steps[0].chunks
    reduced = []
    for owner in range(N):  # what the alltoall hands each owner
        pieces = [tf.split(s.send, s.splits)[owner] for s in steps]
        splits = tf.constant([int(tf.size(p)) for p in pieces], tf.int32)
        red = steps[owner].reduce(tf.concat(pieces, 0), splits)
        assert red.shape[0] == chunks.reduced_words(owner)
        reduced.append(red)
    gathered = tf.concat(reduced, 0)
    outs = [[o.numpy() for o in s.finish(gathered)] for s in steps]
    return outs, steps, reduced


def _compare(comps, w, keys, outs, want, step):
    for i, name in enumerate(keys):
        for rank, c in enumerate(comps):
            np.testing.assert_array_equal(outs[rank][i], want[i],
                                          err_msg="rank %d %s step %d" % (rank, name, step))
            np.testing.assert_array_equal(c.residuals.variable(name).numpy(),
                                          w.residuals[rank][name])
    if comps[0].threshold == "auto":
        key = sw.owner_key(keys)
        for c, comp in enumerate(comps):
            np.testing.assert_array_equal(comp.owners.variable(key).numpy(),
                                          w.owner_residuals[c][key])


@pytest.mark.parametrize("threshold,block,blocks", [(0.5, None, None), (0.05, None, None),
                                                    ("auto", None, None), ("auto", 16, 4)])
@pytest.mark.parametrize("nranks", [2, 3, 4])
def test_bucket_matches_reference(threshold, block, blocks, nranks):
    comps = [TwoBitCompressor(threshold, block=block, blocks=blocks, exchange="scatter")
             for _ in range(nranks)]
    w = ref.Workers(nranks, threshold, block=block, blocks=blocks, exchange="scatter")
    keys = ["t%d" % i for i in range(len(SIZES))]
    sent = 0
    for step in range(3):
        grads = _grads(SIZES, nranks, step)
        outs, _, _ = exchange(comps, keys, grads)
        want = w.bucket(keys, grads)
        sent += sum(np.count_nonzero(x) for x in want)
        _compare(comps, w, keys, outs, want, step)
    assert sent > 0


@pytest.mark.parametrize("nranks", [2, 3, 4])
@pytest.mark.parametrize("n", [0, 1, 16 * 3 + 5, 1000])
@pytest.mark.parametrize("threshold", [0.5, "auto"])
def test_single_tensor_of_odd_size(nranks, n, threshold):
    comps = [TwoBitCompressor(threshold, exchange="scatter") for _ in range(nranks)]
    w = ref.Workers(nranks, threshold, exchange="scatter")
    for step in range(3):
        grads = _grads([n], nranks, step)
        outs, _, _ = exchange(comps, ["t0"], grads)
        _compare(comps, w, ["t0"], outs, [w.allreduce("t0", [g[0] for g in grads])], step)


@pytest.mark.parametrize("threshold", [0.05, "auto"])
def test_sum_with_scale_factors_inside_a_function(threshold):
    """op=Sum with prescale and postscale, the whole simulated step traced as one graph."""
    sizes, nranks = [300, 17], 3
    comps = [TwoBitCompressor(threshold, exchange="scatter") for _ in range(nranks)]
    w = ref.Workers(nranks, threshold, exchange="scatter")
    fn = tf.function(lambda gs: exchange_graph(comps, gs))  # traced once
    for step in range(3):
        grads = _grads(sizes, nranks, step)
        outs = [[o.numpy() for o in rank] for rank in fn([[tf.constant(g) for g in gs]
                                                          for gs in grads])]
        want = w.bucket(["a", "b"], grads, op="sum", prescale=0.5, postscale=3.0)
        _compare(comps, w, ["a", "b"], outs, want, step)


def exchange_graph(comps, grads):
    """:func:`exchange` in graph ops (called inside a tf.function), op=Sum with scale factors."""
    N = len(comps)
    steps = []
    for rank, c in enumerate(comps):
        ts = grads[rank]
        ex = BucketExchange(c, ts, ["a", "b"], mpi_ops.Sum, 0.5, 3.0, N)
        steps.append(ScatterStep(c, ex, layout_of(c, ["a", "b"], ts), ["a", "b"], N, rank))
    reduced = []
    for owner in range(N):
        pieces = [tf.split(s.send, s.splits)[owner] for s in steps]
        reduced.append(steps[owner].reduce(tf.concat(pieces, 0),
                                           tf.stack([tf.size(p) for p in pieces])))
    gathered = tf.concat(reduced, 0)
    return [s.finish(gathered) for s in steps]


def test_payload_bytes():
    """Phase-1 chunks are slices of the allgather payload with their header; phase 2 carries the
    reference's count planes."""
    nranks, sizes = 3, [40, 17, 300]
    comps = [TwoBitCompressor(0.5, exchange="scatter") for _ in range(nranks)]
    grads = _grads(sizes, nranks, 0, scale=1.0)
    keys = ["a", "b", "c"]
    _, steps, reduced = exchange(comps, keys, grads)
    chunks, layout = steps[0].chunks, steps[0].layout
    counts = np.zeros(layout.values, np.int64)
    for rank, s in enumerate(steps):
        assert s.splits.numpy().tolist() == [chunks.sent_words(c) for c in range(nranks)]
        payload = s.ex.payload.numpy()
        for c, piece in enumerate(tf.split(s.send, s.splits)):
            piece = piece.numpy()
            assert piece[:sw.HEADER_WORDS].tolist() == chunks.header(c, 0.5)
            a, b = chunks.word_starts[c], chunks.word_starts[c + 1]
            np.testing.assert_array_equal(piece[-(b - a):] if b > a else [],
                                          payload[layout.body + a:layout.body + b])
        r = np.zeros(layout.values, np.float32)
        for i, (st, n) in enumerate(zip(layout.starts, sizes)):
            counts[st:st + n] += rs.signs(ref.quantize(grads[rank][i], r[st:st + n], 0.5))
    for c in range(nranks):
        a, n = chunks.value_start(c), 16 * chunks.words(c)
        got = reduced[c].numpy()
        assert got[:sw.HEADER_WORDS].tolist() == chunks.header(c, 0.5, reduced=True)
        assert got[sw.HEADER_WORDS:].tolist() == rs.pack_counts(counts[a:a + n], nranks).tolist()


@pytest.mark.parametrize("threshold", [0.5, "auto"])
def test_nonfinite_member_is_nan_everywhere_and_keeps_every_residual(threshold):
    sizes, nranks, keys = [40, 17, 300], 3, ["t0", "t1", "t2"]
    comps = [TwoBitCompressor(threshold, exchange="scatter") for _ in range(nranks)]
    w = ref.Workers(nranks, threshold, exchange="scatter")
    for step in range(3):
        grads = _grads(sizes, nranks, step)
        if step == 1:
            grads[1][2][5] = np.nan
        outs, _, _ = exchange(comps, keys, grads)
        want = w.bucket(keys, grads)
        _compare(comps, w, keys, outs, want, step)
        assert np.isnan(want[2]).all() == (step == 1) and not np.isnan(want[0]).any()


def _mismatched_sends(numels, threshold=0.5):
    """Two ranks whose tensor "x" has ``numels[rank]`` values: each one's ScatterStep."""
    steps = []
    for rank, n in enumerate(numels):
        c = TwoBitCompressor(threshold[rank] if isinstance(threshold, list) else threshold,
                             exchange="scatter")
        t = tf.ones([n])
        ex = Exchange(c, t, "x", mpi_ops.Average, 1.0, 1.0, 2)
        steps.append(ScatterStep(c, ex, layout_of(c, ["x"], [t]), ["x"], 2, rank))
    return steps


@pytest.mark.parametrize("numels,threshold,pattern", [
    ([33, 34], 0.5, r"different sizes \[33, 34\]"),
    ([40, 40], [0.5, 0.25], r"different thresholds \[0\.5, 0\.25\]"),
    ([40, 40], ["auto", 0.5], r"some ranks use threshold='auto' and others a fixed"),
])
@pytest.mark.parametrize("graph", [False, True])
def test_mismatch_raises_the_same_error_for_every_owner(numels, threshold, pattern, graph):
    steps = _mismatched_sends(numels, threshold)
    msgs = set()
    for owner, s in enumerate(steps):
        pieces = [tf.split(x.send, x.splits)[owner] for x in steps]
        args = (tf.concat(pieces, 0), tf.constant([int(tf.size(p)) for p in pieces], tf.int32))
        if graph:
            with pytest.raises(tf.errors.UnknownError) as e:
                tf.function(s.reduce)(*args)
            err = translate(e.value)
            assert err is not None, e.value
        else:
            with pytest.raises(wire.PayloadMismatchError) as e:
                s.reduce(*args)
            err = e.value
        assert __import__("re").search(pattern, str(err)), err
        msgs.add(str(err))
    assert len(msgs) == 1
    for s in steps:  # no owner residual changed
        for name in s.state.owners.names():
            assert not s.state.owners.variable(name).numpy().any()


def test_count_planes_match_reference():
    rng = np.random.default_rng(1)
    for n in (1, 2, 3, 4, 8, 100):
        c = rng.integers(-n, n + 1, 16 * 13)
        words = scatter_codec.pack_counts(tf.constant(c + n, tf.int32), sw.count_bits(n))
        assert words.numpy().tolist() == rs.pack_counts(c, n).tolist()
        back = scatter_codec.unpack_counts(words, c.size, sw.count_bits(n), n)
        np.testing.assert_array_equal(back.numpy(), c.astype(np.float32))


@pytest.mark.parametrize("n,size", [(2, 70001), (8, 65536 + 32 * 7 + 5), (100, 100003)])
def test_compiled_count_planes_match_reference(n, size):
    """From COMPILE_MIN_NUMEL values the planes are packed and unpacked in one XLA call each:
    the same words and counts as the reference."""
    from horovod_twobit.tensorflow.codec import kernels
    assert kernels._compiled(size)
    c = np.random.default_rng(n).integers(-n, n + 1, size)
    bits = sw.count_bits(n)
    words = scatter_codec._packed(tf.constant(c + n, tf.int32), bits)
    assert words.numpy().tolist() == rs.pack_counts(c, n).tolist()
    back = scatter_codec._counts(words, size, bits, n)
    np.testing.assert_array_equal(back.numpy(), c.astype(np.float32))


def test_compiled_sender_signs_match_numpy():
    """An owner's per-value (senders of +t) - (senders of -t), from COMPILE_MIN_NUMEL values in
    one XLA call: MXNet's layout decoded in NumPy (four values per byte, the first in the two
    highest bits; code 11 is +t, 10 is -t, 00 and 01 are 0)."""
    from horovod_twobit.tensorflow.codec import kernels
    nranks, nwords = 5, 4099
    assert kernels._compiled(16 * nwords)
    words = np.random.default_rng(3).integers(-2 ** 31, 2 ** 31, (nranks, nwords)).astype(np.int32)
    b = words.view(np.uint8).reshape(nranks, -1)
    codes = np.stack([(b >> s) & 3 for s in (6, 4, 2, 0)], -1).reshape(nranks, -1)
    want = (codes == wire.CODE_POS).sum(0) - (codes == wire.CODE_NEG).sum(0)
    got = scatter_codec._signs_xla(tf.constant(words), 16 * nwords)
    np.testing.assert_array_equal(got.numpy(), want)
    np.testing.assert_array_equal(scatter_codec.sender_signs(tf.constant(words), 16 * nwords).numpy(),
                                  want)


def test_chunks_past_the_compile_size_match_reference():
    """Chunks of COMPILE_MIN_NUMEL values and more take the XLA calls (the owners' signs, the count
    planes both ways): results and residuals bit for bit the reference's."""
    from horovod_twobit.tensorflow.codec import kernels
    n, nranks = 2 * kernels.COMPILE_MIN_NUMEL + 37, 2
    comps = [TwoBitCompressor(0.05, exchange="scatter") for _ in range(nranks)]
    w = ref.Workers(nranks, 0.05, exchange="scatter")
    for step in range(2):
        grads = _grads([n], nranks, step)
        outs, _, _ = exchange(comps, ["t0"], grads)
        _compare(comps, w, ["t0"], outs, [w.allreduce("t0", [g[0] for g in grads])], step)


def test_owner_encode_benchmark_times_both_tf_encodes_of_one_chunk():
    """horovod_twobit.benchmarks.owner_encode in TensorFlow: the 2-bit baseline is format 1's
    owner encode (each piece's levels codec.auto_levels', its words codec.pack's, its residual
    codec.committed's) and both encodes are timed on one chunk, in a tf.function and eagerly."""
    from horovod_twobit.benchmarks import owner_encode
    from horovod_twobit.tensorflow import codec
    chunks, _, _, _ = owner_encode._chunk(4096, 4)
    pieces, nv = chunks.pieces[1], chunks.values(1)
    S = tf.constant(np.random.default_rng(5).standard_normal(nv).astype(np.float32))
    body, new = owner_encode.encode_2bit_tf(chunks, 1, tf.zeros([nv]), S, tf.constant([False]))
    for i, (_, _, s, n, _) in enumerate(pieces):
        t, v = codec.auto_levels(tf.zeros([n]), S[s:s + n], "lsq")
        assert body[i].numpy() == tf.bitcast(v, tf.int32).numpy()
        np.testing.assert_array_equal(new[s:s + n].numpy(),
                                      codec.committed(S[s:s + n], tf.zeros([n]), t, v).numpy())
    t, v = codec.auto_levels(tf.zeros([pieces[0][3]]), S[:pieces[0][3]], "lsq")
    words = codec.pack(codec.codes(S[:16 * pieces[0][4]], t))
    np.testing.assert_array_equal(body[len(pieces):len(pieces) + pieces[0][4]].numpy(), words)
    for path in ("function", "eager"):
        t2, t3, k = owner_encode.measure_tf(4096, 4, path)
        assert t2 > 0 and t3 > 0 and k == len(pieces)
