"""Code that runs inside each engine: initialisation, variable transfer, memory (data plane).

The kernel calls these functions through ipyparallel's ``apply``; they are pickled by
reference, so every engine imports this module (cheap: torch is imported inside the functions).
:func:`start_background_init` (called by the engine process at launch) imports torch and runs
``hora.torch.init()`` while the engine registers; :func:`init_engine` (the first call from the
kernel) waits for it, so the process group is ready before ``%dist_start`` returns, and leaves
``hvd`` and ``torch`` in the engine's namespace.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
from typing import Any, TypedDict, final

from hora.engines import world
from hora.env import RankEnv

_BG_DONE = threading.Event()
_BG_ERROR: list[BaseException] = []
_BG_STARTED = False
# where an engine started by the service writes its stack on SIGUSR1 (the kernel reads it)
STACK_FILE: list[str] = []


@final
class EngineInfo(TypedDict):
    """What an engine answers :func:`init_engine` with once ``hora.torch`` is initialised.

    A plain dict on the wire (pickled by ipyparallel); :class:`hora.engines.Cluster` reads it
    into its :class:`~hora.engines.group.Engine`.
    """

    rank: int
    size: int
    host: str
    pid: int
    device: str  # torch device ("cuda:0", "cpu")
    gpu: str  # the GPU bound through CUDA_VISIBLE_DEVICES ("" on CPU)
    main_thread: int  # ident of the engine's main thread (to pick its stack from a dump)
    stack_file: str | None  # where it writes its stack on SIGUSR1 (None: the kernel's choice)


@final
class EngineFailure(TypedDict):
    """What an engine answers :func:`init_engine` with when the initialisation failed."""

    pid: int
    rank: int  # -1 when RANK is not set
    error: str  # the formatted traceback


InitAnswer = EngineInfo | EngineFailure  # what init_engine returns


def _background_init() -> None:
    try:
        import hora.torch as hvd

        if os.environ.get(world.VAR):  # a notebook kernel's engine: it says where worlds are
            from hora.torch import host

            host.set_world_source(world.engine_world)
        hvd.init()
    except BaseException as e:  # re-raised by init_engine in the main thread, with context
        _BG_ERROR.append(e)
    finally:
        _BG_DONE.set()


def start_background_init() -> None:
    """Import torch and run ``hora.torch.init()`` in a thread, while the engine registers.

    The backend and timeout come from ``HORA_BACKEND`` / ``HORA_TIMEOUT`` set at launch;
    :func:`init_engine` waits for this thread and re-raises its error.
    """
    global _BG_STARTED
    _BG_STARTED = True
    threading.Thread(target=_background_init, name="hora-init", daemon=True).start()


STACK_REQUEST = "hora_stack_request"  # a control message: "send your main thread's stack"


def main_stack() -> str:
    """This process's main thread's stack, written as faulthandler writes it.

    Example:
        >>> main_stack().splitlines()[0].endswith("(most recent call first):")
        True
    """
    ident = threading.main_thread().ident or 0
    frame = sys._current_frames().get(ident)
    lines = [f"Thread 0x{ident:016x} (most recent call first):"]
    while frame is not None:
        code = frame.f_code
        lines.append(f'  File "{code.co_filename}", line {frame.f_lineno} in {code.co_name}')
        frame = frame.f_back
    return "\n".join(lines)


def serve_stacks(wait_s: float = 120.0) -> None:
    """Answer :data:`STACK_REQUEST` on the engine's control channel, from a background thread.

    An engine on another machine (a Slurm node) cannot be sent SIGUSR1 by the kernel nor
    have its stack file read there; its control thread answers while a cell runs (a rank
    blocked in a collective has released the GIL). The handler is added to the engine
    kernel's control handlers once ipyparallel has made the kernel.
    """

    def install() -> None:
        from ipyparallel.engine.app import IPEngine

        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            kernel = (
                getattr(IPEngine.instance(), "kernel", None) if IPEngine.initialized() else None
            )
            if kernel is not None:
                kernel.control_handlers[STACK_REQUEST] = _stack_reply(kernel)
                return
            time.sleep(0.1)

    threading.Thread(target=install, name="hora-stacks", daemon=True).start()


def _stack_reply(kernel: Any) -> Any:
    def reply(stream: Any, ident: Any, parent: Any) -> None:
        content = {"status": "ok", "stack": main_stack()}
        kernel.session.send(stream, "hora_stack_reply", content, parent, ident=ident)

    return reply


def _user_ns() -> dict[str, Any]:
    from IPython import get_ipython

    ip = get_ipython()
    if ip is None:  # pragma: no cover - engines always run an IPython shell
        raise RuntimeError("not running inside an IPython engine")
    return ip.user_ns  # type: ignore[no-any-return]


def namespace() -> dict[str, Any]:
    """The engine's user namespace (where cells run)."""
    return _user_ns()


def rank_device() -> Any:
    """This rank's device (``cuda:N`` bound at init, else the CPU)."""
    return _device()


def _device() -> Any:
    import torch

    from hora.torch import host

    state = host.current()
    return state.device if state is not None else torch.device("cpu")


