"""The HTTP API of the job service (control plane): ``create_app`` builds the FastAPI app."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__all__ = ["create_app"]

if TYPE_CHECKING:  # pragma: no cover
    from hora_service.api.app import create_app


def __getattr__(name: str) -> Any:
    if name == "create_app":
        from hora_service.api.app import create_app

        return create_app
    raise AttributeError(f"module 'hora_service.api' has no attribute {name!r}")
