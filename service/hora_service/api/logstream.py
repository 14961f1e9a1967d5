r"""Reading and streaming one rank's log file (control plane, used by the logs route).

Offsets are byte offsets into the log file of one attempt. A chunk never ends inside a UTF-8
sequence, so every event's text decodes on its own and ``id`` (the offset after the chunk) is
a safe place to resume from. Server-Sent Events carry the text as a JSON string in ``data:``
so that ``\r`` from progress bars and trailing newlines survive the SSE line format.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from starlette.concurrency import run_in_threadpool

from hora_service.runtimes.runfiles import UntrustedRunFile, file_size, read_chunk

SSE_CHUNK_BYTES = 64 * 1024


def complete_prefix(data: bytes, final: bool = False) -> tuple[str, int]:
    """Decode the longest prefix of ``data`` that does not end inside a UTF-8 sequence.

    Args:
        data: raw bytes of a log.
        final: nothing more will follow; decode everything (bad bytes become U+FFFD).

    Returns:
        The text and the number of bytes it consumed.

    Example:
        >>> complete_prefix("né".encode()[:2])
        ('n', 1)
    """
    if final:
        return data.decode("utf-8", errors="replace"), len(data)
    cut = len(data)
    # walk back over at most 3 continuation bytes to the start of the last sequence
    for back in range(1, min(4, len(data)) + 1):
        byte = data[-back]
        if byte & 0xC0 == 0x80:
            continue
        need = (
            2
            if byte >> 5 == 0b110
            else 3
            if byte >> 4 == 0b1110
            else 4
            if byte >> 3 == 0b11110
            else 1
        )
        if need > back:
            cut = len(data) - back
        break
    return data[:cut].decode("utf-8", errors="replace"), cut


def sse_event(data: Any, event: str | None = None, event_id: int | None = None) -> bytes:
    r"""Encode one Server-Sent Event whose data is ``json.dumps(data)`` (one line).

    Example:
        >>> sse_event("hi", event_id=4)
        b'id: 4\ndata: "hi"\n\n'
    """
    lines = []
    if event:
        lines.append(f"event: {event}")
    if event_id is not None:
        lines.append(f"id: {event_id}")
    lines.append(f"data: {json.dumps(data)}")
    return ("\n".join(lines) + "\n\n").encode()


def _size(path: Path) -> int:
    try:
        return file_size(path)
    except UntrustedRunFile:
        return 0  # the next read says why


@dataclass(frozen=True)
class FollowState:
    """What the stream needs to know about the job at each poll."""

    done: bool
    info: dict[str, Any]


async def follow_log(
    path: Path,
    offset: int,
    poll_state: Callable[[], FollowState],
    disconnected: Callable[[], Awaitable[bool]],
    poll_s: float = 0.2,
    heartbeat_s: float = 15.0,
    take: Callable[[bytes, bool], tuple[str, int]] = complete_prefix,
) -> AsyncIterator[bytes]:
    """Stream ``path`` from ``offset`` as SSE until the attempt is done and the file drained.

    Args:
        path: the log file (from the manager, never from user input).
        offset: byte offset to start from.
        poll_state: returns whether the attempt is over (checked before each read, so every
            byte written before the end is sent) and what to put in the final event.
        disconnected: async check that the client went away.
        poll_s: seconds between polls when there is nothing new.
        heartbeat_s: seconds between keep-alive comments while idle.
        take: the text to send of the bytes read and how many it consumed (default: all of
            it, cut at a whole UTF-8 sequence; an elastic job's rank: its worker's lines).

    Yields:
        Encoded SSE events: log chunks (``id`` = offset after the chunk), then ``event: end``.
    """
    last_sent = time.monotonic()
    start = offset
    while True:
        state = await run_in_threadpool(poll_state)
        try:
            data = await run_in_threadpool(read_chunk, path, offset, SSE_CHUNK_BYTES)
        except UntrustedRunFile as e:  # the job planted it: say so and end the stream
            yield sse_event({**state.info, "offset": offset, "error": str(e)}, "end", offset)
            return
        text, used = take(data, state.done and len(data) < SSE_CHUNK_BYTES)
        if used:
            offset += used
            if text:
                last_sent = time.monotonic()
                yield sse_event(text, event_id=offset)
            continue
        if not data and offset > start and await run_in_threadpool(_size, path) < offset:
            offset = start = 0  # the log passed its limit and was cut: go on from its marker
            continue
        if state.done:
            yield sse_event({**state.info, "offset": offset}, event="end", event_id=offset)
            return
        if await disconnected():
            return
        if time.monotonic() - last_sent >= heartbeat_s:
            last_sent = time.monotonic()
            yield b": keep-alive\n\n"
        await asyncio.sleep(poll_s)
