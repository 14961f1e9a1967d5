"""``hora submit / jobs / status / logs / cancel / gpus``: the job service from a terminal.

Data plane: a thin layer over :class:`hora.client.Client` (parse arguments into a
:class:`hora.spec.JobSpec`, call the service, print a readable table). URL and token come from
``--url``/``--token``, else ``HORA_URL``/``HORA_TOKEN``, else ``~/.hora/config``. A token
on the command line shows in ``ps`` to every user of the machine: prefer the config file or
``HORA_TOKEN``, or ``--token -``, which reads it from the first line of stdin.

``hora submit --wait`` prints state changes on stderr and rank 0's log on stdout until the job
ends, then exits 0 (succeeded), 1 (failed) or 130 (cancelled). ``hora logs`` of a rank that
wrote nothing prints nothing on stdout, says so on stderr, and exits 0. Errors exit 1 with one
line on stderr; usage errors exit 2. On a service without GPUs, workers hold "slots".
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
from collections.abc import Callable, Sequence
from typing import Any, TextIO

from hora.client import Client, Job, JobInfo, JobWaitTimeout, parse_spec
from hora.errors import HoraError, SpecError
from hora.export import DEFAULT_EXPORT, with_export
from hora.jobs_text import (
    age,
    empty_log_note,
    format_table,
    gpus_table,
    jobs_table,
    new_state_lines,
    scaling_text,
    slot_unit,
    state_cell,
    state_line,
    status_text,
    workers_cell,
)
from hora.spec import JobState, Priority

__all__ = [
    "age",
    "build_parser",
    "cmd_cancel",
    "cmd_gpus",
    "cmd_jobs",
    "cmd_logs",
    "cmd_scaling",
    "cmd_status",
    "cmd_submit",
    "empty_log_note",
    "follow_job",
    "format_table",
    "gpus_table",
    "jobs_table",
    "main",
    "parse_elastic",
    "parse_env",
    "read_token",
    "scaling_text",
    "slot_unit",
    "spec_from_args",
    "state_cell",
    "state_line",
    "status_text",
    "workers_cell",
]

CANCEL_WAIT_S = 30.0  # how long hora cancel waits for a job's ranks to stop
STOPPING = "cancelling (its ranks are stopping)"  # what hora cancel says of one still stopping
EXIT_FOR_STATE = {JobState.succeeded: 0, JobState.failed: 1, JobState.cancelled: 130}
EXIT_INTERRUPTED = 130


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", help="service URL (default: HORA_URL or ~/.hora/config)")
    p.add_argument(
        "--token",
        help="bearer token; - reads it from stdin (default: HORA_TOKEN or ~/.hora/config; "
        "a token given here shows in ps)",
    )


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every job subcommand (``prog`` is ``hora``).

    Returns:
        The parser; ``args.cmd`` names the subcommand.

    Example:
        >>> build_parser().parse_args(["cancel", "7"]).job_id
        [7]
    """
    parser = argparse.ArgumentParser(prog="hora", description="Use the hora job service.")
    sub = parser.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser(
        "submit",
        help="submit a job",
        description=(
            "Submit COMMAND (after --) as a job. With --wait, exit 0 if it succeeded, "
            "1 if it failed, 130 if it was cancelled."
        ),
    )
    s.add_argument("--workers", "-w", type=int, default=None, help="processes (ranks), default 1")
    s.add_argument(
        "--elastic",
        default=None,
        metavar="MIN:MAX",
        help="an elastic job of MIN to MAX workers (hora.torch.elastic; see docs/elastic.md)",
    )
    s.add_argument("--gpus", type=int, default=1, help="GPUs (or CPU slots) per worker, default 1")
    s.add_argument("--name", default="job", help="job name")
    s.add_argument(
        "--env", "-e", action="append", default=[], metavar="K=V", help="env var (repeat)"
    )
    s.add_argument("--priority", choices=[p.value for p in Priority], default="normal")
    s.add_argument("--max-retries", type=int, default=0, help="retries after a failed attempt")
    s.add_argument("--timeout", type=float, default=None, help="seconds before the job is killed")
    s.add_argument(
        "--workdir",
        default=None,
        help="working directory of the ranks (default: this directory when it lies under the "
        "service's work root, else the service's default)",
    )
    s.add_argument(
        "--export",
        default=",".join(DEFAULT_EXPORT),
        metavar="NAMES|NONE",
        help="what the job takes from here, as sbatch --export: these variables (default "
        f"{','.join(DEFAULT_EXPORT)}) and this directory; NONE: nothing (the service's "
        "environment and default working directory)",
    )
    s.add_argument(
        "--submission-id", default=None, help="idempotency key: resubmitting returns the same job"
    )
    s.add_argument(
        "--image", default=None, help="container image: the job runs in it (docker runtime)"
    )
    s.add_argument(
        "--runtime",
        default=None,
        help="local, docker or slurm (default: docker with --image, else local)",
    )
    s.add_argument(
        "--wait", action="store_true", help="follow progress and rank 0's log until the end"
    )
    s.add_argument("command", nargs=argparse.REMAINDER, help="-- program and arguments")
    j = sub.add_parser("jobs", help="list jobs (newest first)")
    j.add_argument("--state", choices=[s.value for s in JobState], help="only jobs in this state")
    j.add_argument("--all", action="store_true", help="every job, not just the latest --limit")
    j.add_argument("--limit", type=int, default=20, help="how many to show (default 20)")
    st = sub.add_parser("status", help="show one job")
    st.add_argument("job_id", type=int)
    st.add_argument("--json", action="store_true", help="print the raw JSON record")
    lg = sub.add_parser("logs", help="print (or follow with -f) one rank's log")
    lg.add_argument("job_id", type=int)
    lg.add_argument("--follow", "-f", action="store_true", help="keep printing until the job ends")
    lg.add_argument("--rank", "-r", type=int, default=0, help="which rank (default 0)")
    lg.add_argument("--attempt", type=int, default=None, help="which attempt (default: current)")
    c = sub.add_parser(
        "cancel", help="cancel jobs; print the state each ends in (waiting up to --wait s)"
    )
    c.add_argument("job_id", type=int, nargs="+")
    c.add_argument("--wait", type=float, default=CANCEL_WAIT_S, metavar="S",
                   help=f"seconds to wait for the ranks to stop (default {CANCEL_WAIT_S:g})")
    sub.add_parser("gpus", help="show GPUs/slots and which job holds each")
    sc = sub.add_parser(
        "scaling",
        help="a job's scaling report, from its timeline",
        description="Per rank: wall time, time in collectives and waiting, bytes reduced, "
        "bandwidth against the preflight's; the slowest rank and why; the estimated scaling "
        "efficiency. The job must set HOROVOD_TIMELINE in its env.",
    )
    sc.add_argument("job_id", type=int)
    sc.add_argument("--json", action="store_true", help="print the raw JSON report")
    for p in sub.choices.values():
        _common(p)
    return parser


