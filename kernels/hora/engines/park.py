"""Parking inside each engine: what cannot be saved, this rank's snapshot, its restore (data plane).

The kernel calls these through ipyparallel's ``apply`` (:mod:`hora.engines.parking`), on every
rank at once: each rank writes its own part, in parallel, nothing is gathered.

* :func:`scan` names the variables that cannot be saved (open files, sockets, threads,
  generators, DataLoader iterators with worker processes, CUDA streams and events, anything
  else that does not pickle), each with its type, before anything stops; and estimates the
  snapshot's size without copying any data.
* :func:`write` saves the rank's namespace as **one pickle graph** (``torch.save`` with
  cloudpickle, :mod:`hora.engines._pickling`): a parameter shared by a model and an optimizer
  is one tensor again after the restore, and functions and classes defined in cells come
  back. Modules (``torch``, ``hvd``, ``np``) are imported again, not saved. The RNG states
  (Python, numpy, torch CPU and CUDA) go with it, so training continues bit for bit. The
  part is written to a temporary file, checksummed (CRC-32) as it is written, and only then
  renamed: a part that exists is whole. The service flushes the parts to disk once the park
  is committed (the engines need not wait for the disk); a part an OS crash left short never
  matches its checksum, so it is never restored.
* :func:`start_prefetch` (a resumed engine, at process start) reads its part and checks its
  checksum while torch imports and the engine registers; :func:`restore_prepare` loads it
  (tensors that were on a GPU land on this rank's device) and :func:`restore_install` puts
  it in the namespace once every rank has loaded its part.
"""

from __future__ import annotations

import importlib
import os
import random
import sys
import threading
import time
import types
import warnings
import zlib
from collections.abc import Iterator, Mapping, MutableMapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, cast

from hora.contract import RankEnv

HIDDEN = frozenset({"In", "Out", "exit", "quit", "get_ipython"})
CHUNK = 8 << 20
VERSION = 1


def part_name(rank: int) -> str:
    """The file of ``rank``'s part of a snapshot.

    Example:
        >>> part_name(3)
        'rank3.pt'
    """
    return f"rank{rank}.pt"


def part_of(rank: int, world: int, parked_world: int) -> int:
    """Whose part ``rank`` restores: its own, or rank 0's when the size changed (elastic).

    Example:
        >>> part_of(1, 2, 2), part_of(2, 3, 2)
        (1, 0)
    """
    return rank if world == parked_world else 0


@dataclass(frozen=True)
class Unsaveable:
    """A variable that cannot be saved: its name, its type and why."""

    name: str
    kind: str
    why: str

    def line(self) -> str:
        """``name (type): why``, as the notebook shows it."""
        return f"{self.name} ({self.kind}): {self.why}"


