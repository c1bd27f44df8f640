"""The scatter exchange in the torch codec: N ranks simulated in one process (the alltoall and the
allgather are concatenations), against the NumPy reference, bit for bit."""

import numpy as np
import pytest
import torch

from horovod_twobit import reference as ref
from horovod_twobit.reference import scatter as rs
from horovod_twobit.wire import scatter as sw
from horovod_twobit import wire
from horovod_twobit.wire.layout import Layout
from horovod_twobit.torch.codec import owner as owner_codec, scatter as scatter_codec
from horovod_twobit.torch import codec
from test_torch_buckets import _grads, encode_all

SIZES = [1, 15, 16, 17, 40, 480, 1000, 9216, 70003]
# "cpu, late division": the GPU's order of work on the CPU (compiled passes without the division,
# then a correctly rounded one: decode_kernels._late_division)
DEVICES = ["cpu", "cpu, late division", pytest.param(
    "cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"))]


def _device(monkeypatch, device):
    from horovod_twobit.torch.codec import compiled, decode_kernels
    if device == "cpu, late division":
        monkeypatch.setattr(decode_kernels, "_late_division",
                            lambda dev, n: (n >= compiled.COMPILE_MIN_NUMEL
                                            and not compiled.disabled))
    return device.split(",")[0]


def exchange(layout, rs_, owners, grads, threshold, rule="lsq", divisor=None, scale=1.0,
             in_place=False, scratches=None):
    """One step on every rank; returns each rank's flat result (written over its flat gradient
    when ``in_place``) and the phase payloads. ``scratches``: each owner's buffer, kept from step
    to step as a bucket keeps it (:func:`owner_scratches`), else none."""
    N = len(rs_)
    chunks = sw.Chunks(layout, N)
    names = ["t%d" % i for i in range(layout.members)]
    payloads, levels, gs = encode_all(layout, rs_, grads, threshold, rule)
    sends = [scatter_codec.chunk_payloads(chunks, p, threshold) for p in payloads]
    reduced, bads = [], []
    for owner in range(N):  # what the alltoall hands each owner
        pieces = [send.split(splits.tolist())[owner] for send, splits in sends]
        red, bad = scatter_codec.owner_reduce(chunks, torch.cat(pieces), [p.numel() for p in pieces],
                                              names, owner, threshold, rule, owners[owner],
                                              scratches[owner] if scratches else None)
        if scratches:  # left zero past the chunk's words, as the next step needs it
            assert not scratches[owner][16 * chunks.words(owner):].any()
        assert red.numel() == chunks.reduced_words(owner)
        reduced.append(red)
        bads.append(bad)
    assert all(b == bads[0] for b in bads)
    gathered = torch.cat(reduced)
    outs = [scatter_codec.finish_reduced(chunks, gathered, names, rs_[rank], gs[rank],
                                         *levels[rank], bads[rank], divisor or N, scale,
                                         out=None if in_place else
                                         torch.empty(layout.values, device=gs[rank].device))
            for rank in range(N)]
    return outs, sends, reduced


def ranks_state(layout, nranks, device="cpu"):
    """(chunks, every rank's zero residual, every owner's zero residual ("auto"; else None))."""
    chunks = sw.Chunks(layout, nranks)
    return chunks, [torch.zeros(layout.values, device=device) for _ in range(nranks)], \
        [torch.zeros(chunks.values(c), device=device) if layout.auto else None
         for c in range(nranks)]


def owner_scratches(chunks, device="cpu"):
    return [torch.zeros(owner_codec.scratch_values(chunks.words(c)), device=device)
            for c in range(chunks.nranks)]


@pytest.mark.parametrize("threshold,block,blocks", [(0.5, None, None), (0.05, None, None),
                                                    ("auto", None, None), ("auto", 16, 4)])