def parse_env(pairs: Sequence[str]) -> dict[str, str]:
    """Turn ``["K=V", ...]`` into a dict.

    Args:
        pairs: ``K=V`` strings.

    Returns:
        The environment mapping.

    Raises:
        SpecError: a pair has no ``=`` (field ``env``).

    Example:
        >>> parse_env(["A=1", "B=x=y"])
        {'A': '1', 'B': 'x=y'}
    """
    env = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise SpecError("env", f"{pair!r} is not KEY=VALUE")
        env[key] = value
    return env


def parse_elastic(text: str) -> dict[str, int]:
    """``hora submit --elastic MIN:MAX`` as the spec's ``elastic`` field.

    Raises:
        SpecError: it is not two whole numbers.

    Example:
        >>> parse_elastic("2:4")
        {'min_workers': 2, 'max_workers': 4}
    """
    low, sep, high = text.partition(":")
    if not sep or not low.strip().isdigit() or not high.strip().isdigit():
        raise SpecError("elastic", f"{text!r} is not MIN:MAX (e.g. 2:4)")
    return {"min_workers": int(low), "max_workers": int(high)}


def spec_from_args(args: argparse.Namespace) -> Any:
    """Build the :class:`JobSpec` of ``hora submit`` from its parsed arguments.

    Raises:
        SpecError: no command after ``--``, or an invalid field.
    """
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise SpecError("command", "give the program after --, e.g. hora submit -- python train.py")
    data: dict[str, Any] = {
        "name": args.name,
        "command": command,
        "workers": args.workers,
        "gpus_per_worker": args.gpus,
        "env": parse_env(args.env),
        "priority": args.priority,
        "max_retries": args.max_retries,
        "timeout_s": args.timeout,
        "working_dir": args.workdir,
        "submission_id": args.submission_id,
        "image": args.image,
        "runtime": args.runtime,  # none given: the spec's default (docker with an image)
        "elastic": parse_elastic(args.elastic) if args.elastic is not None else None,
    }
    given = {k: v for k, v in data.items() if v is not None}
    return parse_spec(with_export(given, args.export))


