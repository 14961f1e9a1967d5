#!/usr/bin/env bash
# Install hora and what its tests need on a fresh machine (Debian/Ubuntu, Python >= 3.11).
#   scripts/install.sh          runtime only (service, JupyterLab, examples)
#   scripts/install.sh test     + test tools, Open MPI, Chromium (for the browser test)
# On a machine without a GPU, constraints/cpu.txt pins the CPU build of torch; set
# HORA_TORCH_CONSTRAINTS= (empty) on a GPU machine to get your CUDA build instead.
set -euo pipefail
cd "$(dirname "$0")/.."
want="${1:-run}"
constraints="${HORA_TORCH_CONSTRAINTS-constraints/cpu.txt}"
pip_c=()
[ -n "$constraints" ] && pip_c=(-c "$constraints")

apt_pkgs=()
if [ "$want" = test ]; then
  command -v mpirun >/dev/null || apt_pkgs+=(openmpi-bin)
  command -v chromium >/dev/null || apt_pkgs+=(chromium)
fi
if [ ${#apt_pkgs[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ]; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${apt_pkgs[@]}" >/dev/null
  else
    echo "install.sh: please install with apt: ${apt_pkgs[*]}" >&2
  fi
fi

extra=".[examples]"
[ "$want" = test ] && extra=".[test]"
python3 -m pip install -q --disable-pip-version-check "${pip_c[@]}" -e "$extra"
