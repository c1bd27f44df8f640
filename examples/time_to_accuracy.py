"""Time to accuracy: how long each method takes to reach fp32's final test accuracy (digits MLP)
or validation loss (character LSTM) at 8 ranks, on hosts of the emulated cluster.

The models, data, optimizers and schedule are examples/convergence.py's (the MLP with momentum,
the LSTM with Adam and its gradient clipping; batches of 32 per rank). Three parts:

1. the curves, one job per framework (any number of ranks; every rank takes its share of the
   digits, every size-th sample, and draws its own LSTM sequences)::

       horovodrun -np 8 -H localhost:8 --gloo python examples/time_to_accuracy.py train \\
           --methods none,fp16,auto,scatter_auto
       torchrun --standalone --nproc_per_node 8 examples/time_to_accuracy.py train \\
           --methods ddp,ddp_fp16,ddp_powersgd,ddp_powersgd4,ddp_twobit_auto

   Method names are examples/bench_cluster.py's. Each run trains ``--longer`` times the study's
   length (15 epochs, 400 steps), so that a slower method can still reach the target, and rank 0
   writes ``<out>/curve-<model>-<method>.json``: the test accuracy after every MLP step and the
   validation loss every 10 LSTM steps.
2. the step times, on 8 hosts (examples/bench_cluster.py, the same models as ``digits`` and
   ``charlstm``, the same optimizers and batch)::

       python examples/bench_cluster.py --hosts 8 --rates 100mbit,1gbit --models digits,charlstm \\
           --batch 32 --methods none,fp16,auto,scatter_auto,ddp,ddp_fp16,ddp_powersgd,\\
       ddp_powersgd4,ddp_twobit_auto --out build/time_to_accuracy/cluster

3. the table and the plot: ``python examples/time_to_accuracy.py report``. The target is
   Horovod fp32's accuracy or loss at the study's length; a method's steps to the target are
   those of its first evaluation at or past it, and its time to the target is those steps x its
   median real-host step on the cluster at each rate. A method that does not reach it within its
   run is "not reached", with its final figure.
"""

import argparse
import glob
import json
import math
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from examples._cluster_worker import POWERSGD_RANKS, STUDY_MODELS  # noqa: E402

# Horovod methods: bench_cluster's names -> examples/convergence.py's
HOROVOD = {"none": "none", "fp16": "fp16", "auto": "auto", "scatter_auto": "auto+scatter"}
DDP = ["ddp", "ddp_fp16"] + list(POWERSGD_RANKS) + ["ddp_twobit_auto"]
LABELS = {"none": "Horovod fp32", "fp16": "Horovod fp16", "auto": 'Horovod TwoBit "auto"',
          "scatter_auto": 'Horovod TwoBit "auto", scatter', "ddp": "DDP, no hook",
          "ddp_fp16": "DDP fp16_compress_hook", "ddp_powersgd": "DDP PowerSGD rank 1",
          "ddp_powersgd4": "DDP PowerSGD rank 4", "ddp_twobit_auto": 'DDP 2-bit hook "auto"'}
METRIC = {"digits": "test accuracy", "charlstm": "validation loss"}


# ---------------------------------------------------------------------- training
def train_one(model, method, args, rank, size, setup):
    """Trains one method; ``setup(net)`` -> (module to call, update). Returns [(step, value)]
    on rank 0 (empty elsewhere)."""
    import torch
    from examples import convergence as cv
    short, kind = STUDY_MODELS[model]
    torch.manual_seed(args.seed)
    if model == "digits":
        data = cv.digits_data(rank, size)
        net = cv.mlp_net()
        forward, update = setup(net, kind, cv.OPTIMIZERS[short][kind], None)
        return cv.train_mlp(forward, update, data, args.mlp_epochs, args.seed, rank,
                            eval_every=args.mlp_eval_every, evaluate=net if rank == 0 else None)
    data = cv.text_data()
    net = cv.CharLSTM(data[2])
    forward, update = setup(net, kind, cv.OPTIMIZERS[short][kind], cv.LSTM_CLIP)
    return cv.train_lstm(forward, update, data, args.lstm_steps, args.seed, rank,
                         args.lstm_eval_every, evaluate=net if rank == 0 else None)


def horovod_setup(method):
    from examples import convergence as cv

    def setup(net, kind, params, clip):
        opt = cv.make_optimizer(net, kind, params, HOROVOD[method])
        return net, cv.updater(opt, clip, synchronize=True)
    return setup


def ddp_setup(method):
    from torch.nn.parallel import DistributedDataParallel
    from examples import convergence as cv
    from examples._cluster_worker import ddp_options, register_hook

    def setup(net, kind, params, clip):
        model = DistributedDataParallel(net, **ddp_options(method))
        register_hook(model, method)
        return model, cv.updater(cv.base_optimizer(model, kind, params), clip)
    return setup


