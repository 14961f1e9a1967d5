"""Many short worlds that call ``hvd.init()`` and exit: the rank program of test_exit.py.

``python _exit_rounds.py OUT WORLDS PARALLEL`` imports torch once, then forks worlds of two
ranks (``PARALLEL`` at a time, each on its own port, with the environment ``hora run`` gives a
rank) until ``WORLDS`` have run. Forking keeps 200 exits within seconds; each child is a
normal interpreter that finalises as a script does. World ``i`` exits the way ``MODES[i % 4]``
says, with ``EXIT_CODE`` (or 1 for the exception):

* ``exit``: ``sys.exit(EXIT_CODE)`` right after a collective;
* ``end``: the script ends (``os._exit`` is never used: exit code 0 is expected);
* ``shutdown``: ``hvd.shutdown()`` and then ``sys.exit(EXIT_CODE)``;
* ``raise``: an uncaught exception (exit code 1).

Every rank registers, before ``hvd.init()``, an atexit handler that runs after hora's own
and writes how many threads the process still has: gloo's worker threads must be gone by then
(a worker thread that drops a finished Work while Python finalises aborts the process, the
"terminate called without an active exception" exit 134). One line per rank goes to OUT:
``world rank mode expected exit_code threads_at_exit other_thread_names``.
"""

from __future__ import annotations

import atexit
import gc
import os
import socket
import sys

import torch

import hora.torch as hvd
from hora.env import rank_env
from hora.net import free_port

MODES = ("exit", "end", "shutdown", "raise")
EXIT_CODE = 3
EXPECTED = {"exit": EXIT_CODE, "end": 0, "shutdown": EXIT_CODE, "raise": 1}


def _free_port() -> int:
    return free_port()  # below the ephemeral range: no outgoing connection takes it meanwhile


def _threads_file(out: str, world: int, rank: int) -> str:
    return f"{out}.w{world}r{rank}"


def _rank(out: str, world: int, rank: int, port: int) -> None:
    """The body of one forked rank; it never returns (it exits as the mode says)."""
    os.environ.update(rank_env(rank, 2, master_port=port))  # a fresh child, not a server

    def note_threads() -> None:
        tasks = os.listdir("/proc/self/task")
        names = []  # the other threads' names, so that a failure says whose thread is left
        for tid in tasks:
            try:
                if int(tid) != os.getpid():
                    with open(f"/proc/self/task/{tid}/comm") as comm:
                        names.append(comm.read().strip().replace(" ", "_") or "?")
            except FileNotFoundError:  # it ended since the listing: still counted as left
                names.append("ended")
        with open(_threads_file(out, world, rank), "w") as f:
            f.write(f"{len(tasks)} {','.join(names) or '-'}")

    atexit.register(note_threads)  # before init(): runs after hora's own handler
    mode = MODES[world % len(MODES)]
    hvd.init()
    hvd.allreduce(torch.ones(4), name=f"w{world}")
    if mode == "shutdown":
        hvd.shutdown()
    if mode == "raise":
        raise RuntimeError("the script failed")
    if mode != "end":
        sys.exit(EXIT_CODE)
    sys.exit()  # "end": what falling off the end of a script does


def _start_world(out: str, world: int) -> list[int]:
    port = _free_port()
    pids = []
    for rank in range(2):
        pid = os.fork()
        if pid == 0:  # the child's exit unwinds through here to a normal finalisation
            _rank(out, world, rank, port)
        pids.append(pid)
    return pids


def main() -> None:
    # the children's collections then skip torch's objects: exits take 2 s less each
    gc.freeze()
    out, worlds, parallel = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    running: dict[int, tuple[int, int]] = {}  # pid -> (world, rank)
    lines = []
    started = 0
    while started < worlds or running:
        while started < worlds and len(running) < 2 * parallel:
            for rank, pid in enumerate(_start_world(out, started)):
                running[pid] = (started, rank)
            started += 1
        pid, status = os.wait()
        world, rank = running.pop(pid)
        mode = MODES[world % len(MODES)]
        code = os.waitstatus_to_exitcode(status)
        try:
            with open(_threads_file(out, world, rank)) as f:
                threads = f.read()
        except FileNotFoundError:
            threads = "-1 -"
        lines.append(f"{world} {rank} {mode} {EXPECTED[mode]} {code} {threads}\n")
    with open(out, "w") as f:
        f.writelines(lines)


if __name__ == "__main__":
    main()