@pytest.mark.parametrize("nranks", [2, 3, 4])
@pytest.mark.parametrize("device", DEVICES)
def test_bucket_matches_reference(monkeypatch, threshold, block, blocks, nranks, device):
    device = _device(monkeypatch, device)
    auto = threshold == "auto"
    layout = Layout(SIZES, auto, *wire.validate_blocks(threshold, block, blocks))
    chunks, rs_, owners = ranks_state(layout, nranks, device)
    w = ref.Workers(nranks, threshold, block=block, blocks=blocks, exchange="scatter")
    names = ["t%d" % i for i in range(len(SIZES))]
    sent = 0
    scratches = owner_scratches(chunks, device) if nranks != 3 else None  # both ways
    for step in range(3):
        grads = _grads(SIZES, nranks, step)
        outs, _, _ = exchange(layout, rs_, owners, grads, threshold, scratches=scratches)
        want = w.bucket(names, grads)
        check_step(w, names, layout, want, outs, rs_, owners if auto else None, step)
        sent += sum(np.count_nonzero(x) for x in want)
    assert sent > 0


@pytest.mark.parametrize("path", ["eager", "compiled"])
@pytest.mark.parametrize("chunk,in_place", [(64, False), (80, True), (1 << 22, True)])
def test_auto_results_decode_in_parts(monkeypatch, path, chunk, in_place):
    """finish_reduced writes each owner's "auto" chunk into the result kernels.PACK_CHUNK values
    at a time (whole plane words: 80 -> 64): the reference's bits whatever the part size, pieces
    and members cut by the parts included, over the gradient or into a new tensor."""
    from horovod_twobit.torch.codec import compiled, kernels
    monkeypatch.setattr(kernels, "PACK_CHUNK", chunk)
    monkeypatch.setattr(compiled, "COMPILE_MIN_NUMEL", 0 if path == "compiled" else 1 << 62)
    nranks = 3
    layout = Layout(SIZES, True, *wire.validate_blocks("auto", 16, 4))
    chunks = sw.Chunks(layout, nranks)
    assert max(chunks.values(c) for c in range(nranks)) > 100 * chunk or chunk > 1 << 20
    rs_ = [torch.zeros(layout.values) for _ in range(nranks)]
    owners = [torch.zeros(chunks.values(c)) for c in range(nranks)]
    w = ref.Workers(nranks, "auto", block=16, blocks=4, exchange="scatter")
    names = ["t%d" % i for i in range(len(SIZES))]
    for step in range(2):
        grads = _grads(SIZES, nranks, step)
        outs, _, _ = exchange(layout, rs_, owners, grads, "auto", divisor=nranks, scale=0.7,
                              in_place=in_place)
        check_step(w, names, layout, w.bucket(names, grads, postscale=0.7), outs, rs_, owners,
                   step)
    assert not compiled.disabled


def check_step(w, names, layout, want, outs, rs_, owners, step):
    """Every rank's result and residuals, and every owner's residual (``owners``: "auto"), are
    the reference's bit for bit."""
    for i, (n, s) in enumerate(zip(layout.numels, layout.starts)):
        for rank in range(len(outs)):
            np.testing.assert_array_equal(outs[rank][s:s + n].cpu().numpy(), want[i],
                                          err_msg="rank %d tensor %d step %d" % (rank, i, step))
            np.testing.assert_array_equal(rs_[rank][s:s + n].cpu().numpy(),
                                          w.residuals[rank][names[i]])
    for c, owner in enumerate(owners or []):
        np.testing.assert_array_equal(owner.cpu().numpy(),
                                      w.owner_residuals[c][sw.owner_key(names)])


@pytest.mark.parametrize("nranks", [2, 3, 4])
@pytest.mark.parametrize("n", [0, 1, 17, 33, 16 * 3 + 5, 1000])
@pytest.mark.parametrize("threshold", [0.5, "auto"])
def test_single_tensor_of_odd_size(nranks, n, threshold):
    layout = Layout([n], threshold == "auto", *wire.validate_blocks(threshold))
    chunks = sw.Chunks(layout, nranks)
    rs_ = [torch.zeros(n) for _ in range(nranks)]
    owners = [torch.zeros(chunks.values(c)) for c in range(nranks)]
    w = ref.Workers(nranks, threshold, exchange="scatter")
    for step in range(3):
        grads = _grads([n], nranks, step)
        outs, _, _ = exchange(layout, rs_, owners, grads, threshold)
        want = w.allreduce("t0", [g[0] for g in grads])
        for rank in range(nranks):
            np.testing.assert_array_equal(outs[rank].numpy(), want)