def train(args):
    import torch
    methods = args.methods.split(",")
    unknown = [m for m in methods if m not in HOROVOD and m not in DDP]
    if unknown or (any(m in HOROVOD for m in methods) and any(m in DDP for m in methods)):
        sys.exit("--methods: Horovod's (%s) under horovodrun, or DDP's (%s) under torchrun"
                 % (", ".join(HOROVOD), ", ".join(DDP)))
    torch.set_num_threads(1)
    if methods[0] in HOROVOD:
        import horovod.torch as hvd
        hvd.init()
        rank, size = hvd.rank(), hvd.size()
    else:
        import torch.distributed as dist
        dist.init_process_group("gloo")
        rank, size = dist.get_rank(), dist.get_world_size()
    if args.quick:
        args.mlp_epochs, args.lstm_steps, args.target_epochs, args.target_steps = 2, 20, 1, 10
        args.lstm_eval_every = 5
    args.mlp_epochs = args.mlp_epochs or int(args.longer * args.target_epochs)
    args.lstm_steps = args.lstm_steps or int(args.longer * args.target_steps)
    os.makedirs(args.out, exist_ok=True)
    for model in args.models.split(","):
        for method in methods:
            t0 = time.time()
            setup = horovod_setup(method) if method in HOROVOD else ddp_setup(method)
            curve = train_one(model, method, args, rank, size, setup)
            if rank != 0:
                continue
            from examples import convergence as cv
            per_rank = math.ceil(len(cv.digits_data(0, size)[0]) / cv.MLP_BATCH)
            row = dict(model=model, method=method, optimizer=STUDY_MODELS[model][1],
                       ranks=size, seed=args.seed, curve=curve, seconds=time.time() - t0,
                       steps_per_epoch=per_rank if model == "digits" else None,
                       batch=cv.MLP_BATCH if model == "digits" else cv.LSTM_BATCH,
                       target_step=args.target_epochs * per_rank if model == "digits"
                       else args.target_steps)
            with open(os.path.join(args.out, "curve-%s-%s.json" % (model, method)), "w") as f:
                json.dump(row, f)
            print("%-8s %-16s %s %.4f after %d steps (%.0f s)" % (
                model, method, METRIC[model], curve[-1][1], curve[-1][0], row["seconds"]),
                flush=True)
    if methods[0] in DDP:
        from horovod_twobit.torch import ddp as twobit_ddp
        twobit_ddp.shutdown()  # a barrier, then destroy_process_group
    return 0


# ---------------------------------------------------------------------- report
def reached(curve, target, higher):
    """The first step whose value is at or past ``target``, or None."""
    for step, v in curve:
        if (v >= target) if higher else (v <= target):
            return step
    return None


def load_curves(path):
    rows = {}
    for f in sorted(glob.glob(os.path.join(path, "curve-*.json"))):
        with open(f) as fh:
            r = json.load(fh)
        rows[(r["model"], r["method"])] = r
    return rows


def load_steps(paths):
    """{(rate, model, method): bench_cluster's row} from its JSON files (later files win)."""
    steps = {}
    for p in paths:
        with open(p) as f:
            for r in json.load(f)["results"]:
                if not r.get("failed"):
                    steps[(r["rate"], r["model"], r["method"])] = r
    return steps


def study(curves, steps):
    """Per model: the target and a row per method (steps to the target, the final figure, and
    per rate the step and the time to the target)."""
    rates = list(dict.fromkeys(k[0] for k in steps))
    out = {}
    for model in METRIC:
        ref = curves.get((model, "none"))
        if ref is None:
            continue
        higher = model == "digits"
        target = [v for s, v in ref["curve"] if s <= ref["target_step"]][-1]
        rows = []
        for method in list(HOROVOD) + DDP:
            c = curves.get((model, method))
            if c is None:
                continue
            n = reached(c["curve"], target, higher)
            per_rate = {}
            for rate in rates:
                r = steps.get((rate, model, method))
                if r:
                    per_rate[rate] = dict(step_s=r["real_step_s"], bytes=r["bytes_per_step"],
                                          time_s=None if n is None else n * r["real_step_s"],
                                          compute_s=r.get("compute_s"), wait_s=r.get("wait_s"),
                                          codec_s=r.get("codec_s"))
            rows.append(dict(method=method, steps=n, final=c["curve"][-1][1],
                             last_step=c["curve"][-1][0], rates=per_rate))
        out[model] = dict(target=target, target_step=ref["target_step"], higher=higher,
                          steps_per_epoch=ref["steps_per_epoch"], ranks=ref["ranks"], rows=rows)
    return out, rates


