#!/usr/bin/env bash
# Before/after of hora.torch's init()/shutdown() cycle, side by side: two commits' sources run
# tests/dist/_reinit_rounds.py (init, a checked allreduce, barrier, shutdown; a handle or an
# optimizer left in flight every third round) under `hora run -np 2`, interleaved B A B A ...
# after one warm-up pair; prints rank 0's median round time per run and the median of the
# per-pair ratios A/B (BENCH.md rule 1). Both commits' sources run on this checkout's .venv.
#
# Usage: bench/reinit_ab.sh BEFORE AFTER [PAIRS=5] [ROUNDS=60]
set -euo pipefail
cd "$(dirname "$0")/.."
py=$PWD/.venv/bin/python
before=$(git rev-parse "$1") after=$(git rev-parse "$2") pairs=${3:-5} rounds=${4:-60}
tmp=$(mktemp -d /tmp/hora-reinit-ab.XXXXXX)
trap 'git worktree remove --force "$tmp/b" 2>/dev/null; git worktree remove --force "$tmp/a" 2>/dev/null; rm -rf "$tmp"' EXIT
git worktree add -q --detach "$tmp/b" "$before"
git worktree add -q --detach "$tmp/a" "$after"
run() {  # run SRC: rank 0's median round time (s)
  local out
  out=$(mktemp -d "$tmp/out.XXXXXX")
  (cd "$1" && OMP_NUM_THREADS=1 HORA_TIMEOUT=20 RES_OPTIONS="timeout:1 attempts:1" \
    PYTHONPATH="$1/kernels:$1/service" \
    "$py" -m hora.cli run -np 2 -- "$py" tests/dist/_reinit_rounds.py "$out" "$rounds" >/dev/null 2>&1)
  "$py" -c 'import json, statistics, sys; print(statistics.median(json.load(open(sys.argv[1] + "/rank0.json"))["times_s"]))' "$out"
}
echo "init/allreduce/barrier/shutdown rounds, 2 ranks (gloo, 1 thread each), $rounds rounds a run"
printf '%5s  %12s  %12s  %7s\n' pair "${before:0:7} s" "${after:0:7} s" ratio
ratios=()
for i in $(seq 0 "$pairs"); do
  b=$(run "$tmp/b") a=$(run "$tmp/a")
  r=$("$py" -c 'import sys; print(round(float(sys.argv[2]) / float(sys.argv[1]), 3))' "$b" "$a")
  if [ "$i" = 0 ]; then label=warm-up; else label=$i; ratios+=("$r"); fi
  printf '%5s  %12.4f  %12.4f  %7s\n' "$label" "$b" "$a" "$r"
done
"$py" -c 'import json, statistics, sys; r = [float(x) for x in sys.argv[1:]]; print(json.dumps({"bench": "reinit_ab", "metric": "median round time, after / before", "ratio": statistics.median(r), "min": min(r), "max": max(r)}))' "${ratios[@]}"
