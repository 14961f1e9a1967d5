"""The communication preflight (hora.torch.preflight) on 3 real gloo ranks of one host.

One world, in order:

* ``hvd.init()`` with ``HORA_PREFLIGHT=1`` and a pipe named by ``HORA_PREFLIGHT_FD`` (as the
  rank shim gives rank 0): rank 0 writes one JSON document to the pipe with the figures of
  both paths (gloo, and the shared-memory ring); no rank writes anything to its output;
* a plain :func:`run`: the same report on every rank, per-rank and per-link figures, the
  nccl-tests busbw factor; rank 0 records it as each node's baseline (:func:`save_baseline`);
* rank 1 slowed on purpose (a test hook sleeps 50 ms inside each timed local copy) without a
  baseline: nothing is named (the other ranks are no reference: on a loaded machine they are
  slow together);
* rank 1 slowed: it is named against the recorded baseline, and its ranks waited less than
  the others;
* rank 2's links slowed (50 ms per ping-pong): rank 2 is named, not a link (every link of it is
  slow, the third link is not);
* with ``fail_below`` and rank 1 slowed: PreflightError on every rank, naming rank 1.

No timing is asserted beyond that a 50 ms sleep in a millisecond copy is far below the rest.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest


def _sleepy(phase_wanted: str) -> Callable[[str], None]:
    import time

    def hook(phase: str) -> None:
        if phase == phase_wanted:
            time.sleep(0.05)

    return hook


def _slowed(preflight: Any, rank: int, who: int, phase: str, **kw: Any) -> Any:
    if rank == who:
        preflight.SLOW_HOOKS.append(_sleepy(phase))
    try:
        return preflight.run(**kw).to_dict()
    except preflight.PreflightError as e:
        return {"error": str(e)}
    finally:
        preflight.SLOW_HOOKS.clear()


def _init_handing_figures_over() -> tuple[str, str]:
    """``hvd.init()`` with the preflight asked for and a pipe as its shim gives rank 0.

    Returns what the process wrote to its output meanwhile, and what came down the pipe.
    """
    import hora.torch as hvd

    read_end, write_end = os.pipe()
    st = os.fstat(write_end)
    os.environ["HORA_PREFLIGHT"] = "1"
    os.environ["HORA_PREFLIGHT_FD"] = f"{write_end}:{st.st_dev}:{st.st_ino}"
    out = io.StringIO()
    with contextlib.redirect_stderr(out), contextlib.redirect_stdout(out):
        hvd.init()
    del os.environ["HORA_PREFLIGHT"], os.environ["HORA_PREFLIGHT_FD"]
    os.close(write_end)
    with os.fdopen(read_end, "rb") as pipe:
        return out.getvalue(), pipe.read().decode()


def _body(rank: int, size: int, base_dir: str) -> dict[str, Any]:
    import hora.torch as hvd
    from hora.torch import preflight

    said, handed = _init_handing_figures_over()
    out: dict[str, Any] = {"init_output": said, "handed": handed}
    healthy = preflight.run()
    out["healthy"], out["line"] = healthy.to_dict(), healthy.line()
    if rank == 0:
        preflight.save_baseline(healthy, base_dir)
    hvd.barrier()
    out["unjudged"] = _slowed(preflight, rank, 1, "copy")
    out["slow_copy"] = _slowed(preflight, rank, 1, "copy", baseline_dir=base_dir)
    out["slow_link"] = _slowed(preflight, rank, 2, "link", baseline_dir=base_dir)
    out["fail"] = _slowed(preflight, rank, 1, "copy", fail_below=0.5, baseline_dir=base_dir)
    hvd.shutdown()
    return out


@pytest.fixture(scope="module")
def results(run_world: Callable[..., list[Any]], tmp_path_factory: pytest.TempPathFactory
            ) -> list[dict[str, Any]]:
    base = tmp_path_factory.mktemp("baseline")
    BASE[:] = [base]
    return run_world(__file__, "_body", 3, args=(str(base),), timeout=180)


BASE: list[Path] = []


def test_init_hands_rank_0_s_figures_over_on_the_pipe_and_prints_nothing(
    results: list[Any],
) -> None:
    assert [r["init_output"] for r in results] == ["", "", ""]
    (doc,) = results[0]["handed"].splitlines()  # one JSON document, one line
    first = json.loads(doc)
    assert first["size"] == 3 and first["backend"] == "gloo"
    assert {p["path"] for p in first["paths"]} == {"gloo", "shm"}
    assert [r["handed"] for r in results[1:]] == ["", ""]  # rank 0 alone


def test_without_a_baseline_a_slow_rank_is_not_judged_against_the_others(
    results: list[Any],
) -> None:
    report = results[0]["unjudged"]
    assert report["findings"] == [] and report["baseline"] is False, report["findings"]
    assert results[0]["line"].endswith("; no baseline recorded: nothing judged")


def test_every_rank_gets_the_same_figures_per_rank_and_per_link(results: list[Any]) -> None:
    reports = [r["healthy"] for r in results]
    assert reports[0] == reports[1] == reports[2]
    gloo = next(p for p in reports[0]["paths"] if p["path"] == "gloo")
    assert gloo["sizes"] == [4096, 262144, 4 * 1024 * 1024]
    assert [r["rank"] for r in gloo["ranks"]] == [0, 1, 2]
    assert all(r["copy_gbps"] > 0 and r["latency_us"] > 0 for r in gloo["ranks"])
    assert [(k["a"], k["b"]) for k in gloo["links"]] == [(0, 1), (1, 2), (2, 0)]
    for alg, bus in zip(gloo["algbw_gbps"], gloo["busbw_gbps"], strict=True):
        assert bus == pytest.approx(alg * 2 * 2 / 3)  # nccl-tests: busbw = algbw * 2(n-1)/n
    assert results[0]["line"].startswith("preflight (3 ranks, ")
    assert "gloo 4 MiB busbw" in results[0]["line"] and "shm 4 MiB busbw" in results[0]["line"]


def test_baseline_is_recorded_per_node(results: list[Any]) -> None:
    files = list(BASE[0].glob("*.json"))
    assert len(files) == 1
    paths = json.loads(files[0].read_text())["paths"]
    assert set(paths) == {"gloo", "shm"} and paths["gloo"]["copy_gbps"] > 0


def test_a_slowed_rank_is_named_against_the_baseline(results: list[Any]) -> None:
    report = results[0]["slow_copy"]
    assert all(r["slow_copy"]["findings"] == report["findings"] for r in results)
    named = [f for f in report["findings"] if f["who"] == "rank 1"]
    assert named and {f["against"] for f in named} == {"baseline"}, report["findings"]
    gloo = next(p for p in report["paths"] if p["path"] == "gloo")
    waits = {r["rank"]: r["wait_s"] for r in gloo["ranks"]}
    assert waits[1] < waits[0] and waits[1] < waits[2]  # the others waited for rank 1


def test_a_rank_whose_links_are_slow_is_named_not_its_links(results: list[Any]) -> None:
    findings = results[0]["slow_link"]["findings"]
    gloo = [f for f in findings if f["path"] == "gloo"]
    assert any(f["who"] == "rank 2" and f["figure"] == "link_gbps" for f in gloo), findings
    assert not any(f["who"] in ("link 1<->2", "link 2<->0") for f in gloo), findings


def test_fail_below_raises_on_every_rank_naming_the_rank(results: list[Any]) -> None:
    for r in results:
        assert "error" in r["fail"], r["fail"]
        assert "rank 1" in r["fail"]["error"]
