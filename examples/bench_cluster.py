"""Multi-host benchmark on a virtual cluster: Horovod (no compression, fp16, TwoBitCompressor) against
PyTorch DDP with its communication hooks (fp16_compress_hook, quantization_pertensor_hook,
powerSGD_hook), over the same shaped links.

For every rate and model it trains for a fixed number of steps on N hosts (network namespaces with
their own sshd, see horovod_twobit/cluster/) and reports the median step time, the bytes each host
put on the wire per step (its interface counters around the timed steps), and the loss after the
steps on a fixed evaluation batch. Horovod jobs go through horovodrun over ssh; DDP jobs are started
in every host with ``ip netns exec`` (torch.distributed, gloo backend, MASTER_ADDR = host 0).

Needs root (network namespaces). Quick run::

    sudo .venv/bin/python examples/bench_cluster.py --rates 100mbit --models mlp \\
        --methods none,fp16,twobit --steps 5

Everything::

    sudo .venv/bin/python examples/bench_cluster.py

Writes <out>/bench_cluster.md (the table), bench_cluster.png (the plot) and bench_cluster.json.
Figures are honest for this machine only: N hosts share its CPU cores, so compute (and the 2-bit
codec) of all hosts runs on the same cores, which a real cluster would not do.
"""

import argparse
import glob
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, REPO)

HOROVOD_METHODS = {"none": "Horovod, no compression", "fp16": "Horovod, Compression.fp16",
                   "twobit": "Horovod, TwoBitCompressor",
                   "auto": 'Horovod, TwoBitCompressor("auto")',
                   "scatter": 'Horovod, TwoBitCompressor(exchange="scatter")',
                   "scatter_auto": 'Horovod, TwoBitCompressor("auto", exchange="scatter")'}
# the TwoBitCompressor methods: (fixed threshold or "auto", exchange)
TWOBIT = {"twobit": ("fixed", "allgather"), "auto": ("auto", "allgather"),
          "scatter": ("fixed", "scatter"), "scatter_auto": ("auto", "scatter")}
DDP_METHODS = {"ddp": "DDP, no hook", "ddp_fp16": "DDP, fp16_compress_hook",
               "ddp_quant": "DDP, quantization_pertensor_hook*", "ddp_powersgd": "DDP, powerSGD_hook**"}
ALL_METHODS = dict(HOROVOD_METHODS, **DDP_METHODS)
DEFAULT_METHODS = "none,fp16,twobit,ddp_fp16,ddp_quant,ddp_powersgd"
# about 3x the mean |gradient| of each model at step 0
THRESHOLDS = {"mlp": 1e-3, "cnn": 1e-2, "resnet": 1e-2, "transformer": 1e-2}
# models with many small tensors, from examples/bench_buckets.py (its names)
MANY_TENSORS = {"resnet": "cnn", "transformer": "transformer"}


