"""threshold="auto": the value travels in the header, receivers use each sender's value."""

import numpy as np
import pytest
import torch

from horovod_twobit import reference as ref
from horovod_twobit.wire import checks as wire_checks
from horovod_twobit import wire
from horovod_twobit.torch.codec import compiled, decode_kernels, kernels, levels
from horovod_twobit.torch import TwoBitCompressor


@pytest.mark.parametrize("rule", ["lsq", "opt", "mean", "rms", "mean*3", "lsq*2"])
@pytest.mark.parametrize("path", ["eager", "compiled"])
@pytest.mark.parametrize("n", [0, 1, 17, 5000, 100003])
def test_auto_threshold_matches_reference(monkeypatch, rule, path, n):
    monkeypatch.setattr(compiled, "COMPILE_MIN_NUMEL", 0 if path == "compiled" else 1 << 62)
    rng = np.random.default_rng(n)
    r = (rng.standard_normal(n) * 0.01).astype(np.float32)
    g = (rng.standard_normal(n) * rng.choice([0.001, 0.1, 3.0], n)).astype(np.float32)
    got = levels.auto_levels(torch.from_numpy(r), torch.from_numpy(g), rule)
    want = ref.auto_levels(r + g, rule)
    for y, w in zip(got, want):
        assert y.dtype == torch.float32 and y.dim() == 0
        assert y.numpy().view(np.int32) == np.float32(w).view(np.int32)
    assert levels.auto_threshold(torch.from_numpy(r), torch.from_numpy(g), rule).item() == want[0]


def _spread(rng, shape):
    """float32 values whose magnitudes span 2^-60 to 2^60 (float64 sums of them round), with
    exact zeros and subnormals among them."""
    x = rng.standard_normal(shape) * np.exp2(rng.uniform(-60, 60, shape))
    x[rng.random(shape) < 0.05] = 0.0
    x[rng.random(shape) < 0.02] = 1e-40
    return x.astype(np.float32)


@pytest.mark.parametrize("rule", ["lsq", "opt", "mean", "rms", "lsq*2"])
@pytest.mark.parametrize("path", ["eager", "compiled"])
def test_levels_of_widely_spread_magnitudes(monkeypatch, rule, path):
    """Summation orders differ (the reference's pairwise sums, the kernels' vector lanes and
    broadcasts), yet the levels are the reference's bits: each is rounded to float32 once."""
    monkeypatch.setattr(compiled, "COMPILE_MIN_NUMEL", 0 if path == "compiled" else 1 << 62)
    rng = np.random.default_rng(2024)
    for rows, n in [(200, 64), (60, 1000), (3, 40000), (1, 7)]:
        r, g = _spread(rng, (rows, n)), _spread(rng, (rows, n))
        x = r + g
        if rows > 1:  # a row of one huge value, a row of zeros
            x[0] = 0.0
            x[1, :-1], x[1, -1] = 1e-30, 1e38
            r, g = x, np.zeros_like(x)
        t, v = levels.auto_levels(torch.from_numpy(r), torch.from_numpy(g), rule)
        want = np.array([ref.auto_levels(row, rule) for row in x], np.float32)
        np.testing.assert_array_equal(t.numpy().view(np.int32), want[:, 0].view(np.int32))
        np.testing.assert_array_equal(v.numpy().view(np.int32), want[:, 1].view(np.int32))
    x = _spread(rng, 70001)
    t, v = levels.block_levels(torch.from_numpy(x), torch.zeros(70001), 256, rule)
    tb, vb = ref.block_levels(x, 256, rule)
    np.testing.assert_array_equal(t.numpy().view(np.int32), tb.view(np.int32))
    np.testing.assert_array_equal(v.numpy().view(np.int32), vb.view(np.int32))


