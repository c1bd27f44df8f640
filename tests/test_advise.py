"""python -m horovod_twobit.advise: predictions, JSON, plot, --model, and validation rows."""

import json
import os
import subprocess
import sys

import pytest

from horovod_twobit.advisor import cli as advise, validate
from horovod_twobit.model import steptime

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(args, capsys):
    assert advise.main(args) == 0
    return capsys.readouterr().out


def test_json(capsys):
    out = json.loads(run(["--params", "25.6M", "--step-ms", "100", "--workers", "64", "--rate",
                          "10gbit", "--profile", "a100-bound", "--json"], capsys))
    m = out["methods"]
    assert set(m) == set(steptime.METHODS)
    assert m["none"]["speedup"] == pytest.approx(1.0)
    for k, v in m.items():
        assert v["step_s"] > 0.1
        assert v["speedup"] == pytest.approx(m["none"]["step_s"] / v["step_s"])
    assert m["scatter"]["bytes_sent"] < m["twobit"]["bytes_sent"] / 10
    assert out["profile"]["kind"] == "bound"


def test_table_and_break_even(capsys):
    out = run(["--params", "25.6M", "--step-ms", "120", "--workers", "64", "--rate", "25gbit",
               "--profile", "h100-bound", "--methods", "twobit,scatter", "--counts", "8,1024"],
              capsys)
    assert "| TwoBit, scatter |" in out and "Break-even" in out
    rows = [l for l in out.splitlines() if l.startswith("| 8 |") or l.startswith("| 1024 |")
            or l.startswith("| 64 |")]
    assert len(rows) == 3  # the --workers count joins the table
    assert "(a bound" in out


def test_collective_cost_option(capsys):
    args = ["--params", "4M", "--step-ms", "0", "--workers", "8", "--rate", "10gbit",
            "--profile", "a100-bound", "--methods", "twobit,scatter", "--fusion-bytes", "1",
            "--json"]
    base = json.loads(run(args, capsys))["methods"]
    dear = json.loads(run(args + ["--collective-cost", "1ms"], capsys))["methods"]
    # no compute to hide them, no fusion: 4 buckets, one collective each (two: the scatter)
    assert dear["twobit"]["step_s"] - base["twobit"]["step_s"] == pytest.approx(4e-3)
    assert dear["scatter"]["step_s"] - base["scatter"]["step_s"] == pytest.approx(8e-3)


def test_model_option(tmp_path, capsys, monkeypatch):
    (tmp_path / "tiny_model.py").write_text(
        "import torch\n\ndef build():\n    return torch.nn.Sequential(torch.nn.Linear(100, 50), "
        "torch.nn.Linear(50, 10))\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    out = json.loads(run(["--model", "tiny_model:build", "--step-ms", "5", "--workers", "4",
                          "--json"], capsys))
    assert out["values"] == 100 * 50 + 50 + 50 * 10 + 10 and out["tensors"] == 4


def test_plot(tmp_path, capsys):
    png = tmp_path / "s.png"
    run(["--params", "10M", "--step-ms", "50", "--profile", "h100-bound", "--methods", "scatter",
         "--counts", "8,64", "--plot", str(png)], capsys)
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_unknown_method_is_an_error(capsys):
    with pytest.raises(SystemExit) as e:
        advise.main(["--params", "1M", "--step-ms", "1", "--methods", "gzip"])
    assert e.value.code not in (0, None)
    assert "gzip" in capsys.readouterr().err


def _bench_json(path, rows, hosts=4):
    path.write_text(json.dumps({"args": {"hosts": hosts}, "results": rows}))
    return str(path)


def _row(model, method, real, compute=0.1):
    return {"model": model, "method": method, "rate": "1gbit", "failed": False,
            "real_step_s": real, "compute_s": compute, "cpus_per_host": 0.4, "dilation": 2.5}


