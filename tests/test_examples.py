"""The examples users run: they work and print what they promise."""

import json
import os

import pytest

import jobs

EXAMPLES = os.path.join(os.path.dirname(jobs.HERE), "examples")


@pytest.mark.slow
def test_keras_demo_runs_and_plots(tmp_path):
    """The whole demo (15 epochs, about 20 s): both runs learn, TwoBit as well as uncompressed."""
    png = tmp_path / "plot.png"
    res = jobs.run(2, os.path.join(EXAMPLES, "digits_keras.py"), "--plot", png, timeout=300)
    jobs.check_demo_accuracies(res.output)
    assert png.stat().st_size > 1000, res


@pytest.mark.slow
def test_convergence_study_smoke(tmp_path):
    res = jobs.run(2, os.path.join(EXAMPLES, "convergence.py"), "--quick", "--models", "mlp,lstm",
                   "--optimizers", "momentum", "--methods", "none,fp16,auto,auto-opt/32:8@300",
                   "--lstm-steps", 4, "--eval-every", 2, "--out", tmp_path, timeout=300)
    results = json.loads((tmp_path / "results.json").read_text())
    methods = ("none", "fp16", "auto", "auto-opt/32:8@300")
    assert {(r["model"], r["method"]) for r in results} == {
        (m, k) for m in ("mlp", "lstm") for k in methods}
    mlp = {r["method"]: r for r in results if r["model"] == "mlp"}
    assert mlp["none"]["bytes"] == 2 * mlp["fp16"]["bytes"] > 14 * mlp["auto"]["bytes"]
    # the two bias vectors (256 and 10 values) of the MLP travel uncompressed; the two weight
    # matrices are cut into at most 8 blocks of at least 32 values: 2048 and 512 values
    from horovod_twobit import wire
    assert mlp["auto-opt/32:8@300"]["bytes"] == 4 * (256 + 10) + \
        wire.payload_bytes(64 * 256, 2048) + wire.payload_bytes(256 * 10, 512)
    # the defaults: blocks of at least 64 values, at most 64 blocks; 10 values are one block
    assert mlp["auto"]["bytes"] == wire.payload_bytes(64 * 256, 256) + wire.payload_bytes(256, 64) \
        + wire.payload_bytes(256 * 10, 64) + wire.payload_bytes(10)
    table = (tmp_path / "table.md").read_text()
    assert "| mlp (test acc) | momentum |" in table and "| bytes/step/rank (lstm) |" in table
    assert (tmp_path / "curves.png").stat().st_size > 1000, res