def test_lsq_sends_the_least_squares_magnitude():
    """lsq: the support is |x| >= t, and the magnitude sent is the mean of |x| over it, which
    beats magnitude = threshold; every other rule sends the threshold itself."""
    x = np.array([0.1, -0.1, 0.2, 1.0, -3.0, 0.05, 0.0, 2.0], np.float32)
    t, v = ref.auto_levels(x, "lsq")
    support = np.abs(x) >= t
    assert support.sum() == 2 and np.isclose(v, np.abs(x[support]).mean())  # {-3, 2}: 5^2/2 > 6^2/3
    err = lambda thr, mag: ((x - np.where(x >= thr, mag, np.where(x <= -thr, -mag, 0))) ** 2).sum()  # noqa
    assert err(t, v) < err(t, t)
    assert err(t, v) <= min(err(c, c) for c in np.abs(x) if c > 0)
    for rule in ("opt", "mean", "rms"):
        a, b = ref.auto_levels(x, rule)
        assert a == b
    r = np.zeros(8, np.float32)
    words = ref.encode(x, r, t, v)
    np.testing.assert_array_equal(r, x - ref.decode(words, 8, v))


def test_auto_threshold_of_zeros_sends_nothing():
    t = levels.auto_threshold(torch.zeros(32), torch.zeros(32))
    assert float(t) == torch.finfo(torch.float32).tiny
    assert ref.auto_threshold(np.zeros(32, np.float32)) == np.finfo(np.float32).tiny
    r = np.zeros(32, np.float32)
    assert (ref.encode(np.zeros(32, np.float32), r, ref.auto_threshold(r)) == 0).all()


def test_header_carries_the_senders_value():
    from horovod_twobit.torch.exchange.bucket import _split
    rows = []
    for rank, t in enumerate([0.25, 0.0625]):
        words = ref.encode(np.array([1.0, -1.0, 0.01] * 11, np.float32), np.zeros(33, np.float32), t)
        rows.append(np.array(wire.make_header(33, t, wire.FLAG_AUTO), np.int32))
        rows.append(words)
    parts = _split(torch.from_numpy(np.concatenate(rows)), 33, 2, "w")
    assert [h.threshold for h, _ in parts] == [0.25, 0.0625] and all(h.auto for h, _ in parts)
    out = decode_kernels.decode_sum([w for _, w in parts], [h.threshold for h, _ in parts], 33, 2)
    assert out[0].item() == (0.25 + 0.0625) / 2 and out[1].item() == -(0.25 + 0.0625) / 2
    assert out[2].item() == 0


def test_auto_and_fixed_senders_refuse_to_mix():
    a = wire.make_header(16, 0.5, wire.FLAG_AUTO) + [0]
    b = wire.make_header(16, 0.5) + [0]
    with pytest.raises(wire.PayloadMismatchError, match="threshold='auto'"):
        wire_checks.split_gathered(a + b, 2, "w")


@pytest.mark.parametrize("bad", ["Auto", "", None, "auto ", "0.5"])
def test_bad_threshold_values(bad):
    with pytest.raises(ValueError, match="positive number or the string 'auto'"):
        TwoBitCompressor(bad)


def test_auto_is_accepted():
    assert TwoBitCompressor("auto").threshold == "auto"


def test_rule_argument_environment_and_default(monkeypatch):
    monkeypatch.delenv("HOROVOD_TWOBIT_AUTO_RULE", raising=False)
    c = TwoBitCompressor("auto")
    assert c.auto_rule == "lsq" and repr(c) == "TwoBitCompressor(threshold='auto')"
    monkeypatch.setenv("HOROVOD_TWOBIT_AUTO_RULE", "mean*3")
    assert TwoBitCompressor("auto").auto_rule == "mean*3"
    c = TwoBitCompressor("auto", rule="opt")
    assert c.auto_rule == "opt" and repr(c) == "TwoBitCompressor(threshold='auto', rule='opt')"
    for bad in ["OPT", "", "median", "opt*", "opt*-1", 3]:
        with pytest.raises(ValueError, match=r"rule must be one of \('lsq', 'opt', 'mean', 'rms'\)"):
            TwoBitCompressor("auto", rule=bad)
    monkeypatch.setenv("HOROVOD_TWOBIT_AUTO_RULE", "RMS")
    with pytest.raises(ValueError, match="HOROVOD_TWOBIT_AUTO_RULE must be one of"):
        TwoBitCompressor("auto")


