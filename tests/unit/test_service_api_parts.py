"""Pure parts of the job API: log chunking, SSE encoding, metrics text, size limit, safety."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
from hora.errors import SpecError
from hora_service.api.body_limit import BodySizeLimit
from hora_service.api.errors import spec_error_detail
from hora_service.api.logstream import complete_prefix, read_chunk, sse_event
from hora_service.api.prometheus import render_metrics
from hora_service.api.safety import UnsafeConfigError, check_safe, is_loopback
from prometheus_client.parser import text_string_to_metric_families
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import Route


@pytest.mark.parametrize("text", ["plain ascii", "né", "a€b", "x😀y", "\r50%\r100%\n"])
def test_chunks_never_split_a_character(text: str) -> None:
    data = text.encode()
    for cut in range(len(data) + 1):
        head, used = complete_prefix(data[:cut])
        tail, rest = complete_prefix(data[used:], final=True)
        assert head + tail == text and used + rest == len(data)
        assert data[:used].decode() == head


def test_final_chunk_replaces_bad_bytes() -> None:
    assert complete_prefix(b"ok\xff", final=True) == ("ok\ufffd", 3)
    assert complete_prefix(b"\xc3")[1] == 0  # an incomplete tail waits for more bytes


def test_read_chunk_offsets(tmp_path: Path) -> None:
    log = tmp_path / "rank-0.log"
    log.write_bytes(b"0123456789")
    assert read_chunk(log, 3, 4) == b"3456"
    assert read_chunk(log, 20, 4) == b""
    assert read_chunk(tmp_path / "missing.log", 0, 4) == b""


def test_sse_event_is_one_json_data_line() -> None:
    raw = sse_event("a\nb\r", event_id=12).decode()
    assert raw == 'id: 12\ndata: "a\\nb\\r"\n\n'
    assert sse_event({"state": "succeeded"}, event="end").decode().startswith("event: end\n")


def samples(text: str) -> dict[str, float]:
    """``name{labels}`` -> value, read back with prometheus_client's own parser."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def test_render_metrics() -> None:
    snap = SimpleNamespace(
        jobs_by_state={"queued": 3, "running": 1},
        queue_length=3,
        slots_total=4,
        slots_allocated=2,
        schedule_latency_p50_s=0.05,
        schedule_latency_p99_s=0.2,
        schedule_latency_sum_s=1.5,
        schedule_latency_count=10,
    )
    text = render_metrics(snap)
    got = samples(text)
    assert got['hora_jobs{state="queued"}'] == 3
    assert got['hora_jobs{state="failed"}'] == 0  # every state is always present
    assert got["hora_slots_allocated"] == 2 and got["hora_queue_length"] == 3
    assert got['hora_schedule_latency_seconds{quantile="0.99"}'] == 0.2
    assert got["hora_schedule_latency_seconds_count"] == 10
    assert "# TYPE hora_schedule_latency_seconds summary" in text and text.endswith("\n")


def test_render_metrics_exports_extra_fields() -> None:
    snap = SimpleNamespace(
        jobs_by_state={}, queue_length=0, slots_total=2, slots_allocated=0,
        scheduler_pass_ms=1.5, retries_by_user={"ann": 2}, label="x", flag=True,
    )  # fmt: skip
    got = samples(render_metrics(snap))
    assert got["hora_scheduler_pass_ms"] == 1.5
    assert got['hora_retries_by_user{key="ann"}'] == 2
    assert not [k for k in got if "label" in k or "flag" in k]


def test_label_values_are_escaped() -> None:
    from hora_service.models import MetricsSnapshot

    odd = 'a"b\\c\nd'
    snap = MetricsSnapshot(jobs_by_state={}, queue_length=0, slots_total=1, slots_allocated=0,
                           slot_hours={odd: 1.0})  # fmt: skip
    got = samples(render_metrics(snap))
    assert got[f'hora_slot_hours_total{{slot_kind="gpu",user="{odd}"}}'] == 1.0


def test_spec_error_detail_names_field() -> None:
    detail = spec_error_detail(SpecError("rank", "no rank 5"), "query")
    assert detail == [{"loc": ["query", "rank"], "msg": "no rank 5", "type": "spec_error"}]


async def _echo(request: Request) -> PlainTextResponse:
    return PlainTextResponse(str(len(await request.body())))


async def _limit_case(size: int, status: int, chunked: bool) -> None:
    app = BodySizeLimit(Starlette(routes=[Route("/", _echo, methods=["POST"])]), max_bytes=1000)

    async def body():  # type: ignore[no-untyped-def]  # no Content-Length: the middleware must count
        for i in range(0, size, 100):
            yield b"x" * min(100, size - i)

    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
        r = await c.post("/", content=body() if chunked else b"x" * size)
    assert r.status_code == status
    if status == 200:
        assert r.text == str(size)


@pytest.mark.parametrize(("size", "status"), [(100, 200), (1000, 200), (1001, 413)])
@pytest.mark.parametrize("chunked", [False, True])
def test_body_size_limit(size: int, status: int, chunked: bool) -> None:
    import asyncio

    asyncio.run(_limit_case(size, status, chunked))


@pytest.mark.parametrize(
    ("host", "loop"),
    [
        ("127.0.0.1", True),
        ("localhost", True),
        ("::1", True),
        ("0.0.0.0", False),
        ("10.0.0.1", False),
    ],
)
def test_is_loopback(host: str, loop: bool) -> None:
    assert is_loopback(host) is loop


@pytest.mark.parametrize(
    ("host", "users", "dev", "hub", "ok"),
    [
        ("127.0.0.1", 0, False, False, True),
        ("0.0.0.0", 1, False, False, True),
        ("0.0.0.0", 0, False, False, False),
        ("0.0.0.0", 0, True, False, True),
        ("10.0.0.1", 0, False, True, True),  # behind a hub: its users come on first contact
    ],
)
def test_check_safe(host: str, users: int, dev: bool, hub: bool, ok: bool) -> None:
    settings = SimpleNamespace(host=host, dev_mode=dev, max_request_bytes=1 << 20, hub=hub)
    if ok:
        check_safe(settings, users)
    else:
        with pytest.raises(UnsafeConfigError, match="no users"):
            check_safe(settings, users)
