"""How many bits does the scatter exchange's phase 2 need with a numeric threshold, as N grows?

    python -m examples.count_entropy [--ranks 4,8] [--steps 10] [--batch 4]

With a numeric threshold t, owner c sends, for every value of its chunk, the count of ranks that
sent +t minus those that sent -t: an integer in [-N, N], in ceil(log2(2N + 1)) bits
(``scatter_wire.count_bits``). This trains ``examples/bench_cluster.py``'s MLP (its default sizes,
threshold and SGD step) with N simulated ranks in one process: every rank encodes its own
gradient with its own residual through the project's codec (``horovod_twobit.torch.codec``), the
counts are summed as an owner sums them, and the model takes the averaged result, as the real
exchange would. For each N it prints the counts' distribution and their zeroth-order entropy H
(bits per value: what an ideal entropy coder of independent values would need), then the bits
per value a host sends per step, (N - 1) / N * (2 + phase-2 bits), with the format's fixed-width
planes and with H, and the growth of both between consecutive N.

The zeroth-order entropy is a bound for coders that treat values independently (a context model
could use correlations between neighbouring values); it shows how much of the fixed-width
format's growth with N is information that any such lossless code would have to send.
"""

import argparse
import os
import sys
from types import SimpleNamespace

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import torch  # noqa: E402

from horovod_twobit.wire import scatter as sw  # noqa: E402
from horovod_twobit.torch import codec  # noqa: E402


def histogram(counts):
    """{value: share of the values} of an integer tensor."""
    values, freq = torch.unique(counts, return_counts=True)
    return {int(v): float(f) / counts.numel() for v, f in zip(values, freq)}


def bits(hist):
    """Zeroth-order entropy (bits per value) of a :func:`histogram`."""
    p = torch.tensor(list(hist.values()), dtype=torch.float64)
    return float(-(p * p.log2()).sum())


def entropy(counts):
    """Zeroth-order entropy (bits per value) of an integer tensor."""
    return bits(histogram(counts))


def simulate(nranks, steps, batch, threshold, sizes, lr=0.1):
    """Per step: (histogram {count: share}, entropy) of the summed counts of N simulated ranks."""
    from examples._cluster_worker import build

    net, data = build("mlp", SimpleNamespace(mlp_in=sizes[0], mlp_hidden=sizes[1]))
    params = list(net.parameters())
    residuals = [[torch.zeros(p.numel()) for p in params] for _ in range(nranks)]
    out = []
    for step in range(steps):
        counts = [torch.zeros(p.numel(), dtype=torch.int64) for p in params]
        for r in range(nranks):
            net.zero_grad()
            x, y = data(r, step, batch)
            ((net(x) - y) ** 2).mean().backward()
            for k, p in enumerate(params):
                words = codec.encode(p.grad, residuals[r][k], threshold)
                counts[k] += torch.round(codec.decode(words, p.numel(), threshold) / threshold).long()
        hist = histogram(torch.cat(counts))
        out.append((hist, bits(hist)))
        with torch.no_grad():  # the averaged result, as every rank applies it
            for k, p in enumerate(params):
                p -= lr * (counts[k].float() * threshold / nranks).view(p.shape)
    return out


def sent_bits(nranks, phase2_bits):
    """Bits per value a host sends per step in the scatter exchange (headers left out)."""
    return (nranks - 1) / nranks * (2 + phase2_bits)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", default="4,8", help="comma-separated numbers of ranks")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--batch", type=int, default=4, help="per rank (bench_cluster's 8-host runs: 4)")
    ap.add_argument("--threshold", type=float, default=1e-3, help="bench_cluster's MLP default")
    ap.add_argument("--mlp-in", type=int, default=1024)
    ap.add_argument("--mlp-hidden", type=int, default=4096)
    ap.add_argument("--skip", type=int, default=2, help="steps left out of the mean (warm-up)")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    rows = []
    for n in [int(x) for x in args.ranks.split(",")]:
        per_step = simulate(n, args.steps, args.batch, args.threshold, (args.mlp_in, args.mlp_hidden))
        kept = per_step[args.skip:] or per_step
        h = sum(e for _, e in kept) / len(kept)
        last = kept[-1][0]
        share = lambda f: sum(s for c, s in last.items() if f(abs(c)))  # noqa: E731
        print("N=%d: counts at the last step: 0 %.3f, +-1 %.3f, |c|>=2 %.3f; entropy %.3f bits "
              "(steps %d-%d: %s)" % (n, share(lambda a: a == 0), share(lambda a: a == 1),
                                     share(lambda a: a >= 2), h, args.skip, len(per_step) - 1,
                                     " ".join("%.2f" % e for _, e in kept)), flush=True)
        rows.append((n, sw.count_bits(n), h))
    print()
    print("| N | phase-2 bits: format | entropy H | sent bits per value: format | with H |"
          " growth from the previous N: format | with H |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    prev = None
    for n, b, h in rows:
        fmt, ent = sent_bits(n, b), sent_bits(n, h)
        growth = ("%.2fx" % (fmt / prev[0]), "%.2fx" % (ent / prev[1])) if prev else ("", "")
        print("| %d | %d | %.2f | %.2f | %.2f | %s | %s |" % ((n, b, h, fmt, ent) + growth))
        prev = (fmt, ent)
    return rows


if __name__ == "__main__":
    main()
