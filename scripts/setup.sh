#!/usr/bin/env bash
# Sets up everything horovod-twobit needs, from a fresh Debian 12 machine with Python >= 3.10:
# Debian packages, a virtual environment in .venv/, PyTorch 2.13.0 (CPU) and Triton 3.7.1,
# TensorFlow 2.15.1 (CPU), mpi4py built against the system's OpenMPI, Horovod 0.28.1 built from its
# sdist (patched from C++14 to C++17 so it compiles against torch >= 2.1) and this package in
# editable mode.
#
# The Horovod and mpi4py wheels are cached under $HOROVOD_TWOBIT_CACHE (default ~/.cache/horovod-twobit),
# keyed by every version they were built against, so a rerun that installs nothing takes about 30 s
# (pip's resolution, horovodrun --check-build), and one after a setup that changed nothing at all
# (the key below: this script, the settings, the venv's packages) under a second.
#
# Environment:
#   HOROVOD_TWOBIT_CACHE        where built wheels are kept
#   HOROVOD_TWOBIT_VENV         the virtual environment (default: <repo>/.venv)
#   HOROVOD_TWOBIT_TORCH_INDEX  an extra package index holding torch's CPU wheels (the Docker image
#                               sets it; pip's configured find-links serve them on the project's machines)
#   PYTHON                      the interpreter to build the venv from (default: python3)
#   HOROVOD_TWOBIT_SETUP_LOG    where the commands' output goes (default: <repo>/build/setup.log)
#   HOROVOD_TWOBIT_SKIP_PACKAGE if set, everything but this package (the Docker image's dependency
#                               layer, built before the source is copied in)
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${HOROVOD_TWOBIT_VENV:-$REPO/.venv}"
CACHE="${HOROVOD_TWOBIT_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/horovod-twobit}"
PYTHON="${PYTHON:-python3}"
LOG_DIR="$REPO/build"
LOG="${HOROVOD_TWOBIT_SETUP_LOG:-$LOG_DIR/setup.log}"

HOROVOD_VERSION=0.28.1
TORCH_VERSION=2.13.0
TF_VERSION=2.15.1
# Triton, the version torch 2.13's CUDA builds pin, for the tests that run the codec's
# Triton kernels through its interpreter on CPU tensors (tests/test_triton_kernels.py; the
# package itself never needs it without CUDA). It adds a 198 MB wheel (690 MB installed) and
# about 5 s to setup on this project's VM once downloaded. It goes to its own directory,
# $VENV/triton-site, which only those tests' workers put on their path: in the venv itself,
# Inductor would import it in every process that compiles, and Triton's LLVM beside TensorFlow's
# custom ops crashes such a process at exit (SIGSEGV after its last test).
TRITON_VERSION=3.7.1
# and the oldest Triton the kernels support (horovod_twobit.torch.codec.compiled.TRITON_MIN, the
# one torch 2.8 pins), for the test that compiles them for GPUs with both: 155 MB (540 MB
# installed) and about 3 s more, in $VENV/triton-min-site
TRITON_MIN_VERSION=3.4.0
APT_PACKAGES=(libopenmpi-dev openmpi-bin cmake g++ make openssh-client openssh-server iproute2)
# setuptools < 81: TensorBoard 2.15 (the stats example, its test) imports pkg_resources, gone in 81
PY_PACKAGES=("torch==$TORCH_VERSION" "tensorflow-cpu==$TF_VERSION" "numpy<2"
             "scikit-learn" "pytest" "pytest-timeout" "matplotlib" "setuptools>=68,<81" "wheel"
             "cloudpickle" "psutil" "pyyaml" "packaging" "cffi>=1.4.0")

# A setup that ended "ready" leaves a key of what it set up: this script and pyproject.toml (if
# any), the settings above, OpenMPI's version and the names in the venv's site-packages (every
# installed distribution and its version). While it matches, there is nothing to do: the checks below (pip's
# resolution, horovodrun --check-build) cost about 30 s a run.
READY="$VENV/.horovod-twobit-ready"
ready_key() {
  {
    cat "$REPO/scripts/setup.sh"
    # absent in the Docker image's dependency layer, which copies this script alone
    [ ! -f "$REPO/pyproject.toml" ] || cat "$REPO/pyproject.toml"
    printf '%s\n' "$REPO" "$VENV" "$CACHE" "$PYTHON" "${HOROVOD_TWOBIT_TORCH_INDEX:-}" \
      "${HOROVOD_TWOBIT_SKIP_PACKAGE:-}"
    dpkg-query -W -f='${Version}\n' libopenmpi-dev 2>/dev/null || true
    ls -1a "$VENV"/lib/python*/site-packages "$VENV/triton-site" "$VENV/triton-min-site" \
      2>/dev/null || true
  } | sha256sum | cut -d' ' -f1
}
if [ "${1:-}" = --ready-key ]; then ready_key; exit 0; fi  # what the check compares (the tests')

