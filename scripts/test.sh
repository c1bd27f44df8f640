#!/usr/bin/env bash
# Sets up everything (scripts/setup.sh) and runs the test suite.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$REPO/scripts/setup.sh"
cd "$REPO"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
exec "${HOROVOD_TWOBIT_VENV:-$REPO/.venv}/bin/python" -m pytest -v -rs --durations=30 "$@" tests
