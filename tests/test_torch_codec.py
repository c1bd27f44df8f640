"""The torch codec against the NumPy reference, bit for bit."""

import numpy as np
import pytest
import torch

from horovod_twobit import reference as ref
from horovod_twobit import wire
from horovod_twobit.torch import decode, encode

import sim

SIZES, THRESHOLDS, _grads = sim.SIZES, sim.THRESHOLDS, sim.grads


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("t", THRESHOLDS)
def test_encode_decode_match_reference(n, t):
    r_ref = np.zeros(n, np.float32)
    r = torch.zeros(n)
    for g in _grads(n, t, 3, n):
        want = ref.encode(g, r_ref, t)
        got = encode(torch.from_numpy(g), r, t)
        assert got.dtype == torch.int32 and got.shape == (-(-n // 16),)
        np.testing.assert_array_equal(got.numpy(), want)
        np.testing.assert_array_equal(r.numpy().view(np.int32), r_ref.view(np.int32))
        dec = decode(got, n, t)
        assert dec.dtype == torch.float32 and dec.shape == (n,)
        np.testing.assert_array_equal(dec.numpy(), ref.decode(want, n, t))


def test_layout_example():
    words = encode(torch.tensor([0.5, -0.5, 0.0, 0.7]), torch.zeros(4), 0.5)
    assert words.view(torch.uint8).tolist() == [0xE3, 0, 0, 0]


def test_residual_any_shape_and_half_precision():
    g = torch.randn(3, 5, dtype=torch.float16)
    r = torch.zeros(3, 5)
    r_ref = np.zeros(15, np.float32)
    want = ref.encode(g.float().numpy().reshape(-1), r_ref, 0.5)
    np.testing.assert_array_equal(encode(g, r, 0.5).numpy(), want)
    np.testing.assert_array_equal(r.numpy().reshape(-1), r_ref)


def test_non_contiguous_grad():
    base = torch.randn(8, 6)
    g = base.t()  # non-contiguous
    r = torch.zeros(6, 8)
    r_ref = np.zeros(48, np.float32)
    want = ref.encode(g.contiguous().numpy().reshape(-1), r_ref, 0.1)
    np.testing.assert_array_equal(encode(g, r, 0.1).numpy(), want)


def test_bad_arguments():
    with pytest.raises(ValueError, match="positive"):
        encode(torch.zeros(3), torch.zeros(3), -1)
    with pytest.raises(TypeError, match="float32"):
        encode(torch.zeros(3), torch.zeros(3, dtype=torch.float64), 0.5)
    with pytest.raises(ValueError, match="values"):
        encode(torch.zeros(3), torch.zeros(4), 0.5)
    with pytest.raises(TypeError, match="floating-point"):
        encode(torch.zeros(3, dtype=torch.int32), torch.zeros(3), 0.5)
    with pytest.raises(ValueError, match="words"):
        decode(torch.zeros(2, dtype=torch.int32), 40, 0.5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu():
    g = torch.randn(100003)
    r1, r2 = torch.zeros(100003), torch.zeros(100003, device="cuda")
    w1 = encode(g, r1, 0.5)
    w2 = encode(g.cuda(), r2, 0.5)
    assert torch.equal(w1, w2.cpu()) and torch.equal(r1, r2.cpu())
    assert torch.equal(decode(w1, 100003, 0.5), decode(w2, 100003, 0.5).cpu())


@pytest.mark.parametrize("chunk", [1 << 22, 48, "one pass"])
@pytest.mark.parametrize("path", ["eager", "compiled"])
def test_eager_and_compiled_paths_give_the_reference_bits(monkeypatch, path, chunk):
    """Both paths, with the packing done in one chunk or in many (48 values: 3 words each), or
    in one pass of whole words as on a GPU."""
    from horovod_twobit.torch.codec import compiled, decode_kernels, kernels
    if chunk == "one pass":
        monkeypatch.setattr(kernels, "_one_pass", lambda device: True)
    else:
        monkeypatch.setattr(kernels, "PACK_CHUNK", chunk)
    monkeypatch.setattr(compiled, "COMPILE_MIN_NUMEL", 0 if path == "compiled" else 1 << 62)
    monkeypatch.setattr(compiled, "disabled", False)
    for n in (16, 1000, 4099):
        r_ref, r = np.zeros(n, np.float32), torch.zeros(n)
        for g in _grads(n, 0.1, 2, n):
            want = ref.encode(g, r_ref, 0.1)
            np.testing.assert_array_equal(encode(torch.from_numpy(g), r, 0.1).numpy(), want)
            np.testing.assert_array_equal(r.numpy(), r_ref)
            np.testing.assert_array_equal(decode(torch.from_numpy(want), n, 0.1).numpy(),
                                          ref.decode(want, n, 0.1))
        rows = [torch.from_numpy(ref.encode(g, np.zeros(n, np.float32), 0.1)) for g in _grads(n, 0.1, 3, 7)]
        got = decode_kernels.decode_sum(rows, [0.1, 0.1, 0.1], n, divisor=3, scale=0.5)
        want = ref.aggregate([ref.decode(w.numpy(), n, 0.1) for w in rows], "average", 0.5, 1.0)
        np.testing.assert_array_equal(got.numpy(), want)
        # into a kept buffer, and in the GPU's order of work (the division after the pass)
        late_division = decode_kernels._late_division
        for late in (False, True):
            monkeypatch.setattr(decode_kernels, "_late_division",
                                lambda dev, numel, late=late: late)
            buf = torch.full((16 * wire.num_words(n),), 7.0)
            got = decode_kernels.decode_sum(rows, [0.1, 0.1, 0.1], n, divisor=3, scale=0.5, out=buf)
            np.testing.assert_array_equal(got.numpy(), want)
            assert got.data_ptr() == buf.data_ptr() and not buf[n:].any()
            np.testing.assert_array_equal(
                decode_kernels.decode_sum(rows, [0.1, 0.1, 0.1], n, divisor=3,
                                          scale=0.5).numpy(), want)
        monkeypatch.setattr(decode_kernels, "_late_division", late_division)
    assert not compiled.disabled, "compilation failed and fell back to eager"


@pytest.mark.parametrize("way", ["chunks", "one pass", pytest.param(
    "cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))])
@pytest.mark.parametrize("per_word", [False, True])
def test_pack_words_and_word_flags(monkeypatch, way, per_word):
    """kernels.pack from COMPILE_MIN_NUMEL values, in cache-sized chunks (a CPU) or in one pass
    of whole words (a GPU): the reference's words for a threshold or one per word, the flag and
    each word's NaN/Inf flag, r and g untouched; the partial last word included."""
    from horovod_twobit.torch.codec import compiled, kernels
    if way != "cuda":  # a GPU packs in one pass anyway
        monkeypatch.setattr(kernels, "_one_pass", lambda device: way == "one pass")
    monkeypatch.setattr(kernels, "PACK_CHUNK", 1 << 16)
    dev = "cuda" if way == "cuda" else "cpu"
    n = 3 * (1 << 16) + 16 * 5 + 7
    rng = np.random.default_rng(4)
    g = rng.standard_normal(n).astype(np.float32)
    r = (rng.standard_normal(n) * 0.3).astype(np.float32)
    t = rng.uniform(0.2, 1.5, wire.num_words(n)).astype(np.float32) if per_word else 0.5
    for bad in ([], [7, 160, 70001, n - 1], [n - 3]):  # 160: a word's first value
        gb = g.copy()
        gb[bad] = [np.nan, np.inf, -np.inf, np.nan][:len(bad)]
        want = ref.pack(ref.quantize(gb, r.copy(), np.repeat(t, 16)[:n] if per_word else t))
        G, R = torch.from_numpy(gb).to(dev), torch.from_numpy(r).to(dev)
        flags = torch.ones(wire.num_words(n), dtype=torch.bool, device=dev)
        words, flag = kernels.pack(R, G, torch.from_numpy(t).to(dev) if per_word else t,
                                   word_flags=flags)
        np.testing.assert_array_equal(words.cpu().numpy(), want)
        assert bool(flag) == bool(bad)
        assert sorted(torch.nonzero(flags).view(-1).tolist()) == sorted({i // 16 for i in bad})
        assert torch.equal(R.cpu(), torch.from_numpy(r))
        assert torch.equal(G.isnan().cpu(), torch.from_numpy(np.isnan(gb)))
    assert not compiled.disabled, "compilation failed and fell back to eager"


@pytest.mark.parametrize("path", ["eager", "compiled"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("into", ["gradient", "new tensor"])
def test_finish_commits_and_decodes_in_one_pass(monkeypatch, path, dtype, into):
    """decode_kernels.finish = commit (r <- r + g - q) + decode-sum, written over g or into a new
    tensor: the reference's bits either way, the tail of a partial last word included."""
    from horovod_twobit.torch.codec import compiled, decode_kernels
    monkeypatch.setattr(compiled, "COMPILE_MIN_NUMEL", 0 if path == "compiled" else 1 << 62)
    monkeypatch.setattr(compiled, "disabled", False)
    for n in (16, 1000, 4099):
        g = torch.from_numpy(_grads(n, 0.1, 1, n + 1)[0]).to(dtype)
        g32 = g.float().numpy()
        r_ref = np.linspace(-0.15, 0.15, n, dtype=np.float32)
        r = torch.from_numpy(r_ref.copy())
        rows = [torch.from_numpy(ref.encode(x, np.zeros(n, np.float32), 0.1)) for x in _grads(n, 0.1, 2, 3)]
        want_sum = ref.aggregate([ref.decode(w.numpy(), n, 0.1) for w in rows], "average", 0.5, 1.0)
        ref.encode(g32, r_ref, 0.1)  # the commit this rank's own step makes
        out = None if into == "gradient" else torch.empty(n, dtype=dtype)
        got = decode_kernels.finish(rows, [0.1, 0.1], r, g, 0.1, divisor=2, scale=0.5, out=out)
        assert got is (g if out is None else out)
        np.testing.assert_array_equal(r.numpy(), r_ref)
        np.testing.assert_array_equal(got.numpy(), torch.from_numpy(want_sum).to(dtype).numpy())
    assert not compiled.disabled, "compilation failed and fell back to eager"


def _free_memory_bytes():
    try:
        with open("/proc/meminfo") as f:
            info = dict(l.split(":", 1) for l in f)
        return int(info["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return 0


@pytest.mark.slow
def test_payload_of_more_than_2_to_the_31_bits():
    """2^30 + 17 values: 2^31 + 34 bits of payload; indexing past 2^31 must not wrap. The gradient
    is float16 (2 GiB), so the whole test peaks near 6.5 GiB and runs on a 24 GiB machine."""
    from horovod_twobit.torch.codec import compiled
    free = _free_memory_bytes()
    assert free > 8 * 2 ** 30, "needs about 8 GiB of free memory, %.1f GiB free" % (free / 2 ** 30)
    if compiled.disabled:
        pytest.skip("needs the compiled kernels (the eager path's temporaries would not fit)")
    n = 2 ** 30 + 17
    g = torch.full((n,), 0.25, dtype=torch.float16)
    tail = torch.tensor([0.75, -0.6, 0.1, 2.0] * 8 + [0.9], dtype=torch.float16)  # the last 33
    g[-33:] = tail
    g[:4] = torch.tensor([0.6, -0.6, 0.0, 0.6], dtype=torch.float16)
    r = torch.zeros(n)
    words = encode(g, r, 0.5)
    assert words.numel() == (n + 15) // 16
    assert words.view(torch.uint8)[0].item() == 0xE3
    # the last 33 values straddle three words: compare them with the reference
    k = n - 33 - ((n - 33) % 16)  # start of the word holding value n-33
    r_ref = np.zeros(n - k, np.float32)
    want = ref.encode(g[k:].float().numpy(), r_ref, 0.5)
    np.testing.assert_array_equal(words[k // 16:].numpy(), want)
    np.testing.assert_array_equal(r[k:].numpy(), r_ref)
    del g, r
    out = decode(words, n, 0.5)
    np.testing.assert_array_equal(out[k:].numpy(), ref.decode(want, n - k, 0.5))
    assert out[:4].tolist() == [0.5, -0.5, 0.0, 0.5]


@pytest.mark.parametrize("args,row", [
    (["--frameworks", "torch", "--sizes", "4096", "--paths", "compiled,eager"],
     ["| torch | cpu | 4096 | compiled |", "| torch | cpu | 4096 | eager |"]),
    (["--owner", "--sizes", "4096", "--ranks", "2"], ["| torch | 4096 | 2 |"])])
@pytest.mark.slow
def test_codec_benchmark_runs(args, row):
    """``python -m horovod_twobit.benchmarks.codec`` (the README's and docs' figures) runs and
    prints a row for each path it was asked for."""
    import subprocess
    import sys
    proc = subprocess.run([sys.executable, "-m", "horovod_twobit.benchmarks.codec"] + args,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    for r in row:
        assert r in proc.stdout, proc.stdout
