"""The stats reach TensorBoard: examples/stats_tensorboard.py trains with 2 ranks and writes the
compressor's stats; the real ``tensorboard`` serves the logs, and its HTTP API gives the scalars
back. With ``--ddp`` (DDP's 2-bit hook under torchrun) the same scalars are in the event file
(read with TensorBoard's own reader)."""

import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

import jobs

pytestmark = pytest.mark.slow
EXAMPLES = os.path.join(os.path.dirname(jobs.HERE), "examples")


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(port, path):
    with urllib.request.urlopen("http://127.0.0.1:%d%s" % (port, path), timeout=10) as r:
        return json.loads(r.read())


def test_stats_on_tensorboard(tmp_path):
    logdir = tmp_path / "tb"
    res = jobs.run(2, os.path.join(EXAMPLES, "stats_tensorboard.py"), "--logdir", logdir,
                   "--epochs", 2, "--every", 5, timeout=300)
    m = re.search(r"stats written to .* \((\d+) steps\)", res.output)
    assert m and "% of values" in res.output, res
    steps = int(m.group(1))
    port = _free_port()
    exe = os.path.join(os.path.dirname(sys.executable), "tensorboard")
    proc = subprocess.Popen([exe, "--logdir", str(logdir), "--host", "127.0.0.1", "--port",
                             str(port), "--load_fast", "false", "--reload_interval", "1"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        tags, deadline = {}, time.time() + 90
        while time.time() < deadline and "twobit/fraction_sent" not in str(tags):
            time.sleep(1)
            if proc.poll() is not None:
                pytest.fail("tensorboard exited: %s" % proc.stdout.read()[-3000:])
            try:
                tags = _get(port, "/data/plugin/scalars/tags")
            except OSError:
                continue
        assert "twobit/fraction_sent" in str(tags), tags
        (run,) = tags  # one run: the logdir itself
        for tag in ("twobit/fraction_sent", "twobit/threshold", "twobit/bytes_last_step/allgather",
                    "twobit/nonfinite_steps"):
            assert tag in tags[run], sorted(tags[run])
        points = _get(port, "/data/plugin/scalars/scalars?run=%s&tag=twobit/fraction_sent"
                      % urllib.request.quote(run))
        # [wall time, step, value]: every 5 steps
        assert [p[1] for p in points] == list(range(5, steps + 1, 5)), points
        assert all(0 < p[2] < 1 for p in points), points
        nbytes = _get(port, "/data/plugin/scalars/scalars?run=%s&tag=twobit/bytes_last_step/"
                      "allgather" % urllib.request.quote(run))
        assert len({p[2] for p in nbytes}) == 1 and nbytes[0][2] > 0, nbytes
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_ddp_stats_on_tensorboard(tmp_path):
    """--ddp: DDP's 2-bit hook under torchrun (2 ranks, the scatter exchange) writes the same
    scalars; read back from the event file with TensorBoard's own reader."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    logdir = tmp_path / "tb"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           os.path.join(EXAMPLES, "stats_tensorboard.py"), "--ddp", "--exchange", "scatter",
           "--logdir", str(logdir), "--epochs", "1", "--every", "5"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=str(tmp_path),
                         env=jobs.job_env())
    m = re.search(r"stats written to .* \((\d+) steps\)", res.stdout)
    assert res.returncode == 0 and m, res.stdout[-3000:] + res.stderr[-3000:]
    events = EventAccumulator(str(logdir))
    events.Reload()
    tags = events.Tags()["scalars"]
    for tag in ("twobit/fraction_sent", "twobit/threshold", "twobit/bytes_last_step/scatter",
                "twobit/bytes_total/scatter", "twobit/nonfinite_steps"):
        assert tag in tags, sorted(tags)
    assert any(t.startswith("twobit/bucket/") and t.endswith("/residual_l2") for t in tags), tags
    points = events.Scalars("twobit/fraction_sent")
    assert [p.step for p in points] == list(range(5, int(m.group(1)) + 1, 5)), points
    assert all(0 < p.value < 1 for p in points), points
    nbytes = {p.value for p in events.Scalars("twobit/bytes_last_step/scatter")}
    assert len(nbytes) == 1 and nbytes.pop() > 0
    assert {p.value for p in events.Scalars("twobit/bytes_last_step/allgather")} == {0}
