"""Multi-user mode: a job takes only what its own account may use (issue 25, Why 7, Deliver 1, 4).

A real ``hora serve`` as root in multi-user mode (the fixtures of
:mod:`test_service_isolation`: fresh OS accounts, a work root under ``/tmp``, each job in its
own network and mount namespace with a private ``/tmp``), and the real ``hora`` CLI in a
subprocess whose ``PATH`` and ``VIRTUAL_ENV`` are an activated venv that lies under ``/tmp``
but outside the work root, run from a subdirectory of the work root:

* while the venv sits in a directory the job's account cannot enter, the submission is
  refused, checked as that account, naming ``env.VIRTUAL_ENV``, the path and the account
  (before, the job ran the system's ``python`` and failed on its first import);
* once the account can enter it, the job runs with that venv's ``python`` in the submitting
  directory, although its ``/tmp`` is private (the venv stays visible there: before, a bare
  ``rank 0 exited with code 127``) and the rest of the host's ``/tmp`` stays hidden;
* the same venv reached through a symlink under ``/tmp`` is refused before it runs, naming
  the path the job would not find;
* a multi-user service whose work root its job accounts cannot enter (by default the
  service account's home, ``/root``, mode 0700) refuses to start, naming the setting.

Needs root, as the other multi-user tests.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import test_service_isolation as iso
from helpers.service_server import ServiceServer, free_port

pytestmark = pytest.mark.timeout(240)

root, base, accounts = iso.root, iso.base, iso.accounts  # the same fixtures
SYSTEM_PATH = "/usr/bin:/bin"
WHERE = """\
import os, sys
print("prefix", sys.prefix, flush=True)
print("cwd", os.getcwd(), flush=True)
print("host marker seen", os.path.exists(sys.argv[1]), flush=True)
"""


def make_venv(where: Path) -> Path:
    """A venv of the system's Python (the one job accounts can run), without pip: fast."""
    subprocess.run([iso.JOB_PY, "-m", "venv", "--without-pip", str(where)], check=True,
                   capture_output=True, timeout=120)  # fmt: skip
    return where


def hora_in(srv: ServiceServer, user: str, cwd: Path, venv: Path, *args: str,
            ) -> subprocess.CompletedProcess[str]:  # fmt: skip
    """``hora`` in a terminal at ``cwd`` where ``venv`` was activated (``source .../activate``)."""
    env = {
        "HOME": str(cwd),
        "HORA_URL": srv.url,
        "HORA_TOKEN": srv.tokens[user],
        "HORA_CONFIG": str(cwd / "no-config"),
        "PATH": f"{venv / 'bin'}:{SYSTEM_PATH}",
        "VIRTUAL_ENV": str(venv),
    }
    return subprocess.run(
        [sys.executable, "-m", "hora.cli", *args], cwd=cwd, env=env, capture_output=True,
        text=True, timeout=180, stdin=subprocess.DEVNULL,
    )  # fmt: skip


def test_a_venv_is_taken_only_where_the_job_s_account_may_use_it(
    base: Path, accounts: dict[str, int]
) -> None:
    ann = next(iter(accounts))
    work = iso.work_dir(base)
    sub = work / "proj" / "sub"
    sub.mkdir(parents=True)
    sub.chmod(0o777)  # the CLI runs as root here, the job as ann's account
    (sub / "where.py").write_text(WHERE)
    (base / "marker").write_text("the host's /tmp")
    closed = base / "closed"
    closed.mkdir(mode=0o700)
    venv = make_venv(closed / "venv")
    run = ["submit", "--wait", "--name", "where", "--", "python", "where.py", str(base / "marker")]
    with iso.serve(base, accounts) as srv:
        refused = hora_in(srv, ann, sub, venv, *run)
        assert refused.returncode == 1, (refused.stdout, refused.stderr)
        err = refused.stderr
        assert "(422)" in err and "env.VIRTUAL_ENV: " in err and str(venv) in err, err
        assert f"account hora-{ann} (uid {accounts[ann]}) cannot use" in err, err
        assert "Permission denied" in err and "--export NONE" in err, err

        closed.chmod(0o755)  # now the account may use it
        ran = hora_in(srv, ann, sub, venv, *run)
        assert ran.returncode == 0, (ran.stdout, ran.stderr)
        assert f"prefix {venv}\n" in ran.stdout and f"cwd {sub}\n" in ran.stdout, ran.stdout
        assert "host marker seen False" in ran.stdout, ran.stdout  # its /tmp is its own

        link = base / "link"
        link.symlink_to(venv)
        hidden = hora_in(srv, ann, sub, link, *run)
        assert hidden.returncode == 1, hidden.stderr
        assert f"env.VIRTUAL_ENV: {link} is hidden from the job: its /tmp is its own" in (
            hidden.stderr
        ), hidden.stderr


def test_a_multi_user_service_refuses_a_work_root_its_accounts_cannot_enter(
    base: Path, accounts: dict[str, int]
) -> None:
    home = base / "admin-home"
    home.mkdir(mode=0o700)  # as /root is: `hora serve` as root puts the work root there
    env = {k: v for k, v in os.environ.items() if not k.startswith("HORA_")}
    env.update(HOME=str(home), HORA_USER_MODE="multi", HORA_DATA_DIR=str(base / "data"),
               HORA_CPU_SLOTS="2", HORA_GPUS="0")  # fmt: skip
    done = subprocess.run(
        [sys.executable, "-m", "hora.cli", "serve", "--port", str(free_port())],
        env=env, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    said = done.stdout + done.stderr
    assert done.returncode == 1, said
    assert f"job accounts cannot enter the work root {home} ({home} is mode 0700)" in said, said
    assert "Set work_root (hora serve --work-root DIR, or HORA_WORK_ROOT)" in said, said
