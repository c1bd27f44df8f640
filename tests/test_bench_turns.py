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
