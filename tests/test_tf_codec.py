"""The TensorFlow codec against the NumPy reference, bit for bit, eagerly and inside tf.function."""

import numpy as np
import pytest
import tensorflow as tf

from horovod_twobit import reference as ref
from horovod_twobit.tensorflow import decode, encode

import sim

SIZES, THRESHOLDS, _grads = sim.SIZES, sim.THRESHOLDS, sim.grads


def _bits(a):
    return np.ascontiguousarray(a, dtype=np.float32).view(np.int32)


@pytest.mark.parametrize("mode", ["eager", "function"])
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("t", THRESHOLDS)
def test_encode_decode_match_reference(n, t, mode):
    r_ref = np.zeros(n, np.float32)
    r = tf.Variable(tf.zeros([n]))
    enc = lambda g: encode(g, r, t)  # noqa: E731
    dec = lambda w: decode(w, n, t)  # noqa: E731
    if mode == "function":
        enc, dec = tf.function(enc), tf.function(dec)
    for g in _grads(n, t, 3, n):
        want = ref.encode(g, r_ref, t)
        got = enc(tf.constant(g))
        assert got.dtype == tf.int32 and tuple(got.shape) == (-(-n // 16),)
        np.testing.assert_array_equal(got.numpy(), want)
        np.testing.assert_array_equal(_bits(r.numpy()), _bits(r_ref))
        out = dec(got)
        assert out.dtype == tf.float32 and tuple(out.shape) == (n,)
        np.testing.assert_array_equal(_bits(out.numpy()), _bits(ref.decode(want, n, t)))


def test_layout_example():
    words = encode(tf.constant([0.5, -0.5, 0.0, 0.7]), tf.Variable(tf.zeros(4)), 0.5)
    assert tf.bitcast(words, tf.uint8).numpy().reshape(-1).tolist() == [0xE3, 0, 0, 0]


def test_residual_any_shape_and_half_precision():
    g = tf.random.stateless_normal([3, 5], seed=[1, 2], dtype=tf.float16)
    r = tf.Variable(tf.zeros([3, 5]))
    r_ref = np.zeros(15, np.float32)
    want = ref.encode(g.numpy().astype(np.float32).reshape(-1), r_ref, 0.5)
    np.testing.assert_array_equal(encode(g, r, 0.5).numpy(), want)
    np.testing.assert_array_equal(r.numpy().reshape(-1), r_ref)


def test_unknown_static_shape_in_function():
    """Inside a tf.function traced for any length, sizes are computed at run time."""
    r = tf.Variable(tf.zeros([37]))
    r_ref = np.zeros(37, np.float32)
    enc = tf.function(lambda g: encode(g, r, 0.1), input_signature=[tf.TensorSpec([None], tf.float32)])
    dec = tf.function(lambda w: decode(w, 37, 0.1), input_signature=[tf.TensorSpec([None], tf.int32)])
    for g in _grads(37, 0.1, 3, 5):
        want = ref.encode(g, r_ref, 0.1)
        got = enc(tf.constant(g))
        np.testing.assert_array_equal(got.numpy(), want)
        np.testing.assert_array_equal(r.numpy(), r_ref)
        np.testing.assert_array_equal(dec(got).numpy(), ref.decode(want, 37, 0.1))


def test_residual_made_in_a_trace_costs_no_second_trace():
    """A residual first used inside a tf.function is made and initialized eagerly, so the function
    is traced once, not a second time to lift an initializer (tracing is most of a first step)."""
    from horovod_twobit.tensorflow.residuals import Residuals
    res, traces = Residuals(), []

    @tf.function
    def step(g):
        traces.append(1)
        r = res.get("x", g)
        r.assign_add(g)
        return r.read_value()

    np.testing.assert_array_equal(step(tf.ones([3])).numpy(), [1, 1, 1])
    np.testing.assert_array_equal(step(tf.ones([3])).numpy(), [2, 2, 2])
    assert len(traces) == 1
    assert isinstance(res.variable("x"), tf.Variable) and not res.variable("x").trainable


def test_non_finite_values_send_nothing():
    g = np.array([np.nan, np.inf, -np.inf, 0.7], np.float32)
    r_ref = np.zeros(4, np.float32)
    r = tf.Variable(tf.zeros(4))
    want = ref.encode(g, r_ref, 0.5)
    np.testing.assert_array_equal(encode(tf.constant(g), r, 0.5).numpy(), want)
    np.testing.assert_array_equal(_bits(r.numpy()), _bits(r_ref))


def test_bad_arguments():
    with pytest.raises(ValueError, match="positive"):
        encode(tf.zeros(3), tf.Variable(tf.zeros(3)), -1)
    with pytest.raises(TypeError, match="float32"):
        encode(tf.zeros(3), tf.Variable(tf.zeros(3, tf.float64)), 0.5)
    with pytest.raises(TypeError, match="tf.Variable"):
        encode(tf.zeros(3), tf.zeros(3), 0.5)
    with pytest.raises(ValueError, match="values"):
        encode(tf.zeros(3), tf.Variable(tf.zeros(4)), 0.5)
    with pytest.raises(TypeError, match="floating-point"):
        encode(tf.zeros(3, tf.int32), tf.Variable(tf.zeros(3)), 0.5)
    with pytest.raises(TypeError, match="IndexedSlices"):
        encode(tf.IndexedSlices(tf.ones([1, 2]), tf.constant([0]), tf.constant([3, 2])),
               tf.Variable(tf.zeros(6)), 0.5)
    with pytest.raises(ValueError, match="words"):
        decode(tf.zeros(2, tf.int32), 40, 0.5)
    with pytest.raises(TypeError, match="int32"):
        decode(tf.zeros(3, tf.float32), 40, 0.5)
    with pytest.raises(ValueError, match="numeric threshold"):
        decode(tf.zeros(3, tf.int32), 40, "auto")


@pytest.mark.skipif(not tf.config.list_physical_devices("GPU"), reason="needs a GPU")
def test_gpu_matches_cpu():
    g = np.random.default_rng(0).standard_normal(100003).astype(np.float32)
    with tf.device("/CPU:0"):
        r1 = tf.Variable(tf.zeros(100003))
        w1 = encode(tf.constant(g), r1, 0.5)
        d1 = decode(w1, 100003, 0.5)
    with tf.device("/GPU:0"):
        r2 = tf.Variable(tf.zeros(100003))
        w2 = encode(tf.constant(g), r2, 0.5)
        d2 = decode(w2, 100003, 0.5)
        assert "GPU" in w2.device and "GPU" in d2.device
    np.testing.assert_array_equal(w1.numpy(), w2.numpy())
    np.testing.assert_array_equal(r1.numpy(), r2.numpy())
    np.testing.assert_array_equal(d1.numpy(), d2.numpy())


# ----------------------------------------------------------------- threshold="auto"

def _auto_inputs(n):
    rng = np.random.default_rng(n)
    r = (rng.standard_normal(n) * 0.01).astype(np.float32)
    g = (rng.standard_normal(n) * rng.choice([0.001, 0.1, 3.0], n)).astype(np.float32)
    return r, g


@pytest.mark.parametrize("mode", ["eager", "function"])
@pytest.mark.parametrize("rule", ["lsq", "opt", "mean", "rms", "mean*3", "lsq*2"])
@pytest.mark.parametrize("n", [0, 1, 17, 5000, 100003])
def test_auto_threshold_matches_reference(n, rule, mode):
    """The same inputs as tests/test_auto_threshold.py (the PyTorch kernel's test)."""
    from horovod_twobit.tensorflow import auto_threshold
    r, g = _auto_inputs(n)
    fn = lambda r, g: auto_threshold(r, g, rule)  # noqa: E731
    if mode == "function":
        fn = tf.function(fn)
    got = fn(tf.Variable(r), tf.constant(g))
    assert got.dtype == tf.float32 and got.shape.rank == 0
    want = ref.auto_threshold(r + g, rule)
    assert got.numpy().view(np.int32) == np.float32(want).view(np.int32), (got.numpy(), want)


@pytest.mark.parametrize("rule", ["lsq", "opt", "mean", "rms", "mean*3", "lsq*2"])
def test_auto_threshold_unknown_length_and_half_precision(rule):
    from horovod_twobit.tensorflow import auto_threshold
    fn = tf.function(lambda r, g: auto_threshold(r, g, rule),
                     input_signature=[tf.TensorSpec([None], tf.float32)] * 2)
    for n in (0, 1, 17, 5000):
        r, g = _auto_inputs(n)
        want = np.float32(ref.auto_threshold(r + g, rule))
        assert fn(tf.constant(r), tf.constant(g)).numpy().view(np.int32) == want.view(np.int32)
    r, g = _auto_inputs(300)
    g16 = g.astype(np.float16)
    want = np.float32(ref.auto_threshold(r + g16.astype(np.float32), rule))
    got = auto_threshold(tf.constant(r.reshape(10, 30)), tf.constant(g16.reshape(30, 10)), rule)
    assert got.numpy().view(np.int32) == want.view(np.int32)


@pytest.mark.skipif(not tf.config.list_physical_devices("GPU"), reason="needs a GPU")
@pytest.mark.parametrize("rule", ["lsq", "opt", "mean", "rms", "mean*3", "lsq*2"])
def test_auto_threshold_gpu_matches_reference(rule):
    from horovod_twobit.tensorflow import auto_threshold
    for n in (17, 100003, 2 ** 22 + 5):
        r, g = _auto_inputs(n)
        with tf.device("/GPU:0"):
            fn = tf.function(lambda r, g: auto_threshold(r, g, rule))
            got = fn(tf.constant(r), tf.constant(g))
            assert "GPU" in got.device
        want = np.float32(ref.auto_threshold(r + g, rule))
        assert got.numpy().view(np.int32) == want.view(np.int32), (n, got.numpy(), want)


def test_auto_threshold_of_zeros_and_non_finite():
    from horovod_twobit.tensorflow import auto_threshold
    tiny = np.finfo(np.float32).tiny
    assert auto_threshold(tf.zeros(32), tf.zeros(32)).numpy() == tiny
    assert auto_threshold(tf.zeros(32), tf.fill([32], 1e-44)).numpy() == tiny
    assert np.isnan(auto_threshold(tf.zeros(3), tf.constant([1.0, np.nan, 0.0])).numpy())
    assert auto_threshold(tf.zeros(3), tf.constant([1.0, np.inf, 0.0])).numpy() == np.inf
    with pytest.raises(ValueError, match="unknown automatic threshold rule 'median'"):
        auto_threshold(tf.zeros(3), tf.zeros(3), "median")


def test_auto_compressor_construction(monkeypatch):
    from horovod_twobit.tensorflow import TwoBitCompressor
    monkeypatch.delenv("HOROVOD_TWOBIT_AUTO_RULE", raising=False)
    c = TwoBitCompressor("auto")
    assert c.threshold == "auto" and c.auto_rule == "lsq"
    assert repr(c) == "TwoBitCompressor(threshold='auto')"
    assert c.state_dict()["threshold"] == "auto"
    monkeypatch.setenv("HOROVOD_TWOBIT_AUTO_RULE", "rms")
    assert TwoBitCompressor("auto").auto_rule == "rms"
    monkeypatch.setenv("HOROVOD_TWOBIT_AUTO_RULE", "RMS")
    with pytest.raises(ValueError,
                       match=r"HOROVOD_TWOBIT_AUTO_RULE must be one of \('lsq', 'opt', 'mean', 'rms'\)"):
        TwoBitCompressor("auto")
    c = TwoBitCompressor("auto", rule="opt")  # the argument wins over the environment
    assert c.auto_rule == "opt" and repr(c) == "TwoBitCompressor(threshold='auto', rule='opt')"
    monkeypatch.delenv("HOROVOD_TWOBIT_AUTO_RULE")
    for bad in ["Auto", "", None, "auto ", "0.5"]:
        with pytest.raises(ValueError, match="positive number or the string 'auto'"):
            TwoBitCompressor(bad)


def _exchanger(compressors, key, graph, receivers=None):
    """One exchange among simulated ranks without Horovod: each builds its payload, the payloads
    are concatenated as an allgather would, and each rank in ``receivers`` (default: all) finishes
    on the same buffer. Returns a function of the ranks' gradients -> (payloads, results)."""
    from horovod.tensorflow import mpi_ops
    from horovod_twobit.tensorflow.exchange import single as communicator
    receivers = range(len(compressors)) if receivers is None else receivers

    def step(*gs):
        exs = [communicator.Exchange(c, g, key, mpi_ops.Average, 1.0, 1.0, len(compressors))
               for c, g in zip(compressors, gs)]
        gathered = tf.concat([ex.payload for ex in exs], axis=0)
        # opaque, like a real allgather, whose size is known only at run time (a static size
        # would let Grappler turn the average's division into a multiplication)
        gathered = tf.numpy_function(lambda a: a, [gathered], tf.int32, stateful=True)
        return [ex.payload for ex in exs], [exs[i].finish(gathered) for i in receivers]

    step = tf.function(step) if graph else step
    return lambda grads: step(*[tf.constant(g) for g in grads])


@pytest.fixture(params=["plain", "xla"])
def path(request, monkeypatch):
    """Runs a test with the codec's plain TF ops and with its XLA-compiled passes (which otherwise
    start at 65536 values)."""
    from horovod_twobit.tensorflow.codec import kernels
    monkeypatch.setattr(kernels, "DISABLED", False)
    monkeypatch.setattr(kernels, "COMPILE_MIN_NUMEL", 0 if request.param == "xla" else 1 << 62)
    return request.param


@pytest.mark.parametrize("rule", ["lsq", "opt", "mean", "rms", "mean*3", "lsq*2"])
@pytest.mark.parametrize("graph", [False, True])
def test_auto_exchange_headers_and_per_sender_decode(monkeypatch, graph, rule, path):
    """Each payload's header carries FLAG_AUTO and its sender's t (float32 bits); every receiver
    decodes each payload with that sender's t; residuals follow the NumPy simulation."""
    from horovod_twobit import wire
    from horovod_twobit.tensorflow import TwoBitCompressor
    monkeypatch.setenv("HOROVOD_TWOBIT_AUTO_RULE", rule)
    nranks, n = 3, 37
    cs = [TwoBitCompressor("auto") for _ in range(nranks)]
    sim = ref.Workers(nranks, "auto", rule=rule)
    rng = np.random.default_rng(3)
    exchange = _exchanger(cs, "w", graph)
    for step in range(4):
        scale = [0.01, 1.0, 30.0]  # very different scales: one t per sender
        grads = [(rng.standard_normal(n) * s).astype(np.float32) for s in scale]
        payloads, outs = exchange(grads)
        want = sim.allreduce("w", grads)
        ts = sim.last_thresholds["w"]
        assert len(set(float(t) for t in ts)) == nranks
        for rank in range(nranks):
            p = payloads[rank].numpy()
            h = wire.Header(p[:wire.HEADER_WORDS])
            assert h.auto and not h.nonfinite and h.numel == n
            assert p[4] == np.float32(ts[rank]).view(np.int32)
            np.testing.assert_array_equal(_bits(outs[rank].numpy()), _bits(want))
            np.testing.assert_array_equal(_bits(cs[rank].residuals.variable("w").numpy()),
                                          _bits(sim.residuals[rank]["w"]))


@pytest.mark.parametrize("rule", ["lsq", "opt"])
@pytest.mark.parametrize("graph", [False, True])
def test_block_exchange_matches_simulation(graph, rule, path):
    """block=32: the header carries FLAG_BLOCKS and the block size, each sender's block magnitudes
    follow it, receivers decode each block with its sender's magnitude; results and residuals are
    the NumPy simulation's (the PyTorch binding's test uses the same reference)."""
    from horovod_twobit import wire
    from horovod_twobit.tensorflow import TwoBitCompressor, codec
    nranks, n, block = 3, 101, 32  # three whole blocks and a partial one, a partial last word
    cs = [TwoBitCompressor("auto", rule=rule, block=block) for _ in range(nranks)]
    sim = ref.Workers(nranks, "auto", rule=rule, block=block)
    rng = np.random.default_rng(5)
    exchange = _exchanger(cs, "b", graph)
    for step in range(4):
        scale = np.repeat([0.01, 1.0, 30.0, 0.3], block)[:n]  # each block its own scale
        grads = [(rng.standard_normal(n) * scale * (k + 1)).astype(np.float32) for k in range(nranks)]
        payloads, outs = exchange(grads)
        want = sim.allreduce("b", grads)
        for rank in range(nranks):
            p = payloads[rank].numpy()
            assert p.size == wire.payload_bytes(n, block) // 4
            h = wire.Header(p[:wire.HEADER_WORDS])
            assert h.auto and h.block == block and h.numel == n
            np.testing.assert_array_equal(p[wire.HEADER_WORDS:wire.HEADER_WORDS + 4],
                                          sim.last_thresholds["b"][rank].view(np.int32))
            np.testing.assert_array_equal(_bits(outs[rank].numpy()), _bits(want))
            np.testing.assert_array_equal(_bits(cs[rank].residuals.variable("b").numpy()),
                                          _bits(sim.residuals[rank]["b"]))
    r, g = _auto_inputs(70001)
    for got, want in zip(codec.block_levels(r, g, 512, rule), ref.block_levels(r + g, 512, rule)):
        np.testing.assert_array_equal(got.numpy().view(np.int32), want.view(np.int32))


def test_block_arguments():
    from horovod_twobit.tensorflow import PayloadMismatchError, TwoBitCompressor
    assert repr(TwoBitCompressor("auto", block=128)) == \
        "TwoBitCompressor(threshold='auto', block=128, blocks=64)"
    c = TwoBitCompressor("auto")
    assert (c.block, c.blocks) == (64, 64) and repr(c) == "TwoBitCompressor(threshold='auto')"
    with pytest.raises(ValueError, match="block must be a power of two of at least 16"):
        TwoBitCompressor("auto", block=100)
    with pytest.raises(ValueError, match="blocks must be a positive integer"):
        TwoBitCompressor("auto", blocks=-1)
    with pytest.raises(ValueError, match="use it with threshold='auto'"):
        TwoBitCompressor(0.1, block=64)
    cs = [TwoBitCompressor("auto", block=16), TwoBitCompressor("auto", blocks=1)]
    with pytest.raises(PayloadMismatchError, match="different block sizes"):
        _exchanger(cs, "m", graph=False)([np.ones(40, np.float32)] * 2)


def test_auto_and_fixed_refuse_to_mix():
    from horovod_twobit.tensorflow import PayloadMismatchError, TwoBitCompressor
    cs = [TwoBitCompressor("auto"), TwoBitCompressor(0.5)]
    with pytest.raises(PayloadMismatchError, match="some ranks use threshold='auto'"):
        _exchanger(cs, "m", graph=False)([np.ones(20, np.float32)] * 2)


@pytest.mark.parametrize("threshold", ["auto", 0.1])
def test_senders_summed_in_rank_order(threshold, path):
    """Inside a graph the sum equals the reference's float32 sum in rank order, bit for bit. A
    chain of Adds would be regrouped by Grappler (combine_add_to_addn; AddN adds in chunks of 8)
    and round differently (with a fixed threshold from 10 senders on; with "auto", whose senders'
    thresholds differ, wherever the regrouped order rounds otherwise)."""
    from horovod_twobit.tensorflow import TwoBitCompressor
    n, nranks = 4000, 10
    cs = [TwoBitCompressor(threshold) for _ in range(nranks)]
    rng = np.random.default_rng(nranks)
    grads = [(rng.standard_normal(n) * s).astype(np.float32)
             for s in rng.choice([0.05, 0.2, 1.0], nranks)]
    want = ref.Workers(nranks, threshold).allreduce("w", grads)
    _, outs = _exchanger(cs, "w", graph=True, receivers=[0])(grads)
    np.testing.assert_array_equal(_bits(outs[0].numpy()), _bits(want))


@pytest.mark.parametrize("graph", [False, True])
def test_sum_scale_and_non_finite_through_both_paths(graph, path):
    """op=Sum with a postscale, a partial last word, then a step in which one rank's gradient
    holds NaN: every result NaN, every residual as it was; the step after is the reference's."""
    from horovod.tensorflow import mpi_ops
    from horovod_twobit.tensorflow.exchange import single as communicator
    from horovod_twobit.tensorflow import TwoBitCompressor
    n, nranks, t = 1000 + 7, 2, 0.1
    cs = [TwoBitCompressor(t) for _ in range(nranks)]
    sim = ref.Workers(nranks, t)

    def step(*gs):
        exs = [communicator.Exchange(c, g, "s", mpi_ops.Sum, 1.0, 0.5, nranks)
               for c, g in zip(cs, gs)]
        gathered = tf.numpy_function(lambda a: a, [tf.concat([e.payload for e in exs], 0)],
                                     tf.int32, stateful=True)
        return [e.finish(gathered) for e in exs]

    step = tf.function(step) if graph else step
    for k, g in enumerate(zip(_grads(n, t, 3, 11), _grads(n, t, 3, 12))):
        g = [x.copy() for x in g]
        if k == 1:
            g[1][5] = np.nan
        before = [c.residuals.variable("s").numpy().copy() for c in cs] if k else None
        outs = step(*[tf.constant(x) for x in g])
        if k == 1:
            for c, o, b in zip(cs, outs, before):
                assert np.isnan(o.numpy()).all()
                np.testing.assert_array_equal(_bits(c.residuals.variable("s").numpy()), _bits(b))
            continue
        want = sim.allreduce("s", g, op="sum", postscale=0.5)
        for rank, o in enumerate(outs):
            np.testing.assert_array_equal(_bits(o.numpy()), _bits(want))
            np.testing.assert_array_equal(_bits(cs[rank].residuals.variable("s").numpy()),
                                          _bits(sim.residuals[rank]["s"]))


@pytest.mark.parametrize("threshold,blocks", [(0.05, {}), ("auto", {}), ("auto", dict(block=16, blocks=4))])
@pytest.mark.parametrize("graph", [False, True])
def test_bucket_matches_each_tensor_alone_and_torch_bytes(path, threshold, blocks, graph):
    """A bucket of tensors (BucketExchange): every member's result and residual are the
    reference's for that tensor alone, and each rank's payload is the PyTorch binding's bytes."""
    import torch
    from horovod.tensorflow import mpi_ops
    from horovod_twobit.wire.layout import Layout
    from horovod_twobit import wire
    from horovod_twobit.tensorflow import TwoBitCompressor
    from horovod_twobit.tensorflow.exchange.bucket import BucketExchange
    from horovod_twobit.torch import codec as torch_codec
    sizes, nranks, keys = [40, 17, 300, 1], 3, ["a", "b", "c", "d"]
    comps = [TwoBitCompressor(threshold, **blocks) for _ in range(nranks)]

    def step(*flat):
        gs = [list(flat[r * len(sizes):(r + 1) * len(sizes)]) for r in range(nranks)]
        exs = [BucketExchange(c, g, keys, mpi_ops.Average, 1.0, 1.0, nranks)
               for c, g in zip(comps, gs)]
        gathered = tf.numpy_function(lambda a: a, [tf.concat([ex.payload for ex in exs], 0)],
                                     tf.int32, stateful=True)
        return [ex.payload for ex in exs], [ex.finish(gathered) for ex in exs]

    step = tf.function(step) if graph else step
    w = ref.Workers(nranks, threshold, **blocks)
    lay = Layout(sizes, threshold == "auto", *wire.validate_blocks(threshold, **blocks))
    r_torch = [torch.zeros(lay.values) for _ in range(nranks)]
    for s in range(3):
        rng = np.random.default_rng(s)
        grads = [[(rng.standard_normal(n) * 0.1).astype(np.float32) for n in sizes]
                 for _ in range(nranks)]
        payloads, outs = step(*[tf.constant(g) for gs in grads for g in gs])
        for i, k in enumerate(keys):
            want = w.allreduce(k, [g[i] for g in grads])
            for rank in range(nranks):
                np.testing.assert_array_equal(outs[rank][i].numpy(), want)
                np.testing.assert_array_equal(comps[rank].residuals.variable(k).numpy(),
                                              w.residuals[rank][k])
        for rank in range(nranks):
            g = torch.zeros(lay.values)
            for st, x in zip(lay.starts, grads[rank]):
                g[st:st + x.size] = torch.from_numpy(x)
            p = torch.empty(lay.payload_words, dtype=torch.int32)
            t, v = torch_codec.encode_payload(lay, r_torch[rank], g, threshold, "lsq", p)
            torch_codec.kernels.commit(r_torch[rank], g, t, v)
            assert payloads[rank].numpy().tolist() == p.tolist()


@pytest.mark.parametrize("level", [0.5, np.finfo(np.float32).tiny, float("inf"), float("nan")])
def test_xla_decode_gives_each_code_its_value_for_any_level(level):
    """The XLA bodies' decode (``codec.decoded``: one select of sign times level) gives the codes
    what ``codec.values`` gives them, bit for bit (NaN as NaN): +level for 11, -level for 10, +0
    for 00 and 01, with the smallest level (FLT_MIN), an infinite or a NaN one too (an unsent
    value never becomes 0 * inf = NaN), inside an XLA body and out of one."""
    from horovod_twobit.tensorflow import codec
    c = tf.constant(np.array([[0, 1, 2, 3]] * 2, np.int32))
    lv = tf.constant([[level], [2.0]], tf.float32)
    want = codec.values(c, lv).numpy()
    for got in (codec.decoded(c, lv), tf.function(codec.decoded, jit_compile=True)(c, lv)):
        got = got.numpy()
        assert np.array_equal(np.isnan(got), np.isnan(want))
        same = ~np.isnan(want)
        assert np.array_equal(got[same].view(np.int32), want[same].view(np.int32))
    assert want[0, 0] == 0 and not np.signbit(want[0, :2]).any()
    assert want[1].tolist() == [0, 0, -2, 2]