def test_compare_and_summary(tmp_path):
    sizes = {"m": [1 << 20] * 4}
    prof = steptime.load_profile("cpu")
    from horovod_twobit.cluster.hosts import tbf_burst  # the emulation's links
    pred = {m: steptime.predict(sizes["m"], m, 4, "1gbit", 0.1, prof, latency_s=0.0,
                                burst_bytes=tbf_burst("1gbit", 1500)).step_s
            for m in ("none", "twobit", "scatter")}
    rows = [_row("m", "none", pred["none"]), _row("m", "twobit", pred["twobit"] * 1.2),
            _row("m", "scatter", pred["scatter"] / 2), _row("m", "ddp", 1.0),
            dict(_row("m", "fp16", 1.0), failed=True)]
    got = advise.compare([_bench_json(tmp_path / "b.json", rows)], "cpu",
                         sizes_of=lambda model, args: sizes[model])
    assert [r["method"] for r in got] == ["none", "twobit", "scatter"]
    assert got[0]["error"] == pytest.approx(0, abs=1e-9)
    assert got[1]["error"] == pytest.approx(1 / 1.2 - 1)
    assert got[2]["error"] == pytest.approx(1.0)
    s = advise.summary(got)
    assert s["rows"] == 3 and s["worst_abs_error"] == pytest.approx(1.0)
    assert s["median_abs_error"] == pytest.approx(1 - 1 / 1.2)
    assert got[0]["spread_s"] is None and got[0]["codec_predicted_s"] == 0.0
    fastest_measured = min(got, key=lambda r: r["measured_s"])["method"]
    fastest_predicted = min(got, key=lambda r: r["predicted_s"])["method"]
    assert s["fastest_hits"] == int(fastest_measured == fastest_predicted) and s["cells"] == 1
    by = {r["method"]: r["measured_s"] for r in got}
    loss = by[fastest_predicted] / by[fastest_measured] - 1
    assert s["median_pick_loss"] == s["worst_pick_loss"] == pytest.approx(loss)
    assert [(m["fastest"], m["picked"]) for m in s["misses"]] == (
        [] if loss == 0 else [(fastest_measured, fastest_predicted)])


def test_runs_of_a_cluster_combine_at_their_median(tmp_path):
    """``combine``: the same cluster's rows from several runs are one row each, measured at the
    median of the runs (compute, codec and wait too); other clusters stay apart; without it
    each run is its own."""
    sizes = {"m": [1 << 20] * 4}
    runs = [[_row("m", "none", 0.30 + d, 0.10 + d), _row("m", "twobit", 0.20 + 2 * d)]
            for d in (0.0, 0.03, 0.01)]
    for rs, codec in zip(runs, (0.004, 0.001, 0.002)):
        rs[1]["codec_s"] = codec
    paths = [_bench_json(tmp_path / ("r%d.json" % i), rs) for i, rs in enumerate(runs)]
    other = _bench_json(tmp_path / "h8.json", [_row("m", "none", 0.5)], hosts=8)
    # two copies of run 1 (0.30, the lowest) would make it the median: a copy counts once
    copies = [_bench_json(tmp_path / ("copy%d.json" % i), runs[0]) for i in range(2)]
    got = advise.compare(paths + copies + [other], "cpu",
                         sizes_of=lambda model, args: sizes[model], combine=True)
    by = {(r["hosts"], r["method"]): r for r in got}
    assert len(got) == 3 and by[(8, "none")]["measured_s"] == 0.5
    assert by[(4, "none")]["measured_s"] == pytest.approx(0.31)
    assert by[(4, "twobit")]["measured_s"] == pytest.approx(0.22)
    assert by[(4, "twobit")]["codec_measured_s"] == pytest.approx(0.002)
    # the cell's compute, the model's input, is the median run's too: as run 3's prediction
    alone = advise.compare([paths[2]], "cpu", sizes_of=lambda model, args: sizes[model])
    assert by[(4, "twobit")]["predicted_s"] == pytest.approx(alone[1]["predicted_s"])
    assert len(advise.compare(paths, "cpu", sizes_of=lambda model, args: sizes[model])) == 6
    # runs of one cluster at two rates: each rate's rows keep the profile measured at that rate
    prof = steptime.load_profile("cpu")
    for rate, name in (("1gbit", "measured-1g"), ("100mbit", "measured-100m")):
        rows = [dict(_row("m", m, 0.3), rate=rate) for m in ("none", "twobit")]
        (tmp_path / rate).write_text(json.dumps({"args": {"hosts": 8}, "results": rows,
                                                 "profiles": {rate: dict(prof, name=name)}}))
    got = advise.compare([str(tmp_path / "1gbit"), str(tmp_path / "100mbit")],
                         sizes_of=lambda model, args: sizes[model], combine=True)
    assert sorted((r["rate"], r["profile"]) for r in got) == [
        ("100mbit", "measured-100m"), ("100mbit", "measured-100m"),
        ("1gbit", "measured-1g"), ("1gbit", "measured-1g")]


