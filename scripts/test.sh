#!/usr/bin/env bash
# The test command from the README: installs test dependencies (into the active virtual
# environment, else .venv), then runs the whole suite from that environment.
set -euo pipefail
cd "$(dirname "$0")/.."
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
scripts/install.sh test
venv="${VIRTUAL_ENV:-$PWD/.venv}"
# tests start `hora`, `python` and `jupyter` as subprocesses: they must come from the venv
export VIRTUAL_ENV="$venv" PATH="$venv/bin:$PATH"
exec python -m pytest -q "$@"