def _out(stream: TextIO, text: str) -> None:
    stream.write(text)
    stream.flush()


def follow_job(job: Job, rank: int, out: TextIO, err: TextIO) -> JobInfo:
    """Print state changes (to ``err``) and ``rank``'s log (to ``out``) until the job ends.

    Returns:
        The final record.
    """
    shown = 0

    def on_state(info: JobInfo) -> None:
        nonlocal shown
        for line in new_state_lines(info, shown):
            _out(err, line)
        shown = max(shown, len(info.transitions))

    for text in job.follow(rank, on_state=on_state):
        _out(out, text)
    return job.info or job.status()


def _client(args: argparse.Namespace) -> Client:
    return Client(args.url, read_token(args.token, sys.stdin))


def read_token(given: str | None, stdin: TextIO) -> str | None:
    """The ``--token`` value; ``-`` means the first line of ``stdin`` (kept out of ``ps``).

    Raises:
        SpecError: ``-`` and stdin has no token.

    Example:
        >>> import io
        >>> read_token("-", io.StringIO("s3cret" + chr(10))), read_token(None, io.StringIO())
        ('s3cret', None)
    """
    if given != "-":
        return given
    token = stdin.readline().strip()
    if not token:
        raise SpecError("token", "--token - reads the token from stdin, which had none")
    return token


