"""Which gradient exchange pays, predicted by the step-time model (:mod:`horovod_twobit.model.steptime`).

    python -m horovod_twobit.advise --params 25.6M --step-ms 120 --workers 64 --rate 25gbit
    python -m horovod_twobit.advise --model my_module:build --step-ms 120 --workers 64 --rate 25gbit
    python -m horovod_twobit.advise ... --json            # method -> step seconds and speed-up
    python -m horovod_twobit.advise ... --plot out.png    # speed-up against link rate, N = 8 ... 1024
    python -m horovod_twobit.advise calibrate [--out FILE]   # this machine's codec rates -> profile
    python -m horovod_twobit.advise validate build/emu/*/bench_cluster.json   # model vs emulation

For each method it prints the predicted step time, its speed-up over no compression and the
bytes a worker sends per step; then, per worker count, the break-even link rate: below it the
method is faster than no compression. ``--profile`` picks the device profile: ``cpu`` (measured
on the machine that wrote it, one core per worker), a GPU bound (``h100-bound``, ``a100-bound``:
the codec at the GPU's memory bandwidth, a lower bound, not a measurement), or a JSON file.
"""

import argparse
import importlib
import json
import math
import sys

from horovod_twobit.advisor import calibrate
from horovod_twobit.model import steptime
from horovod_twobit.advisor.validate import (bench_sizes, compare, main_validate, summary)  # noqa: F401

WORKER_COUNTS = (8, 16, 32, 64, 128, 256, 512, 1024)


def _fmt_rate(bps):
    if bps is None:
        return "always"
    if bps == 0:
        return "never"
    for unit, div in (("Tbit/s", 1e12), ("Gbit/s", 1e9), ("Mbit/s", 1e6)):
        if bps >= div:
            return "%.3g %s" % (bps / div, unit)
    return "%.3g kbit/s" % (bps / 1e3)


def _fmt_bytes(b):
    for unit, div in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if b >= div:
            return "%.3g %s" % (b / div, unit)
    return "%d B" % b


def _load_model(spec):
    """A torch.nn.Module from "module:function" (called without arguments) or "module:attr"."""
    mod, _, attr = spec.partition(":")
    if not attr:
        raise SystemExit("--model takes module:function, e.g. my_module:build")
    sys.path.insert(0, "")
    obj = getattr(importlib.import_module(mod), attr)
    return obj() if callable(obj) and not hasattr(obj, "parameters") else obj


def _model_kw(args):
    return dict(latency_s=steptime.parse_seconds(args.latency),
                cycle_s=steptime.parse_seconds(args.cycle),
                fusion_bytes=steptime.parse_count(args.fusion_bytes),
                bucket_bytes=args.bucket_bytes, forward_fraction=args.forward_fraction,
                powersgd_rank=args.powersgd_rank, collective_s=args.collective_cost and
                steptime.parse_seconds(args.collective_cost),
                burst_bytes=steptime.parse_count(args.burst))


def advise(sizes, compute_s, workers, rate, profile, methods=steptime.METHODS, **kw):
    """{method: {"step_s", "speedup", "bytes_sent", "bound"}} for one worker count and rate."""
    preds = steptime.predict_all(sizes, workers, rate, compute_s, profile, methods=methods, **kw)
    base = preds["none"].step_s if "none" in preds else steptime.predict(
        sizes, "none", workers, rate, compute_s, profile, **kw).step_s
    return {m: {"step_s": p.step_s, "speedup": base / p.step_s,
                "bytes_sent": p.parts["bytes_sent"], "bound": p.parts["bound"]}
            for m, p in preds.items()}


def _close_calls(res):
    """:func:`steptime.close_calls` of :func:`advise`'s predictions, among this project's methods
    (PowerSGD is a reference point)."""
    return steptime.close_calls({m: r["step_s"] for m, r in res.items() if m != "powersgd"})


def break_even_table(sizes, compute_s, profile, counts, methods, **kw):
    """{N: {method: bits/s or None (always pays) or 0.0 (never)}}."""
    return {N: {m: steptime.break_even_rate(sizes, m, N, compute_s, profile, **kw)
                for m in methods if m != "none"} for N in counts}


