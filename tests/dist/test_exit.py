"""A rank that exits after ``hvd.init()`` keeps its own exit code and never aborts.

Before hora released the process group at exit, gloo's worker threads sometimes dropped the
last reference to a finished Work while Python was finalising; the thread's GIL request ended
it with ``pthread_exit``, and the unwinding through C++ aborted the whole process
("terminate called without an active exception", exit 134 instead of the script's code).
The race is rare per run, so the test runs 200 rank exits (100 two-rank worlds, four ways
of exiting) and also checks the cause directly: once hora's exit handler has run, no thread
but the main one is left.
"""

from __future__ import annotations

import subprocess
import sys
from collections import Counter
from pathlib import Path

from helpers.world import base_env

SCRIPT = Path(__file__).with_name("_exit_rounds.py")
WORLDS = 100


def test_200_rank_exits_keep_their_exit_codes_and_leave_no_threads(tmp_path: Path) -> None:
    out = tmp_path / "exits.txt"
    res = subprocess.run(
        [sys.executable, str(SCRIPT), str(out), str(WORLDS), "4"],
        env=base_env({"HORA_TIMEOUT": "20", "HORA_START_TIMEOUT": "60"}),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    rows = [line.split() for line in out.read_text().splitlines()]
    assert len(rows) == 2 * WORLDS
    wrong = [r for r in rows if r[3] != r[4]]
    aborts = [r for r in rows if r[4] in ("134", "-6")]
    assert not aborts, f"{len(aborts)} of {len(rows)} rank exits aborted: {aborts[:5]}"
    assert not wrong, f"exit codes differ from the script's: {wrong[:5]}"
    threads = Counter(r[5] for r in rows)
    left = [r for r in rows if r[5] != "1"][:5]  # their last column names the threads
    assert threads == {"1": len(rows)}, f"threads left after hora's exit handler: {left}"
    assert "terminate called" not in res.stderr
