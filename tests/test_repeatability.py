"""Telling two methods of a measured cell apart: the sign test over the steps they ran side by
side, and how validate reports the model's misses with it."""

import json
import math
import subprocess
import sys

import pytest

from horovod_twobit.advisor import repeatability, validate

from test_advise import ROOT, _bench_json, _row


def test_sign_test_is_the_binomial_tail():
    assert repeatability.sign_test(0, 20) == 1.0
    assert repeatability.sign_test(20, 20) == 2.0 ** -20
    assert repeatability.sign_test(15, 20) == pytest.approx(
        sum(math.comb(20, j) for j in range(15, 21)) / 2 ** 20)  # 0.021
    assert repeatability.sign_test(10, 20) == pytest.approx(0.588, abs=1e-3)
    with pytest.raises(ValueError, match="0..steps"):
        repeatability.sign_test(4, 3)


def test_paired_pairs_the_steps_of_each_run_that_timed_both():
    a = {"r1": [1.0, 2.0, 3.0, 4.0], "r2": [5.0, 5.0, 5.0], "copy": [1.0, 2.0, 3.0, 4.0],
         "only_a": [9.0, 9.0]}
    b = {"r1": [0.5, 2.5, 2.0, 4.0], "r2": [4.0, 4.0, 4.0, 4.0], "copy": [0.5, 2.5, 2.0, 4.0],
         "only_b": [0.0]}
    got = repeatability.paired(a, b)
    # r1: +0.5, -0.5, +1, 0 (a tie: drops out); r2: +1 x 3 (its 4th step has no pair);
    # the copy of r1 counts once; runs of one method only are not pairs
    assert got["steps"] == 6 and got["slower"] == 5
    assert got["p"] == pytest.approx(repeatability.sign_test(5, 6))
    assert got["median_diff_s"] == pytest.approx(1.0)  # of +0.5 -0.5 +1 0 +1 +1 +1
    assert repeatability.paired(b, a)["slower"] == 1
    assert repeatability.paired({"r1": [1.0]}, {"r2": [1.0]}) is None
    assert repeatability.measurably_slower(None) is None
    assert repeatability.measurably_slower({"p": 0.01}) is True
    assert repeatability.measurably_slower({"p": 0.2}) is False


def test_runs_with_another_quota_period_are_another_cluster():
    """Runs of the same hosts and models whose CPU quota comes in other periods (bench_cluster's
    ``--cpu-period-us``) are not combined: their hosts are not the same."""
    def run(period, hosts=4):
        return ("p%s-h%d" % (period, hosts), {"args": {"hosts": hosts, "cpu_period_us": period},
                                              "results": []})
    groups = repeatability.clusters([run(10000), run(1000), run(10000), run(10000, 2)])
    assert sorted(sorted(p for p, _ in g) for g in groups) == [
        ["p1000-h4"], ["p10000-h2"], ["p10000-h4", "p10000-h4"]]


def _cell_runs(tmp_path, steps):
    """bench_cluster JSON of one 4-host cell per run: {method: step_s} each; real_step_s is
    the median of the steps, as bench_cluster writes it."""
    import statistics
    paths = []
    for i, run in enumerate(steps):
        rows = [dict(_row("m", meth, statistics.median(s)), step_s=s) for meth, s in run.items()]
        paths.append(_bench_json(tmp_path / ("r%d.json" % i), rows))
    return paths


