"""How a cell's failure is shown: cell numbers, hidden frames, stacks, log tails (data plane).

Pure functions over text: the engines report in their own terms (their own cell counts,
ipykernel's cell files, faulthandler dumps of every thread, whole engine logs); these turn that
into what the notebook's user reads.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

_CELL = re.compile(r"(Cell\S*\s*\S*In\[)(\d+)(\])")
_CELL_FILE = re.compile(r'File "[^"]*ipykernel_\d+[/\\](\d+)\.py", line (\d+)')


@dataclass
class CellNumbers:
    """The notebook's numbers of the cells the engines ran (each engine counts its own cells).

    IPython names a cell in a traceback by the engine's count (``Cell In[2]``) and, in a raw
    stack, by a file named after a hash of its source; both are mapped back to the number the
    notebook shows.

    Attributes:
        by_count: rank -> engine execution count -> notebook number.
        by_file: ipykernel's cell-file hash -> notebook number.
    """

    by_count: dict[int, dict[int, int]] = field(default_factory=dict)
    by_file: dict[str, int] = field(default_factory=dict)

    def note_code(self, code: str, number: int) -> None:
        """Remember the file name ipykernel gives ``code`` in the engines."""
        try:
            from ipykernel.compiler import get_tmp_hash_seed, murmur2_x86
        except ImportError:  # pragma: no cover - engines run ipykernel
            return
        self.by_file[str(murmur2_x86(code, get_tmp_hash_seed()))] = number

    def traceback(self, rank: int, lines: Sequence[str]) -> list[str]:
        """Return ``lines`` with the engine's cell numbers replaced by the notebook's.

        Example:
            >>> CellNumbers({1: {2: 7}}).traceback(1, ["Cell In[2], line 3", "Cell In[9], x"])
            ['Cell In[7], line 3', 'Cell In[9], x']
        """
        known = self.by_count.get(rank, {})

        def sub(m: re.Match[str]) -> str:
            return f"{m[1]}{known.get(int(m[2]), int(m[2]))}{m[3]}"

        return [_CELL.sub(sub, line) for line in lines]

    def stack(self, text: str) -> str:
        """Return a stack dump with the cells' file names replaced by ``Cell In[N]``.

        Example:
            >>> n = CellNumbers(by_file={"42": 5})
            >>> n.stack('  File "/tmp/ipykernel_9/42.py", line 3 in f')
            '  Cell In[5], line 3 in f'
        """

        def sub(m: re.Match[str]) -> str:
            number = self.by_file.get(m[1])
            return m[0] if number is None else f"Cell In[{number}], line {m[2]}"

        return _CELL_FILE.sub(sub, text)


_ANSI = re.compile(r"\x1b\[[0-9;]*m")
HORA_FRAMES = ("/hora/torch/", "/hora/engines/")


def hide_hora_frames(lines: Sequence[str]) -> list[str]:
    """Drop the frames inside hora from an IPython traceback; one line says how many.

    The user's own frames and the exception stay; what hora.torch did below the user's call
    (signature checks, waits) explains nothing the message does not say.

    Example:
        >>> tb = ["Cell In[1], line 1", "--> 1 f()", "", "File /x/hora/torch/a.py:3, in g", ""]
        >>> hide_hora_frames(tb + ["KeyError: 1"])
        ['Cell In[1], line 1', '--> 1 f()', '', '(1 frame inside hora hidden)', '', 'KeyError: 1']
    """
    out: list[str] = []
    block: list[str] = []
    hidden = 0

    def flush() -> None:
        nonlocal hidden
        head = _ANSI.sub("", block[0]).strip() if block else ""
        if head.startswith("File ") and any(m in head for m in HORA_FRAMES):
            hidden += 1
            return
        if hidden:
            out.extend([f"({hidden} frame{'s' if hidden > 1 else ''} inside hora hidden)", ""])
            hidden = 0
        out.extend(block)

    for line in lines:
        block.append(line)
        if not _ANSI.sub("", line).strip():
            flush()
            block = []
    if block:
        flush()
    return out


def pick_thread(dump: str, thread_id: int) -> str:
    """Return one thread's frames from a faulthandler dump, cut below the cell's own frames.

    Args:
        dump: faulthandler output for all threads.
        thread_id: the thread to keep (the engine's main thread); 0 keeps the whole dump.

    Returns:
        The frames of that thread up to the IPython machinery that runs cells.

    Example:
        >>> dump = "Thread 0x1 (most recent call first):"  + chr(10) + '  File "a.py", line 1 in f'
        >>> pick_thread(dump, 1)
        '  File "a.py", line 1 in f'
    """
    blocks: dict[int, list[str]] = {}
    current: list[str] | None = None
    for line in dump.splitlines():
        words = line.split()
        if line.startswith(("Thread 0x", "Current thread 0x")) and len(words) > 1:
            current = blocks.setdefault(int(words[1] if words[0] == "Thread" else words[2], 16), [])
        elif current is not None and line.startswith("  "):
            current.append(line)
    frames = blocks.get(thread_id) if thread_id else None
    if frames is None:
        return dump.strip()
    kept = []
    for line in frames:
        if "IPython/core/interactiveshell.py" in line:
            break
        kept.append(line)
    return "\n".join(kept or frames)


COLLECTIVE_FRAMES = ("/hora/torch/", "/torch/distributed/")


def in_collective(stack: str) -> bool:
    """Return whether a stack (from :func:`read_stack`) is inside hora.torch or torch.distributed.

    Example:
        >>> in_collective('  File "/x/hora/torch/mpi_ops.py", line 9 in allreduce')
        True
    """
    return any(marker in stack for marker in COLLECTIVE_FRAMES)


# warnings every engine logs at start; they explain nothing about a death
_BENIGN = ("Not using CurveZMQ security", "debugpy_stream undefined")


def log_tail(path: Path, main_thread: int = 0, n: int = 20) -> str:
    """Return what explains an engine's death from its log: a fatal-error stack, else the tail.

    Args:
        path: the engine's log file.
        main_thread: the engine's main thread ident, to keep only its frames of a crash dump.
        n: lines of plain tail when there is no crash dump.

    Returns:
        "Fatal Python error: ..." with the main thread's frames, or the last ``n`` lines.
    """
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    at = text.rfind("Fatal Python error")
    if at < 0:
        lines = [line for line in text.splitlines() if not any(b in line for b in _BENIGN)]
        return "\n".join(lines[-n:])
    dump = text[at:]
    head = dump.splitlines()[0]
    return head + "\n" + pick_thread(dump, main_thread)
