#!/usr/bin/env bash
# Re-resolve hora[test] (which includes the examples, docs and hub extras) and write
# constraints/test.txt, the lock that scripts/install.sh and CI install from. Run it after
# changing dependencies in pyproject.toml, and commit the result.
#
# The lock must install on every Python that pyproject.toml's requires-python admits, so it is
# resolved for the lowest one (the floor: ">=3.11" -> 3.11.0), not for the interpreter running
# this script: pip resolves with `--python-version <floor> --only-binary :all: --dry-run` (and a
# --target, which pip asks for with these options; nothing is installed), which
# admits a release only if its Requires-Python accepts the floor and it has a wheel for it
# (manylinux x86_64, cp311/abi3/py3). Every pin's Requires-Python is then checked again
# against the floor from pip's report, and the script fails if one does not admit it. torch
# stays pinned by constraints/cpu.txt only (GPU machines keep their CUDA build). Dependencies
# whose markers depend on the Python version are evaluated for 3.11, as the floor is.
# The current lock's pins are kept (passed to pip as constraints) so that a re-lock changes only
# what it must; name packages to let them move (or `all` for a fresh resolution):
#   LOCK_UPGRADE="soupsieve pytest" scripts/lock.sh
# A kept pin that the floor cannot install makes pip fail: name it in LOCK_UPGRADE.
#
#   scripts/lock.sh check PYTHON   installs the lock (hora[test]) with that interpreter into a
#                                  throw-away venv, then `pip check`s it; .ci/run does this with
#                                  Debian 12's /usr/bin/python3 (3.11.2), the proof on a real one
set -euo pipefail
cd "$(dirname "$0")/.."
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

if [ "${1:-}" = check ]; then
  python="${2:?usage: scripts/lock.sh check PYTHON}"
  t0=$(date +%s)
  echo "lock.sh: installing the lock with $python ($("$python" --version 2>&1))"
  "$python" -m venv "$tmp/venv"
  # --no-compile: no bytecode for the thousands of modules installed (the most of pip's time
  # here); the imports below compile what they load, as any first run does
  if ! "$tmp/venv/bin/python" -m pip install --disable-pip-version-check --progress-bar off \
      --no-compile -c constraints/cpu.txt -c constraints/test.txt -e ".[test]" >"$tmp/pip.log" 2>&1; then
    echo "lock.sh: the lock does not install with $python; pip's log ends:" >&2
    grep -v '^WARNING: Location' "$tmp/pip.log" | tail -20 >&2
    exit 1
  fi
  "$tmp/venv/bin/python" -m pip check
  "$tmp/venv/bin/python" -c 'import hora, hora_service, sphinx, torch'
  echo "lock.sh: the lock installs with $python ($(( $(date +%s) - t0 ))s)"
  exit 0
fi

# requirements of hora[test], with hora's own extras expanded, and the requires-python floor
python3 - "$tmp" <<'EOF'
import re
import sys
import tomllib
from pathlib import Path

project = tomllib.loads(Path("pyproject.toml").read_text())["project"]
extras = project["optional-dependencies"]
floor = re.fullmatch(r">=\s*(\d+)\.(\d+)(?:\.(\d+))?", project["requires-python"].strip())
if not floor:
    sys.exit(f"lock.sh: cannot read a floor from requires-python {project['requires-python']!r}")
major, minor, micro = floor.group(1), floor.group(2), floor.group(3) or "0"
reqs: list[str] = list(project["dependencies"])
todo, seen = ["test"], set()
while todo:
    extra = todo.pop()
    if extra in seen:
        continue
    seen.add(extra)
    for req in extras[extra]:
        own = re.fullmatch(r"hora\[([\w,\s-]+)\]", req.split("#")[0].strip())
        if own:
            todo += [e.strip() for e in own.group(1).split(",")]
        else:
            reqs.append(req)
out = Path(sys.argv[1])
(out / "requirements.txt").write_text("\n".join(reqs) + "\n")
(out / "floor").write_text(f"{major}.{minor}.{micro}")
EOF
floor=$(cat "$tmp/floor")

# the current pins to keep: all but those named in LOCK_UPGRADE
python3 - "$tmp/keep.txt" "${LOCK_UPGRADE:-}" <<'EOF'
import re
import sys
from pathlib import Path

def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()

out, upgrade = Path(sys.argv[1]), {norm(n) for n in sys.argv[2].split()}
lock = Path("constraints/test.txt")
lines = lock.read_text().splitlines() if lock.exists() and "all" not in upgrade else []
keep = [ln for ln in lines if "==" in ln and not ln.startswith("#")
        and norm(ln.split("==")[0]) not in upgrade]
out.write_text("\n".join(keep) + "\n")
print(f"lock.sh: keeping {len(keep)} current pins; free: {' '.join(sorted(upgrade)) or 'none'}")
EOF

echo "lock.sh: resolving hora[test] for Python $floor (wheels only)"
python3 -m venv "$tmp/venv"
"$tmp/venv/bin/python" -m pip install -q --disable-pip-version-check --dry-run --target "$tmp/none" \
  --python-version "$floor" --only-binary :all: --report "$tmp/report.json" \
  -c constraints/cpu.txt -c "$tmp/keep.txt" -r "$tmp/requirements.txt" 2>&1 \
  | { grep -v '^WARNING: Location' || true; }

# pins from pip's report; every pin's Requires-Python must admit the floor
"$tmp/venv/bin/python" - "$tmp" "$floor" <<'EOF'
import json
import sys
from pathlib import Path

from pip._vendor.packaging.specifiers import SpecifierSet

tmp, floor = Path(sys.argv[1]), sys.argv[2]
report = json.loads((tmp / "report.json").read_text())
pins, bad = [], []
for item in report["install"]:
    meta = item["metadata"]
    name, version = meta["name"], meta["version"]
    needs = meta.get("requires_python") or ""
    if needs and not SpecifierSet(needs).contains(floor, prereleases=True):
        bad.append(f"{name}=={version} requires Python {needs}")
    if name.lower() != "torch":
        pins.append(f"{name}=={version}")
if bad:
    sys.exit("lock.sh: pins that Python %s cannot install:\n  %s" % (floor, "\n  ".join(bad)))
header = f"""\
# Lock for installs and CI: every dependency of hora[test] (with its examples, docs, hub extras)
# at the version CI tests with. Written by scripts/lock.sh, which resolves for Python {floor}, the
# floor of requires-python, from wheels only, and checks that every pin's Requires-Python admits
# it: the lock installs on any Python that pyproject.toml admits (Debian 12's 3.11.2 included).
# torch is pinned in cpu.txt only, so GPU machines keep their CUDA build (see the install docs).
# pytest stays below 9.2: schemathesis 4.32.5's pytest plugin breaks on pytest 9.2.0 ('_nodeid').
"""
pins.sort(key=str.lower)
(tmp / "lock.txt").write_text(header + "\n".join(pins) + "\n")
print(f"lock.sh: {len(pins)} pins, each admitting Python {floor}")
EOF
mv "$tmp/lock.txt" constraints/test.txt
echo "lock.sh: wrote constraints/test.txt"

