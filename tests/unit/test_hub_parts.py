"""hora as a JupyterHub service, the parts that need no hub: the hub's configuration, PKCE,
the access scope, and how a hub user becomes a hora user (a real SQLite store)."""

from __future__ import annotations

import base64
import hashlib
import os
import pwd
from pathlib import Path
from types import SimpleNamespace

import pytest
from hora_service.hub import configure
from hora_service.hub.api import HubApi, HubUnavailable, HubUser, authorize_url, pkce_pair
from hora_service.hub.config import merge_roles, roles, service_entry
from hora_service.hub.users import HubUserRefused, HubUsers, account_uid
from hora_service.settings import Settings
from hora_service.store.db import Store
from hora_service.users.registry import Users
from traitlets.config import Config

NOBODY = pwd.getpwnam("nobody").pw_uid


def test_an_external_service_needs_the_shared_token_and_a_managed_one_gets_its_env() -> None:
    with pytest.raises(ValueError, match="api_token"):
        service_entry("hora", "http://127.0.0.1:8765")
    external = service_entry("hora", "http://127.0.0.1:8765", api_token="t")
    assert "command" not in external and external["api_token"] == "t"
    assert external["oauth_client_allowed_scopes"] == ["access:services!service=hora"]
    managed = service_entry("hora", "http://x:1", command=["hora", "serve", "--hub"],
                            environment={"HORA_DATA_DIR": "/srv/hora"})  # fmt: skip
    assert managed["command"] == ["hora", "serve", "--hub"] and "api_token" not in managed
    assert managed["environment"] == {"HORA_DATA_DIR": "/srv/hora"}


def test_roles_extend_the_hubs_own_and_keep_what_the_admin_set() -> None:
    admin_set = [
        {"name": "user", "scopes": ["self", "read:groups"]},
        {"name": "culler", "scopes": ["list:users"], "services": ["idle-culler"]},
    ]
    merged = merge_roles(admin_set, roles("hora"))
    by_name = {r["name"]: r for r in merged}
    assert by_name["user"]["scopes"] == ["self", "read:groups", "access:services!service=hora"]
    assert by_name["server"]["scopes"][-1] == "access:services!service=hora"
    assert by_name["culler"] == admin_set[1]
    assert admin_set[0]["scopes"] == ["self", "read:groups"], "the admin's list was changed"
    assert "hora-service" not in by_name  # reading users only when hub admins count
    assert {"name": "hora-service", "scopes": ["read:users"], "services": ["hora"]} in roles(
        "hora", hub_admins=True
    )


def test_configure_fills_a_hub_config_and_keeps_what_was_there() -> None:
    c = Config()
    c.JupyterHub.services.append({"name": "idle-culler", "command": ["culler"]})  # lazily
    c.Spawner.environment.update({"PATH": "/opt/venv/bin:/usr/bin:/bin"})
    configure(
        c, "http://127.0.0.1:8765", command=["hora", "serve", "--hub"],
        environment={"HORA_DATA_DIR": "/srv/hora"}, notebook_url="http://hub/services/hora/",
    )  # fmt: skip
    names = [s["name"] for s in c.JupyterHub.services]
    assert names == ["idle-culler", "hora"]
    env = c.JupyterHub.services[1]["environment"]
    assert env == {"HORA_HOST": "127.0.0.1", "HORA_PORT": "8765", "HORA_HUB_ADMINS": "0",
                   "HORA_DATA_DIR": "/srv/hora"}  # fmt: skip
    spawner_env = c.Spawner.environment
    assert spawner_env["PATH"] == "/opt/venv/bin:/usr/bin:/bin"
    assert spawner_env["HORA_URL"] == "http://hub/services/hora"
    # the token is the server's own, from the spawner the hub is starting
    assert spawner_env["HORA_TOKEN"](SimpleNamespace(api_token="server-token")) == "server-token"
    assert [r["name"] for r in c.JupyterHub.load_roles] == ["user", "server"]
    assert c.Spawner.args == ["--ServerApp.jpserver_extensions=hora.server_extension=True",
                              "--KernelManager.shutdown_wait_time=25"]  # fmt: skip


def test_configure_installs_the_kernel_spec_for_the_servers_python(tmp_path: Path) -> None:
    python = tmp_path / "venv" / "bin" / "python"
    c = Config()
    configure(c, api_token="t", kernel_python=str(python))
    spec = tmp_path / "venv" / "share" / "jupyter" / "kernels" / "hora" / "kernel.json"
    assert f'"{python}"' in spec.read_text()


def test_pkce_challenge_is_the_verifiers_sha256_and_the_authorize_url_carries_it() -> None:
    verifier, challenge = pkce_pair()
    digest = base64.urlsafe_b64encode(hashlib.sha256(verifier.encode()).digest())
    assert challenge == digest.rstrip(b"=").decode()
    url = authorize_url("/jh/", "service-hora", "/jh/services/hora/oauth_callback", "st", challenge)
    assert url.startswith("/jh/hub/api/oauth2/authorize?client_id=service-hora&")
    assert f"code_challenge={challenge}" in url and "code_challenge_method=S256" in url
    assert authorize_url("/", "c", "/cb", "s", "x").startswith("/hub/api/oauth2/authorize?")


