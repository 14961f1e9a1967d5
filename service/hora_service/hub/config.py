"""What a ``jupyterhub_config.py`` adds to run hora for the hub's users (control plane).

:func:`configure` is called from the hub's configuration file, in the hub's process; it only
fills the hub's configuration (and installs the hora kernel spec), so it imports nothing but
the standard library (and jupyter_client, for the kernel spec)::

    from hora_service.hub import configure
    configure(c, url="http://127.0.0.1:8765", command=["/opt/hora/bin/hora", "serve", "--hub"])

What it sets, each built by a pure function below:

* the service (:func:`service_entry`): ``hora``, proxied at ``/services/hora/``; with
  ``command`` the hub starts it (and gives it ``JUPYTERHUB_API_TOKEN`` and the rest), without
  it the admin runs ``hora serve --hub`` with ``HORA_HUB_API_TOKEN`` set to ``api_token``;
* the roles (:func:`roles`): every user may use the service (``access:services!service=hora``,
  added to the ``user`` role); a user server's token may too (the ``server`` role), so that
  the token the hub gives each server reaches hora as that user; with ``hub_admins`` the
  service may read users (to see who is the hub's admin);
* the servers' environment (:func:`server_environment`): ``HORA_URL`` and ``HORA_TOKEN``, the
  server's own API token (made by the hub for that server alone, in its environment only,
  revoked when it stops), so ``%load_ext hora`` and ``%dist_start`` need no set-up; and
  ``HORA_PARK_ON_EXIT=1``, so that a kernel the hub's stop shuts down parks its session;
* the servers' arguments (:func:`server_args`): they load :mod:`hora.server_extension`, so
  that the hub's SIGINT (a cull, a stop) shuts their kernels down cleanly, and each kernel
  ends its session (frees its slots) before the server goes, given time to do it;
* the hora kernel spec, installed for the single-user servers' Python (``kernel_python``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

# the users' servers load hora.server_extension: the hub's SIGINT then shuts their kernels
# down cleanly, so that a kernel ends (or parks) its session before the server goes
SERVER_EXTENSION = "--ServerApp.jpserver_extensions=hora.server_extension=True"
KERNEL_SHUTDOWN_S = 25.0  # the hub sends SIGTERM 30 s after SIGINT
PARK_ON_EXIT = "HORA_PARK_ON_EXIT"  # read by the kernel (hora.engines.session)
# the scopes of the hub's built-in roles that configure() extends (jupyterhub.roles)
USER_ROLE_SCOPES = ("self",)
SERVER_ROLE_SCOPES = ("users:activity!user", "access:servers!server")


def access_scope(name: str) -> str:
    """The scope a token needs to use the service called ``name``.

    Example:
        >>> access_scope("hora")
        'access:services!service=hora'
    """
    return f"access:services!service={name}"


def service_entry(
    name: str,
    url: str,
    api_token: str | None = None,
    command: Sequence[str] | None = None,
    environment: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """The service's entry in ``c.JupyterHub.services``.

    Args:
        name: the service's name (its path ``/services/NAME/``).
        url: where ``hora serve`` listens, as the proxy reaches it.
        api_token: the token the service and the hub share (required without ``command``).
        command: the hub starts the service with it (a managed service); None: external.
        environment: the managed service's environment (its ``HORA_*`` settings).

    Raises:
        ValueError: an external service without ``api_token``.

    Example:
        >>> e = service_entry("hora", "http://127.0.0.1:8765", api_token="t")
        >>> e["oauth_client_allowed_scopes"], e["oauth_no_confirm"]
        (['access:services!service=hora'], True)
    """
    entry: dict[str, Any] = {
        "name": name,
        "url": url,
        "oauth_no_confirm": True,
        "oauth_client_allowed_scopes": [access_scope(name)],
        "display": True,
    }
    if api_token:
        entry["api_token"] = api_token
    if command:
        entry["command"] = list(command)
        entry["environment"] = dict(environment or {})
    elif not api_token:
        raise ValueError(
            "api_token: an external hora service needs the token it shares with the hub "
            "(the same value as its HORA_HUB_API_TOKEN)"
        )
    return entry


def roles(name: str, hub_admins: bool = False) -> list[dict[str, Any]]:
    """The roles to load: users and their servers' tokens may use the service.

    Example:
        >>> [r["name"] for r in roles("hora", hub_admins=True)]
        ['user', 'server', 'hora-service']
    """
    scope = access_scope(name)
    found: list[dict[str, Any]] = [
        {"name": "user", "scopes": [*USER_ROLE_SCOPES, scope]},
        {"name": "server", "scopes": [*SERVER_ROLE_SCOPES, scope]},
    ]
    if hub_admins:
        found.append({"name": f"{name}-service", "scopes": ["read:users"], "services": [name]})
    return found


def merge_roles(current: Any, extra: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``c.JupyterHub.load_roles`` with ``extra``: a role of the same name gains its scopes.

    Example:
        >>> merge_roles([{"name": "user", "scopes": ["self", "x"]}], roles("hora"))[0]["scopes"]
        ['self', 'x', 'access:services!service=hora']
    """
    merged = [dict(r) for r in (current if isinstance(current, list) else [])]
    for role in extra:
        same = next((r for r in merged if r.get("name") == role["name"]), None)
        if same is None:
            merged.append(dict(role))
            continue
        scopes = list(same.get("scopes", []))
        same["scopes"] = scopes + [s for s in role["scopes"] if s not in scopes]
        for key in ("services", "users", "groups"):
            if key in role:
                same[key] = list(dict.fromkeys([*same.get(key, []), *role[key]]))
    return merged


