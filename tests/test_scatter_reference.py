"""The NumPy reference of the scatter exchange and its wire format (no Horovod)."""

import numpy as np
import pytest

from horovod_twobit import reference as ref
from horovod_twobit.reference import scatter as rs
from horovod_twobit.wire import scatter as sw
from horovod_twobit import wire
from horovod_twobit.wire.layout import Layout

SIZES = [1, 15, 16, 17, 40, 480, 1000]
NAMES = ["t%d" % i for i in range(len(SIZES))]


def _grads(nranks, step, scale, sizes=SIZES):
    rng = np.random.default_rng(step)
    return [[(rng.standard_normal(n) * scale * rng.choice([0.1, 0.7, 3.0], n)).astype(np.float32)
             for n in sizes] for _ in range(nranks)]


@pytest.mark.parametrize("nranks", [2, 3, 4, 5])
@pytest.mark.parametrize("threshold", [0.5, 0.05])
def test_fixed_threshold_scatter_equals_allgather(nranks, threshold):
    """Lossless: the same values as the allgather exchange (bit for bit where its rank-order sums
    are exact: N <= 3, or a threshold with few significant bits), the same workers' residuals."""
    a = ref.Workers(nranks, threshold)
    s = ref.Workers(nranks, threshold, exchange="scatter")
    differ = 0
    for step in range(4):
        grads = _grads(nranks, step, threshold)
        for x, y in zip(a.bucket(NAMES, grads), s.bucket(NAMES, grads)):
            np.testing.assert_allclose(y, x, rtol=2e-7, atol=0)
            differ += int(np.count_nonzero(x != y))
        for r in range(nranks):
            for n in NAMES:
                np.testing.assert_array_equal(s.residuals[r][n], a.residuals[r][n])
    if nranks <= 3 or threshold == 0.5:
        assert differ == 0
    assert not any(s.owner_residuals)  # nothing is kept by owners with a numeric threshold


@pytest.mark.parametrize("nranks", [2, 3, 4])
@pytest.mark.parametrize("size", [1, 17, 33, 47, 64, 65, 16 * 12 + 1])
def test_single_tensors_of_odd_sizes(nranks, size):
    a = ref.Workers(nranks, 0.5)
    s = ref.Workers(nranks, 0.5, exchange="scatter")
    for step in range(3):
        grads = [g[0] for g in _grads(nranks, step, 0.5, [size])]
        np.testing.assert_array_equal(s.allreduce("x", grads), a.allreduce("x", grads))


@pytest.mark.parametrize("nranks", [2, 3, 4])
def test_auto_owner_error_feedback_keeps_what_it_does_not_send(nranks):
    """The owners' residuals hold exactly what the phase-2 codes have not yet carried of the
    summed chunks: sent + owner residual = the allgather exchange's sums, step after step."""
    a = ref.Workers(nranks, "auto")
    s = ref.Workers(nranks, "auto", exchange="scatter")
    lay = Layout(SIZES, True, wire.DEFAULT_BLOCK, wire.DEFAULT_BLOCKS)
    chunks = sw.Chunks(lay, nranks)
    want = [np.zeros(n, np.float64) for n in SIZES]
    got = [np.zeros(n, np.float64) for n in SIZES]
    for step in range(5):
        grads = _grads(nranks, step, 1.0)
        for i, (x, y) in enumerate(zip(a.bucket(NAMES, grads, op="sum"),
                                       s.bucket(NAMES, grads, op="sum"))):
            want[i] += x
            got[i] += y
        for r in range(nranks):  # the workers are the same as with allgather
            for n in NAMES:
                np.testing.assert_array_equal(s.residuals[r][n], a.residuals[r][n])
    flat = np.zeros(lay.values, np.float64)
    for c in range(nranks):
        e = s.owner_residuals[c][sw.owner_key(NAMES)]
        assert e.size == chunks.values(c)
        flat[chunks.value_start(c):chunks.value_start(c) + e.size] = e
    for i, (st, n) in enumerate(zip(lay.starts, SIZES)):
        np.testing.assert_allclose(got[i] + flat[st:st + n], want[i], rtol=1e-5, atol=1e-4)
    assert sum(np.count_nonzero(g) for g in got) > 0


