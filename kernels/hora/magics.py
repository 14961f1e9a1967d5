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
from typing import TYPE_CHECKING

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_cell_magic, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring

from hora import magics_park, magics_submit
from hora.export import DEFAULT_EXPORT
from hora.kinds import RuntimeName
from hora.magics_display import (
    DisplaySink,
    QueueDisplay,
    Table,
    engines_table,
    notify,
    short_errors,
    show_profile,
)
from hora.magics_start import StartMode, cluster_options, start_mode
from hora.magics_submit import JobEndedError, submit_history, write_job_files

if TYPE_CHECKING:  # the engines load ipyparallel: only when a magic first starts them
    from IPython.core.interactiveshell import ExecutionInfo, InteractiveShell

    from hora.client import Job
    from hora.engines import Cluster, ClusterOptions
    from hora.engines.cluster import EngineRow
    from hora.engines.script import Record
    from hora.engines.session import ServiceCluster

__all__ = [
    "DisplaySink",
    "HoraMagics",
    "JobEndedError",
    "QueueDisplay",
    "StartMode",
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


@magics_class
class HoraMagics(Magics):
    """The ``%dist_*`` magics and ``%%distributed``; holds this kernel's one cluster."""

    def __init__(self, shell: InteractiveShell) -> None:
        super().__init__(shell)
        self.cluster: Cluster | None = None
        self.cell_number: int | None = None
        # what the engines ran since they started, for %dist_submit (the cluster's start
        # count tells when they were restarted, by %dist_restart or after a stuck interrupt)
        self.history: list[Record] = []
        self._history_of = 0
        self._last_size: int | None = None  # ranks of the engines %dist_stop stopped
        self._mode = StartMode()
        self._preflight = True  # %dist_start --no-preflight turns it off

    def pre_run_cell(self, info: ExecutionInfo) -> None:
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
    def _ns(self) -> dict[str, object]:
        assert self.shell is not None  # registered by load_ipython_extension with its shell
        return self.shell.user_ns  # type: ignore[no-any-return]

    def _start(self, options: ClusterOptions) -> None:
        from IPython.display import display

        from hora.client import ServiceUnavailable
        from hora.engines import Cluster
        from hora.engines.session import ServiceCluster, service_configured

        mode, queue = self._mode, QueueDisplay()
        why = "--local" if mode.local else "no hora service configured"
        self.history, self._history_of = [], 0
        started: tuple[Cluster, list[EngineRow]] | None = None
        if mode.runtime is not RuntimeName.local and (mode.local or not service_configured()):
            raise UsageError(
                f"--runtime {mode.runtime} needs a hora service (HORA_URL), not --local"
            )
        if not mode.local and service_configured():
            self.cluster = session = ServiceCluster(
                options, progress=queue.update, notify=notify, idle_timeout_s=mode.idle_timeout_s,
                runtime=mode.runtime, ip=mode.ip, image=mode.image,
            )  # fmt: skip
            try:
                started = session, session.start()
            except ServiceUnavailable as e:
                if session.asked is not None or mode.runtime is not RuntimeName.local:  # say so
                    raise
                # configured but not running (hora up stopped): the notebook still works, and
                # kernel-local engines still leave alone the GPUs other processes use
                why = f"the configured hora service did not answer: {e.cause}"
        if started is None:
            self.cluster = local = Cluster(options)
            started = local, local.start()
        cluster, rows = started
        queue.done(cluster)
        where = f"from {cluster.where}" if isinstance(cluster, ServiceCluster) else None
        took = f"{cluster.start_s:.1f}s"
        title = f"{len(rows)} engines ready in {took} ({cluster.backend}); "
        display(engines_table(rows, title + (where or f"kernel-local engines ({why})")))
        if self._preflight:
            from hora.engines.profile import run_preflight

            run_preflight(cluster)

    def _record(self, cluster: Cluster, record: Record) -> None:
        if cluster.starts != self._history_of:  # fresh engines: earlier cells are gone
            self.history, self._history_of = [], cluster.starts
        self.history.append(record)

    def _running(self) -> Cluster:
        """The cluster, a parked session resumed first (its engines are needed)."""
        from hora.engines import ClusterNotRunningError

        if self.cluster is None:
            raise ClusterNotRunningError("no engines are running; run %dist_start first")
        if (parked := self._parked()) is not None:
            magics_park.resume(parked)
            self._history_of = self.cluster.starts  # the cells that ran are the engines' again
        return self.cluster

    def _parked(self) -> ServiceCluster | None:
        """This notebook's session when it is parked (only a session parks), else None."""
        from hora.engines import ClusterState
        from hora.engines.session import ServiceCluster

        c = self.cluster
        return c if isinstance(c, ServiceCluster) and c.state is ClusterState.PARKED else None

    def _repaired(self) -> Cluster:
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

    def _up(self) -> Cluster | None:
        """The cluster unless there is none or it is stopped."""
        from hora.engines import ClusterState

        c = self.cluster
        return c if c is not None and c.state is not ClusterState.STOPPED else None

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
        choices=[r.value for r in RuntimeName],
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
        options = cluster_options(args)
        if args.idle_timeout is not None and args.idle_timeout <= 0:
            raise UsageError(f"--idle-timeout must be > 0 seconds, got {args.idle_timeout:g}")
        if (parked := self._parked()) is not None:
            sys.stderr.write(
                f"session {parked.launcher.resuming} is parked: the next %%distributed "
                "cell (or %dist_resume) resumes it; %dist_stop ends it\n"
            )
            return
        if (up := self._up()) is not None:
            sys.stderr.write(
                f"engines already running ({up.size} ranks); "
                "use %dist_restart or %dist_stop first\n"
            )
            return
        self._mode = start_mode(args)
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
    def dist_status(self, line: str) -> None:
        """Show each rank's liveness, pid, device and memory. Example: ``%dist_status``."""
        from IPython.display import display

        if (parked := self._parked()) is not None:
            magics_park.show_parked(parked)
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

        self._record(cluster, record_push(self.cell_number, values, ranks))

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
        if self._up() is None:
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

        self._record(cluster, CellRecord(self.cell_number, code))
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
    def dist_submit(self, line: str) -> Job:
        """Submit the %%distributed cells that ran, in order, as a job of the hora service.

        The pushed values go with them; it works after ``%dist_stop`` too. With
        ``--handoff`` the session's engines stop and the job starts on their slots at once
        (no queued job takes them in between). Returns the :class:`hora.Job`.

        Example: ``job = %dist_submit --workers 2 --name digits --wait``
        """
        args = parse_argstring(self.dist_submit, line)
        up = self._up()
        workers = args.workers or (up.size if up is not None else self._last_size)
        if workers is None:
            raise UsageError("%dist_submit: no engines are running; pass --workers N")
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
        cluster = self._parked()
        if cluster is not None:
            mine = cluster.launcher.resuming
            if args.session not in (None, mine):
                raise UsageError(f"this notebook's session {mine} is parked; %dist_stop it first")
        elif args.session is None:
            magics_park.show_parked(self._up())
            return
        elif self._up() is not None:
            raise UsageError("engines are running here; %dist_stop them first")
        else:
            self.cluster = cluster = magics_park.adopt(args.session)
            self.history, self._history_of = [], 0
        magics_park.resume(cluster, args.n)
        self._history_of = cluster.starts


def load_ipython_extension(ipython: InteractiveShell) -> None:
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


def unload_ipython_extension(ipython: InteractiveShell) -> None:
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
