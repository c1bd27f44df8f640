"""The step-time model (:mod:`horovod_twobit.model.steptime`) against measured steps: every Horovod row of
``examples/bench_cluster.py``'s JSON, predicted with the row's own model, hosts, rate and the
cell's no-compression compute, and what the model lacks per row (the measured codec and CPU per
step against the predicted, the spread of the slowest host).

    python -m horovod_twobit.advise validate build/emu/*/bench_cluster.json --json-out rows.json
"""

import argparse
import json
import statistics
import sys

from horovod_twobit.model import steptime
from horovod_twobit.advisor.repeatability import (EMU_METHODS, MEASURABLE, measurably_slower,
    paired, run_agreement)
from horovod_twobit.advisor.repeatability import clusters as _clusters


def bench_sizes(model, bench_args):
    """Tensor sizes of a bench_cluster model, built as its worker builds it."""
    import os
    import types
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if repo not in sys.path:
        sys.path.insert(0, repo)
    from examples._cluster_worker import build
    a = types.SimpleNamespace(mlp_hidden=bench_args.get("mlp_hidden", 4096),
                              mlp_in=bench_args.get("mlp_in", 1024),
                              cnn_channels=bench_args.get("cnn_channels", 16))
    net, _ = build(model, a)
    return steptime.sizes_from(net)


def compare(paths, profile=None, sizes_of=None, **kw):
    """Rows of predicted against measured real-host step for every Horovod row of bench_cluster
    JSON files (``<out>/bench_cluster.json``). Compute per step: the cell's no-compression
    row's measured compute (the model's input), the same for every method of the cell.
    ``profile``: the device profile for every row; None (default): the profile bench_cluster
    measured on the rows' own hosts (``--calibrate``, its JSON's "profiles" by rate) where there
    is one, else "cpu". ``combine=True``: several runs of a cluster count as one
    (:func:`combined`); ``burst_bytes``: the links' token bucket (default: the emulation's,
    :func:`_burst`); ``latency_s`` (default 0: the emulation adds none)."""
    sizes_of = sizes_of or bench_sizes
    fixed = steptime.load_profile(profile) if profile is not None else None
    cpu = steptime.load_profile("cpu")  # for rows without a measured profile
    rows, cache = [], {}
    loaded = load(paths)
    if kw.get("combine"):
        loaded = combined(loaded)
    for path, data in loaded:
        measured = data.get("profiles", {})
        bargs = data.get("args", {})
        hosts = int(bargs.get("hosts", 4))
        res = [r for r in data["results"] if not r.get("failed") and r["method"] in EMU_METHODS]
        for r in res:
            base = next((b for b in res if b["model"] == r["model"] and b["rate"] == r["rate"]
                         and b["method"] == "none"), None)
            if base is None or base.get("compute_s") is None:
                continue
            key = (r["model"], bargs.get("mlp_hidden"), bargs.get("mlp_in"),
                   bargs.get("cnn_channels"))
            if key not in cache:
                cache[key] = sizes_of(r["model"], bargs)
            prof = fixed or measured.get(r["rate"]) or cpu
            p = steptime.predict(cache[key], r["method"], hosts, r["rate"], base["compute_s"],
                                 prof, latency_s=kw.get("latency_s", 0.0),
                                 bucket_bytes=bargs.get("bucket_bytes"),
                                 burst_bytes=_burst(r["rate"], bargs, kw.get("burst_bytes")))
            rows.append({"source": path, "hosts": hosts, "rate": r["rate"], "model": r["model"],
                         "method": r["method"], "measured_s": r["real_step_s"],
                         "profile": prof.get("name"),
                         "predicted_s": p.step_s, "error": p.step_s / r["real_step_s"] - 1,
                         "bound": p.parts["bound"], "cpus_per_host": r.get("cpus_per_host"),
                         "dilation": r.get("dilation"), **_parts_against(r, p),
                         "steps_by_run": r.get("steps_by_run", _steps_by_run([(path, r)]))})
    return rows


MEASURED = ("real_step_s", "compute_s", "codec_s", "wait_s", "cpu_step_s")


def _distinct(pairs):
    """``[(file, row)]`` less the rows whose measured figures repeat an earlier one's exactly (a
    copied run's: it counts once, as in :func:`run_agreement`)."""
    out, seen = [], []
    for path, r in pairs:
        key = [r.get(k) for k in MEASURED + ("step_s",)]
        if key not in seen:
            seen.append(key)
            out.append((path, r))
    return out


def _steps_by_run(pairs):
    """``{run's file: its timed steps}`` of a row's ``[(file, row)]`` that kept them."""
    return {path: r["step_s"] for path, r in pairs if r.get("step_s")}


def load(paths):
    """``[(path, bench_cluster JSON)]`` of ``paths``."""
    out = []
    for path in paths:
        with open(path) as f:
            out.append((path, json.load(f)))
    return out