def markdown(res, rates):
    lines = []
    for model, m in res.items():
        lines += ["", "**%s** (%s; target: fp32's %.4f after %d steps, 8 ranks)" % (
            model, METRIC[model], m["target"], m["target_step"]), "",
            "| " + " | ".join(["method", "steps to target", "final (step)"] + [
                "%s: %s" % (r, h) for r in rates for h in ("step (s)", "time to target (s)")])
            + " |", "|---|---:|---:|" + "---:|---:|" * len(rates)]
        best = {r: min((x["rates"][r]["time_s"] for x in m["rows"] if r in x["rates"]
                        and x["rates"][r]["time_s"] is not None), default=None) for r in rates}
        for x in m["rows"]:
            cells = []
            for r in rates:
                p = x["rates"].get(r)
                if p is None:
                    cells += ["", ""]
                    continue
                t = p["time_s"]
                cells += ["%.4f" % p["step_s"], "not reached" if t is None else
                          ("**%.2f**" if t == best[r] else "%.2f") % t]
            lines.append("| " + " | ".join([
                LABELS[x["method"]], "not reached" if x["steps"] is None else str(x["steps"]),
                "%.4f (%d)" % (x["final"], x["last_step"])] + cells) + " |")
    return "\n".join(lines)


def plot(res, curves, rates, path):
    """A panel per model and rate: each method's curve against its real-host training time at
    that rate (against its steps where no rate was measured)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rates = rates or [None]
    fig, axes = plt.subplots(len(res), len(rates), figsize=(5 * len(rates), 3.8 * len(res)),
                             squeeze=False)
    for i, (model, m) in enumerate(res.items()):
        for j, rate in enumerate(rates):
            ax = axes[i][j]
            for x in m["rows"]:
                p = x["rates"].get(rate) if rate else {"step_s": 1.0}
                if p is None:
                    continue
                c = curves[(model, x["method"])]["curve"]
                style = "-" if x["method"] in HOROVOD else "--"
                ax.plot([s * p["step_s"] for s, _ in c], [v for _, v in c], style, lw=1.2,
                        label=LABELS[x["method"]])
            ax.axhline(m["target"], color="k", lw=0.6, ls=":")
            ax.set_xscale("log")
            ax.set_title("%s, 8 hosts at %s" % (model, rate) if rate else model)
            ax.set_xlabel("real-host training time (s, log)" if rate else "steps (log)")
            ax.set_ylabel(METRIC[model])
            if model == "digits":
                ax.set_ylim(max(0.5, m["target"] - 0.25), 1.0)
            else:
                ax.set_ylim(m["target"] - 0.3, m["target"] + 1.5)
            ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=80)


def report(args):
    curves = load_curves(args.curves)
    steps = load_steps([p for p in args.cluster.split(",") if p])  # none: steps only
    res, rates = study(curves, steps)
    text = markdown(res, rates)
    print(text)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "time_to_accuracy.md"), "w") as f:
        f.write(text + "\n")
    with open(os.path.join(args.out, "time_to_accuracy.json"), "w") as f:
        json.dump(res, f, indent=1)
    plot(res, curves, rates, os.path.join(args.out, "time_to_accuracy.png"))
    print("wrote %s/time_to_accuracy.{md,json,png}" % args.out)
    return 0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="what", required=True)
    t = sub.add_parser("train", help="the curves (under horovodrun or torchrun)")
    t.add_argument("--models", default="digits,charlstm")
    t.add_argument("--methods", default=",".join(HOROVOD))
    t.add_argument("--target-epochs", type=int, default=15, help="the study's MLP length")
    t.add_argument("--target-steps", type=int, default=400, help="the study's LSTM length")
    t.add_argument("--longer", type=float, default=2.0,
                   help="train this many times the study's length (default %(default)s)")
    t.add_argument("--mlp-epochs", type=int, default=None, help="instead of --longer")
    t.add_argument("--lstm-steps", type=int, default=None, help="instead of --longer")
    t.add_argument("--mlp-eval-every", type=int, default=1, help="steps")
    t.add_argument("--lstm-eval-every", type=int, default=10, help="steps")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--quick", action="store_true", help="a few steps, for a smoke run")
    t.add_argument("--out", default="build/time_to_accuracy")
    r = sub.add_parser("report", help="the table and the plot")
    r.add_argument("--curves", default="build/time_to_accuracy")
    r.add_argument("--cluster", default="build/time_to_accuracy/cluster/bench_cluster.json",
                   help="bench_cluster JSON files, comma-separated (later ones win)")
    r.add_argument("--out", default="build/time_to_accuracy")
    args = ap.parse_args(argv)
    return train(args) if args.what == "train" else report(args)


if __name__ == "__main__":
    sys.exit(main())
