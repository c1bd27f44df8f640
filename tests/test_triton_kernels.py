"""The codec's Triton kernels (horovod_twobit/torch/codec/triton_kernels.py), bit for bit against the
NumPy reference: on CPU tensors through Triton's interpreter (TRITON_INTERPRET=1 must be set
before a process starts, so tests/workers/triton_codec.py runs in a subprocess), and compiled on
a GPU where there is one. The worker drives the codec's own entry points with the Triton path
forced (HOROVOD_TWOBIT_TRITON=force), so what runs is the dispatch a CUDA tensor takes."""

import importlib.util
import json
import os
import re
import subprocess
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "workers", "triton_codec.py")

# Triton is found, never imported here: in the same process as TensorFlow's custom ops its LLVM
# crashes the process at exit (SIGSEGV after the last test). scripts/setup.sh installs it in
# its own directory beside the venv, which only the workers put on their path.
TRITON_SITE = os.path.join(sys.prefix, "triton-site")
HAVE_TRITON = (importlib.util.find_spec("triton") is not None
               or os.path.isdir(os.path.join(TRITON_SITE, "triton")))


# the oldest Triton the kernels support (compiled.TRITON_MIN), for their compile test alone
TRITON_MIN_SITE = os.path.join(sys.prefix, "triton-min-site")


def worker_env(env=None, site=TRITON_SITE):
    """The environment of a worker: Triton's directory (``site``) on its path."""
    out = dict(os.environ, **(env or {}))
    if os.path.isdir(site):
        out["PYTHONPATH"] = os.pathsep.join(p for p in (site, out.get("PYTHONPATH")) if p)
    return out
needs_triton = pytest.mark.skipif(not HAVE_TRITON, reason="Triton is not installed (scripts/setup.sh "
                                  "installs the version matching torch)")

sys.path.insert(0, os.path.join(HERE, "workers"))
import triton_codec  # noqa: E402

# small programs and chunks, so that a bucket spans many programs and a segment many chunks
INTERPRETER_ENV = {"TRITON_INTERPRET": "1", "HOROVOD_TWOBIT_TRITON": "force",
                   "HOROVOD_TWOBIT_COMPILE": "0", "HOROVOD_TWOBIT_TRITON_BLOCK_WORDS": "64",
                   "HOROVOD_TWOBIT_TRITON_CHUNK": "512", "PYTHONWARNINGS": "ignore"}


def run_worker(cases, env=None, device=None, timeout=900):
    """{case: row} of the worker's JSON lines for ``cases``."""
    return run_workers([cases], env, device, timeout)


def run_at_once(commands, timeout=900):
    """``(returncode, JSON lines, stderr)`` of each ``(argv, env)`` of ``commands``, all running
    at once in this directory (a worker keeps one core busy: two take half the time on two
    cores); what still runs after a failure is killed."""
    procs = [subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, cwd=HERE) for argv, env in commands]
    results = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=timeout)
            rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
            results.append((proc.returncode, rows, err))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return results


def run_workers(groups, env=None, device=None, timeout=900):
    """{case: row} of the JSON lines of one worker per group of cases, all running at once."""
    results = run_at_once([([sys.executable, WORKER] + (["--device", device] if device else [])
                            + list(cases), worker_env(env)) for cases in groups], timeout)
    rows = {}
    for cases, (rc, got, err) in zip(groups, results):
        assert got, "the worker of %s printed no result (rc %d):\n%s" % (cases, rc, err[-3000:])
        rows.update((row["case"], row) for row in got)
    return rows


# the fast cases in two workers of about equal time (26-27 s each on the 2-core VM)
FAST_GROUPS = [["auto_single", "nonfinite", "fixed_single", "auto_rules", "at_least"],
               ["auto_bucket", "half", "scatter", "fixed_bucket"]]
assert sorted(sum(FAST_GROUPS, [])) == sorted(triton_codec.FAST)


@pytest.fixture(scope="module")
def interpreted():
    return run_workers(FAST_GROUPS, INTERPRETER_ENV)


def _check(row):
    assert row["ok"], row["error"]
    assert row["triton"], "the Triton kernels did not run"


@needs_triton
@pytest.mark.parametrize("case", triton_codec.FAST)
def test_interpreted_kernels_match_reference(interpreted, case):
    """Each kernel (fixed and "auto" encode, finish, the owner's decode-sum) on CPU tensors
    through the interpreter: payload words, results and residuals are the reference's bits."""
    _check(interpreted[case])


