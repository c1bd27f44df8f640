#!/usr/bin/env bash
# The codec on one GPU, in one call of about 5 minutes: a machine with one NVIDIA GPU and torch
# with CUDA (which brings Triton); no Horovod build needed (where `import horovod.torch` fails,
# an import-only stand-in lets the codec's tests import; nothing calls it). From the repository
# root:
#
#   bash scripts/gpu_check.sh            # results under build/gpu_check/ (GPU_CHECK_OUT=DIR)
#
# 1. the CUDA tests (`-k "cuda or gpu"` over the codec's test files: the Triton kernels against
#    the NumPy reference and the compiled torch ops, and the existing CUDA tests, which now run
#    on the Triton kernels);
# 2. scripts/gpu_codec_bench.py: encode, finish (2 and 8 ranks), the scatter owner's reduce, at
#    1 M / 16 M / 64 M / 256 M values, fixed and "auto", Triton and the compiled torch ops,
#    against the same run's probe; one step's codec for a 25 M-value model in 4 MiB buckets;
# 3. `python -m horovod_twobit.advise calibrate --device cuda` into a profile of this GPU with
#    the Triton kernels, and the advisor's ResNet-50 projection (64 workers, 25 Gbit/s) and
#    worker counts 8-1024 with it and with the shipped h200 profile (before);
# 4. DDP's 2-bit hook on the GPU: tests/test_ddp.py's CUDA jobs (2 torchrun processes on the one
#    GPU, gloo with CUDA tensors: every step bit for bit against the NumPy reference, a fault
#    included; a short training run whose losses follow the same run on the CPU);
# then one table of everything. Each part has its own time limit, and a part that fails does not
# stop the others; the exit status is that of the tests (1, then 4).
set -uo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
OUT="${GPU_CHECK_OUT:-$REPO/build/gpu_check}"
mkdir -p "$OUT"
if [ -n "${PYTHON:-}" ]; then PY="$PYTHON"
elif [ -x "$REPO/.venv/bin/python" ]; then PY="$REPO/.venv/bin/python"
else PY=python3; fi
T0=$(date +%s)
say() { printf '[gpu_check %4ss] %s\n' "$(( $(date +%s) - T0 ))" "$*"; }

say "python: $PY"
if ! "$PY" - <<'EOF' 2>&1 | tee "$OUT/device.txt"; then say "no usable GPU: stopping"; exit 2; fi
import sys, torch
if not torch.cuda.is_available():
    sys.exit("torch %s sees no CUDA device" % torch.__version__)
import triton
print("device: %s; torch %s, CUDA %s, triton %s" % (torch.cuda.get_device_name(0),
      torch.__version__, torch.version.cuda, triton.__version__))
EOF

# ------------------------------------------------------------------ Horovod's import-only stand-in
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
if ! "$PY" -c "import horovod.torch" >/dev/null 2>&1; then
  STUB="$OUT/horovod_stand_in"
  rm -rf "$STUB"
  mkdir -p "$STUB/horovod/torch/elastic"  # no horovod.tensorflow: TensorFlow's tests skip
  cat >"$STUB/horovod/_stub.py" <<'EOF'
"""Import-only stand-in for Horovod (scripts/gpu_check.sh): any name is a class whose instances
and calls are inert (empty when iterated), so modules that import Horovod, and register with it
at import, import; nothing in the codec's tests uses it further."""


class Stub:
    def __init__(self, *args, **kwargs):
        pass

    def __call__(self, *args, **kwargs):
        return Stub()

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return Stub()

    def __iter__(self):
        return iter(())


def getattr_(name):
    if name.startswith("__"):
        raise AttributeError(name)
    if name[:1].islower():  # a function: returns an inert object
        return Stub()
    return type(name, (Stub,), {})
EOF
  for m in __init__ torch/__init__ torch/mpi_ops torch/compression torch/optimizer \
           torch/elastic/__init__ torch/elastic/state; do
    printf 'from horovod._stub import getattr_ as __getattr__  # noqa: F401\n' \
      >"$STUB/horovod/$m.py"
  done
  export PYTHONPATH="$STUB:$PYTHONPATH"
  say "Horovod does not import: its import-only stand-in is on PYTHONPATH ($STUB)"
fi