def cmd_submit(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    """``hora submit``: submit a job; with ``--wait`` follow it to the end."""
    spec = spec_from_args(args)
    with _client(args) as client:
        job = client.submit_spec(spec)
        state = job.info.state.value if job.info else "queued"
        _out(err if args.wait else out, f"submitted job {job.id} ({spec.name}): {state}\n")
        moves = job.info.transitions if job.info is not None else []
        note = moves[0].reason if moves and moves[0].state == JobState.queued else None
        if note and not args.wait:  # where it runs, if not here (--wait shows it as a state)
            _out(err, f"hora submit: note: {note}\n")
        if not args.wait:
            return 0
        try:
            final = follow_job(job, 0, out, err)
        except KeyboardInterrupt:
            _out(err, f"\nstopped waiting; job {job.id} goes on (hora cancel {job.id} stops it)\n")
            return EXIT_INTERRUPTED
        return EXIT_FOR_STATE.get(final.state, 1)


def cmd_jobs(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    """``hora jobs``: a table of jobs, newest first."""
    with _client(args) as client:
        page = 500 if args.all else max(1, min(args.limit, 500))
        jobs, total = client.jobs(args.state, limit=page)
        unit = slot_unit(client.gpus())
        waits = {e.id: e.reason.text for e in client.queue() if e.id and e.reason}
        while args.all and len(jobs) < total:
            more, total = client.jobs(args.state, limit=page, offset=len(jobs))
            if not more:
                break
            jobs += more
    _out(out, jobs_table(jobs, unit=unit, waits=waits) + "\n")
    if len(jobs) < total:
        _out(err, f"({len(jobs)} of {total} jobs; --all shows every one)\n")
    return 0


def cmd_status(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    """``hora status ID``: one job in detail."""
    with _client(args) as client:
        info = client.get_job(args.job_id)
        if args.json:
            _out(out, json.dumps(info.model_dump(mode="json"), indent=2) + "\n")
        else:
            _out(out, status_text(info, slot_unit(client.gpus())) + "\n")
    return 0


def cmd_logs(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    """``hora logs [-f] [--rank R] ID``: print or follow one rank's log."""
    with _client(args) as client:
        job = client.job(args.job_id)
        if not args.follow:
            text = job.logs(args.rank, attempt=args.attempt)
            _out(out, text)
        else:
            try:
                if args.attempt is not None:
                    for text in job.follow(args.rank, args.attempt):
                        _out(out, text)
                else:
                    follow_job(job, args.rank, out, io.StringIO())
            except KeyboardInterrupt:
                return EXIT_INTERRUPTED
            text = job.logs(args.rank, attempt=args.attempt)
        if not text:
            _out(err, empty_log_note(job.status(), args.rank, args.attempt) + "\n")
    return 0


def cmd_cancel(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    """``hora cancel ID...``: cancel jobs; print the state each ended in.

    A running job ends once its ranks have stopped (SIGTERM, then SIGKILL after the service's
    grace period): each is waited for up to ``--wait`` seconds. One still stopping then is
    said to be so, not shown as the ``running`` the cancel found.
    """
    with _client(args) as client:
        for job_id in args.job_id:
            job = Job(client, job_id)
            info = job.cancel()
            if not info.state.terminal:
                with contextlib.suppress(JobWaitTimeout):
                    info = job.wait(timeout=max(0.0, args.wait), poll=0.2)
            said = info.state.value if info.state.terminal else STOPPING
            _out(out, f"job {info.id}: {said}\n")
    return 0


def cmd_gpus(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    """``hora gpus``: slots and the jobs holding them."""
    with _client(args) as client:
        _out(out, gpus_table(client.gpus()) + "\n")
    return 0


def cmd_scaling(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    """``hora scaling ID``: the job's scaling report, from its timeline."""
    with _client(args) as client:
        report = client.scaling(args.job_id)
    data = report.model_dump(mode="json")
    _out(out, (json.dumps(data, indent=2) if args.json else scaling_text(report)) + "\n")
    return 0


COMMANDS: dict[str, Callable[[argparse.Namespace, TextIO, TextIO], int]] = {
    "submit": cmd_submit,
    "jobs": cmd_jobs,
    "status": cmd_status,
    "logs": cmd_logs,
    "cancel": cmd_cancel,
    "gpus": cmd_gpus,
    "scaling": cmd_scaling,
}


def main(argv: list[str], out: TextIO | None = None, err: TextIO | None = None) -> int:
    """Run one job subcommand; ``argv[0]`` is the subcommand (``["submit", "--", ...]``).

    Args:
        argv: the subcommand and its arguments.
        out: where results go (default stdout).
        err: where progress and errors go (default stderr).

    Returns:
        The exit status: 0 ok, 1 error (or failed job with --wait), 2 usage, 130 cancelled.
    """
    out, err = out or sys.stdout, err or sys.stderr
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:
        return int(e.code or 0)
    try:
        return COMMANDS[args.cmd](args, out, err)
    except SpecError as e:
        _out(err, f"hora {args.cmd}: error: {e}\n")
        return 2
    except HoraError as e:
        _out(err, f"hora {args.cmd}: error: {e}\n")
        return 1
