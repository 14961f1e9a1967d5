"""Which world a notebook engine joins when ``hvd.elastic.run`` re-forms it (data plane).

The kernel starts its engines with ``HORA_ENGINE_WORLD``, a file in the cluster's private
directory. When an engine dies during a cell, the kernel starts a new engine for that rank at a
fresh store port and writes a new *generation* there: its number and that port. A surviving
engine whose cell runs ``hvd.elastic.run`` leaves the failed world and calls ``hvd.init()``
again: :func:`engine_world` (``init()``'s world source in the engines) marks it waiting, waits
for a generation newer than the one it is in, and returns its own rank at that port, where the
new engine meets it (when every rank waits and none died, a collective failed: the kernel
publishes a new generation for the same engines). Any other ``init()`` takes the last
generation's port (the engine's environment before there is one), so that every engine
agrees. Standard library only; the kernel writes and reads the same file.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

from hora.env import RankEnv, World, detect_world
from hora.errors import CollectiveTimeout, HoraError, RendezvousError

VAR = RankEnv.var("engine_world")
_POLL_S = 0.02
DEFAULT_WAIT_S = 60.0


@dataclass(frozen=True)
class Generation:
    """A world of the notebook's engines, as the kernel published it.

    Attributes:
        number: 1, 2, ... (one more for every replacement).
        port: the store port of that world (its rank 0 hosts the store).
        root_lost: rank 0's engine died: its new engine has none of the training state, so
            a cell's ``hvd.elastic.run`` cannot take the state from rank 0 and must stop.
    """

    number: int
    port: int
    root_lost: bool = False


class RootLostError(HoraError):
    """Rank 0's engine died during ``hvd.elastic.run``: the cell cannot carry on."""


def write_generation(path: Path, gen: Generation) -> None:
    """Publish ``gen`` (atomic: readers see the old generation or the new one)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(json.dumps(dataclasses.asdict(gen)))
    os.replace(tmp, path)


def read_generation(path: Path) -> Generation | None:
    """Return the last generation published, or None before the first.

    Example:
        >>> read_generation(Path("/nonexistent/world.json")) is None
        True
    """
    try:
        return Generation(**json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):
        return None


def _marker(path: Path, rank: int) -> Path:
    return path.with_name(f"waiting.{rank}")


def waiting_ranks(path: Path, left: int) -> list[int]:
    """Return the ranks waiting in ``hvd.elastic.run`` for a world after generation ``left``."""
    out = []
    for marker in path.parent.glob("waiting.*"):
        try:
            if int(marker.read_text()) == left:
                out.append(int(marker.name.removeprefix("waiting.")))
        except (OSError, ValueError):
            continue
    return sorted(out)


class _Joined:
    """The generation this engine is in (None before its first ``init()``)."""

    number: int | None = None
    given: int | None = None  # the port the kernel handed over for the next init()


def join_at(port: int) -> None:
    """Make the next ``init()`` meet the others at ``port`` (the last generation's), at once.

    For an engine whose ``hvd.elastic.run`` left its world and found no new one (rank 0
    died): the kernel moves it to the new engines' world after the cell.
    """
    _Joined.given = port


def note_current(environ: dict[str, str] | None = None) -> None:
    """Say that this engine is in the last generation (its group was rebuilt at its port)."""
    raw = (os.environ if environ is None else environ).get(VAR, "")
    gen = read_generation(Path(raw)) if raw else None
    _Joined.number = gen.number if gen is not None else 0


def engine_world(
    environ: dict[str, str], failure: CollectiveTimeout | RendezvousError | None = None
) -> World:
    """Return the world ``init()`` joins in a notebook engine (see the module docstring).

    Args:
        environ: a copy of the engine's environment.
        failure: why the last rendezvous of this ``init()`` failed; raised again.

    Raises:
        RootLostError: rank 0's engine died while this one waited to re-form the world.
        CollectiveTimeout: no new world came within the collective timeout.
    """
    from hora.torch import host

    if failure is not None:
        raise failure
    world = detect_world(environ)
    raw = environ.get(VAR, "")
    if not raw:
        return world
    if _Joined.given is not None:
        port, _Joined.given = _Joined.given, None
        note_current(environ)
        return dataclasses.replace(world, master_port=port)
    path = Path(raw)
    if not os.access(path.parent, os.W_OK | os.X_OK):  # not the kernel's user: no re-forming
        return world
    gen = read_generation(path)
    if _Joined.number is None:  # the first init(): a new engine's environment names its world
        _Joined.number = gen.number if gen is not None else 0
        return world
    if host.left_broken():
        gen = _await_newer(path, world.rank, _Joined.number, _wait_s(environ))
    if gen is None:
        return world
    _Joined.number = gen.number
    return dataclasses.replace(world, master_port=gen.port)


def _wait_s(environ: dict[str, str]) -> float:
    try:
        # the contract's name; a bad value waits the default (hvd.init() names it, not this)
        return float(environ.get(RankEnv.var("timeout"), "") or DEFAULT_WAIT_S)
    except ValueError:
        return DEFAULT_WAIT_S


def _await_newer(path: Path, rank: int, left: int, timeout_s: float) -> Generation:
    marker = _marker(path, rank)
    marker.write_text(str(left))
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            gen = read_generation(path)
            if gen is not None and gen.number > left:
                if gen.root_lost:
                    raise RootLostError(
                        "rank 0's engine died: its new engine has none of the training state, "
                        "so hvd.elastic.run cannot carry on in this cell; once the cell has "
                        "ended the engine is replaced: run the cell again"
                    )
                return gen
            if time.monotonic() > deadline:
                raise CollectiveTimeout(
                    "init", [], timeout_s, name="a new world from the notebook kernel"
                )
            time.sleep(_POLL_S)
    finally:
        marker.unlink(missing_ok=True)
