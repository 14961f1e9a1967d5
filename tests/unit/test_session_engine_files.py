"""A service session's engine keeps the controller's key on disk only until it has read it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hora.engines._child import _forget_after_load
from ipyparallel.engine.app import IPEngine

CONN = {
    "interface": "tcp://127.0.0.1", "registration": 1, "control": 2, "mux": 3, "task": 4,
    "iopub": 5, "hb_ping": 6, "hb_pong": 7, "key": "the-controllers-key", "location": "here",
    "pack": "json", "unpack": "json", "signature_scheme": "hmac-sha256", "ssh": "",
}  # fmt: skip


def _engine_class() -> type[IPEngine]:
    class Engine(IPEngine):  # a subclass: the patch stays out of ipyparallel's own class
        pass

    return Engine


def test_the_connection_file_is_gone_once_ipyparallel_read_it(tmp_path: Path) -> None:
    url = tmp_path / "engine.json"
    url.write_text(json.dumps(CONN))
    engine_cls = _engine_class()
    _forget_after_load(engine_cls, str(url))
    engine = engine_cls(url_file=str(url))
    engine.load_connection_file()
    assert not url.exists()
    assert engine.config.Session.key == b"the-controllers-key"  # read before it went


def test_the_connection_file_is_gone_even_when_reading_it_fails(tmp_path: Path) -> None:
    url = tmp_path / "engine.json"
    url.write_text("{not json")
    engine_cls = _engine_class()
    _forget_after_load(engine_cls, str(url))
    with pytest.raises(json.JSONDecodeError):
        engine_cls(url_file=str(url)).load_connection_file()
    assert not url.exists()