mkdir -p "$(dirname "$LOG")" "$CACHE"
: >"$LOG"
T0=$(date +%s)
stage() { printf '[setup %4ss] %s\n' "$(( $(date +%s) - T0 ))" "$*"; echo "=== $* ===" >>"$LOG"; }
fail() {
  echo "[setup] FAILED: $1" >&2
  echo "[setup] last lines of $LOG:" >&2
  tail -n 40 "$LOG" >&2 || true
  echo "[setup] what to do: $2" >&2
  exit 1
}
run() { "$@" >>"$LOG" 2>&1; }

# ---------------------------------------------------------------- Debian packages
stage "checking Debian packages: ${APT_PACKAGES[*]}"
missing=()
for p in "${APT_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  [ "$(id -u)" = 0 ] || fail "missing Debian packages: ${missing[*]}" \
    "run as root, or: sudo apt-get install -y ${missing[*]}"
  stage "installing Debian packages: ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  run apt-get update || fail "apt-get update" "check the machine reaches Debian's mirrors"
  run apt-get install -y --no-install-recommends "${missing[@]}" \
    || fail "apt-get install ${missing[*]}" "install them by hand and rerun"
fi

# ---------------------------------------------------------------- nothing changed?
if [ -x "$VENV/bin/python" ] && [ -f "$READY" ] && [ "$(cat "$READY")" = "$(ready_key)" ]; then
  stage "ready: $VENV (nothing changed since its last setup; delete $READY to check it all again)"
  exit 0
fi
rm -f "$READY"

# ---------------------------------------------------------------- virtual environment
"$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 10))' \
  || fail "$PYTHON is older than 3.10" "set PYTHON to a Python >= 3.10 interpreter"
if [ ! -x "$VENV/bin/python" ]; then
  stage "creating virtual environment $VENV"
  run "$PYTHON" -m venv "$VENV" || fail "python -m venv" "install python3-venv"
fi
PY="$VENV/bin/python"
PIP=("$PY" -m pip install --disable-pip-version-check)
[ -n "${HOROVOD_TWOBIT_TORCH_INDEX:-}" ] && PIP+=(--extra-index-url "$HOROVOD_TWOBIT_TORCH_INDEX")

stage "installing Python packages (torch $TORCH_VERSION CPU, tensorflow-cpu $TF_VERSION, ...)"
run "${PIP[@]}" "${PY_PACKAGES[@]}" \
  || fail "pip install of the Python packages" "read $LOG; pip's index must serve torch==$TORCH_VERSION (CPU)"
if "$PY" -m pip show triton >/dev/null 2>&1; then  # an earlier setup put it in the venv itself
  run "$PY" -m pip uninstall -y triton || fail "pip uninstall triton" "remove triton from $VENV by hand"
fi
triton_into() {  # triton_into DIR VERSION WHAT: Triton VERSION alone in DIR, once
  [ ! -f "$1/triton-$2.installed" ] || return 0
  stage "installing triton $2 into $1 ($3)"
  rm -rf "$1"
  run "${PIP[@]}" --no-deps --target "$1" "triton==$2" \
    || fail "pip install triton==$2" "read $LOG; pip's index must serve it"
  touch "$1/triton-$2.installed"
}
triton_into "$VENV/triton-site" "$TRITON_VERSION" "for the interpreter tests only"
triton_into "$VENV/triton-min-site" "$TRITON_MIN_VERSION" "the oldest supported, compile test only"
py_v=$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
ompi_v=$(dpkg-query -W -f='${Version}' libopenmpi-dev 2>/dev/null || echo unknown)
if ! "$PY" -c 'import mpi4py' >/dev/null 2>&1; then
  # cached like Horovod's wheel (a few minutes to build on 2 cores; the Docker image reuses it)
  MPI4PY_KEY="mpi4py-py$py_v-ompi$ompi_v-$(uname -m)"
  MPI4PY_DIR="$CACHE/wheels/${MPI4PY_KEY//[^A-Za-z0-9._+-]/_}"
  if ! ls "$MPI4PY_DIR"/mpi4py-*.whl >/dev/null 2>&1; then
    stage "building mpi4py against the system's OpenMPI"
    rm -rf "$MPI4PY_DIR.tmp"
    run env MPICC=mpicc "$PY" -m pip wheel --disable-pip-version-check --no-deps --no-binary mpi4py \
        -w "$MPI4PY_DIR.tmp" "mpi4py>=3.1,<5" \
      || fail "mpi4py build" "check that mpicc (libopenmpi-dev) works"
    rm -rf "$MPI4PY_DIR" && mv "$MPI4PY_DIR.tmp" "$MPI4PY_DIR"
  fi
  stage "installing mpi4py from $MPI4PY_DIR"
  run "${PIP[@]}" --no-deps "$MPI4PY_DIR"/mpi4py-*.whl \
    || fail "install of the mpi4py wheel" "delete $MPI4PY_DIR and rerun to rebuild it"
