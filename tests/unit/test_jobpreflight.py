"""The service's reading of a job's preflight line (hora_service.jobpreflight): what is kept."""

from __future__ import annotations

import json

from hora_service.jobpreflight import PreflightBook, parse

GOOD = {
    "size": 2, "backend": "gloo", "seconds": 0.3,
    "paths": [{"path": "gloo", "sizes": [4096], "busbw_gbps": [1.5], "algbw_gbps": [1.5],
               "latency_us": 80.0,
               "ranks": [{"rank": 0, "host": "h", "latency_us": 80, "copy_gbps": 5,
                          "busbw_gbps": 1.5, "coll_s": 0.1, "wait_s": 0.0}],
               "links": [{"a": 0, "b": 1, "latency_us": 40, "gbps": 2.0}]}],
    "findings": [{"kind": "rank", "who": "rank 1", "path": "gloo", "text": "rank 1 (slow)"}],
}


def _log(*lines: str) -> bytes:
    return "".join(f"{x}\n" for x in lines).encode()


def test_the_first_valid_line_at_a_line_start_is_taken() -> None:
    data = _log(
        "hello",
        "say HORA_PREFLIGHT " + json.dumps(GOOD | {"size": 7}),  # not at a line start
        "HORA_PREFLIGHT {not json",
        "HORA_PREFLIGHT " + json.dumps(GOOD | {"seconds": float("inf")}).replace(
            "Infinity", "1e999"),  # not finite
        "HORA_PREFLIGHT " + json.dumps(GOOD),
    )
    figures = parse(data)
    assert figures is not None and figures.size == 2
    assert figures.line() == (
        "preflight (2 ranks, 0.30s): gloo busbw 1.50 GB/s, 80 us; SLOW: rank 1 (slow)"
    )


def test_bad_fields_and_unfinished_lines_are_refused() -> None:
    bad_path = GOOD | {"paths": [GOOD["paths"][0] | {"path": "../x"}]}
    assert parse(_log("HORA_PREFLIGHT " + json.dumps(bad_path))) is None
    assert parse(_log("HORA_PREFLIGHT " + json.dumps(GOOD | {"size": -1}))) is None
    assert parse(("HORA_PREFLIGHT " + json.dumps(GOOD)).encode()) is None  # no newline yet
    assert parse(b"") is None


def test_the_book_keeps_an_attempt_s_figures_and_the_node_s_bandwidth(tmp_path) -> None:
    log = tmp_path / "rank0.log"
    log.write_bytes(_log("HORA_PREFLIGHT " + json.dumps(GOOD)))
    book = PreflightBook()
    assert book.note(1, 1, tmp_path / "missing.log") is None
    assert book.note(1, 1, log) is not None
    log.write_bytes(b"")  # kept once read
    assert book.note(1, 1, log) is not None
    assert book.by_node() == {"h": {"gloo": 1.5}}


def test_the_monitor_is_told_of_the_figures_once_and_a_failure_names_the_rank(tmp_path) -> None:
    log = tmp_path / "rank0.log"
    log.write_bytes(b"starting\n")
    book = PreflightBook()
    assert book.poll(1, 1, log, now=10.0) is None  # read: not there yet
    log.write_bytes(_log("HORA_PREFLIGHT " + json.dumps(GOOD | {"failed": "preflight: x"})))
    assert book.poll(1, 1, log, now=10.5) is None  # not looked at again within POLL_S
    found = book.poll(1, 1, log, now=10.5, force=True)
    assert found is not None and found.event() == found.line()
    assert found.line().endswith("SLOW: rank 1 (slow); FAILED: threshold crossed")
    assert book.poll(1, 1, log, now=99.0, force=True) is None  # told once
    assert book.known(1, 1) == found
    assert found.explain("rank 0 exited with code 1") == "preflight: x; rank 0 exited with code 1"
    assert found.explain("preflight: x; rank 0 exited") == "preflight: x; rank 0 exited"


def test_a_log_past_the_scanned_bytes_without_figures_is_not_read_again(tmp_path) -> None:
    from hora_service import jobpreflight

    log = tmp_path / "rank0.log"
    log.write_bytes(b"x" * jobpreflight.SCAN_BYTES + b"\n")
    book = PreflightBook()
    assert book.poll(2, 1, log, now=0.0) is None
    log.write_bytes(_log("HORA_PREFLIGHT " + json.dumps(GOOD)))  # too late: not looked at
    assert book.poll(2, 1, log, now=99.0, force=True) is None
