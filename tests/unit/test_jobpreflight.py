"""The service's reading of a job's preflight figures (hora_service.jobs.preflight): what is kept.

Rank 0 hands the figures to its shim on a pipe and the shim keeps them as ``preflight.json``
in the run directory (tests/e2e/test_service_preflight.py runs that whole path); here the
file is written by hand.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from hora_service.jobs.preflight import FILE_MAX, PreflightBook, parse

GOOD = {
    "size": 2, "backend": "gloo", "seconds": 0.3,
    "paths": [{"path": "gloo", "sizes": [4096], "busbw_gbps": [1.5], "algbw_gbps": [1.5],
               "latency_us": 80.0,
               "ranks": [{"rank": 0, "host": "h", "latency_us": 80, "copy_gbps": 5,
                          "busbw_gbps": 1.5, "coll_s": 0.1, "wait_s": 0.0}],
               "links": [{"a": 0, "b": 1, "latency_us": 40, "gbps": 2.0}]}],
    "findings": [{"kind": "rank", "who": "rank 1", "path": "gloo", "text": "rank 1 (slow)"}],
}


def _doc(data: dict) -> bytes:
    return json.dumps(data).encode()


def test_a_valid_document_is_taken_and_its_line_says_what_is_slow() -> None:
    figures = parse(_doc(GOOD))
    assert figures is not None and figures.size == 2
    assert figures.line() == (
        "preflight (2 ranks, 0.30s): gloo busbw 1.50 GB/s, 80 us; SLOW: rank 1 (slow)"
    )


def test_without_findings_the_line_says_whether_a_baseline_judged_them() -> None:
    quiet = GOOD | {"findings": []}
    assert parse(_doc(quiet)).line().endswith("; no baseline recorded: nothing judged")
    judged = parse(_doc(quiet | {"baseline": True}))
    assert judged.line().endswith("; no rank or link far below its baseline")


def test_bad_fields_and_bad_documents_are_refused() -> None:
    bad_path = GOOD | {"paths": [GOOD["paths"][0] | {"path": "../x"}]}
    assert parse(_doc(bad_path)) is None
    assert parse(_doc(GOOD | {"size": -1})) is None
    assert parse(_doc(GOOD).replace(b"0.3", b"1e999")) is None  # not finite
    assert parse(b"HORA_PREFLIGHT " + _doc(GOOD)) is None  # the old log line is no document
    assert parse(b"{not json") is None
    assert parse(b"") is None
    assert parse(_doc(GOOD) + b" " * FILE_MAX) is None  # past the bound


def test_the_book_keeps_an_attempt_s_figures_and_the_node_s_bandwidth(tmp_path: Path) -> None:
    file = tmp_path / "preflight.json"
    file.write_bytes(_doc(GOOD))
    book = PreflightBook()
    assert book.note(1, 1, tmp_path / "missing.json") is None
    figures = book.note(1, 1, file)
    assert figures is not None
    file.write_bytes(b"")  # kept once read
    assert book.note(1, 1, file) is not None
    assert book.by_node() == {}  # the gauge: only where the service placed the job
    book.measured(figures, frozenset({"elsewhere"}))
    assert book.by_node() == {}  # a host the job names that the service did not place it on
    book.measured(figures, frozenset({"h"}))
    assert book.by_node() == {"h": {"gloo": 1.5}}


def test_the_monitor_is_told_of_each_new_report_once_and_a_failure_names_the_rank(
    tmp_path: Path,
) -> None:
    file = tmp_path / "preflight.json"
    book = PreflightBook()
    assert book.poll(1, 1, file, now=10.0) is None  # not there yet
    file.write_bytes(_doc(GOOD | {"failed": "preflight: x"}))
    assert book.poll(1, 1, file, now=10.5) is None  # not looked at again within POLL_S
    found = book.poll(1, 1, file, now=10.5, force=True)
    assert found is not None and found.event() == found.line()
    assert found.line().endswith("SLOW: rank 1 (slow); FAILED: threshold crossed")
    assert book.poll(1, 1, file, now=99.0, force=True) is None  # told once
    assert book.known(1, 1) == found
    assert found.explain("rank 0 exited with code 1") == "preflight: x; rank 0 exited with code 1"
    assert found.explain("preflight: x; rank 0 exited") == "preflight: x; rank 0 exited"


def test_a_world_that_measures_again_is_told_again(tmp_path: Path) -> None:
    # an elastic job's world re-forms and rank 0 hands over a new report: a new event
    file = tmp_path / "preflight.json"
    file.write_bytes(_doc(GOOD))
    book = PreflightBook()
    assert book.poll(3, 1, file, now=0.0) is not None
    file.write_bytes(_doc(GOOD | {"size": 3, "findings": []}))
    os.utime(file, ns=(1, 1))  # a new stamp even on a coarse clock
    again = book.poll(3, 1, file, now=5.0)
    assert again is not None and again.size == 3
    assert book.known(3, 1) == again


def test_a_link_or_a_fifo_in_place_of_the_file_is_not_read(tmp_path: Path) -> None:
    secret = tmp_path / "secret.json"
    secret.write_bytes(_doc(GOOD))
    run = tmp_path / "run"
    run.mkdir(mode=0o750)
    (run / "preflight.json").symlink_to(secret)
    assert PreflightBook().poll(4, 1, run / "preflight.json", now=0.0) is None
    (run / "preflight.json").unlink()
    os.mkfifo(run / "preflight.json")  # would block a plain open(); read_chunk refuses it
    assert PreflightBook().note(4, 1, run / "preflight.json") is None