@needs_triton
@pytest.mark.slow
def test_interpreted_kernels_auto_defaults():
    """threshold="auto" with its default blocks (many small segments), both exchanges."""
    rows = run_workers([["auto_defaults"], ["scatter_auto_defaults"]], INTERPRETER_ENV)
    assert sorted(rows) == ["auto_defaults", "scatter_auto_defaults"]
    for row in rows.values():
        _check(row)


@needs_triton
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_kernels_match_reference():
    """The same cases compiled on a GPU, against the reference and the torch ops (eager: the
    same bits as compiled, without a minute of Inductor compilations; the other CUDA tests
    check those)."""
    env = {"HOROVOD_TWOBIT_TRITON": "1", "HOROVOD_TWOBIT_COMPILE": "0"}
    for row in run_worker(list(triton_codec.CASES), env, device="cuda").values():
        _check(row)


PROBE = """
import sys, warnings, torch
from horovod_twobit.torch import codec
from horovod_twobit.torch.codec import compiled
from horovod_twobit.wire.layout import Layout
lay = Layout([40, 17], False)
r, g = torch.zeros(lay.values), torch.randn(lay.values)
p = torch.empty(lay.payload_words, dtype=torch.int32)
codec.encode_payload(lay, r, g, 0.5, "lsq", p)
with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    cuda = compiled.triton_path(torch.device("cuda"))
print(compiled.triton_path(torch.device("cpu")) is not None, cuda is not None,
      sys.modules.get("triton") is not None, len(w))
"""


# what stands in for Triton: none at all, or one older than the kernels compile with
HIDE = {"none": "import sys; sys.modules['triton'] = None\n",
        "old": "import sys, types; sys.modules['triton'] = types.ModuleType('triton'); "
               "sys.modules['triton'].__version__ = '3.3.1'\n"}


@pytest.mark.parametrize("setting,hide,want", [
    (None, None, "False True True 0"),  # CPU tensors: the torch path; CUDA: the kernels
    ("0", None, "False False False 0"),  # switched off: Triton never imported
    (None, "none", "False False False 1"),  # no Triton: the torch path, one warning
    (None, "old", "False False True 1"),  # Triton 3.3: the torch path, one warning
])
def test_dispatch(setting, hide, want):
    """Where the Triton kernels run: CUDA tensors, unless HOROVOD_TWOBIT_TRITON=0 or Triton does
    not import or is older than 3.4 (a warning, then the compiled torch ops); never CPU tensors
    but when forced. The codec imports and runs on a CPU without Triton."""
    if not HAVE_TRITON and not hide:
        pytest.skip("Triton is not installed")
    code = HIDE.get(hide, "") + PROBE
    if hide == "old":  # the warning names the fix, and the kernels' module was never imported
        code += ("assert \"pip install 'triton>=3.4'\" in str(w[0].message), w[0].message\n"
                 "assert 'horovod_twobit.torch.codec.triton_kernels' not in sys.modules\n"
                 "print('ok')\n")
        want = "%s\nok" % want
    env = worker_env({"HOROVOD_TWOBIT_COMPILE": "0"})
    env.pop("HOROVOD_TWOBIT_TRITON", None)
    if setting is not None:
        env["HOROVOD_TWOBIT_TRITON"] = setting
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.rstrip("\n").endswith(want), out.stdout


def test_triton_versions_the_kernels_take():
    from horovod_twobit.torch.codec import compiled
    assert compiled.TRITON_MIN == (3, 4)
    for v in ("3.4.0", "3.6.0", "3.7.1", "3.10.0", "4.0.0", "3.5.0+git8b1e2f3"):
        assert compiled.triton_supported(v), v
    for v in ("3.3.1", "3.0.0", "2.3.1", "", "unknown"):
        assert not compiled.triton_supported(v), v


COMPILER = os.path.join(HERE, "workers", "triton_compile.py")


