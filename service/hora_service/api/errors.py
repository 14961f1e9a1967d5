"""How hora errors become HTTP answers (control plane).

A :class:`SpecError` becomes a 422 shaped like FastAPI's own validation errors
(``{"detail": [{"loc": [...], "msg": ..., "type": "spec_error"}]}``) so that clients read
one format; ``loc`` names the field. FastAPI's own validation errors pass through
:func:`validation_detail`, which keeps them valid JSON whatever the input was (``NaN``,
``Infinity``, a lone surrogate), so that bad input is always a 422, never a 500.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from fastapi import HTTPException
from hora.errors import SpecError
from hora.spec import error_message

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


def safe_text(value: object) -> str:
    r"""``str(value)`` with lone surrogates escaped, so that it encodes as UTF-8.

    Example:
        >>> safe_text("a\ud800")
        'a\\ud800'
    """
    return str(value).encode("utf-8", "backslashreplace").decode("utf-8")


def _json_safe(value: object) -> bool:
    try:
        json.dumps(value, allow_nan=False, ensure_ascii=False).encode("utf-8")
    except (TypeError, ValueError):  # UnicodeEncodeError is a ValueError
        return False
    return True


def validation_detail(errors: Sequence[Any]) -> list[dict[str, Any]]:
    """FastAPI's validation errors as JSON that always encodes (see the module docstring).

    Example:
        >>> validation_detail([{"loc": ("body", "timeout_s"), "msg": "bad", "type": "x",
        ...                     "input": float("nan")}])
        [{'loc': ['body', 'timeout_s'], 'msg': 'bad', 'type': 'x'}]
    """
    out = []
    for err in errors:
        loc = [p if isinstance(p, int) else safe_text(p) for p in err.get("loc", ())]
        item: dict[str, Any] = {
            "loc": loc,
            "msg": safe_text(error_message(err)),
            "type": safe_text(err.get("type", "")),
        }
        if "input" in err and _json_safe(err["input"]):
            item["input"] = err["input"]
        out.append(item)
    return out
