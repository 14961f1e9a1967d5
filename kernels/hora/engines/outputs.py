"""How many outputs a cell published, told in its reply, so the kernel need not wait for more.

A cell's outputs (``stream``, ``display_data``, ...) come on the engine's IOPub channel, its
``execute_reply`` on the shell channel: two ZeroMQ streams, relayed separately by the
controller, so the kernel cannot know from the reply alone whether every output has arrived.
The standard answer is to wait for the ``status: idle`` that ends the request on IOPub, which
on a busy machine comes milliseconds after the reply (ipyparallel's own ``view.execute``
does not wait for it, and may miss outputs). Instead each engine counts the outputs it
published for a request and puts the count in the reply (:data:`KEY`, in its content, which
ipyparallel keeps; it drops metadata it does not know): the
kernel's cell is done on a rank when its reply came and that many outputs did; a silent cell
is done at its reply. (data plane: the engine side is installed by ``hora.engines._child``;
:mod:`hora.engines.execute` reads the count.)
"""

from __future__ import annotations

import threading
import time
from typing import Any

KEY = "hora_outputs"
_KEPT = 1024
# the IOPub messages the kernel shows (hora.engines.execute.CellRun._on_iopub)
TYPES = frozenset({"stream", "display_data", "execute_result", "update_display_data",
                   "clear_output"})
# not sent at all: the code the kernel itself just sent, echoed back on IOPub; the cell's
# execution count, its only use, is in the reply too (one message less per rank and cell:
# about a tenth of a trivial cell's round trip, bench/notebook.py)
SKIPPED = "execute_input"


def counted(kernel: Any) -> None:
    """Make ``kernel`` count its outputs per request and report the count in every reply.

    Its session's ``send`` counts the messages of :data:`TYPES` by their parent request, and
    drops :data:`SKIPPED` (ipyparallel's client only files its code away); its
    ``finish_metadata`` (run after the cell, once stdout and stderr were flushed, before the
    reply is sent) moves the request's count into the reply's content, and a failed cell's
    execution count into its ``engine_info`` (the part of an error reply that ipyparallel's
    ``RemoteError`` keeps: :func:`hora.engines._ipp.reply_count` reads it).
    """
    counts: dict[str, int] = {}
    lock = threading.Lock()  # streams are sent from the IOPub thread, displays from the cell's
    session, send, finish = kernel.session, kernel.session.send, kernel.finish_metadata

    def send_counted(stream: Any, msg_or_type: Any, *args: Any, **kwargs: Any) -> Any:
        if msg_or_type == SKIPPED:
            return None
        parent = _parent_id(msg_or_type, args, kwargs)
        if parent is not None:
            with lock:
                counts[parent] = counts.get(parent, 0) + 1
                if len(counts) > _KEPT:  # requests that never finished here (late output)
                    counts.pop(next(iter(counts)))
        return send(stream, msg_or_type, *args, **kwargs)

    def finish_counted(parent: Any, metadata: Any, reply_content: Any) -> Any:
        md = finish(parent, metadata, reply_content)
        with lock:
            reply_content[KEY] = counts.pop(parent.get("header", {}).get("msg_id", ""), 0)
        info = reply_content.get("engine_info")
        if isinstance(info, dict):  # a failed cell: ipyparallel keeps only this of its reply
            info.setdefault("execution_count", reply_content.get("execution_count"))
        return md

    session.send = send_counted
    kernel.finish_metadata = finish_counted


def _parent_id(msg_or_type: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
    """The request an output message answers (None for anything else)."""
    if isinstance(msg_or_type, dict):
        kind = msg_or_type.get("header", {}).get("msg_type")
        parent = msg_or_type.get("parent_header") or {}
    else:
        kind = msg_or_type
        given = kwargs.get("parent", args[1] if len(args) > 1 else None) or {}
        parent = given.get("header", given)
    if kind not in TYPES:
        return None
    msg_id = parent.get("msg_id")
    return msg_id if isinstance(msg_id, str) else None


def count_outputs(wait_s: float = 120.0) -> None:
    """Install :func:`counted` on the engine's kernel once ipyparallel has made it (a thread)."""

    def install() -> None:
        from ipyparallel.engine.app import IPEngine

        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            kernel = (
                getattr(IPEngine.instance(), "kernel", None) if IPEngine.initialized() else None
            )
            if kernel is not None:
                counted(kernel)
                return
            time.sleep(0.05)

    threading.Thread(target=install, name="hora-outputs", daemon=True).start()


def expected(content: Any) -> int | None:
    """The number of outputs a reply's content says the engine published (None: not said).

    Example:
        >>> expected({"status": "ok", "hora_outputs": 2}), expected({"status": "ok"})
        (2, None)
    """
    value = content.get(KEY) if isinstance(content, dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


class Tally:
    """The kernel's side: per rank, the outputs its reply says it published, and those seen."""

    def __init__(self) -> None:
        self.due: dict[int, int] = {}
        self.got: dict[int, int] = {}

    def replied(self, rank: int, content: Any) -> None:
        """Note the count a rank's reply carries (an engine that does not tell: nothing)."""
        due = expected(content)
        if due is not None:
            self.due[rank] = due

    def seen(self, rank: int, kind: str) -> None:
        """Note one IOPub message of the rank's request (counted when it is an output)."""
        if kind in TYPES:
            self.got[rank] = self.got.get(rank, 0) + 1

    def complete(self, rank: int) -> bool:
        """Whether every output the rank's reply announced came (False: not announced)."""
        due = self.due.get(rank)
        return due is not None and self.got.get(rank, 0) >= due

    def forget(self, rank: int) -> None:
        """Forget the rank (a new engine runs the cell again in its place)."""
        self.due.pop(rank, None)
        self.got.pop(rank, None)