@pytest.mark.parametrize("rule", ["lsq", "opt", "mean", "rms"])
@pytest.mark.parametrize("path", ["eager", "compiled", "compiled, 48-value chunks", pytest.param(
    "cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))])
@pytest.mark.parametrize("n,block", [(1, 16), (15, 16), (48, 16), (1000, 64), (70001, 512)])
def test_block_levels_match_reference(monkeypatch, rule, path, n, block):
    """block=B: one (threshold, magnitude) per block of B values (the last one may be shorter),
    the pack and the commit use each value's block, bit for bit as the reference."""
    monkeypatch.setattr(compiled, "COMPILE_MIN_NUMEL", 1 << 62 if path == "eager" else 0)
    if "chunks" in path:  # the pack's chunks cut blocks: each chunk takes its words' thresholds
        monkeypatch.setattr(kernels, "PACK_CHUNK", 48)
    dev = "cuda" if path == "cuda" else "cpu"
    rng = np.random.default_rng(n + block)
    scale = np.repeat(rng.uniform(0.001, 2.0, wire.num_blocks(n, block)), block)[:n]  # per block
    g = (rng.standard_normal(n) * scale).astype(np.float32)
    r = (rng.standard_normal(n) * 0.01).astype(np.float32)
    tb, vb = ref.block_levels(r + g, block, rule)
    assert tb.shape == vb.shape == (wire.num_blocks(n, block),)
    for i, a in enumerate(range(0, n, block)):  # each block is auto_levels of its own values
        assert (tb[i], vb[i]) == ref.auto_levels((r + g)[a:a + block], rule)
    G = torch.from_numpy(g).to(dev)
    t, v = levels.block_levels(torch.from_numpy(r).to(dev), G, block, rule)
    np.testing.assert_array_equal(t.cpu().numpy().view(np.int32), tb.view(np.int32))
    np.testing.assert_array_equal(v.cpu().numpy().view(np.int32), vb.view(np.int32))
    rr, R = r.copy(), torch.from_numpy(r.copy()).to(dev)
    want = ref.encode(g, rr, ref.per_value(tb, block, n), ref.per_value(vb, block, n))
    tw, vw = kernels.per_word(t, block, n), kernels.per_word(v, block, n)
    words, _ = kernels.pack(R, G, tw)
    np.testing.assert_array_equal(words.cpu().numpy(), want)
    out = decode_kernels.finish([words, words], [vw, vw], R, G.clone(), tw, 2, magnitude=vw)
    np.testing.assert_array_equal(R.cpu().numpy().view(np.int32), rr.view(np.int32))
    np.testing.assert_array_equal(out.cpu().numpy(), ref.decode(want, n, ref.per_value(vb, block, n)))


def test_block_header_and_body():
    """With blocks, header word 4 is the block size and each rank's block magnitudes follow its
    header; receivers decode each block of each sender with that sender's magnitude."""
    from horovod_twobit.torch.exchange.bucket import _split
    n, block, gathered, grads = 40, 16, [], []
    for rank in range(2):
        g = np.linspace(-1, 1, n).astype(np.float32) * (rank + 1)
        t, v = ref.block_levels(g, block)
        words = ref.encode(g, np.zeros(n, np.float32), ref.per_value(t, block, n), ref.per_value(v, block, n))
        gathered += [np.array(wire.make_header(n, 1.0, wire.FLAG_AUTO, block), np.int32),
                     v.view(np.int32), words]
        grads.append(g)
    flat = torch.from_numpy(np.concatenate(gathered))
    assert flat.numel() == 2 * wire.payload_bytes(n, block) // 4 == 2 * (5 + 3 + 3)
    parts = _split(flat, n, 2, "w", block)
    assert [h.block for h, _ in parts] == [16, 16] and all(h.threshold is None for h, _ in parts)
    w = ref.Workers(2, "auto", block=block)
    want = w.allreduce("w", grads)
    mags = [kernels.per_word(body[:3].view(torch.float32), block, n) for _, body in parts]
    got = decode_kernels.decode_sum([body[3:] for _, body in parts], mags, n, 2)
    np.testing.assert_array_equal(got.numpy(), want)
    assert len({float(m[0]) for m in mags}) == 2  # the senders' magnitudes differ


def test_block_sizes_must_agree():
    a = wire.make_header(40, 1.0, wire.FLAG_AUTO, 16) + [0] * 6
    b = wire.make_header(40, 1.0, wire.FLAG_AUTO, 32) + [0] * 5
    c = wire.make_header(40, 1.0, wire.FLAG_AUTO) + [0] * 3
    with pytest.raises(wire.PayloadMismatchError, match="different block sizes"):
        wire_checks.split_gathered(a + b, 2, "w")
    with pytest.raises(wire.PayloadMismatchError, match="different block sizes"):
        wire_checks.split_gathered(a + c, 2, "w")


def test_bad_block_values():
    c = TwoBitCompressor("auto")
    assert (c.block, c.blocks) == (64, 64) and repr(c) == "TwoBitCompressor(threshold='auto')"
    c = TwoBitCompressor("auto", block=256, blocks=0)
    assert (c.block, c.blocks) == (256, None)
    assert repr(c) == "TwoBitCompressor(threshold='auto', block=256, blocks=0)"
    assert (TwoBitCompressor(0.5).block, TwoBitCompressor(0.5).blocks) == (None, None)
    for bad in [0, 8, 100, 513, True, 512.0, "512", -16]:
        with pytest.raises(ValueError, match="block must be a power of two of at least 16"):
            TwoBitCompressor("auto", block=bad)
    for bad in [-1, True, 64.0, "64"]:
        with pytest.raises(ValueError, match="blocks must be a positive integer .* or 0 for no limit"):
            TwoBitCompressor("auto", blocks=bad)
    for kw in (dict(block=512), dict(blocks=1)):
        with pytest.raises(ValueError, match="use it with threshold='auto'"):
            TwoBitCompressor(0.5, **kw)


@pytest.mark.parametrize("numel,block,blocks,want", [
    (100, None, None, None),
    (100, 64, 64, 64),             # the defaults of "auto"
    (64, 64, 64, None),
    (65536, 64, 64, 1024),
    (10 ** 6, 64, 64, 16384),
    (10 ** 6, 64, 1, None),        # blocks=1: one magnitude per tensor
    (10 ** 6, 64, None, 64),       # blocks=0 (None here): no limit
    (6, 32, None, None),           # one block: one magnitude, in the header
    (40, 32, None, 32),
    (50, None, 4, 16),             # 16 * 4 >= 50
    (480, None, 4, 128),
    (65, None, 4, 32),
    (64, None, 4, 16),
    (16, None, 4, None),
    (65536, None, 64, 1024),
    (16384, 256, 64, 256),         # block is the smallest size, blocks the most blocks
    (65536, 256, 64, 1024),
    (1000, 256, 64, 256),
    (200, 256, 64, None),
])
def test_block_of(numel, block, blocks, want):
    assert wire.block_of(numel, block, blocks) == want
    if want:
        assert wire.num_blocks(numel, want) <= (blocks or numel) and wire.num_blocks(numel, want) > 1



def test_blocks_simulation_uses_each_tensors_block_size():
    """Workers(blocks=K): a tensor's block magnitudes are those of block_of(n); a small tensor
    sends one magnitude, as per-tensor "auto" does."""
    rng = np.random.default_rng(3)
    big = [rng.standard_normal(1000).astype(np.float32) * np.repeat([0.01, 1.0], 500) for _ in range(2)]
    small = [rng.standard_normal(12).astype(np.float32) for _ in range(2)]
    w, per_block = ref.Workers(2, "auto", blocks=4), ref.Workers(2, "auto", block=256, blocks=0)
    per_tensor = ref.Workers(2, "auto", blocks=1)
    np.testing.assert_array_equal(w.allreduce("big", big), per_block.allreduce("big", big))
    assert [np.shape(v) for v in w.last_thresholds["big"]] == [(4,), (4,)]
    np.testing.assert_array_equal(w.allreduce("small", small), per_tensor.allreduce("small", small))
    assert w.last_thresholds["small"] == per_tensor.last_thresholds["small"]
