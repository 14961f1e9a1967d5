"""New CPU tensors for hora's results ask for huge pages when large (hora.torch._pages).

Checked through what the kernel reports for this process (/proc/self/smaps): the advice flag
(``hg`` in the mapping's VmFlags) inside a large tensor, none for a small one or with the
advice switched off, and, once written, huge pages behind it wherever the machine's
transparent huge pages allow ``madvise`` (none where they are ``never``).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from helpers import pagemaps
from hora.torch import _pages

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


@pytest.fixture(autouse=True)
def _fresh_lookup(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Each test finds libc's madvise again, under its own environment."""
    monkeypatch.delenv("HORA_HUGE_PAGES", raising=False)
    monkeypatch.delenv("THP_MEM_ALLOC_ENABLE", raising=False)
    _pages._libc_madvise.cache_clear()
    yield
    _pages._libc_madvise.cache_clear()


def _mode() -> str:
    text = THP.read_text() if THP.exists() else "[never]"
    return text[text.index("[") + 1 : text.index("]")]


def test_a_large_result_is_advised_and_filled_with_huge_pages_where_the_kernel_allows() -> None:
    t = _pages.empty(((40 << 20) // 4,), torch.ones(1))
    assert t.is_contiguous() and t.dtype == torch.float32 and t.numel() == (40 << 20) // 4
    assert pagemaps.advised(t)
    t.fill_(1.0)
    if _mode() == "never":
        assert pagemaps.huge_kb(t) == 0
    else:
        assert pagemaps.huge_kb(t) >= 16 << 10  # 16 MiB of the 40 at least


def test_the_edges_stay_on_small_pages_so_no_huge_page_reaches_past_the_tensor() -> None:
    t = _pages.empty(((40 << 20) // 4 + 3,), torch.ones(1))
    start, end = t.data_ptr(), t.data_ptr() + t.numel() * 4
    assert start % pagemaps.HUGE != 0, "torch's allocation starts past a mapping's header"
    assert "hg" not in pagemaps.mapping_at(start).get("VmFlags", "").split()
    assert "hg" not in pagemaps.mapping_at(end - 1).get("VmFlags", "").split()
    assert pagemaps.advised(t)


def test_a_clone_has_the_values_and_the_advice() -> None:
    src = torch.arange((36 << 20) // 8, dtype=torch.float64).view(-1, 2).t()  # not contiguous
    got = _pages.clone(src)
    assert got.is_contiguous() and torch.equal(got, src) and got.shape == src.shape
    assert pagemaps.advised(got)


def test_a_small_tensor_is_left_alone() -> None:
    t = _pages.empty(((_pages.MIN_BYTES - 4096) // 4,), torch.ones(1))
    assert not _pages.advise(t)
    assert not pagemaps.advised(t)


@pytest.mark.parametrize("env", [{"HORA_HUGE_PAGES": "off"}, {"HORA_HUGE_PAGES": "0"},
                                 {"THP_MEM_ALLOC_ENABLE": "1"}], ids=lambda e: str(e))
def test_switched_off_or_left_to_torch_nothing_is_asked(
        monkeypatch: pytest.MonkeyPatch, env: dict[str, str]) -> None:
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert not _pages.wanted()
    t = torch.empty((40 << 20) // 4)
    assert not _pages.advise(t)
    assert not pagemaps.advised(t)
