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
#    1 M / 16 M / 64 M / 256 M values, and 16 M + 8 last (a tensor alone whose size is not a
#    multiple of 16: every program but its last on the vector path), fixed and "auto", Triton
#    and the compiled torch ops, against the same run's probe; one step's codec for a 25 M-value
#    model in 4 MiB buckets;
# 3. `python -m horovod_twobit.advise calibrate --device cuda` into a profile of this GPU with
#    the Triton kernels, and the advisor's ResNet-50 projection (64 workers, 25 Gbit/s) and
#    worker counts 8-1024 with it and with the shipped h200 profile (before);
# 4. DDP's 2-bit hook on the GPU: tests/test_ddp.py's CUDA jobs (2 torchrun processes on the one
#    GPU, gloo with CUDA tensors: every step bit for bit against the NumPy reference, a fault
#    included; a short training run whose losses follow the same run on the CPU);
# then one table of everything, kept in OUT/summary.md part by part (what a cut-off run leaves).
#
# The parts share one deadline, GPU_CHECK_BUDGET seconds from the start (default 390, for a call
# limited to 420 s): each runs until its own limit or until only the later parts' minimums are
# left, whichever comes first, so that a slow part shortens the ones after it instead of
# starving them. GPU_CHECK_DEVICE=cpu rehearses the whole script on this machine's CPU (Triton's
# interpreter, tiny sizes, Horovod's stand-in forced, the CUDA tests skipping): the suite runs it
# so, and a plumbing mistake does not cost the one call on a GPU. Exit status: that of the tests
# (1, then 4); 2 where the device is not usable.
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

DEVICE="${GPU_CHECK_DEVICE:-cuda}"
BUDGET="${GPU_CHECK_BUDGET:-390}"
case "$DEVICE" in cuda|cpu) ;; *) echo "GPU_CHECK_DEVICE must be cuda or cpu, not $DEVICE" >&2; exit 2 ;; esac
# what the Triton parts run with: on a GPU the kernels compiled; in the rehearsal Triton's
# interpreter on CPU tensors (and Triton's own directory, which scripts/setup.sh keeps beside the
# venv, on the path of those parts only: beside TensorFlow's ops in one process it crashes at exit)
TRITON_ENV=() TRITON_PATH=""
if [ "$DEVICE" = cpu ]; then
  TRITON_ENV=(TRITON_INTERPRET=1 HOROVOD_TWOBIT_COMPILE=0 PYTHONWARNINGS=ignore)
  SITE=$("$PY" -c "import sys; print(sys.prefix)")/triton-site
  [ -d "$SITE" ] && TRITON_PATH="$SITE:"
fi
# with_triton SECONDS [NAME=VALUE ...] COMMAND ...: a Triton part, stopped after SECONDS
with_triton() {
  local limit=$1; shift
  timeout "$limit" env "${TRITON_ENV[@]}" PYTHONPATH="$TRITON_PATH${PYTHONPATH:-}" "$@"
}
: >"$OUT/summary.md"
row() { echo "| $1 | $2 | $3 |" >>"$OUT/summary.md"; }
rc_word() { case "$1" in 0) echo ok ;; 124) echo "timed out after $2 s" ;; *) echo "failed ($1)" ;; esac; }
# a pytest part's row: its summary line, after "timed out" where it was stopped
tests_row() {
  local line
  line=$(grep -E "passed|failed|error|skipped|deselected|no tests ran" "$4" | tail -n 1)
  [ "$2" = 124 ] && line="timed out after $3 s; $line"
  row "$1" "${line:-no result}" "$4"
}
# seconds part may run: its own limit, or what is left before the deadline less the minimums of the
# parts after it (never under 10)
cap() {
  local left=$(( T0 + BUDGET - $(date +%s) - $2 ))
  [ "$left" -lt "$1" ] || left=$1
  [ "$left" -ge 10 ] || left=10
  echo "$left"
}

say "python: $PY; device: $DEVICE; budget ${BUDGET} s"
if ! with_triton 60 GPU_CHECK_DEVICE="$DEVICE" "$PY" - <<'EOF' 2>&1 | tee "$OUT/device.txt"; then
import os, sys, torch
if os.environ["GPU_CHECK_DEVICE"] == "cpu":
    import triton
    print("device: CPU, a rehearsal (Triton's interpreter); torch %s, triton %s"
          % (torch.__version__, triton.__version__))
    sys.exit(0)
if not torch.cuda.is_available():
    sys.exit("torch %s sees no CUDA device" % torch.__version__)
import triton
print("device: %s; torch %s, CUDA %s, triton %s" % (torch.cuda.get_device_name(0),
      torch.__version__, torch.version.cuda, triton.__version__))
EOF
  say "no usable device: stopping"; exit 2
fi

# ------------------------------------------------------------------ Horovod's import-only stand-in
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
if [ "$DEVICE" = cpu ] || ! "$PY" -c "import horovod.torch" >/dev/null 2>&1; then
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
  say "Horovod's import-only stand-in is on PYTHONPATH ($STUB)"