def combined(loaded):
    """``[(source, bench_cluster JSON)]`` with the runs of one cluster (the same hosts, quota,
    dilation and arguments that shape the models) made one: each (model, method, rate) row at
    the median of its runs' measured figures (:data:`MEASURED`; a row copied into another run
    counts once) and with ``steps_by_run``, each run's timed steps (``step_s``) by its file
    where it kept them; each rate's profile from the first run that has one. The source names
    the runs' files."""
    out = []
    for runs in _clusters(loaded):
        by_row = {}
        for path, data in runs:
            for r in data["results"]:
                if not r.get("failed"):
                    by_row.setdefault((r["model"], r["method"], r["rate"]), []).append((path, r))
        results = []
        for pairs in by_row.values():
            pairs = _distinct(pairs)
            same = [r for _, r in pairs]
            r = dict(same[0], runs=len(same), steps_by_run=_steps_by_run(pairs))
            for k in MEASURED:
                xs = [x[k] for x in same if x.get(k) is not None]
                r[k] = statistics.median(xs) if xs else None
            results.append(r)
        profiles = {}
        for _, data in runs:  # by rate: a run's own, the first run's where several have one
            for rate, prof in data.get("profiles", {}).items():
                profiles.setdefault(rate, prof)
        out.append((" + ".join(p for p, _ in runs),
                    dict(runs[0][1], results=results, profiles=profiles)))
    return out


def _burst(rate, bench_args, burst_bytes=None):
    """The token bucket of the emulation's links at ``rate`` (each end of every veth is a tc
    ``tbf`` of that many bytes: :func:`horovod_twobit.cluster.hosts.tbf_burst`), unless
    ``burst_bytes`` is given."""
    if burst_bytes is not None:
        return burst_bytes
    from horovod_twobit.cluster.hosts import tbf_burst
    return tbf_burst(rate, int(bench_args.get("mtu", 1500)))


def _parts_against(r, p):
    """What the model lacks, row by row: the measured codec and CPU per step against the
    predicted, the pages first touched per step (the process's minor faults) against the pages
    the model has the step map fresh, and the spread (the measured step, the slowest host's,
    less the median host's compute + codec + wait; None where bench_cluster did not record the
    parts)."""
    parts = [r.get(k) for k in ("compute_s", "codec_s", "wait_s")]
    return {"codec_measured_s": r.get("codec_s"), "codec_predicted_s": p.parts["codec"],
            "cpu_measured_s": r.get("cpu_step_s"), "cpu_predicted_s": p.parts["cpu"],
            "faults_measured": r.get("faults_per_step"), "pages_predicted": p.parts["fresh_pages"],
            "spread_s": None if None in parts else r["real_step_s"] - sum(parts)}


def summary(rows):
    """Median and worst |error|; the share of (source, model, rate, N) cells whose fastest
    method the model picks; and what following the model costs where it does not: per cell,
    the measured step of the method it picks over the measured fastest, less 1
    (``pick_loss``: median and worst over the cells; ``misses``: the cells it gets wrong); and
    how often the measured fastest is among the methods the advisor names as too close to call
    (:func:`steptime.close_calls` of the predicted steps; ``close_call_hits``, with the mean
    number of methods it names per cell, ``close_call_size``). Each miss has ``paired``: the
    pick against the fastest over the steps they ran side by side (:func:`repeatability.paired`,
    None where the rows kept no steps); ``measurable_misses`` counts the misses whose pick is
    measurably slower, ``untold_misses`` those without steps to tell; ``within_noise`` counts
    the cells whose pick is the measured fastest or, by the steps, not measurably slower than
    it (a miss without steps does not count): the share of cells the model gets right as far as
    the measurements can tell. ``decided`` counts the cells whose steps name their fastest
    method (every other method of the cell measurably slower than it, step by step: cells the
    model can be checked on at all), ``decided_hits`` those of them whose fastest it picks."""
    errs = [abs(r["error"]) for r in rows]
    cells = {}
    for r in rows:
        cells.setdefault((r["source"], r["model"], r["rate"], r["hosts"]), []).append(r)
    hits, losses, misses, close_hits, close_sizes, decided = [], [], [], [], [], []
    for c in cells.values():
        if len(c) < 2:
            continue
        best = min(c, key=lambda r: r["measured_s"])
        pick = min(c, key=lambda r: r["predicted_s"])
        hits.append(best["method"] == pick["method"])
        if all(measurably_slower(paired(r.get("steps_by_run", {}),
                                        best.get("steps_by_run", {}))) is True
               for r in c if r is not best):
            decided.append(hits[-1])
        close = steptime.close_calls({r["method"]: r["predicted_s"] for r in c})
        close_hits.append(best["method"] in close)
        close_sizes.append(len(close))
        losses.append(pick["measured_s"] / best["measured_s"] - 1)
        if not hits[-1]:
            misses.append({"hosts": best["hosts"], "rate": best["rate"], "model": best["model"],
                           "fastest": best["method"], "picked": pick["method"],
                           "pick_loss": losses[-1],
                           "paired": paired(pick.get("steps_by_run", {}),
                                            best.get("steps_by_run", {}))})
    measurable = sum(measurably_slower(m["paired"]) is True for m in misses)
    untold = sum(m["paired"] is None for m in misses)
    return {"rows": len(rows), "median_abs_error": statistics.median(errs) if errs else None,
            "worst_abs_error": max(errs) if errs else None, "cells": len(hits),
            "fastest_hits": sum(hits), "fastest_hit_rate": sum(hits) / len(hits) if hits else None,
            "median_pick_loss": statistics.median(losses) if losses else None,
            "worst_pick_loss": max(losses) if losses else None, "misses": misses,
            "measurable_misses": measurable, "untold_misses": untold,
            "within_noise": len(hits) - measurable - untold,
            "decided": len(decided), "decided_hits": sum(decided),
            "close_call_hits": sum(close_hits),
            "close_call_size": statistics.mean(close_sizes) if close_sizes else None}


