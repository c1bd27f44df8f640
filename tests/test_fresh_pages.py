"""The step-time model's pages first touched per step: buffers of at least 32 MiB that a step
allocates anew (fp16's float16 copy and float32 result, TwoBit's gathered payloads) are mapped
fresh and zero-filled by the kernel every step; the model charges them at the profile's
``page_s``, and the calibration measures it."""

import json
import platform
import subprocess
import sys

import pytest

from horovod_twobit.advisor import timing as calibrate_timing
from horovod_twobit.model import steptime
from horovod_twobit.model.units import FRESH_MAP_BYTES, PAGE_BYTES, fresh_pages

CPU = steptime.load_profile("cpu")
BIG = 1 << 24  # values: a 64 MiB float32 tensor, its float16 copy exactly 32 MiB


def with_page(page_s):
    prof = json.loads(json.dumps(CPU))
    prof["page_s"] = page_s
    return prof


def test_fresh_pages_from_32_mib_up():
    assert FRESH_MAP_BYTES == 32 << 20 and PAGE_BYTES == 4096  # glibc on 64-bit; x86-64's page
    assert fresh_pages((32 << 20) - 1) == 0
    assert fresh_pages(32 << 20) == 8192
    assert fresh_pages((32 << 20) + 1) == 8193
    assert fresh_pages(0) == 0


@pytest.mark.parametrize("method,nranks,pages", [
    ("fp16", 4, (2 * BIG + 4 * BIG) // PAGE_BYTES),   # the float16 copy and the float32 result
    ("none", 4, 0),                                   # allreduced in place
    ("twobit", 4, 0),                                 # 4 payloads of 4 MiB: 16 MiB gathered
    ("twobit", 8, None),                              # 8 payloads: at least 32 MiB gathered
    ("scatter", 8, 0),                                # the scatter exchange keeps its buffers
])
def test_the_model_charges_each_page_a_step_maps_fresh(method, nranks, pages):
    sizes = [BIG, 4096]
    without = steptime.predict(sizes, method, nranks, "1gbit", 0.1, with_page(0.0))
    page_s = 1e-6
    charged = steptime.predict(sizes, method, nranks, "1gbit", 0.1, with_page(page_s))
    if pages is None:  # the gathered payloads, as the allgather's output holds them
        big = max(steptime.units(sizes, method, nranks, CPU, None), key=lambda u: u.values)
        pages = fresh_pages(nranks * big.bytes)
        assert pages > FRESH_MAP_BYTES // PAGE_BYTES
    assert charged.parts["codec"] - without.parts["codec"] == pytest.approx(pages * page_s)
    assert charged.parts["cpu"] - without.parts["cpu"] == pytest.approx(pages * page_s)
    if pages:
        assert charged.step_s > without.step_s


def test_a_profile_without_page_s_charges_none():
    sizes = [BIG]
    assert "page_s" not in CPU
    for m in ("fp16", "twobit"):
        assert (steptime.predict(sizes, m, 8, "1gbit", 0.1, CPU).step_s
                == steptime.predict(sizes, m, 8, "1gbit", 0.1, with_page(0.0)).step_s)


# run in a fresh interpreter: what a buffer faults in depends on the heap's history (glibc
# raises its thresholds as big buffers are freed), which tests run before would have set
FAULTS = """
import json, resource, sys
import torch
import horovod.torch as hvd

def minor_faults(fn, rounds=3):
    fn()  # the heap's threshold grows on the first frees
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(rounds):
        fn()
    return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0) / rounds

out = {}
for nbytes in map(int, sys.argv[1:3]):
    out[nbytes] = minor_faults(lambda: torch.empty(nbytes, dtype=torch.uint8).fill_(1))
g = torch.ones(int(sys.argv[3]))

def fp16_round():
    half, ctx = hvd.Compression.fp16.compress(g)
    hvd.Compression.fp16.decompress(half, ctx)
out["fp16"] = minor_faults(fp16_round)
print(json.dumps(out))
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc thresholds")
def test_this_machine_maps_big_buffers_fresh_every_time():
    """What the model counts, against the kernel's count of pages first touched (in a fresh
    process): every buffer of at least 32 MiB, allocated, written and freed again and again,
    faults in all its pages each time, and so does Horovod's fp16 compression of a 16 M-value
    gradient (a float16 copy of 32 MiB, a float32 result of 64 MiB). Below 32 MiB what is
    faulted in again depends on the heap's history (its trim threshold); the model charges none
    of it."""
    sizes = (FRESH_MAP_BYTES, 2 * FRESH_MAP_BYTES + 4096)
    res = subprocess.run([sys.executable, "-c", FAULTS] + [str(n) for n in sizes] + [str(BIG)],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    faults = json.loads(res.stdout.strip().splitlines()[-1])
    for nbytes in sizes:
        assert fresh_pages(nbytes) <= faults[str(nbytes)] <= fresh_pages(nbytes) + 2
    pages = fresh_pages(2 * BIG) + fresh_pages(4 * BIG)
    assert pages == 6 * BIG // PAGE_BYTES
    assert pages <= faults["fp16"] <= pages + 4


def test_calibration_measures_a_page():
    per = calibrate_timing._time_per_value(1 << 16, 1)
    assert per["page_s"] > 0


def test_validate_sets_the_pages_against_the_faults_measured(tmp_path):
    from horovod_twobit.advisor import validate

    def row(method, real, faults):
        return {"model": "m", "method": method, "rate": "1gbit", "failed": False,
                "real_step_s": real, "compute_s": 0.1, "faults_per_step": faults}
    path = tmp_path / "bench_cluster.json"
    path.write_text(json.dumps({"args": {"hosts": 4}, "results": [
        row("none", 0.5, 3.0), row("fp16", 0.6, 24578.0)]}))
    got = {r["method"]: r for r in validate.compare([str(path)], with_page(2e-6),
                                                    sizes_of=lambda model, args: [BIG])}
    assert got["fp16"]["faults_measured"] == 24578.0
    assert got["fp16"]["pages_predicted"] == 6 * BIG // PAGE_BYTES
    assert got["none"]["pages_predicted"] == 0 and got["none"]["faults_measured"] == 3.0
