"""The codec's Triton kernels compiled for NVIDIA GPUs on a machine without one: what the GPU's
compiler makes of them, where the interpreter (tests/workers/triton_codec.py) runs NumPy's
arithmetic instead.

``python -O triton_compile.py [--arch 90,80] [--table] [CASE...]`` (``-O``: the cases' own asserts
off; ``--table``: one markdown table instead of the rows; ``--host-cost``: instead, what the
codec's calls cost the host, launches stopped at the driver) drives the interpreter test's cases
(``triton_codec.CASES``; default: its fast ones) through the codec's own entry points with the
Triton path forced and ``TRITON_INTERPRET`` unset. A stand-in for Triton's driver names the
targets; each kernel specialization the cases launch is compiled by Triton's real NVIDIA
back-end (LLVM, then the ``ptxas`` its wheel ships) for every target, and not launched. Nothing
is computed, so the cases' comparisons are switched off here (their results are the interpreter
test's and, on a GPU, ``test_cuda_kernels_match_reference``'s).

It prints one JSON line per (kernel, specialization, target): the kernel, the architecture, the
Triton version that compiled it, its constexprs, the dtypes of its pointers, registers, spilled
bytes (``ptxas``' local memory), shared memory, and the PTX's counts of the instructions that
decide its bits and its speed: FMAs, float32 and float64 divisions by kind, vector loads,
barriers (in all, and the most in one pass of a loop). A line ``{"error": ...}`` where a case or
a compilation failed.
"""

import json
import os
import re
import subprocess
import sys
import tempfile
import time
import traceback

assert os.environ.get("TRITON_INTERPRET") != "1", "compiling needs TRITON_INTERPRET unset"
os.environ["HOROVOD_TWOBIT_TRITON"] = "force"
os.environ.setdefault("HOROVOD_TWOBIT_COMPILE", "0")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import triton  # noqa: E402
from triton import knobs  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource, make_backend  # noqa: E402
from triton.runtime.driver import driver  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

# PTX instructions counted, by name: a pattern over the PTX text
COUNTED = {
    "fma_f32": r"\bfma\.rn(\.ftz)?\.f32\b",
    "fma_f64": r"\bfma\.rn\.f64\b",
    "div_rn_f32": r"\bdiv\.rn(\.ftz)?\.f32\b",
    "div_approx_f32": r"\bdiv\.(full|approx)(\.ftz)?\.f32\b",
    "div_rn_f64": r"\bdiv\.rn\.f64\b",
    "rcp_approx": r"\brcp\.approx",
    "ld_global_v4": r"\bld\.global(\.\w+)*\.v4\.",
    "ld_global_v2": r"\bld\.global(\.\w+)*\.v2\.",
    "ld_global": r"\bld\.global\b",
    "ld_global_b32": r"\bld\.global(\.(?!v\d)\w+)*\.b32\b",  # one 32-bit word a thread
    "ld_global_b8": r"\bld\.global(\.(?!v\d)\w+)*\.[bu]8\b",
    "st_global_v4": r"\bst\.global(\.\w+)*\.v4\.",
    "bar_sync": r"\bbar\.sync\b|\bbarrier\.sync\b",
    "atom": r"\batom\.",
    "cvt_rn_f16_f32": r"\bcvt\.rn\.f16\.f32\b",
    "cvt_rn_bf16_f32": r"\bcvt\.rn\.bf16\.f32\b",
}


class _Driver:
    """Triton's view of a device, without one: device 0 of the current target, stream 0."""

    def __init__(self, target):
        self.target = target

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return self.target

    def get_active_torch_device(self):
        return torch.device("cpu")


def loop_barriers(ptx):
    """The most barriers in one pass of any loop of the PTX: those between a loop's header
    label and the last branch back to it."""
    lines = ptx.splitlines()
    most = 0
    for i, line in enumerate(lines):
        if "Loop Header" in line and ":" in line:
            label = line.split(":")[0].strip()
            back = [j for j in range(i + 1, len(lines))
                    if re.search(r"\bbra(\.uni)?\s+%s;" % re.escape(label), lines[j])]
            if back:
                most = max(most, sum(bool(re.search(COUNTED["bar_sync"], x))
                                     for x in lines[i:back[-1]]))
    return most


