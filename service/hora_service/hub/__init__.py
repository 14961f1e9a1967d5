"""hora as a JupyterHub service (control plane).

A team's JupyterHub gives each member a JupyterLab running as their own OS account; hora
runs beside it as the hub's service ``hora``, behind the hub's proxy at ``/services/hora/``:

* :mod:`hora_service.hub.config`: what a ``jupyterhub_config.py`` adds
  (:func:`configure`): the service, the roles, each server's ``HORA_URL`` and ``HORA_TOKEN``,
  the kernel spec. It runs in the hub's process and imports only the standard library.
* :mod:`hora_service.hub.api`: the hub's REST API as the service asks it (whose token, the
  OAuth code exchange, who is the hub's admin).
* :mod:`hora_service.hub.users`: a hub user is the hora user of the same name, made on first
  contact and bound to the OS account of that name.
* :mod:`hora_service.hub.signin`: the service's prefix and the dashboard's sign-in through the
  hub (``hora serve --hub``).
"""

from __future__ import annotations

from hora_service.hub.config import configure

__all__ = ["configure"]
