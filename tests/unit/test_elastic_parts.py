"""The pure parts of elastic training: flags, discovery output, blacklist, generations, sampler.

The processes, kills and re-formed worlds are in tests/dist/test_elastic.py; here, what can be
checked without them, in milliseconds.
"""

from __future__ import annotations

import os
import time
import types
from pathlib import Path

import pytest
from hora.errors import SpecError
from hora.launch import elastic_rdzv as rdzv
from hora.launch.config import parse_args
from hora.launch.hosts import Blacklist, parse_hosts_output
from hora.torch import _state
from hora.torch.elastic import ElasticSampler


def test_elastic_flags_parse_into_a_typed_config(tmp_path: Path) -> None:
    script = tmp_path / "discover.sh"
    script.write_text("#!/bin/sh\necho localhost:2\n")
    script.chmod(0o755)
    cfg = parse_args(["-np", "2", "--min-np", "1", "--max-np", "4", "--host-discovery-script",
                      str(script), "--reset-limit", "3", "--blacklist-cooldown-range", "1", "5",
                      "--", "true"])  # fmt: skip
    assert cfg.elastic is not None
    assert (cfg.elastic.min_np, cfg.elastic.max_np, cfg.elastic.reset_limit) == (1, 4, 3)
    assert cfg.elastic.discovery == (str(script),) and cfg.elastic.cooldown == (1.0, 5.0)
    assert parse_args(["-np", "2", "--", "true"]).elastic is None


@pytest.mark.parametrize(("argv", "field"), [
    (["-np", "1", "--min-np", "2"], "-np"),
    (["-np", "5", "--max-np", "4"], "-np"),
    (["-np", "2", "--min-np", "x"], "--min-np"),
    (["-np", "2", "--host-discovery-script", "/nonexistent/discover"], "--host-discovery-script"),
    (["-np", "2", "--min-np", "1", "--blacklist-cooldown-range", "9", "1"],
     "--blacklist-cooldown-range"),
    (["-np", "2", "--min-np", "1", "--reset-limit", "-1"], "--reset-limit"),
])  # fmt: skip
def test_bad_elastic_flags_name_the_flag(argv: list[str], field: str) -> None:
    with pytest.raises(SpecError) as e:
        parse_args([*argv, "--", "true"])
    assert e.value.field == field


def test_discovery_output_is_hosts_and_slots() -> None:
    assert parse_hosts_output("localhost:2\n\n# a comment\nnode1\nlocalhost:1\n") == {
        "localhost": 3, "node1": 1}
    for bad in ("localhost:x", ":2", "host:-1"):
        with pytest.raises(SpecError, match="--host-discovery-script"):
            parse_hosts_output(bad)


def test_blacklist_cools_down_longer_each_time() -> None:
    b = Blacklist(threshold=2, window_s=60, low=10, high=25)
    assert not b.failed("h", 0) and b.failed("h", 1)
    assert b.blocked("h", 10.9) and not b.blocked("h", 11.1) and not b.blocked("other", 5)
    assert not b.failed("h", 100) and b.failed("h", 101)  # second time: 20 s
    assert b.blocked("h", 120.9) and not b.blocked("h", 121.1)
    assert not b.failed("h", 200) and b.failed("h", 201)  # third: 40 s, capped at 25
    assert b.blocked("h", 225.9) and not b.blocked("h", 226.1)
    assert not b.failed("g", 0) and not b.failed("g", 61)  # failures a minute apart


def test_generations_round_trip_and_number_hosts(tmp_path: Path) -> None:
    members = rdzv.members_for([("w0", "a"), ("w3", "b"), ("w1", "a")])
    assert [(m.wid, m.local_rank, m.local_size, m.cross_rank, m.cross_size) for m in members] == [
        ("w0", 0, 2, 0, 2), ("w3", 0, 1, 1, 2), ("w1", 1, 2, 0, 2)]
    gen = rdzv.Generation(4, members, "127.0.0.1", 1234, note="w2 exited")
    assert rdzv.read_generation(tmp_path) is None
    rdzv.write_generation(tmp_path, gen)
    assert rdzv.read_generation(tmp_path) == gen and gen.rank_of("w1") == 2
    rdzv.mark(tmp_path, "arrived.4.w0")
    assert rdzv.missing_arrivals(tmp_path, gen) == [1, 2]
    rdzv.mark(tmp_path, "reset.w3", "4")
    assert rdzv.reset_requests(tmp_path) == {"w3": 4}