@pytest.mark.parametrize("threshold", [0.5, "auto"])
def test_nonfinite_member_is_nan_and_keeps_every_residual(threshold):
    nranks = 3
    s = ref.Workers(nranks, threshold, exchange="scatter")
    for step in range(3):
        grads = _grads(nranks, step, 0.5)
        if step == 1:
            grads[2][5][7] = np.inf  # rank 2, member t5 (480 values, spread over chunks)
        before = [{k: v.copy() for k, v in d.items()} for d in s.residuals]
        owners = [{k: v.copy() for k, v in d.items()} for d in s.owner_residuals]
        out = s.bucket(NAMES, grads)
        for i, x in enumerate(out):
            assert np.isnan(x).all() == (step == 1 and i == 5)
            assert not np.isnan(x).any() or i == 5
        if step == 1:
            lay = Layout(SIZES, threshold == "auto", *wire.validate_blocks(threshold))
            s5 = slice(lay.starts[5], lay.starts[5] + 480)
            for r in range(nranks):
                np.testing.assert_array_equal(s.residuals[r]["t5"], before[r]["t5"])
            chunks = sw.Chunks(lay, nranks)
            for c in range(nranks):
                if not owners[c]:
                    continue
                key = sw.owner_key(NAMES)
                a0 = chunks.value_start(c)
                mask = np.zeros(lay.values, bool)
                mask[s5] = True
                local = mask[a0:a0 + chunks.values(c)]
                np.testing.assert_array_equal(s.owner_residuals[c][key][local],
                                              owners[c][key][local])


def test_count_planes_layout():
    # N = 2: u = count + 2 in 3 bits; plane j holds bit j of each value, value k at bit k
    words = rs.pack_counts([-2, 0, 2, 1] + [0] * 12, 2)
    assert sw.count_bits(2) == 3 and words.size == 3
    u = np.array([0, 2, 4, 3] + [2] * 12)
    for j in range(3):
        assert int(np.uint32(words[j])) == sum(((int(x) >> j) & 1) << k for k, x in enumerate(u))
    rng = np.random.default_rng(0)
    for n in (1, 2, 4, 7, 8, 100):
        c = rng.integers(-n, n + 1, 16 * 37)
        w = rs.pack_counts(c, n)
        assert w.size == sw.count_bits(n) * sw.plane_words(37)
        np.testing.assert_array_equal(rs.unpack_counts(w, c.size, n), c)


def test_count_bits():
    assert [sw.count_bits(n) for n in (1, 2, 3, 4, 7, 8, 15, 16, 127, 128)] == \
        [2, 3, 3, 4, 4, 5, 5, 6, 8, 9]