# ---------------------------------------------------------------------- models and data
def build(model, args):
    """(net, batch): the model, and batch(rank, step, size) -> (x, y), a regression onto a fixed
    random linear map of the inputs (a teacher), the same on every run."""
    import torch
    torch.manual_seed(0)
    nn = torch.nn
    if model in MANY_TENSORS:  # examples/bench_buckets.py's models, many small tensors
        from examples.bench_buckets import torch_model
        net, data, _ = torch_model(MANY_TENSORS[model])
        if model == "transformer":  # token ids: the teacher reads their one-hot average
            t = teacher((100,))

            def batch(rank, step, size):
                g = torch.Generator().manual_seed(100003 * rank + step)
                x = torch.randint(0, 100, (size, 32), generator=g)
                return x, torch.nn.functional.one_hot(x, 100).float().mean(1) @ t
            return net, batch
        shape = (3, 16, 16)
    elif model == "mlp":
        h = args.mlp_hidden
        net = nn.Sequential(nn.Linear(args.mlp_in, h), nn.ReLU(), nn.Linear(h, h), nn.ReLU(),
                            nn.Linear(h, 10))
        shape = (args.mlp_in,)
    elif model == "cnn":
        c = args.cnn_channels
        net = nn.Sequential(nn.Conv2d(3, c, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                            nn.Conv2d(c, 2 * c, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                            nn.Conv2d(2 * c, 2 * c, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                            nn.Flatten(), nn.Linear(2 * c * 4 * 4, 10))
        shape = (3, 32, 32)
    else:
        raise ValueError("unknown model %r (%s)" % (model, ", ".join(THRESHOLDS)))
    t = teacher(shape)

    def batch(rank, step, size):
        g = torch.Generator().manual_seed(100003 * rank + step)
        x = torch.randn((size,) + shape, generator=g)
        return x, x.reshape(size, -1) @ t
    return net, batch


def teacher(shape):
    """A fixed linear map from inputs to 10 targets: the task every method learns."""
    import torch
    g = torch.Generator().manual_seed(123)
    n = 1
    for s in shape:
        n *= s
    return torch.randn(n, 10, generator=g) / n ** 0.5


def eval_loss(net, batch):
    import torch
    with torch.no_grad():
        x, y = batch(999, 999, 256)
        return float(((net(x) - y) ** 2).mean())


# ---------------------------------------------------------------------- workers
def quantization_pertensor_hook(process_group, bucket):
    """torch's ``quantization_pertensor_hook`` (uint8 per-tensor min/max quantization, allgather,
    dequantize and average), with two fixes needed on the gloo backend (torch 2.13):

    * the stock hook indexes ``fut.wait()[0]``, which on gloo is rank 0's tensor rather than the
      list of all ranks' ("IndexError: index 2 is out of bounds" on more than 2 ranks);
    * it issues and waits for its second all_gather inside a future callback; with several
      buckets (the 21M-parameter MLP, 4 ranks) the job hung there.

    Here both all_gathers run in the hook itself, in bucket order, and the result is returned as a
    completed future: same bytes on the wire, no overlap of this bucket's exchange with backward."""
    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks.quantization_hooks import (
        _dequantize_per_tensor_backend, _quantize_per_tensor_backend)
    group = process_group if process_group is not None else dist.group.WORLD
    rank, world = dist.get_rank(group), group.size()
    tensor = bucket.buffer()
    observer = torch.ao.quantization.MinMaxObserver()
    observer(tensor)
    s, z = observer.calculate_qparams()
    s_and_z = torch.tensor([float(s), float(z)], dtype=torch.float32)
    all_s_and_z = [torch.zeros_like(s_and_z) for _ in range(world)]
    dist.all_gather(all_s_and_z, s_and_z, group=group)
    q = _quantize_per_tensor_backend(tensor, all_s_and_z[rank][0], all_s_and_z[rank][1])
    quantized = [torch.zeros_like(q) for _ in range(world)]
    dist.all_gather(quantized, q, group=group)
    out = torch.zeros_like(tensor, dtype=torch.float32)
    for r, qr in enumerate(quantized):
        out += _dequantize_per_tensor_backend(qr, all_s_and_z[r][0], all_s_and_z[r][1])
    fut = torch.futures.Future()
    fut.set_result((out / world).to(tensor.dtype))
    return fut


def worker(args):
    import torch
    from horovod_twobit.cluster import iface_bytes

    torch.set_num_threads(args.threads)
    net, batch = build(args.model, args)
    threshold = args.threshold or THRESHOLDS[args.model]

    if args.worker == "horovod":
        import horovod.torch as hvd
        hvd.init()
        rank, size = hvd.rank(), hvd.size()
        hvd.broadcast_parameters(net.state_dict(), root_rank=0)
        if args.method in TWOBIT:
            from horovod_twobit.torch import TwoBitCompressor
            kind, exchange = TWOBIT[args.method]
            compression = TwoBitCompressor(threshold if kind == "fixed" else "auto",
                                           exchange=exchange)
        else:
            compression = {"none": hvd.Compression.none, "fp16": hvd.Compression.fp16}[args.method]
        opt = hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=args.lr),
                                       named_parameters=net.named_parameters(),
                                       compression=compression)
        model = net

        def barrier():
            hvd.allreduce(torch.zeros(1), name="barrier", op=hvd.Sum)
    else:
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel as DDP
        rank, size = args.rank, args.world
        dist.init_process_group("gloo", init_method="tcp://%s:%d" % (args.master, args.port),
                                rank=rank, world_size=size)
        # powerSGD_hook issues its allreduces from future callbacks: with several buckets in
        # flight they reach gloo in different orders on different ranks (a collective mismatch
        # that crashes the job), so it gets one bucket for the whole model.
        cap = {"bucket_cap_mb": 4096} if args.method == "ddp_powersgd" else {}
        model = DDP(net, **cap)  # broadcasts rank 0's parameters
        if args.method == "ddp_fp16":
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
            model.register_comm_hook(None, default_hooks.fp16_compress_hook)
        elif args.method == "ddp_quant":
            model.register_comm_hook(None, quantization_pertensor_hook)
        elif args.method == "ddp_powersgd":
            from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook
            state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=1,
                                                start_powerSGD_iter=2)
            model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
        opt = torch.optim.SGD(model.parameters(), lr=args.lr)

        def barrier():
            dist.barrier()

    def step(i):
        x, y = batch(rank, i, args.batch)
        opt.zero_grad()
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        opt.step()
        return float(loss.detach())

    loss0 = eval_loss(net, batch)
    for i in range(args.warmup):
        step(i)
    barrier()
    rx0, tx0 = iface_bytes(args.iface)
    times, losses = [], []
    for i in range(args.warmup, args.warmup + args.steps):
        t0 = time.perf_counter()
        losses.append(step(i))
        times.append(time.perf_counter() - t0)
    barrier()
    rx1, tx1 = iface_bytes(args.iface)
    res = {"rank": rank, "size": size, "times": times, "train_losses": losses,
           "tx": tx1 - tx0, "rx": rx1 - rx0, "steps": args.steps,
           "eval_loss_start": loss0, "eval_loss": eval_loss(net, batch),
           "params": sum(p.numel() for p in net.parameters()),
           "threshold": threshold if TWOBIT.get(args.method, ("",))[0] == "fixed" else None}
    with open(os.path.join(args.out, "rank%d.json" % rank), "w") as f:
        json.dump(res, f)
    if args.worker == "ddp":
        import torch.distributed as dist
        dist.destroy_process_group()
    return 0


