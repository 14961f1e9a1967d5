"""A real Docker engine and hora's CPU image for the docker e2e tests.

:func:`engine` reuses the engine in ``DOCKER_HOST`` when it answers (``.ci/run`` starts one
with ``scripts/dockerd.sh`` and exports ``DOCKER_HOST`` and ``HORA_TEST_DOCKERD_DIR``), else
starts a private ``dockerd`` (state under a new directory in /tmp) and stops it at the end.
Where neither is possible (not root, no ``dockerd``) it fails with the reason: these tests are
never skipped. :func:`cpu_image` builds ``hora:cpu`` with ``hora image build --cpu`` unless
the engine has one built from this checkout's sources (label ``hora.source``); :func:`image`
does the same for any kind (the opt-in GPU image test builds ``hora:gpu`` with it). Where
``HORA_TEST_IMAGE_LOCK`` names a file, the build waits for an exclusive ``flock`` on it first:
``.ci/run`` builds the image in the background under that lock from its first install on, and a
docker test that comes before it is done waits for it rather than building a second one.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import docker
import docker.errors

ROOT = Path(__file__).resolve().parents[2]
DOCKERD_SH = ROOT / "scripts" / "dockerd.sh"
IMAGE = "hora:cpu"
BUILD_TIMEOUT_S = {"cpu": 1200, "gpu": 3600}  # the GPU image gathers several GB of wheels
LOCK_VAR = "HORA_TEST_IMAGE_LOCK"


class EngineUnavailable(RuntimeError):
    """No Docker engine can be reached or started here (the message says why)."""


@dataclass
class Engine:
    """A Docker engine the tests drive: its address and, when known, its state directory."""

    host: str
    state_dir: Path | None
    owned: bool

    def client(self) -> docker.DockerClient:
        return docker.DockerClient(base_url=self.host, timeout=60)

    def stop(self) -> None:
        if self.state_dir is None:
            raise EngineUnavailable("the engine's state directory is unknown: cannot stop it")
        _dockerd("stop", self.state_dir)

    def start(self) -> None:
        if self.state_dir is None:
            raise EngineUnavailable("the engine's state directory is unknown: cannot start it")
        _dockerd("start", self.state_dir)

    def remove_stopped_hora_containers(self) -> list[str]:
        """Remove hora's containers that are not running (left by an earlier run on this engine)."""
        found = self.client().containers.list(
            all=True, filters={"label": "hora.instance", "status": "exited"}
        )
        for c in found:
            c.remove(force=True)
        return [c.name for c in found]

    def hora_containers(self) -> list[str]:
        found = self.client().containers.list(all=True, filters={"label": "hora.instance"})
        return [f"{c.name} ({c.status})" for c in found]


def _dockerd(cmd: str, state_dir: Path) -> str:
    proc = subprocess.run(
        [str(DOCKERD_SH), cmd, str(state_dir)], capture_output=True, text=True, timeout=120
    )
    if proc.returncode != 0:
        raise EngineUnavailable(f"scripts/dockerd.sh {cmd} failed: {proc.stderr.strip()}")
    return proc.stdout.strip()


def _answers(host: str) -> bool:
    try:
        return bool(docker.DockerClient(base_url=host, timeout=10).ping())
    except (docker.errors.DockerException, OSError):
        return False


@contextmanager
def engine() -> Iterator[Engine]:
    """The engine of ``DOCKER_HOST`` if it answers, else a private one (stopped at the end)."""
    host = os.environ.get("DOCKER_HOST")
    if host and _answers(host):
        state = os.environ.get("HORA_TEST_DOCKERD_DIR")
        yield Engine(host, Path(state) if state else None, owned=False)
        return
    if os.geteuid() != 0:
        raise EngineUnavailable(
            "the docker e2e tests start a private dockerd, which needs root; run them as root "
            "or point DOCKER_HOST at a running engine"
        )
    if shutil.which("dockerd") is None:
        raise EngineUnavailable("dockerd is not installed (scripts/install.sh test installs it)")
    state_dir = Path(tempfile.mkdtemp(prefix="hora-dockerd-", dir="/tmp"))
    line = _dockerd("start", state_dir)
    try:
        yield Engine(line.split("=", 1)[1], state_dir, owned=True)
    finally:
        _dockerd("stop", state_dir)
        shutil.rmtree(state_dir, ignore_errors=True)


def cpu_image(eng: Engine) -> str:
    """``hora:cpu`` built from this checkout (built now unless the engine has it)."""
    return image(eng, "cpu")


def image(eng: Engine, kind: str) -> str:
    """``hora:KIND`` built from this checkout (built now unless the engine has it)."""
    with _held(os.environ.get(LOCK_VAR), BUILD_TIMEOUT_S[kind]):
        return _built(eng, kind)


@contextmanager
def _held(lock: str | None, timeout_s: float) -> Iterator[None]:
    """An exclusive ``flock`` on ``lock`` (nothing when None), waited for up to ``timeout_s``."""
    if not lock:
        yield
        return
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise EngineUnavailable(
                        f"the image build holding {lock} ({LOCK_VAR}) did not end within "
                        f"{timeout_s:.0f} s"
                    ) from None
                time.sleep(1)
        yield
    finally:
        os.close(fd)  # releases the lock


def _built(eng: Engine, kind: str) -> str:
    from hora_service.images import SOURCE_LABEL, source_digest

    tag = f"hora:{kind}"
    client = eng.client()
    try:
        labels = client.images.get(tag).labels or {}
        if labels.get(SOURCE_LABEL) == source_digest(ROOT):
            return tag
    except docker.errors.ImageNotFound:
        pass
    proc = subprocess.run(
        [sys.executable, "-m", "hora.cli", "image", "build", f"--{kind}", "--repo", str(ROOT)],
        env={**os.environ, "DOCKER_HOST": eng.host},
        capture_output=True, text=True, timeout=BUILD_TIMEOUT_S[kind], stdin=subprocess.DEVNULL,
    )  # fmt: skip
    if proc.returncode != 0 or proc.stdout.strip().splitlines()[-1:] != [tag]:
        raise EngineUnavailable(f"hora image build --{kind} failed:\n{proc.stderr[-3000:]}")
    return tag
