#!/usr/bin/env bash
# Sets up everything (scripts/setup.sh) and trains the digits MLP on 2 workers, uncompressed and
# with TwoBitCompressor. Extra arguments go to examples/digits_torch.py.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$REPO/scripts/setup.sh"
cd "$REPO"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
VENV="${HOROVOD_TWOBIT_VENV:-$REPO/.venv}"
exec "$VENV/bin/horovodrun" -np 2 -H localhost:2 --gloo "$VENV/bin/python" examples/digits_torch.py "$@"