def namespace_parts(ns: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """Split a namespace into what is saved and the modules imported again by name.

    Names starting with ``_`` and IPython's own (``In``, ``Out``, ``get_ipython``...) are
    neither.

    Example:
        >>> values, modules = namespace_parts({"x": 1, "os": os, "_y": 2, "In": []})
        >>> values, modules
        ({'x': 1}, {'os': 'os'})
    """
    values: dict[str, Any] = {}
    modules: dict[str, str] = {}
    for name, value in ns.items():
        if name.startswith("_") or name in HIDDEN:
            continue
        if isinstance(value, types.ModuleType):
            modules[name] = value.__name__
        else:
            values[name] = value
    return values, modules


# --- what cannot be saved ---------------------------------------------------------------------

_WORDS = (
    ("TextIOWrapper", "an open file"),
    ("BufferedReader", "an open file"),
    ("BufferedWriter", "an open file"),
    ("BufferedRandom", "an open file"),
    ("BufferedRWPair", "an open file"),
    ("FileIO", "an open file"),
    ("'socket'", "a socket"),
    ("'Thread'", "a thread"),
    ("generator", "a generator"),
    ("coroutine", "a coroutine"),
    ("_MultiProcessingDataLoaderIter", "a DataLoader iterator with worker processes"),
    ("_thread.lock", "a lock (of a thread, a queue)"),
    ("_thread.RLock", "a lock (of a thread, a queue)"),
    ("'Stream'", "a CUDA stream"),
    ("'Event'", "a CUDA event"),
)


def _refused_types() -> tuple[type, ...]:
    """Types refused outright, whatever their pickling would do: their use cannot move.

    cloudpickle would save a file opened for reading as its contents; an open file is
    named instead (in-memory ``io.BytesIO`` / ``io.StringIO`` are saved).
    """
    import io
    import threading as th

    found: list[type] = [
        th.Thread, io.FileIO, io.BufferedReader, io.BufferedWriter, io.BufferedRandom,
        io.BufferedRWPair, io.TextIOWrapper,
    ]  # fmt: skip
    torch = sys.modules.get("torch")
    if torch is not None:
        for name in ("Stream", "Event"):
            for owner in (torch, torch.cuda):
                kind = getattr(owner, name, None)
                if isinstance(kind, type):
                    found.append(kind)
    return tuple(found)


def _kind(value: Any) -> str:
    cls = type(value)
    module = cls.__module__
    own = module in ("builtins", "__main__")
    return cls.__qualname__ if own else f"{module}.{cls.__qualname__}"


def _why(value: Any, error: BaseException) -> str:
    """Why ``value`` did not pickle, in words where the error names a known kind.

    Example:
        >>> _why((i for i in ()), TypeError("cannot pickle 'generator' object"))
        'a generator'
        >>> _why([], TypeError("cannot pickle 'generator' object"))
        'holds a generator'
    """
    text = str(error).splitlines()[0] if str(error) else type(error).__name__
    for needle, words in _WORDS:
        if needle in text:
            own = needle.strip("'").rsplit(".", 1)[-1] in type(value).__qualname__
            return words if own else f"holds {words}"
    return text if isinstance(error, TypeError) else f"{type(error).__name__}: {text}"


class _Counter:
    """A file that keeps only the count of bytes written to it."""

    def __init__(self) -> None:
        self.size = 0

    def write(self, data: Any) -> int:
        n = memoryview(data).nbytes
        self.size += n
        return n


def _storage_ids(seen: set[tuple[int, str]], counter: _Counter) -> Any:
    """A ``persistent_id`` that keeps tensors' data out of the stream and counts it once."""
    import torch

    def persistent_id(obj: Any) -> Any:
        if isinstance(obj, torch.storage.TypedStorage):
            with warnings.catch_warnings():  # TypedStorage's deprecation is torch's business
                warnings.simplefilter("ignore")
                obj = obj.untyped()
        if not isinstance(obj, torch.UntypedStorage):
            return None
        key = (obj.data_ptr(), str(obj.device))
        if key not in seen:
            seen.add(key)
            counter.size += obj.nbytes()
        return f"{key[0]}:{key[1]}"

    return persistent_id


def scan(drop: Sequence[str] = ()) -> dict[str, Any]:
    """Name what this engine cannot save, and estimate the size of what it can.

    Each variable is pickled as :func:`write` would, into a counter: tensors' data is
    counted, never copied (and counted once when shared).

    Args:
        drop: names the user drops (neither checked nor counted).

    Returns:
        ``{"rank", "unsaveable": [[name, type, why], ...], "bytes", "names"}``.
    """
    from hora.engines import _pickling

    ns = _user_ns()
    values, modules = namespace_parts(ns)
    refused = _refused_types()
    kept = {n: v for n, v in values.items() if n not in set(drop)}
    seen: set[tuple[int, str]] = set()
    counter = _Counter()
    bad: list[list[str]] = []
    with _pickling.saving(ns, set(kept) | set(modules), refused):
        for name, value in kept.items():
            pickler = _pickling.Pickler(counter, protocol=5, buffer_callback=_count(counter))
            pickler.persistent_id = _storage_ids(seen, counter)
            try:
                pickler.dump(value)
            except Exception as e:  # whatever pickling raised is why it cannot be saved
                bad.append([name, _kind(value), _why(value, e)])
    failed = {b[0] for b in bad}
    return {
        "rank": _rank(),
        "unsaveable": bad,
        "bytes": counter.size,
        "names": sorted(n for n in kept if n not in failed),
    }


def _count(counter: _Counter) -> Any:
    def take(buffer: Any) -> bool:
        counter.size += memoryview(buffer).nbytes
        return False  # out of band: not copied into the stream

    return take


# --- writing ----------------------------------------------------------------------------------


class ChecksumFile:
    """A write-only file on ``fd`` that computes the CRC-32 of what it writes, as it writes.

    The checksum of a large buffer runs in a thread while the buffer is written (both
    release the GIL), so writing costs little more than the disk's time.
    """

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.crc = 0
        self.size = 0

    def write(self, data: Any) -> int:
        """Write ``data`` whole, adding it to the checksum; its length."""
        view = memoryview(data).cast("B")
        n = view.nbytes
        if n >= (1 << 20):
            box: list[int] = []
            summer = threading.Thread(target=lambda: box.append(zlib.crc32(view, self.crc)))
            summer.start()
            _write_all(self.fd, view)
            summer.join()
            self.crc = box[0]
        else:
            self.crc = zlib.crc32(view, self.crc)
            _write_all(self.fd, view)
        self.size += n
        return n

    def flush(self) -> None:
        """Nothing is buffered here: writes go straight to the file."""


def _write_all(fd: int, view: memoryview) -> None:
    while view.nbytes:
        done = os.write(fd, view[: 1 << 30])
        view = view[done:]


@contextmanager
def _torch_crc_off() -> Iterator[None]:
    """Torch's own per-record CRC is redundant with the part's: skip computing it twice."""
    import torch

    get = getattr(torch.serialization, "get_crc32_options", None)
    put = getattr(torch.serialization, "set_crc32_options", None)
    before = get() if get is not None and put is not None else None
    if put is not None and before is not None:
        put(False)
    try:
        yield
    finally:
        if put is not None and before is not None:
            put(before)


def rng_state() -> dict[str, Any]:
    """The random generators' states: Python's, numpy's (if imported), torch's CPU and GPU."""
    import torch

    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    np = sys.modules.get("numpy")
    if np is not None:
        state["numpy"] = np.random.get_state()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: Mapping[str, Any]) -> None:
    """Put back what :func:`rng_state` took (CUDA's on this rank's device)."""
    import torch

    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        import numpy as np

        np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _elastic(values: Mapping[str, Any]) -> bool:
    """Whether the namespace holds elastic state (it may then resume at another size)."""
    module = sys.modules.get("hora.torch.elastic.state")
    state = getattr(module, "State", None)
    return state is not None and any(isinstance(v, state) for v in values.values())


