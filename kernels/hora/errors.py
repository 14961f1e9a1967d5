"""One error tree for all of hora (data plane; the service reuses it).

Every exception carries the data a caller needs to act on it (the field, the rank, the
missing ranks), not just a message, so the magics, the CLI and the service can render
them in their own way.
"""

from __future__ import annotations

from collections.abc import Sequence


class HoraError(Exception):
    """Root of every error hora raises on purpose.

    ``code`` is what code may act on (the service sends it beside the message; the client's
    :class:`hora.client.ServiceError` carries it back): never the message's text.
    """

    code: str | None = None


class EngineRunning(HoraError):
    """A session's engine asked to be replaced still runs (the service has not seen it die)."""

    code = "engine_running"

    def __init__(self, session_id: int, rank: int) -> None:
        super().__init__(f"rank {rank}'s engine of session {session_id} is running")
        self.session_id = session_id
        self.rank = rank


class NotInitializedError(HoraError):
    """A hora.torch operation ran before ``hvd.init()``."""

    def __init__(self, op: str) -> None:
        super().__init__(
            f"hora.torch.{op}() called before hora.torch.init(); call hvd.init() first"
        )
        self.op = str(op)  # a plain str, also when given a hora.torch Kind


class SpecError(HoraError, ValueError):
    """A job or launch description is invalid; ``field`` names the offending field."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class LauncherEnvError(HoraError):
    """The environment set by a launcher (torchrun, mpirun, srun, hora run) is inconsistent."""


class RendezvousError(HoraError):
    """The rendezvous store could not be opened or reached at ``address`` (host:port)."""

    def __init__(self, address: str, detail: str) -> None:
        super().__init__(f"rendezvous at {address}: {detail}")
        self.address = address
        self.detail = detail


class RankFailedError(HoraError):
    """A rank exited or raised; ``others`` counts further failed ranks not shown in full."""

    def __init__(
        self,
        rank: int,
        exit_code: int | None = None,
        host: str = "",
        detail: str = "",
        others: Sequence[int] = (),
    ) -> None:
        where = f" on {host}" if host else ""
        code = f" with exit code {exit_code}" if exit_code is not None else ""
        msg = f"rank {rank}{where} failed{code}"
        if detail:
            msg += f": {detail}"
        if others:
            msg += f" (also failed on ranks {', '.join(map(str, others))})"
        super().__init__(msg)
        self.rank = rank
        self.exit_code = exit_code
        self.host = host
        self.detail = detail
        self.others = list(others)


class CollectiveTimeout(HoraError):
    """A collective did not complete because some ranks never arrived."""

    def __init__(
        self, op: str, missing_ranks: Sequence[int], timeout_s: float, name: str = ""
    ) -> None:
        tensor = f" on tensor {name!r}" if name else ""
        missing = ", ".join(map(str, missing_ranks)) if missing_ranks else "unknown"
        super().__init__(
            f"{op}{tensor} timed out after {timeout_s:g}s waiting for missing ranks: {missing}"
        )
        self.op = str(op)  # a plain str, also when given a hora.torch Kind
        self.missing_ranks = list(missing_ranks)
        self.timeout_s = timeout_s
        self.name = name


class CollectiveDeadlock(CollectiveTimeout):
    """Every rank waits in a collective that the others never submitted: none can complete.

    Raised on every rank as soon as that is certain (every member of the process set is
    blocked, none in a collective that all of them submitted), instead of at the timeout. The
    ranks are then at different points of the script, so the world must start anew with
    ``hvd.init()``. A CollectiveTimeout: ``missing_ranks`` names the ranks that never
    submitted this collective, and handlers written for timeouts still catch it; ``waits``
    says where those ranks wait instead.
    """

    def __init__(
        self, op: str, missing_ranks: Sequence[int], name: str, waits: str, waited_s: float
    ) -> None:
        missing = ", ".join(map(str, missing_ranks))
        HoraError.__init__(
            self,
            f"{op} on tensor {name!r} can never complete: missing ranks {missing} wait in "
            f"other collectives ({waits}) and every rank is blocked (for {waited_s:.1f} s). "
            "An exception skipped a collective on some ranks, or they call collectives in "
            "different orders; call hvd.init() on every rank to start a new world",
        )
        self.op = str(op)  # a plain str, also when given a hora.torch Kind
        self.missing_ranks = list(missing_ranks)
        self.timeout_s = waited_s
        self.name = name
        self.waits = waits


class TensorMismatchError(HoraError, ValueError, RuntimeError):
    """Ranks passed tensors of different shape or dtype to the same collective.

    A ValueError (bad input) and, like Horovod's mismatch errors, a RuntimeError.
    """

    def __init__(self, op: str, name: str, detail: str, ranks: Sequence[int]) -> None:
        super().__init__(
            f"{op} on tensor {name!r}: {detail} (ranks {', '.join(map(str, ranks))} disagree)"
        )
        self.op = str(op)  # a plain str, also when given a hora.torch Kind
        self.name = name
        self.detail = detail
        self.ranks = list(ranks)


class UnsupportedError(HoraError, NotImplementedError):
    """A Horovod capability that hora does not provide was called."""


class HorovodInternalError(HoraError, RuntimeError):
    """Horovod's error for a collective that failed because the world broke (a peer died).

    hora raises :class:`PeerFailedError` (also a :class:`RankFailedError`) in that case, so
    ``except hvd.HorovodInternalError`` in Horovod scripts (elastic training loops) catches it.
    """


class PeerFailedError(RankFailedError, HorovodInternalError):
    """A collective failed because rank ``rank`` died or left it: Horovod's internal error.

    ``hvd.elastic.run`` catches it, goes back to the last commit and re-forms the world.
    """


class HostsUpdatedInterrupt(HoraError, RuntimeError):
    """Horovod elastic's signal that the host set changed (``state.commit()`` raises it).

    Args:
        skip_sync: Horovod's flag (skip the state sync after the reset).
    """

    def __init__(self, skip_sync: bool = False) -> None:
        super().__init__("hosts updated")
        self.skip_sync = skip_sync
