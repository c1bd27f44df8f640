"""How far measured cells can tell methods apart: the runs of a cluster against each other
(:func:`run_agreement`), and two methods of one cell step by step (:func:`paired`).

A cell (cluster, model, rate) is scored by its fastest method. Where its methods lie within a
few per cent of each other, which one is fastest depends on the run: a model checked against
such a cell cannot be right or wrong there. ``examples/bench_cluster.py`` runs the methods of a
job in turns, step by step, and keeps every timed step (``step_s``): step i of two methods ran
side by side, under the same load, so their difference is the methods' own plus noise. The sign
test over those pairs says whether one method is measurably slower than the other.

Limits: steps of one run are not fully independent (a slow host stays slow for a while), so
the test's p-value is a guide, not a guarantee; the measured fastest is the smallest of several
medians, which favours its own noise, so the test errs towards calling the other method slower.
"""

import json
import math
import statistics

EMU_METHODS = ("none", "fp16", "twobit", "auto", "scatter", "scatter_auto")
MEASURABLE = 0.05  # a one-sided sign test below this: measurably slower


def clusters(loaded):
    """``loaded`` (``[(path, bench_cluster JSON)]``) grouped by cluster: lists of the runs of
    the same hosts, quota (its share and its period), dilation and arguments that shape the
    models."""
    def cluster(data):
        a = data.get("args", {})
        return json.dumps([a.get(k) for k in ("hosts", "cpus_per_host", "cpu_period_us",
                                              "dilation", "mlp_hidden", "mlp_in", "cnn_channels",
                                              "bucket_bytes")])
    groups = {}
    for path, data in loaded:
        groups.setdefault(cluster(data), []).append((path, data))
    return list(groups.values())


def run_agreement(loaded):
    """How repeatable the fastest method of a cell is: for every cell (cluster, model, rate)
    measured in at least two distinct runs (a run whose rows of the cell repeat another's
    exactly, a copied file, counts once), each run's own fastest method against the fastest of
    the runs' medians (what :func:`horovod_twobit.advisor.validate.combined` gives). ``{"cells", "runs":
    (cell, run) pairs, "agree": pairs whose run names the median's fastest, "unanimous": cells
    where every run names the same}``. A model scored against the medians cannot be checked
    more finely than the runs agree among themselves."""
    cells = runs_total = agree = unanimous = 0
    for runs in clusters(loaded):
        by_cell = {}
        for _, data in runs:
            rows = {}
            for r in data["results"]:
                if not r.get("failed") and r["method"] in EMU_METHODS:
                    rows.setdefault((r["model"], r["rate"]), {})[r["method"]] = r["real_step_s"]
            for cell, steps in rows.items():
                if len(steps) > 1 and steps not in by_cell.setdefault(cell, []):
                    by_cell[cell].append(steps)
        for distinct in by_cell.values():
            if len(distinct) < 2:
                continue
            methods = set.intersection(*(set(d) for d in distinct))
            median = {m: statistics.median(d[m] for d in distinct) for m in methods}
            best = min(median, key=median.get)
            alone = [min(methods, key=d.get) for d in distinct]
            cells += 1
            runs_total += len(alone)
            agree += sum(m == best for m in alone)
            unanimous += len(set(alone)) == 1
    return {"cells": cells, "runs": runs_total, "agree": agree, "unanimous": unanimous}


def sign_test(slower, steps):
    """One-sided sign test: the chance of ``slower`` or more of ``steps`` paired steps going one
    way when neither method is slower (each way with chance 1/2)."""
    if not 0 <= slower <= steps:
        raise ValueError("slower must be 0..steps, got %r of %r" % (slower, steps))
    return sum(math.comb(steps, j) for j in range(slower, steps + 1)) / 2.0 ** steps


def paired(a_runs, b_runs):
    """Method a against method b of one cell, step by step: ``a_runs`` and ``b_runs`` map a run
    (its file) to its timed steps (``step_s``). Pairs the steps of every run that timed both,
    as many as they have alike; a run whose steps repeat another's (a copied file) counts once;
    tied steps drop out. ``{"steps", "slower": steps where a took longer, "median_diff_s",
    "p": :func:`sign_test`}``, or None where no run timed both."""
    diffs, seen = [], []
    for run, a in a_runs.items():
        b = b_runs.get(run)
        if not a or not b or (a, b) in seen:
            continue
        seen.append((a, b))
        diffs += [x - y for x, y in zip(a, b)]
    if not diffs:
        return None
    moved = [d for d in diffs if d != 0]
    slower = sum(d > 0 for d in moved)
    return {"steps": len(moved), "slower": slower, "median_diff_s": statistics.median(diffs),
            "p": sign_test(slower, len(moved))}


def measurably_slower(test):
    """Whether a :func:`paired` result shows method a slower than b (None: no steps to tell)."""
    return None if test is None else test["p"] < MEASURABLE
