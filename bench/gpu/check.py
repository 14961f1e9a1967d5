"""The GPU check's driver: each step in its own process, within a time budget, one report.

Steps (in this order; each a program that ends with one JSON line ``{"step": ..., "pass":
...}``, except the CUDA-marked tests, read from pytest's summary):

1. ``cuda_tests``: the tests marked ``cuda`` (``pytest -m cuda`` on the modules that mark
   any, so that collecting needs no more than hora's own dependencies).
2. ``nccl_world1``: hora.torch on NCCL at world size 1 (bench/gpu/nccl_world1.py).
3. ``notebook``: ``%%distributed -n 1`` on the GPU through nbclient; the model stays on the
   GPU between cells (bench/gpu/notebook_gpu.py).
4. ``optimizer_overhead``: DistributedOptimizer at 1 rank vs plain single-GPU training of
   the same model, interleaved; target overhead <= 2 % (bench/gpu/optimizer_overhead.py).
5. ``preflight_nccl``: the communication preflight's NCCL row (bench/gpu/preflight_nccl.py).
6. ``park_cuda``: park and resume CUDA tensors (bench/gpu/park_cuda.py, when parking exists;
   else skipped with "parking not built").
7. ``gpu_image``: ``hora image build --gpu``, then ``torch.cuda.is_available()`` in a
   container of it with the GPU (bench/gpu/image_gpu.py; needs a Docker engine).

Without a GPU (``nvidia-smi`` finds none, or torch sees none), and with ``--dry-run``, every
step is listed and skipped with the reason "no GPU" (its program must exist and compile, else
the step fails). ``--rehearse`` runs the steps that can on CPU instead (2, 3, 4 and 6, with
``--cpu``: gloo, a CPU model), so that they are known to work before a GPU comes. The report
(Markdown) has a table of the steps (status, seconds, what each found) and the tail of each
step's output; the last line printed is the benchmark JSON line. Exit status 1 when a step
failed.

Usage: bench/gpu/check.sh [--dry-run | --rehearse] [--report FILE] [--budget SECONDS]
                          [--image TAG]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

NO_GPU = "no GPU"
TAIL = 3000  # characters of each step's output kept in the report


@dataclass(frozen=True)
class Context:
    """What the steps are run with."""

    root: Path
    python: str
    gpus: int
    docker: bool
    image: str | None
    rehearse: bool = False


@dataclass(frozen=True)
class Step:
    """One check: its program (None: skipped, with the reason) and its time limit."""

    name: str
    title: str
    argv: Callable[[Context], tuple[list[str] | None, str]]
    timeout_s: int
    rehearsal: bool = False  # it has a --cpu form


@dataclass
class Result:
    """What one step did."""

    name: str
    title: str
    status: str  # pass, fail, skipped
    reason: str = ""
    seconds: float = 0.0
    figures: dict[str, Any] = field(default_factory=dict)
    tail: str = ""


def _script(name: str) -> Callable[[Context], tuple[list[str] | None, str]]:
    def argv(ctx: Context) -> tuple[list[str] | None, str]:
        cpu = ["--cpu"] if ctx.rehearse else []
        return [ctx.python, str(ctx.root / "bench" / "gpu" / name), *cpu], ""

    return argv


def cuda_test_files(root: Path) -> list[Path]:
    """The test modules that mark tests ``cuda`` (collecting only these needs only hora's own
    dependencies, not the whole suite's: a GPU machine has torch but not, say, playwright)."""
    return sorted(p for p in (root / "tests").rglob("test_*.py")
                  if "pytest.mark.cuda" in p.read_text(errors="replace"))


def _cuda_tests(ctx: Context) -> tuple[list[str] | None, str]:
    files = cuda_test_files(ctx.root)
    if not files:
        return None, "no test is marked cuda"
    return [ctx.python, "-m", "pytest", "-q", "-m", "cuda", "-p", "no:cacheprovider",
            *map(str, files)], ""


def _park(ctx: Context) -> tuple[list[str] | None, str]:
    script = ctx.root / "bench" / "gpu" / "park_cuda.py"
    if not script.is_file():
        return None, "parking not built (bench/gpu/park_cuda.py does not exist yet)"
    cpu = ["--cpu", "--mb", "32", "--pairs", "1"] if ctx.rehearse else []
    return [ctx.python, str(script), *cpu], ""


def _image(ctx: Context) -> tuple[list[str] | None, str]:
    if not ctx.docker:
        return None, "no Docker engine (docker info failed; set DOCKER_HOST)"
    extra = ["--image", ctx.image] if ctx.image else []
    return [ctx.python, str(ctx.root / "bench" / "gpu" / "image_gpu.py"), *extra], ""


STEPS = [
    Step("cuda_tests", "the CUDA-marked tests", _cuda_tests, 180),
    Step("nccl_world1", "hora.torch on NCCL, world size 1", _script("nccl_world1.py"), 60, True),
    Step("notebook", "%%distributed -n 1 on the GPU through nbclient",
         _script("notebook_gpu.py"), 120, True),
    Step("optimizer_overhead", "DistributedOptimizer at 1 rank vs plain single-GPU training",
         _script("optimizer_overhead.py"), 150, True),
    Step("preflight_nccl", "the preflight's NCCL row", _script("preflight_nccl.py"), 60),
    Step("park_cuda", "park/resume of CUDA tensors", _park, 120, True),
    Step("gpu_image", "hora image build --gpu, torch.cuda.is_available() inside", _image, 420),
]


def count_gpus() -> int:
    """GPUs ``nvidia-smi -L`` lists (0 without nvidia-smi or a driver)."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return 0
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return sum(1 for line in out.stdout.splitlines() if line.startswith("GPU "))


def torch_sees_gpu(python: str) -> bool:
    code = "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"
    try:
        return subprocess.run([python, "-c", code], timeout=120).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def docker_up() -> bool:
    docker = shutil.which("docker")
    if docker is None:
        return False
    try:
        return subprocess.run([docker, "info"], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def run_step(step: Step, ctx: Context, left_s: float) -> Result:
    """Run one step (or skip it, saying why) within ``min(its limit, left_s)``."""
    res = Result(step.name, step.title, "skipped")
    argv, why = step.argv(ctx)
    if ctx.gpus == 0 and not (ctx.rehearse and step.rehearsal):
        res.reason = NO_GPU
        broken = _broken(argv or [])
        if broken:
            res.status, res.reason = "fail", broken
        return res
    if argv is None:
        res.reason = why
        return res
    limit = min(step.timeout_s * (3 if ctx.rehearse else 1), left_s)
    if limit < 5:
        res.status, res.reason = "fail", "out of time: the budget was spent by the steps before"
        return res
    t0 = time.monotonic()
    try:
        proc = subprocess.run(argv, cwd=ctx.root, capture_output=True, text=True, timeout=limit)
        out, code = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as e:
        out = _text(e.stdout) + _text(e.stderr)
        code = None
    res.seconds = time.monotonic() - t0
    res.tail = out[-TAIL:]
    _judge(res, step, out, code, limit)
    return res


def _broken(argv: list[str]) -> str:
    """Why a step's program cannot run ("" when its scripts exist and compile)."""
    for arg in argv:
        if arg.endswith(".py"):
            try:
                compile(Path(arg).read_text(), arg, "exec")
            except (OSError, SyntaxError, ValueError) as e:
                return f"its program cannot run: {e}"
    return ""


def _text(b: bytes | str | None) -> str:
    return b.decode(errors="replace") if isinstance(b, bytes) else (b or "")


def _judge(res: Result, step: Step, out: str, code: int | None, limit: float) -> None:
    if code is None:
        res.status, res.reason = "fail", f"timed out after {limit:.0f} s"
        return
    if step.name == "cuda_tests":
        summary = [ln for ln in out.splitlines() if " in " in ln and ("passed" in ln or
                   "skipped" in ln or "failed" in ln or "error" in ln)]
        res.figures = {"summary": summary[-1].strip("= ") if summary else ""}
        res.status = "pass" if code == 0 else "fail"
        res.reason = res.figures["summary"] or f"pytest exit status {code}"
        return
    lines = [ln for ln in out.splitlines() if ln.startswith("{")]
    try:
        res.figures = json.loads(lines[-1]) if lines else {}
    except json.JSONDecodeError:
        res.figures = {}
    ok = code == 0 and bool(res.figures.get("pass"))
    res.status = "pass" if ok else "fail"
    if ok and res.figures.get("skipped"):
        res.status, res.reason = "skipped", str(res.figures["skipped"])
        return
    res.reason = str(res.figures.get("summary", "")) or (
        "" if ok else f"exit status {code}" + ("" if lines else ", no result line"))


def report(results: list[Result], ctx: Context, started: str, wall: float) -> str:
    head = [
        "# hora GPU check", "",
        f"- date: {started}; wall {wall:.0f} s; host {platform.node()}",
        f"- GPUs: {ctx.gpus}" + ("" if ctx.gpus else " (rehearsal on CPU: the steps with a CPU "
                                 "form ran with --cpu)" if ctx.rehearse else
                                 f" ({NO_GPU}: every step skipped)"),
        f"- command: `bench/gpu/check.sh {' '.join(sys.argv[1:])}`".replace(
            f"--root {ctx.root} ", ""),
        "", "| step | what | status | seconds | found |", "|---|---|---|---:|---|",
    ]
    rows = [f"| {r.name} | {r.title} | {r.status} | {r.seconds:.1f} | "
            f"{r.reason.replace('|', '/')} |" for r in results]
    tails = [f"\n## {r.name}\n\n```\n{r.tail}\n```" for r in results if r.tail]
    return "\n".join(head + rows + tails) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--root", type=Path, required=True, help=argparse.SUPPRESS)
    how = p.add_mutually_exclusive_group()
    how.add_argument("--dry-run", action="store_true", help="list the steps, skip each (no GPU)")
    how.add_argument("--rehearse", action="store_true", help="run the steps that can on CPU")
    p.add_argument("--report", type=Path, default=Path("hora-gpu-check.md"))
    p.add_argument("--budget", type=float, default=None,
                   help="seconds for every step (default 480; a rehearsal 1200)")
    p.add_argument("--image", help="check this image instead of building hora:gpu")
    args = p.parse_args(argv)
    budget = args.budget or (1200.0 if args.rehearse else 480.0)
    started = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    t0 = time.monotonic()
    gpus = 0 if (args.dry_run or args.rehearse) else count_gpus()
    if gpus and not torch_sees_gpu(sys.executable):
        gpus = 0
    ctx = Context(args.root, sys.executable, gpus, gpus > 0 and docker_up(), args.image,
                  args.rehearse)
    results = []
    for step in STEPS:
        res = run_step(step, ctx, budget - (time.monotonic() - t0))
        print(f"{res.name:<20} {res.status:<8} {res.seconds:6.1f}s  {res.reason}", flush=True)
        results.append(res)
    wall = time.monotonic() - t0
    args.report.write_text(report(results, ctx, started, wall))
    failed = [r.name for r in results if r.status == "fail"]
    passed = sum(r.status == "pass" for r in results)
    print(f"report: {args.report.resolve()}")
    print(json.dumps({"bench": "gpu_check", "metric": "steps passed", "hora": passed,
                      "baseline": None, "ratio": None, "target": len(STEPS), "pass": not failed,
                      "gpus": gpus, "wall_s": round(wall, 1), "failed": failed,
                      "steps": {r.name: r.status for r in results}}))
    return 1 if failed else 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
