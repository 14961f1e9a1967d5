"""The ``hora`` console script (data plane entry point).

A thin dispatcher: each subcommand lives in the module that owns it and is imported only
when used, so ``hora run`` never loads FastAPI and ``hora serve`` never loads IPython.
Each target module exposes ``main(argv: list[str]) -> int``.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> (module, one-line help). Modules under hora_service belong to the control
# plane; importing them lazily here keeps `import hora` free of fastapi.
COMMANDS: dict[str, tuple[str, str]] = {
    "run": ("hora.launch.cli", "start N local ranks of a training script (horovodrun/torchrun)"),
    "kernel": ("hora.engines.kernelspec", "install the 'Python 3 (hora)' Jupyter kernel"),
    "serve": ("hora_service.cli", "start the job service (FastAPI + scheduler)"),
    "up": ("hora_service.up", "start the service and JupyterLab together"),
    "user": ("hora_service.cli", "manage users and tokens of the service"),
    "image": ("hora_service.images", "build hora's container images (cpu, gpu, notebook)"),
    "submit": ("hora.jobs_cli", "submit a job to the service"),
    "jobs": ("hora.jobs_cli", "list your jobs"),
    "status": ("hora.jobs_cli", "show one job"),
    "logs": ("hora.jobs_cli", "print or follow a job's logs"),
    "cancel": ("hora.jobs_cli", "cancel a job"),
    "gpus": ("hora.jobs_cli", "show GPUs/slots and which job holds each"),
    "scaling": ("hora.jobs_cli", "a job's scaling report, from its timeline"),
}


def _usage() -> str:
    width = max(map(len, COMMANDS))
    lines = ["usage: hora <command> [args...]", "", "commands:"]
    lines += [f"  {name:<{width}}  {text}" for name, (_, text) in COMMANDS.items()]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    """Return a parser that describes the ``hora`` command and its subcommands (for the docs).

    ``main`` dispatches on the first word itself; each subcommand's own parser reads the rest.

    Example:
        >>> build_parser().parse_args(["run"]).command
        'run'
    """
    parser = argparse.ArgumentParser(
        prog="hora", description="Jupyter-first data-parallel PyTorch."
    )
    parser.add_argument("--version", action="store_true", help="print hora's version and exit")
    sub = parser.add_subparsers(dest="command", metavar="<command>")
    for name, (_, text) in COMMANDS.items():
        sub.add_parser(name, help=text, add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one ``hora`` subcommand and return its exit status.

    Args:
        argv: arguments after the program name (default: ``sys.argv[1:]``).

    Returns:
        The subcommand's exit status (2 for a usage error).
    """
    args = sys.argv[1:] if argv is None else list(argv)
    if not args or args[0] in ("-h", "--help", "help"):
        sys.stdout.write(_usage() + "\n")
        return 0 if args else 2
    if args[0] == "--version":
        from hora import __version__

        sys.stdout.write(f"hora {__version__}\n")
        return 0
    if args[0] not in COMMANDS:
        sys.stderr.write(f"hora: unknown command {args[0]!r}\n\n{_usage()}\n")
        return 2
    module = importlib.import_module(COMMANDS[args[0]][0])
    return int(module.main(args))


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
