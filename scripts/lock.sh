#!/usr/bin/env bash
# Re-resolve hora[test] in a throw-away virtual environment and write constraints/test.txt.
# Run after changing dependencies in pyproject.toml; commit the result; CI installs from it.
set -euo pipefail
cd "$(dirname "$0")/.."
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python3 -m venv "$tmp/venv"
"$tmp/venv/bin/python" -m pip install -q --disable-pip-version-check \
  -c constraints/cpu.txt "pytest<9.2" -e ".[test]"
{
  sed -n '1,/^# pytest stays/p' constraints/test.txt
  "$tmp/venv/bin/python" -m pip freeze --exclude-editable | grep -v -i '^torch=='
} >"$tmp/lock.txt"
mv "$tmp/lock.txt" constraints/test.txt
echo "lock.sh: wrote constraints/test.txt ($(grep -c '==' constraints/test.txt) pins)"
