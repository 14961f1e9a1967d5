"""What ``%dist_start``'s line asks for: the engines' options and how to start them (data plane).

The magic (:mod:`hora.magics`) parses its line with IPython's ``magic_arguments``; this module
turns the parsed arguments into a :class:`hora.engines.ClusterOptions` and a
:class:`StartMode`, each bad value a :class:`~IPython.core.error.UsageError` naming the flag.
Light: the engines' modules load inside :func:`cluster_options`.
"""

from __future__ import annotations

from argparse import Namespace
from dataclasses import dataclass
from typing import TYPE_CHECKING

from IPython.core.error import UsageError

from hora.kinds import RuntimeName

if TYPE_CHECKING:
    from hora.engines import ClusterOptions


@dataclass(frozen=True)
class StartMode:
    """How ``%dist_start`` starts engines (``%%distributed`` and ``%dist_restart`` reuse it)."""

    local: bool = False  # kernel-local engines even where a hora service is configured
    idle_timeout_s: float | None = None
    runtime: RuntimeName = RuntimeName.local  # where the service starts them
    ip: str | None = None  # the controller's address the Slurm nodes reach (slurm)
    image: str | None = None  # the engines' image (docker)


def cluster_options(args: Namespace) -> ClusterOptions:
    """The engines' options from ``%dist_start``'s arguments.

    Raises:
        UsageError: a bad ``--gpus`` list, or options the engines refuse.
    """
    from hora.engines import ClusterOptions
    from hora.errors import SpecError

    try:
        return ClusterOptions(
            n=args.n,
            gpus=_csv(args.gpus) if args.gpus else None,
            backend=args.backend,
            timeout_s=args.timeout if args.timeout is not None else 60.0,
            start_timeout_s=args.start_timeout,
        )
    except SpecError as e:
        raise UsageError(str(e)) from None


def start_mode(args: Namespace) -> StartMode:
    """How to start the engines, from ``%dist_start``'s arguments.

    Raises:
        UsageError: ``--ip`` without ``--runtime slurm``; ``--image`` without
            ``--runtime docker`` or that runtime without an image.

    Example:
        >>> mode = start_mode(Namespace(local=False, idle_timeout=None, runtime="slurm",
        ...                             ip="10.0.0.1", image=None))
        >>> mode.runtime is RuntimeName.slurm, mode.ip
        (True, '10.0.0.1')
    """
    runtime = RuntimeName(args.runtime)
    if args.ip is not None and runtime is not RuntimeName.slurm:
        raise UsageError("--ip is for --runtime slurm (local engines use 127.0.0.1)")
    if (args.image is not None) != (runtime is RuntimeName.docker):
        raise UsageError("--image goes with --runtime docker, which needs one (with hora)")
    return StartMode(args.local, args.idle_timeout, runtime, args.ip, args.image)


def _csv(value: str) -> tuple[str, ...]:
    items = tuple(v.strip() for v in value.split(",") if v.strip())
    if not items:
        raise UsageError(f"--gpus expects a comma-separated list such as 0,1; got {value!r}")
    return items