# ---------------------------------------------------------------------- driver
def run_one(c, args, model, method, rate, log):
    out = tempfile.mkdtemp(prefix="bench-", dir=args.work)
    common = ["--model", model, "--method", method, "--steps", args.steps, "--warmup",
              args.warmup, "--batch", args.batch, "--lr", args.lr, "--out", out, "--iface", c.iface,
              "--mlp-hidden", args.mlp_hidden, "--mlp-in", args.mlp_in, "--cnn-channels",
              args.cnn_channels, "--threads", args.threads]
    if args.threshold:
        common += ["--threshold", args.threshold]
    env = {"PYTHONPATH": REPO, "OMP_NUM_THREADS": str(args.threads), "TF_CPP_MIN_LOG_LEVEL": "3",
           "GLOO_SOCKET_IFNAME": c.iface}
    script = os.path.abspath(__file__)
    if method in HOROVOD_METHODS:
        res = c.horovodrun(1, [sys.executable, script, "--worker", "horovod"] + common,
                           timeout=args.job_timeout, env=env, stream=log)
    else:
        master = c.hosts[0].addr
        res = c.run_on_hosts(lambda h: [sys.executable, script, "--worker", "ddp", "--rank", h.index,
                                        "--world", c.n_hosts, "--master", master, "--port", 29500]
                             + common, timeout=args.job_timeout, env=env, stream=log)
    ranks = [json.load(open(f)) for f in sorted(glob.glob(os.path.join(out, "rank*.json")))]
    shutil.rmtree(out, ignore_errors=True)
    if res.returncode != 0 or len(ranks) != c.n_hosts:
        print("  %s %s at %s FAILED (rc=%s):\n%s" % (model, method, rate, res.returncode,
                                                      res.output[-3000:]), flush=True)
        return {"model": model, "method": method, "rate": rate, "failed": True,
                "error": res.output[-1000:]}
    step_max = [max(r["times"][i] for r in ranks) for i in range(args.steps)]
    return {"model": model, "method": method, "rate": rate, "failed": False,
            "params": ranks[0]["params"],
            "median_step_s": statistics.median(step_max),
            "bytes_per_step": statistics.mean(r["tx"] for r in ranks) / args.steps,
            "eval_loss": ranks[0]["eval_loss"], "eval_loss_start": ranks[0]["eval_loss_start"],
            "threshold": ranks[0]["threshold"], "job_s": res.seconds}


def fmt_bytes(b):
    return "%.2f MB" % (b / 1e6) if b >= 1e5 else "%.1f kB" % (b / 1e3)


