"""What the service trusts, pure parts: image references as Docker reads them, and run files.

Image references are normalized by Docker's rules before the allow-list is matched (issue 16,
"Why" #5: ``hora:5000/evil/miner``, ``hora-evil.example.com:443/...`` and ``hora-x/miner``
passed ``hora:*`` / ``hora-*:*`` as spellings). Run files are read without following a symlink,
opening a FIFO or trusting another owner's file ("Why" #2, #3): here with real files, FIFOs and
symlinks in a temporary directory.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
from hora.errors import SpecError
from hora_service.runtimes.docker import DockerConfig
from hora_service.runtimes.imageref import ImageRef, check_pattern, normalize_pattern
from hora_service.runtimes.runfiles import UntrustedRunFile, read_chunk, read_int
from hora_service.settings import Settings

DEFAULT = ("hora:*", "hora-*:*")
DIGEST = "sha256:" + "ab" * 32


@pytest.mark.parametrize(
    ("text", "normalized"),
    [
        ("hora:cpu", "docker.io/library/hora:cpu"),
        ("hora", "docker.io/library/hora:latest"),
        ("ubuntu:22.04", "docker.io/library/ubuntu:22.04"),
        ("docker.io/ubuntu", "docker.io/library/ubuntu:latest"),
        ("index.docker.io/library/ubuntu:1", "docker.io/library/ubuntu:1"),
        ("hora:5000/evil/miner", "hora:5000/evil/miner:latest"),  # a registry: it has a ':'
        ("hora-evil.example.com:443/x/y:1", "hora-evil.example.com:443/x/y:1"),
        ("hora-x/miner", "docker.io/hora-x/miner:latest"),  # a user on Docker Hub
        ("localhost/hora:cpu", "localhost/hora:cpu"),
        (f"hora:cpu@{DIGEST}", f"docker.io/library/hora:cpu@{DIGEST}"),
        (f"hora@{DIGEST}", f"docker.io/library/hora@{DIGEST}"),
    ],
)
def test_references_normalize_as_docker_reads_them(text: str, normalized: str) -> None:
    assert str(ImageRef.parse(text)) == normalized


@pytest.mark.parametrize(
    ("image", "allowed"),
    [
        ("hora:cpu", True),
        ("hora-gpu:12.4", True),
        (f"hora:cpu@{DIGEST}", True),  # allowed by name; the engine must have the digest
        ("hora:5000/evil/miner", False),
        ("hora-evil.example.com:443/evil/miner:1", False),
        ("hora-x/miner", False),
        ("hora-x/miner:latest", False),
        ("docker.io/library/hora:cpu", True),
        ("ghcr.io/library/hora:cpu", False),  # the same name on another registry
        ("evil/miner:latest", False),
    ],
)
def test_the_default_list_allows_hora_images_only(image: str, allowed: bool) -> None:
    assert DockerConfig(instance="x", allowed_images=DEFAULT).allows(image) is allowed


def test_patterns_are_normalized_and_star_never_crosses_a_slash() -> None:
    assert normalize_pattern("hora:*") == "docker.io/library/hora:*"
    team = DockerConfig(instance="x", allowed_images=("ghcr.io/acme/*", "team/*:v?"))
    assert team.allows("ghcr.io/acme/trainer:3") and team.allows(f"ghcr.io/acme/t@{DIGEST}")
    assert not team.allows("ghcr.io/acme/deep/trainer:3")  # '*' stops at '/'
    assert team.allows("team/x:v1") and not team.allows("team/x:v10")
    # an image ID allows that image only, by its ID
    assert DockerConfig(instance="x", allowed_images=(DIGEST,)).allows(DIGEST)
    assert not DockerConfig(instance="x", allowed_images=DEFAULT).allows(DIGEST)


def test_only_a_pattern_naming_a_registry_lets_an_image_be_pulled() -> None:
    config = DockerConfig(instance="x", allowed_images=("hora:*", "localhost:5000/ml/*:*"))
    assert not config.pulls("hora:cpu")  # never fetched from Docker Hub
    assert config.pulls("localhost:5000/ml/train:1")
    never = DockerConfig(instance="x", allowed_images=("localhost:5000/ml/*:*",), pull="never")
    assert not never.pulls("localhost:5000/ml/train:1")


@pytest.mark.parametrize(
    "bad", ["hora\x00:cpu", "", " hora", "Hora:cpu", "hora:cpu@sha256:xyz", "hora:c/d:e:f:g"]
)
def test_a_bad_reference_is_a_spec_error_on_image(bad: str) -> None:
    with pytest.raises(SpecError) as e:
        ImageRef.parse(bad)
    assert e.value.field == "image"


def test_settings_refuse_an_unusable_pattern(tmp_path: Path) -> None:
    assert check_pattern("ghcr.io/acme/*") == "ghcr.io/acme/*"
    with pytest.raises(ValueError, match="image pattern"):
        Settings(data_dir=tmp_path, docker_allowed_images="hora:*, bad pattern")  # type: ignore[arg-type]


# --- run files ------------------------------------------------------------------------


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    d = tmp_path / "run"
    d.mkdir(mode=0o750)
    d.chmod(0o750)
    return d


def test_a_plain_run_file_reads(run_dir: Path) -> None:
    (run_dir / "rank0.exit").write_text("7   ")
    (run_dir / "rank0.log").write_bytes(b"0123456789")
    assert read_int(run_dir / "rank0.exit") == 7
    assert read_int(run_dir / "rank1.exit") is None  # not written yet
    assert read_chunk(run_dir / "rank0.log", 3, 4) == b"3456"


def test_a_symlink_is_refused_not_followed(run_dir: Path, tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_text("token hashes")
    (run_dir / "rank1.log").symlink_to(secret)
    (run_dir / "rank1.exit").symlink_to(secret)
    with pytest.raises(UntrustedRunFile, match="rank1.log .* symbolic link"):
        read_chunk(run_dir / "rank1.log", 0, 100)
    with pytest.raises(UntrustedRunFile, match="rank1.exit"):
        read_int(run_dir / "rank1.exit")


def test_a_fifo_is_refused_without_blocking(run_dir: Path) -> None:
    os.mkfifo(run_dir / "rank1.exit")
    os.mkfifo(run_dir / "rank1.log")
    errors: list[BaseException] = []

    def read_both() -> None:
        for fn in (lambda: read_int(run_dir / "rank1.exit"),
                   lambda: read_chunk(run_dir / "rank1.log", 0, 10)):  # fmt: skip
            try:
                fn()
            except UntrustedRunFile as e:
                errors.append(e)

    reader = threading.Thread(target=read_both, daemon=True)
    reader.start()
    reader.join(timeout=10)
    assert not reader.is_alive(), "reading a FIFO blocked"
    assert [str(e).split(" in ")[0] for e in errors] == ["rank1.exit", "rank1.log"]
    assert "named pipe" in str(errors[0])


def test_a_file_of_another_owner_or_a_writable_dir_is_refused(run_dir: Path) -> None:
    (run_dir / "rank0.exit").write_text("0")
    with pytest.raises(UntrustedRunFile, match="uid"):
        read_int(run_dir / "rank0.exit", owner=os.geteuid() + 1)
    run_dir.chmod(0o770)
    with pytest.raises(UntrustedRunFile, match="other accounts can write"):
        read_int(run_dir / "rank0.exit")