def _deal(sampler: ElasticSampler, size: int, batches: int, batch: int,
          monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """What ``size`` ranks in lock step take in ``batches`` batches; records them."""
    taken = []
    for rank in range(size):
        monkeypatch.setattr(_state, "_STATE", types.SimpleNamespace(size=size, rank=rank))
        sampler.reset()
        taken += list(sampler)[: batches * batch]
    for _ in range(batches):
        sampler.record_batch(0, batch)
    return taken


def test_elastic_sampler_resumes_mid_epoch_at_another_size(monkeypatch: pytest.MonkeyPatch) -> None:
    """3 ranks take 2 batches of 4, a commit; 2 ranks take the rest: every sample once."""
    sampler = ElasticSampler(list(range(48)), shuffle=True, seed=7)
    first = _deal(sampler, 3, 2, 4, monkeypatch)
    committed = sampler.state_dict()
    assert committed == {"epoch": 0, "processed_num": 24}
    _deal(sampler, 3, 1, 4, monkeypatch)  # uncommitted work, lost with its ranks
    sampler.load_state_dict(committed)
    rest = _deal(sampler, 2, 6, 2, monkeypatch)
    assert sorted(first + rest) == list(range(48))
    assert len(sampler) == 12 and sampler.processed_num == 48  # each of 2 took 12 of the 24 left


def test_a_commit_copies_into_the_last_one_and_a_restore_never_aliases_it() -> None:
    """The optimizer's state after a restore is not the saved copy: training after it
    (in-place momentum updates) leaves the commit as it was, and a later commit reuses the
    saved tensors instead of allocating new ones."""
    import torch
    from hora.torch.elastic.state import OptimizerStateHandler, snapshot

    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    def step() -> None:
        opt.zero_grad()
        model(torch.ones(4, 3)).sum().backward()
        opt.step()

    step()
    handler = OptimizerStateHandler(opt)
    saved = handler.saved["state"][0]["momentum_buffer"]
    kept = saved.clone()
    handler.restore()
    assert opt.state_dict()["state"][0]["momentum_buffer"] is not saved
    step()  # mutates the live momentum buffer in place
    assert torch.equal(handler.saved["state"][0]["momentum_buffer"], kept)
    handler.save()
    assert handler.saved["state"][0]["momentum_buffer"] is saved  # copied into, not new
    assert not torch.equal(saved, kept)
    nested = {"a": [1, (torch.zeros(2), "x")], "b": None}
    copy = snapshot(nested)
    nested["a"][1][0].add_(1)
    assert copy["a"][1][0].tolist() == [0.0, 0.0] and copy["a"][1][1] == "x"


def test_a_commit_parses_the_generation_file_again_only_when_it_may_have_changed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Parsed again when replaced, or while it is younger than a second (a replacement within
    one tick of the kernel's clock can keep the inode, the size and the time); else one stat."""
    from hora.torch.elastic import _world

    monkeypatch.setattr(_world._Seen, "key", None)
    reads: list[int] = []
    real = rdzv.read_generation

    def counted(root: Path) -> rdzv.Generation | None:
        reads.append(1)
        return real(root)

    def aged(seconds: float) -> None:  # the file's time, as if written that long ago
        then = time.time_ns() - int(seconds * 1e9)
        os.utime(tmp_path / rdzv.WORLD_FILE, ns=(then, then))

    monkeypatch.setattr(rdzv, "read_generation", counted)
    member = rdzv.Member("w0", "localhost", 0, 1, 0, 1)
    assert _world._generation(tmp_path) is None and reads == []  # nothing published yet
    rdzv.write_generation(tmp_path, rdzv.Generation(1, (member,), "127.0.0.1", 1))
    aged(5)
    got = [_world._generation(tmp_path) for _ in range(3)]
    assert [g.number for g in got if g] == [1, 1, 1] and len(reads) == 1
    rdzv.write_generation(tmp_path, rdzv.Generation(2, (member,), "127.0.0.1", 1, note="grow"))
    got2 = _world._generation(tmp_path)  # replaced: a new inode and size
    assert got2 is not None and (got2.number, got2.note) == (2, "grow") and len(reads) == 2
    aged(0.1)  # young: read at every check, then trusted once it is old
    _world._generation(tmp_path)
    assert len(reads) == 3
    path, stamp = tmp_path / rdzv.WORLD_FILE, os.stat(tmp_path / rdzv.WORLD_FILE).st_mtime_ns
    path.write_text(path.read_text().replace('"number": 2', '"number": 3'))  # same inode, size
    os.utime(path, ns=(stamp, stamp))  # and the same time: only its youth tells
    got3 = _world._generation(tmp_path)
    assert got3 is not None and got3.number == 3
    aged(5)
    _world._generation(tmp_path)
    n = len(reads)
    _world._generation(tmp_path)
    assert len(reads) == n
    path.unlink()
    assert _world._generation(tmp_path) is None
