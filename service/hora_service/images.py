"""``hora image build``: hora's images, built on the engine in ``DOCKER_HOST`` (control plane).

``hora image build [--cpu|--gpu|--notebook] [--base IMAGE] [--tag TAG]`` builds one image
from the repository's ``docker/`` folder through the Docker Engine API and prints its tag
last:

* ``--cpu`` (``hora:cpu``, ``docker/cpu.Dockerfile``): what jobs need to run hora's examples
  (hora, the CPU build of torch, numpy, scikit-learn, and ipyparallel for session engines) on a
  minimal Debian. Its context is the
  Dockerfile and ``wheels/``: those packages at the versions of ``constraints/``, made on this
  machine with ``pip wheel`` (and its pip settings), so the build downloads nothing. Without
  ``--base`` it uses ``hora-base:bookworm`` and, when the engine lacks it, makes it with
  ``debootstrap --variant=minbase`` from this machine's Debian mirror into a cached directory,
  imported as a one-layer image.
* ``--gpu`` (``hora:gpu``, ``docker/Dockerfile``): hora with all of its dependencies and the
  examples' packages, and torch's CUDA build, on the same base. Its context is the Dockerfile,
  ``requirements.txt`` (hora's dependencies), ``constraints.txt`` (the lock) and ``wheels/``:
  made with ``pip --isolated wheel`` and no pip configuration file, against the package index,
  so that torch's CUDA build and its ``nvidia-*`` wheels (CUDA runtime, cuDNN, NCCL, ...) are
  gathered, never a local CPU wheel that this machine's pip settings may prefer. The driver
  comes from the host.
* ``--notebook`` (``hora:notebook``, ``docker/notebook.Dockerfile``): JupyterLab with the hora
  kernel and engines, on the GPU image (``--base``, default ``hora:gpu``).

Both the CPU and the GPU image are built from a context made here, so the build itself
downloads nothing; their wheels are kept in the cache (``--cache``) between builds. Every
process is built from an argument list (``debootstrap``, ``tar``, ``pip``).
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
from collections.abc import Iterable, Mapping
from enum import StrEnum
from pathlib import Path
from typing import Any

from hora.errors import HoraError

log = logging.getLogger(__name__)

BASE_IMAGE = "hora-base:bookworm"
SUITE = "bookworm"
DEFAULT_MIRROR = "http://deb.debian.org/debian"
PACKAGES = ("python3", "python3-venv", "ca-certificates")


class ImageKind(StrEnum):
    """The images ``hora image build`` makes."""

    cpu = "cpu"
    gpu = "gpu"
    notebook = "notebook"


KINDS = {  # kind -> (default tag, Dockerfile under docker/)
    ImageKind.cpu: ("hora:cpu", "cpu.Dockerfile"),
    ImageKind.gpu: ("hora:gpu", "Dockerfile"),
    ImageKind.notebook: ("hora:notebook", "notebook.Dockerfile"),
}
STEP_TIMEOUT_S = 1800
CPU_PACKAGES = ("torch", "numpy", "scikit-learn", "ipyparallel")
GPU_EXTRAS = ("examples",)  # hora's extras the GPU image carries besides its dependencies
LOCK = ("cpu.txt", "test.txt")  # under constraints/: the versions both images install
SOURCE_LABEL = "hora.source"


def build_parser() -> argparse.ArgumentParser:
    """Arguments of ``hora image build``.

    Example:
        >>> build_parser().parse_args(["build", "--gpu"]).kind is ImageKind.gpu
        True
    """
    p = argparse.ArgumentParser(prog="hora image", description="Build hora's container images.")
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="build an image on the engine in DOCKER_HOST")
    kind = b.add_mutually_exclusive_group()
    for name in KINDS:
        kind.add_argument(
            f"--{name}", dest="kind", action="store_const", const=name, help=f"the {name} image"
        )
    b.set_defaults(kind=ImageKind.cpu)
    b.add_argument("--base", help="base image (default: per kind; see hora image build -h)")
    b.add_argument("--tag", help="tag of the result (default hora:KIND)")
    b.add_argument("--repo", type=Path, help="hora's repository (default: found from here)")
    b.add_argument(
        "--cache",
        type=Path,
        default=Path(os.environ.get("HORA_IMAGE_CACHE", "~/.cache/hora/images")).expanduser(),
        help="keeps the debootstrap base and the wheels between builds (HORA_IMAGE_CACHE)",
    )
    b.add_argument("--mirror", help="Debian mirror for the base (default: apt's own)")
    return p


def apt_mirror(sources: Iterable[str]) -> str:
    """The first Debian mirror named in apt's sources (deb822 or one-line format).

    Example:
        >>> apt_mirror(["Types: deb", "URIs: http://m.example/debian", "Suites: bookworm"])
        'http://m.example/debian'
        >>> apt_mirror(["deb [arch=amd64] http://m.example/debian bookworm main"])
        'http://m.example/debian'
    """
    for text in sources:
        for line in text.splitlines():
            m = re.match(r"^\s*URIs:\s*(\S+)", line) or re.match(
                r"^\s*deb\s+(?:\[[^\]]*\]\s+)?(\S+)\s+\S+", line
            )
            if m and "security" not in m.group(1):
                return m.group(1)
    return DEFAULT_MIRROR


def debootstrap_argv(target: Path, mirror: str) -> list[str]:
    """The ``debootstrap`` command that makes the base's root file system in ``target``.

    Example:
        >>> debootstrap_argv(Path("/c/base"), "http://m/debian")[1:4]
        ['--variant=minbase', '--include=python3,python3-venv,ca-certificates', 'bookworm']
    """
    return [
        "debootstrap", "--variant=minbase", f"--include={','.join(PACKAGES)}", SUITE,
        str(target), mirror,
    ]  # fmt: skip


def wheel_argvs(
    repo: Path, wheels: Path, hora: Path, python: str = sys.executable
) -> list[list[str]]:
    """The ``pip wheel`` commands that gather the CPU image's packages at the lock's versions.

    hora itself without its dependencies into ``hora`` (jobs use only its data plane), then
    torch, numpy, scikit-learn and ipyparallel with theirs into ``wheels``.

    Example:
        >>> [argv[-1] for argv in wheel_argvs(Path("/r"), Path("/w"), Path("/h"), "py")]
        ['/r', 'ipyparallel']
    """
    pip = [python, "-m", "pip", "wheel", "--disable-pip-version-check", "--progress-bar", "off"]
    return [
        [*pip, "--no-deps", "-w", str(hora), str(repo)],
        [*pip, *_constraints(repo), "--find-links", str(wheels), "-w", str(wheels),
         *CPU_PACKAGES],
    ]  # fmt: skip


def gpu_wheel_argvs(
    repo: Path, wheels: Path, hora: Path, requirements: Path, python: str = sys.executable
) -> list[list[str]]:
    """The ``pip wheel`` commands that gather the GPU image's packages.

    hora itself without its dependencies into ``hora``, then what ``requirements`` names
    (:func:`gpu_requirements`) at the lock's versions into ``wheels``. The second runs with
    ``--isolated``: pip settings of this machine that prefer a local CPU build of torch (a
    ``find-links`` folder, an extra index) are ignored, so the package index's torch, a CUDA
    build with the CUDA libraries as ``nvidia-*`` wheels, is what is gathered (run it with
    :func:`index_only_env`, which turns off the configuration files ``--isolated`` still reads).

    Example:
        >>> argvs = gpu_wheel_argvs(Path("/r"), Path("/w"), Path("/h"), Path("/q.txt"), "py")
        >>> argvs[1][3], argvs[1][-2:]
        ('--isolated', ['-r', '/q.txt'])
    """
    pip = [python, "-m", "pip", "wheel", "--disable-pip-version-check", "--progress-bar", "off"]
    return [
        [*pip, "--no-deps", "-w", str(hora), str(repo)],
        [python, "-m", "pip", "--isolated", *pip[3:], *_constraints(repo),
         "--find-links", str(wheels), "-w", str(wheels), "-r", str(requirements)],
    ]  # fmt: skip


def index_only_env(environ: Mapping[str, str]) -> dict[str, str]:
    """``environ`` for the GPU image's ``pip --isolated wheel``: no pip configuration file.

    ``--isolated`` ignores ``PIP_*`` variables and the user's configuration file, but pip still
    reads the file ``PIP_CONFIG_FILE`` names and the global one (``/etc/pip.conf``); ``os.devnull``
    there turns every file off, so no ``find-links`` can offer a local CPU build of torch.

    Example:
        >>> index_only_env({"PIP_CONFIG_FILE": "/home/me/pip.conf", "PATH": "/bin"})
        {'PIP_CONFIG_FILE': '/dev/null', 'PATH': '/bin'}
    """
    return {**environ, "PIP_CONFIG_FILE": os.devnull}


def gpu_requirements(pyproject: str) -> list[str]:
    """The requirements the GPU image installs: hora's and those of its :data:`GPU_EXTRAS`.

    Example:
        >>> gpu_requirements('''[project]
        ... dependencies = ["torch>=2.4", "uvicorn[standard]>=0.29"]
        ... optional-dependencies = {examples = ["scikit-learn>=1.4"], docs = ["sphinx"]}
        ... ''')
        ['torch>=2.4', 'uvicorn[standard]>=0.29', 'scikit-learn>=1.4']
    """
    project = tomllib.loads(pyproject)["project"]
    extras = project.get("optional-dependencies", {})
    return [*project["dependencies"], *(req for name in GPU_EXTRAS for req in extras[name])]


def _constraints(repo: Path) -> list[str]:
    return [
        arg for name in LOCK if (repo / "constraints" / name).exists()
        for arg in ("-c", str(repo / "constraints" / name))
    ]  # fmt: skip


def source_digest(repo: Path) -> str:
    """A digest of hora's sources (``kernels/``, ``service/``, ``pyproject.toml``).

    Images carry it as the label ``hora.source``, so a test can tell whether an image holds
    the hora of this checkout.
    """
    h = hashlib.sha256()
    files = [repo / "pyproject.toml"] + sorted(
        p for root in ("kernels", "service") for p in (repo / root).rglob("*.py")
    )
    for path in files:
        h.update(str(path.relative_to(repo)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def find_repo(start: Path) -> Path:
    """The repository: ``start`` or a parent with ``docker/cpu.Dockerfile``, else this file's.

    Raises:
        HoraError: none found (pass ``--repo``).
    """
    for d in [start, *start.parents, *Path(__file__).resolve().parents]:
        if (d / "docker" / "cpu.Dockerfile").is_file() and (d / "pyproject.toml").is_file():
            return d
    raise HoraError("cannot find hora's repository (docker/cpu.Dockerfile): pass --repo")


def _run(argv: list[str], what: str, env: dict[str, str] | None = None) -> None:
    log.info("%s: %s", what, " ".join(argv))
    done = subprocess.run(
        argv, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=STEP_TIMEOUT_S,
        env=env,
    )  # fmt: skip
    if done.returncode != 0:
        tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-15:])
        raise HoraError(f"{what} failed (exit {done.returncode}):\n{tail}")


def ensure_base(client: Any, cache: Path, mirror: str | None) -> str:
    """Make :data:`BASE_IMAGE` on the engine unless it has it; return its name.

    The debootstrap directory is kept in ``cache`` and reused by later builds.
    """
    import docker.errors

    try:
        client.images.get(BASE_IMAGE)
        return BASE_IMAGE
    except docker.errors.ImageNotFound:
        pass
    root = cache / f"base-{SUITE}"
    if not (root / "usr" / "bin" / "python3").exists():
        if shutil.which("debootstrap") is None:
            raise HoraError("debootstrap is not installed (apt-get install debootstrap)")
        if mirror is None:
            found = sorted(Path("/etc/apt").glob("sources.list*")) + sorted(
                Path("/etc/apt/sources.list.d").glob("*.sources")
            )
            mirror = apt_mirror(p.read_text() for p in found if p.is_file())
        tmp = cache / f"base-{SUITE}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        cache.mkdir(parents=True, exist_ok=True)
        _say(f"making the base with debootstrap from {mirror} (a few minutes, cached after)")
        _run(debootstrap_argv(tmp, mirror), "debootstrap")
        shutil.rmtree(root, ignore_errors=True)
        tmp.rename(root)
    with tempfile.TemporaryDirectory(dir=cache) as tmpdir:
        tar = Path(tmpdir) / "base.tar"
        _run(["tar", "-C", str(root), "-cf", str(tar), "."], "tar")
        repo, tag = BASE_IMAGE.split(":")
        client.api.import_image(src=str(tar), repository=repo, tag=tag)
    _say(f"imported {BASE_IMAGE}")
    return BASE_IMAGE


def cpu_context(repo: Path, cache: Path, into: Path) -> None:
    """Assemble the CPU image's build context: its Dockerfile, ``wheels/`` and ``hora/``."""
    wheels = cache / "wheels-cpu"
    wheels.mkdir(parents=True, exist_ok=True)
    _say("gathering wheels with pip (hora, torch, numpy, scikit-learn, ipyparallel; versions of "
         "constraints/)")
    for argv in wheel_argvs(repo, wheels, into / "hora"):
        _run(argv, "pip wheel")
    shutil.copy(repo / "docker" / "cpu.Dockerfile", into / "Dockerfile")
    _link_wheels(wheels, into / "wheels")


