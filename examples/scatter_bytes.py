"""Bytes per host and step of the two exchanges, as N grows: the formats' count beside the virtual
cluster's counters.

    python -m examples.scatter_bytes [--measured 2=DIR 4=DIR 8=DIR ...]

For ``examples/bench_cluster.py``'s MLP (its default sizes, cut into buckets the way
``TwoBitCompressor`` cuts them), prints a markdown table of the bytes each host sends per step for
N = 2 ... 64: Horovod's ring allreduce of fp32 and fp16 (2 (N - 1) / N times the tensor's bytes),
TwoBit's allgather exchange and its scatter exchange, numeric threshold and "auto"
(``scatter_wire``'s own count, headers included). Each ``N=DIR`` names a ``bench_cluster.py --out``
directory of a run on N hosts: its measured bytes (the hosts' interface tx counters, mean over
hosts, TCP/IP and Gloo overhead included) go beside the formula. Writes the plot to
``--out`` (default build/scatter_bytes.png).
"""

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from horovod_twobit.wire import layout as lay  # noqa: E402
from horovod_twobit.wire import scatter as sw  # noqa: E402

NS = (2, 3, 4, 8, 16, 32, 64)
# bench_cluster's methods, in the table's order
METHODS = [("none", "fp32 allreduce"), ("fp16", "fp16 allreduce"), ("twobit", "allgather"),
           ("scatter", "scatter, numeric"), ("scatter_auto", 'scatter, "auto"')]


def mlp_sizes(inputs=1024, hidden=4096, outputs=10):
    """The MLP's parameter sizes in registration order (weight, bias of each layer)."""
    dims = [inputs, hidden, hidden, outputs]
    out = []
    for a, b in zip(dims, dims[1:]):
        out += [a * b, b]
    return out


def formula(sizes, method, n):
    """Bytes one host sends per step (mean over hosts)."""
    values = sum(sizes)
    if method in ("none", "fp16"):
        return 2 * (n - 1) / n * values * (4 if method == "none" else 2)
    layouts = lay.model_layouts(sizes, "auto" if method == "scatter_auto" else 0.5)
    return sw.bytes_per_rank(layouts, n, "allgather" if method == "twobit" else "scatter")


def measured(specs):
    """{(N, method): bytes per host per step} from ``N=DIR`` bench_cluster output directories."""
    got = {}
    for spec in specs:
        n, _, d = spec.partition("=")
        with open(os.path.join(d, "bench_cluster.json")) as f:
            for r in json.load(f)["results"]:
                if r["model"] == "mlp" and not r["failed"]:
                    got[(int(n), r["method"])] = r["bytes_per_step"]
    return got


def table(sizes, got):
    mb = lambda b: "%.2f" % (b / 1e6)  # noqa: E731
    lines = ["| N | " + " | ".join(label for _, label in METHODS) +
             " | scatter / allgather (numeric / auto) |",
             "|---|" + "---:|" * (len(METHODS) + 1)]
    for n in sorted(set(NS) | {k[0] for k in got}):
        cells = []
        for m, _ in METHODS:
            cell = mb(formula(sizes, m, n))
            if (n, m) in got:
                cell += " (**%s**)" % mb(got[(n, m)])
            cells.append(cell)
        ag = formula(sizes, "twobit", n)
        ratio = "%.2f / %.2f" % (formula(sizes, "scatter", n) / ag,
                                 formula(sizes, "scatter_auto", n) / ag)
        if all((n, m) in got for m in ("twobit", "scatter", "scatter_auto")):
            ratio += " (**%.2f / %.2f**)" % (got[(n, "scatter")] / got[(n, "twobit")],
                                             got[(n, "scatter_auto")] / got[(n, "twobit")])
        lines.append("| %d | %s | %s |" % (n, " | ".join(cells), ratio))
    return "\n".join(lines)


def plot(sizes, got, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, (m, label) in enumerate(METHODS):
        color = "C%d" % i
        ax.plot(NS, [formula(sizes, m, n) / 1e6 for n in NS], "-", color=color, label=label)
        pts = sorted((n, b) for (n, mm), b in got.items() if mm == m)
        if pts:
            ax.plot([n for n, _ in pts], [b / 1e6 for _, b in pts], "o", color=color)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(NS)
    ax.set_xticklabels([str(n) for n in NS])
    ax.set_xlabel("hosts N")
    ax.set_ylabel("MB sent per host per step")
    ax.set_title("MLP of %.1f M values: lines the formats' count, dots measured" % (sum(sizes) / 1e6))
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--measured", nargs="*", default=[], metavar="N=DIR")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(HERE), "build", "scatter_bytes.png"))
    args = ap.parse_args(argv)
    sizes = mlp_sizes()
    got = measured(args.measured)
    print("MB per host per step, %s values (formula; **measured**)\n" % format(sum(sizes), ","))
    print(table(sizes, got))
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    plot(sizes, got, args.out)
    print("\nplot: %s" % args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
