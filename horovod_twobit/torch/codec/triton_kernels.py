"""The codec's passes as Triton kernels, for CUDA tensors: one launch per pass over a whole bucket,
its members' offsets, thresholds and segments read from small device tables (made once per layout
and device), no host synchronisation. :mod:`horovod_twobit.torch.codec` dispatches here on CUDA
(:func:`.compiled.triton_path`); the CPU keeps the Inductor / eager bodies.

- :func:`encode_payload`, fixed threshold: one pass reads r and g, writes the packed words and
  ORs the NaN/Inf flags (header word 1, each member's flag byte) into the payload with atomics,
  only in words that held NaN or Inf. It reads r and g in vectors, and so does the finish: a
  bucket's values come in whole words, and a tensor alone of any other size takes a path whose
  masks are constants in every program but its last (``SPLIT``).
- :func:`encode_payload`, ``"auto"`` (rule ``lsq``): each segment (a member's block) is cut into
  chunks of :data:`CHUNK` values, one program each. Pass 1 sums |r + g| per chunk (float64). Pass
  2 takes its segment's mean from those sums, counts and sums (float64) |r + g| at or above every
  candidate threshold, and stores per value one byte: how many of the candidates' float32-rounded
  thresholds |r + g| reaches, and its sign. Its tiles are :data:`COUNT_ROWS` x :data:`COUNT_LANES`
  values with a lane's :data:`COUNT_ROWS` contiguous values in one thread (one vector load of each
  of r and g), so each candidate's count and sum are added up within the thread across the chunk
  and the lanes summed once at its end (compiled, no barrier per tile). Passes 1 and 2 read a
  chunk of whole words (all but a tensor's last) in vectors, and one that ends inside a word value
  by value. Pass 3, one program per segment, reduces the segment's counts and sums and chooses and
  rounds the levels as :func:`horovod_twobit.reference.auto_levels` does. Pass 4 packs the codes
  from the bytes (a value is sent exactly when it reaches more candidates than the chosen one's
  index, since the rounded candidates are sorted). A segment's chunk sums are added
  :data:`SUM_LANES` at a time (lane j: chunks j, j + SUM_LANES, ... in order; then the lanes), in
  the same order wherever they are needed. r and g are read twice. Other rules take their levels
  from :mod:`.levels`, then the fixed-threshold pass with one threshold per word.
- :func:`finish_payload`: one pass commits this rank's error feedback (r <- (r + g) - q, MXNet's
  float32 operations in :func:`.kernels.committed`'s order), sums every rank's decoded words in
  rank order (each rank's threshold or magnitudes read from its own payload), divides correctly
  rounded (``div_rn``), multiplies by the scale and writes over g or into ``out``; members that
  held NaN or Inf on some rank get NaN and keep their residual.
- :func:`decode_rows`: the scatter owner's sum of every sender's chunk, all ranks in one launch.

Extra memory: the "auto" encode holds one byte per value of the bucket (pass 2's), and a few
float64 sums per chunk, while it runs.

What the GPU's compiler makes of each kernel (registers, spills, barriers, divisions, FMAs,
vector loads) is checked without a GPU: tests/workers/triton_compile.py compiles every
specialization the interpreter cases launch for sm_90 and sm_80 with Triton's NVIDIA back-end
(``test_kernels_compile_for_gpus``).

Bits: no operation here has a result that depends on fusion or order but the float64 sums of
the "auto" levels (float64 sums of float32 values, rounded to float32 once, as the reference and
:mod:`.levels` do, whose order differs too: the same bits in all but astronomically rare cases;
the order here is fixed, so every run gives the same bits). Under ``TRITON_INTERPRET=1`` the
kernels run on CPU tensors with NumPy's arithmetic, and the suite checks them there against the
NumPy reference. What the interpreter cannot show, and ``scripts/gpu_check.sh`` checks on a GPU
(``test_cuda_kernels_match_reference``, the same cases compiled):

- float32 division: Triton's ``/`` is approximate on a GPU (``div.full.f32``); the one float32
  division, by the number of ranks, is ``tl.math.div_rn`` (``div.rn.f32``). The float64 ones
  (the mean, the least-squares score and magnitude) lower to IEEE division (``div.rn.f64``);
- FMA contraction: the GPU compiler fuses a multiply and an add by default; launches pass
  ``enable_fp_fusion=False`` (no pass has a multiply feeding an add whose fused result would
  differ, but the guard costs nothing);
- conversions: float32 to float16 rounds to nearest even on both; float32 to bfloat16 is
  rounded with integer operations (:func:`_bf16_bits`), since the interpreter truncates;
- integer wrap-around of the packed words' int32 sums (disjoint bits) and int32 atomics.
"""

import os

import torch
import triton
import triton.language as tl

