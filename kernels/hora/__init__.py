"""hora: Jupyter-first data-parallel PyTorch (data plane root package).

``import hora`` is cheap: torch, IPython and httpx load only when the part that needs them is
used. ``%load_ext hora`` registers the notebook magics; ``import hora.torch as hvd`` is the
Horovod-compatible API; ``hora.Client`` talks to the job service.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

__all__ = ["Client", "Job", "__version__", "load_ipython_extension", "unload_ipython_extension"]

if TYPE_CHECKING:  # pragma: no cover
    from hora.client import Client, Job


def load_ipython_extension(ipython: Any) -> None:
    """Register hora's magics in an IPython kernel (``%load_ext hora``)."""
    from hora.magics import load_ipython_extension as _load

    _load(ipython)


def unload_ipython_extension(ipython: Any) -> None:
    """Stop engines started by this kernel (``%unload_ext hora``)."""
    from hora.magics import unload_ipython_extension as _unload

    _unload(ipython)


def __getattr__(name: str) -> Any:
    if name in ("Client", "Job"):
        from hora import client

        return getattr(client, name)
    raise AttributeError(f"module 'hora' has no attribute {name!r}")