def test_run_agreement_counts_how_often_single_runs_name_the_medians_fastest(tmp_path):
    """Cell "a": runs name twobit, none, none (medians: none fastest): 2 of 3 agree. Cell "b":
    every run names scatter. A copied run (the same rows of a cell) counts once; a cell in one
    run only, or of one method, is not a cell; other clusters are their own."""
    steps = [{"a": (0.33, 0.32, 0.40), "b": (0.5, 0.6, 0.2)},
             {"a": (0.30, 0.31, 0.40), "b": (0.5, 0.6, 0.3)},
             {"a": (0.29, 0.33, 0.40), "b": (0.5, 0.6, 0.1)}]
    runs = [[_row(m, meth, x) for m, xs in run.items()
             for meth, x in zip(("none", "twobit", "scatter"), xs)] for run in steps]
    runs[0].append(_row("c", "none", 0.1))           # one method: no cell
    runs[0] += [_row("d", "none", 0.2), _row("d", "twobit", 0.1)]  # in one run only
    paths = [_bench_json(tmp_path / ("r%d.json" % i), rs) for i, rs in enumerate(runs)]
    copy = _bench_json(tmp_path / "copy.json", runs[2])
    other = _bench_json(tmp_path / "h8.json", runs[0], hosts=8)
    load = lambda ps: [(p, json.loads(open(p).read())) for p in ps]  # noqa: E731
    got = validate.run_agreement(load(paths + [copy, other]))
    assert got == {"cells": 2, "runs": 6, "agree": 5, "unanimous": 1}
    assert validate.run_agreement(load([paths[0], copy, other])) == {
        "cells": 2, "runs": 4, "agree": 3, "unanimous": 1}
    # a run and its copy, or one run of each cluster: no cell
    copy0 = _bench_json(tmp_path / "copy0.json", runs[0])
    assert validate.run_agreement(load([paths[0], copy0]))["cells"] == 0
    assert validate.run_agreement(load([paths[0], other]))["cells"] == 0