def gpu_context(repo: Path, cache: Path, into: Path) -> None:
    """Assemble the GPU image's build context (see ``docker/Dockerfile``).

    Raises:
        HoraError: pip gathered no CUDA build of torch (no ``nvidia-nccl`` wheel).
    """
    wheels = _mkdir(cache / "wheels-gpu")
    requirements = into / "requirements.txt"
    requirements.write_text("\n".join(gpu_requirements((repo / "pyproject.toml").read_text())))
    _say("gathering wheels with pip --isolated from the package index (hora's dependencies at "
         "the versions of constraints/, torch's CUDA build: several GB the first time)")
    for whl in wheels.glob("torch-*+cpu*.whl"):  # would win over the CUDA build (2.13.0+cpu
        whl.unlink()  # sorts after 2.13.0), and never belongs in this cache
    hora, deps = gpu_wheel_argvs(repo, wheels, into / "hora", requirements)
    _run(hora, "pip wheel")
    _run(deps, "pip wheel", env=index_only_env(os.environ))
    cpu = sorted(p.name for p in wheels.glob("torch-*+cpu*.whl"))
    if cpu or not any(wheels.glob("nvidia_nccl_cu*.whl")):
        found = f"it found {cpu[0]}" if cpu else "no nvidia-nccl wheel came with torch"
        raise HoraError(
            f"pip gathered no CUDA build of torch into {wheels} ({found}): the package index "
            "this machine reaches serves a CPU-only torch"
        )
    lock = [(repo / "constraints" / name) for name in LOCK]
    (into / "constraints.txt").write_text("\n".join(p.read_text() for p in lock if p.exists()))
    shutil.copy(repo / "docker" / "Dockerfile", into / "Dockerfile")
    _link_wheels(wheels, into / "wheels")


