"""examples/bench_collectives.py on a real virtual cluster: every collective kind and size it
lists is timed on every host and reported in real-host milliseconds."""

import json
import math
import os
import subprocess
import sys

import pytest

from horovod_twobit import cluster
from horovod_twobit.cluster import cpu

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, REPO)
from examples import bench_collectives  # noqa: E402

REASON = cluster.unavailable_reason()
if REASON is None and not cpu.backends():
    REASON = "no CPU cgroup hierarchy with CFS bandwidth control (cgroup v1 cpu or v2 cpu.max)"


def test_cases_fill_the_ring_from_2n_values():
    """The sizes the docs' table compares: one value, below and at N and 2N (every segment of
    Gloo's ring holds a value from 2N on), and the other kinds."""
    got = bench_collectives.cases(4)
    assert [v for k, v in got.values() if k == "allreduce"] == [1, 2, 4, 8, 256]
    assert got["allgather 64"] == ("allgather", 64)
    assert got["alltoall 16/peer"] == ("alltoall", 64)  # 16 to each of the 4 ranks


@pytest.mark.slow
@pytest.mark.skipif(REASON is not None, reason="virtual cluster unavailable: %s" % REASON)
@pytest.mark.timeout(600)
def test_every_case_is_timed_on_the_hosts(tmp_path):
    out = tmp_path / "collectives.json"
    res = subprocess.run([sys.executable, os.path.join(REPO, "examples", "bench_collectives.py"),
                          "--hosts", "2", "--rate", "1gbit", "--rounds", "3", "--iface", "hvdtc",
                          "--subnet", "10.77.6.0/24", "--json-out", str(out)],
                         cwd=REPO, capture_output=True, text=True, timeout=540)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    got = json.loads(out.read_text())
    assert got["hosts"] == 2 and got["rate"] == "1gbit"
    # 2 hosts at 0.8 cores each on this machine's cores: D = 1 / Q
    q = (os.cpu_count() or 1) * 0.8 / 2
    assert math.isclose(got["dilation"], 1 / q, rel_tol=1e-6)
    assert set(got["ms"]) == set(bench_collectives.cases(2))
    for name, ms in got["ms"].items():
        # a barrier-separated collective among two hosts: more than the links' latency, less
        # than a second of real-host time
        assert 0.01 < ms < 1000, (name, ms)
    for name in got["ms"]:
        assert name in res.stdout  # the printed table names every case
