"""The scatter exchange's owner encode ("auto" phase 2), 3-bit against the 2-bit one it replaced.

    python -m horovod_twobit.benchmarks.owner_encode [--sizes 64K,1M,4M] [--ranks 8] [--threads 1]
        [--frameworks torch,tensorflow] [--paths function,eager]
    python -m horovod_twobit.benchmarks.codec --owner ...     # the same rows (PyTorch)

For one owner's chunk of each size (a tensor of N times as many values in the default blocks,
cut into N chunks: the chunk's pieces are its blocks), the time per value of what the owner does
between summing the chunk and sending it (the sum itself, the same in both, is not timed):

- 2-bit (scatter format 1): the least-squares levels of each piece (``levels.auto_levels``, all
  nine candidate multiples of mean |x|), the packed 2-bit words, the residual's commit;
- 3-bit (format 2, :func:`horovod_twobit.torch.codec.owner.owner_encode`): each piece's max |x|,
  the codes k = round(x / a), their three planes, the residual x - k * a.

PyTorch: eager ops, as the binding runs them. TensorFlow (:mod:`horovod_twobit.tensorflow.
owner_codec` against format 1's owner encode, rebuilt here as it was: ``codec._row_levels`` over
tables of equal-length pieces, ``codec.codes`` / ``pack`` / ``committed``, the bad members'
residuals kept): path ``function``, each in a ``tf.function`` (graph ops, no XLA), as the binding
runs its exchange, or ``eager``. CPU; the two take turns (see ``timing.time_round_robin``), each
figure the median of the calls.
"""

import argparse
import functools

import numpy as np
import torch

from horovod_twobit.wire import scatter as sw
from horovod_twobit import wire
from horovod_twobit.wire.layout import Layout
from horovod_twobit.torch.codec import kernels, levels, owner as owner_codec
from horovod_twobit.benchmarks.timing import parse_size, time_round_robin


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


def _chunk(n, ranks):
    """(chunks, the pieces of chunk 0, its words, its values) of a tensor of ``n * ranks``
    values in the default blocks."""
    lay = Layout([n * ranks], True, *wire.validate_blocks("auto"))
    chunks = sw.Chunks(lay, ranks)
    return chunks, chunks.pieces[0], chunks.words(0), chunks.values(0)


def measure(n, ranks=8):
    """Seconds per value of the 2-bit and the 3-bit owner encode of a chunk of about ``n``
    values, and the chunk's pieces."""
    chunks, pieces, wc, nv = _chunk(n, ranks)
    words = owner_codec.piece_words(pieces, "cpu")
    S = torch.randn(nv) * torch.rand(nv) ** 4  # a heavy-tailed sum
    r2, r3 = torch.zeros(nv), torch.zeros(nv)
    bad = [False] * chunks.layout.members
    t2, t3 = time_round_robin(
        [lambda: encode_2bit(pieces, words, wc, r2, S),
         lambda: owner_codec.owner_encode(pieces, wc, r3, S, bad, words)], torch.device("cpu"))
    return t2 / nv, t3 / nv, len(pieces)


def piece_levels_tf(pieces, x, rule="lsq"):
    """The 2-bit phase 2's levels in TF ops, as format 1's owner computed them: (thresholds,
    magnitudes) of ``x`` over each piece, each table of equal-length pieces one reduction."""
    import tensorflow as tf
    from horovod_twobit.tensorflow import codec
    name, k = wire.parse_rule(rule)
    by_len = {}
    for i, p in enumerate(pieces):
        by_len.setdefault(p[3], []).append(i)
    ts, vs, order = [], [], []
    for length, ids in sorted(by_len.items()):
        first = pieces[ids[0]][2]
        if all(pieces[i][2] == first + j * length for j, i in enumerate(ids)):
            rows = x[first:first + len(ids) * length]
        else:
            rows = tf.gather(x, np.concatenate([np.arange(pieces[i][2], pieces[i][2] + length)
                                                for i in ids]).astype(np.int32))
        t, v = codec._row_levels(tf.reshape(rows, [len(ids), length]), name, k)
        ts, vs, order = ts + [t], vs + [v], order + ids
    if len(ts) == 1 and order == sorted(order):
        return ts[0], vs[0]
    perm = np.argsort(np.asarray(order), kind="stable").astype(np.int32)
    return tf.gather(tf.concat(ts, 0), perm), tf.gather(tf.concat(vs, 0), perm)


