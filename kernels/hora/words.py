"""Counting in messages: ``1 worker``, ``2 workers``, ``rank 1``, ``ranks 1, 2`` (data plane).

One spelling for every message that counts something, so that none says ``1 workers`` or
``ranks 1``. Standard library only.
"""

from __future__ import annotations

from collections.abc import Iterable


def count(n: int, noun: str, nouns: str | None = None) -> str:
    """``n`` and the noun, singular for one.

    Args:
        n: how many.
        noun: the singular.
        nouns: the plural (default: ``noun + "s"``).

    Example:
        >>> count(1, "worker"), count(2, "worker"), count(0, "world")
        ('1 worker', '2 workers', '0 worlds')
    """
    return f"{n} {noun if n == 1 else (nouns or noun + 's')}"


def named(noun: str, items: Iterable[object], nouns: str | None = None) -> str:
    """The noun and the items it names, singular for one.

    Example:
        >>> named("rank", [1]), named("rank", [1, 2])
        ('rank 1', 'ranks 1, 2')
    """
    listed = [str(i) for i in items]
    word = noun if len(listed) == 1 else (nouns or noun + "s")
    return f"{word} {', '.join(listed)}"
