"""Elastic training: recovery from a SIGKILL, hora's repair vs torchrun's restart-everything.

Protocol (../shared/BENCH.md): the same script (bench/_elastic_worker.py: the digits CNN,
batch 32 per worker, SGD with momentum, ElasticSampler, ``state.commit()`` and a checkpoint
file every 5 steps) runs under

* ``hora``: ``hora run -np 3 --min-np 2 --max-np 3`` (survivors re-form the world from the last
  commit in memory; a replacement joins at a later commit);
* ``torchrun``: ``torchrun --standalone --nproc_per_node 3 --max-restarts 3`` (the agent
  stops every worker and starts them all again; they resume from the checkpoint file),

interleaved (hora, torchrun, then torchrun, hora, ...). In each run the worker of rank 1 is
SIGKILLed once the job passed step ``--kill-at``. From the workers' event logs:

* ``know``: kill -> the last survivor's failed collective raised (hora; torchrun's survivors
  are stopped by its agent instead: no figure);
* ``resume``: kill -> the first training step after the world re-formed (hora: at size 2;
  torchrun: the restarted workers' first step);
* ``full``: kill -> the world is back to 3 workers (hora: the replacement joined);
* ``lost``: committed steps lost (the last commit before the kill minus the step training
  went back to; target 0); ``redone``: steps done after that commit, done again;
* ``kept``: survivors that kept their process (pids before and after the kill);
* ``job``: the whole job's wall time.

Correctness first: every run must end at ``--steps`` with no committed step lost.

Steady state (same protocol, in one ``hora run -np 2`` job): blocks of 40 steps alternately
with a commit every N steps and without, for N in ``--commit-every`` (a sweep); ratio =
samples/s with commits / without, per pair; the commit's own time is reported.

Targets: know <= 5 s, resume <= 10 s (median over runs), lost = 0, steady-state ratio >= 0.97
at N = 10.

``--steady-only`` runs the steady state alone at N = 10, with ``--steady-pairs`` pairs (the
spread of a pair is large on a shared machine: take 20 or more for a firm figure).

Usage: python bench/elastic.py [--quick] [--pairs 5] [--steps 600] [--kill-at 40]
       [--steady-only] [--steady-pairs 20] [--block 40]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).parent
WORKER = HERE / "_elastic_worker.py"
RUN_TIMEOUT_S = 600


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("HOROVOD_", "RANK", "WORLD_SIZE", "MASTER_", "HORA_"))}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", HORA_BACKEND="gloo")
    return env


def _events(out: Path) -> list[dict[str, Any]]:
    evs = []
    for path in out.glob("events.*"):
        evs += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return sorted(evs, key=lambda e: e["t"])


def _argv(kind: str, steps: int, out: Path) -> list[str]:
    script = [sys.executable, str(WORKER), str(out), "recover", "--steps", str(steps)]
    if kind == "hora":
        return [sys.executable, "-m", "hora.cli", "run", "-np", "3", "--min-np", "2",
                "--max-np", "3", "--", *script]  # fmt: skip
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
            "3", "--max-restarts", "3", "--monitor-interval", "0.1", *script[1:]]  # fmt: skip


def recover_run(kind: str, steps: int, kill_at: int) -> dict[str, Any]:
    """One job with one SIGKILL; return its figures."""
    with tempfile.TemporaryDirectory(prefix="hora-bench-elastic-") as tmp:
        out = Path(tmp)
        t0 = time.time()
        proc = subprocess.Popen(_argv(kind, steps, out), env=_env(), cwd=out,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
        victim, t_kill = _kill_when(out, kill_at, proc)
        code = proc.wait(timeout=RUN_TIMEOUT_S)
        evs = _events(out)
    return _figures(kind, evs, victim, t_kill, code, time.time() - t0, steps)


def _kill_when(out: Path, kill_at: int, proc: subprocess.Popen[bytes]) -> tuple[int, float]:
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while time.monotonic() < deadline and proc.poll() is None:
        evs = _events(out)
        if any(e["kind"] == "step" and e["step"] >= kill_at for e in evs):
            victim = next(e["pid"] for e in evs if e["kind"] == "start" and e["rank"] == "1")
            t_kill = time.time()
            os.kill(victim, signal.SIGKILL)
            return victim, t_kill
        time.sleep(0.02)
    raise RuntimeError("the job ended or stalled before the kill step")


def _figures(kind: str, evs: list[dict[str, Any]], victim: int, t_kill: float, code: int,
             took: float, steps: int) -> dict[str, Any]:  # fmt: skip
    before = [e for e in evs if e["t"] < t_kill]
    after = [e for e in evs if e["t"] >= t_kill]
    committed = max((e["step"] for e in before if e["kind"] == "commit"), default=0)
    done_before = max((e["step"] for e in before if e["kind"] == "step"), default=0)
    back = [e for e in after if e["kind"] in ("reset", "restored")]
    restored = back[0]["step"] if back else -1
    # steps after the world re-formed (survivors may finish a step or two before they know)
    again = [e for e in after if e["kind"] == "step" and back and e["t"] > back[0]["t"]]
    resumed = again[0]["t"] if again else None
    detect = [e["t"] for e in after if e["kind"] == "detect"]
    full = next((e["t"] for e in again if e["size"] == 3), None)
    old = {e["pid"] for e in before if e["kind"] == "step"} - {victim}
    kept = len(old & {e["pid"] for e in again})
    final = max((e["step"] for e in evs if e["kind"] == "done"), default=0)
    return {
        # a commit that completed as the kill came is logged after it: restored > committed
        "kind": kind, "ok": code == 0 and final == steps and restored >= committed,
        "know_s": (max(detect) - t_kill) if kind == "hora" and detect else None,
        "resume_s": (resumed - t_kill) if resumed else None,
        "full_s": (full - t_kill) if full else None,
        "lost": max(0, committed - restored) if restored >= 0 else None,
        "redone": max(0, done_before - restored), "kept": kept, "survivors": len(old),
        "job_s": took, "exit": code,
    }


def steady_state(intervals: list[int], pairs: int, block: int = 40) -> list[dict[str, Any]]:
    """For each commit interval, one 2-worker job of alternating blocks; return the figures."""
    rows = []
    for n in intervals:
        with tempfile.TemporaryDirectory(prefix="hora-bench-elastic-") as tmp:
            argv = [sys.executable, "-m", "hora.cli", "run", "-np", "2", "--min-np", "1", "--",
                    sys.executable, str(WORKER), tmp, "throughput", "--commit-every", str(n),
                    "--pairs", str(pairs), "--block", str(block)]  # fmt: skip
            subprocess.run(argv, env=_env(), check=True, timeout=RUN_TIMEOUT_S,
                           stdout=subprocess.DEVNULL)  # fmt: skip
            res = json.loads(Path(tmp, "throughput.json").read_text())
        el = [v for k, v in res["blocks"] if k == "elastic"]
        pl = [v for k, v in res["blocks"] if k == "plain"]
        ratios = [a / b for a, b in zip(el, pl, strict=True)]
        rows.append({"every": n, "elastic": statistics.median(el), "plain": statistics.median(pl),
                     "ratio": statistics.median(ratios), "min": min(ratios), "max": max(ratios),
                     "ratios": ratios,
                     "commit_ms": 1e3 * statistics.median(res["commit_s"])})  # fmt: skip
    return rows


def _steady_table(rows: list[dict[str, Any]], block: int) -> None:
    print(f"\nsteady state, 2 workers, blocks of {block} steps; ratio = with commits / without")
    print(f"{'every':>6} {'elastic':>9} {'plain':>9} {'ratio':>6} {'min':>6} {'max':>6} "
          f"{'commit':>8}  (samples/s, ms)")
    for r in rows:
        print(f"{r['every']:>6} {r['elastic']:9.0f} {r['plain']:9.0f} {r['ratio']:6.3f} "
              f"{r['min']:6.3f} {r['max']:6.3f} {r['commit_ms']:8.2f}")


def steady_only(pairs: int, block: int) -> int:
    """The steady state alone (a commit every 10 steps), ``pairs`` pairs: print, JSON line."""
    import torch

    print(f"elastic steady state, 2 workers, gloo, 1 thread each, torch {torch.__version__}, "
          f"{os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}; {pairs} pairs after 1 warm-up")
    (row,) = steady_state([10], pairs, block)
    _steady_table([row], block)
    print(f"pairs {pairs}: per-pair ratios " + " ".join(f"{r:.3f}" for r in row["ratios"]))
    q1, q3 = statistics.quantiles(row["ratios"], n=4)[0::2]
    print(f"median {row['ratio']:.3f}, interquartile {q1:.3f}..{q3:.3f}; target >= 0.97")
    print(json.dumps({
        "bench": "elastic_steady", "metric": "samples/s, commit every 10 steps / no commits",
        "hora": round(row["elastic"], 1), "baseline": round(row["plain"], 1),
        "ratio": round(row["ratio"], 4), "ratio_min": round(row["min"], 4),
        "ratio_max": round(row["max"], 4), "iqr": [round(q1, 4), round(q3, 4)],
        "pairs": pairs, "commit_ms": round(row["commit_ms"], 3), "target": 0.97,
        "pass": row["ratio"] >= 0.97,
    }))  # fmt: skip
    return 0 if row["ratio"] >= 0.97 else 1


def _fmt(v: float | None) -> str:
    return "   -  " if v is None else f"{v:6.2f}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="1 pair, shorter jobs (< 60 s idle)")
    p.add_argument("--pairs", type=int, default=5)
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--kill-at", type=int, default=40)
    p.add_argument("--steady-only", action="store_true", help="only the steady state, N = 10")
    p.add_argument("--steady-pairs", type=int, default=20)
    p.add_argument("--block", type=int, default=40, help="steps per steady-state block")
    a = p.parse_args()
    if a.steady_only:
        return steady_only(a.steady_pairs, a.block)
    pairs, steps, kill_at = (1, 100, 22) if a.quick else (a.pairs, a.steps, a.kill_at)
    import torch

    print(f"elastic recovery, 3 workers, gloo, 1 thread each, torch {torch.__version__}, "
          f"{os.cpu_count()} cores; SIGKILL of rank 1 after step {kill_at} of {steps}")
    runs = []
    for i in range(pairs):
        for kind in (("hora", "torchrun") if i % 2 == 0 else ("torchrun", "hora")):
            runs.append(recover_run(kind, steps, kill_at))
    print(f"{'run':>9} {'ok':>3} {'know':>6} {'resume':>6} {'full':>6} {'lost':>4} "
          f"{'redone':>6} {'kept':>5} {'job':>6}  (seconds)")
    for r in runs:
        print(f"{r['kind']:>9} {'yes' if r['ok'] else 'NO':>3} {_fmt(r['know_s'])} "
              f"{_fmt(r['resume_s'])} {_fmt(r['full_s'])} {r['lost']!s:>4} {r['redone']:>6} "
              f"{r['kept']:>2}/{r['survivors']:<2} {r['job_s']:6.1f}")
    med = {k: {f: statistics.median([r[f] for r in runs if r["kind"] == k and r[f] is not None]
                                    or [float("nan")])
               for f in ("know_s", "resume_s", "full_s", "job_s")}
           for k in ("hora", "torchrun")}  # fmt: skip
    print("median   " + "  ".join(f"{k}: resume {m['resume_s']:.2f} s, full {m['full_s']:.2f} s,"
                                  f" job {m['job_s']:.1f} s" for k, m in med.items()))
    rows = steady_state([1, 10, 50] if not a.quick else [10], pairs + 1 if a.quick else pairs)
    _steady_table(rows, 40)
    ten = next(r for r in rows if r["every"] == 10)
    ok = all(r["ok"] for r in runs) and all(r["lost"] == 0 for r in runs)
    know, resume = med["hora"]["know_s"], med["hora"]["resume_s"]
    passed = ok and know <= 5 and resume <= 10 and ten["ratio"] >= 0.97
    print(json.dumps({
        "bench": "elastic", "metric": "seconds from SIGKILL to training resumed (median)",
        "hora": round(resume, 3), "baseline": round(med["torchrun"]["resume_s"], 3),
        "ratio": round(med["torchrun"]["resume_s"] / resume, 2), "target": 10.0,
        "know_s": round(know, 3), "steady_ratio_every10": round(ten["ratio"], 4),
        "commit_ms": round(ten["commit_ms"], 3), "lost": [r["lost"] for r in runs],
        "pass": passed,
    }))
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
