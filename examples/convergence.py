"""Convergence study: does 2-bit compression train as well as fp32?

    horovodrun -np 2 -H localhost:2 --gloo python examples/convergence.py [--quick]

Trains, on every rank of one Horovod job, (1) an MLP on scikit-learn's digits and (2) a character-
level LSTM language model on the text of Python's own help topics (``pydoc_data``; no download),
each with plain SGD, SGD with momentum 0.9 and Adam, for each method: no compression, Horovod's
fp16, ``TwoBitCompressor`` with fixed thresholds 0.5, 0.05, 0.005, ``threshold="auto"`` and
``threshold="auto", blocks=1`` (one magnitude per tensor; ``--methods`` takes these names and
``auto[-RULE][/BLOCK][:BLOCKS][@MIN]``, each optionally followed by ``+scatter`` or ``+auto``
for that ``exchange``, e.g. ``auto+scatter``).
Rank 0 prints a markdown table (final test accuracy or validation loss, payload bytes per step per
rank) and writes a PNG of the learning curves.
"""

import argparse
import json
import os
import time

import numpy as np
import torch

import horovod.torch as hvd
from horovod_twobit import wire
from horovod_twobit.torch import TwoBitCompressor

OPTIMIZERS = {
    "mlp": {"sgd": dict(lr=0.5), "momentum": dict(lr=0.1, momentum=0.9), "adam": dict(lr=1e-3)},
    "lstm": {"sgd": dict(lr=1.0), "momentum": dict(lr=0.1, momentum=0.9), "adam": dict(lr=3e-3)},
}
METHODS = ["none", "fp16", "0.5", "0.05", "0.005", "auto", "auto:1"]


def parse_method(method):
    """none, fp16, a number (fixed threshold), or auto[-RULE][/BLOCK][:BLOCKS][@MIN]:
    threshold="auto" with that rule, smallest block and most blocks per tensor, leaving tensors of
    fewer than MIN values uncompressed (min_numel); then +EXCHANGE for that exchange.
    Returns (threshold or method, keyword arguments of TwoBitCompressor)."""
    method, _, exchange = method.partition("+")
    method, _, min_numel = method.partition("@")
    method, _, blocks = method.partition(":")
    method, _, block = method.partition("/")
    kw = dict(min_numel=int(min_numel or 0), block=int(block) if block else None,
              blocks=int(blocks) if blocks else None, exchange=exchange or "allgather")
    if method.startswith("auto"):
        return "auto", dict(kw, rule=method.partition("-")[2] or None)
    return (method if method in ("none", "fp16") else float(method)), kw


def compression_of(method):
    threshold, kw = parse_method(method)
    if threshold == "none":
        return hvd.Compression.none
    if threshold == "fp16":
        return hvd.Compression.fp16
    return TwoBitCompressor(threshold, **kw)


def payload_bytes(model, method):
    sizes = [p.numel() for p in model.parameters()]
    threshold, kw = parse_method(method)
    if threshold == "none":
        return 4 * sum(sizes)
    if threshold == "fp16":
        return 2 * sum(sizes)
    blocks = wire.validate_blocks(threshold, kw["block"], kw["blocks"])
    return sum(wire.payload_bytes(n, wire.block_of(n, *blocks)) if n >= kw["min_numel"] else 4 * n
               for n in sizes)


def make_optimizer(model, kind, params, method):
    opt = torch.optim.Adam(model.parameters(), **params) if kind == "adam" else \
        torch.optim.SGD(model.parameters(), **params)
    return hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                    compression=compression_of(method))


# ----------------------------------------------------------------- digits MLP

def digits_data():
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split
    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32)
    xtr, xte, ytr, yte = train_test_split(x, y, test_size=0.25, random_state=0, stratify=y)
    r, n = hvd.rank(), hvd.size()
    return (torch.from_numpy(xtr[r::n]), torch.from_numpy(ytr[r::n]),
            torch.from_numpy(xte), torch.from_numpy(yte))


def run_mlp(kind, method, args):
    xtr, ytr, xte, yte = digits_data()
    torch.manual_seed(args.seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
    opt = make_optimizer(model, kind, OPTIMIZERS["mlp"][kind], method)
    g = torch.Generator().manual_seed(args.seed + hvd.rank())
    curve = []
    for _ in range(args.mlp_epochs):
        perm = torch.randperm(len(xtr), generator=g)
        for s in range(0, len(xtr), 32):
            idx = perm[s:s + 32]
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(xtr[idx]), ytr[idx]).backward()
            opt.step()
        with torch.no_grad():
            curve.append(float((model(xte).argmax(1) == yte).float().mean()))
    return curve, payload_bytes(model, method)


# ----------------------------------------------------------------- char-LSTM

class CharLSTM(torch.nn.Module):
    def __init__(self, vocab, emb=32, hidden=128):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, emb)
        self.lstm = torch.nn.LSTM(emb, hidden, batch_first=True)
        self.out = torch.nn.Linear(hidden, vocab)

    def forward(self, x):
        return self.out(self.lstm(self.emb(x))[0])