@pytest.fixture(scope="module")
def compiled_for_gpus():
    """What Triton's NVIDIA back-end makes of every kernel specialization the interpreter cases
    launch, for sm_90 (H100, H200) and sm_80 (A100), without a GPU: one row per (kernel,
    specialization, architecture), for the Triton of torch 2.13 (``"current"``) and the oldest
    the kernels support (``"oldest"``, in its own directory), compiled at once (one core each)."""
    sites = {"current": TRITON_SITE, "oldest": TRITON_MIN_SITE}
    sites = {k: v for k, v in sites.items() if k == "current" or os.path.isdir(v)}
    envs = [worker_env({"HOROVOD_TWOBIT_COMPILE": "0", "PYTHONWARNINGS": "ignore"}, site)
            for site in sites.values()]
    for env in envs:
        env.pop("TRITON_INTERPRET", None)
    return dict(zip(sites, run_at_once([([sys.executable, "-O", COMPILER, "--arch", "90,80"], env)
                                        for env in envs], timeout=600)))


@needs_triton
@pytest.mark.parametrize("which", ["current", "oldest"])
def test_kernels_compile_for_gpus(compiled_for_gpus, which):
    """Every kernel the cases launch compiles for both architectures, with no FMA contraction,
    no approximate float32 division (the finish's / divisor is div.rn.f32), no spilled
    registers, no barrier inside a loop (the "auto" count pass had 56 a tile), and vector loads
    in the encode and the finish, for buckets and for lone tensors of any size; the
    flagged-member and bfloat16 finishes among them. With torch 2.13's Triton and with the
    oldest the codec takes (compiled.TRITON_MIN: older ones fall back to the compiled torch
    ops)."""
    from horovod_twobit.torch.codec import compiled
    if which not in compiled_for_gpus:
        pytest.fail("no Triton %d.%d in %s: scripts/setup.sh installs it there, run it"
                    % (compiled.TRITON_MIN + (TRITON_MIN_SITE,)))
    rc, rows, stderr = compiled_for_gpus[which]
    assert rc == 0 and rows, "rc %d:\n%s" % (rc, stderr[-3000:])
    versions = {r["triton"] for r in rows if "triton" in r}
    assert len(versions) == 1, versions
    major_minor = tuple(int(x) for x in versions.pop().split(".")[:2])
    if which == "oldest":
        assert major_minor == compiled.TRITON_MIN
    else:
        assert major_minor > compiled.TRITON_MIN
    errors = [r for r in rows if "error" in r]
    assert not errors, errors[0]["error"]
    rows = [r for r in rows if r["module"] == "horovod_twobit.torch.codec.triton_kernels"]
    kernels = {(r["kernel"], r["arch"]) for r in rows}
    for name in ("_encode_kernel", "_abs_sums_kernel", "_counts_kernel", "_levels_kernel",
                 "_auto_pack_kernel", "_decode_kernel"):
        assert {(name, 90), (name, 80)} <= kernels, name
    for r in rows:
        what = "%s sm_%d %s" % (r["kernel"], r["arch"], r["constexprs"])
        assert r["enable_fp_fusion"] is False, what
        assert r["fma_f32"] == r["fma_f64"] == 0, what
        assert r["div_approx_f32"] == r["rcp_approx"] == 0, what
        assert r["spill_bytes"] == 0, what
        if r["kernel"] == "_decode_kernel" and r["constexprs"].get("DIVIDE"):
            assert r["div_rn_f32"] > 0, what
        assert r["loop_bar_sync"] == 0, what  # no block-wide reduction inside a loop
    decodes = [r["constexprs"] for r in rows if r["kernel"] == "_decode_kernel"]
    assert any(c.get("CHECK_BAD") for c in decodes) and any(c.get("BF16") for c in decodes)
    # the encode and the finish read r and g in vectors, lone tensors of any size included (all
    # but a tensor's last program; the cases' lone tensors are not multiples of 16), but a
    # tensor of one value (its size a constant)
    for name, n in (("_encode_kernel", "n"), ("_decode_kernel", "nvalues")):
        whole = [r for r in rows if r["kernel"] == name and r["pointers"]["g_ptr"] == "*fp32"
                 and r["constexprs"].get("COMMIT", True) and n not in r["constexprs"]]
        assert whole and all(r["ld_global_v4"] > 0 for r in whole), (name, whole)
    assert any(not r["constexprs"]["BUCKET"] and "n" not in r["constexprs"] for r in rows
               if r["kernel"] == "_encode_kernel")  # a lone tensor's encode among them
    # "auto": a chunk of whole words reads r and g in vectors, one that ends inside a word
    # value by value (its masks differ within a vector), and the pack a word's 16 bytes at once
    for name in ("_abs_sums_kernel", "_counts_kernel"):
        for r in (r for r in rows if r["kernel"] == name and r["pointers"]["g_ptr"] == "*fp32"):
            assert r["ld_global_v4"] >= 2 and r["ld_global_b32"] >= 8, (name, r)
    for r in (r for r in rows if r["kernel"] == "_auto_pack_kernel"):
        assert r["ld_global_b8"] == 0 and r["ld_global_v4"] > 0, r  # a word's bytes in one load