def encode_2bit_tf(chunks, owner, residual, S, bad):
    """Format 1's owner encode in TF ops: (magnitudes as int32 and packed words, the new
    residual; pieces of ``bad`` members keep theirs)."""
    import tensorflow as tf
    from horovod_twobit.tensorflow import codec
    from horovod_twobit.tensorflow.codec.scatter import piece_values
    pieces = chunks.pieces[owner]
    x = residual + S
    ts, vs = piece_levels_tf(pieces, x)
    t, v = piece_values(chunks, owner, ts), piece_values(chunks, owner, vs)
    packed = codec.pack(codec.codes(x, t))
    keep = piece_values(chunks, owner, tf.gather(bad, np.asarray([p[1] for p in pieces],
                                                                 np.int32)))
    new = tf.where(keep, residual, codec.committed(S, residual, t, v))
    return tf.concat([tf.bitcast(vs, tf.int32), packed], 0), new


def measure_tf(n, ranks=8, path="function"):
    """:func:`measure` for the TensorFlow binding (``path``: "function" or "eager")."""
    import tensorflow as tf
    from horovod_twobit.tensorflow.codec import owner as tf_owner
    chunks, pieces, wc, nv = _chunk(n, ranks)
    S = tf.constant((torch.randn(nv) * torch.rand(nv) ** 4).numpy())  # a heavy-tailed sum
    r, bad = tf.zeros([nv], tf.float32), tf.zeros([chunks.layout.members], tf.bool)
    enc2 = functools.partial(encode_2bit_tf, chunks, 0)
    enc3 = functools.partial(tf_owner.owner_encode, pieces, wc)
    if path == "function":
        enc2, enc3 = (tf.function(f, autograph=False) for f in (enc2, enc3))
    # CPU ops run synchronously: a call returns once its results exist
    t2, t3 = time_round_robin([lambda: enc2(r, S, bad), lambda: enc3(r, S, bad)],
                               torch.device("cpu"))
    return t2 / nv, t3 / nv, len(pieces)


def table(sizes, ranks, out=print, frameworks=("torch",), paths=("function",)):
    out("| framework | values per chunk | N | pieces | 2-bit owner encode (ns/value) "
        "| 3-bit (ns/value) | 3-bit / 2-bit |")
    out("|---|---:|---:|---:|---:|---:|---:|")
    rows = []
    runs = [("torch", None)] if "torch" in frameworks else []
    runs += [("tensorflow", p) for p in paths if "tensorflow" in frameworks]
    for fw, path in runs:
        for size in sizes:
            n = parse_size(size)
            t2, t3, k = measure(n, ranks) if fw == "torch" else measure_tf(n, ranks, path)
            rows.append((fw, path, n, t2, t3))
            name = fw if path is None else "%s (%s)" % (fw, path)
            out("| %s | %s | %d | %d | %.2f | %.2f | %.2f |"
                % (name, size, ranks, k, 1e9 * t2, 1e9 * t3, t3 / t2))
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="64K,1M,4M")
    p.add_argument("--ranks", type=int, default=8)
    p.add_argument("--threads", type=int, default=0,
                   help="torch's and TensorFlow's threads (0: their defaults)")
    p.add_argument("--frameworks", default="torch", help="torch, tensorflow or both")
    p.add_argument("--paths", default="function",
                   help="TensorFlow: function (a tf.function, as the binding runs it), eager")
    args = p.parse_args(argv)
    frameworks = args.frameworks.split(",")
    if args.threads:
        torch.set_num_threads(args.threads)
        if "tensorflow" in frameworks:
            import tensorflow as tf
            tf.config.threading.set_intra_op_parallelism_threads(args.threads)
            tf.config.threading.set_inter_op_parallelism_threads(args.threads)
    table(args.sizes.split(","), args.ranks, frameworks=frameworks, paths=args.paths.split(","))


if __name__ == "__main__":
    main()
