"""The scatter exchange's owner encode ("auto" phase 2), 3-bit against the 2-bit one it replaced.

    python -m horovod_twobit.benchmarks.owner_encode [--sizes 64K,1M,4M] [--ranks 8] [--threads 1]
    python -m horovod_twobit.benchmarks.codec --owner ...     # the same rows

For one owner's chunk of each size (a tensor of N times as many values in the default blocks,
cut into N chunks: the chunk's pieces are its blocks), the time per value of what the owner does
between summing the chunk and sending it (the sum itself, the same in both, is not timed):

- 2-bit (scatter format 1): the least-squares levels of each piece (``levels.auto_levels``, all
  nine candidate multiples of mean |x|), the packed 2-bit words, the residual's commit;
- 3-bit (format 2, :func:`horovod_twobit.torch.owner_codec.owner_encode`): each piece's max |x|,
  the codes k = round(x / a), their three planes, the residual x - k * a.

PyTorch, eager ops, CPU; the two take turns (see ``codec._time_round_robin``).
"""

import argparse

import torch

from .. import scatter_wire as sw
from .. import wire
from ..layout import Layout
from ..torch import kernels, levels, owner_codec
from .codec import _parse_size, _time_round_robin


def piece_levels(pieces, r, g, rule="lsq"):
    """The 2-bit phase 2's levels: automatic (thresholds, magnitudes) of r + g over each piece,
    pieces of equal length reduced together (as scatter format 1's owner did)."""
    ts = torch.empty(len(pieces), dtype=torch.float32, device=g.device)
    vs = torch.empty_like(ts)
    by_len = {}
    for i, p in enumerate(pieces):
        by_len.setdefault(p[3], []).append(i)
    for length, ids in by_len.items():
        idx = torch.cat([torch.arange(pieces[i][2], pieces[i][2] + length, device=g.device)
                         for i in ids])
        t, v = levels.auto_levels(r.index_select(0, idx).view(len(ids), length),
                                  g.index_select(0, idx).view(len(ids), length), rule)
        where = torch.tensor(ids, dtype=torch.int64, device=g.device)
        ts.index_copy_(0, where, t)
        vs.index_copy_(0, where, v)
    return ts, vs


def encode_2bit(pieces, words, wc, residual, S):
    """The 2-bit owner encode: (magnitudes as int32, packed words); commits ``residual``."""
    t, v = piece_levels(pieces, residual, S)
    t_w = torch.repeat_interleave(t, words, output_size=wc)
    v_w = torch.repeat_interleave(v, words, output_size=wc)
    packed, _ = kernels.pack(residual, S, t_w)
    kernels.commit(residual, S, t_w, v_w)
    return torch.cat([v.view(torch.int32), packed])


def measure(n, ranks=8):
    """Seconds per value of the 2-bit and the 3-bit owner encode of a chunk of about ``n``
    values, and the chunk's pieces."""
    lay = Layout([n * ranks], True, *wire.validate_blocks("auto"))
    chunks = sw.Chunks(lay, ranks)
    pieces, wc, nv = chunks.pieces[0], chunks.words(0), chunks.values(0)
    words = owner_codec.piece_words(pieces, "cpu")
    S = torch.randn(nv) * torch.rand(nv) ** 4  # a heavy-tailed sum
    r2, r3 = torch.zeros(nv), torch.zeros(nv)
    bad = [False] * lay.members
    t2, t3 = _time_round_robin(
        [lambda: encode_2bit(pieces, words, wc, r2, S),
         lambda: owner_codec.owner_encode(pieces, wc, r3, S, bad, words)], torch.device("cpu"))
    return t2 / nv, t3 / nv, len(pieces)


def table(sizes, ranks, out=print):
    out("| values per chunk | N | pieces | 2-bit owner encode (ns/value) | 3-bit (ns/value) "
        "| 3-bit / 2-bit |")
    out("|---:|---:|---:|---:|---:|---:|")
    rows = []
    for size in sizes:
        n = _parse_size(size)
        t2, t3, k = measure(n, ranks)
        rows.append((n, t2, t3))
        out("| %s | %d | %d | %.2f | %.2f | %.2f |" % (size, ranks, k, 1e9 * t2, 1e9 * t3, t3 / t2))
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="64K,1M,4M")
    p.add_argument("--ranks", type=int, default=8)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    table(args.sizes.split(","), args.ranks)


if __name__ == "__main__":
    main()
