"""The private parts of ipyparallel's client that the engines must use, in one place (data plane).

ipyparallel's public API sends a cell to a view of engines and interrupts through a nanny
process; hora needs to send one cell to one engine by its ZeroMQ identity (a replacement
engine joins a cell already running on the others), to ask an engine on its control channel
for its stack or to interrupt itself (hora's engines run without a nanny), and to learn an
engine's identity. An ipyparallel upgrade that moves these names breaks here only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def engine_ident(client: Any, engine_id: int) -> bytes:
    """The ZeroMQ identity of engine ``engine_id`` (what a direct request is addressed to)."""
    return str(client._engines[engine_id]).encode()


def send_cell(client: Any, code: str, ident: bytes, hook: Callable[[Any], None]) -> None:
    """Send ``code`` to one engine, by identity, on the client's multiplexed channel.

    Args:
        client: the ipyparallel client.
        code: the cell's source.
        ident: the engine's identity (:func:`engine_ident`).
        hook: called with the request's message future (ipyparallel's
            ``message_future_hook``), to follow its outputs and its end.
    """
    client.send_execute_request(
        client._mux_stream, code, silent=False, ident=ident, message_future_hook=hook
    )


def reply_content(reply: Any) -> dict[str, Any] | None:
    """The content of an engine's ``execute_reply`` as ipyparallel kept it (None: not kept)."""
    content = getattr(reply, "_content", None)
    return content if isinstance(content, dict) else None


def reply_count(reply: Any) -> int | None:
    """The execution count an engine's reply (an ``ExecuteReply`` or a ``RemoteError``) gives.

    A failed cell's count is in the error's ``engine_info``, where the engine put it
    (:func:`hora.engines.outputs.counted`).
    """
    content = reply_content(reply)
    if content is None:
        info = getattr(reply, "engine_info", None)
        content = info if isinstance(info, dict) else {}
    count = content.get("execution_count")
    return count if isinstance(count, int) and not isinstance(count, bool) else None


def control_request(client: Any, engine_id: int, msg_type: str) -> Any:
    """Send ``msg_type`` on one engine's control channel (answered also while a cell runs).

    Returns:
        The request's future (``.result(timeout)`` gives the list of replies); not waited for.
    """
    return client._send_control_request([engine_id], msg_type, {}, block=False)