def test_payload_bytes():
    """Phase 1 chunks are slices of the allgather payload with their header; phase 2 carries the
    reference's count planes."""
    nranks, sizes = 3, [40, 17, 300]
    layout = Layout(sizes, False)
    chunks = sw.Chunks(layout, nranks)
    grads = _grads(sizes, nranks, 0, scale=1.0)
    _, sends, reduced = exchange(layout, [torch.zeros(layout.values) for _ in range(3)],
                                 [None] * 3, grads, 0.5)
    counts = np.zeros(layout.values, np.int64)
    for rank in range(nranks):
        send, splits = sends[rank]
        assert splits.tolist() == [chunks.sent_words(c) for c in range(nranks)]
        for c, piece in enumerate(send.split(splits.tolist())):
            assert piece[:sw.HEADER_WORDS].tolist() == chunks.header(c, 0.5)
        r = np.zeros(layout.values, np.float32)
        for i, (s, n) in enumerate(zip(layout.starts, sizes)):
            codes = ref.quantize(grads[rank][i], r[s:s + n], 0.5)
            counts[s:s + n] += rs.signs(codes)
    for c in range(nranks):
        a, n = chunks.value_start(c), 16 * chunks.words(c)
        assert reduced[c][:sw.HEADER_WORDS].tolist() == chunks.header(c, 0.5, reduced=True)
        assert reduced[c][sw.HEADER_WORDS:].tolist() == rs.pack_counts(counts[a:a + n], nranks).tolist()


