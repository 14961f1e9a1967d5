#!/usr/bin/env bash
# The test command from the README: installs test dependencies, then runs the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
scripts/install.sh test
exec python3 -m pytest -q "$@"