def _resources(cubin, tool):
    """{"regs", "spill_bytes", "shared_bytes"} of a cubin, from cuobjdump's resource usage."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True,
                             text=True, check=True).stdout
    field = lambda name: int(re.search(r"\b%s:(\d+)" % name, out).group(1))
    return {"regs": field("REG"), "spill_bytes": field("LOCAL"), "shared_bytes": field("SHARED")}


class Compiler:
    """A ``jit_cache_hook`` that compiles each new specialization for every target (``archs``)
    and skips the launch, printing what it found."""

    def __init__(self, archs):
        self.targets = [GPUTarget("cuda", a, 32) for a in archs]
        self.backends = {t.arch: make_backend(t) for t in self.targets}
        self.seen = set()
        self.rows = []
        from triton.backends.nvidia import compiler as nv
        self.cuobjdump = os.path.join(os.path.dirname(nv.__file__), "bin", "cuobjdump")

    def __call__(self, key, repr, fn, compile, is_manual_warmup, already_compiled):
        jf = fn.jit_function
        spec = (fn.name, str(key))
        if spec in self.seen:
            return True
        self.seen.add(spec)
        sig = compile["signature"]
        consts = {jf.arg_names[k[0]]: (v.value if hasattr(v, "value") else v)
                  for k, v in compile["constants"].items() if len(k) == 1}
        consts = {k: v for k, v in consts.items() if sig.get(k) == "constexpr"}
        opts = {k: compile[k] for k in ("num_warps", "num_ctas", "num_stages", "enable_fp_fusion")}
        for target in self.targets:
            row = {"kernel": fn.name, "module": jf.module, "arch": target.arch,
                   "triton": triton.__version__, "constexprs": consts,
                   "pointers": {k: v for k, v in sig.items() if v.startswith("*")},
                   "enable_fp_fusion": opts["enable_fp_fusion"], "num_warps": opts["num_warps"]}
            t0 = time.time()
            try:
                src = ASTSource(jf, sig, compile["constants"], compile["configs"][0])
                k = triton.compile(src, target=target, options=opts)
            except Exception:
                row["error"] = traceback.format_exc()[-3000:]
                self.emit(row)
                continue
            row["seconds"] = round(time.time() - t0, 2)
            ptx = k.asm["ptx"]
            row.update({name: len(re.findall(pat, ptx)) for name, pat in COUNTED.items()})
            row["loop_bar_sync"] = loop_barriers(ptx)
            row.update(_resources(k.asm["cubin"], self.cuobjdump))
            self.emit(row)
        return True  # compiled: not launched

    def emit(self, row):
        self.rows.append(row)
        print(json.dumps(row), flush=True)


def table(rows):
    """Markdown: per kernel and architecture, the range over its specializations of what the
    compiler made of it."""
    groups = {}
    for r in rows:
        if "error" not in r and r.get("module", "").endswith("triton_kernels"):
            groups.setdefault((r["kernel"], r["arch"]), []).append(r)
    cols = [("regs", "registers"), ("spill_bytes", "spilled bytes"), ("bar_sync", "barriers"),
            ("loop_bar_sync", "barriers a loop pass"),
            ("ld_global_v4", "vector loads"), ("div_rn_f32", "div.rn.f32"),
            ("div_approx_f32", "approx. div"), ("fma_f32", "FMA")]
    out = ["| kernel | sm | specializations | " + " | ".join(c for _, c in cols) + " |",
           "|---|---|---:|" + "---:|" * len(cols)]
    for (name, arch), rs in sorted(groups.items()):
        cells = []
        for key, _ in cols:
            lo, hi = min(r[key] for r in rs), max(r[key] for r in rs)
            cells.append("%d" % lo if lo == hi else "%d-%d" % (lo, hi))
        out.append("| `%s` | %d | %d | %s |" % (name, arch, len(rs), " | ".join(cells)))
    return "\n".join(out)


class _NoLaunch:
    """A compiled kernel that launches nothing (the host's side of a launch, timed alone)."""
    function = packed_metadata = None

    def launch_metadata(self, *args):
        return None

    def run(self, *args):
        pass


def host_cost(calls=500):
    """Markdown: what the codec's calls cost the host on Triton's path, each kernel launch
    stopped where Triton hands it to the driver (which adds a few us a launch on a GPU): the
    Python of the codec and of Triton's dispatch, the header copies, the payload checks."""
    import torch
    from triton.runtime import jit
    from horovod_twobit import wire
    from horovod_twobit.torch import codec
    from horovod_twobit.wire.layout import Layout

    def no_compile(self, key, signature, device, constexprs, options, attrs, warmup):
        kernel = self.device_caches[device][0][key] = _NoLaunch()
        return kernel
    jit.JITFunction._do_compile = no_compile
    out = ["| tensors | threshold | encode (us) | finish, 2 ranks (us) | finish, 8 ranks (us) |",
           "|---|---|---:|---:|---:|"]
    for label, sizes in (("1 M values alone", [1 << 20]),
                         ("a 4 MiB bucket of 64 tensors", [16384] * 64)):
        for threshold in (0.5, "auto"):
            lay = Layout(sizes, threshold == "auto", *wire.validate_blocks(threshold))
            names = ["t%d" % i for i in range(lay.members)]
            r, g = torch.zeros(lay.values), torch.randn(lay.values)
            p = torch.zeros(lay.payload_words, dtype=torch.int32)

            def timed(fn):  # the best of 5 batches' mean: the host's own cost, not its noise
                for _ in range(10):
                    fn()
                best = float("inf")
                for _ in range(5):
                    t0 = time.perf_counter()
                    for _ in range(calls // 5):
                        fn()
                    best = min(best, (time.perf_counter() - t0) / (calls // 5) * 1e6)
                return best
            enc = timed(lambda: codec.encode_payload(lay, r, g, threshold, "lsq", p))
            t, v = codec.encode_payload(lay, r, g, threshold, "lsq", p)
            fin = []
            for n in (2, 8):
                gathered = p.repeat(n)
                fin.append(timed(lambda: codec.finish_payload(lay, gathered, n, names, r, g, t, v,
                                                              n, 1.0)))
            out.append("| %s | %s | %.0f | %.0f | %.0f |" % (label, threshold, enc, *fin))
    return "\n".join(out)


def main(argv):
    if __debug__:
        sys.exit("run with python -O: the cases' asserts of results are off here")
    archs = [90, 80]
    as_table = "--table" in argv
    argv = [a for a in argv if a != "--table"]
    if argv[:1] == ["--arch"]:
        archs, argv = [int(a) for a in argv[1].split(",")], argv[2:]
    if "--host-cost" in argv:
        driver.set_active(_Driver(GPUTarget("cuda", archs[0], 32)))
        print(host_cost())
        return 0
    import triton_codec
    names = argv or triton_codec.FAST
    compiler = Compiler(archs)
    driver.set_active(_Driver(compiler.targets[0]))
    knobs.runtime.jit_cache_hook = compiler
    # nothing runs: the cases' checks of results are off (their bits are the interpreter
    # test's); the payloads and results they see are whatever the buffers held
    np.testing.assert_array_equal = lambda *a, **k: None
    # no kernel runs, so no payload holds a NaN/Inf flag: each finish also compiles its
    # specialization for a flagged member
    from horovod_twobit.torch.codec import triton_kernels as tk
    finish = tk.finish_payload

    def finish_both(layout, on, gathered, nranks, bad, *args, **kwargs):
        if not any(bad):
            finish(layout, on, gathered, nranks, [True] + list(bad[1:]), *args, **kwargs)
        return finish(layout, on, gathered, nranks, bad, *args, **kwargs)
    tk.finish_payload = finish_both
    if as_table:
        compiler.emit = compiler.rows.append
    for name in names:
        try:
            triton_codec.CASES[name]()
        except Exception:
            print(json.dumps({"case": name, "error": traceback.format_exc()[-3000:]}), flush=True)
    if as_table:
        print(table(compiler.rows))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
