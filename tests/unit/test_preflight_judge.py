"""Judging the preflight's figures against a node's baseline: which rank or link is named."""

from __future__ import annotations

from hora.torch._preflight_figures import LinkFigures, PathFigures, RankFigures, judge

BASE = {"n1": {"gloo": {"copy_gbps": 10.0, "link_gbps": 1.0}}}


def _path(links: dict[tuple[int, int], float]) -> PathFigures:
    ranks = [RankFigures(r, "n1", 10.0, 10.0, 1.0, 0.0) for r in range(3)]
    return PathFigures("gloo", [4], [1.0], [1.0], 10.0, ranks,
                       [LinkFigures(a, b, 50.0, g) for (a, b), g in links.items()])  # fmt: skip


def test_a_rank_all_of_whose_links_are_slow_is_named_instead_of_its_links() -> None:
    found = judge(_path({(0, 1): 0.9, (1, 2): 0.01, (2, 0): 0.01}), BASE, 0.5)
    assert [(f.kind, f.who, f.figure) for f in found] == [("rank", "rank 2", "link_gbps")]


def test_a_link_the_machine_slowed_too_does_not_name_a_sound_rank() -> None:
    # under load the link between two sound ranks also fell below half of the baseline: the
    # rank every slowest link goes through (2) is named, and the other link stays a link
    found = judge(_path({(0, 1): 0.4, (1, 2): 0.01, (2, 0): 0.01}), BASE, 0.5)
    assert sorted((f.kind, f.who) for f in found) == [("link", "link 0<->1"), ("rank", "rank 2")]
    found = judge(_path({(0, 1): 0.01, (1, 2): 0.4, (2, 0): 0.01}), BASE, 0.5)
    assert sorted((f.kind, f.who) for f in found) == [("link", "link 1<->2"), ("rank", "rank 0")]


def test_one_slow_link_is_named_as_a_link() -> None:
    found = judge(_path({(0, 1): 0.9, (1, 2): 0.2, (2, 0): 0.9}), BASE, 0.5)
    assert [(f.kind, f.who) for f in found] == [("link", "link 1<->2")]