def server_token(spawner: Any) -> str:
    """``HORA_TOKEN`` of a user's server: the API token the hub made for that server."""
    return str(spawner.api_token)


def server_environment(notebook_url: str, park_on_exit: bool = True) -> dict[str, Any]:
    """What each user's server gets in its environment (values or callables of the spawner).

    Example:
        >>> sorted(server_environment("http://127.0.0.1:8000/services/hora"))
        ['HORA_PARK_ON_EXIT', 'HORA_TOKEN', 'HORA_URL']
    """
    env: dict[str, Any] = {"HORA_URL": notebook_url.rstrip("/"), "HORA_TOKEN": server_token}
    if park_on_exit:  # a kernel shut down with its server (a cull) parks its session
        env[PARK_ON_EXIT] = "1"
    return env


def server_args(kernel_shutdown_s: float = KERNEL_SHUTDOWN_S) -> list[str]:
    """The users' servers' arguments: hora's extension, and time for kernels to end.

    Example:
        >>> server_args(25)[1]
        '--KernelManager.shutdown_wait_time=25'
    """
    return [SERVER_EXTENSION, f"--KernelManager.shutdown_wait_time={kernel_shutdown_s:g}"]


def install_kernel(python: str) -> str:
    """Install the "Python 3 (hora)" kernel spec for the servers' ``python`` (its prefix).

    Returns:
        The directory written.
    """
    from pathlib import Path

    from hora.engines.kernelspec import install_kernel_spec

    prefix = str(Path(python).parent.parent)
    return install_kernel_spec(prefix=prefix, python=python)


def configure(
    c: Any,
    url: str = "http://127.0.0.1:8765",
    *,
    name: str = "hora",
    api_token: str | None = None,
    command: Sequence[str] | None = None,
    environment: Mapping[str, str] | None = None,
    notebook_url: str | None = None,
    kernel_python: str | None = None,
    hub_admins: bool = False,
    kernel_shutdown_s: float = KERNEL_SHUTDOWN_S,
    park_on_exit: bool = True,
) -> None:
    """Add the hora service to a JupyterHub configuration ``c`` (see the module docstring).

    Call it after the rest of the configuration sets ``load_roles`` and the spawner's
    ``environment``, if it does: it extends them.

    Args:
        c: the hub's configuration (``c`` in ``jupyterhub_config.py``).
        url: where ``hora serve`` listens (the proxy's target); a managed service is given
            ``HORA_HOST`` and ``HORA_PORT`` from it.
        name: the service's name at the hub.
        api_token: the token the service and the hub share (required for an external one).
        command: start the service with this command (a managed service, ``hora serve
            --hub``); None: it is started apart, as ``hora serve --hub``.
        environment: more of the managed service's environment (``HORA_DATA_DIR``, ...).
        notebook_url: ``HORA_URL`` of the users' servers (default ``url``).
        kernel_python: the users' servers' Python: the hora kernel spec is installed for it.
        hub_admins: the hub's admins are hora admins too (the service may then read users).
        kernel_shutdown_s: how long a server waits for each kernel to end at its stop (a
            kernel that parks its session writes its engines' state first).
        park_on_exit: a kernel that shuts down with its server (a cull, a stop) parks its
            session (``HORA_PARK_ON_EXIT=1``: ``%dist_resume`` in a new kernel brings the
            engines and their variables back); False: it ends the session.

    Raises:
        ValueError: an external service without ``api_token``.
    """
    env: dict[str, str] = {}
    if command:
        host, _, port = url.split("://", 1)[-1].split("/", 1)[0].rpartition(":")
        env = {"HORA_HOST": host or "127.0.0.1", "HORA_PORT": port or "80"}
        env["HORA_HUB_ADMINS"] = "1" if hub_admins else "0"
        env.update(environment or {})
    c.JupyterHub.services = [
        *_listed(c.JupyterHub.services),
        service_entry(name, url, api_token, command, env),
    ]
    c.JupyterHub.load_roles = merge_roles(_listed(c.JupyterHub.load_roles), roles(name, hub_admins))
    own = _resolved(c.Spawner.environment, {})
    c.Spawner.environment = {**own, **server_environment(notebook_url or url, park_on_exit)}
    args = _listed(c.Spawner.args)
    c.Spawner.args = [*args, *(a for a in server_args(kernel_shutdown_s) if a not in args)]
    if kernel_python:
        install_kernel(kernel_python)


def _resolved(value: Any, empty: Any) -> Any:
    """A configuration value as set so far.

    traitlets keeps an unset value, or one only appended to or updated, as a lazy value,
    which applies its changes to ``empty``.
    """
    if hasattr(value, "get_value"):
        return value.get_value(empty)
    return value if isinstance(value, type(empty)) else empty


def _listed(value: Any) -> list[Any]:
    """A configuration list as set so far (see :func:`_resolved`)."""
    return list(_resolved(value, []))
