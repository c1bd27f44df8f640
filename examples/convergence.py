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
import contextlib
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
    return hvd.DistributedOptimizer(base_optimizer(model, kind, params),
                                    named_parameters=model.named_parameters(),
                                    compression=compression_of(method))


# ----------------------------------------------------------------- shared by both models
# (examples/time_to_accuracy.py trains the same models, data and schedule under DDP, and
# examples/bench_cluster.py times their steps)

MLP_BATCH = 32
LSTM_SEQ, LSTM_BATCH = 64, 32
LSTM_CLIP = 1.0


def finish_step(opt, params, clip=None, synchronize=False):
    """After the backward pass: clip the gradient norm of ``params`` to ``clip`` (if any) and
    step. ``synchronize``: ``opt`` is Horovod's DistributedOptimizer, whose exchange has to
    finish before clipping; under DDP the backward pass has exchanged already."""
    stepping = contextlib.nullcontext()
    if clip is not None:
        if synchronize:
            opt.synchronize()
            stepping = opt.skip_synchronize()
        torch.nn.utils.clip_grad_norm_(params, clip)
    with stepping:
        opt.step()


def updater(opt, clip=None, synchronize=False):
    """update(loss_fn): zero the gradients, loss_fn() (the forward pass), backward, then
    :func:`finish_step`."""
    params = [p for group in opt.param_groups for p in group["params"]]

    def update(loss_fn):
        opt.zero_grad()
        loss = loss_fn()
        loss.backward()
        finish_step(opt, params, clip, synchronize)
        return loss
    return update


def base_optimizer(model, kind, params):
    return torch.optim.Adam(model.parameters(), **params) if kind == "adam" else \
        torch.optim.SGD(model.parameters(), **params)


# ----------------------------------------------------------------- digits MLP

def digits_data(rank=None, size=None):
    """(train x, train y) of this rank's share (every size-th sample from rank), and the whole
    test set; rank and size default to Horovod's."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split
    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32)
    xtr, xte, ytr, yte = train_test_split(x, y, test_size=0.25, random_state=0, stratify=y)
    r = hvd.rank() if rank is None else rank
    n = hvd.size() if size is None else size
    return (torch.from_numpy(xtr[r::n]), torch.from_numpy(ytr[r::n]),
            torch.from_numpy(xte), torch.from_numpy(yte))


def mlp_net():
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))


def train_mlp(forward, update, data, epochs, seed, rank, eval_every=None, evaluate=None):
    """Trains ``epochs`` epochs of batches of MLP_BATCH from this rank's share, shuffled per
    epoch (``forward``: the model, or DDP's wrapper of it). Returns [(step, test accuracy of
    the module ``evaluate``)] after every epoch, or every ``eval_every`` steps; empty where
    ``evaluate`` is None."""
    xtr, ytr, xte, yte = data
    g = torch.Generator().manual_seed(seed + rank)
    curve, step = [], 0

    def accuracy():
        with torch.no_grad():
            return float((evaluate(xte).argmax(1) == yte).float().mean())
    for _ in range(epochs):
        perm = torch.randperm(len(xtr), generator=g)
        for s in range(0, len(xtr), MLP_BATCH):
            idx = perm[s:s + MLP_BATCH]
            update(lambda: torch.nn.functional.cross_entropy(forward(xtr[idx]), ytr[idx]))
            step += 1
            if evaluate is not None and eval_every and step % eval_every == 0:
                curve.append((step, accuracy()))
        if evaluate is not None and not eval_every:
            curve.append((step, accuracy()))
    return curve


def run_mlp(kind, method, args):
    data = digits_data()
    torch.manual_seed(args.seed)
    model = mlp_net()
    opt = make_optimizer(model, kind, OPTIMIZERS["mlp"][kind], method)
    curve = train_mlp(model, updater(opt), data, args.mlp_epochs, args.seed, hvd.rank(),
                      evaluate=model)
    return [v for _, v in curve], payload_bytes(model, method)


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
    index = {c: i for i, c in enumerate(chars)}
    ids = torch.tensor([index[c] for c in text], dtype=torch.long)
    cut = int(len(ids) * 0.9)
    return ids[:cut], ids[cut:], len(chars)


def lstm_batch(ids, starts):
    """(inputs, next characters) of the sequences of LSTM_SEQ characters at ``starts``."""
    return (torch.stack([ids[s:s + LSTM_SEQ] for s in starts]),
            torch.stack([ids[s + 1:s + LSTM_SEQ + 1] for s in starts]))


def lstm_loss(out, y):
    return torch.nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


def train_lstm(forward, update, data, steps, seed, rank, eval_every, evaluate=None):
    """Trains ``steps`` steps of LSTM_BATCH random sequences per rank. Returns [(step,
    validation loss of the module ``evaluate``)] every ``eval_every`` steps and after the last;
    empty where ``evaluate`` is None."""
    train, val, vocab = data
    g = torch.Generator().manual_seed(seed + rank)
    vx, vy = lstm_batch(val, torch.arange(0, len(val) - LSTM_SEQ - 1,
                                          (len(val) - LSTM_SEQ - 1) // 64)[:64])
    curve = []
    for step in range(1, steps + 1):
        x, y = lstm_batch(train, torch.randint(0, len(train) - LSTM_SEQ - 1, (LSTM_BATCH,),
                                               generator=g))
        update(lambda: lstm_loss(forward(x), y))
        if evaluate is not None and (step % eval_every == 0 or step == steps):
            with torch.no_grad():
                curve.append((step, float(lstm_loss(evaluate(vx), vy))))
    return curve


def run_lstm(kind, method, args):
    data = text_data()
    torch.manual_seed(args.seed)
    model = CharLSTM(data[2])
    opt = make_optimizer(model, kind, OPTIMIZERS["lstm"][kind], method)
    curve = train_lstm(model, updater(opt, LSTM_CLIP, synchronize=True), data, args.lstm_steps,
                       args.seed, hvd.rank(), args.eval_every, evaluate=model)
    return [v for _, v in curve], payload_bytes(model, method)


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
