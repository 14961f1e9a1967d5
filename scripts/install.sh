#!/usr/bin/env bash
# Install hora and what its tests need on a fresh machine (Debian/Ubuntu, Python >= 3.11).
#   scripts/install.sh          runtime only (service, JupyterLab, examples)
#   scripts/install.sh test     + test tools, Open MPI, Chromium, Docker engine, debootstrap
#   scripts/install.sh hub      + JupyterHub, its idle culler, batchspawner and the hub's proxy
#                               (npm), to run hora as a JupyterHub service (docs/team.md)
#   scripts/install.sh system   only the machine's packages that `test` adds (apt, npm: needs
#                               root), no venv: CI runs it beside the first install
# Everything goes into a virtual environment: the active one ($VIRTUAL_ENV), else .venv in the
# repository root (created here). Versions come from constraints/test.txt (the lock CI tests
# with) and, on a machine without a GPU, constraints/cpu.txt (the CPU build of torch).
#   HORA_TORCH_CONSTRAINTS=   (empty) keep or get your CUDA build of torch instead
#   HORA_LOCK=                (empty) resolve freely instead of using the lock
set -euo pipefail
cd "$(dirname "$0")/.."
want="${1:-run}"
case "$want" in
  run|test|hub|system) ;;
  *) echo "usage: scripts/install.sh [test|hub|system]" >&2; exit 2 ;;
esac
t0=$(date +%s)
say() { echo "install.sh [$(( $(date +%s) - t0 ))s] $*"; }
# apt waits for another apt (or dpkg) holding its lock instead of failing at once
apt_get() { apt-get -o DPkg::Lock::Timeout=600 "$@"; }

