#!/usr/bin/env bash
# Before/after of hora's lead over DDP, side by side: two commits' sources each run their own
# bench/train_throughput.py (hora's DistributedOptimizer and DDP in the same 2 processes,
# interleaved rounds), alternately B A A B ... after one warm-up pair; prints each run's
# hora/DDP median ratio per shape and, per shape, the median over pairs of after / before
# (BENCH.md rule 1: the DDP rows of each run absorb the machine's state at that time).
# Both commits' sources run on this checkout's .venv.
#
# Usage: bench/train_ab.sh BEFORE AFTER [PAIRS=5] [ROUNDS=20] [SHAPES=large,small]
set -euo pipefail
cd "$(dirname "$0")/.."
py=$PWD/.venv/bin/python
before=$(git rev-parse "$1") after=$(git rev-parse "$2")
pairs=${3:-5} rounds=${4:-20} shapes=${5:-large,small}
tmp=$(mktemp -d /tmp/hora-train-ab.XXXXXX)
trap 'git worktree remove --force "$tmp/b" 2>/dev/null; git worktree remove --force "$tmp/a" 2>/dev/null; rm -rf "$tmp"' EXIT
git worktree add -q --detach "$tmp/b" "$before"
git worktree add -q --detach "$tmp/a" "$after"
run() {  # run SRC: that tree's JSON line (hora/DDP ratio per shape)
  (cd "$1" && PYTHONPATH="$1/kernels:$1/service" "$py" bench/train_throughput.py \
    --pairs "$rounds" --steps 1 --check-steps 2 --shapes "$shapes" 2>/dev/null | tail -1)
}
echo "hora/DDP samples/s (median of $rounds rounds, 2 ranks, gloo, 1 thread each) per run; load $(cut -d' ' -f1 /proc/loadavg)"
lines=()
for i in $(seq 0 "$pairs"); do
  if (( i % 2 )); then a=$(run "$tmp/a"); b=$(run "$tmp/b"); else b=$(run "$tmp/b"); a=$(run "$tmp/a"); fi
  label=$([ "$i" = 0 ] && echo warm-up || echo "$i")
  "$py" -c 'import json, sys; b, a = json.loads(sys.argv[2]), json.loads(sys.argv[3]); print(f"{sys.argv[1]:>8}  before {b[\"ratios\"]}  after {a[\"ratios\"]}  (A/A {b[\"aa_ratios\"]} / {a[\"aa_ratios\"]})")' "$label" "$b" "$a"
  [ "$i" = 0 ] || lines+=("$b" "$a")
done
"$py" - "${before:0:7}" "${after:0:7}" "${lines[@]}" <<'PY'
import json, statistics, sys
b_ref, a_ref, runs = sys.argv[1], sys.argv[2], [json.loads(x) for x in sys.argv[3:]]
pairs = list(zip(runs[0::2], runs[1::2]))
out = {}
for shape in pairs[0][0]["ratios"]:
    r = [a["ratios"][shape] / b["ratios"][shape] for b, a in pairs]
    out[shape] = {"before": statistics.median(b["ratios"][shape] for b, _ in pairs),
                  "after": statistics.median(a["ratios"][shape] for _, a in pairs),
                  "after_over_before": statistics.median(r), "min": min(r), "max": max(r)}
    print(f"{shape:>6}: hora/DDP {b_ref} {out[shape]['before']:.3f}, {a_ref} "
          f"{out[shape]['after']:.3f}; after/before median {statistics.median(r):.3f} "
          f"[{min(r):.3f}, {max(r):.3f}]")
print(json.dumps({"bench": "train_ab", "metric": "hora/DDP, after / before", "shapes": out}))
PY
