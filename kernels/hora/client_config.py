"""Where the job service is and which token to use (data plane; used by the client and CLI).

Resolution order: explicit arguments, then ``HORA_URL`` / ``HORA_TOKEN``, then the JSON file
``~/.hora/config`` (``{"url": ..., "token": ...}``, mode 0600; ``HORA_CONFIG`` names another
file), then the default URL ``http://127.0.0.1:8000``. ``hora up`` writes the file.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hora.errors import SpecError

DEFAULT_URL = "http://127.0.0.1:8000"
CONFIG_ENV = "HORA_CONFIG"


@dataclass(frozen=True)
class ClientConfig:
    """Where the service is and who we are."""

    url: str
    token: str | None


def config_path(environ: Mapping[str, str] | None = None) -> Path:
    """Path of the client config file: ``$HORA_CONFIG`` or ``~/.hora/config``.

    Args:
        environ: environment to read (default ``os.environ``).

    Returns:
        The path (it may not exist).

    Example:
        >>> config_path({"HORA_CONFIG": "/tmp/c.json"})
        PosixPath('/tmp/c.json')
    """
    env = os.environ if environ is None else environ
    if env.get(CONFIG_ENV):
        return Path(env[CONFIG_ENV])
    return Path.home() / ".hora" / "config"


def load_config(
    url: str | None = None,
    token: str | None = None,
    environ: Mapping[str, str] | None = None,
) -> ClientConfig:
    """Resolve URL and token: arguments, then ``HORA_URL``/``HORA_TOKEN``, then the config file.

    Args:
        url: explicit service URL (wins).
        token: explicit bearer token (wins).
        environ: environment to read (default ``os.environ``).

    Returns:
        The resolved config; the URL defaults to ``http://127.0.0.1:8000``.

    Raises:
        SpecError: the config file exists but is not a JSON object.

    Example:
        >>> load_config("http://h:1", "t", environ={}).url
        'http://h:1'
    """
    env = os.environ if environ is None else environ
    path = config_path(env)
    stored: dict[str, Any] = {}
    if (url is None or token is None) and path.is_file():
        try:
            stored = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise SpecError("config", f"cannot read {path}: {e}") from e
        if not isinstance(stored, dict):
            raise SpecError("config", f"{path} must hold a JSON object with url and token")
    final_url = url or env.get("HORA_URL") or stored.get("url") or DEFAULT_URL
    final_token = token or env.get("HORA_TOKEN") or stored.get("token")
    return ClientConfig(url=str(final_url).rstrip("/"), token=final_token or None)


def save_config(url: str, token: str, path: Path | None = None) -> Path:
    """Write ``{"url", "token"}`` to the config file, readable by its owner only.

    Args:
        url: service URL.
        token: bearer token.
        path: file to write (default :func:`config_path`).

    Returns:
        The path written.

    Example:
        >>> save_config("http://127.0.0.1:8000", "tok", Path("/tmp/hora-doc-config"))
        PosixPath('/tmp/hora-doc-config')
    """
    target = path or config_path()
    target.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump({"url": url, "token": token}, f)
        f.write("\n")
    os.chmod(target, 0o600)
    return target