def table(results, args):
    lines = ["| rate | model | method | median step (s) | speed-up vs Horovod none | sent per host "
             "per step | loss after %d steps (start) |" % (args.warmup + args.steps),
             "|---|---|---|---:|---:|---:|---:|"]
    base = {(r["rate"], r["model"]): r for r in results if r["method"] == "none" and not r["failed"]}
    for r in results:
        label = ALL_METHODS[r["method"]]
        if r["method"] in TWOBIT and r.get("threshold"):
            label += " (t=%g)" % r["threshold"]
        if r["failed"]:
            lines.append("| %s | %s | %s | failed | | | |" % (r["rate"], r["model"], label))
            continue
        b = base.get((r["rate"], r["model"]))
        speed = "%.2fx" % (b["median_step_s"] / r["median_step_s"]) if b else ""
        lines.append("| %s | %s (%s params) | %s | %.3f | %s | %s | %.4f (%.4f) |" % (
            r["rate"], r["model"], "%.1fM" % (r["params"] / 1e6) if r["params"] >= 1e6
            else "%.1fk" % (r["params"] / 1e3), label, r["median_step_s"], speed,
            fmt_bytes(r["bytes_per_step"]), r["eval_loss"], r["eval_loss_start"]))
    return "\n".join(lines)


def plot(results, path, hosts):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    ok = [r for r in results if not r["failed"]]
    models = list(dict.fromkeys(r["model"] for r in ok))
    rates = list(dict.fromkeys(r["rate"] for r in ok))
    if not ok:
        return
    fig, axes = plt.subplots(len(models), len(rates), figsize=(5.5 * len(rates), 4 * len(models)),
                             squeeze=False)
    for i, model in enumerate(models):
        for j, rate in enumerate(rates):
            ax = axes[i][j]
            rows = [r for r in ok if r["model"] == model and r["rate"] == rate]
            names = [r["method"] for r in rows]
            colors = ["tab:red" if n in TWOBIT else "tab:blue" if n in HOROVOD_METHODS
                      else "tab:gray" for n in names]
            bars = ax.bar(range(len(rows)), [r["median_step_s"] for r in rows], color=colors)
            for b_, r in zip(bars, rows):
                ax.annotate(fmt_bytes(r["bytes_per_step"]), (b_.get_x() + b_.get_width() / 2,
                                                             b_.get_height()),
                            ha="center", va="bottom", fontsize=7)
            ax.set_xticks(range(len(rows)))
            ax.set_xticklabels(names, rotation=30, ha="right")
            ax.set_ylabel("median step time (s)")
            ax.set_title("%s @ %s" % (model, rate))
    fig.suptitle("%d-host virtual cluster: median step time (bars), bytes sent per host per step "
                 "(labels); red = TwoBit, blue = Horovod, gray = DDP" % hosts)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def machine():
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "?")
    except OSError:
        cpu = "?"
    import torch
    return "%s, %d cores (%s), Linux %s, Python %s, torch %s" % (
        platform.node() or "?", os.cpu_count(), cpu, platform.release(),
        platform.python_version(), torch.__version__)


