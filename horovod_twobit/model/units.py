"""What one training step exchanges, for the step-time model (:mod:`horovod_twobit.model.steptime`):
its units in the order their gradients become ready (a tensor that Horovod allreduces, or a TwoBit
bucket by the project's own bucketing, :func:`horovod_twobit.wire.layout.assign_buckets`), each
unit's bytes by the project's own formats (the allgather payload of :mod:`horovod_twobit.wire.layout`,
:mod:`horovod_twobit.wire.scatter`'s chunks) and its codec calls by a device profile, and the bytes
one rank sends per step (:func:`exchange_bytes`). Pure Python."""

import bisect
import json
import math

from horovod_twobit.wire import layout as _layout
from horovod_twobit.wire import scatter as _sw
from horovod_twobit import wire as _wire
from horovod_twobit.model.device import bandwidth_bound_profile, codec_s

PAGE_BYTES = 4096
# glibc's largest mmap threshold on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX): an allocation of at least
# this much is mapped fresh and unmapped when freed, however far the threshold has grown
FRESH_MAP_BYTES = 32 << 20


def fresh_pages(nbytes):
    """Pages of a buffer of ``nbytes`` that a step allocates anew and the kernel faults in and
    zero-fills every time: all of them from :data:`FRESH_MAP_BYTES` up (torch's CPU allocator
    keeps no cache; glibc maps such a buffer fresh each step), none below (there the heap serves
    it, and what it faults in again depends on its history, its trim threshold: not counted).
    A device profile charges each ``page_s`` (measured on CPU hosts, else 0)."""
    return -(-int(nbytes) // PAGE_BYTES) if nbytes >= FRESH_MAP_BYTES else 0


def scatter_words(lay, nranks):
    """(sum over owners of phase-1 chunk words, sum over owners of phase-2 words) for a layout:
    :class:`scatter_wire.Chunks`' counts in O(N log segments)."""
    N, W = nranks, lay.words
    fw = _wire.flag_words(lay.members)
    starts = [c * W // N for c in range(N + 1)]
    auto = lay.auto
    if auto:
        ends = [s // 16 + w for s, w in zip(lay.seg_starts, lay.seg_words)]
    sent = red = 0
    bits = _sw.count_bits(N)
    for c in range(N):
        wc = starts[c + 1] - starts[c]
        m = 0
        if auto and wc:
            first = bisect.bisect_right(ends, starts[c])
            last = bisect.bisect_right(ends, starts[c + 1] - 1)
            m = last - first + 1
        elif auto:  # an empty chunk strictly inside a segment still carries its magnitude
            k = bisect.bisect_right(ends, starts[c])
            m = int(k < len(ends) and (ends[k - 1] if k else 0) < starts[c])
        sent += _sw.HEADER_WORDS + fw + m + wc
        red += _sw.HEADER_WORDS + (m + _sw.OWNER_BITS * _sw.plane_words(wc) if auto
                                   else bits * _sw.plane_words(wc))
    return sent, red


class Unit:
    """One thing the exchange sends: a tensor (allreduce) or a TwoBit bucket."""

    __slots__ = ("members", "values", "kind", "bytes", "bytes2", "encode", "owner", "decode",
                 "ready", "done", "dtype_bytes", "pages")

    def __init__(self, members, values, kind):
        self.members, self.values, self.kind = members, values, kind
        self.bytes = self.bytes2 = self.encode = self.owner = self.decode = 0.0
        self.ready = self.done = 0.0
        self.dtype_bytes = 4
        self.pages = 0  # pages it maps fresh per step (:func:`fresh_pages`), in its codec's cost


_CACHE = {}


def units(sizes, method, nranks, prof, bucket_bytes):
    """The units of a step in the order their gradients become ready (fresh objects; their
    sizes, bytes and codec costs are computed once per model, method, N and profile)."""
    key = (tuple(sizes), method, nranks, bucket_bytes,
           json.dumps([prof["codec"], prof.get("codec_by_size"), prof.get("codec_members"),
                       prof.get("codec_tables"), prof.get("codec_segments"),
                       prof["cast_fp16_s"], prof.get("page_s", 0.0)], sort_keys=True))
    if key not in _CACHE:
        if len(_CACHE) > 4096:
            _CACHE.clear()
        _CACHE[key] = [(u.members, u.values, u.kind, u.bytes, u.bytes2, u.encode, u.owner,
                        u.decode, u.dtype_bytes, u.pages)
                       for u in _make(sizes, method, nranks, prof, bucket_bytes)]
    out = []
    for members, values, kind, b1, b2, enc, own, dec, db, pages in _CACHE[key]:
        u = Unit(members, values, kind)
        u.bytes, u.bytes2, u.encode, u.owner, u.decode, u.dtype_bytes = b1, b2, enc, own, dec, db
        u.pages = pages
        out.append(u)
    return out


def _make(sizes, method, nranks, prof, bucket_bytes):
    """The units of a step (see :func:`units`), made anew."""
    N = nranks
    if method in ("none", "fp16"):
        out = []
        for i in reversed(range(len(sizes))):
            if sizes[i]:
                u = Unit([i], sizes[i], "allreduce")
                u.dtype_bytes = 2 if method == "fp16" else 4
                if method == "fp16":  # a float16 copy, then a float32 result
                    cast, page = sizes[i] * prof["cast_fp16_s"], prof.get("page_s", 0.0)
                    half, result = fresh_pages(2 * sizes[i]), fresh_pages(4 * sizes[i])
                    u.encode, u.decode = cast + half * page, cast + result * page
                    u.pages = half + result
                out.append(u)
        return out
    auto = method in ("auto", "scatter_auto")
    threshold = "auto" if auto else 0.5
    block, blocks = _wire.validate_blocks(threshold)
    entries = [(i, int(sizes[i]), 4 * int(sizes[i]), "") for i in reversed(range(len(sizes)))]
    buckets = _layout.assign_buckets(entries, _layout.validate_bucket_bytes(bucket_bytes))
    in_bucket = {i: k for k, b in enumerate(buckets) for i in b}
    seen, groups = set(), []
    for i, n, _, _ in entries:  # ready order: a bucket when its last member is ready
        if not n:
            continue
        k = in_bucket.get(i)
        if k is None:
            groups.append([i])
        elif all(j == i or j in seen for j in buckets[k]):
            groups.append(buckets[k])
        seen.add(i)
    exchange = "scatter" if method.startswith("scatter") else "allgather"
    return [bucket_unit(_layout.Layout([sizes[i] for i in g], auto, block, blocks), exchange, N,
                        prof, g) for g in groups]


def bucket_unit(lay, exchange, nranks, prof, members=None):
    """The unit of one TwoBit bucket of layout ``lay`` sent by ``exchange`` ("allgather" or
    "scatter") among ``nranks`` ranks: its bytes by the formats' own counts, its codec calls by
    the profile (per member, and per table and per segment of an "auto" layout's segments beyond
    one tensor's, where it measured those)."""
    N, suffix = nranks, "_auto" if lay.auto else ""
    u = Unit(members, lay.values, exchange)
    tables, segments = (lay.table_count, lay.extra_segments) if lay.auto else (1, 0)
    cost = lambda key: codec_s(prof, key + suffix, lay.values, N, lay.members,  # noqa: E731
                               tables, segments)
    if exchange == "scatter":
        sent, red = scatter_words(lay, N)
        u.bytes = 4.0 * sent * (N - 1) / N      # one rank's share of the alltoall
        u.bytes2 = 4.0 * red * (N - 1) / N      # and of the allgather of the owners' sums
        u.encode, u.owner, u.decode = (cost("scatter_encode"), cost("owner"),
                                       cost("scatter_finish"))
    else:
        u.bytes = 4.0 * lay.payload_words        # sent to each of the N - 1 others
        u.encode, u.decode = cost("encode"), cost("finish")
        u.pages = fresh_pages(N * u.bytes)       # the gathered payloads, Horovod's output
        u.decode += u.pages * prof.get("page_s", 0.0)
    return u


def exchange_bytes(sizes, method, nranks, bucket_bytes=None, powersgd_rank=4):
    """Bytes one rank sends per step (its share of every collective) for ``method``."""
    prof = bandwidth_bound_profile("bytes", 1e12, "")
    N = nranks
    if method == "powersgd":
        return sum(powersgd_bytes(n, powersgd_rank) for n in sizes) * 2 * (N - 1) / N
    total = 0.0
    for u in units(sizes, method, N, prof, bucket_bytes):
        if u.kind == "allreduce":
            total += 2.0 * (N - 1) / N * u.values * u.dtype_bytes
        elif u.kind == "allgather":
            total += (N - 1) * u.bytes
        else:
            total += u.bytes + u.bytes2
    return total


def powersgd_bytes(n, r):
    """float32 bytes PowerSGD allreduces for a tensor of n values taken as a square matrix
    (P and Q: (rows + cols) r values); small or 1-D tensors go uncompressed."""
    side = math.isqrt(n)
    if n < 4096 or side * side < n // 2:
        return 4 * n
    return 4 * (side + (n + side - 1) // side) * r
