"""Notebook magics: ``%dist_start``, ``%%distributed`` and friends (data plane).

Thin by design: each magic parses its line with IPython's ``magic_arguments`` (never ``eval``),
calls :class:`hora.engines.Cluster`, and displays the result. ``%load_ext hora`` registers them
without importing torch or ipyparallel; those load when a magic first starts engines.
What they show is in :mod:`hora.magics_display`, and ``%dist_submit``'s job path in
:mod:`hora.magics_submit`; the names they define stay importable from here.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_cell_magic, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring

from hora import magics_park, magics_submit
from hora.export import DEFAULT_EXPORT
from hora.magics_display import (
    DisplaySink,
    QueueDisplay,
    Table,
    notify,
    short_errors,
    show_profile,
)
from hora.magics_submit import JobEndedError, submit_history, write_job_files

__all__ = [
    "DisplaySink",
    "HoraMagics",
    "JobEndedError",
    "QueueDisplay",
    "Table",
    "load_ipython_extension",
    "unload_ipython_extension",
    "write_job_files",
]

_MAGICS: HoraMagics | None = None


def _names(names: Sequence[str], flag: str) -> list[str]:
    bad = [n for n in names if not n.isidentifier()]
    if bad:
        raise UsageError(f"{flag}: {bad[0]!r} is not a Python variable name")
    return list(names)


def _csv(value: str) -> tuple[str, ...]:
    items = tuple(v.strip() for v in value.split(",") if v.strip())
    if not items:
        raise UsageError(f"--gpus expects a comma-separated list such as 0,1; got {value!r}")
    return items


@magics_class
class HoraMagics(Magics):
    """The ``%dist_*`` magics and ``%%distributed``; holds this kernel's one cluster."""

    def __init__(self, shell: Any) -> None:
        super().__init__(shell)
        self.cluster: Any = None
        self.cell_number: int | None = None
        # what the engines ran since they started, for %dist_submit (the cluster's start
        # count tells when they were restarted, by %dist_restart or after a stuck interrupt)
        self.history: list[Any] = []
        self._history_of = 0
        self._last_size: int | None = None  # ranks of the engines %dist_stop stopped
        # how engines are started: (kernel-local forced, idle timeout, runtime, controller address)
        self._mode: tuple[bool, float | None, str, str | None, str | None] = (
            False, None, "local", None, None)  # fmt: skip
        self._preflight = True  # %dist_start --no-preflight turns it off

    def pre_run_cell(self, info: Any) -> None:
        """Note the number the notebook shows for the cell that starts (engines count apart).

        IPython has already counted the cell when this event fires if it stores history.
        """
        count = int(getattr(self.shell, "execution_count", 1))
        self.cell_number = count - 1 if getattr(info, "store_history", False) else count
        beat = getattr(self.cluster, "heartbeat", None)
        for notice in beat.take_notices() if beat is not None else ():
            sys.stderr.write(notice + "\n")  # the session's idle warning or end, not yet seen
        settle = getattr(self.cluster, "parked_by_service", None)
        if settle is not None and settle():
            sys.stderr.write("hora: the hora service parked this notebook's session\n")

    # --- helpers ---------------------------------------------------------------------------
    def _ns(self) -> dict[str, Any]:
        shell: Any = self.shell
        return shell.user_ns  # type: ignore[no-any-return]

    def _options(self, args: Any) -> Any:
        from hora.engines import ClusterOptions
        from hora.errors import SpecError

        try:
            return ClusterOptions(
                n=args.n,
                gpus=_csv(args.gpus) if args.gpus else None,
                backend=args.backend,
                timeout_s=args.timeout if args.timeout is not None else 60.0,
                start_timeout_s=args.start_timeout,
            )
        except SpecError as e:
            raise UsageError(str(e)) from None

    def _start(self, options: Any) -> None:
        from IPython.display import display

        from hora.client import ServiceUnavailable
        from hora.engines import Cluster
        from hora.engines.session import ServiceCluster, service_configured

        local, idle, runtime, ip, image = self._mode
        queue = QueueDisplay()
        why = "--local" if local else "no hora service configured"
        self.history, self._history_of = [], 0
        rows = None
        if runtime != "local" and (local or not service_configured()):
            raise UsageError(f"--runtime {runtime} needs a hora service (HORA_URL), not --local")
        if not local and service_configured():
            self.cluster = ServiceCluster(
                options, progress=queue.update, notify=notify, idle_timeout_s=idle,
                runtime=runtime, ip=ip, image=image,
            )  # fmt: skip
            try:
                rows = self.cluster.start()
            except ServiceUnavailable as e:
                if self.cluster.asked is not None or runtime != "local":  # say so
                    raise
                # configured but not running (hora up stopped): the notebook still works, and
                # kernel-local engines still leave alone the GPUs other processes use
                why = f"the configured hora service did not answer: {e.cause}"
        if rows is None:
            self.cluster = Cluster(options)
            rows = self.cluster.start()
        queue.done(self.cluster)
        if isinstance(self.cluster, ServiceCluster):
            where = f"from {self.cluster.where}"
        else:
            where = f"kernel-local engines ({why})"
        took = f"{self.cluster.start_s:.1f}s"
        title = f"{len(rows)} engines ready in {took} ({self.cluster.backend}); {where}"
        display(
            Table(
                [
                    {k: r[k] for k in ("rank", "host", "pid", "device", "gpu", "engine_id")}
                    for r in rows
                ],
                title,
            )
        )
        if self._preflight:
            from hora.engines.profile import run_preflight

            run_preflight(self.cluster)

    def _record(self, record: Any) -> None:
        if self.cluster.starts != self._history_of:  # fresh engines: earlier cells are gone
            self.history, self._history_of = [], self.cluster.starts
        self.history.append(record)

    def _running(self) -> Any:
        """The cluster, a parked session resumed first (its engines are needed)."""
        from hora.engines import ClusterNotRunningError

        if self.cluster is None:
            raise ClusterNotRunningError("no engines are running; run %dist_start first")
        if self._parked():
            magics_park.resume(self.cluster)
            self._history_of = self.cluster.starts  # the cells that ran are the engines' again
        return self.cluster

    def _parked(self) -> bool:
        from hora.engines import ClusterState

        return self.cluster is not None and self.cluster.state is ClusterState.PARKED

    def _repaired(self) -> Any:
        """The running cluster, its engines that died since the last cell replaced (said so)."""
        cluster = self._running()
        repaired = cluster.repair()
        if repaired:
            sys.stderr.write(f"hora: {repaired}\n")
        return cluster

    @staticmethod
    def _check_rank(rank: int | None, size: int) -> None:
        if rank is not None and not 0 <= rank < size:
            raise UsageError(f"--rank {rank} is outside 0..{size - 1}")

    def _is_up(self) -> bool:
        from hora.engines import ClusterState

        return self.cluster is not None and self.cluster.state is not ClusterState.STOPPED

    # --- magics ----------------------------------------------------------------------------
    @magic_arguments()
    @argument(
        "-n", type=int, default=None, help="number of engines (default: one per free GPU, else 2)"
    )
    @argument("--gpus", default=None, help="GPU ids to bind, one per rank, e.g. 0,1")
    @argument("--backend", choices=["nccl", "gloo"], default=None, help="process group backend")
    @argument(
        "--timeout",
        type=float,
        default=None,
        help="collective timeout in the engines, seconds (default 60); half of it is the "
        "default stall timeout of cells",
    )
    @argument("--start-timeout", type=float, default=60.0, help="seconds engines may take to start")
    @argument(
        "--local",
        action="store_true",
        help="start the engines in this kernel even where a hora service is configured",
    )
    @argument(
        "--idle-timeout",
        type=float,
        default=None,
        help="seconds of idle engines before the service frees their slots (its default: 1 h)",
    )
    @argument(
        "--no-preflight",
        action="store_true",
        help="skip the communication preflight (latency, bandwidth) after start",
    )
    @argument(
        "--runtime",
        choices=["local", "docker", "slurm"],
        default="local",
        help="where the service starts the engines: its machine, containers of --image, or one "
        "Slurm job (default local)",
    )
    @argument("--image", default=None, help="with --runtime docker: the engines' image (with hora)")
    @argument(
        "--ip",
        default=None,
        help="with --runtime slurm: this machine's address the nodes reach (default: the "
        "service's choice)",
    )
    @line_magic
    @short_errors
    def dist_start(self, line: str) -> None:
        """Start engines, bind one GPU each, and initialise hora.torch in them.

        With a hora service configured (``HORA_URL``/``HORA_TOKEN`` or ``~/.hora/config``)
        the engines are a session the service schedules with its jobs; otherwise (or with
        ``--local``) this kernel starts them itself. With ``--runtime slurm`` the service
        starts them as one Slurm job and the kernel's controller listens on an address the
        nodes reach.

        Example: ``%dist_start -n 2 --backend gloo``, ``%dist_start -n 4 --runtime slurm``
        """
        args = parse_argstring(self.dist_start, line)
        options = self._options(args)
        if args.idle_timeout is not None and args.idle_timeout <= 0:
            raise UsageError(f"--idle-timeout must be > 0 seconds, got {args.idle_timeout:g}")
        if self._parked():
            sys.stderr.write(
                f"session {self.cluster.launcher.resuming} is parked: the next %%distributed "
                "cell (or %dist_resume) resumes it; %dist_stop ends it\n"
            )
            return
        if self._is_up():
            sys.stderr.write(
                f"engines already running ({self.cluster.size} ranks); "
                "use %dist_restart or %dist_stop first\n"
            )
            return
        if args.ip is not None and args.runtime != "slurm":
            raise UsageError("--ip is for --runtime slurm (local engines use 127.0.0.1)")
        if (args.image is not None) != (args.runtime == "docker"):
            raise UsageError("--image goes with --runtime docker, which needs one (with hora)")
        self._mode = (args.local, args.idle_timeout, args.runtime, args.ip, args.image)
        self._preflight = not args.no_preflight
        self._start(options)

    @line_magic
    @short_errors
    def dist_stop(self, line: str) -> None:
        """Stop the engines and the controller. Example: ``%dist_stop``.

        The cells they ran stay the notebook's: ``%dist_submit`` still submits them.
        """
        self._stop_engines()

    def _handed_off(self) -> None:
        """The service stopped the session for a handoff: the kernel lets go of its side."""
        magics_submit.let_go(self.cluster)
        self._stop_engines()

    def _stop_engines(self) -> None:
        if self.cluster is not None:
            if self.cluster.starts != self._history_of:
                self.history = []
            self._last_size = self.cluster.size
            self.cluster.stop()
        self.cluster = None

    @line_magic
    @short_errors
    def dist_restart(self, line: str) -> None:
        """Stop and start the engines with the last start's options. Example: ``%dist_restart``."""
        cluster = self._running()
        cluster.stop()
        self._start(cluster.options)

    @line_magic
    @short_errors
    def dist_status(self, line: str) -> Any:
        """Show each rank's liveness, pid, device and memory. Example: ``%dist_status``."""
        from IPython.display import display

        if self._parked():
            magics_park.show_parked(self.cluster)
            return
        cluster = self._running()
        note = f" ({cluster.broken_reason})" if cluster.broken_reason else ""
        display(Table(cluster.status(), f"cluster {cluster.state.value}{note}"))

    @magic_arguments()
    @argument("names", nargs="+", help="notebook variables to copy to every engine")
    @argument("--rank", type=int, default=None, help="copy to this rank only")
    @line_magic
    @short_errors
    def dist_push(self, line: str) -> None:
        """Copy notebook variables to every engine, or one (tensors to each engine's device).

        Example: ``%dist_push weights lr`` or ``%dist_push seed --rank 0``
        """
        args = parse_argstring(self.dist_push, line)
        _names(args.names, "%dist_push")
        missing = [n for n in args.names if n not in self._ns()]
        if missing:
            raise UsageError(f"%dist_push: {', '.join(missing)} not defined in the notebook")
        cluster = self._repaired()
        self._check_rank(args.rank, cluster.size)
        ranks = None if args.rank is None else [args.rank]
        values = {n: self._ns()[n] for n in args.names}
        cluster.push(values, ranks)
        from hora.engines.script import record_push

        self._record(record_push(self.cell_number, values, ranks))

    @magic_arguments()
    @argument("names", nargs="+", help="engine variables to fetch")
    @argument("--rank", type=int, default=None, help="fetch only this rank's value (not a list)")
    @line_magic
    @short_errors
    def dist_pull(self, line: str) -> None:
        """Fetch engine variables into the notebook: a list by rank, or one value with --rank.

        Example: ``%dist_pull loss --rank 0``
        """
        args = parse_argstring(self.dist_pull, line)
        cluster = self._repaired()
        self._check_rank(args.rank, cluster.size)
        ranks = None if args.rank is None else [args.rank]
        for name in _names(args.names, "%dist_pull"):
            values = cluster.pull(name, ranks)
            self._ns()[name] = values[0] if args.rank is not None else values

    @magic_arguments()
    @argument("-n", type=int, default=None, help="engines to start if none are running")
    @argument("--all", action="store_true", help="show every rank's output, prefixed [rank N]")
    @argument("--rank", type=int, default=None, help="show only this rank's output")
    @argument(
        "--timeout",
        type=float,
        default=None,
        help="stall timeout: seconds ranks may run after the first finished (default: half "
        "of %%dist_start's --timeout)",
    )
    @argument(
        "--out",
        default=None,
        help="gather this engine variable from every rank into a notebook list",
    )
    @argument(
        "--profile",
        action="store_true",
        help="report per rank: compute, collectives, waiting, bandwidth; slowest rank",
    )
    @line_cell_magic
    @short_errors
    def distributed(self, line: str, cell: str | None = None) -> None:
        """Run the cell on every rank; ``%distributed stmt`` runs one statement.

        Example::

            %%distributed --all
            print(hvd.rank(), hvd.allreduce(torch.ones(1)))
        """
        if cell is None:
            self._run_cell(line, shown_all=False, rank=None, timeout=None, out=None, n=None,
                           profile=False)
            return
        args = parse_argstring(self.distributed, line)
        if args.all and args.rank is not None:
            raise UsageError("use either --all or --rank R, not both")
        if args.out is not None:
            _names([args.out], "--out")
        self._run_cell(
            cell, shown_all=args.all, rank=args.rank, timeout=args.timeout, out=args.out, n=args.n,
            profile=args.profile,
        )

    def _run_cell(
        self,
        code: str,
        *,
        shown_all: bool,
        rank: int | None,
        timeout: float | None,
        out: str | None,
        n: int | None,
        profile: bool,
    ) -> None:
        if not self._is_up():
            from hora.engines import ClusterOptions

            self._start(ClusterOptions(n=n))
        cluster = self._running()
        if n is not None and n != cluster.size:
            raise UsageError(
                f"engines are running with {cluster.size} ranks but the cell asks for -n {n}; "
                f"run %dist_stop then %dist_start -n {n}"
            )
        self._check_rank(rank, cluster.size)
        if timeout is not None and timeout <= 0:
            raise UsageError(f"--timeout must be > 0 seconds, got {timeout:g}")
        shown = list(range(cluster.size)) if shown_all else [0 if rank is None else rank]
        sink = DisplaySink(prefix=shown_all)
        if profile:
            from hora.engines import profile as prof

            prof.start_profile(cluster)
        try:
            self._repaired()  # an engine died between cells: say so before the cell's output
            result = cluster.run(
                code,
                sink=sink,
                shown=shown,
                timeout=timeout,
                cell_number=self.cell_number,
            )
        except BaseException:
            if profile:
                prof.abandon_profile(cluster)
            raise
        finally:
            sink.flush()
        for note in result.notes:  # a rank died during the cell and was replaced
            sys.stderr.write(f"hora: {note}\n")
        if profile:
            show_profile(prof.finish_profile(cluster))
        from hora.engines.script import CellRecord

        self._record(CellRecord(self.cell_number, code))
        if out:
            self._ns()[out] = cluster.pull(out)

    @magic_arguments()
    @argument("--workers", "-w", type=int, default=None, help="ranks (default: as many as engines)")
    @argument("--name", default="notebook", help="job name (default notebook)")
    @argument("--gpus", type=int, default=1, help="GPUs (or CPU slots) per worker, default 1")
    @argument("--wait", action="store_true", help="wait for the job, showing rank 0's log")
    @argument(
        "--export",
        default=",".join(DEFAULT_EXPORT),
        metavar="NAMES|NONE",
        help="what the job takes from this kernel, as sbatch --export (default PATH, "
        "VIRTUAL_ENV, CONDA_PREFIX and the directory; NONE: nothing)",
    )
    @argument(
        "--handoff",
        action="store_true",
        help="stop this notebook's session and give its slots straight to the job",
    )
    @line_magic
    @short_errors
    def dist_submit(self, line: str) -> Any:
        """Submit the %%distributed cells that ran, in order, as a job of the hora service.

        The pushed values go with them; it works after ``%dist_stop`` too. With
        ``--handoff`` the session's engines stop and the job starts on their slots at once
        (no queued job takes them in between). Returns the :class:`hora.Job`.

        Example: ``job = %dist_submit --workers 2 --name digits --wait``
        """
        args = parse_argstring(self.dist_submit, line)
        workers = args.workers or (self.cluster.size if self._is_up() else self._last_size)
        if workers is None:
            raise UsageError("%dist_submit: no engines are running; pass --workers N")
        up = self.cluster if self._is_up() else None
        session = magics_submit.handoff_session(up) if args.handoff else None
        if self.cluster is not None and self.cluster.starts != self._history_of:
            self.history = []
        return submit_history(
            self.history, name=args.name, workers=workers, gpus=args.gpus, session=session,
            wait=args.wait, stop_engines=self._handed_off, export=args.export,
        )  # fmt: skip

    def stop(self) -> None:
        """Stop this kernel's engines (unload or shutdown); a parked session stays parked."""
        if self.cluster is not None:
            self.cluster.close()
            self.cluster = None

    # --- parking -------------------------------------------------------------------------------
    @magic_arguments()
    @argument("--drop", nargs="+", default=[], metavar="NAME", help="variables to leave out")
    @argument(
        "--force", action="store_true", help="leave out whatever cannot be saved (named)"
    )
    @line_magic
    def dist_park(self, line: str) -> None:
        """Park the session: save every engine's variables, give the slots back.

        The next ``%%distributed`` cell (or ``%dist_resume``) resumes it where it was.
        Whatever cannot be saved is named before anything stops.

        Example: ``%dist_park``, ``%dist_park --drop loader_iter``, ``%dist_park --force``
        """
        args = parse_argstring(self.dist_park, line)
        cluster = magics_park.session_cluster(self.cluster, "%dist_park")
        magics_park.park(cluster, _names(args.drop, "--drop"), args.force)

    @magic_arguments()
    @argument("session", nargs="?", type=int, default=None, help="a parked session's id")
    @argument("-n", type=int, default=None, help="engines (another size needs elastic state)")
    @line_magic
    def dist_resume(self, line: str) -> None:
        """Resume this notebook's parked session, or adopt one of yours by id.

        Without an id and with nothing parked here, list your parked sessions.

        Example: ``%dist_resume``, ``%dist_resume 12``
        """
        args = parse_argstring(self.dist_resume, line)
        if self._parked():
            mine = self.cluster.launcher.resuming
            if args.session not in (None, mine):
                raise UsageError(f"this notebook's session {mine} is parked; %dist_stop it first")
        elif args.session is None:
            magics_park.show_parked(self.cluster if self._is_up() else None)
            return
        elif self._is_up():
            raise UsageError("engines are running here; %dist_stop them first")
        else:
            self.cluster = magics_park.adopt(args.session)
            self.history, self._history_of = [], 0
        magics_park.resume(self.cluster, args.n)
        self._history_of = self.cluster.starts


def load_ipython_extension(ipython: Any) -> None:
    """Register hora's magics (``%load_ext hora``); cheap: no torch, no ipyparallel yet.

    Args:
        ipython: the running InteractiveShell.

    Example:
        >>> %load_ext hora  # doctest: +SKIP
    """
    global _MAGICS
    if _MAGICS is not None and _MAGICS.shell is ipython:
        return
    _MAGICS = HoraMagics(ipython)
    ipython.register_magics(_MAGICS)
    ipython.events.register("pre_run_cell", _MAGICS.pre_run_cell)


def unload_ipython_extension(ipython: Any) -> None:
    """Stop the engines this kernel started (``%unload_ext hora``).

    Args:
        ipython: the running InteractiveShell.
    """
    global _MAGICS
    if _MAGICS is not None:
        _MAGICS.stop()
        try:
            ipython.events.unregister("pre_run_cell", _MAGICS.pre_run_cell)
        except ValueError:  # registered by another shell
            pass
        _MAGICS = None