def driver(args):
    from horovod_twobit.cluster import VirtualCluster, unavailable_reason
    reason = unavailable_reason()
    if reason:
        print("bench_cluster: %s" % reason, file=sys.stderr)
        return 2
    methods = [m for m in args.methods.split(",") if m]
    bad = [m for m in methods if m not in ALL_METHODS]
    if bad:
        print("unknown methods %s (choose from %s)" % (bad, ", ".join(ALL_METHODS)), file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    previous = []
    if args.append and os.path.exists(os.path.join(args.out, "bench_cluster.json")):
        with open(os.path.join(args.out, "bench_cluster.json")) as f:
            previous = json.load(f)["results"]
    args.work = tempfile.mkdtemp(prefix="bench-cluster-")
    log = open(os.path.join(args.out, "bench_cluster.log"), "w")
    results = []
    try:
        for rate in args.rates.split(","):
            with VirtualCluster(n_hosts=args.hosts, rate=rate, iface=args.iface, subnet=args.subnet) as c:
                print(c.describe(), flush=True)
                for model in args.models.split(","):
                    for method in methods:
                        t0 = time.time()
                        r = run_one(c, args, model, method, rate, log)
                        results.append(r)
                        if not r["failed"]:
                            print("  %-4s %-13s %-7s median step %.3f s, %s/step/host, loss %.4f "
                                  "(job %.0f s)" % (model, method, rate, r["median_step_s"],
                                                    fmt_bytes(r["bytes_per_step"]), r["eval_loss"],
                                                    time.time() - t0), flush=True)
    finally:
        log.close()
        shutil.rmtree(args.work, ignore_errors=True)
    if previous:  # new rows replace the same (rate, model, method); order: rate, model, method
        new = {(r["rate"], r["model"], r["method"]) for r in results}
        results = [r for r in previous if (r["rate"], r["model"], r["method"]) not in new] + results
        order = list(ALL_METHODS)
        rates = list(dict.fromkeys(r["rate"] for r in previous + results))
        results.sort(key=lambda r: (rates.index(r["rate"]), r["model"] != "mlp", r["model"],
                                    order.index(r["method"])))
        methods = list(dict.fromkeys(r["method"] for r in results))
    md = ["# horovod-twobit: %d-host virtual cluster benchmark" % args.hosts, "",
          "Machine: %s. All %d hosts share these cores." % (machine(), args.hosts),
          "Steps: %d warm-up + %d timed, batch %d per host, SGD lr %g; median over the timed steps "
          "of the slowest host's step time; bytes = the host's interface tx counter over the timed "
          "steps (headers and control traffic included), mean over hosts." % (
              args.warmup, args.steps, args.batch, args.lr), "",
          table(results, args), ""]
    if "ddp_quant" in methods:
        md += ["\\* torch's hook fails on gloo in torch 2.13 (it reads `fut.wait()[0]`, rank 0's "
               "tensor, as the list of all ranks', and with several buckets its callback-issued "
               "all_gathers can hang); this runs the same algorithm (same bytes) with both "
               "all_gathers issued in the hook, in bucket order, without overlap.", ""]
    if "ddp_powersgd" in methods:
        md += ["\\*\\* rank 1, compressing from step 2 on (warm-up steps are plain allreduce), "
               "with one DDP bucket for the whole model: with several buckets its callback-issued "
               "allreduces reach gloo in different orders on different ranks and the job crashes "
               "(torch 2.13).", ""]
    text = "\n".join(md)
    print("\n" + text)
    with open(os.path.join(args.out, "bench_cluster.md"), "w") as f:
        f.write(text)
    with open(os.path.join(args.out, "bench_cluster.json"), "w") as f:
        json.dump({"machine": machine(), "args": {k: v for k, v in vars(args).items() if k != "work"},
                   "results": results}, f, indent=1)
    plot(results, os.path.join(args.out, "bench_cluster.png"), args.hosts)
    print("wrote %s/bench_cluster.{md,png,json}" % args.out)
    return 0 if all(not r["failed"] for r in results) else 1


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hosts", type=int, default=4)
    ap.add_argument("--rates", default="100mbit,1gbit", help="comma-separated tc rates")
    ap.add_argument("--models", default="mlp,cnn",
                    help="mlp (>= 20M params), cnn (small), resnet (53 tensors, BatchNorm), "
                         "transformer (99 tensors, LayerNorm)")
    ap.add_argument("--methods", default=DEFAULT_METHODS,
                    help="comma-separated, from: %s" % ", ".join(ALL_METHODS))
    ap.add_argument("--steps", type=int, default=10, help="timed steps")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps first (PowerSGD starts "
                                                           "compressing at step 2)")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--threshold", type=float, default=None,
                    help="TwoBit threshold (default: %s)" % THRESHOLDS)
    ap.add_argument("--mlp-hidden", type=int, default=4096)
    ap.add_argument("--mlp-in", type=int, default=1024)
    ap.add_argument("--cnn-channels", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per host")
    ap.add_argument("--job-timeout", type=float, default=900)
    ap.add_argument("--iface", default="hvd0")
    ap.add_argument("--subnet", default="10.77.0.0/24")
    ap.add_argument("--out", default=os.path.join(REPO, "build", "bench_cluster"))
    ap.add_argument("--append", action="store_true",
                    help="merge into <out>/bench_cluster.json: rows of this run replace the same "
                         "rate/model/method, the others stay")
    # worker mode (started by the driver in every host)
    ap.add_argument("--worker", choices=["horovod", "ddp"], help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--method", help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--world", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--master", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=29500, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return worker(args)
    return driver(args)


if __name__ == "__main__":
    sys.exit(main())