def write(directory: str, drop: Sequence[str] = ()) -> dict[str, Any]:
    """Write this rank's part of a snapshot into ``directory`` (made 0700 if missing).

    Args:
        directory: the snapshot's directory (the service chose it, in the owner's own).
        drop: names left out (the user's ``--drop``, or what :func:`scan` named under
            ``--force``).

    Returns:
        ``{"rank", "bytes", "crc32", "names", "dropped", "elastic", "seconds"}``.

    Raises:
        OSError: the part could not be written (nothing is left behind).
        pickle.PicklingError, TypeError: a variable does not pickle after all.
    """
    import torch

    from hora.engines import _pickling

    t0 = time.perf_counter()
    ns = _user_ns()
    values, modules = namespace_parts(ns)
    kept = {n: v for n, v in values.items() if n not in set(drop)}
    dropped = [f"{n} ({_kind(values[n])})" for n in drop if n in values]
    snapshot = {
        "version": VERSION, "values": kept, "modules": modules, "rng": rng_state(),
    }  # fmt: skip
    where = Path(directory)
    where.mkdir(mode=0o700, parents=True, exist_ok=True)
    rank = _rank()
    path = where / part_name(rank)
    tmp = where / f".{part_name(rank)}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        out = ChecksumFile(fd)
        with _pickling.saving(ns, set(kept) | set(modules), _refused_types()), _torch_crc_off():
            torch.save(snapshot, cast(IO[bytes], out), pickle_module=_pickling, pickle_protocol=4)
        os.rename(tmp, path)  # whole, or not there (the service flushes it to disk later)
    except BaseException:
        _unlink(tmp)
        raise
    finally:
        os.close(fd)
    return {
        "rank": rank, "bytes": out.size, "crc32": out.crc, "names": sorted(kept),
        "dropped": dropped, "elastic": _elastic(kept), "seconds": time.perf_counter() - t0,
    }  # fmt: skip


def _unlink(path: Path) -> None:
    try:
        path.unlink()
    except OSError:
        pass


# --- restoring --------------------------------------------------------------------------------


@dataclass
class _Read:
    """A part read (and checksummed) ahead of the restore."""

    path: Path
    done: threading.Event
    size: int = 0
    crc: int = 0
    error: str | None = None
    seconds: float = 0.0


_PREFETCH: list[_Read] = []
_PENDING: list[dict[str, Any]] = []


def checksum(path: Path) -> tuple[int, int]:
    """Size and CRC-32 of a file, read without following a link.

    Raises:
        OSError: it cannot be read (missing, a link, no permission).
    """
    crc = size = 0
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        while chunk := os.read(fd, CHUNK):
            crc = zlib.crc32(chunk, crc)
            size += len(chunk)
    finally:
        os.close(fd)
    return size, crc


def _read_ahead(job: _Read) -> None:
    t0 = time.perf_counter()
    try:
        job.size, job.crc = checksum(job.path)
    except OSError as e:
        job.error = f"{e.strerror or e}: {job.path}"
    finally:
        job.seconds = time.perf_counter() - t0
        job.done.set()


