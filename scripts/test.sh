#!/usr/bin/env bash
# Sets up everything (scripts/setup.sh) and runs the test suite.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$REPO/scripts/setup.sh"
cd "$REPO"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
# torch.compile's kernels are kept beside the wheels (keyed by the code they compile), so a fresh
# clone does not compile them again: on 2 cores the whole suite takes 23-31 minutes, and on a
# machine where nothing is cached yet about 32 (docs/README.md, For contributors)
CACHE="${HOROVOD_TWOBIT_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/horovod-twobit}"
export TORCHINDUCTOR_CACHE_DIR="${TORCHINDUCTOR_CACHE_DIR:-$CACHE/inductor}"
exec "${HOROVOD_TWOBIT_VENV:-$REPO/.venv}/bin/python" -m pytest -v -rs --durations=30 "$@" tests
