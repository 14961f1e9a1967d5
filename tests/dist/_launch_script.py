"""The rank program test_launcher.py starts under ``hora run``; argv[1] picks the behaviour.

Modes (RANK comes from the launcher's environment):

* ``exit CODES DELAYS``: rank r prints to stdout and stderr, sleeps DELAYS[r] seconds and exits
  with CODES[r] (a code ``kill`` makes the rank SIGKILL itself). Lists are comma-separated.
* ``echo ARGS...``: prints its arguments, one per line, and a last line without a newline.
* ``signals DIR``: notes SIGINT/SIGTERM in DIR/got-RANK-SIGNAME and exits 0; writes
  DIR/pids-RANK and DIR/ready-RANK, then waits (at most 60 s).
* ``stubborn DIR``: like ``signals`` but ignores SIGINT and SIGTERM after noting them.
* ``orphans DIR``: starts two ``sleep`` children, one in the rank's process group and one in
  a session of its own, writes every pid to DIR/pids-RANK and DIR/ready-RANK; rank 1 then
  exits 3 (once rank 0 is ready), rank 0 ignores SIGTERM and waits to be killed.
* ``late-init``: rank 1 sleeps 60 s before ``hvd.init()``; rank 0 calls it at once.
* ``collectives``: a few named collectives and two DistributedOptimizer steps (timeline).
* ``world``: ``hvd.init()``, one allreduce, and a JSON line with what hora.torch detected.
* ``crash``: one allreduce, then rank 1 exits 3 while rank 0 waits to be stopped.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

RANK = int(os.environ.get("RANK", "-1"))


def _exit(codes: str, delays: str) -> None:
    print(f"hello from rank {RANK}", flush=True)
    print(f"warn {RANK}", file=sys.stderr, flush=True)
    time.sleep(float(delays.split(",")[RANK]))
    code = codes.split(",")[RANK]
    if code == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    sys.exit(int(code))


def _echo(args: list[str]) -> None:
    for a in args:
        print(f"arg:{a}")
    sys.stdout.write(f"no newline {RANK}")


def _ready(d: Path, pids: list[int]) -> None:
    Path(d, f"pids-{RANK}").write_text(" ".join(map(str, [os.getpid(), *pids])))
    Path(d, f"ready-{RANK}").touch()


def _signals(d: Path, stubborn: bool = False) -> None:
    def note(signum: int, frame: object) -> None:
        Path(d, f"got-{RANK}-{signal.Signals(signum).name}").touch()
        if not stubborn:
            sys.exit(0)

    signal.signal(signal.SIGINT, note)
    signal.signal(signal.SIGTERM, note)
    _ready(d, [])
    time.sleep(60)


def _orphans(d: Path) -> None:
    if RANK == 0:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the launcher must escalate to SIGKILL
    same_group = subprocess.Popen(["sleep", "300"])
    own_session = subprocess.Popen(["sleep", "300"], start_new_session=True)
    _ready(d, [same_group.pid, own_session.pid])
    if RANK == 1:
        deadline = time.monotonic() + 60
        while not Path(d, "ready-0").exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        sys.exit(3)
    time.sleep(60)


def _late_init() -> None:
    import hora.torch as hvd

    if RANK == 1:
        time.sleep(60)
    hvd.init()


def _collectives() -> None:
    import hora.torch as hvd
    import torch

    hvd.init()
    hvd.allreduce(torch.ones(1000), name="grad.w")
    hvd.broadcast(torch.ones(10, dtype=torch.float64), root_rank=0, name="bcast.b")
    hvd.allgather(torch.ones(hvd.rank() + 1, 4), name="gather.g")
    model = torch.nn.Linear(8, 2)
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters()
    )
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
    hvd.shutdown()


def _world() -> None:
    import hora.torch as hvd
    import torch

    hvd.init()
    total = hvd.allreduce(torch.tensor([float(hvd.rank() + 1)]), op=hvd.Sum, name="ranks")
    world = {
        "rank": hvd.rank(), "size": hvd.size(), "local_rank": hvd.local_rank(),
        "local_size": hvd.local_size(), "cross_size": hvd.cross_size(),
        "launcher": hvd._state.require_init("world").launcher, "sum": float(total),
    }  # fmt: skip
    sys.stdout.write("WORLD " + json.dumps(world) + "\n")  # one write: ranks share mpirun's stdout
    sys.stdout.flush()
    hvd.shutdown()


def _crash() -> None:
    import hora.torch as hvd
    import torch

    hvd.init()
    hvd.allreduce(torch.ones(16), name="grad.before_crash")
    hvd.barrier()  # rank 0 recorded the allreduce before it got here
    if RANK == 1:
        sys.exit(3)
    time.sleep(60)  # stopped by the launcher (SIGTERM) without reaching shutdown()


def main() -> None:
    mode, args = sys.argv[1], sys.argv[2:]
    if mode == "exit":
        _exit(*args)
    elif mode == "echo":
        _echo(args)
    elif mode in ("signals", "stubborn"):
        _signals(Path(args[0]), stubborn=mode == "stubborn")
    elif mode == "orphans":
        _orphans(Path(args[0]))
    elif mode == "late-init":
        _late_init()
    elif mode == "collectives":
        _collectives()
    elif mode == "world":
        _world()
    elif mode == "crash":
        _crash()
    else:
        raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    main()