from horovod_twobit import wire

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# words per program of the elementwise passes, values per chunk of the "auto" levels, words per
# tile inside a chunk; the interpreter costs ~5 ms a program, so it runs few, large ones
BLOCK_WORDS = int(os.environ.get("HOROVOD_TWOBIT_TRITON_BLOCK_WORDS", 256 if INTERPRET else 64))
CHUNK = int(os.environ.get("HOROVOD_TWOBIT_TRITON_CHUNK", 16384 if INTERPRET else 8192))
TILE_WORDS = 32
PACK_WORDS = 128  # the "auto" pack pass's tile: a word's 16 bytes a thread (4 warps), one load
COUNT_ROWS, COUNT_LANES = 4, 128  # the "auto" count pass's tiles: a lane a thread (4 warps)
SUM_LANES = 32  # a segment's chunks summed this many at a time (the mean, the counts and sums)
_KP = 16  # candidate slots (OPT_MULTIPLES padded to a power of two)
_K = len(wire.OPT_MULTIPLES)
assert _K <= _KP and CHUNK % (16 * TILE_WORDS) == 0 and BLOCK_WORDS & (BLOCK_WORDS - 1) == 0

_FLAG_NONFINITE = tl.constexpr(wire.FLAG_NONFINITE)
_BUCKET_HEADER_WORDS = tl.constexpr(wire.BUCKET_HEADER_WORDS)
_FLT_MIN = tl.constexpr(float(torch.finfo(torch.float32).tiny))
_CODE_POS = tl.constexpr(wire.CODE_POS)
_CODE_NEG = tl.constexpr(wire.CODE_NEG)
_OPT_MULTIPLES = tl.constexpr(tuple(float(m) for m in wire.OPT_MULTIPLES))


def _launch_options():
    if INTERPRET:
        return {}
    return {"enable_fp_fusion": False, "num_warps": 4}


# ----------------------------------------------------------------- device helpers