def main_validate(argv):
    p = argparse.ArgumentParser(prog="python -m horovod_twobit.advise validate",
                                description="Predicted against measured real-host step times "
                                            "for bench_cluster.json files (examples/"
                                            "bench_cluster.py's output).")
    p.add_argument("json", nargs="+")
    p.add_argument("--profile", default=None,
                   help="device profile for every row (default: the one bench_cluster measured "
                        "on the rows' hosts with --calibrate, else cpu)")
    p.add_argument("--combine", action="store_true",
                   help="several runs of a cluster as one: each row at the median of its runs")
    p.add_argument("--json-out", help="also write the rows and summary here")
    args = p.parse_args(argv)
    rows = compare(args.json, args.profile, combine=args.combine)
    agreement = run_agreement(load(args.json)) if args.combine else None
    print("| source | N | rate | model | method | measured (s) | predicted (s) | error | "
          "model's bound | codec measured / predicted (ms) | spread (ms) |")
    print("|---|---:|---|---|---|---:|---:|---:|---|---:|---:|")
    ms = lambda s: "" if s is None else "%.1f" % (1e3 * s)
    for r in rows:
        print("| %s | %d | %s | %s | %s | %.3f | %.3f | %+.0f %% | %s | %s / %s | %s |" % (
            r["source"], r["hosts"], r["rate"], r["model"], r["method"], r["measured_s"],
            r["predicted_s"], 100 * r["error"], r["bound"], ms(r["codec_measured_s"]),
            ms(r["codec_predicted_s"]), ms(r["spread_s"])))
    s = summary(rows)
    print()
    if s["rows"]:
        print("rows %d: median |error| %.1f %%, worst %.1f %%; fastest method predicted in %d of "
              "%d cells (%.0f %%)" % (s["rows"], 100 * s["median_abs_error"],
                                      100 * s["worst_abs_error"], s["fastest_hits"], s["cells"],
                                      100 * (s["fastest_hit_rate"] or 0)))
        if s["misses"]:
            print("where it picks another method, that method's measured step is slower than the "
                  "fastest by: " + ", ".join(
                      "%s %d hosts %s: %s for %s, +%.1f %%" % (
                          m["model"], m["hosts"], m["rate"], m["picked"], m["fastest"],
                          100 * m["pick_loss"]) for m in s["misses"]))
            told = ["%s %d hosts %s slower in %d of %d steps (p %.2g)" % (
                m["model"], m["hosts"], m["rate"], m["paired"]["slower"], m["paired"]["steps"],
                m["paired"]["p"]) for m in s["misses"] if m["paired"]]
            line = ("of the %d cells it misses, %d pick a method measurably slower than the "
                    "fastest (a one-sided sign test over the steps the two ran side by side, "
                    "p < %g)" % (len(s["misses"]), s["measurable_misses"], MEASURABLE))
            if s["untold_misses"]:
                line += "; %d kept no steps to tell" % s["untold_misses"]
            print(line + (": " + ", ".join(told) if told else ""))
            print("the model's pick is the fastest or not measurably slower than it in %d of %d "
                  "cells" % (s["within_noise"], s["cells"]))
        print("the steps name the fastest method (every other method of the cell measurably "
              "slower than it) in %d of %d cells; the model picks it in %d of them" % (
                  s["decided"], s["cells"], s["decided_hits"]))
        print("the measured fastest is among the methods within %d %% of the model's pick in %d "
              "of %d cells (%.1f methods named per cell)" % (
                  round(100 * steptime.CLOSE_CALL), s["close_call_hits"], s["cells"],
                  s["close_call_size"] or 0))
    if agreement and agreement["cells"]:
        print("how repeatable the cells are: each run alone names the fastest method of the "
              "runs' medians in %d of %d (cell, run) pairs; every run names the same in %d of "
              "%d cells" % (agreement["agree"], agreement["runs"], agreement["unanimous"],
                            agreement["cells"]))
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"rows": rows, "summary": s, "run_agreement": agreement}, f, indent=1)
    return 0
