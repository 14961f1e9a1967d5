"""An engine's part of a parked session, written and restored in this process (issue 28).

:mod:`hora.engines.park` runs inside each engine; here its namespace is a plain dict (the
engine's user namespace stands in) and the rank is 0, so the save, the checks and the
restore run in milliseconds: what is saved, shared and re-imported, what cannot be saved,
the random generators, and a damaged or missing part refused.
"""

from __future__ import annotations

import io
import os
import random
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hora.engines import park


@pytest.fixture
def ns(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Any]]:
    """The engine's namespace, as a plain dict, with rank 0."""
    space: dict[str, Any] = {"__name__": "__main__", "__builtins__": __builtins__}
    monkeypatch.setattr(park, "_user_ns", lambda: space)
    monkeypatch.setattr(park, "_rank", lambda: 0)
    yield space
    park.restore_discard()


def fresh(ns: dict[str, Any]) -> None:
    """What a new engine's namespace holds before the restore."""
    ns.clear()
    ns.update({"__name__": "__main__", "__builtins__": __builtins__})


def roundtrip(ns: dict[str, Any], where: Path, drop: list[str] | None = None) -> dict[str, Any]:
    written = park.write(str(where), drop or [])
    fresh(ns)
    park.restore_prepare(str(where), 0, written["bytes"], written["crc32"])
    park.restore_install()
    return written


def test_a_model_and_its_optimizer_come_back_sharing_their_parameters(
    ns: dict[str, Any], tmp_path: Path
) -> None:
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.ones(3)).sum().backward()
    opt.step()
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1)
    ns.update(model=model, opt=opt, sched=sched, tied=model.weight, np=np, arr=np.arange(4))
    written = roundtrip(ns, tmp_path)
    assert written["names"] == ["arr", "model", "opt", "sched", "tied"]
    assert ns["opt"].param_groups[0]["params"][0] is ns["model"].weight is ns["tied"]
    assert ns["sched"].optimizer is ns["opt"]
    assert torch.equal(ns["model"].weight, model.weight)
    moments = ns["opt"].state[ns["model"].weight]["exp_avg"]
    assert torch.equal(moments, opt.state[model.weight]["exp_avg"])
    assert ns["np"] is np and ns["arr"].tolist() == [0, 1, 2, 3]  # a module, imported again


def test_functions_and_classes_of_cells_see_the_namespace_after_the_restore(
    ns: dict[str, Any], tmp_path: Path
) -> None:
    cell = "k = 3\ndef f():\n    return k + 1\nclass C:\n    def g(self):\n        return k * 2\n"
    exec(cell + "c = C()", ns)
    roundtrip(ns, tmp_path)
    assert ns["f"]() == 4 and ns["c"].g() == 6 and isinstance(ns["c"], ns["C"])
    ns["k"] = 10  # a later cell rebinds a global: the restored functions see it
    assert ns["f"]() == 11 and ns["c"].g() == 20
    assert ns["f"].__globals__ is ns


def test_the_random_generators_continue_where_they_were(ns: dict[str, Any], tmp_path: Path) -> None:
    ns["np"] = np  # numpy's generator is saved when numpy is there
    for seed in (random.seed, np.random.seed, torch.manual_seed):
        seed(7)
    park.write(str(tmp_path), [])
    expected = (random.random(), float(np.random.rand()), torch.rand(2).tolist())
    for seed in (random.seed, np.random.seed, torch.manual_seed):
        seed(99)  # a new engine's generators are elsewhere
    parts = park.checksum(tmp_path / "rank0.pt")
    fresh(ns)
    park.restore_prepare(str(tmp_path), 0, *parts)
    park.restore_install()
    assert (random.random(), float(np.random.rand()), torch.rand(2).tolist()) == expected


def test_what_cannot_be_saved_is_named_with_its_type(ns: dict[str, Any], tmp_path: Path) -> None:
    f = open(tmp_path / "log.txt", "w")  # noqa: SIM115 - what a user leaves open
    sock = socket.socket()
    model = torch.nn.Linear(2, 2)
    model.log = f  # type: ignore[assignment]
    ns.update(
        f=f, sock=sock, gen=(i for i in range(3)), th=threading.Thread(target=print),
        model=model, ok=torch.ones(4), buf=io.BytesIO(b"kept"),
    )  # fmt: skip
    try:
        found = park.scan([])
        bad = {name: (kind, why) for name, kind, why in found["unsaveable"]}
        assert bad == {
            "f": ("_io.TextIOWrapper", "an open file"),
            "sock": ("socket.socket", "a socket"),
            "gen": ("generator", "a generator"),
            "th": ("threading.Thread", "a thread"),
            "model": ("torch.nn.modules.linear.Linear", "holds an open file"),
        }
        assert found["names"] == ["buf", "ok"] and found["bytes"] >= 16
        assert set(park.scan(["f", "model"])["names"]) == {"buf", "ok"}
        written = park.write(str(tmp_path), sorted(bad))
        assert written["names"] == ["buf", "ok"]
        assert "f (_io.TextIOWrapper)" in written["dropped"]
    finally:
        f.close()
        sock.close()