def text_data():
    import pydoc_data.topics
    text = "".join(pydoc_data.topics.topics[k] for k in sorted(pydoc_data.topics.topics))
    chars = sorted(set(text))
    ids = torch.tensor([chars.index(c) for c in text], dtype=torch.long)
    cut = int(len(ids) * 0.9)
    return ids[:cut], ids[cut:], len(chars)


def run_lstm(kind, method, args):
    train, val, vocab = text_data()
    torch.manual_seed(args.seed)
    model = CharLSTM(vocab)
    opt = make_optimizer(model, kind, OPTIMIZERS["lstm"][kind], method)
    seq, batch = 64, 32
    g = torch.Generator().manual_seed(args.seed + hvd.rank())
    vstarts = torch.arange(0, len(val) - seq - 1, (len(val) - seq - 1) // 64)[:64]
    vx = torch.stack([val[s:s + seq] for s in vstarts])
    vy = torch.stack([val[s + 1:s + seq + 1] for s in vstarts])
    curve = []
    for step in range(1, args.lstm_steps + 1):
        starts = torch.randint(0, len(train) - seq - 1, (batch,), generator=g)
        x = torch.stack([train[s:s + seq] for s in starts])
        y = torch.stack([train[s + 1:s + seq + 1] for s in starts])
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x).reshape(-1, vocab), y.reshape(-1))
        loss.backward()
        opt.synchronize()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        with opt.skip_synchronize():
            opt.step()
        if step % args.eval_every == 0 or step == args.lstm_steps:
            with torch.no_grad():
                curve.append(float(torch.nn.functional.cross_entropy(
                    model(vx).reshape(-1, vocab), vy.reshape(-1))))
    return curve, payload_bytes(model, method)


# ----------------------------------------------------------------- main

def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="mlp,lstm")
    p.add_argument("--optimizers", default="sgd,momentum,adam")
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--mlp-epochs", type=int, default=15)
    p.add_argument("--lstm-steps", type=int, default=400)
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="a few epochs/steps, for a smoke run")
    p.add_argument("--out", default="build/convergence")
    args = p.parse_args()
    if args.quick:
        args.mlp_epochs, args.lstm_steps, args.eval_every = 2, 20, 10
    hvd.init()
    torch.set_num_threads(1)
    results = []
    t0 = time.time()
    for model in args.models.split(","):
        for kind in args.optimizers.split(","):
            for method in args.methods.split(","):
                t1 = time.time()
                curve, nbytes = (run_mlp if model == "mlp" else run_lstm)(kind, method, args)
                row = dict(model=model, optimizer=kind, method=method, final=curve[-1],
                           curve=curve, bytes=nbytes, seconds=time.time() - t1)
                results.append(row)
                if hvd.rank() == 0:
                    print("%-4s %-8s %-6s %s %.4f  bytes/step/rank %8d  (%.0fs)" % (
                        model, kind, method, "test acc" if model == "mlp" else "val loss",
                        row["final"], nbytes, row["seconds"]), flush=True)
    if hvd.rank() != 0:
        return
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    table = ["| model | optimizer | " + " | ".join(args.methods.split(",")) + " |",
             "|---|---|" + "---|" * len(args.methods.split(","))]
    for model in args.models.split(","):
        for kind in args.optimizers.split(","):
            cells = []
            for r in results:
                if r["model"] == model and r["optimizer"] == kind:
                    cells.append("%.4f" % r["final"])
            table.append("| %s (%s) | %s | %s |" % (
                model, "test acc" if model == "mlp" else "val loss", kind, " | ".join(cells)))
    for model in args.models.split(","):
        byte_row = {r["method"]: r["bytes"] for r in results if r["model"] == model}
        table.append("| bytes/step/rank (%s) | | %s |" % (model, " | ".join(
            str(byte_row[m]) for m in args.methods.split(","))))
    text = "\n".join(table)
    with open(os.path.join(args.out, "table.md"), "w") as f:
        f.write(text + "\n")
    print(text)
    print("total %.0fs on %d ranks" % (time.time() - t0, hvd.size()))
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    models, kinds = args.models.split(","), args.optimizers.split(",")
    fig, axes = plt.subplots(len(models), len(kinds), figsize=(4.5 * len(kinds), 3.5 * len(models)),
                             squeeze=False)
    for i, model in enumerate(models):
        for j, kind in enumerate(kinds):
            ax = axes[i][j]
            for r in results:
                if r["model"] == model and r["optimizer"] == kind:
                    ax.plot(range(1, len(r["curve"]) + 1), r["curve"], label=r["method"])
            ax.set_title("%s, %s" % (model, kind))
            ax.set_xlabel("epoch" if model == "mlp" else "evaluation (every %d steps)" % args.eval_every)
            ax.set_ylabel("test accuracy" if model == "mlp" else "validation loss")
            ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    png = os.path.join(args.out, "curves.png")
    fig.savefig(png, dpi=90)
    print("curves written to %s" % os.path.abspath(png))


if __name__ == "__main__":
    main()