# the machine's packages that hora's tests (test) or its hub (hub) need, from apt and npm
system_packages() {
  local set=$1 apt_pkgs=()
  if [ "$set" = test ]; then
    command -v mpirun >/dev/null || apt_pkgs+=(openmpi-bin)
    command -v chromium >/dev/null || apt_pkgs+=(chromium)
    command -v dockerd >/dev/null || apt_pkgs+=(docker.io)
    command -v debootstrap >/dev/null || apt_pkgs+=(debootstrap)
    # a real two-node Slurm for the slurm runtime's tests (scripts/slurm-cluster.sh)
    command -v slurmd >/dev/null || apt_pkgs+=(slurm-wlm)
    command -v sbatch >/dev/null || apt_pkgs+=(slurm-client)
    command -v munged >/dev/null || apt_pkgs+=(munge)
    command -v nsenter >/dev/null || apt_pkgs+=(util-linux)
    command -v ip >/dev/null || apt_pkgs+=(iproute2)
    # batchspawner's `sudo -u USER sbatch` (tests/slurm/test_hub_slurm.py)
    command -v sudo >/dev/null || apt_pkgs+=(sudo)
  fi
  if [ "$set" = test ] || [ "$set" = hub ]; then
    # JupyterHub's proxy comes from npm (below)
    command -v npm >/dev/null || apt_pkgs+=(nodejs npm)
  fi
  if [ ${#apt_pkgs[@]} -gt 0 ]; then
    if [ "$(id -u)" = 0 ]; then
      say "apt: installing ${apt_pkgs[*]} (a minute or two)"
      apt_get update -qq
      DEBIAN_FRONTEND=noninteractive apt_get install -y -qq --no-install-recommends \
        "${apt_pkgs[@]}" >/dev/null
    else
      echo "install.sh: please install with apt: ${apt_pkgs[*]}" >&2
    fi
  fi

  # JupyterHub's real proxy for the hub tests, from the npm registry (pinned)
  local chp=configurable-http-proxy@5.3.0
  if { [ "$set" = test ] || [ "$set" = hub ]; } && ! command -v configurable-http-proxy >/dev/null
  then
    if [ "$(id -u)" = 0 ] && command -v npm >/dev/null; then
      say "npm: installing $chp"
      npm install -g --no-fund --no-audit --loglevel=error "$chp" >/dev/null
    else
      echo "install.sh: please install JupyterHub's proxy: npm install -g $chp" >&2
    fi
  fi
}

if [ "$want" = system ]; then
  system_packages test
  say "done: the test set's system packages"
  exit 0
fi

# one install at a time from this checkout (two scripts/test.sh started together both run this;
# the second waits, then finds the stamp below and has nothing to do)
exec 9<"$0"
if ! flock -w 1800 9; then
  echo "install.sh: another scripts/install.sh from this checkout held its lock for 30 min" >&2
  exit 1
fi

venv="${VIRTUAL_ENV:-$PWD/.venv}"
if [ ! -x "$venv/bin/python" ]; then
  say "creating the virtual environment $venv"
  if ! err=$(python3 -m venv "$venv" 2>&1); then
    # Debian's own python3 has no ensurepip without its python3-venv package
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
      say "apt: installing python3-venv (python3 -m venv needs it)"
      apt_get update -qq
      DEBIAN_FRONTEND=noninteractive apt_get install -y -qq --no-install-recommends \
        python3-venv >/dev/null
      python3 -m venv "$venv"
    else
      echo "$err" >&2
      echo "install.sh: python3 -m venv failed; on Debian/Ubuntu: apt-get install python3-venv" >&2
      exit 1
    fi
  fi
fi
py="$venv/bin/python"

system_packages "$want"

pip_c=() constraint_files=()
torch_c="${HORA_TORCH_CONSTRAINTS-constraints/cpu.txt}"
lock="${HORA_LOCK-constraints/test.txt}"
[ -n "$torch_c" ] && pip_c+=(-c "$torch_c") constraint_files+=("$torch_c")
[ -n "$lock" ] && pip_c+=(-c "$lock") constraint_files+=("$lock")
extra=".[examples]"
[ "$want" = hub ] && extra=".[examples,hub]"
[ "$want" = test ] && extra=".[test]"

# the same request as last time (pyproject.toml, the constraints, the extra, the venv's Python),
# with hora imported from this checkout, needs no pip run: hora is installed in editable mode,
# so code changes need none either
stamp="$venv/.hora-install-stamp"
key=$( { echo "$extra ${pip_c[*]}"; "$py" -VV; cat pyproject.toml "${constraint_files[@]}"; } \
  | sha256sum | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$key" ] && "$py" -c 'import hora, sys; sys.exit(not hora.__file__.startswith(sys.argv[1]))' \
    "$PWD/kernels/" 2>/dev/null; then
  say "pip: hora$([ "$want" = test ] && echo ' and its test tools') already installed as asked in $venv"
  exit 0
fi
rm -f "$stamp"
say "pip: installing hora$([ "$want" = test ] && echo ' and its test tools') into $venv"
# pip's own output goes to a log; a progress line every 25 packages shows it is moving (looked
# at every 5 s; pip's end is noticed within a second)
log="$venv/pip-install.log"
set +e
"$py" -m pip install --disable-pip-version-check --progress-bar off "${pip_c[@]}" -e "$extra" \
  >"$log" 2>&1 &
pid=$!
shown=0
installing=no
tick=0
while kill -0 "$pid" 2>/dev/null; do
  sleep 1
  tick=$(( tick + 1 ))
  [ $(( tick % 5 )) = 0 ] || continue
  m=$(grep -c -E '^(Collecting|Requirement already satisfied)' "$log" || true)
  if [ $(( m / 25 )) -gt $(( shown / 25 )) ]; then say "pip: $m packages resolved"; shown=$m; fi
  if [ "$installing" = no ] && grep -q '^Installing collected' "$log"; then
    say "pip: installing"; installing=yes
  fi
done
wait "$pid"
status=$?
set -e
if [ "$status" != 0 ]; then
  echo "install.sh: pip failed (exit $status); the end of its log ($log):" >&2
  grep -v '^WARNING: Location' "$log" | tail -20 >&2
  exit "$status"
fi
echo "$key" >"$stamp"
say "done: $("$py" -c 'import hora, torch; print("hora", hora.__version__, "torch", torch.__version__)')"
if [ -z "${VIRTUAL_ENV:-}" ]; then
  say "commands are in $venv/bin (source $venv/bin/activate to put them on PATH)"
fi
