"""Where the job service is and which token to use (data plane; used by the client and CLI).

Resolution order: explicit arguments, then ``HORA_URL`` / ``HORA_TOKEN``, then the JSON file
``~/.hora/config`` (``{"url": ..., "token": ...}``, mode 0600; ``HORA_CONFIG`` names another
file), then the default URL ``http://127.0.0.1:8000``. ``hora up`` writes the file, in a
``~/.hora`` of mode 0700. A config file that other users can read is refused: its token may
have leaked (``chmod 600`` it, and consider a new token), as ssh refuses a readable key.
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
        SpecError: the config file exists but is not a JSON object, or other users can read it.

    Example:
        >>> load_config("http://h:1", "t", environ={}).url
        'http://h:1'
    """
    env = os.environ if environ is None else environ
    path = config_path(env)
    stored: dict[str, Any] = {}
    if (url is None or token is None) and path.is_file():
        _check_private(path)
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
    target.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    if target.parent == Path.home() / ".hora":
        target.parent.chmod(0o700)  # hora's own directory: nobody else looks in
    fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump({"url": url, "token": token}, f)
        f.write("\n")
    os.chmod(target, 0o600)
    return target


def _check_private(path: Path) -> None:
    """Refuse a config file that group or others may read (its token is a password)."""
    try:
        mode = path.stat().st_mode & 0o777
    except OSError as e:
        raise SpecError("config", f"cannot read {path}: {e}") from e
    if mode & 0o077:
        raise SpecError(
            "config",
            f"{path} is readable by other users (mode {mode:o}), so its token may have "
            f"leaked: run `chmod 600 {path}` (and consider asking for a new token)",
        )