fi

# ---------------------------------------------------------------- Horovod
torch_v=$("$PY" -c 'import torch; print(torch.__version__)')
tf_v=$("$PY" -c 'import os; os.environ["TF_CPP_MIN_LOG_LEVEL"]="3"; import tensorflow as tf; print(tf.__version__)' 2>/dev/null)
PATCH_ID=cxx17-v1
KEY="horovod-$HOROVOD_VERSION-$PATCH_ID-py$py_v-torch$torch_v-tf$tf_v-ompi$ompi_v-$(uname -m)"
KEY="${KEY//[^A-Za-z0-9._+-]/_}"
WHEEL_DIR="$CACHE/wheels/$KEY"

installed_hvd=$("$PY" -c 'import importlib.metadata as m; print(m.version("horovod"))' 2>/dev/null || true)
stamp="$VENV/.horovod-twobit-horovod-key"
if [ "$installed_hvd" = "$HOROVOD_VERSION" ] && [ "$(cat "$stamp" 2>/dev/null)" = "$KEY" ]; then
  stage "horovod $HOROVOD_VERSION already installed ($KEY)"
else
  if ! ls "$WHEEL_DIR"/horovod-*.whl >/dev/null 2>&1; then
    stage "building horovod $HOROVOD_VERSION (about 5 minutes on 2 cores; log: $LOG)"
    SRC=$(mktemp -d)
    trap 'rm -rf "$SRC"' EXIT
    run "$PY" -m pip download --no-deps --no-binary :all: "horovod==$HOROVOD_VERSION" -d "$SRC" \
      || fail "download of the horovod $HOROVOD_VERSION sdist" "check the machine reaches PyPI"
    tar xzf "$SRC"/horovod-"$HOROVOD_VERSION".tar.gz -C "$SRC"
    HSRC="$SRC/horovod-$HOROVOD_VERSION"
    # torch >= 2.1 headers need C++17; Horovod 0.28.1 asks for C++14 in two places.
    sed -i 's/set(CMAKE_CXX_STANDARD 14)/set(CMAKE_CXX_STANDARD 17)/' \
      "$HSRC/CMakeLists.txt" "$HSRC/horovod/torch/CMakeLists.txt"
    grep -q 'CMAKE_CXX_STANDARD 14' "$HSRC/CMakeLists.txt" "$HSRC/horovod/torch/CMakeLists.txt" \
      && fail "patching horovod's CMake files" "the sdist changed; update the sed in $0"
    mkdir -p "$WHEEL_DIR.tmp"
    run env HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITH_GLOO=1 \
        HOROVOD_WITH_MPI=1 HOROVOD_WITHOUT_MXNET=1 \
        MAKEFLAGS="-j$(nproc)" \
        "$PY" -m pip wheel --no-deps --no-build-isolation -w "$WHEEL_DIR.tmp" "$HSRC" \
      || fail "horovod build" "read $LOG (compiler errors are near its end)"
    rm -rf "$WHEEL_DIR" && mv "$WHEEL_DIR.tmp" "$WHEEL_DIR"
    stage "horovod wheel cached in $WHEEL_DIR"
  fi
  stage "installing horovod from $WHEEL_DIR"
  run "${PIP[@]}" --force-reinstall --no-deps "$WHEEL_DIR"/horovod-*.whl \
    || fail "install of the horovod wheel" "delete $WHEEL_DIR and rerun to rebuild it"
  echo "$KEY" >"$stamp"
fi

# ---------------------------------------------------------------- this package
if [ -n "${HOROVOD_TWOBIT_SKIP_PACKAGE:-}" ]; then
  stage "not installing horovod-twobit (HOROVOD_TWOBIT_SKIP_PACKAGE is set)"
elif ! (cd / && "$PY" -c 'import horovod_twobit, sys; sys.exit(not horovod_twobit.__file__.startswith(sys.argv[1]))' "$REPO") >/dev/null 2>&1; then
  stage "installing horovod-twobit in editable mode"
  run "${PIP[@]}" --no-deps --no-build-isolation -e "$REPO" || fail "pip install -e ." "read $LOG"
fi

# ---------------------------------------------------------------- check
stage "checking horovodrun --check-build"
out=$("$VENV/bin/horovodrun" --check-build 2>&1) || fail "horovodrun --check-build" "read its output above"
echo "$out" >>"$LOG"
for fw in TensorFlow PyTorch MPI Gloo; do
  echo "$out" | grep -qE "\[X\] $fw\b" || { echo "$out"; fail "horovod was built without $fw" "delete $WHEEL_DIR and rerun"; }
done
ready_key >"$READY"
stage "ready: $VENV (horovod $HOROVOD_VERSION, torch $torch_v, tensorflow $tf_v)"
