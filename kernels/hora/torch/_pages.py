"""New CPU tensors for the results hora hands back, on huge pages when large (data plane).

A collective that returns a new tensor (``hvd.allreduce``, ``hvd.allgather``,
``hvd.broadcast``) allocates it on every call. From 32 MiB, glibc's largest mmap threshold,
every such allocation is a fresh mapping, and writing the result faults it in one 4 KiB page
at a time: on the development VM a fresh 256 MB tensor took 3x as long to fill as with
2 MiB pages, and a 2-rank ``hvd.allreduce`` of it twice as long as with them
(``bench/RESULTS.md`` section 22). The kernel backs a range with huge pages at its first
touch when the process asks for them (``madvise(MADV_HUGEPAGE)``), also where transparent
huge pages are set to ``madvise``, the default of most distributions. :func:`empty` asks for
them over the 2 MiB-aligned inside of a tensor of at least :data:`MIN_BYTES`, before anything
wrote it; the edges keep small pages, so no huge page reaches into another allocation.
Smaller tensors come from glibc's heap, mostly from pages already in use, and are left alone.

Advice only: where the kernel has no transparent huge pages (or they are ``never``), on another
OS, where torch already asks for every allocation (its ``THP_MEM_ALLOC_ENABLE=1``), or with
``HORA_HUGE_PAGES=off``, nothing changes. Tensors on a GPU are left as torch made them.
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import torch

HUGE = 2 << 20
MIN_BYTES = 32 << 20  # glibc's largest mmap threshold: from there, every allocation is fresh
MADV_HUGEPAGE = 14
_OFF = ("0", "off", "false", "no")


def wanted(environ: Mapping[str, str] | None = None) -> bool:
    """Whether hora asks for huge pages in this process (``HORA_HUGE_PAGES``, torch's own).

    >>> wanted({})
    True
    >>> wanted({"HORA_HUGE_PAGES": "off"}), wanted({"THP_MEM_ALLOC_ENABLE": "1"})
    (False, False)
    """
    env = os.environ if environ is None else environ
    if env.get("HORA_HUGE_PAGES", "").strip().lower() in _OFF:
        return False
    return env.get("THP_MEM_ALLOC_ENABLE", "").strip() != "1" and sys.platform == "linux"


@functools.cache
def _libc_madvise() -> Any:
    """The C library's madvise, looked up at the first large tensor; None if absent or off."""
    if not wanted():
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def advise(t: torch.Tensor) -> bool:
    """Ask for huge pages under the aligned inside of ``t``'s memory; return whether it was asked.

    Worth it only before ``t`` was written: a range faults in huge pages at its first touch.
    The kernel refusing (no transparent huge pages) is not an error.
    """
    nbytes = t.numel() * t.element_size()
    if nbytes < MIN_BYTES or t.device.type != "cpu":
        return False
    fn = _libc_madvise()
    if fn is None:
        return False
    start = t.data_ptr()
    lo, hi = (start + HUGE - 1) & ~(HUGE - 1), (start + nbytes) & ~(HUGE - 1)
    return hi > lo and fn(lo, hi - lo, MADV_HUGEPAGE) == 0


def empty(shape: Sequence[int], like: torch.Tensor) -> torch.Tensor:
    """A new contiguous tensor of ``like``'s dtype and device, not written yet."""
    out = like.new_empty(tuple(shape))
    advise(out)
    return out


def clone(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of ``t``, in memory advised before the copy wrote it."""
    return empty(t.shape, t).copy_(t)
