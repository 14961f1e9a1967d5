"""Startup safety rule of the job service (control plane, pure).

Outside dev mode the service refuses to start when

* it would listen on a non-loopback address while no user exists (anyone who can reach the
  port would meet an empty service; create a user first with ``hora user add NAME --admin``),
  except behind JupyterHub (``hub``), whose users become the service's on first contact;
* the request-size limit is not positive (every body would be unbounded).

``hora serve --dev`` (``HORA_DEV_MODE=1``) lifts the rule for local experiments. Tokens are
always required; dev mode never turns authentication off.
"""

from __future__ import annotations

import ipaddress
from typing import Any

from hora.errors import HoraError


class UnsafeConfigError(HoraError):
    """The service would start with an unsafe configuration outside dev mode."""


def is_loopback(host: str) -> bool:
    """True for ``localhost`` and loopback addresses (``127.0.0.0/8``, ``::1``).

    Example:
        >>> is_loopback("127.0.0.1"), is_loopback("0.0.0.0")
        (True, False)
    """
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_safe(settings: Any, user_count: int) -> None:
    """Refuse unsafe defaults outside dev mode (see the module docstring).

    Args:
        settings: the service settings.
        user_count: number of users in the store.

    Raises:
        UnsafeConfigError: the configuration is unsafe; the message says the fix.
    """
    if settings.dev_mode:
        return
    if not is_loopback(settings.host) and user_count == 0 and not getattr(settings, "hub", False):
        raise UnsafeConfigError(
            f"refusing to listen on {settings.host} with no users: anyone could reach an "
            "empty service. Create one first (hora user add NAME --admin) or use --dev"
        )
    if int(getattr(settings, "max_request_bytes", 1)) <= 0:
        raise UnsafeConfigError("max_request_bytes must be positive outside dev mode")