@pytest.mark.parametrize("sizes", [[1], [15], [17], [16 * 7 + 3], SIZES])
@pytest.mark.parametrize("nranks", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("auto", [False, True])
def test_chunks_cover_every_word_once(sizes, nranks, auto):
    lay = Layout(sizes, auto, *(wire.validate_blocks("auto", 16, 4) if auto else (None, None)))
    ch = sw.Chunks(lay, nranks)
    lengths = [ch.words(c) for c in range(nranks)]
    assert sum(lengths) == lay.words and max(lengths) - min(lengths) <= 1
    assert sum(ch.values(c) for c in range(nranks)) == lay.values
    if auto:  # every word of every segment lies in exactly one piece
        assert sum(p[4] for c in range(nranks) for p in ch.pieces[c]) == lay.words
        for c in range(nranks):
            for k, member, start, length, words in ch.pieces[c]:
                assert lay.seg_member[k] == member and 0 < length <= 16 * words
                assert 0 <= start and start + length <= ch.values(c)
    assert ch.sent_words(0) == sw.HEADER_WORDS + wire.flag_words(len(sizes)) + ch.mags(0) + lengths[0]


def test_auto_exchange_picks_fewer_bytes_the_same_way_everywhere():
    big, small = Layout([1 << 20], False), Layout([100], False)
    assert sw.choose("auto", big, 2) == "allgather"  # 3-bit counts: scatter sends more
    assert sw.choose("auto", big, 1) == "allgather"
    assert sw.choose("auto", small, 8) == "allgather"  # headers dominate
    for n in (3, 4, 8, 64):
        assert sw.choose("auto", big, n) == "scatter"
        assert sw.Chunks(big, n).total_bytes() < sw.allgather_total_bytes(big, n)
    assert sw.choose("scatter", small, 2) == "scatter"
    assert sw.choose("allgather", big, 8) == "allgather"


@pytest.mark.parametrize("bad", ["Scatter", "", None, 1, "ring"])
def test_bad_exchange(bad):
    with pytest.raises(ValueError, match="exchange must be one of"):
        sw.validate_exchange(bad)
    with pytest.raises(ValueError, match="exchange must be one of"):
        ref.Workers(2, 0.5, exchange=bad)


def _chunk_header(numels, threshold, owner, nranks):
    lay = Layout(numels, threshold == "auto", *wire.validate_blocks(threshold))
    return sw.parse_header(sw.Chunks(lay, nranks).header(owner, threshold))


def test_header_checks_name_the_difference_the_same_way_on_every_owner():
    def msgs(make):
        out = set()
        for owner in range(2):
            with pytest.raises(wire.PayloadMismatchError) as e:
                sw.check_headers([make(r, owner) for r in range(2)], ["x"], owner, 2)
            out.add(str(e.value))
        assert len(out) == 1
        return out.pop()
    assert "different sizes [33, 34]" in msgs(lambda r, o: _chunk_header([33 + r], 0.5, o, 2))
    assert "different thresholds [0.5, 0.25]" in msgs(
        lambda r, o: _chunk_header([40], [0.5, 0.25][r], o, 2))
    assert "threshold='auto'" in msgs(lambda r, o: _chunk_header([40], [0.5, "auto"][r], o, 2))
    assert "bucketed different tensors" in msgs(
        lambda r, o: _chunk_header([[40, 17], [40, 18]][r], 0.5, o, 2))
    assert "ranks [1] sent something other" in msgs(
        lambda r, o: None if r else _chunk_header([40], 0.5, o, 2))
    assert sw.parse_header(wire.make_header(40, 0.5) + [0] * 4) is None  # an allgather payload
    lay = Layout([40], False)
    assert sw.parse_header(sw.Chunks(lay, 2).header(0, 0.5, reduced=True)) is None
    assert sw.parse_header(sw.Chunks(lay, 2).header(0, 0.5, reduced=True), reduced=True)


def test_owner_scale_reaches_the_largest_value_and_every_level_is_exact():
    rng = np.random.default_rng(3)
    for x in [rng.standard_normal(37).astype(np.float32) * 10.0 ** rng.integers(-30, 30)
              for _ in range(200)]:
        a = rs.owner_scale(x)
        assert int(a.view(np.int32)) & 3 == 0 and a >= np.finfo(np.float32).tiny
        m = np.abs(x).max()
        assert 3 * np.float64(a) <= m and m - 3 * np.float64(a) <= m * 2.0 ** -21
        for k in range(-3, 4):  # every level is exact in float32
            assert np.float64(np.float32(k) * a) == k * np.float64(a)
    assert rs.owner_scale(np.zeros(5, np.float32)) == np.finfo(np.float32).tiny


def test_owner_quantize_rounds_to_nearest_level_and_keeps_the_rest():
    rng = np.random.default_rng(4)
    S = (rng.standard_normal(96) * rng.choice([0.01, 1.0, 30.0], 96)).astype(np.float32)
    e = (rng.standard_normal(96) * 0.1).astype(np.float32)
    x = e + S
    pieces = [(0, 0, 0, 40, 3), (1, 1, 48, 33, 3)]  # values 40..47 and 81..95: padding
    e[40:48] = e[81:] = 0
    S[40:48] = S[81:] = 0
    before = e.copy()
    scales, k = rs.owner_quantize(S, e, pieces, [False, False])
    for a, (_, _, s, n, _) in zip(scales, pieces):
        part = slice(s, s + n)
        assert a == rs.owner_scale(x[part])
        np.testing.assert_array_equal(k[part], np.clip(np.rint(x[part] / a), -3, 3))
        assert abs(k[part]).max() == 3  # the largest |x| is sent as 3a
        np.testing.assert_array_equal(e[part], x[part] - k[part].astype(np.float32) * a)
        assert np.abs(e[part]).max() <= a / 2 * (1 + 1e-6)
    assert not k[40:48].any() and not k[81:].any() and not e[40:48].any()
    e2 = before.copy()
    scales, k = rs.owner_quantize(S, e2, pieces, [False, True])  # member 1 held NaN or Inf
    assert scales[1] == 0 and not k[48:81].any()
    np.testing.assert_array_equal(e2[48:81], before[48:81])
    body = rs.owner_payload(scales, k, 6)
    assert body.size == 2 + sw.OWNER_BITS * sw.plane_words(6)
    assert body[:2].view(np.float32).tolist() == scales.tolist()
    np.testing.assert_array_equal(rs.unpack_counts(body[2:], 96, sw.OWNER_LEVELS), k)


def test_auto_phase2_bytes_and_crossover():
    lay = Layout([1 << 20], True, *wire.validate_blocks("auto"))
    ch = sw.Chunks(lay, 8)
    for c in range(8):
        assert ch.reduced_words(c) == sw.HEADER_WORDS + len(ch.pieces[c]) + 3 * sw.plane_words(ch.words(c))
    ratio = sw.bytes_per_rank([lay], 8, "scatter") / sw.bytes_per_rank([lay], 8, "allgather")
    assert 0.30 < ratio <= 0.32
    small = lambda n: Layout([n], True, *wire.validate_blocks("auto"))  # noqa: E731
    assert sw.choose("auto", small(256), 8) == "allgather"
    assert sw.choose("auto", small(257), 8) == "scatter"
    assert sw.choose("auto", small(496), 4) == "allgather"
    assert sw.choose("auto", small(497), 4) == "scatter"


def test_scatter_format_version_mismatch_is_named():
    heads = []
    for r in range(2):
        h = sw.Chunks(Layout([40], False), 2).header(0, 0.5)
        if r:
            h[0] = (wire.MAGIC << 16) | 1  # a 2-bit phase-2 version
        heads.append(sw.parse_header(h))
    with pytest.raises(wire.PayloadMismatchError, match=r"scatter format versions \[2, 1\]"):
        sw.check_headers(heads, ["x"], 0, 2)
