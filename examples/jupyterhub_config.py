"""JupyterHub for a team on one GPU machine, with hora as its service (docs/team.md).

Every member signs in with their own account (PAM), gets a JupyterLab running as that
account, and a notebook whose ``%dist_start`` asks hora for GPUs, with nothing to set up.
Adapt the values marked below, save it as ``/etc/jupyterhub/jupyterhub_config.py``, and start
both, as root::

    jupyterhub -f /etc/jupyterhub/jupyterhub_config.py

The hub starts ``hora serve --hub`` itself (a managed service); ``hora`` appears on the hub's
home page as a service, and its dashboard is at ``/services/hora/ui``.
"""

from hora_service.hub import configure

c = get_config()  # noqa: F821  (JupyterHub's configuration loader defines it)

VENV = "/opt/hora"  # hora[hub] in a virtualenv of /usr/bin/python3 that every account can run
STATE = "/var/lib/jupyterhub"  # the hub's state, root's alone (mode 0700)

c.JupyterHub.bind_url = "http://:8000"  # behind TLS: ssl_cert/ssl_key, or a reverse proxy
c.JupyterHub.db_url = f"sqlite:///{STATE}/jupyterhub.sqlite"
c.JupyterHub.cookie_secret_file = f"{STATE}/jupyterhub_cookie_secret"
c.ConfigurableHTTPProxy.pid_file = f"{STATE}/jupyterhub-proxy.pid"

c.Authenticator.allowed_users = {"alice", "bob"}  # existing OS accounts (PAM)
c.Authenticator.admin_users = {"carol"}  # the hub's admins (hora's: `hora user add --admin`)

c.Spawner.cmd = [f"{VENV}/bin/jupyterhub-singleuser"]
c.Spawner.default_url = "/lab"
# root's PATH would reach the servers (the spawner's env_keep): give them their own
c.Spawner.environment = {"PATH": f"{VENV}/bin:/usr/local/bin:/usr/bin:/bin"}

# servers idle for an hour are stopped; their kernels end their hora sessions first
c.JupyterHub.services = [
    {
        "name": "idle-culler",
        "command": [f"{VENV}/bin/python", "-m", "jupyterhub_idle_culler", "--timeout=3600"],
    }
]
c.JupyterHub.load_roles = [
    {
        "name": "idle-culler",
        "services": ["idle-culler"],
        "scopes": ["list:users", "read:users:activity", "read:servers", "delete:servers"],
    }
]

# hora: last, as it extends the services, roles, environment and arguments set above
configure(
    c,
    "http://127.0.0.1:8765",  # where hora serve listens; the hub's proxy passes /services/hora/
    command=[f"{VENV}/bin/hora", "serve", "--hub"],
    environment={
        "HORA_DATA_DIR": "/var/lib/hora",
        "HORA_WORK_ROOT": "/srv/hora-work",  # each user's working directory is made here
        "HORA_GPUS": "auto",
    },
)