@triton.jit
def _shifts():
    """wire.WORD_SHIFTS: value j of a word in bits 8 * (j // 4) + 6 - 2 * (j % 4)."""
    j = tl.arange(0, 16)
    return (j // 4) * 8 + 6 - 2 * (j % 4)


@triton.jit
def _pack(codes):
    """int32 words of a (words, 16) tile of codes (disjoint bits: their int32 sum is their OR)."""
    return tl.sum(codes << _shifts()[None, :], axis=1)


@triton.jit
def _flag_words(head_ptr, w, bad, mow_ptr, BUCKET: tl.constexpr):
    """ORs the NaN/Inf flags of the words ``w`` where ``bad`` into the payload's header (word 1)
    and, in a bucket, into each member's flags byte. No memory traffic where nothing is bad."""
    tl.atomic_or(head_ptr + 1 + w * 0, _FLAG_NONFINITE, mask=bad)
    if BUCKET:
        mem = tl.load(mow_ptr + w, mask=bad, other=0)
        tl.atomic_or(head_ptr + _BUCKET_HEADER_WORDS + mem // 4, 1 << ((mem % 4) * 8), mask=bad)


@triton.jit
def _rounded_by(y, factor, HAS_FACTOR: tl.constexpr):
    """float32 of a float64 level (times the rule's float64 ``factor`` first, kept after the
    multiples in slot 15 of :func:`_mult`'s table), never below the smallest normal float32
    (NaN stays NaN): :func:`.levels._rounded`."""
    if HAS_FACTOR:
        y = y * factor
    y = y.to(tl.float32)
    return tl.where(y < _FLT_MIN, _FLT_MIN, y)


@triton.jit
def _at_least(t):
    """The smallest float32 at or above float64 ``t >= 0`` (or NaN), so that for any float32
    x, ``x >= _at_least(t)`` is ``x >= t`` (+Inf where no finite float32 reaches ``t``; the
    smallest subnormal for 0 < t below it)."""
    n = t.to(tl.float32)  # nearest
    up = (n.to(tl.int32, bitcast=True) + 1).to(tl.float32, bitcast=True)  # the next above n >= 0
    return tl.where(n.to(tl.float64) < t, up, n)


@triton.jit
def _bf16_bits(x):
    """The bfloat16 bits (int16) of float32 ``x`` rounded to nearest, ties to even, as torch
    rounds (NaN: 0x7FC0). Integer operations, so the interpreter (which truncates its own
    float32 -> bfloat16 conversion) gives the GPU's bits."""
    u = x.to(tl.int32, bitcast=True)
    r = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    return tl.where(x != x, 0x7FC0, r & 0xFFFF).to(tl.int16)


@triton.jit
def _whole_words(length):
    """``length``, a multiple of 16, as a value the compiler knows to be one (so that a mask
    ``i < length`` holds for 16 values at a time: vector loads). Not ``tl.multiple_of(length,
    16)``: that marks the op that made ``length``, so it would hold on every path, also where
    ``length`` is not a multiple of 16."""
    return length // 16 * 16


@triton.jit
def _masks(idx, n, w, nwords, BW: tl.constexpr, FULL: tl.constexpr):
    """The masks of a (BW, 16) tile's values ``idx`` (< ``n``) and of its words ``w`` (<
    ``nwords``); all true where FULL (the tile lies within both), so that the compiler reads and
    writes the tile in vectors whatever ``n`` is. (With :func:`_whole_words` of ``n`` as the
    bound it did so in the encode, not in the finish.)"""
    if FULL:
        return tl.full([BW, 16], 1, tl.int1), tl.full([BW], 1, tl.int1)
    return idx < n, w < nwords


@triton.jit
def _segment_mean(part_ptr, first, count, nseg, P: tl.constexpr):
    """The float64 mean of |r + g| over a segment: its chunks' sums, ``P`` at a time (lane j
    adds chunks j, j + P, ... in order, then the lanes are summed), / its length."""
    j = tl.arange(0, P)
    acc = tl.zeros([P], dtype=tl.float64)
    for off in range(0, count, P):
        acc += tl.load(part_ptr + first + off + j, mask=off + j < count, other=0.0)
    return tl.sum(acc, axis=0) / nseg


# ----------------------------------------------------------------- kernels

@triton.jit
def _encode_kernel(r_ptr, g_ptr, words_ptr, head_ptr, t_ptr, mow_ptr, n, nwords,
                   PER_WORD: tl.constexpr, BUCKET: tl.constexpr, SPLIT: tl.constexpr,
                   BW: tl.constexpr):
    """Packed words of ternary(r + g) for BW words, and their NaN/Inf flags. SPLIT (``n`` not a
    multiple of 16: a lone tensor's): a program whose words all lie within the ``n`` values
    reads them in vectors, the last one value by value."""
    pid = tl.program_id(0).to(tl.int64)
    w = pid * BW + tl.arange(0, BW)
    if SPLIT and (pid + 1) * (BW * 16) <= n:
        _encode_words(r_ptr, g_ptr, words_ptr, head_ptr, t_ptr, mow_ptr, w, n, nwords,
                      PER_WORD, BUCKET, BW, True)
    else:
        _encode_words(r_ptr, g_ptr, words_ptr, head_ptr, t_ptr, mow_ptr, w, n, nwords,
                      PER_WORD, BUCKET, BW, False)


@triton.jit
def _encode_words(r_ptr, g_ptr, words_ptr, head_ptr, t_ptr, mow_ptr, w, n, nwords,
                  PER_WORD: tl.constexpr, BUCKET: tl.constexpr, BW: tl.constexpr,
                  FULL: tl.constexpr):
    """:func:`_encode_kernel`'s words ``w`` of the ``n`` values (FULL: all of them within)."""
    idx = w[:, None] * 16 + tl.arange(0, 16)[None, :]
    m, wm = _masks(idx, n, w, nwords, BW, FULL)
    x = tl.load(r_ptr + idx, mask=m, other=0.0) + tl.load(g_ptr + idx, mask=m, other=0.0).to(tl.float32)
    if PER_WORD:
        t = tl.load(t_ptr + w, mask=wm, other=1.0)[:, None]
    else:
        t = tl.load(t_ptr)
    codes = tl.where(x >= t, _CODE_POS, tl.where(x <= -t, _CODE_NEG, 0))
    tl.store(words_ptr + w, _pack(codes), mask=wm)
    bad = (tl.max(((x - x) != 0).to(tl.int32), axis=1) > 0) & wm
    _flag_words(head_ptr, w, bad, mow_ptr, BUCKET)


@triton.jit
def _chunk_abs_sum(r_ptr, g_ptr, start, length, TW: tl.constexpr):
    """The float64 sum of |r + g| over ``length`` values from ``start``."""
    acc = tl.zeros([TW, 16], dtype=tl.float64)
    for off in range(0, length, 16 * TW):  # only the chunk's own tiles
        i = off + tl.arange(0, TW)[:, None] * 16 + tl.arange(0, 16)[None, :]
        m = i < length
        x = tl.load(r_ptr + start + i, mask=m, other=0.0) + \
            tl.load(g_ptr + start + i, mask=m, other=0.0).to(tl.float32)
        acc += tl.abs(x).to(tl.float64)
    return tl.sum(tl.sum(acc, axis=1), axis=0)


@triton.jit
def _abs_sums_kernel(r_ptr, g_ptr, ch_ptr, part_ptr, TW: tl.constexpr):
    """Pass 1 of "auto": the float64 sum of |r + g| over each chunk."""
    c = tl.program_id(0)
    start = tl.multiple_of(tl.load(ch_ptr + c * 5), 16)  # chunks start at whole words
    length = tl.load(ch_ptr + c * 5 + 1)
    if length % 16 == 0:  # whole words (every chunk but a tensor's last): vector loads
        total = _chunk_abs_sum(r_ptr, g_ptr, start, _whole_words(length), TW)
    else:
        total = _chunk_abs_sum(r_ptr, g_ptr, start, length, TW)
    tl.store(part_ptr + c, total)


@triton.jit
def _chunk_counts(r_ptr, g_ptr, stash_ptr, head_ptr, mow_ptr, start, length, mean, factor,
                  K: tl.constexpr, HAS_FACTOR: tl.constexpr, BUCKET: tl.constexpr,
                  ROWS: tl.constexpr, LANES: tl.constexpr):
    """:func:`_counts_kernel`'s pass over ``length`` values from ``start``: the (16, LANES)
    accumulators of the candidates' counts and float64 sums; stores the bytes and the flags."""
    cand = tl.arange(0, 16)[:, None]
    cacc = tl.zeros([16, LANES], dtype=tl.int32)
    tacc = tl.zeros([16, LANES], dtype=tl.float64)
    for off in range(0, length, ROWS * LANES):  # only the chunk's own tiles
        # lane t's ROWS values are contiguous (ROWS * t on): one vector load of r and of g
        i = off + tl.arange(0, ROWS)[:, None] + tl.arange(0, LANES)[None, :] * ROWS
        m = i < length
        x = tl.load(r_ptr + start + i, mask=m, other=0.0) + \
            tl.load(g_ptr + start + i, mask=m, other=0.0).to(tl.float32)
        ax = tl.where(m, tl.abs(x), -1.0)  # past the chunk: below every candidate
        a = ax.to(tl.float64)
        reached = tl.zeros([ROWS, LANES], dtype=tl.int32)
        for j in tl.static_range(K):
            tj = mean * _OPT_MULTIPLES[j]  # the thresholds: of the mean alone, out of the loop
            hit = ax >= _at_least(tj)  # |r + g| >= tj, in float32
            cacc += tl.where(cand == j, tl.sum(hit.to(tl.int32), axis=0)[None, :], 0)
            tacc += tl.where(cand == j, tl.sum(tl.where(hit, a, 0.0), axis=0)[None, :], 0.0)
            reached += (ax >= _rounded_by(tj, factor, HAS_FACTOR)).to(tl.int32)
        byte = tl.where(m, reached + tl.where(x > 0, 16, 0), 0)
        tl.store(stash_ptr + start + i, byte.to(tl.uint8), mask=m)
        # the flags a lane at a time: its ROWS values lie in one word (the chunk starts at a
        # whole word, ROWS divides 16), reduced within the thread. Value by value, the atomics'
        # operands took a layout of their own, a conversion through shared memory with barriers
        # in every pass of the loop (Triton 3.5 and 3.6)
        bad = tl.max(((x - x) != 0).to(tl.int32), axis=0) > 0  # 0.0 past the chunk
        _flag_words(head_ptr, (start + off + tl.arange(0, LANES) * ROWS) // 16, bad, mow_ptr,
                    BUCKET)
    return cacc, tacc


@triton.jit
def _counts_kernel(r_ptr, g_ptr, ch_ptr, part_ptr, mult_ptr, cnt_ptr, tot_ptr,
                   stash_ptr, head_ptr, mow_ptr, K: tl.constexpr, HAS_FACTOR: tl.constexpr,
                   BUCKET: tl.constexpr, ROWS: tl.constexpr, LANES: tl.constexpr,
                   P: tl.constexpr):
    """Pass 2 of "auto": per chunk, the count and float64 sum of |r + g| at or above each
    candidate (OPT_MULTIPLES times the segment's mean), one byte per value (how many rounded
    candidates |r + g| reaches, plus 16 where r + g > 0), and the NaN/Inf flags. A tile is
    (ROWS, LANES) values, lane t's ROWS contiguous values in one thread (a vector load each of
    r and g where the chunk is whole words): each candidate's count and sum over a lane go into
    that candidate's row of a (16, LANES) accumulator, within the thread (no shuffle, no
    barrier); the lanes are summed once, at the end of the chunk."""
    tl.static_assert(16 % ROWS == 0, "a lane's ROWS values must lie in one word")
    c = tl.program_id(0)
    start = tl.multiple_of(tl.load(ch_ptr + c * 5), 16)  # chunks start at whole words
    length = tl.load(ch_ptr + c * 5 + 1)
    first = tl.load(ch_ptr + c * 5 + 2)
    count = tl.load(ch_ptr + c * 5 + 3)
    nseg = tl.load(ch_ptr + c * 5 + 4)
    mean = _segment_mean(part_ptr, first, count, nseg.to(tl.float64), P)
    factor = tl.load(mult_ptr + 15)
    if length % 16 == 0:  # whole words (every chunk but a tensor's last): vector loads
        cacc, tacc = _chunk_counts(r_ptr, g_ptr, stash_ptr, head_ptr, mow_ptr, start,
                                   _whole_words(length), mean, factor, K, HAS_FACTOR, BUCKET,
                                   ROWS, LANES)
    else:
        cacc, tacc = _chunk_counts(r_ptr, g_ptr, stash_ptr, head_ptr, mow_ptr, start, length,
                                   mean, factor, K, HAS_FACTOR, BUCKET, ROWS, LANES)
    k = tl.arange(0, 16)
    tl.store(cnt_ptr + c * 16 + k, tl.sum(cacc, axis=1).to(tl.int64))
    tl.store(tot_ptr + c * 16 + k, tl.sum(tacc, axis=1))


@triton.jit
def _levels_kernel(seg_ptr, part_ptr, mult_ptr, cnt_ptr, tot_ptr, head_ptr, mag_off, ts_ptr,
                   vs_ptr, best_ptr, K: tl.constexpr, HAS_FACTOR: tl.constexpr,
                   P: tl.constexpr):
    """Pass 3 of "auto", one program per segment: its levels, the lsq choice from its chunks'
    counts and sums (P chunks at a time, as :func:`_segment_mean` adds), rounded as
    :func:`.levels._rounded`; writes the magnitude into the payload, and the segment's
    thresholds, magnitudes and chosen candidate for the packing pass."""
    s = tl.program_id(0)
    first = tl.load(seg_ptr + s * 3)
    count = tl.load(seg_ptr + s * 3 + 1)
    nseg = tl.load(seg_ptr + s * 3 + 2)
    ts = _segment_mean(part_ptr, first, count, nseg.to(tl.float64), P) * \
        tl.load(mult_ptr + tl.arange(0, 16))
    k = tl.arange(0, 16)
    rows = tl.arange(0, P)[:, None]
    cacc = tl.zeros([P, 16], dtype=tl.int64)
    tacc = tl.zeros([P, 16], dtype=tl.float64)
    for off in range(0, count, P):
        at = (off + rows) * 16 + k[None, :]  # (chunk, candidate) of the segment's chunks
        cacc += tl.load(cnt_ptr + first * 16 + at, mask=at < count * 16, other=0)
        tacc += tl.load(tot_ptr + first * 16 + at, mask=at < count * 16, other=0.0)
    cnt = tl.sum(cacc, axis=0)
    tot = tl.sum(tacc, axis=0)
    has = cnt > 0
    cf = tl.where(has, cnt, 1).to(tl.float64)
    score = tl.where(has, tot * tot / cf, 0.0)
    score = tl.where(k < K, score, -1.0)
    best = tl.argmax(score, 0, tie_break_left=True)
    sel = k == best
    t64 = tl.sum(tl.where(sel, ts, 0.0))
    cb = tl.sum(tl.where(sel, cnt, 0))
    tb = tl.sum(tl.where(sel, tot, 0.0))
    v64 = tl.where(cb > 0, tb / tl.where(cb > 0, cb, 1).to(tl.float64), t64)
    factor = tl.load(mult_ptr + 15)
    t32 = tl.where(nseg > 0, _rounded_by(t64, factor, HAS_FACTOR), 1.0)  # no values: 1.0
    v32 = tl.where(nseg > 0, _rounded_by(v64, factor, HAS_FACTOR), 1.0)
    tl.store(head_ptr + mag_off + s, v32.to(tl.int32, bitcast=True))
    tl.store(ts_ptr + s, t32)
    tl.store(vs_ptr + s, v32)
    tl.store(best_ptr + s, best.to(tl.int32))


@triton.jit
def _auto_pack_kernel(ch_ptr, seg_ptr, stash_ptr, words_ptr, ts_ptr, vs_ptr, best_ptr, tw_ptr,
                      vw_ptr, TW: tl.constexpr):
    """Pass 4 of "auto": per chunk, the packed words from pass 2's bytes with its segment's
    chosen candidate (a value is sent exactly when it reaches more rounded candidates than the
    chosen one's index), and the segment's levels for each of its words."""
    c = tl.program_id(0)
    start = tl.multiple_of(tl.load(ch_ptr + c * 5), 16)  # chunks start at whole words
    length = tl.load(ch_ptr + c * 5 + 1)
    seg = tl.load(seg_ptr + c)
    best = tl.load(best_ptr + seg)
    t32 = tl.load(ts_ptr + seg)
    v32 = tl.load(vs_ptr + seg)
    nw = (length + 15) // 16
    for off in range(0, nw, TW):
        wl = off + tl.arange(0, TW)
        i = wl[:, None] * 16 + tl.arange(0, 16)[None, :]
        wm = wl < nw
        # whole words of bytes (the stash has 16 a word): a word's 16 in one thread, one vector
        # load, packed within the thread; a word's bytes past the chunk were never written, and
        # send nothing
        byte = tl.load(stash_ptr + start + i, mask=tl.broadcast_to(wm[:, None], [TW, 16]),
                       other=0).to(tl.int32)
        codes = tl.where((byte & 15) > best, tl.where(byte >= 16, _CODE_POS, _CODE_NEG), 0)
        codes = tl.where(i < length, codes, 0)
        w = start // 16 + wl
        tl.store(words_ptr + w, _pack(codes), mask=wm)
        tl.store(tw_ptr + w, t32 + tl.zeros([TW], dtype=tl.float32), mask=wm)
        tl.store(vw_ptr + w, v32 + tl.zeros([TW], dtype=tl.float32), mask=wm)


@triton.jit
def _decode_kernel(rows_ptr, nranks, row_stride, body_off, lvl_off, lvl_idx_ptr, nvalues, nwords,
                   r_ptr, g_ptr, t_ptr, v_ptr, div_ptr, scale_ptr, dest_ptr,
                   mow_ptr, bad_ptr, mend_ptr,
                   LEVELS: tl.constexpr, COMMIT: tl.constexpr, OWN_PER_WORD: tl.constexpr,
                   DIVIDE: tl.constexpr, CHECK_BAD: tl.constexpr, BF16: tl.constexpr,
                   SPLIT: tl.constexpr, BW: tl.constexpr):
    """The decode-sum of ``nranks`` payload rows (row i's word w at rows[i * row_stride +
    body_off + w]) in rank order, each rank's level from its own row: LEVELS 0, the float32 at
    word ``lvl_off`` (a threshold); 1, at word ``lvl_off + lvl_idx[w]`` (a segment's or piece's
    magnitude); 2, 1.0 (counts). Then / divisor (correctly rounded) * scale where DIVIDE, into
    ``dest`` (its dtype). With COMMIT, first r <- (r + g) - q with this rank's (t, v). With
    CHECK_BAD, members flagged in ``bad`` get NaN over their values (their padding is left) and
    keep their residual. BF16: ``dest`` is a bfloat16 tensor seen as int16 (:func:`_bf16_bits`).
    SPLIT as in :func:`_encode_kernel` (``nvalues`` not a multiple of 16): a program whose
    words all lie within the values reads and writes them in vectors."""
    pid = tl.program_id(0).to(tl.int64)
    w = pid * BW + tl.arange(0, BW)
    if SPLIT and (pid + 1) * (BW * 16) <= nvalues:
        _decode_words(rows_ptr, nranks, row_stride, body_off, lvl_off, lvl_idx_ptr, w,
                      nvalues, nwords, r_ptr, g_ptr, t_ptr, v_ptr, div_ptr, scale_ptr, dest_ptr,
                      mow_ptr, bad_ptr, mend_ptr, LEVELS, COMMIT, OWN_PER_WORD, DIVIDE,
                      CHECK_BAD, BF16, BW, True)
    else:
        _decode_words(rows_ptr, nranks, row_stride, body_off, lvl_off, lvl_idx_ptr, w, nvalues,
                      nwords, r_ptr, g_ptr, t_ptr, v_ptr, div_ptr, scale_ptr, dest_ptr,
                      mow_ptr, bad_ptr, mend_ptr, LEVELS, COMMIT, OWN_PER_WORD, DIVIDE,
                      CHECK_BAD, BF16, BW, False)


@triton.jit
def _decode_words(rows_ptr, nranks, row_stride, body_off, lvl_off, lvl_idx_ptr, w, nvalues,
                  nwords, r_ptr, g_ptr, t_ptr, v_ptr, div_ptr, scale_ptr, dest_ptr,
                  mow_ptr, bad_ptr, mend_ptr,
                  LEVELS: tl.constexpr, COMMIT: tl.constexpr, OWN_PER_WORD: tl.constexpr,
                  DIVIDE: tl.constexpr, CHECK_BAD: tl.constexpr, BF16: tl.constexpr,
                  BW: tl.constexpr, FULL: tl.constexpr):
    """:func:`_decode_kernel`'s words ``w`` of the ``nvalues`` values (FULL: all of them
    within)."""
    idx = w[:, None] * 16 + tl.arange(0, 16)[None, :]
    m, wm = _masks(idx, nvalues, w, nwords, BW, FULL)
    sh = _shifts()[None, :]
    if LEVELS == 1:
        li = tl.load(lvl_idx_ptr + w, mask=wm, other=0)
    acc = tl.zeros([BW, 16], dtype=tl.float32)
    for i in range(0, nranks):
        base = rows_ptr + tl.cast(i, tl.int64) * row_stride
        word = tl.load(base + body_off + w, mask=wm, other=0)
        if LEVELS == 0:
            lv = tl.load(base + lvl_off).to(tl.float32, bitcast=True)
        elif LEVELS == 1:
            lv = tl.load(base + lvl_off + li, mask=wm, other=0).to(tl.float32, bitcast=True)[:, None]
        else:
            lv = 1.0
        c = (word[:, None] >> sh) & 3
        val = tl.where(c == _CODE_POS, lv, tl.where(c == _CODE_NEG, -lv, 0.0))
        acc = tl.where(i == 0, val, acc + val)  # rank 0's value itself (keeps a -0.0), then +
    if DIVIDE:
        acc = tl.math.div_rn(acc, tl.load(div_ptr)) * tl.load(scale_ptr)
    keep = m
    if CHECK_BAD:
        mem = tl.load(mow_ptr + w, mask=wm, other=0)
        bad = tl.load(bad_ptr + mem, mask=wm, other=0) != 0
        real = idx < tl.load(mend_ptr + mem, mask=wm, other=0)[:, None]
        keep = m & ~bad[:, None]
        acc = tl.where(bad[:, None], float("nan"), acc)
    if COMMIT:
        x = tl.load(r_ptr + idx, mask=keep, other=0.0) + \
            tl.load(g_ptr + idx, mask=keep, other=0.0).to(tl.float32)
        if OWN_PER_WORD:
            t = tl.load(t_ptr + w, mask=wm, other=1.0)[:, None]
            v = tl.load(v_ptr + w, mask=wm, other=1.0)[:, None]
        else:
            t = tl.load(t_ptr)
            v = tl.load(v_ptr)
        r_new = tl.where(x >= t, x - v, tl.where(x <= -t, x + v, x))
        tl.store(r_ptr + idx, r_new, mask=keep)
    if BF16:
        out = _bf16_bits(acc)
    else:
        out = acc.to(dest_ptr.dtype.element_ty)
    if CHECK_BAD:
        tl.store(dest_ptr + idx, out, mask=keep | (m & real))
    else:
        tl.store(dest_ptr + idx, out, mask=m)


# ----------------------------------------------------------------- tables (once per layout, device)

class _Tables:
    """A layout's device tables for these kernels."""

    def __init__(self, layout, device):
        def ints(values, dtype=torch.int32):
            return torch.tensor(values, dtype=dtype, device=device)
        mow, mend = [], []
        for i, (s, n, w) in enumerate(zip(layout.starts, layout.numels, layout.member_words)):
            mow += [i] * w
            mend.append(s + n)
        self.member_of_word = ints(mow or [0])
        self.member_end = ints(mend, torch.int64)
        head = layout.header(1.0 if layout.auto else 0.5)
        self.heads = {}
        self.head_pad = [0] * (layout.head_words - len(head))
        if layout.auto:
            sow, rows, seg, segs = [], [], [], []
            for k, (s, n, w) in enumerate(zip(layout.seg_starts, layout.seg_lengths, layout.seg_words)):
                sow += [k] * w
                first = len(rows)
                pieces = [(a, min(CHUNK, n - a)) for a in range(0, n, CHUNK)] or [(0, 0)]
                for a, length in pieces:
                    rows.append([s + a, length, first, len(pieces), n])
                    seg.append(k)
                segs.append([first, len(pieces), n])
            self.seg_of_word = ints(sow or [0])
            self.chunks = ints(rows, torch.int64)  # per chunk: start, length, first, count, n
            self.chunk_seg = ints(seg)
            self.segs = ints(segs, torch.int64)  # per segment: first chunk, chunks, values
            self.nchunks = len(rows)
            self.mults = {}
            self.mag_off = layout.head_words if layout.mag_words else 4

    def head(self, layout, threshold, device):
        """The payload's header words with every flag clear (an int32 tensor)."""
        if threshold not in self.heads:
            self.heads[threshold] = torch.tensor(layout.header(threshold) + self.head_pad,
                                                 dtype=torch.int32, device=device)
        return self.heads[threshold]


def tables(on, layout, device):
    """The layout's :class:`_Tables` on ``device``, kept in ``on`` (the codec's other tables of
    the layout on that device) once made."""
    if on.triton is None:
        on.triton = _Tables(layout, device)
    return on.triton


def _mult(tab, k):
    """OPT_MULTIPLES as float64, padded to 16, the rule's factor ``k`` (or 1) in the last slot."""
    m = tab.mults.get(k)
    if m is None:
        vals = list(wire.OPT_MULTIPLES) + [0.0] * (_KP - _K - 1) + [float(k) if k else 1.0]
        m = tab.mults[k] = torch.tensor(vals, dtype=torch.float64, device=tab.member_end.device)
    return m


_CONSTANTS = {}


def _f32(x, device):
    """A float32 tensor of a threshold, divisor or scale; a number's made once per device (no
    copy to the device per call)."""
    if isinstance(x, torch.Tensor):
        return x if x.dtype == torch.float32 else x.to(torch.float32)
    # keyed by the number where equal numbers are one float32, by its hex where not (0.0 and
    # -0.0 are equal, NaN is not equal to itself): float.hex costs the host ~1 us a call
    key = (x if x and x == x else float(x).hex(), device)
    got = _CONSTANTS.get(key)
    if got is None:
        got = _CONSTANTS[key] = torch.tensor(float(x), dtype=torch.float32, device=device)
    return got


def _grid(nwords, bw=None):
    return (max(1, -(-nwords // (bw or BLOCK_WORDS))),)  # (triton.cdiv: ~3 us on the host)


# ----------------------------------------------------------------- the codec's entry points

def pack(r, g, threshold, words, head, member_of_word=None):
    """Packs ternary(r + g) into ``words`` (int32, ceil(n / 16)) and ORs the NaN/Inf flags into
    ``head`` (the payload; with ``member_of_word``, its members' flag bytes too). ``threshold``:
    a number, a 0-d tensor, or one per word."""
    n = g.numel()
    nwords = wire.num_words(n)
    if not nwords:
        return
    t = _f32(threshold, g.device)
    per_word = t.dim() > 0
    _encode_kernel[_grid(nwords)](
        r, g, words, head, t, member_of_word if member_of_word is not None else words, n, nwords,
        PER_WORD=per_word, BUCKET=member_of_word is not None, SPLIT=n % 16 != 0, BW=BLOCK_WORDS,
        **_launch_options())


def encode_payload(layout, on, r, g, threshold, rule, payload, segment_levels):
    """:func:`horovod_twobit.torch.codec.encode_payload` in Triton kernels: the same payload
    bits, the same (threshold, magnitude) returned. ``on``: where the layout's tables on this
    device are kept (:func:`tables`); ``segment_levels`` gives an "auto" layout's levels for the
    rules other than ``lsq``."""
    dev = g.device
    tab = tables(on, layout, dev)
    head = tab.head(layout, "auto" if layout.auto else threshold, dev)
    payload[:head.numel()].copy_(head)
    mow = None if layout.single else tab.member_of_word
    body = payload[layout.body:]
    if not layout.auto:
        pack(r, g, threshold, body, payload, mow)
        return threshold, threshold
    base, k = wire.parse_rule(rule)
    if base != "lsq":
        ts, mags = segment_levels(layout, r, g, rule)
        t, v = _per_word(layout, tab, ts), _per_word(layout, tab, mags)
        pack(r, g, t, body, payload, mow)
        if layout.mag_words:
            payload[layout.head_words:layout.body].copy_(mags.view(torch.int32))
        else:
            payload[4:5].copy_(mags.view(torch.int32))
        return t, v
    nc, words = tab.nchunks, layout.words
    part = torch.empty(nc, dtype=torch.float64, device=dev)
    cnt = torch.empty((nc, _KP), dtype=torch.int64, device=dev)
    tot = torch.empty((nc, _KP), dtype=torch.float64, device=dev)
    stash = torch.empty(max(1, 16 * words), dtype=torch.uint8, device=dev)
    tw = torch.empty(max(1, words), dtype=torch.float32, device=dev)
    vw = torch.empty_like(tw)
    ts = torch.empty(layout.segments, dtype=torch.float32, device=dev)
    vs = torch.empty_like(ts)
    best = torch.empty(layout.segments, dtype=torch.int32, device=dev)
    opts = _launch_options()
    mult = _mult(tab, k)
    _abs_sums_kernel[(nc,)](r, g, tab.chunks, part, TW=TILE_WORDS, **opts)
    _counts_kernel[(nc,)](r, g, tab.chunks, part, mult, cnt, tot, stash, payload,
                          mow if mow is not None else tab.chunks, K=_K, HAS_FACTOR=bool(k),
                          BUCKET=mow is not None, ROWS=COUNT_ROWS, LANES=COUNT_LANES,
                          P=SUM_LANES, **opts)
    _levels_kernel[(layout.segments,)](tab.segs, part, mult, cnt, tot, payload, tab.mag_off, ts,
                                       vs, best, K=_K, HAS_FACTOR=bool(k), P=SUM_LANES, **opts)
    _auto_pack_kernel[(nc,)](tab.chunks, tab.chunk_seg, stash, body, ts, vs, best, tw, vw,
                             TW=PACK_WORDS, **opts)
    if layout.segments == 1:
        return ts[0], vs[0]
    return tw[:words], vw[:words]


def _per_word(layout, tab, seg):
    if layout.segments == 1:
        return seg[0]
    return seg.index_select(0, tab.seg_of_word[:layout.words])


def finish_payload(layout, on, gathered, nranks, bad, r, g, t, v, divisor, scale, out=None):
    """:func:`horovod_twobit.torch.codec.finish_payload`'s pass after the payloads are checked
    (``bad``: each member's NaN/Inf flag over every rank, as the host parsed them): one launch.
    ``on`` as for :func:`encode_payload`."""
    dev = g.device
    tab = tables(on, layout, dev)
    dest = g if out is None else out
    n, nwords = layout.values, layout.words
    if not nwords:
        return dest
    if not layout.auto:
        levels, lvl_off, lvl_idx = 0, 4, tab.member_of_word
    elif layout.mag_words:
        levels, lvl_off, lvl_idx = 1, layout.head_words, tab.seg_of_word
    else:
        levels, lvl_off, lvl_idx = 0, 4, tab.member_of_word
    t = _f32(t, dev)
    v = t if v is None else _f32(v, dev)
    if t.dim() != v.dim():  # one per word and one 0-d: both per word
        t, v = (x.expand(nwords).contiguous() if not x.dim() else x for x in (t, v))
    check = any(bad)
    flags = torch.tensor([int(b) for b in bad], dtype=torch.int32, device=dev) if check \
        else tab.member_end
    bf16 = dest.dtype == torch.bfloat16
    _decode_kernel[_grid(nwords)](
        gathered, nranks, layout.payload_words, layout.body, lvl_off, lvl_idx, n, nwords,
        r, g, t, v, _f32(divisor, dev), _f32(scale, dev), dest.view(torch.int16) if bf16 else dest,
        tab.member_of_word, flags, tab.member_end,
        LEVELS=levels, COMMIT=True, OWN_PER_WORD=t.dim() > 0 or v.dim() > 0, DIVIDE=True,
        CHECK_BAD=check, BF16=bf16, SPLIT=n % 16 != 0, BW=BLOCK_WORDS, **_launch_options())
    return dest


def decode_rows(received, nranks, row_stride, body_off, nwords, out, lvl_off=None, lvl_idx=None):
    """The scatter owner's decode-sum, every sender's chunk in one launch: sender i's ``nwords``
    words at ``received[i * row_stride + body_off:]``, decoded with 1.0 per code (counts;
    ``lvl_off`` None) or with each word's piece magnitude at ``received[i * row_stride + lvl_off
    + lvl_idx[w]]``, summed in rank order into ``out`` (float32, 16 * nwords values)."""
    if not nwords:
        return out
    dummy = out
    _decode_kernel[_grid(nwords)](
        received, nranks, row_stride, body_off, 0 if lvl_off is None else lvl_off,
        received if lvl_idx is None else lvl_idx, 16 * nwords, nwords,
        dummy, dummy, dummy, dummy, dummy, dummy, out, received, received, received,
        LEVELS=2 if lvl_off is None else 1, COMMIT=False, OWN_PER_WORD=False, DIVIDE=False,
        CHECK_BAD=False, BF16=False, SPLIT=False, BW=BLOCK_WORDS, **_launch_options())
    return out