@pytest.mark.parametrize(
    ("scopes", "ok"),
    [
        ({"access:services!service=hora"}, True),
        ({"access:services"}, True),
        ({"access:services!service=other", "self"}, False),
        ({"access:servers!user=ann", "read:users:name!user=ann"}, False),
    ],
)
def test_a_token_may_use_the_service_only_with_its_access_scope(scopes: set[str], ok: bool) -> None:
    assert HubUser("ann", frozenset(scopes)).may_use("hora") is ok


def test_a_hub_that_does_not_answer_is_unavailable_not_an_unknown_token() -> None:
    hub = HubApi("http://127.0.0.1:9/hub/api", "t", "service-hora", "/cb")  # discard port
    with pytest.raises(HubUnavailable, match="cannot reach the hub"):
        hub.user_for_token("anything")
    hub.close()


def test_settings_read_the_hubs_variables_and_hora_s_own_win() -> None:
    env = {
        "JUPYTERHUB_API_URL": "http://127.0.0.1:1/hub/api", "JUPYTERHUB_API_TOKEN": "s",
        "JUPYTERHUB_SERVICE_PREFIX": "/services/hora/", "HORA_HUB_API_URL": "http://h/api",
    }  # fmt: skip
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        s = Settings(hub=True)
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    assert s.hub_api_url == "http://h/api"
    assert s.hub_api_token is not None and s.hub_api_token.get_secret_value() == "s"
    assert "s" not in repr(s.hub_api_token)
    assert (s.hub_prefix, s.hub_client, s.hub_callback) == (
        "/services/hora/",
        "service-hora",
        "/services/hora/oauth_callback",
    )


def _users(tmp_path: Path) -> Users:
    store = Store(tmp_path / "hora.db")
    return Users("multi", lambda: store)


def test_a_hub_user_is_made_on_first_contact_bound_to_the_account_of_that_name(
    tmp_path: Path,
) -> None:
    if os.geteuid() == NOBODY:
        pytest.skip("runs as nobody, whose account this test binds")
    users = _users(tmp_path)
    hub = HubUsers(users, None, "hora", uid_of={"ann": NOBODY}.__getitem__)  # type: ignore[arg-type]
    first = hub.user_for("ann")
    assert (first.name, first.os_uid, first.is_admin, first.gpu_quota) == (
        "ann",
        NOBODY,
        False,
        None,
    )
    assert hub.user_for("ann").id == first.id, "made twice"
    assert [u.name for u in users.all()] == ["ann"]


def test_a_hora_user_bound_to_another_account_is_refused_not_rebound(tmp_path: Path) -> None:
    users = _users(tmp_path)
    users.create("ann", uid=NOBODY)
    other = next(p.pw_uid for p in pwd.getpwall() if p.pw_uid not in (0, NOBODY, os.geteuid()))
    hub = HubUsers(users, None, "hora", uid_of={"ann": other}.__getitem__)  # type: ignore[arg-type]
    with pytest.raises(HubUserRefused, match=f"runs as uid {NOBODY}, but the hub runs 'ann'"):
        hub.user_for("ann")
    assert users.by_name("ann").os_uid == NOBODY  # type: ignore[union-attr]


def test_a_hub_user_without_an_account_or_as_root_is_refused(tmp_path: Path) -> None:
    with pytest.raises(HubUserRefused, match="no OS account"):
        account_uid("no-such-account-here")
    hub = HubUsers(_users(tmp_path), None, "hora", uid_of=account_uid)  # type: ignore[arg-type]
    with pytest.raises(HubUserRefused, match="root"):
        hub.user_for("root")


def test_the_documented_hub_configuration_loads_and_has_hora_in_it() -> None:
    from traitlets.config.loader import PyFileConfigLoader

    example = Path(__file__).resolve().parents[2] / "examples" / "jupyterhub_config.py"
    c = PyFileConfigLoader(example.name, str(example.parent)).load_config()
    services = {s["name"]: s for s in c.JupyterHub.services}
    assert sorted(services) == ["hora", "idle-culler"]
    hora = services["hora"]
    assert hora["command"] == ["/opt/hora/bin/hora", "serve", "--hub"]
    assert hora["environment"]["HORA_PORT"] == "8765"
    assert hora["environment"]["HORA_HUB_ADMINS"] == "0"
    roles = {r["name"]: r for r in c.JupyterHub.load_roles}
    assert "access:services!service=hora" in roles["user"]["scopes"]
    assert "access:services!service=hora" in roles["server"]["scopes"]
    assert roles["idle-culler"]["services"] == ["idle-culler"]
    env = c.Spawner.environment
    assert env["PATH"].startswith("/opt/hora/bin:") and env["HORA_URL"] == "http://127.0.0.1:8765"
    assert "--ServerApp.jpserver_extensions=hora.server_extension=True" in c.Spawner.args


def test_an_account_bound_to_another_hora_user_is_refused_with_the_reason(tmp_path: Path) -> None:
    users = _users(tmp_path)
    users.create("ann", uid=NOBODY)
    hub = HubUsers(users, None, "hora", uid_of={"bob": NOBODY}.__getitem__)  # type: ignore[arg-type]
    with pytest.raises(HubUserRefused, match="already runs the jobs of user 'ann'"):
        hub.user_for("bob")


def test_the_hubs_park_variable_is_the_kernels() -> None:
    from hora.engines import session
    from hora_service.hub import config

    assert config.PARK_ON_EXIT == session.PARK_ON_EXIT
    assert config.server_environment("http://h", park_on_exit=False).keys() == {
        "HORA_URL",
        "HORA_TOKEN",
    }