# ------------------------------------------------------------------ 1. the CUDA tests
XDIST=()
"$PY" -c "import xdist" >/dev/null 2>&1 && XDIST=(-n 8)
say "1. CUDA tests"
# (not the compile check: CI compiles the same kernels for sm_90 and sm_80 without a GPU)
timeout 150 "$PY" -m pytest -q -p no:cacheprovider "${XDIST[@]}" \
  -k "(cuda or gpu) and not compile_for_gpus" \
  tests/test_triton_kernels.py tests/test_torch_codec.py tests/test_torch_buckets.py \
  tests/test_torch_scatter_codec.py tests/test_auto_threshold.py tests/test_steptime.py \
  >"$OUT/tests.txt" 2>&1
TESTS_RC=$?
tail -n 25 "$OUT/tests.txt"
TESTS_LINE=$(grep -E "passed|failed|error" "$OUT/tests.txt" | tail -n 1)
[ "$TESTS_RC" = 124 ] && TESTS_LINE="timed out after 150 s; $TESTS_LINE"

# ------------------------------------------------------------------ 2. the codec's speed
say "2. codec benchmark (Triton and compiled torch ops, against the probe)"
timeout 170 "$PY" scripts/gpu_codec_bench.py --device cuda --sizes 1M,16M,64M,256M \
  --model-values 25M --bucket-bytes 4M --json "$OUT/bench.json" >"$OUT/bench.txt" 2>&1
BENCH_RC=$?
tail -n 40 "$OUT/bench.txt"

# ------------------------------------------------------------------ 3. the profile, the advisor
say "3. advise calibrate --device cuda (the Triton kernels)"
PROFILE="$OUT/gpu-triton.json"
timeout 150 "$PY" -m horovod_twobit.advise calibrate --device cuda --name gpu-triton \
  --out "$PROFILE" --sizes 256K,1M,4M,16M,64M --reps 3 >"$OUT/calibrate.txt" 2>&1
CAL_RC=$?
tail -n 20 "$OUT/calibrate.txt"
ADVISE=(--params 25.6M --step-ms 104 --workers 64 --rate 25gbit)
: >"$OUT/advise.txt"
for prof in h200 "$PROFILE"; do
  [ -f "$prof" ] || [ "$prof" = h200 ] || continue
  for counts in 64 8,16,32,64,128,256,512,1024; do
    echo "### profile $prof, workers $counts" >>"$OUT/advise.txt"
    timeout 60 "$PY" -m horovod_twobit.advise "${ADVISE[@]}" --profile "$prof" \
      --counts "$counts" >>"$OUT/advise.txt" 2>&1
  done
done
cat "$OUT/advise.txt"

# ------------------------------------------------------------------ 4. DDP's hook on the GPU
say "4. DDP's 2-bit hook on the GPU (torchrun, 2 processes)"
timeout 240 "$PY" -m pytest -q -p no:cacheprovider -k cuda tests/test_ddp.py \
  >"$OUT/ddp.txt" 2>&1
DDP_RC=$?
tail -n 15 "$OUT/ddp.txt"
DDP_LINE=$(grep -E "passed|failed|error" "$OUT/ddp.txt" | tail -n 1)
[ "$DDP_RC" = 124 ] && DDP_LINE="timed out after 240 s; $DDP_LINE"

# ------------------------------------------------------------------ one table
rc_word() { case "$1" in 0) echo ok ;; 124) echo "timed out" ;; *) echo "failed ($1)" ;; esac; }
echo
echo "## gpu_check $(date -u +%Y-%m-%dT%H:%MZ), $(head -n 1 "$OUT/device.txt")"
echo
echo "| part | result | where |"
echo "|---|---|---|"
echo "| CUDA tests | ${TESTS_LINE:-no result} | $OUT/tests.txt |"
echo "| DDP hook on the GPU | ${DDP_LINE:-no result} | $OUT/ddp.txt |"
echo "| codec benchmark | $(rc_word $BENCH_RC) | $OUT/bench.txt, bench.json |"
echo "| calibrate | $(rc_word $CAL_RC) | $PROFILE |"
echo "| advisor, h200 then this GPU's profile | $(grep -c '^###' "$OUT/advise.txt") runs | $OUT/advise.txt |"
echo
sed -n '/^| rows |/,$p' "$OUT/bench.txt"
say "done"
[ "$TESTS_RC" = 0 ] || exit "$TESTS_RC"
exit "$DDP_RC"
