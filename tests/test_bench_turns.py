"""bench_cluster's timed steps: the methods take turns step by step (each step after a barrier),
or with ``--run-steps K`` K steps in a row (one barrier each run), as training runs them."""

import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from examples import _cluster_worker  # noqa: E402
from examples import bench_cluster  # noqa: E402


def test_step_by_step_rotates_who_goes_first():
    got = _cluster_worker.turns(3, 2, 4)
    assert got == [(2, [(2, 2), (0, 2), (1, 2)]), (3, [(0, 3), (1, 3), (2, 3)]),
                   (4, [(1, 4), (2, 4), (0, 4)]), (5, [(2, 5), (0, 5), (1, 5)])]


def test_runs_of_steps_in_a_row():
    got = _cluster_worker.turns(2, 1, 5, in_a_row=2)
    # steps 1-2, 3-4, then 5 alone; every method runs each step once, in a row within a turn
    assert got == [(1, [(0, 1), (0, 2), (1, 1), (1, 2)]),
                   (3, [(1, 3), (1, 4), (0, 3), (0, 4)]),
                   (5, [(0, 5), (1, 5)])]
    for methods, warmup, steps, k in [(5, 2, 20, 5), (3, 0, 7, 3), (1, 4, 3, 10)]:
        order = [mi for _, o in _cluster_worker.turns(methods, warmup, steps, k) for mi in o]
        assert sorted(order) == sorted((m, i) for m in range(methods)
                                       for i in range(warmup, warmup + steps))


def test_run_steps_option():
    args = bench_cluster.parser().parse_args(["--run-steps", "5"])
    assert args.run_steps == 5
    assert bench_cluster.parser().parse_args([]).run_steps == 1


def test_bucket_bench_warms_a_fallback_until_its_check_decided():
    """bench_buckets: a method with fallback="auto" runs untimed steps until its compressor's
    stats show the check decided, and one more (a fit loop traces anew there; at least
    ``--warmup``, at most ``fallback.start_steps()``), every other method as many; then the
    methods take turns."""
    import argparse
    from examples import bench_buckets
    from horovod_twobit.state import fallback
    ran = {"none": 0, "twobit_fallback": 0, "auto_fallback": 0}

    class Comp:
        def __init__(self, m, decided_after):
            self.m, self.after = m, decided_after

        def stats(self):
            return {"fallback_checks": [{}]} if ran[self.m] >= self.after else {}

    def step(m):
        def fn():
            ran[m] += 1
        return fn
    comps = {"none": None, "twobit_fallback": Comp("twobit_fallback", 9),
             "auto_fallback": Comp("auto_fallback", 10 ** 6)}  # never decides
    args = argparse.Namespace(warmup=2, rounds=3, steps=1)
    steps_of = {m: step(m) for m in ran}
    times, starts = bench_buckets.interleaved(steps_of, args, comps)
    most = fallback.start_steps()
    assert len(starts["twobit_fallback"]) == 10 and len(starts["auto_fallback"]) == most
    assert len(starts["none"]) == most  # as many as the longest check
    assert all(len(t) == 3 for t in times.values())
    comps["auto_fallback"] = Comp("auto_fallback", 0)  # decided from the start: the warmup
    ran.update(dict.fromkeys(ran, 0))
    times, starts = bench_buckets.interleaved(steps_of, args, comps)
    assert [len(starts[m]) for m in ("none", "twobit_fallback", "auto_fallback")] == [10, 10, 2]


def test_bucket_bench_settles_each_method_before_its_timed_steps():
    """bench_buckets ``--settle K``: each round, a method runs K untimed steps of its own before
    its timed ones, so no timed step follows another method's; the timed count is unchanged."""
    import argparse
    from examples import bench_buckets
    log = []

    def step(m):
        def fn():
            log.append(m)
        return fn
    steps_of = {m: step(m) for m in ("a", "b")}
    args = argparse.Namespace(warmup=1, rounds=2, steps=2, settle=1)
    times, _ = bench_buckets.interleaved(steps_of, args)
    assert log == ["a", "b"] + ["a"] * 3 + ["b"] * 3 + ["b"] * 3 + ["a"] * 3
    assert all(len(t) == 4 for t in times.values())


def test_bucket_bench_sets_each_fallback_beside_a_copy_of_the_faster_method():
    """bench_buckets' fallback table: each fallback method's step over the faster of no
    compression and its twin (``twobit_fallback/256K``'s is ``twobit/256K``), and the copy
    (``#2``) of that faster method over it (a value may carry more than the median and the
    tensors: ``--profile``'s)."""
    from examples import bench_buckets
    r = {("mlp", "none"): (0.0097, 52), ("mlp", "twobit"): (0.0092, 52),
         ("mlp", "twobit_fallback"): (0.0101, 52), ("mlp", "auto"): (0.0103, 52),
         ("mlp", "auto_fallback"): (0.0115, 52, {}), ("mlp", "none#2"): (0.0103, 52),
         ("mlp", "twobit#2"): (0.0102, 52), ("cnn", "none"): (0.02, 53),
         ("cnn", "twobit_fallback"): (0.019, 53), ("mlp", "twobit/256K"): (0.0090, 52),
         ("mlp", "twobit_fallback/256K"): (0.0099, 52)}
    lines = bench_buckets.fallback_table(r).splitlines()
    assert lines[2:] == ["| mlp | auto_fallback | 1.19x | none | 1.06x (none#2) |",
                         "| mlp | twobit_fallback | 1.10x | twobit | 1.11x (twobit#2) |",
                         "| mlp | twobit_fallback/256K | 1.10x | twobit/256K |  |"]
    assert bench_buckets.fallback_table({("mlp", "none"): (0.01, 52)}) == ""