def plot(path, sizes, compute_s, profile, methods, counts=WORKER_COUNTS, **kw):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rates = [10 ** (8 + k / 4) for k in range(0, 15)]  # 100 Mbit/s ... 316 Gbit/s
    rates.append(4e11)
    shown = [m for m in methods if m != "none"]
    cols = min(3, len(shown))
    rows = int(math.ceil(len(shown) / cols))
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.8 * rows), squeeze=False)
    for ax, m in zip([a for r in axes for a in r], shown):
        for N in counts:
            ys = []
            for r in rates:
                none = steptime.predict(sizes, "none", N, r, compute_s, profile, **kw).step_s
                ys.append(none / steptime.predict(sizes, m, N, r, compute_s, profile, **kw).step_s)
            ax.plot([r / 1e9 for r in rates], ys, label="N = %d" % N)
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("link rate per worker (Gbit/s)")
        ax.set_ylabel("speed-up over no compression")
        ax.set_title(steptime.LABELS[m])
    for ax in [a for r in axes for a in r][len(shown):]:
        ax.axis("off")
    axes[0][0].legend(fontsize=7)
    prof = steptime.load_profile(profile)
    fig.suptitle("Predicted speed-up, %s values, %.0f ms compute per step, profile %s (%s)" % (
        _count(sum(sizes)), compute_s * 1e3, prof.get("name"), prof.get("kind")), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def _count(n):
    return "%.3gM" % (n / 1e6) if n >= 1e6 else "%d" % n


def main_predict(argv):
    p = argparse.ArgumentParser(prog="python -m horovod_twobit.advise", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--params", help="parameter count, e.g. 25.6M (cut into tensors of "
                                    "--tensor-values)")
    g.add_argument("--sizes", help="comma-separated tensor sizes, in registration order")
    g.add_argument("--model", help="module:function returning a torch.nn.Module")
    p.add_argument("--tensor-values", default="1M", help="with --params: values per tensor "
                                                         "(default %(default)s)")
    p.add_argument("--step-ms", type=float, required=True,
                   help="forward + backward time of one step on one worker, without communication")
    p.add_argument("--workers", type=int, default=64)
    p.add_argument("--rate", default="25gbit", help="link rate per worker (e.g. 25gbit, 100mbit)")
    p.add_argument("--latency", default="25us", help="link latency per message (default "
                                                     "%(default)s)")
    p.add_argument("--profile", default="cpu", help="cpu, h200, h100 (measured), h100-bound, "
                                                    "a100-bound, v100-bound, or a JSON file "
                                                    "(default %(default)s)")
    p.add_argument("--methods", default=",".join(steptime.METHODS))
    p.add_argument("--cycle", default="1ms", help="HOROVOD_CYCLE_TIME (default %(default)s)")
    p.add_argument("--collective-cost", help="fixed cost of each collective beyond its messages "
                                             "(e.g. 200us; default the profile's, else 0)")
    p.add_argument("--burst", default="0", help="bytes a link shaped by a token bucket sends at "
                                                "once (tc tbf, some clouds; default 0: a plain link)")
    p.add_argument("--fusion-bytes", default="64M", help="HOROVOD_FUSION_THRESHOLD (default "
                                                         "64 MiB)")
    p.add_argument("--bucket-bytes", type=int, default=None, help="TwoBitCompressor's bucket_bytes")
    p.add_argument("--forward-fraction", type=float, default=1.0 / 3,
                   help="share of --step-ms before backward starts (default 1/3)")
    p.add_argument("--powersgd-rank", type=int, default=4)
    p.add_argument("--counts", default=",".join(map(str, WORKER_COUNTS)),
                   help="worker counts of the break-even table and the plot")
    p.add_argument("--json", action="store_true", help="print the predictions as JSON")
    p.add_argument("--plot", metavar="PNG", help="write speed-up against link rate per N here")
    args = p.parse_args(argv)
    if args.model:
        sizes = steptime.sizes_from(_load_model(args.model))
    elif args.sizes:
        sizes = [steptime.parse_count(s) for s in args.sizes.split(",") if s.strip()]
    else:
        sizes = steptime.sizes_from(args.params, steptime.parse_count(args.tensor_values))
    methods = [m for m in args.methods.split(",") if m]
    bad = [m for m in methods if m not in steptime.METHODS]
    if bad:
        p.error("unknown methods %s (choose from %s)" % (bad, ", ".join(steptime.METHODS)))
    if "none" not in methods:
        methods.insert(0, "none")
    prof = steptime.load_profile(args.profile)
    compute_s = args.step_ms / 1e3
    kw = _model_kw(args)
    rate = steptime.parse_rate(args.rate)
    res = advise(sizes, compute_s, args.workers, rate, prof, methods, **kw)
    if args.json:
        print(json.dumps({"workers": args.workers, "rate_bps": rate, "compute_s": compute_s,
                          "values": sum(sizes), "tensors": len(sizes),
                          "profile": {"name": prof.get("name"), "kind": prof.get("kind"),
                                      "source": prof.get("source")},
                          "methods": res, "close_calls": _close_calls(res)}, indent=1))
    else:
        print("model: %s values in %d tensors; compute %.1f ms per step; %d workers; link %s, "
              "latency %s" % (_count(sum(sizes)), len(sizes), args.step_ms, args.workers,
                              _fmt_rate(rate), args.latency))
        print("profile: %s (%s) - %s" % (prof.get("name"), prof.get("kind"), prof.get("source")))
        if prof.get("kind") == "bound":
            print("  (a bound: the codec at the device's memory bandwidth; real codecs are slower)")
        print()
        print("| method | predicted step (ms) | speed-up vs none | sent per worker per step | "
              "limited by |")
        print("|---|---:|---:|---:|---|")
        for m, r in res.items():
            print("| %s | %.1f | %.2fx | %s | %s |" % (
                steptime.LABELS[m], r["step_s"] * 1e3, r["speedup"], _fmt_bytes(r["bytes_sent"]),
                "host CPU" if r["bound"] == "cpu" else "step's critical path"))
        close, pct = _close_calls(res), round(100 * steptime.CLOSE_CALL)
        others = ", ".join(steptime.LABELS[m] for m in close[1:])
        if others:
            tail = ("Within %d %% of it, closer than the model's error against the emulation's "
                    "steps (docs/where_it_pays.md): %s; time these on the cluster before "
                    "choosing." % (pct, others))
        else:
            tail = "No other method within %d %% of it." % pct
        print("\nFastest predicted: %s. %s" % (steptime.LABELS[close[0]], tail))
        counts = [int(c) for c in args.counts.split(",") if c]
        if args.workers not in counts:
            counts = sorted(counts + [args.workers])
        table = break_even_table(sizes, compute_s, prof, counts, methods, **kw)
        shown = [m for m in methods if m != "none"]
        print()
        print("Break-even link rate per worker (the method is faster than no compression below "
              "it):")
        print()
        print("| N | " + " | ".join(steptime.LABELS[m] for m in shown) + " |")
        print("|---:|" + "---:|" * len(shown))
        for N, row in table.items():
            print("| %d | %s |" % (N, " | ".join(_fmt_rate(row[m]) for m in shown)))
    if args.plot:
        counts = [int(c) for c in args.counts.split(",") if c]
        plot(args.plot, sizes, compute_s, prof, methods, counts, **kw)
        if not args.json:
            print("\nwrote %s" % args.plot)
    return 0


def main_calibrate(argv):
    p = argparse.ArgumentParser(prog="python -m horovod_twobit.advise calibrate",
                                description="Measure this machine's codec rates (the project's "
                                            "PyTorch codec) and write a device profile.")
    p.add_argument("--out", help="default: the profiles' folder, NAME.json")
    p.add_argument("--name", help="default: cpu, or the device's kind (cuda)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1: one core "
                                                          "per worker, as the emulation's hosts)")
    p.add_argument("--sizes", default="4K,64K,256K,1M,4M,16M",
                   help="bucket sizes in values, spanning the cache (default %(default)s)")
    p.add_argument("--members", type=int, default=calibrate.MEMBERS,
                   help="time a bucket of this many members too, for the cost per member "
                        "(default %(default)s; 1: not timed)")
    p.add_argument("--tables", type=int, default=calibrate.TABLES,
                   help='time an "auto" bucket of this many tables of segments too, for the '
                        "cost per table (default %(default)s; 1: not timed)")
    p.add_argument("--segment-values", type=int, default=calibrate.SEGMENT_VALUES,
                   help='time an "auto" tensor of this many values in blocks of 64 too, for '
                        "the cost per segment (default %(default)s; 0: not timed)")
    p.add_argument("--ranks", default="2,4,8")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--eager", action="store_true", help="time the uncompiled codec")
    p.add_argument("--device", default="cpu",
                   help="where the codec's tensors live: cpu (default) or cuda (a GPU host; "
                        "times in wall seconds)")
    p.add_argument("--clock", choices=calibrate.CLOCKS,
                   help="cpu (the default on a CPU): CPU seconds of this process; wall (the "
                        "default on a GPU): wall seconds / --dilation, also for a virtual "
                        "cluster's host (examples/bench_cluster.py --calibrate runs it on every "
                        "host)")
    p.add_argument("--dilation", type=float, default=1.0)
    args = p.parse_args(argv)
    args.name = args.name or args.device.split(":")[0]
    args.out = args.out or "%s/%s.json" % (steptime.PROFILE_DIR, args.name)
    sizes = [_binary(s) for s in args.sizes.split(",")]
    prof = calibrate.calibrate(args.out, sizes=sizes, ranks=[int(r) for r in args.ranks.split(",")],
                               threads=args.threads, compiled=not args.eager, reps=args.reps,
                               name=args.name, dilation=args.dilation, device=args.device,
                               clock=args.clock or ("cpu" if args.device == "cpu" else "wall"),
                               members=args.members, tables=args.tables,
                               segment_values=args.segment_values)
    print("wrote %s" % args.out)
    for k in steptime.CODEC_KEYS:
        c0, c1, a, b = prof["codec"][k]
        print("  %-20s %.3g s + %.3g s x N + n x (%.3g + %.3g x N) s" % (k, c0, c1, a, b))
    by_size = prof["codec_by_size"]
    print("per-value rate by bucket size (a + b N, ns):", ", ".join(
        _count(n) for n in by_size["sizes"]))
    for k in steptime.CODEC_KEYS:
        e = by_size["keys"][k]
        print("  %-20s %.3g s + %.3g s x N; %s" % (k, e["fixed"][0], e["fixed"][1], ", ".join(
            "%.3g + %.3g N" % (a * 1e9, b * 1e9) for a, b in e["per_value"])))
    if prof.get("codec_members"):
        cm = prof["codec_members"]
        print("per member beyond the first (a bucket of %d members, %s values), us:" % (
            cm["members"], _count(cm["values"])))
        for k in steptime.CODEC_KEYS:
            m0, m1 = cm["keys"][k]
            print("  %-20s %.3g + %.3g x N" % (k, m0 * 1e6, m1 * 1e6))
    for entry, what in (("codec_tables", 'per table of an "auto" bucket\'s segments beyond '
                                          "the first"),
                        ("codec_segments", 'per "auto" segment beyond one tensor\'s')):
        if prof.get(entry):
            print("%s, us:" % what)
            for k, (u0, u1) in sorted(prof[entry]["keys"].items()):
                print("  %-20s %.3g + %.3g x N" % (k, u0 * 1e6, u1 * 1e6))
    for k in ("sum_fp32_s", "sum_fp16_s", "cast_fp16_s", "copy_s_per_byte", "optimizer_s",
              "kernel_s_per_byte", "message_s", "page_s"):
        if k in prof:  # page_s: CPU profiles measured since it was added
            print("  %-20s %.3g" % (k, prof[k]))
    return 0


def _binary(s):
    s = s.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(s[-1], 1)
    return int(float(s[:-1] if s[-1] in "KMG" else s) * mult)


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "calibrate":
        return main_calibrate(argv[1:])
    if argv and argv[0] == "validate":
        return main_validate(argv[1:])
    return main_predict(argv)


if __name__ == "__main__":
    sys.exit(main())
