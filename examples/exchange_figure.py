"""Draws docs/exchange.svg, the README's picture of one step of the exchange (matplotlib; the same
bytes on every run with the same matplotlib).

    python examples/exchange_figure.py                  # writes docs/exchange.svg
    python examples/exchange_figure.py --png plot.png   # also a PNG, to look at
"""

import argparse
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch  # noqa: E402

OUT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "exchange.svg")

GREY, BLUE, ORANGE, GREEN, FEEDBACK = "#eeeeee", "#dbe8f7", "#fde3c8", "#dcefd9", "#b05a00"


def box(ax, x, y, w, h, text, fill, bold=False):
    ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0,rounding_size=0.12",
                                fc=fill, ec="#555555", lw=1))
    ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=9,
            fontweight="bold" if bold else "normal", linespacing=1.4)


def arrow(ax, a, b, color="#333333", style="-|>", dashed=False, rad=0.0):
    ax.add_patch(FancyArrowPatch(a, b, arrowstyle=style, mutation_scale=11, color=color, lw=1.2,
                                 linestyle="--" if dashed else "-",
                                 connectionstyle="arc3,rad=%g" % rad))


def draw():
    fig, ax = plt.subplots(figsize=(10, 4.4))
    ax.set_xlim(0, 10)
    ax.set_ylim(0.1, 4.6)
    ax.axis("off")
    ax.text(5, 4.42, 'One step of TwoBitCompressor for one bucket, N ranks (exchange="allgather")',
            ha="center", fontsize=11, fontweight="bold")
    ax.text(5, 4.15, "each rank sends 2 bits per value and receives every other rank's payload; "
            "the sum is the same bits on every rank", ha="center", fontsize=9, color="#444444")
    h, rows = 0.55, [3.3, 2.3, 1.3]
    for i, y in enumerate(rows):
        name = "rank %d" % i if i < 2 else "rank N−1"
        box(ax, 0.1, y, 1.3, h, name + "\nx = r + g", GREY, bold=True)
        arrow(ax, (1.4, y + h / 2), (1.75, y + h / 2))
        box(ax, 1.75, y, 2.0, h, "quantize: x ≥ t → 11 (+t)\nx ≤ −t → 10 (−t), else 00", BLUE)
        arrow(ax, (3.75, y + h / 2), (4.1, y + h / 2))
        box(ax, 4.1, y, 1.45, h, "payload\nheader + n/4 bytes", BLUE)
        arrow(ax, (5.55, y + h / 2), (5.9, y + h / 2))
        arrow(ax, (6.7, y + h / 2), (7.0, y + h / 2))
        box(ax, 7.0, y, 2.9, h, "decode all N payloads,\nsum in rank order (Average: ÷ N)", GREEN)
        # error feedback: what was not sent stays in the rank's residual
        arrow(ax, (2.75, y), (0.75, y), color=FEEDBACK, dashed=True, rad=-0.35)
        ax.text(2.85, y - 0.2, "r ← x − q: what was not sent waits on the rank", ha="left",
                fontsize=8, color=FEEDBACK)
    box(ax, 5.9, rows[-1], 0.8, rows[0] + h - rows[-1], "all-\ngather\n\nN − 1\npayloads\nin per\nrank",
        ORANGE, bold=True)
    notes = ("Every rank sees every header: size, threshold and format mismatches raise the same "
             "error on every rank. NaN or Inf on any rank:\nthat tensor is NaN on every rank and no "
             "residual changes.  exchange=\"scatter\": rank c gets chunk c of every payload "
             "(alltoall),\nsums it and sends it to all (allgather), so the bytes stay flat in N.")
    ax.text(0.1, 0.45, notes, fontsize=8.5, va="center", linespacing=1.5)
    fig.tight_layout(pad=0.2)
    return fig


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=OUT, help="the SVG (default: docs/exchange.svg)")
    p.add_argument("--png", help="also write a PNG here")
    args = p.parse_args(argv)
    plt.rcParams["svg.hashsalt"] = "horovod-twobit"  # fixed ids: the same file every run
    plt.rcParams["svg.fonttype"] = "none"  # text stays text
    fig = draw()
    fig.savefig(args.out, format="svg", metadata={"Date": None, "Creator": None})
    if args.png:
        fig.savefig(args.png, dpi=110)


if __name__ == "__main__":
    main()
