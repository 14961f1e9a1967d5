"""Horovod process sets: only the global set is supported (data plane).

``process_set=`` arguments are accepted for signature compatibility; anything but the global
set (or a set listing every rank) raises :class:`~hora.errors.UnsupportedError`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hora.errors import UnsupportedError


class ProcessSet:
    """A set of ranks (Horovod's ``hvd.ProcessSet``); hora runs collectives on all ranks only.

    Args:
        ranks: the ranks in the set; None means every rank.

    Example:
        >>> hvd.global_process_set.ranks is None
        True
    """

    def __init__(self, ranks: Sequence[int] | None = None) -> None:
        self.ranks = None if ranks is None else sorted(int(r) for r in ranks)
        self.process_set_id = 0 if ranks is None else -1

    def __repr__(self) -> str:
        return f"ProcessSet(ranks={self.ranks!r})"

    def size(self) -> int:
        """Return the number of ranks in the set."""
        from hora.torch import _state

        return _state.size() if self.ranks is None else len(self.ranks)

    def included(self) -> bool:
        """Return whether this rank belongs to the set."""
        from hora.torch import _state

        return self.ranks is None or _state.rank() in self.ranks


global_process_set = ProcessSet()


def check_process_set(ps: Any) -> None:
    """Raise UnsupportedError unless ``ps`` is the global set (or None, or all ranks)."""
    if ps is None or ps is global_process_set or getattr(ps, "ranks", 0) is None:
        return
    from hora.torch import _state

    state = _state._STATE
    if state is not None and getattr(ps, "ranks", None) == list(range(state.size)):
        return
    raise UnsupportedError(
        "hora.torch runs collectives on the global process set only; "
        f"{ps!r} is not supported (use torch.distributed.new_group for subgroups)"
    )


def add_process_set(process_set: ProcessSet | Sequence[int]) -> ProcessSet:
    """Not supported: hora.torch has the global process set only.

    Raises:
        UnsupportedError: always.
    """
    raise UnsupportedError("hvd.add_process_set() is not supported by hora.torch")


def remove_process_set(process_set: ProcessSet) -> bool:
    """Not supported: hora.torch has the global process set only.

    Raises:
        UnsupportedError: always.
    """
    raise UnsupportedError("hvd.remove_process_set() is not supported by hora.torch")
