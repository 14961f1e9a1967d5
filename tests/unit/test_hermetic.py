"""The suite runs hermetically (tests/conftest.py): a private HOME, no user hora/Jupyter settings.

Checked in this process and in a child process (kernels, engines and ``hora`` subprocesses
inherit the same environment): the reported failure was ``hora up``'s ``~/.hora/config`` in the
user's real HOME turning ``%dist_start`` in the tests into a service session.
"""

from __future__ import annotations

import json
import os
import pwd
import subprocess
import sys
from pathlib import Path

CHILD = """
import json, os
from pathlib import Path
from hora.client_config import config_path
from hora.engines.session import service_configured
print(json.dumps({"home": os.environ["HOME"], "config": str(config_path()),
                  "configured": service_configured(), "expanded": str(Path("~").expanduser()),
                  "hora": sorted(k for k in os.environ if k.startswith("HORA_")),
                  "jupyter": sorted(k for k in os.environ if k.startswith(("JUPYTER", "IPY")))}))
"""
SUITE_OWN = {
    "HORA_USER_MODE", "HORA_LEASE_DIR", "HORA_HOROVOD_SUITE", "HORA_SCREENSHOT_DIR",
    "HORA_IMAGE_CACHE",
}  # fmt: skip


def test_home_is_private_and_holds_no_hora_config() -> None:
    home = Path(os.environ["HOME"])
    assert home != Path(pwd.getpwuid(os.getuid()).pw_dir)
    assert home.parent.name.startswith("hora-tests-")
    assert not (home / ".hora").exists()


def test_a_child_process_sees_no_configured_service_and_no_user_settings() -> None:
    done = subprocess.run(
        [sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=60,
        stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    assert seen["home"] == seen["expanded"] == os.environ["HOME"]
    assert seen["config"] == str(Path(os.environ["HOME"]) / ".hora" / "config")
    assert seen["configured"] is False
    assert all(k in SUITE_OWN or k.startswith("HORA_TEST_") for k in seen["hora"]), seen["hora"]
    assert os.environ["HORA_USER_MODE"] == "shared"
    # the machine's leases are not the tests': each test has a lease directory of its own
    assert Path(os.environ["HORA_LEASE_DIR"]).parent.name.startswith("hora-test-leases-")
    assert seen["jupyter"] == []
    # test infrastructure (HORA_TEST_*) passes through (set by the test below)
    probe = os.environ.get("HERMETIC_EXPECT_PROBE")
    assert ("HORA_TEST_PROBE" in seen["hora"]) == (probe is not None)
    assert os.environ.get("HORA_TEST_PROBE") == probe


def test_a_users_configured_service_and_settings_do_not_reach_the_tests(tmp_path: Path) -> None:
    """The two checks above, run by pytest under a user's environment after `hora up`."""
    home = tmp_path / "user-home"
    (home / ".hora").mkdir(parents=True, mode=0o700)
    config = home / ".hora" / "config"
    config.write_text(json.dumps({"url": "http://127.0.0.1:9", "token": "user-token"}))
    config.chmod(0o600)
    env = dict(os.environ)
    env.update(
        HOME=str(home), HORA_URL="http://127.0.0.1:9", HORA_TOKEN="user-token",
        HORA_CONFIG=str(config), HORA_USER_MODE="multi", JUPYTER_CONFIG_DIR=str(home / "jc"),
        IPYTHONDIR=str(home / "ipy"), HORA_LEASE_DIR=str(home), HORA_TEST_PROBE="kept",
        HERMETIC_EXPECT_PROBE="kept",
    )  # fmt: skip
    here = Path(__file__)
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(here),
         "-k", "home_is_private or child_process_sees"],
        capture_output=True, text=True, timeout=120, env=env, cwd=here.parents[2],
        stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert done.returncode == 0 and "2 passed" in done.stdout, done.stdout[-3000:]
    assert config.is_file()  # the user's own file is left alone
