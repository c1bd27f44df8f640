"""Several configurations in one job (one launch, one framework import): each configuration's
records go to OUT/<index>/rank<r>.npz, where tests/sim.py's load_ranks reads them."""

import argparse
import os

import numpy as np


def threshold_exchange(spec):
    """``"0.05:scatter"`` -> (0.05, "scatter"); ``"auto:scatter"`` -> ("auto", "scatter")."""
    threshold, exchange = spec.split(":")
    return (threshold if threshold == "auto" else float(threshold)), exchange


def run_each(out, specs, run, rank):
    """``run(spec)`` (a dict of arrays) for each spec in turn, saved as configuration i."""
    for i, spec in enumerate(specs):
        rec = run(spec)
        os.makedirs(os.path.join(out, str(i)), exist_ok=True)
        np.savez(os.path.join(out, str(i), "rank%d.npz" % rank), **rec)
        print("rank %d configuration %d (%s) done" % (rank, i, spec), flush=True)


def parse_args():
    """The options every configuration worker takes: --out DIR --configs SPEC [SPEC ...]."""
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--configs", nargs="+", required=True)
    return p.parse_args()


# the fallback workers' forced decisions, step by step: both paths and the switches between them
SWITCH = ["compressed", "compressed", "plain", "plain", "compressed", "plain"]
HANDBACK = 4  # the step before which the "handback" configuration loads residuals


def checked_schedule(mode):
    """MODE "checked": fallback="auto" checks the model's picks on every job (whatever the
    model's margin), one round a block without warmup, two blocks (one round is never sure:
    the check always goes on for the second), and the check keeps plain whatever it timed (so
    that the steps after it are settled plain alike in every run); returns the steps to run:
    ``SWITCH``'s, or in "checked" the longest schedule, the step that decides and one after
    it."""
    from horovod_twobit.state import fallback
    global _DEFAULTS
    if _DEFAULTS is None:
        _DEFAULTS = (fallback.MARGIN, fallback.WARMUP, fallback.SAMPLES, fallback.BLOCKS,
                     fallback.choose)
    checked = ((float("inf"), 0, 1, 2, lambda figures, tie=None: fallback.PLAIN)
               if mode == "checked" else _DEFAULTS)
    (fallback.MARGIN, fallback.WARMUP, fallback.SAMPLES, fallback.BLOCKS,
     fallback.choose) = checked
    return fallback.start_steps() + 1 if mode == "checked" else len(SWITCH)


_DEFAULTS = None