def init_engine(
    backend: str, timeout_s: float, threads: int, start_s: float | None = None
) -> InitAnswer:
    """Initialise hora.torch in this engine and describe it; failures are returned, not raised.

    Args:
        backend: "nccl" or "gloo".
        timeout_s: rendezvous and collective timeout.
        threads: torch intra-op threads on CPU.
        start_s: how long to wait for the background init (the engines' rendezvous, which
            waits for engines that start late); default ``timeout_s``.

    Returns:
        This engine's :class:`EngineInfo`, or an :class:`EngineFailure` with the formatted
        traceback when init failed (so the kernel can name the failing rank by its pid).

    Example:
        >>> info = view.apply_sync(init_engine, "gloo", 60.0, 1)  # doctest: +SKIP
    """
    try:
        return _init_engine(backend, timeout_s, threads, start_s or timeout_s)
    except Exception as e:
        import traceback

        return EngineFailure(
            pid=os.getpid(),
            rank=int(os.environ.get("RANK", "-1")),
            error="".join(traceback.format_exception(e)).rstrip(),
        )


def _init_engine(backend: str, timeout_s: float, threads: int, start_s: float) -> EngineInfo:
    import torch

    import hora.torch as hvd

    if not torch.cuda.is_available():
        torch.set_num_threads(threads)
    if _BG_STARTED:
        if not _BG_DONE.wait(start_s):
            raise TimeoutError(f"hora.torch.init() did not finish within {start_s:g}s")
        if _BG_ERROR:
            raise _BG_ERROR[0]
    hvd.init(backend=backend, timeout=timeout_s)  # no-op after the background init
    ns = _user_ns()
    ns.setdefault("hvd", hvd)
    ns.setdefault("torch", torch)
    return EngineInfo(
        rank=hvd.rank(),
        size=hvd.size(),
        host=socket.gethostname(),
        pid=os.getpid(),
        device=str(_device()),
        gpu=RankEnv.from_environ(only=("gpu",)).gpu or "",
        main_thread=threading.main_thread().ident or 0,  # the main thread has started
        stack_file=STACK_FILE[0] if STACK_FILE else None,
    )


def abort_group() -> None:
    """Abort this engine's process group, so peers blocked in a collective with it fail now."""
    from hora.torch import host

    host.abort()


def rebuild_group(master_port: int, start_timeout_s: float | None = None) -> int:
    """Make a new process group in this engine (every rank calls it with the same port).

    The engine's variables are untouched; see :func:`hora.torch.host.rebuild`.

    Args:
        master_port: the new store's port.
        start_timeout_s: how long to wait for every rank (new engines start slowly).

    Returns:
        This engine's rank.
    """
    from hora.torch import host

    if host.current() is not None:
        host.rebuild(master_port, start_timeout_s)
        world.note_current()
    else:  # its hvd.elastic.run left the world and found no new one (rank 0 had died)
        import hora.torch as hvd
        from hora.torch import optimizer

        world.join_at(master_port)
        hvd.init()
        optimizer.rebind_all()  # as hvd.elastic.run does after its own init()
    return host.require_init("rebuild").rank


def collective_count() -> int:
    """Return how many collectives this engine's rank has entered (0 before init)."""
    from hora.torch import host

    state = host.current()
    return state.seq if state is not None else 0


def user_names() -> list[str]:
    """Return the names of the variables the user defined in this engine (sorted)."""
    ns = _user_ns()
    hidden = {"In", "Out", "exit", "quit", "get_ipython"}
    return sorted(n for n in ns if not n.startswith("_") and n not in hidden)


def _map_tensors(obj: Any, fn: Any) -> Any:
    import torch

    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, list | tuple):
        mapped = [_map_tensors(o, fn) for o in obj]
        return (
            type(obj)(mapped)
            if isinstance(obj, list) or not hasattr(obj, "_fields")
            else type(obj)(*mapped)
        )
    if isinstance(obj, dict):
        return {k: _map_tensors(v, fn) for k, v in obj.items()}
    return obj


def pull_value(name: str) -> Any:
    """Return the engine variable ``name``, with tensors (also inside lists/dicts) moved to CPU.

    Raises:
        NameError: when the engine has no such variable.
    """
    ns = _user_ns()
    if name not in ns:
        raise NameError(f"name {name!r} is not defined on this engine")
    return _map_tensors(ns[name], lambda t: t.detach().cpu())


def on_device(values: dict[str, Any]) -> dict[str, Any]:
    """Return ``values`` with tensors (also inside lists/dicts) moved to this rank's device.

    What a ``%dist_submit`` script does with the values the notebook pushed.
    """
    device = _device()
    return {name: _map_tensors(value, lambda t: t.to(device)) for name, value in values.items()}


def push_values(values: dict[str, Any]) -> list[str]:
    """Store ``values`` in the engine's namespace, with tensors moved to this engine's device.

    Returns:
        The names stored.
    """
    device = _device()
    ns = _user_ns()
    for name, value in values.items():
        ns[name] = _map_tensors(value, lambda t: t.to(device))
    return sorted(values)


def memory() -> dict[str, int]:
    """Return this engine's memory in use: ``rss`` bytes, and ``cuda`` bytes allocated by torch."""
    import sys

    out = {"rss": _rss(os.getpid())}
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = int(torch.cuda.memory_allocated())
    return out


def _rss(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return 0
    return 0
