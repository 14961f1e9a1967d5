"""Server-Sent Events, parsed from a response's lines (data plane; the client's log streams).

Only the standard library: :func:`parse_sse` reads ``event:``, ``data:`` and ``id:`` fields
and skips comments, as the WHATWG event-stream format says.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

DEFAULT_EVENT = "message"


@dataclass
class SseEvent:
    """One event of a stream: its name (``message`` unless named), data and id."""

    event: str = DEFAULT_EVENT
    data: str = ""
    id: str | None = None


def parse_sse(lines: Iterator[str]) -> Iterator[SseEvent]:
    """Parse Server-Sent Events from text lines (``event:``, ``data:``, ``id:``, comments).

    Args:
        lines: the stream's lines without line terminators.

    Yields:
        One event per blank-line-terminated block that carried data or an event name.

    Example:
        >>> [e.data for e in parse_sse(iter(["id: 3", 'data: "abc"', ""]))]
        ['"abc"']
    """
    ev, seen = SseEvent(), False
    data: list[str] = []
    for line in lines:
        if not line:
            if seen:
                ev.data = "\n".join(data)
                yield ev
            ev, data, seen = SseEvent(), [], False
            continue
        if line.startswith(":"):
            continue
        key, _, value = line.partition(":")
        value = value[1:] if value.startswith(" ") else value
        if key == "data":
            data.append(value)
            seen = True
        elif key == "event":
            ev.event, seen = value, True
        elif key == "id":
            ev.id = value
    if seen:
        ev.data = "\n".join(data)
        yield ev