def test_a_miss_within_the_noise_is_told_from_a_measurable_one(tmp_path):
    """The model picks what it predicts fastest; where the measured fastest is another method,
    validate pairs the two methods' steps over the runs (combined or not) and says whether the
    pick is measurably slower."""
    sizes = {"m": [1 << 20] * 4}
    predicted = {r["method"]: r["predicted_s"] for r in validate.compare(
        _cell_runs(tmp_path, [{"none": [1.0], "twobit": [1.0]}]), "cpu",
        sizes_of=lambda model, args: sizes[model])}
    pick = min(predicted, key=predicted.get)
    other = "none" if pick == "twobit" else "twobit"
    near = [1.00, 0.98, 1.01, 0.99, 1.02, 0.97, 1.00, 0.99]  # the pick: a hair slower
    far = [x * 0.8 for x in near]                              # the pick: 25 % slower
    noisy = {pick: [1.00, 1.03, 0.97, 1.02, 0.98, 1.01, 0.99, 1.00],
             other: [0.99, 1.04, 0.96, 1.01, 0.97, 1.03, 1.00, 0.98]}

    def miss(runs, combine):
        rows = validate.compare(_cell_runs(tmp_path, runs), "cpu",
                                sizes_of=lambda model, args: sizes[model], combine=combine)
        s = validate.summary(rows)
        return s, s["misses"]

    # two runs, the other method faster in every step by a fifth: measurable
    again = {pick: [x * 1.01 for x in near], other: [x * 1.01 for x in far]}
    s, misses = miss([{pick: near, other: far}, again], True)
    assert [(m["picked"], m["fastest"]) for m in misses] == [(pick, other)]
    assert misses[0]["paired"]["steps"] == 16 and misses[0]["paired"]["slower"] == 16
    assert s["measurable_misses"] == 1 and s["untold_misses"] == 0
    assert s["cells"] == 1 and s["within_noise"] == 0
    assert s["decided"] == 1 and s["decided_hits"] == 0  # the steps name the other: a real miss
    # the pick slower by the median only: the steps go both ways
    s, misses = miss([noisy], True)
    assert [(m["picked"], m["fastest"]) for m in misses] == [(pick, other)]
    assert misses[0]["paired"]["slower"] == 5 and misses[0]["paired"]["steps"] == 8  # p 0.36
    assert s["measurable_misses"] == 0 and s["untold_misses"] == 0
    assert s["fastest_hits"] == 0 and s["within_noise"] == 1  # a miss the steps cannot tell
    assert s["decided"] == 0 and s["decided_hits"] == 0
    # without steps kept, nothing to tell; each run alone (not combined) pairs its own steps
    s, misses = miss([{pick: [1.0], other: [0.8]}], False)
    assert misses[0]["paired"]["steps"] == 1
    rows = [dict(_row("m", pick, 1.0)), dict(_row("m", other, 0.8))]
    s = validate.summary(validate.compare([_bench_json(tmp_path / "old.json", rows)], "cpu",
                                          sizes_of=lambda model, args: sizes[model]))
    assert s["misses"][0]["paired"] is None and s["untold_misses"] == 1
    assert s["measurable_misses"] == 0 and s["within_noise"] == 0 and s["decided"] == 0
    # the pick measured fastest: right, with steps or without
    s = validate.summary(validate.compare(_cell_runs(tmp_path, [{pick: far, other: near}]),
                                          "cpu", sizes_of=lambda model, args: sizes[model]))
    assert s["fastest_hits"] == 1 and s["within_noise"] == 1 and not s["misses"]
    assert s["decided"] == 1 and s["decided_hits"] == 1
    # a third method the steps cannot tell from the fastest: the cell names no fastest
    s = validate.summary(validate.compare(
        _cell_runs(tmp_path, [{pick: far, other: near, "fp16": [
            x * k for x, k in zip(far, (1.03, 0.99, 1.02, 0.99, 1.03, 0.99, 1.02, 0.995))]}]),
        "cpu", sizes_of=lambda model, args: sizes[model]))
    assert s["cells"] == 1 and s["decided"] == 0 and s["decided_hits"] == 0


def test_validate_cli_says_which_misses_are_measurable(tmp_path):
    """The CLI prints, for each cell it misses, the paired steps and the sign test."""
    args = {"hosts": 2, "mlp_hidden": 64, "mlp_in": 32}
    path = tmp_path / "bench_cluster.json"

    def write(steps):
        path.write_text(json.dumps({"args": args, "results": [
            dict(_row("mlp", m, sorted(s)[len(s) // 2], 0.01), step_s=s)
            for m, s in steps.items()]}))
    write({"none": [0.04], "twobit": [0.04]})
    predicted = {r["method"]: r["predicted_s"] for r in validate.compare([str(path)], "cpu")}
    pick = min(predicted, key=predicted.get)
    other = "none" if pick == "twobit" else "twobit"
    write({pick: [0.05, 0.03, 0.06, 0.05, 0.05], other: [0.04, 0.04, 0.04, 0.05, 0.04]})
    out = subprocess.run([sys.executable, "-m", "horovod_twobit.advise", "validate", str(path),
                          "--profile", "cpu", "--json-out", str(tmp_path / "v.json")], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    (m,) = json.loads((tmp_path / "v.json").read_text())["summary"]["misses"]
    assert (m["picked"], m["paired"]["slower"], m["paired"]["steps"]) == (pick, 3, 4)  # 1 tie
    assert "of the 1 cells it misses, 0 pick a method measurably slower" in out.stdout
    assert "mlp 2 hosts 1gbit slower in 3 of 4 steps (p 0.31)" in out.stdout
    assert ("the model's pick is the fastest or not measurably slower than it in 1 of 1"
            in out.stdout)
    assert ("the steps name the fastest method (every other method of the cell measurably "
            "slower than it) in 0 of 1 cells; the model picks it in 0 of them" in out.stdout)
