"""The ``hora run`` subcommand: parse, launch, report (data plane).

``main(["run", "-np", "2", "--", "python", "train.py"])`` returns the exit code ``hora run``
exits with: 0, the first non-zero rank exit code, 128 + N after signal N, or 2 for bad
arguments. The launcher's own messages go to stderr prefixed ``hora run:``. Inside a
multi-node Slurm allocation it becomes one ``srun`` (:mod:`hora.launch.slurm`).
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Sequence

from hora.errors import HoraError, RankFailedError, SpecError
from hora.launch.config import PROG, make_parser, parse_args
from hora.launch.elastic import launch_elastic
from hora.launch.launcher import LaunchResult, launch
from hora.launch.slurm import allocation_nodes, srun_argv

log = logging.getLogger("hora.launch")


def _handler() -> logging.Handler:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(f"{PROG}: %(message)s"))
    return handler


def describe(result: LaunchResult) -> str | None:
    """Return the final line for a failed or interrupted run, or None after a success.

    Args:
        result: what :func:`hora.launch.launch` returned.

    Returns:
        E.g. ``"rank 1 on localhost failed with exit code 3"``.

    Example:
        >>> describe(LaunchResult(exit_code=0, exits=())) is None
        True
    """
    first = result.first_failure
    if first is not None:
        return str(RankFailedError(first.rank, first.code, host="localhost",
                                   others=result.also_failed))
    if result.signal is not None:
        return f"interrupted by signal {result.signal}; exit code {result.exit_code}"
    return None


def main(argv: Sequence[str]) -> int:
    """Run ``hora run`` with ``argv`` (``argv[0]`` is ``"run"``) and return its exit code.

    Args:
        argv: the subcommand and its arguments, e.g. ``["run", "-np", "2", "python", "x.py"]``.

    Returns:
        0 when every rank succeeded; the first non-zero rank exit code (death by signal N:
        128 + N); after a forwarded SIGINT/SIGTERM the ranks' status; 2 for bad arguments.

    Example:
        >>> main(["run", "-np", "1", "--", "true"])
        0
    """
    args = list(argv[1:] if argv[:1] == ["run"] else argv)
    if any(a in ("-h", "--help") for a in args[: _command_start(args)]):
        sys.stdout.write(make_parser().format_help())
        return 0
    try:
        config = parse_args(args)
    except SpecError as e:
        sys.stderr.write(f"{PROG}: error: {e}\n{PROG}: try `hora run --help`\n")
        return 2
    nodes = allocation_nodes(os.environ)
    if nodes > 1 and config.elastic is None:  # a multi-node Slurm allocation: Slurm starts them
        try:
            argv_srun = srun_argv(config.np, config.command, nodes)
        except SpecError as e:
            sys.stderr.write(f"{PROG}: error: {e}\n")
            return 2
        os.execvp(argv_srun[0], argv_srun)
    handler = _handler()
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False
    try:
        if config.elastic is not None:
            result = launch_elastic(config)
        else:
            result = launch(config, adopt_orphans=True)
    except HoraError as e:
        log.error("%s", e)
        return 1
    finally:
        log.removeHandler(handler)
    line = describe(result)
    if line:
        sys.stderr.write(f"{PROG}: {line}\n")
        sys.stderr.flush()
    return result.exit_code


def _command_start(args: list[str]) -> int:
    """Index where the rank command starts (so ``--help`` after it belongs to the script)."""
    if "--" in args:
        return args.index("--")
    flags_with_value = {"-np", "--num-proc", "--nproc-per-node", "--nproc_per_node", "-H",
                        "--hosts", "--timeline-filename", "--start-timeout", "--master-port",
                        "--backend", "--grace-period", "--min-np", "--max-np",
                        "--host-discovery-script", "--reset-limit", "--elastic-timeout",
                        "--host-file"}
    i = 0
    while i < len(args) and args[i].startswith("-"):
        if args[i] == "--blacklist-cooldown-range":
            i += 3
            continue
        i += 1 if "=" in args[i] or args[i] not in flags_with_value else 2
    return i
