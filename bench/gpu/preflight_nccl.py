"""GPU check step: the communication preflight's NCCL row (bench/gpu/check.py runs it).

With 2 or more GPUs, ``hvd.init(backend="nccl")`` and ``preflight.run()`` on 2 ranks (one per
GPU); the row's busbw compares with nccl-tests' ``all_reduce_perf``. A world of one has no
collective path to measure (NCCL refuses two ranks on one GPU), so on one GPU the step is
skipped, saying so. Prints the report's line and one JSON line with the NCCL row.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path


def rank(out: str) -> None:
    import hora.torch as hvd
    from hora.torch import preflight

    hvd.init(backend="nccl")
    preflight.run()  # warm-up
    report = preflight.run()
    if hvd.rank() == 0:
        Path(out).write_text(json.dumps({"report": report.to_dict(), "line": report.line()}))
    hvd.shutdown()


def main() -> int:
    import torch
    from hora.env import rank_env
    from hora.net import free_port

    n = min(2, torch.cuda.device_count())
    if n < 2:
        print(json.dumps({"step": "preflight_nccl", "pass": True, "skipped": "needs 2 GPUs: "
                          "a world of one has no collective path to measure"}))
        return 0
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="hora-gpu-preflight-") as tmp:
        out = str(Path(tmp, "report.json"))
        procs = [subprocess.Popen([sys.executable, __file__, "--rank", out],
                                  env={**os.environ, **rank_env(r, n, master_port=port)})
                 for r in range(n)]
        codes = [p.wait(timeout=240) for p in procs]
        if any(codes) or not Path(out).exists():
            print(json.dumps({"step": "preflight_nccl", "pass": False,
                              "summary": f"ranks exited {codes}"}))
            return 1
        got = json.loads(Path(out).read_text())
    print(got["line"])
    rows = [p for p in got["report"]["paths"] if p["path"] == "nccl"]
    row = rows[0] if rows else {}
    summary = (f"{n} rank(s): nccl busbw {row.get('busbw_gbps', [0])[-1]:.2f} GB/s at the "
               f"largest size, latency {row.get('latency_us', 0):.0f} us" if row else
               "no nccl row in the report")
    print(json.dumps({"step": "preflight_nccl", "pass": bool(row), "ranks": n, "row": row,
                      "summary": summary}))
    return 0 if row else 1


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--rank":
        rank(sys.argv[2])
        sys.exit(0)
    sys.exit(main())
