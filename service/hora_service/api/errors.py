"""How hora errors become HTTP answers (control plane).

A :class:`SpecError` becomes a 422 shaped like FastAPI's own validation errors
(``{"detail": [{"loc": [...], "msg": ..., "type": "spec_error"}]}``) so that clients read
one format; ``loc`` names the field.
"""

from __future__ import annotations

from typing import Any

from fastapi import HTTPException
from hora.errors import SpecError

# responses every authenticated route may give, for the OpenAPI schema
AUTH_RESPONSES: dict[int | str, dict[str, Any]] = {
    401: {"description": "Missing or invalid bearer token"},
}
JOB_RESPONSES: dict[int | str, dict[str, Any]] = {
    **AUTH_RESPONSES,
    404: {"description": "No such job, or the job belongs to another user"},
}


def spec_error_detail(err: SpecError, where: str = "body") -> list[dict[str, Any]]:
    """FastAPI-style validation detail for one :class:`SpecError`.

    Example:
        >>> spec_error_detail(SpecError("workers", "too many"))
        [{'loc': ['body', 'workers'], 'msg': 'too many', 'type': 'spec_error'}]
    """
    loc: list[str | int] = [where, *err.field.split(".")]
    return [{"loc": loc, "msg": err.message, "type": "spec_error"}]


def unprocessable(err: SpecError, where: str = "body") -> HTTPException:
    """A 422 naming ``err.field``."""
    return HTTPException(status_code=422, detail=spec_error_detail(err, where))
