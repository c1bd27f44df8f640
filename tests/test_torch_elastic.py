"""Elastic Horovod: residuals are committed, restored and reset consistently on all ranks."""

import json
import os
import stat
import subprocess
import sys
import time

import pytest

import jobs


@pytest.mark.slow
@pytest.mark.parametrize("exchange", ["allgather", "scatter"])
def test_worker_added_then_removed(tmp_path, exchange):
    hosts = tmp_path / "hosts"
    hosts.write_text("localhost:2\n")
    discover = tmp_path / "discover.sh"
    discover.write_text("#!/bin/sh\ncat %s\n" % hosts)
    discover.chmod(discover.stat().st_mode | stat.S_IEXEC)
    cmd = [jobs.horovodrun(), "-np", "2", "--min-np", "1", "--max-np", "3", "--gloo",
           "--host-discovery-script", str(discover), "--elastic-timeout", "60",
           "--network-interface", "lo",
           sys.executable, os.path.join(jobs.WORKERS, "torch_elastic.py"), str(hosts), str(tmp_path)]
    cmd += ["scatter"] if exchange == "scatter" else []
    t0 = time.time()
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          env=jobs.job_env(), timeout=400)
    assert proc.returncode == 0, proc.stdout[-6000:]
    events = [json.loads(l) for l in (tmp_path / "log.jsonl").read_text().splitlines()]
    steps = [e for e in events if e["event"] == "step"]
    sizes = [e["size"] for e in steps]
    assert 3 in sizes and sizes[-1] == 2 and sizes[0] == 2, sizes
    assert all(e["same"] for e in steps), "weights differ across ranks"
    # at each (re)synchronization a worker that was there keeps its residuals, a new one has none
    syncs = [e for e in events if e["event"] == "sync"]
    assert {e["size"] for e in syncs} == {2, 3}, syncs
    for e in syncs:
        before = [s for s in steps if s["rank"] == e["rank"] and s["step"] == e["step"] - 1]
        if e["step"] == 0 or not before:  # the first sync, or a worker that has just joined
            assert e["residual_norm"] == 0, e
        else:
            assert e["residual_norm"] == before[-1]["residual_norm"] > 0, (e, before)
    assert any(e["step"] > 0 and e["residual_norm"] > 0 for e in syncs)
    if exchange == "scatter":  # owners' residuals belong to the (rank, size) of their step
        assert all(tuple(e["owner_of"]) == (e["rank"], e["size"]) for e in steps)
        assert any(sum(e["owners"].values()) > 0 for e in steps)
        resets = [e for e in events if e["event"] == "warning" and "owners' residuals" in e["text"]]
        assert {e["size"] for e in resets} == {2, 3}, resets  # the worker added, then removed
    assert time.time() - t0 < 400
