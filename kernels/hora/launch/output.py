"""Stream each rank's stdout/stderr to the launcher's, every line prefixed with its rank.

Data plane. One daemon thread per pipe reads lines as they arrive and writes
``[1]<stdout>:line`` (Horovod's format) to the launcher's own stdout or stderr, so the two
streams stay separate and a rank that writes megabytes never blocks on a full pipe. A partial
last line (no trailing newline) is flushed, with a newline added, when the pipe closes.
"""

from __future__ import annotations

import threading
from typing import IO


class PrefixedSink:
    """A shared, locked destination for prefixed lines (one per launcher stream).

    Args:
        stream: a text stream with a binary ``buffer`` (``sys.stdout``), or any text stream.

    Example:
        >>> import io
        >>> sink = PrefixedSink(io.StringIO())
        >>> sink.write_line(prefix(0, "stdout"), b"hello")
    """

    def __init__(self, stream: IO[str]) -> None:
        self._stream = stream
        self._binary: IO[bytes] | None = getattr(stream, "buffer", None)
        self._lock = threading.Lock()

    def write_line(self, prefix: bytes, line: bytes) -> None:
        """Write one prefixed line atomically (never interleaved with another rank's line).

        Args:
            prefix: e.g. ``b"[1]<stderr>:"``.
            line: the rank's bytes; a newline is added when missing.
        """
        data = prefix + (line if line.endswith(b"\n") else line + b"\n")
        with self._lock:
            try:
                if self._binary is not None:
                    self._stream.flush()
                    self._binary.write(data)
                    self._binary.flush()
                else:
                    self._stream.write(data.decode("utf-8", errors="replace"))
                    self._stream.flush()
            except (OSError, ValueError):  # our own stdout closed (`| head`): drop, keep draining
                pass


def prefix(rank: int, stream: str) -> bytes:
    """Return Horovod's line prefix for ``rank`` and ``stream`` ("stdout" or "stderr").

    Args:
        rank: the global rank.
        stream: "stdout" or "stderr".

    Returns:
        The prefix bytes.

    Example:
        >>> prefix(1, "stderr")
        b'[1]<stderr>:'
    """
    return f"[{rank}]<{stream}>:".encode()


def _pump(source: IO[bytes], head: bytes, sink: PrefixedSink) -> None:
    try:
        for line in iter(source.readline, b""):
            sink.write_line(head, line)
    except (OSError, ValueError):  # the pipe was closed under us at shutdown
        pass
    finally:
        try:
            source.close()
        except OSError:
            pass


def start_pump(source: IO[bytes], head: bytes, sink: PrefixedSink, name: str) -> threading.Thread:
    """Start a daemon thread copying ``source`` line by line to ``sink`` under ``head``.

    Args:
        source: the read end of a rank's stdout or stderr pipe.
        head: the line prefix (see :func:`prefix`).
        sink: where the lines go.
        name: the thread's name.

    Returns:
        The started thread; it ends when the pipe closes.
    """
    thread = threading.Thread(target=_pump, args=(source, head, sink), name=name, daemon=True)
    thread.start()
    return thread