GPU_CHECK = os.path.join(os.path.dirname(HERE), "scripts", "gpu_check.sh")
# each part's own limit and the minimum it keeps for the parts after it (scripts/gpu_check.sh)
GPU_CHECK_PARTS = {"1. CUDA tests": (150, 175), "2. codec benchmark": (170, 115),
                   "3. advise calibrate": (150, 75), "4. DDP's 2-bit hook": (240, 0)}


@needs_triton
@pytest.mark.slow
def test_the_device_check_rehearses_on_the_cpu(tmp_path):
    """scripts/gpu_check.sh, the one call a lent GPU gets, rehearsed end to end on CPU tensors
    (GPU_CHECK_DEVICE=cpu: Triton's interpreter, tiny sizes, Horovod's import-only stand-in
    forced, so the codec's test files import as on a machine without a Horovod build, and the
    CUDA tests skip): every part runs and has its row in the table and in summary.md; the
    benchmark (part 2) has every row of both paths and thresholds in its table and JSON; the
    calibrated profile loads and the advisor runs on it and on the shipped h200 profile; and the
    parts' limits come from the shared deadline (a budget of 240 s shortens the first part's
    150 s to what the later parts' minimums leave)."""
    budget = 240
    env = dict(os.environ, GPU_CHECK_DEVICE="cpu", GPU_CHECK_OUT=str(tmp_path),
               GPU_CHECK_BUDGET=str(budget))
    proc = subprocess.run(["bash", GPU_CHECK], env=env, capture_output=True, text=True,
                          timeout=600, cwd=os.path.dirname(HERE))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    log = proc.stdout
    assert "Horovod's import-only stand-in is on PYTHONPATH" in log
    for part, (limit, reserve) in GPU_CHECK_PARTS.items():
        m = re.search(r"\[gpu_check +(\d+)s\] %s.*up to (\d+) s\)" % re.escape(part), log)
        assert m, (part, log)
        start, got = int(m.group(1)), int(m.group(2))
        # the limit is taken first, then the line's time: the clock may tick between them, so
        # the line's time may be a second later than the limit's
        assert min(limit, budget - start - reserve) <= got <= min(limit, budget - start - reserve + 1)
    assert "1. CUDA tests (up to 150 s)" not in log  # the deadline shortened it
    rows = dict(line.split(" | ")[:2] for line in (tmp_path / "summary.md").read_text().splitlines())
    assert list(rows) == ["| CUDA tests", "| codec benchmark", "| calibrate",
                          "| advisor, h200 then this device's profile", "| DDP hook on the GPU"]
    assert "skipped" in rows["| CUDA tests"] and "failed" not in rows["| CUDA tests"]
    assert rows["| codec benchmark"] == "ok, 16 rows" and rows["| calibrate"] == "ok"
    assert rows["| advisor, h200 then this device's profile"] == "4 runs, 0 errors"
    assert "skipped" in rows["| DDP hook on the GPU"]
    assert log.count("| CUDA tests |") == 1 and "| DDP hook on the GPU |" in log  # the table
    from horovod_twobit.model import steptime
    prof = steptime.load_profile(str(tmp_path / "gpu-triton.json"))
    assert prof["codec_by_size"]["sizes"] == [4096]
    advice = (tmp_path / "advise.txt").read_text()
    assert advice.count("### profile") == 4 and "Traceback" not in advice
    got = json.loads((tmp_path / "bench.json").read_text())
    want = {(p, t) for p in ("triton", "torch") for t in (0.5, "auto")}
    for kind, keys in (("tensor", ("encode", "finish2", "finish8", "owner8", "probe")),
                       ("model", ("step2", "step8", "probe"))):
        assert {(r["path"], r["threshold"]) for r in got[kind]} == want, got[kind]
        for r in got[kind]:
            assert all(0 < r[k] < 60 for k in keys), r
    table = log[log.rindex("| rows |"):]  # the one table's (part 2 printed it too)
    assert table.count("| tensor | 1K |") == 4 and table.count("| model | 6K |") == 4, table