def _link_wheels(wheels: Path, into: Path) -> None:
    into.mkdir()
    for whl in wheels.glob("*.whl"):
        try:
            os.link(whl, into / whl.name)
        except OSError:
            shutil.copy(whl, into / whl.name)


def build(
    client: Any, context: Path, dockerfile: str, tag: str, base: str | None, digest: str
) -> None:
    """Build ``context`` with ``dockerfile`` on the engine as ``tag``; progress on stderr.

    Raises:
        HoraError: the build failed (the engine's message).
    """
    args = {"BASE": base} if base else {}
    stream = client.api.build(
        path=str(context), dockerfile=dockerfile, tag=tag, buildargs=args,
        rm=True, forcerm=True, decode=True, labels={SOURCE_LABEL: digest},
    )  # fmt: skip
    for chunk in stream:
        if "error" in chunk:
            raise HoraError(f"building {tag} failed: {chunk['error'].strip()}")
        text = chunk.get("stream", "")
        if text.strip():
            sys.stderr.write(text if text.endswith("\n") else text + "\n")


def build_image(kind: ImageKind, client: Any, repo: Path, cache: Path, base: str | None,
                tag: str | None, mirror: str | None = None) -> str:  # fmt: skip
    """Build the ``kind`` image (see the module docstring); return its tag."""
    tag = tag or KINDS[kind][0]
    dockerfile = KINDS[kind][1]
    digest = source_digest(repo)
    if kind in (ImageKind.cpu, ImageKind.gpu):
        base = base or ensure_base(client, cache, mirror)
        with tempfile.TemporaryDirectory(dir=_mkdir(cache)) as ctx:
            (cpu_context if kind == ImageKind.cpu else gpu_context)(repo, cache, Path(ctx))
            build(client, Path(ctx), "Dockerfile", tag, base, digest)
    else:
        build(client, repo / "docker", dockerfile, tag, base, digest)
    return tag


def _mkdir(d: Path) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    return d


def _say(text: str) -> None:
    sys.stderr.write(f"hora image: {text}\n")


def main(argv: list[str]) -> int:
    """``hora image build ...``; prints the built tag last. Returns the exit status."""
    import docker

    args = build_parser().parse_args(argv[1:])
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    try:
        repo = args.repo.resolve() if args.repo else find_repo(Path.cwd())
        try:
            client = docker.from_env(timeout=600)
        except docker.errors.DockerException as e:
            where = os.environ.get("DOCKER_HOST") or "the default socket"
            raise HoraError(
                f"cannot reach the Docker engine at {where} (set DOCKER_HOST; "
                f"scripts/dockerd.sh start DIR starts one): {e}"
            ) from None
        tag = build_image(args.kind, client, repo, args.cache, args.base, args.tag, args.mirror)
    except (HoraError, docker.errors.DockerException, OSError) as e:
        sys.stderr.write(f"hora image: {e}\n")
        return 1
    sys.stdout.write(tag + "\n")
    return 0
