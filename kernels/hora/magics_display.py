"""What the magics show in the notebook: tables, a cell's live output, the queue, --profile.

Imported by :mod:`hora.magics` when ``%load_ext hora`` runs, so it stays light: IPython's
display functions and hora's engine modules load inside the functions that use them.
"""

from __future__ import annotations

import functools
import html
import re
import sys
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from hora.engines.cluster import EngineRow
    from hora.scaling import ProfileReport
    from hora.spec import SessionInfo

F = TypeVar("F", bound=Callable[..., Any])


def short_errors(magic: F) -> F:
    """A magic whose hora errors show as one line: the error's name and what is wrong.

    A :class:`hora.errors.HoraError` raised by the magic (a bad request the service refused,
    a service that cannot be reached, a bad argument) is a usage error: the notebook shows
    it without a traceback through hora's own frames. Errors that render themselves
    (``_render_traceback_``: a failed cell's report, the engines' errors) are left as they
    are; so is anything that is not hora's (a bug shows its whole traceback).

    Example:
        >>> from hora.errors import SpecError
        >>> @short_errors
        ... def magic(line):
        ...     raise SpecError("n", "must be >= 1")
        >>> try:
        ...     magic("")
        ... except SpecError as e:
        ...     e._render_traceback_()
        ['SpecError: n: must be >= 1']
    """

    @functools.wraps(magic)
    def run(*args: Any, **kwargs: Any) -> Any:
        from hora.errors import HoraError

        try:
            return magic(*args, **kwargs)
        except HoraError as e:
            if not hasattr(e, "_render_traceback_"):
                line = f"{type(e).__name__}: {_what_is_wrong(e)}"
                e._render_traceback_ = lambda: [line]  # type: ignore[attr-defined]
            raise

    return run  # type: ignore[return-value]


def _what_is_wrong(e: Exception) -> str:
    """The message of ``e``; of a request the service refused as invalid, only its reason."""
    from hora.client import ServiceError

    if isinstance(e, ServiceError) and e.status == 422:
        from hora.client import render_detail

        return render_detail(e.detail)
    return str(e)


class Table:
    """Rows of dicts shown as an HTML table in notebooks and aligned text elsewhere."""

    def __init__(self, rows: Sequence[dict[str, Any]], title: str = "") -> None:
        self.rows, self.title = list(rows), title
        self.cols = list(self.rows[0]) if self.rows else []

    def __repr__(self) -> str:
        cells = [self.cols] + [[str(r[c]) for c in self.cols] for r in self.rows]
        widths = [max(len(row[i]) for row in cells) for i in range(len(self.cols))]
        lines = [
            "  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)).rstrip()
            for row in cells
        ]
        return "\n".join(([self.title] if self.title else []) + lines)

    def _repr_html_(self) -> str:
        head = "".join(f"<th>{html.escape(c)}</th>" for c in self.cols)
        body = "".join(
            "<tr>" + "".join(f"<td>{html.escape(str(r[c]))}</td>" for c in self.cols) + "</tr>"
            for r in self.rows
        )
        cap = f"<caption>{html.escape(self.title)}</caption>" if self.title else ""
        return f"<table>{cap}<thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def engines_table(rows: Sequence[EngineRow], title: str) -> Table:
    """``%dist_start``'s table: per rank its host, pid, device, GPU and engine id."""
    return Table(
        [
            {"rank": r["rank"], "host": r["host"], "pid": r["pid"], "device": r["device"],
             "gpu": r["gpu"], "engine_id": r["engine_id"]}
            for r in rows
        ],
        title,
    )  # fmt: skip


_LINE_END = re.compile(r"(\r\n|\r|\n)")


