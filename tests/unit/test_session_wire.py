"""One typed wire for notebook sessions: the kernel sends the models the service validates.

The bodies of ``/v1/sessions`` live in the data plane (:mod:`hora.session_wire`); the kernel
builds and sends them, the service's routes take the very same classes, so a bad field is
named in the kernel before the request leaves, as the service's 422 would name it.
"""

from __future__ import annotations

import ast
import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Any

import hora
import pytest
from hora import session_wire as sw
from hora.errors import SpecError
from hora_service.api import parking as parking_api
from hora_service.api import sessions as sessions_api
from test_sessions import CONN


@pytest.mark.parametrize(
    ("route", "param", "model"),
    [
        (sessions_api.create_session, "req", sw.SessionRequest),
        (sessions_api.heartbeat, "beat", sw.Heartbeat),
        (sessions_api.replace_engine, "body", sw.EngineReplacement),
        (parking_api.park_begin, "body", sw.ParkBegin),
        (parking_api.park_abort, "body", sw.ParkAbort),
        (parking_api.resume, "req", sw.ResumeRequest),
    ],
)
def test_the_service_routes_take_the_kernels_bodies(
    route: Callable[..., Any], param: str, model: type
) -> None:
    assert inspect.signature(route, eval_str=True).parameters[param].annotation is model


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"workers": 0}, "workers"),
        ({"threads": 1000}, "threads"),
        ({"connection": {**CONN, "interface": "tcp://10.0.0.1:9"}}, "connection.interface"),
        ({"connection": {**CONN, "extra": 1}}, "connection.extra"),
        ({"runtime": "nowhere"}, "runtime"),
    ],
)
def test_a_bad_field_is_named_before_the_request_leaves_the_kernel(
    fields: dict[str, Any], field: str
) -> None:
    with pytest.raises(SpecError) as e:
        sw.body(sw.SessionRequest, **{"connection": CONN, **fields})
    assert e.value.field == field


def test_a_rule_across_fields_is_named_in_the_message() -> None:
    with pytest.raises(SpecError) as e:
        sw.body(sw.SessionRequest, connection=CONN, runtime="slurm")
    assert e.value.field == "request"
    assert "connection.interface: engines on Slurm nodes cannot reach" in str(e.value)


def test_the_kernel_sends_only_the_fields_it_gives_and_the_service_reads_them_back() -> None:
    req = sw.body(sw.SessionRequest, connection=CONN, workers=3, backend=None, runtime="local")
    sent = sw.wire(req)
    assert sent == {"connection": CONN, "workers": 3, "backend": None, "runtime": "local"}
    assert sw.SessionRequest.model_validate(sent) == req
    assert sw.wire(sw.body(sw.EngineReplacement, rank=1, master_port=29500)) == {
        "rank": 1,
        "master_port": 29500,
    }


def test_a_parks_reason_is_cut_to_what_the_service_keeps() -> None:
    with pytest.raises(SpecError) as e:
        sw.body(sw.ParkAbort, why="x" * (sw.ABORT_WHY_MAX + 1))
    assert e.value.field == "why"
    kept = sw.body(sw.ParkAbort, why=("x" * 5000)[: sw.ABORT_WHY_MAX])
    assert len(kept.why) == sw.ABORT_WHY_MAX


def _dict_bodies(path: Path) -> list[str]:
    """The ``json=`` arguments of ``path`` written as a dict literal or ``dict(...)``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call):
            for kw in node.keywords:
                literal = isinstance(kw.value, ast.Dict)
                call = isinstance(kw.value, ast.Call) and getattr(kw.value.func, "id", "") == "dict"
                if kw.arg == "json" and (literal or call):
                    found.append(f"{path.name}:{node.lineno}")
    return found


def test_the_kernel_sends_no_session_body_as_a_hand_made_dict() -> None:
    root = Path(hora.__file__).parent
    files = [
        root / "engines" / n
        for n in ("session.py", "session_launcher.py", "heartbeat.py", "parking.py")
    ]
    files += [root / "magics_park.py", root / "client.py"]
    assert [f for p in files for f in _dict_bodies(p)] == []


def test_the_kernel_reads_the_session_list_and_address_with_the_services_models() -> None:
    answers = {
        (r.path, m): r.response_model
        for r in [*sessions_api.router.routes, *sessions_api.address_router.routes]
        for m in getattr(r, "methods", ())
    }
    assert answers[("/v1/sessions", "GET")] is sw.SessionList
    assert answers[("/v1/session-address", "GET")] is sw.SessionAddress