@pytest.mark.parametrize("threshold", [0.5, 0.05, "auto"])
@pytest.mark.parametrize("big,in_place", [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("device", DEVICES)
def test_nonfinite_member_is_nan_everywhere_and_keeps_every_residual(monkeypatch, threshold, big,
                                                                     in_place, device):
    """Step 1 has an Inf in one rank's member: NaN for it on every rank, no residual of it
    changed. ``big``: owners' chunks of at least COMPILE_MIN_NUMEL values, whose commit and decode
    run as one compiled pass when no member held NaN or Inf (into the output, or over the
    gradient itself when ``in_place``)."""
    from horovod_twobit.torch.codec import compiled
    device = _device(monkeypatch, device)
    nranks = 3
    sizes = [40, 17, 300] if not big else [40, compiled.COMPILE_MIN_NUMEL * nranks + 7,
                                            compiled.COMPILE_MIN_NUMEL + 3]
    names = ["t0", "t1", "t2"]
    layout = Layout(sizes, threshold == "auto", *wire.validate_blocks(threshold))
    chunks = sw.Chunks(layout, nranks)
    assert big == (min(chunks.values(c) for c in range(nranks)) >= compiled.COMPILE_MIN_NUMEL)
    rs_ = [torch.zeros(layout.values, device=device) for _ in range(nranks)]
    owners = [torch.zeros(chunks.values(c), device=device) for c in range(nranks)]
    w = ref.Workers(nranks, threshold, exchange="scatter")
    scratches = owner_scratches(chunks, device) if in_place else None  # both ways
    for step in range(3):
        grads = _grads(sizes, nranks, step)
        if step == 1:
            grads[1][2][5] = np.inf
        outs, _, _ = exchange(layout, rs_, owners, grads, threshold, divisor=nranks, scale=0.7,
                              in_place=in_place, scratches=scratches)
        want = w.bucket(names, grads, postscale=0.7)
        check_step(w, names, layout, want, outs, rs_, owners if threshold == "auto" else None,
                   step)
        assert np.isnan(want[2]).all() == (step == 1) and not np.isnan(want[1]).any()


def test_mismatch_raises_the_same_error_for_every_owner():
    a, b = Layout([33], False), Layout([34], False)
    msgs = set()
    sends = []
    for lay in (a, b):
        p = torch.empty(lay.payload_words, dtype=torch.int32)
        codec.encode_payload(lay, torch.zeros(lay.values), torch.ones(lay.values), 0.5, "lsq", p)
        sends.append(scatter_codec.chunk_payloads(sw.Chunks(lay, 2), p, 0.5))
    for owner, lay in enumerate((a, b)):
        pieces = [send.split(splits.tolist())[owner] for send, splits in sends]
        with pytest.raises(wire.PayloadMismatchError, match=r"different sizes \[33, 34\]") as e:
            scatter_codec.owner_reduce(sw.Chunks(lay, 2), torch.cat(pieces),
                                       [p.numel() for p in pieces], ["x"], owner, 0.5, "lsq")
        msgs.add(str(e.value))
    assert len(msgs) == 1


def test_count_planes_match_reference():
    rng = np.random.default_rng(1)
    for n in (1, 2, 3, 4, 8, 100):
        c = rng.integers(-n, n + 1, 16 * 13)
        words = scatter_codec.pack_counts(torch.from_numpy(c + n).to(torch.int32), sw.count_bits(n))
        assert words.tolist() == rs.pack_counts(c, n).tolist()
        back = scatter_codec.unpack_counts(words, c.size, sw.count_bits(n), n)
        np.testing.assert_array_equal(back.numpy(), c.astype(np.float32))


@pytest.mark.parametrize("n,size", [(2, 70001), (8, 65536 + 32 * 7 + 5), (100, 100003)])
@pytest.mark.parametrize("device", DEVICES)
def test_compiled_count_planes_match_reference(monkeypatch, n, size, device):
    """From COMPILE_MIN_NUMEL values the planes are packed, and the counts scaled, by compiled
    bodies: the same words as the reference, and the same floats as the eager path's
    (count - n) * t / divisor * scale."""
    from horovod_twobit.torch.codec import compiled
    device = _device(monkeypatch, device)
    assert size >= compiled.COMPILE_MIN_NUMEL
    c = np.random.default_rng(n).integers(-n, n + 1, size)
    bits = sw.count_bits(n)
    words = scatter_codec.pack_counts(torch.from_numpy(c + n).to(torch.int32).to(device), bits)
    assert words.tolist() == rs.pack_counts(c, n).tolist()
    t, div, scale = (torch.tensor(x, dtype=torch.float32) for x in (0.05, float(n), 0.7))
    got = scatter_codec.count_values(words, size, bits, n, t.to(device), div.to(device),
                                     scale.to(device))
    words = words.cpu()  # the eager path on the CPU: correctly rounded, as the reference
    want = scatter_codec.unpack_counts(words, size, bits, n) * t / div * scale
    assert got.shape == (size,)
    assert torch.equal(got.cpu().view(torch.int32), want.view(torch.int32))
    np.testing.assert_array_equal(scatter_codec.unpack_counts(words, size, bits, n).numpy(),
                                  c.astype(np.float32))



def test_owner_encode_benchmark_times_both_encodes_of_one_chunk():
    """horovod_twobit.benchmarks.owner_encode: the 2-bit baseline is the format-1 owner's encode
    (its levels are levels.auto_levels' of each piece, its words kernels.pack's), and both
    encodes are timed on the same chunk."""
    from horovod_twobit.benchmarks import owner_encode
    from horovod_twobit.torch.codec import kernels, levels, owner as owner_codec
    lay = Layout([4096 * 4], True, *wire.validate_blocks("auto"))
    chunks = sw.Chunks(lay, 4)
    pieces, wc, nv = chunks.pieces[1], chunks.words(1), chunks.values(1)
    S, r = torch.randn(nv), torch.zeros(nv)
    body = owner_encode.encode_2bit(pieces, owner_codec.piece_words(pieces, "cpu"), wc, r, S)
    for i, (_, _, s, n, _) in enumerate(pieces):
        t, v = levels.auto_levels(torch.zeros(n), S[s:s + n], "lsq")
        assert body[i].view(torch.float32) == v
    t, v = levels.auto_levels(torch.zeros(pieces[0][3]), S[:pieces[0][3]], "lsq")
    words, _ = kernels.pack(torch.zeros(16 * pieces[0][4]), S[:16 * pieces[0][4]], t)
    assert torch.equal(body[len(pieces):len(pieces) + pieces[0][4]], words)
    t2, t3, k = owner_encode.measure(4096, 4)
    assert t2 > 0 and t3 > 0 and k == len(pieces)


@pytest.mark.parametrize("threshold", [0.5, "auto"])
@pytest.mark.parametrize("device", ["cpu", "cpu, late division"])
def test_commit_runs_over_adjacent_good_members(monkeypatch, threshold, device):
    """The commit is one call per run of adjacent members without NaN or Inf, not one per member,
    and padding between members stays zero: a middle member holds an Inf in step 1 (two runs),
    the steps before and after it are one run, and every step matches the reference."""
    from horovod_twobit.torch.codec import kernels
    device = _device(monkeypatch, device)
    nranks, sizes = 3, [40, 17, 300, 5, 33]
    names = ["t%d" % i for i in range(len(sizes))]
    layout = Layout(sizes, threshold == "auto", *wire.validate_blocks(threshold))
    chunks = sw.Chunks(layout, nranks)
    rs_ = [torch.zeros(layout.values, device=device) for _ in range(nranks)]
    owners = [torch.zeros(chunks.values(c), device=device) for c in range(nranks)]
    w = ref.Workers(nranks, threshold, exchange="scatter")
    commit, calls = kernels.commit, []
    monkeypatch.setattr(kernels, "commit", lambda r, *a: calls.append(r.numel()) or commit(r, *a))
    for step in range(3):
        grads = _grads(sizes, nranks, step)
        if step == 1:
            grads[0][2][7] = np.inf
        del calls[:]
        outs, _, _ = exchange(layout, rs_, owners, grads, threshold, divisor=nranks, scale=0.7)
        want = w.bucket(names, grads, postscale=0.7)
        check_step(w, names, layout, want, outs, rs_, owners if threshold == "auto" else None,
                   step)
        for rank in range(nranks):  # the padding after each member: zero
            for s, n, nw in zip(layout.starts, layout.numels, layout.member_words):
                assert not rs_[rank][s + n:s + 16 * nw].any()
        if threshold == "auto" or step == 1:  # the fused pass commits without kernels.commit
            runs = [[0, 16 * 5], [16 * 5 + 16 * 19, layout.values]] if step == 1 else \
                [[0, layout.values]]
            assert calls == [e - s for s, e in runs] * nranks


@pytest.mark.parametrize("threshold", [0.5, "auto"])
def test_chunks_compile_by_the_bucket_size(monkeypatch, threshold):
    """A bucket of at least COMPILE_MIN_NUMEL values runs its owners' sums and its finish
    compiled even where each chunk is below it; a smaller bucket runs them eagerly. Same bits
    both ways (against the reference)."""
    from horovod_twobit.torch.codec import compiled
    if compiled.disabled:
        pytest.skip("torch.compile is unavailable here")
    monkeypatch.setattr(compiled, "COMPILE_MIN_NUMEL", 4096)
    run, ran = compiled.run, []
    monkeypatch.setattr(compiled, "run", lambda name, *a: ran.append(name) or run(name, *a))
    nranks = 4
    for sizes, expect in (([3000, 1500, 17], True), ([3000, 17], False)):
        names = ["t%d" % i for i in range(len(sizes))]
        layout = Layout(sizes, threshold == "auto", *wire.validate_blocks(threshold))
        chunks = sw.Chunks(layout, nranks)
        assert max(chunks.values(c) for c in range(nranks)) < compiled.COMPILE_MIN_NUMEL
        assert (layout.values >= compiled.COMPILE_MIN_NUMEL) == expect
        rs_ = [torch.zeros(layout.values) for _ in range(nranks)]
        owners = [torch.zeros(chunks.values(c)) for c in range(nranks)]
        w = ref.Workers(nranks, threshold, exchange="scatter")
        for step in range(2):
            grads = _grads(sizes, nranks, step)
            del ran[:]
            outs, _, _ = exchange(layout, rs_, owners, grads, threshold, divisor=nranks, scale=0.7)
            check_step(w, names, layout, w.bucket(names, grads, postscale=0.7), outs, rs_,
                       owners if threshold == "auto" else None, step)
            want = {"decode_into", "owner_values"} if threshold == "auto" else \
                {"decode", "pack_counts", "finish_counts"}
            assert want <= set(ran) if expect else not want & set(ran), (step, sorted(set(ran)))