class DisplaySink:
    r"""Shows a cell's live output in the notebook: text as it streams, rich output displayed.

    With ``prefix`` (``--all``) text is passed on a whole line at a time, each line prefixed
    ``[rank N]``: ranks print concurrently, and a partial line of one rank must not be joined
    with another rank's text. A line ends at ``\n`` or ``\r`` (so progress bars that redraw
    with ``\r`` still update); what is left at the end of the cell is written by :meth:`flush`.

    Args:
        prefix: prefix each line with ``[rank N]`` (``--all``).
    """

    def __init__(self, prefix: bool) -> None:
        self.prefix = prefix
        self._partial: dict[tuple[int, str], str] = {}

    def stream(self, rank: int, name: str, text: str) -> None:
        """Write a rank's text to the notebook's stdout or stderr."""
        if self.prefix:
            key = (rank, name)
            parts = _LINE_END.split(self._partial.pop(key, "") + text)
            if parts[-1]:
                self._partial[key] = parts[-1]
            text = "".join(
                end if not line and end == "\r" else f"[rank {rank}] {line}{end}"
                for line, end in zip(parts[:-1:2], parts[1::2], strict=True)
            )
        self._write(name, text)

    def flush(self) -> None:
        """Write the ranks' unfinished lines (text printed without a newline at the end)."""
        for (rank, name), line in sorted(self._partial.items()):
            self._write(name, f"[rank {rank}] {line}\n")
        self._partial.clear()

    @staticmethod
    def _write(name: str, text: str) -> None:
        if not text:
            return
        out = sys.stderr if name == "stderr" else sys.stdout
        out.write(text)
        out.flush()

    def display(self, rank: int, content: dict[str, Any]) -> None:
        """Display a rank's rich output (plots, tables, the cell's last value, updates)."""
        from IPython.display import clear_output, publish_display_data

        if content.get("clear"):
            clear_output(wait=bool(content.get("wait")))
            return
        transient = dict(content.get("transient") or {})
        if "display_id" in transient:  # ranks may reuse ids; keep them apart in the notebook
            transient["display_id"] = f"rank{rank}-{transient['display_id']}"
        if self.prefix and not content.get("update"):
            sys.stdout.write(f"[rank {rank}]\n")
            sys.stdout.flush()
        publish_display_data(
            content.get("data", {}),
            content.get("metadata", {}),
            transient=transient or None,
            update=bool(content.get("update")),
        )


class QueueDisplay:
    """Shows a queued ``%dist_start`` live in its cell: one display, updated in place."""

    def __init__(self) -> None:
        self.handle: Any = None
        self.t0 = time.monotonic()
        self.placed = False  # a place in the queue was shown

    def update(self, info: SessionInfo) -> None:
        """Show the session's place in the queue (called while it waits).

        While the service hands the freed slots over, the session is still queued but has no
        place any more (``queue`` is None): the place shown last stays, rather than a bare
        "session N queued" replacing it in the cell's last moments of waiting.
        """
        from datetime import UTC, datetime

        from IPython.display import display

        from hora.engines.session import render_queue

        if info.queue is None and self.placed:
            return
        self.placed = self.placed or info.queue is not None
        text = _Text(render_queue(info, datetime.now(UTC), time.monotonic() - self.t0))
        if self.handle is None:
            self.handle = display(text, display_id=True)
        else:
            self.handle.update(text)

    def done(self, cluster: Any) -> None:
        """Say how long the engines waited (the last queue state stays shown above)."""
        if self.handle is not None:
            sys.stdout.write(f"slots granted after {cluster.queued_s:.1f}s in the queue\n")


class _Text:
    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return self.text


def show_profile(report: ProfileReport | None) -> None:
    """Display ``%%distributed --profile``'s table, chart and verdict."""
    from IPython.display import display

    from hora.engines.profile import ChartHTML

    if report is None:
        sys.stderr.write("--profile: some rank recorded nothing (was the cell interrupted?)\n")
        return
    display(Table(report.rows(), "scaling report (--profile)"))
    display(ChartHTML(report))
    sys.stdout.write(report.verdict() + "\n")


def notify(text: str) -> None:
    """Show a session notice (from the heartbeat thread) in the notebook's latest output."""
    sys.stderr.write(text + "\n")
    sys.stderr.flush()