def start_prefetch(environ: Mapping[str, str] = os.environ) -> None:
    """Start reading this engine's part of the snapshot it resumes (``HORA_RESTORE_DIR``).

    Called at process start, before torch is imported: reading and checking the part
    overlaps with the engine's start. Nothing happens without a snapshot to restore.
    """
    env = RankEnv.from_environ(environ, only=("restore_dir", "restore_size", "rank", "world_size"))
    if not env.restore_dir or env.rank is None:
        return
    parked = env.restore_size or env.world_size or 1
    part = part_of(env.rank, env.world_size or parked, parked)
    job = _Read(Path(env.restore_dir) / part_name(part), threading.Event())
    _PREFETCH[:] = [job]
    threading.Thread(target=_read_ahead, args=(job,), name="hora-prefetch", daemon=True).start()


def _verified(path: Path, size: int, crc: int, timeout: float) -> float:
    """Check ``path`` against its recorded size and checksum; the seconds it took to read.

    Raises:
        OSError: the part cannot be read, or differs from what was written (a torn or
            damaged snapshot is never restored).
    """
    ahead = next((j for j in _PREFETCH if j.path == path), None)
    if ahead is None:
        ahead = _Read(path, threading.Event())
        _read_ahead(ahead)
    elif not ahead.done.wait(timeout):
        raise OSError(f"reading {path} took more than {timeout:g}s")
    if ahead.error is not None:
        raise OSError(f"cannot read this rank's part of the snapshot: {ahead.error}")
    if (ahead.size, ahead.crc) != (size, crc):
        raise OSError(
            f"{path.name} does not match what was written ({ahead.size} bytes, CRC-32 "
            f"{ahead.crc:08x}; written: {size} bytes, {crc:08x}): the snapshot is damaged "
            "and is not restored"
        )
    return ahead.seconds


def _to_device(device: Any) -> Any:
    def place(storage: Any, location: str) -> Any:
        return storage.to(device=device) if location.startswith("cuda") else storage

    return place


def restore_prepare(
    directory: str, part: int, size: int, crc: int, timeout: float = 600.0
) -> dict[str, Any]:
    """Check and load a part of a snapshot, without touching the namespace yet.

    Args:
        directory: the snapshot's directory.
        part: whose part (this rank's, or rank 0's at another size).
        size: its size as written.
        crc: its CRC-32 as written.
        timeout: how long to wait for the read started at process start.

    Returns:
        ``{"rank", "names", "bytes", "read_s", "load_s"}``.

    Raises:
        OSError: the part is missing, unreadable or damaged.
    """
    import torch

    from hora.engines import _pickling
    from hora.engines.bootstrap import rank_device

    path = Path(directory) / part_name(part)
    read_s = _verified(path, size, crc, timeout)
    t0 = time.perf_counter()
    ns = _user_ns()
    with _pickling.loading(ns):
        snapshot = torch.load(path, map_location=_to_device(rank_device()), weights_only=False)
    _PENDING[:] = [snapshot]
    return {
        "rank": _rank(), "names": sorted(snapshot["values"]), "bytes": size,
        "read_s": read_s, "load_s": time.perf_counter() - t0,
    }  # fmt: skip


def restore_install() -> dict[str, Any]:
    """Put the loaded part in the namespace: variables, modules, random generators.

    Returns:
        ``{"rank", "names", "lost"}``: ``lost`` names modules that no longer import.
    """
    if not _PENDING:
        raise RuntimeError("no snapshot was loaded on this engine")
    snapshot = _PENDING.pop()
    ns = _user_ns()
    ns.update(snapshot["values"])
    lost = _import_modules(ns, snapshot["modules"])
    set_rng_state(snapshot["rng"])
    _PREFETCH.clear()
    return {"rank": _rank(), "names": sorted(snapshot["values"]), "lost": lost}


def restore_discard() -> None:
    """Forget a loaded part (another rank's could not be loaded: nothing is restored)."""
    _PENDING.clear()
    _PREFETCH.clear()


def _import_modules(ns: MutableMapping[str, Any], modules: Mapping[str, str]) -> list[str]:
    lost = []
    for name, module in modules.items():
        try:
            ns[name] = importlib.import_module(module)
        except Exception as e:  # a module that no longer imports is named, not fatal
            lost.append(f"{name} (module {module}: {type(e).__name__}: {e})")
    return lost


def _user_ns() -> dict[str, Any]:
    from hora.engines.bootstrap import namespace

    return namespace()


def _rank() -> int:
    from hora.torch import host

    return host.require_init("park").rank
