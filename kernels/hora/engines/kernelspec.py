"""``hora kernel install``: the "Python 3 (hora)" Jupyter kernel spec (data plane).

The kernel is the ordinary IPython kernel of the current interpreter, started with
``--ext hora`` so that hora's magics (``%%distributed``, ``%dist_start``, ...) are registered
before the first cell runs. The spec is built by a pure function (:func:`kernel_spec`) and
written with jupyter_client's ``KernelSpecManager`` from a temporary directory, exactly like
``python -m ipykernel install`` does.

Command line (``argv[0]`` is the subcommand name given to the ``hora`` dispatcher)::

    hora kernel install [--user | --sys-prefix | --prefix P] [--name hora] [--display-name D]
    hora kernel uninstall [--name hora]
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

DEFAULT_NAME = "hora"
DEFAULT_DISPLAY_NAME = "Python 3 (hora)"

__all__ = [
    "DEFAULT_DISPLAY_NAME",
    "DEFAULT_NAME",
    "install_kernel_spec",
    "kernel_spec",
    "main",
    "uninstall_kernel_spec",
]


class KernelSpecError(ValueError):
    """A kernel spec argument is invalid (the message names the argument)."""


def _check_name(name: str) -> str:
    # jupyter_client accepts ASCII [a-zA-Z0-9._-]; refuse anything else before touching the disk.
    if not name or not name.isascii() or any(not (c.isalnum() or c in "._-") for c in name):
        raise KernelSpecError(
            f"name: {name!r} is not a valid kernel name (use ASCII letters, digits, '.', '_', '-')"
        )
    return name


def kernel_spec(
    python: str | None = None, display_name: str = DEFAULT_DISPLAY_NAME
) -> dict[str, Any]:
    """Build the contents of the hora kernel's ``kernel.json`` (a pure function).

    Args:
        python: interpreter that runs the kernel (default: the current one).
        display_name: name shown in JupyterLab's launcher and kernel picker.

    Returns:
        The kernel spec as a JSON-serialisable dict.

    Example:
        >>> kernel_spec("/usr/bin/python3")["argv"][-2:]
        ['--ext', 'hora']
    """
    return {
        "argv": [
            python or sys.executable,
            "-m",
            "ipykernel_launcher",
            "-f",
            "{connection_file}",
            "--ext",
            "hora",
        ],
        "display_name": display_name,
        "language": "python",
        "metadata": {"debugger": True},
    }


def _copy_logos(dest: Path) -> None:
    # The Python logos shipped with ipykernel; cosmetic, so a missing file is not an error.
    try:
        from ipykernel.kernelspec import RESOURCES
    except ImportError:  # pragma: no cover - ipykernel is a dependency
        return
    for logo in Path(RESOURCES).glob("logo-*"):
        shutil.copy(logo, dest / logo.name)


def install_kernel_spec(
    user: bool = False,
    prefix: str | None = None,
    name: str = DEFAULT_NAME,
    display_name: str = DEFAULT_DISPLAY_NAME,
    python: str | None = None,
) -> str:
    """Install the hora kernel spec and return the directory it was written to.

    Args:
        user: install for the current user (``~/.local/share/jupyter``) instead of system-wide.
        prefix: install under this prefix (``PREFIX/share/jupyter/kernels/NAME``); use
            ``sys.prefix`` for the current virtual environment. Exclusive with ``user``.
        name: kernel name (directory name, and what ``--kernel`` / nbclient select).
        display_name: name shown in JupyterLab.
        python: interpreter that runs the kernel (default: the current one).

    Returns:
        The absolute path of the installed kernel spec directory.

    Raises:
        KernelSpecError: ``name`` is invalid, or both ``user`` and ``prefix`` were given.

    Example:
        >>> path = install_kernel_spec(prefix="/tmp/env")  # doctest: +SKIP
        >>> path  # doctest: +SKIP
        '/tmp/env/share/jupyter/kernels/hora'
    """
    from jupyter_client.kernelspec import KernelSpecManager

    _check_name(name)
    if user and prefix:
        raise KernelSpecError("prefix: give either --user or --prefix, not both")
    with tempfile.TemporaryDirectory(prefix="hora-kernelspec-") as tmp:
        src = Path(tmp) / name
        src.mkdir()
        spec = kernel_spec(python, display_name=display_name)
        (src / "kernel.json").write_text(json.dumps(spec, indent=1) + "\n")
        _copy_logos(src)
        dest = KernelSpecManager().install_kernel_spec(
            str(src), kernel_name=name, user=user, prefix=prefix
        )
    logger.info("installed kernel spec %r in %s", name, dest)
    return str(dest)


def uninstall_kernel_spec(name: str = DEFAULT_NAME) -> str:
    """Remove an installed hora kernel spec and return the directory that was removed.

    Args:
        name: kernel name given at install time.

    Returns:
        The path of the removed kernel spec directory.

    Raises:
        KernelSpecError: no kernel spec of that name is installed.

    Example:
        >>> uninstall_kernel_spec("hora")  # doctest: +SKIP
        '/usr/local/share/jupyter/kernels/hora'
    """
    from jupyter_client.kernelspec import KernelSpecManager, NoSuchKernel

    _check_name(name)
    try:
        return str(KernelSpecManager().remove_kernel_spec(name))
    except (NoSuchKernel, KeyError) as exc:
        raise KernelSpecError(f"name: no kernel spec named {name!r} is installed") from exc


def build_parser() -> argparse.ArgumentParser:
    """Return the ``hora kernel`` argument parser (``install`` and ``uninstall``).

    Example:
        >>> build_parser().parse_args(["install", "--user"]).user
        True
    """
    parser = argparse.ArgumentParser(
        prog="hora kernel", description="Manage the 'Python 3 (hora)' Jupyter kernel spec."
    )
    sub = parser.add_subparsers(dest="action", required=True)
    inst = sub.add_parser("install", help="install the kernel spec")
    where = inst.add_mutually_exclusive_group()
    where.add_argument("--user", action="store_true", help="install for the current user")
    where.add_argument("--sys-prefix", action="store_true", help="install into sys.prefix")
    where.add_argument("--prefix", help="install under this prefix")
    inst.add_argument("--name", default=DEFAULT_NAME, help="kernel name (default: hora)")
    inst.add_argument("--display-name", default=DEFAULT_DISPLAY_NAME, help="shown in JupyterLab")
    rm = sub.add_parser("uninstall", help="remove the kernel spec")
    rm.add_argument("--name", default=DEFAULT_NAME, help="kernel name (default: hora)")
    return parser


def main(argv: list[str]) -> int:
    """Run ``hora kernel ...`` and return its exit status.

    Args:
        argv: arguments including the subcommand name, e.g. ``["kernel", "install", "--user"]``.

    Returns:
        0 on success, 1 when the spec cannot be installed or removed, 2 on a usage error.

    Example:
        >>> main(["kernel", "install", "--prefix", "/tmp/env"])  # doctest: +SKIP
        0
    """
    args = list(argv[1:] if argv and argv[0] == "kernel" else argv)
    try:
        ns = build_parser().parse_args(args)
    except SystemExit as exc:  # argparse already printed the usage message
        return int(exc.code or 0)
    try:
        if ns.action == "install":
            prefix = sys.prefix if ns.sys_prefix else ns.prefix
            path = install_kernel_spec(ns.user, prefix, ns.name, ns.display_name)
            sys.stdout.write(f"Installed kernel spec {ns.name!r} ({ns.display_name}) in {path}\n")
        else:
            path = uninstall_kernel_spec(ns.name)
            sys.stdout.write(f"Removed kernel spec {ns.name!r} from {path}\n")
    except (KernelSpecError, OSError) as exc:
        sys.stderr.write(f"hora kernel: {exc}\n")
        return 1
    return 0
