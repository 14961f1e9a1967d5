"""Cost and figures of the communication preflight (hora.torch.preflight) on CPU + gloo.

For 2 and 3 ranks on this machine: ``hvd.init()``, one warm-up preflight, then REPS timed
preflights back to back; the cost is each preflight's ``seconds`` (the slowest rank's time
in it, gathering included). Prints a table of the cost (median, min, max) and the figures of
the last run (per path: busbw at the largest size, latency, the links' range), then one JSON
line. **Target:** the median cost is at most 1 s (the issue: "well under a second").

Not a side-by-side ratio: there is no baseline tool to run the same check; the busbw rows are
for comparison with ``bench/allreduce.py``'s gloo rows.

    python bench/preflight.py            # 2 and 3 ranks, 7 runs each
    python bench/preflight.py --quick    # 2 ranks, 3 runs
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))


def worker(out: str, reps: int) -> None:
    import hora.torch as hvd
    import torch
    from hora.torch import preflight

    torch.set_num_threads(1)
    hvd.init()
    preflight.run()  # warm-up
    costs, report = [], None
    for _ in range(reps):
        report = preflight.run()
        costs.append(report.seconds)
    if hvd.rank() == 0 and report is not None:
        Path(out).write_text(json.dumps({"costs": costs, "report": report.to_dict(),
                                         "line": report.line()}))
    hvd.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--out", default="")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    if args.worker:
        worker(args.out, args.reps)
        return
    from _world import run_ranks

    sizes = (2,) if args.quick else (2, 3)
    reps = 3 if args.quick else args.reps
    medians = []
    print(f"{'ranks':>5} {'median s':>9} {'min s':>7} {'max s':>7}  path rows (busbw at 4 MiB, "
          "latency, links)")
    for n in sizes:
        res = run_ranks(__file__, n, ["--reps", str(reps)])
        c = res["costs"]
        medians.append(statistics.median(c))
        rows = []
        for p in res["report"]["paths"]:
            links = p["links"]
            span = (f", links {min(k['gbps'] for k in links):.2f}-"
                    f"{max(k['gbps'] for k in links):.2f} GB/s" if links else "")
            rows.append(f"{p['path']} {p['busbw_gbps'][-1]:.2f} GB/s, "
                        f"{p['latency_us']:.0f} us{span}")
        print(f"{n:>5} {statistics.median(c):>9.3f} {min(c):>7.3f} {max(c):>7.3f}  "
              + "; ".join(rows))
        print(f"      {res['line']}")
    worst = max(medians)
    print(json.dumps({"bench": "preflight", "metric": "seconds per preflight (median)",
                      "hora": round(worst, 3), "baseline": None, "ratio": None,
                      "target": 1.0, "pass": worst <= 1.0}))
    sys.exit(0 if worst <= 1.0 else 1)


if __name__ == "__main__":
    main()
