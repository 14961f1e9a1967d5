#!/usr/bin/env bash
# The GPU check (issue 29): every GPU-side check of hora in one command, one report.
#   bench/gpu/check.sh                  run every step (each skipped, "no GPU", without one)
#   bench/gpu/check.sh --dry-run        list every step, each skipped with "no GPU"
#   bench/gpu/check.sh --report FILE    where the report goes (default ./hora-gpu-check.md)
# Steps, their time limits and the report's format: bench/gpu/check.py (python, no arguments
# of its own beyond these). Exit status 1 when a step failed, else 0 (skipped steps pass).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
py="${HORA_PYTHON:-}"
if [ -z "$py" ]; then
  if [ -n "${VIRTUAL_ENV:-}" ] && [ -x "$VIRTUAL_ENV/bin/python" ]; then py="$VIRTUAL_ENV/bin/python"
  elif [ -x "$root/.venv/bin/python" ]; then py="$root/.venv/bin/python"
  else py="$(command -v python3)"; fi
fi
exec "$py" "$here/check.py" --root "$root" "$@"