def test_shared_storage_is_counted_once_and_no_data_is_copied_to_scan(
    ns: dict[str, Any]
) -> None:
    big = torch.zeros(1 << 20)  # 4 MiB
    ns.update(a=big, b=big[10:], c=[big])
    assert (4 << 20) <= park.scan([])["bytes"] < (4 << 20) + 4096


def test_a_part_that_differs_from_what_was_written_is_never_restored(
    ns: dict[str, Any], tmp_path: Path
) -> None:
    ns["x"] = torch.arange(1000.0)
    written = park.write(str(tmp_path), [])
    part = tmp_path / "rank0.pt"
    data = bytearray(part.read_bytes())
    data[len(data) // 2] ^= 0xFF
    part.write_bytes(bytes(data))
    fresh(ns)
    with pytest.raises(OSError, match="does not match what was written"):
        park.restore_prepare(str(tmp_path), 0, written["bytes"], written["crc32"])
    part.write_bytes(bytes(data[:100]))  # torn
    with pytest.raises(OSError, match="100 bytes"):
        park.restore_prepare(str(tmp_path), 0, written["bytes"], written["crc32"])
    part.unlink()
    with pytest.raises(OSError, match="cannot read"):
        park.restore_prepare(str(tmp_path), 0, written["bytes"], written["crc32"])
    assert "x" not in ns


def test_a_part_is_written_whole_or_not_at_all(ns: dict[str, Any], tmp_path: Path) -> None:
    ns["gen"] = (i for i in range(3))
    with pytest.raises(TypeError):
        park.write(str(tmp_path), [])
    assert os.listdir(tmp_path) == []  # no temporary file, no part


def test_the_checksum_written_is_the_files(tmp_path: Path) -> None:
    fd = os.open(tmp_path / "f", os.O_WRONLY | os.O_CREAT, 0o600)
    out = park.ChecksumFile(fd)
    for chunk in (b"a" * 10, os.urandom(3 << 20), b"z"):
        out.write(chunk)
    os.close(fd)
    assert park.checksum(tmp_path / "f") == (out.size, out.crc)


def test_a_resumed_engine_reads_its_part_while_it_starts(
    ns: dict[str, Any], tmp_path: Path
) -> None:
    ns["x"] = torch.ones(3)
    written = park.write(str(tmp_path), [])
    env = {"HORA_RESTORE_DIR": str(tmp_path), "HORA_RESTORE_SIZE": "1", "RANK": "0",
           "WORLD_SIZE": "1"}  # fmt: skip
    park.start_prefetch(env)
    fresh(ns)
    got = park.restore_prepare(str(tmp_path), 0, written["bytes"], written["crc32"])
    assert got["names"] == ["x"] and got["read_s"] >= 0
    assert park.restore_install()["names"] == ["x"] and torch.equal(ns["x"], torch.ones(3))


def test_at_another_size_every_rank_restores_rank_0s_part() -> None:
    assert [park.part_of(r, 3, 2) for r in range(3)] == [0, 0, 0]
    assert [park.part_of(r, 2, 2) for r in range(2)] == [0, 1]


def test_storages_written_on_a_gpu_are_moved_to_the_ranks_device(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A snapshot of CUDA tensors records each storage's location as "cuda:N"; the restore moves
    # such storages to the rank's device (bench/gpu/park_cuda.py found the call refused on an
    # H200). No GPU here: the location is written as "cuda:0" and the rank's device is the CPU.
    tensors = {"w": torch.arange(6.0).reshape(2, 3)}
    buf = io.BytesIO()
    with monkeypatch.context() as m:
        m.setattr(torch.serialization, "location_tag", lambda storage: "cuda:0")
        torch.save(tensors, buf)
    buf.seek(0)
    seen: list[str] = []
    place = park._to_device(torch.device("cpu"))

    def spy(storage: Any, location: str) -> Any:
        seen.append(location)
        return place(storage, location)

    back = torch.load(buf, map_location=spy, weights_only=False)
    assert seen == ["cuda:0"]
    assert back["w"].device == torch.device("cpu") and torch.equal(back["w"], tensors["w"])
