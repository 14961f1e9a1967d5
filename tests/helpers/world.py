"""Run one test function on N real processes (CPU, gloo) and collect each rank's result.

Usage in a test module::

    def _rank_body(rank, size, arg):       # module level, not collected by pytest
        import hora.torch as hvd
        hvd.init()
        return hvd.rank()

    def test_x():
        results = run_world(__file__, "_rank_body", 2, args=(3,))
        assert results == [0, 1]

Each rank runs ``python tests/helpers/child.py FILE FUNC`` with the hora rank environment
(RANK, WORLD_SIZE, MASTER_ADDR, a free MASTER_PORT, ...) and, as hora's launchers give it, one
fresh ``HORA_RDZV_SECRET`` per world (``env`` may set its own, or ``""`` for none: a plain
torchrun's world). The function's return value must be picklable. A rank that raises makes
run_world raise WorldFailed with every rank's output.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from hora import net
from hora.env import RDZV_SECRET_VAR, new_rdzv_secret, rank_env

CHILD = Path(__file__).with_name("child.py")


class WorldFailed(AssertionError):
    def __init__(self, msg: str, returncodes: list[int | None], outputs: list[str]) -> None:
        super().__init__(msg)
        self.returncodes = returncodes
        self.outputs = outputs


def free_port() -> int:
    """A free port below the ephemeral range (hora.net's rule: see hora.net.free_port), so
    that no outgoing connection of another process (pip beside the suite in CI) takes it
    before the world's rank 0 binds it."""
    return net.free_port()


def base_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env.update({"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONHASHSEED": "0"})
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "HORA_LAUNCHER"):
        env.pop(k, None)
    if extra:
        env.update(extra)
    return env


def run_world(
    file: str,
    func: str,
    n: int,
    args: tuple[Any, ...] = (),
    env: dict[str, str] | None = None,
    timeout: float = 60.0,
    expect_failure: bool = False,
) -> list[Any]:
    """Start n ranks running FILE:FUNC(rank, n, *args); return results by rank.

    With expect_failure=True, returns a list of (returncode, output) per rank instead of
    raising, so error-path tests can assert on what each rank printed.
    """
    port = free_port()
    env = {RDZV_SECRET_VAR: new_rdzv_secret(), **(env or {})}
    with tempfile.TemporaryDirectory(prefix="hora-world-") as tmp:
        argfile = Path(tmp, "args.pkl")
        argfile.write_bytes(pickle.dumps(args))
        procs = []
        for r in range(n):
            e = base_env(env)
            e.update(rank_env(r, n, master_port=port))
            out = Path(tmp, f"out{r}.pkl")
            log = open(Path(tmp, f"log{r}.txt"), "w")  # noqa: SIM115
            cmd = [sys.executable, str(CHILD), file, func, str(argfile), str(out)]
            proc = subprocess.Popen(cmd, env=e, stdout=log, stderr=subprocess.STDOUT)
            procs.append((proc, log, out))
        codes: list[int | None] = []
        for p, log, _ in procs:
            try:
                codes.append(p.wait(timeout=timeout))
            except subprocess.TimeoutExpired:
                codes.append(None)
            log.close()
        for p, _, _ in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        outputs = [Path(tmp, f"log{r}.txt").read_text() for r in range(n)]
        if expect_failure:
            return list(zip(codes, outputs, strict=True))
        if any(c != 0 for c in codes):
            detail = "\n".join(
                f"--- rank {r} (exit {c}) ---\n{o[-4000:]}"
                for r, (c, o) in enumerate(zip(codes, outputs, strict=True))
            )
            raise WorldFailed(f"ranks failed: {codes}\n{detail}", codes, outputs)
        return [pickle.loads(out.read_bytes()) for _, _, out in procs]