def test_validate_cli_on_bench_output(tmp_path):
    rows = [_row("mlp", m, x, 0.01) for m, x in (("none", 0.04), ("twobit", 0.05),
                                                   ("scatter", 0.05))]
    path = tmp_path / "bench_cluster.json"
    path.write_text(json.dumps({"args": {"hosts": 2, "mlp_hidden": 64, "mlp_in": 32},
                                "results": rows}))
    out = subprocess.run([sys.executable, "-m", "horovod_twobit.advise", "validate", str(path),
                          "--json-out", str(tmp_path / "v.json")], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "rows 3: median |error|" in out.stdout
    v = json.loads((tmp_path / "v.json").read_text())
    assert len(v["rows"]) == 3 and v["rows"][0]["model"] == "mlp"
    assert v["run_agreement"] is None and "how repeatable" not in out.stdout
    # two runs combined: the runs' agreement on the fastest method is printed and written
    again = tmp_path / "again.json"
    again.write_text(json.dumps({"args": {"hosts": 2, "mlp_hidden": 64, "mlp_in": 32},
                                 "results": [dict(r, real_step_s=x) for r, x in
                                             zip(rows, (0.06, 0.03, 0.06))]}))
    out = subprocess.run([sys.executable, "-m", "horovod_twobit.advise", "validate", str(path),
                          str(again), "--combine", "--json-out", str(tmp_path / "v.json")],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "every run names the same in 0 of 1 cells" in out.stdout
    v = json.loads((tmp_path / "v.json").read_text())
    assert v["run_agreement"] == {"cells": 1, "runs": 2, "agree": 1, "unanimous": 0}


def test_compare_reports_the_parts_the_model_lacks(tmp_path):
    row = dict(_row("m", "twobit", 0.5), codec_s=0.03, wait_s=0.2, cpu_step_s=0.4)
    got = advise.compare([_bench_json(tmp_path / "b.json", [_row("m", "none", 0.4), row])],
                         "cpu", sizes_of=lambda model, args: [1 << 20] * 4)[1]
    p = steptime.predict([1 << 20] * 4, "twobit", 4, "1gbit", 0.1, "cpu", latency_s=0.0)
    assert got["spread_s"] == pytest.approx(0.5 - 0.1 - 0.03 - 0.2)
    assert got["codec_measured_s"] == 0.03 and got["cpu_measured_s"] == 0.4
    assert got["codec_predicted_s"] == pytest.approx(p.parts["codec"])
    assert got["cpu_predicted_s"] == pytest.approx(p.parts["cpu"])


def test_summary_reports_what_a_wrong_pick_costs():
    """Per cell, the measured step of the method the model predicts fastest over the measured
    fastest: 0 where it picks right; the cells it gets wrong are listed with that loss."""
    def row(cell, method, measured, predicted):
        return {"source": "s", "model": cell, "rate": "1gbit", "hosts": 4, "method": method,
                "measured_s": measured, "predicted_s": predicted,
                "error": predicted / measured - 1}
    rows = [row("a", "none", 1.0, 0.9), row("a", "twobit", 0.8, 1.0),  # picks none: +25 %
            row("b", "none", 2.0, 2.0), row("b", "twobit", 1.0, 1.1),  # right
            row("c", "none", 3.0, 1.0), row("c", "scatter", 2.0, 1.5), row("c", "auto", 2.4, 3)]
    s = advise.summary(rows)
    assert s["cells"] == 3 and s["fastest_hits"] == 1
    assert s["worst_pick_loss"] == pytest.approx(0.5)  # c: none at 3.0 against scatter at 2.0
    assert s["median_pick_loss"] == pytest.approx(0.25)
    assert [(m["model"], m["fastest"], m["picked"]) for m in s["misses"]] == [
        ("a", "twobit", "none"), ("c", "scatter", "none")]
    assert s["misses"][0]["pick_loss"] == pytest.approx(0.25)


def test_close_calls_are_the_methods_within_the_margin_of_the_fastest():
    steps = {"none": 1.00, "fp16": 0.95, "twobit": 0.90, "auto": 0.989, "scatter": 0.991}
    assert steptime.close_calls(steps) == ["twobit", "fp16", "auto"]  # 0.90 x 1.1 = 0.99
    assert steptime.close_calls(steps, margin=0.0) == ["twobit"]
    assert steptime.close_calls({"none": 2.0}) == ["none"]


def test_the_advisor_names_the_close_calls(capsys):
    """The fastest method and every method within CLOSE_CALL of it, in the table's terms and in
    the JSON; PowerSGD, a reference point only, is never one of them."""
    args = ["--params", "25.6M", "--step-ms", "120", "--workers", "64", "--rate", "25gbit",
            "--profile", "h100-bound"]
    out = json.loads(run(args + ["--json"], capsys))
    steps = {m: r["step_s"] for m, r in out["methods"].items() if m != "powersgd"}
    best = min(steps, key=steps.get)
    assert out["close_calls"][0] == best
    assert set(out["close_calls"]) == {m for m, s in steps.items()
                                       if s <= steps[best] * (1 + steptime.CLOSE_CALL)}
    assert len(out["close_calls"]) > 1  # this case has some: the test sees the list
    assert "powersgd" not in out["close_calls"]
    text = run(args, capsys)
    line = next(l for l in text.splitlines() if l.startswith("Fastest predicted:"))
    assert line.startswith("Fastest predicted: %s." % steptime.LABELS[best])
    for m in out["close_calls"][1:]:
        assert steptime.LABELS[m] in line


def test_summary_counts_the_cells_whose_fastest_is_a_close_call():
    def row(cell, method, measured, predicted):
        return {"source": "s", "model": cell, "rate": "1gbit", "hosts": 4, "method": method,
                "measured_s": measured, "predicted_s": predicted,
                "error": predicted / measured - 1}
    rows = [row("a", "none", 1.0, 0.90), row("a", "twobit", 0.8, 0.95),  # within 10 %: named
            row("b", "none", 1.0, 0.90), row("b", "twobit", 0.8, 1.00),  # 11 % away: not
            row("c", "none", 2.0, 2.00), row("c", "twobit", 1.0, 1.10)]  # picked right
    s = advise.summary(rows)
    assert s["fastest_hits"] == 1 and s["close_call_hits"] == 2
    assert s["close_call_size"] == pytest.approx(4 / 3)