fi

# ------------------------------------------------------------------ 1. the CUDA tests
XDIST=()
"$PY" -c "import xdist" >/dev/null 2>&1 && XDIST=(-n 8)
LIMIT=$(cap 150 175)
say "1. CUDA tests (up to $LIMIT s)"
# (not the compile check: CI compiles the same kernels for sm_90 and sm_80 without a GPU; not
# the rehearsal of this script, which CI runs)
timeout "$LIMIT" "$PY" -m pytest -q -p no:cacheprovider "${XDIST[@]}" \
  -k "(cuda or gpu) and not compile_for_gpus and not rehearses" \
  tests/test_triton_kernels.py tests/test_torch_codec.py tests/test_torch_buckets.py \
  tests/test_torch_scatter_codec.py tests/test_auto_threshold.py tests/test_steptime.py \
  >"$OUT/tests.txt" 2>&1
TESTS_RC=$?
tail -n 25 "$OUT/tests.txt"
tests_row "CUDA tests" "$TESTS_RC" "$LIMIT" "$OUT/tests.txt"

# ------------------------------------------------------------------ 2. the codec's speed
BENCH=(--device cuda --sizes 1M,16M,64M,256M,16777224 --model-values 25M --bucket-bytes 4M)
[ "$DEVICE" = cpu ] && BENCH=(--device cpu --sizes 1K --model-values 6K --bucket-bytes 8K
                              --min-time 0 --min-rounds 1)
LIMIT=$(cap 170 115)
say "2. codec benchmark (Triton and compiled torch ops, against the probe; up to $LIMIT s)"
with_triton "$LIMIT" "$PY" scripts/gpu_codec_bench.py "${BENCH[@]}" \
  --json "$OUT/bench.json" >"$OUT/bench.txt" 2>&1
BENCH_RC=$?
tail -n 40 "$OUT/bench.txt"
row "codec benchmark" "$(rc_word $BENCH_RC $LIMIT), $(grep -c '^| ' "$OUT/bench.txt") rows" \
  "$OUT/bench.txt, bench.json"

# ------------------------------------------------------------------ 3. the profile, the advisor
CAL=(--device cuda --sizes 256K,1M,4M,16M,64M --reps 3)
[ "$DEVICE" = cpu ] && CAL=(--device cpu --sizes 4K --reps 1 --members 1 --tables 1
                            --segment-values 0)
LIMIT=$(cap 150 75)
say "3. advise calibrate --device $DEVICE (the Triton kernels; up to $LIMIT s)"
PROFILE="$OUT/gpu-triton.json"
rm -f "$PROFILE"
with_triton "$LIMIT" "$PY" -m horovod_twobit.advise calibrate "${CAL[@]}" \
  --name gpu-triton --out "$PROFILE" >"$OUT/calibrate.txt" 2>&1
CAL_RC=$?
tail -n 20 "$OUT/calibrate.txt"
row "calibrate" "$(rc_word $CAL_RC $LIMIT)" "$PROFILE"
ADVISE=(--params 25.6M --step-ms 104 --workers 64 --rate 25gbit)
: >"$OUT/advise.txt"
for prof in h200 "$PROFILE"; do
  [ -f "$prof" ] || [ "$prof" = h200 ] || continue
  for counts in 64 8,16,32,64,128,256,512,1024; do
    echo "### profile $prof, workers $counts" >>"$OUT/advise.txt"
    timeout "$(cap 30 60)" "$PY" -m horovod_twobit.advise "${ADVISE[@]}" --profile "$prof" \
      --counts "$counts" >>"$OUT/advise.txt" 2>&1
  done
done
cat "$OUT/advise.txt"
row "advisor, h200 then this device's profile" \
  "$(grep -c '^###' "$OUT/advise.txt") runs, $(grep -c 'Traceback\|error:' "$OUT/advise.txt") errors" \
  "$OUT/advise.txt"

# ------------------------------------------------------------------ 4. DDP's hook on the GPU
LIMIT=$(cap 240 0)
say "4. DDP's 2-bit hook on the GPU (torchrun, 2 processes; up to $LIMIT s)"
timeout "$LIMIT" "$PY" -m pytest -q -p no:cacheprovider -k cuda tests/test_ddp.py \
  >"$OUT/ddp.txt" 2>&1
DDP_RC=$?
tail -n 15 "$OUT/ddp.txt"
tests_row "DDP hook on the GPU" "$DDP_RC" "$LIMIT" "$OUT/ddp.txt"

# ------------------------------------------------------------------ one table
echo
echo "## gpu_check $(date -u +%Y-%m-%dT%H:%MZ), $(head -n 1 "$OUT/device.txt")"
echo
echo "| part | result | where |"
echo "|---|---|---|"
cat "$OUT/summary.md"
echo
sed -n '/^| rows |/,$p' "$OUT/bench.txt"
say "done"
[ "$TESTS_RC" = 0 ] || exit "$TESTS_RC"
exit "$DDP_RC"