@pytest.mark.slow
def test_codec_benchmark_prints_every_row(tmp_path):
    """python examples/bench_codec.py: one table row per framework, size and path, with figures."""
    import subprocess
    import sys
    md = tmp_path / "codec.md"
    out = subprocess.run(
        [sys.executable, os.path.join(EXAMPLES, "bench_codec.py"), "--sizes", "1K,20000",
         "--device", "cpu", "--markdown", str(md)],
        capture_output=True, text=True, timeout=600, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"))
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [line.split("|")[1:-1] for line in md.read_text().splitlines()[2:]]
    assert {(r[0].strip(), r[2].strip(), r[3].strip()) for r in rows} == {
        (fw, size, path) for fw in ("torch", "tensorflow") for size in ("1K", "20000")
        for path in ("compiled", "eager")}
    for r in rows:
        assert all(float(c) > 0 for c in r[4:7]), r
    assert md.read_text() in out.stdout


@pytest.mark.slow
def test_bucket_benchmark_prints_every_row():
    """python -m examples.bench_buckets: a row per model with a figure for every method."""
    import subprocess
    import sys
    out = subprocess.run(
        [sys.executable, "-m", "examples.bench_buckets", "--frameworks", "torch", "--models",
         "cnn,transformer", "--methods", "none,twobit,twobit/alone", "--rounds", "1", "--steps", "2",
         "--warmup", "1"],
        cwd=os.path.dirname(EXAMPLES), capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    rows = [line for line in out.stdout.splitlines() if line.startswith("| cnn") or
            line.startswith("| transformer")]
    assert [r.split("|")[2].strip() for r in rows] == ["53", "99"], out.stdout
    for r in rows:
        assert r.count("x)") == 3, r


def test_count_entropy_measures_the_counts_a_scatter_owner_sends(capsys):
    """python -m examples.count_entropy: the summed counts' entropy, beside the format's bits."""
    import math
    import sys
    sys.path.insert(0, os.path.dirname(EXAMPLES))
    import torch
    from examples import count_entropy as ce
    from horovod_twobit.wire import scatter as sw
    assert ce.entropy(torch.tensor([0, 0, 1, -1])) == 1.5
    assert ce.entropy(torch.zeros(10, dtype=torch.int64)) == 0
    small = ["--steps", "2", "--skip", "0", "--mlp-in", "32", "--mlp-hidden", "64"]
    rows = ce.main(["--ranks", "2,3"] + small)
    assert [(n, b) for n, b, _ in rows] == [(2, sw.count_bits(2)), (3, sw.count_bits(3))]
    for n, _, h in rows:  # some counts differ from 0, and no code can beat log2(2N + 1) values
        assert 0 < h <= math.log2(2 * n + 1), rows
    table = capsys.readouterr().out
    assert "| 3 | 3 | %.2f | %.2f |" % (rows[1][2], 2 / 3 * 5) in table, table
    # a threshold no gradient reaches: every count is 0, nothing to send
    assert ce.main(["--ranks", "2", "--threshold", "1e6"] + small)[0][2] == 0


def test_step_benchmarks_refuse_one_rank():
    """On one rank Horovod's optimizers skip the allreduce and no compressor runs: bench_buckets
    (``--np 1``) and bench_stats (started without horovodrun) stop with the reason instead of
    timing the same uncompressed step for every method."""
    import subprocess
    import sys
    for args in (["examples.bench_buckets", "--frameworks", "torch", "--np", "1"],
                 ["examples.bench_stats", "--framework", "torch", "--rounds", "1"]):
        out = subprocess.run([sys.executable, "-m"] + args, cwd=os.path.dirname(EXAMPLES),
                             capture_output=True, text=True, timeout=600)
        assert out.returncode != 0 and "2 ranks or more" in out.stderr, \
            (out.stdout + out.stderr)[-2000:]
        assert "median" not in out.stdout


def test_bucket_benchmark_mlp_has_52_tensors_in_both_frameworks():
    """examples.bench_buckets --models mlp: the same 52 parameter tensors in PyTorch and Keras;
    an unknown model is refused."""
    import sys
    sys.path.insert(0, os.path.dirname(EXAMPLES))
    from examples import bench_buckets as bb
    net, data, _ = bb.torch_model("mlp")
    assert len(list(net.parameters())) == 52 and tuple(data(4).shape) == (4, 128)
    tf_net, tf_data = bb.tf_model("mlp")
    assert len(tf_net.trainable_variables) == 52 and tuple(tf_data(4).shape) == (4, 128)
    assert sum(p.numel() for p in net.parameters()) == tf_net.count_params()
    with pytest.raises(ValueError, match="unknown model"):
        bb.tf_model("resnet")


@pytest.mark.slow
def test_time_to_accuracy_trains_both_frameworks_and_reports(tmp_path):
    """examples/time_to_accuracy.py: the Horovod methods under horovodrun and DDP's under
    torchrun train the same models on the same data (at 2 ranks DDP without a hook gives
    Horovod fp32's curve, and the 2-bit hook Horovod TwoBit "auto"'s, bit for bit); the report
    takes each method's steps to fp32's figure times its step on the cluster."""
    import subprocess
    import sys
    script = os.path.join(EXAMPLES, "time_to_accuracy.py")
    jobs.run(2, script, "train", "--quick", "--methods", "none,auto", "--out", tmp_path,
             timeout=300)
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                          "--nproc_per_node", "2", script, "train", "--quick", "--methods",
                          "ddp,ddp_twobit_auto", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=300, env=jobs.job_env())
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]

    def curve(model, method):
        return json.loads((tmp_path / ("curve-%s-%s.json" % (model, method))).read_text())

    for model in ("digits", "charlstm"):
        assert curve(model, "ddp")["curve"] == curve(model, "none")["curve"]
        assert curve(model, "ddp_twobit_auto")["curve"] == curve(model, "auto")["curve"]
    digits = curve("digits", "none")
    # 1,347 training images, every 2nd per rank, batches of 32: 22 steps an epoch, 2 epochs
    assert digits["steps_per_epoch"] == 22 and digits["curve"][-1][0] == 44
    assert digits["target_step"] == 22 and curve("charlstm", "none")["target_step"] == 10
    cluster = tmp_path / "bench_cluster.json"
    cluster.write_text(json.dumps({"results": [
        {"rate": "100mbit", "model": model, "method": method, "real_step_s": step,
         "bytes_per_step": 1000} for model in ("digits", "charlstm")
        for method, step in (("none", 0.5), ("auto", 0.25), ("ddp", 0.5),
                             ("ddp_twobit_auto", 0.25))]}))
    subprocess.run([sys.executable, script, "report", "--curves", str(tmp_path), "--cluster",
                    str(cluster), "--out", str(tmp_path)], check=True, timeout=300,
                   capture_output=True)
    res = json.loads((tmp_path / "time_to_accuracy.json").read_text())
    for model, higher in (("digits", True), ("charlstm", False)):
        target = [v for s, v in curve(model, "none")["curve"]
                  if s <= curve(model, "none")["target_step"]][-1]
        assert res[model]["target"] == target
        for row in res[model]["rows"]:
            first = next((s for s, v in curve(model, row["method"])["curve"]
                          if (v >= target if higher else v <= target)), None)
            assert row["steps"] == first
            step = 0.5 if row["method"] in ("none", "ddp") else 0.25
            assert row["rates"]["100mbit"]["time_s"] == (None if first is None else first * step)
    assert (tmp_path / "time_to_accuracy.png").stat().st_size > 1000
    assert "| Horovod fp32 |" in (tmp_path / "time_to_accuracy.md").read_text()
