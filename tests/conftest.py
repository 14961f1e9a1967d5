"""Suite-wide set-up: a private HOME, and none of the user's hora or Jupyter settings.

The suite is hermetic: it never reads the user's ``~/.hora`` (``hora up`` saves the service's
URL and token there, and a configured service changes what ``%dist_start`` does), their
``HORA_*`` settings, or their Jupyter/IPython configuration. Before any test is collected, this
module changes ``os.environ`` for the whole session, so every subprocess the tests start
(``hora``, kernels, engines, ``hora run`` ranks, uvicorn) inherits the same:

* ``HOME`` is a fresh temporary directory (removed at exit), so ``~/.hora`` (the client
  config and the service's default data directory), ``~/.ipython``, ``~/.jupyter`` and
  ``~/.local/share/jupyter`` are private and empty. A test that needs a configured service
  starts its own and configures it itself (its own ``HORA_URL``/``HORA_TOKEN`` or config file).
* Every variable starting with ``HORA_`` is removed, except the suite's own test
  infrastructure, which a developer or CI sets on purpose and no product code reads: names
  starting with ``HORA_TEST_`` (e.g. ``HORA_TEST_DOCKERD_DIR``, CI's private Docker engine)
  and those in :data:`SUITE_SETTINGS`. Then the suite's own defaults (:data:`SUITE_DEFAULTS`)
  are set.
* Jupyter's and IPython's location variables (``JUPYTER_*``, ``IPYTHONDIR``) and the XDG
  config/data/state homes are removed, so Jupyter finds only the virtual environment's own
  kernels and settings.
* Every test gets a lease directory of its own (``HORA_LEASE_DIR``, a fresh sticky,
  world-writable directory, as the machine's default is): the services and kernel-local
  engines one test starts share it, and no two tests (nor other checkouts' tests on the same
  machine) ever see each other's leases of ``cpu0``, ``gpu0``, ...; a fixture of a wider scope
  (a module's server, started before any test's own) gets the suite's own directory.
* Kept as they are: ``PATH``, ``VIRTUAL_ENV``, ``DOCKER_HOST`` and every other variable. Caches
  that only save time point back at the real HOME's, since the private HOME starts empty:
  ``HORA_IMAGE_CACHE`` (the debootstrap base and wheels of ``hora image build``, which the
  docker tests run when the CPU image is stale), ``PIP_CACHE_DIR``, and the user's pip
  configuration file (``PIP_CONFIG_FILE``: the index that ``pip wheel`` in that build uses).
"""

import atexit
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

# tests/helpers is importable as `helpers` from every test module.
sys.path.insert(0, str(Path(__file__).parent))

# HORA_* variables the suite reads itself (test infrastructure, never product settings), kept
# from the caller's environment besides HORA_TEST_*.
SUITE_SETTINGS = (
    "HORA_HOROVOD_SUITE",  # where Horovod's test suite is (tests/helpers/horovod.py)
    "HORA_SCREENSHOT_DIR",  # keep JupyterLab screenshots there (test_notebooks_jupyterlab.py)
    "HORA_IMAGE_CACHE",  # a cache of `hora image build`; defaults to the real HOME's below
)

# Tests run as root (CI does), where the service's default is multi-user mode: every user
# needs an OS account of their own. Tests that are not about isolation run the service in
# shared mode (several users, jobs as the test's own account); the isolation tests
# (tests/e2e/test_service_isolation.py) ask for multi-user mode explicitly.
SUITE_DEFAULTS = {"HORA_USER_MODE": "shared"}

_HIDDEN = ("IPYTHONDIR", "XDG_CONFIG_HOME", "XDG_DATA_HOME", "XDG_STATE_HOME")


def _kept(name: str) -> bool:
    if name.startswith("HORA_"):
        return name.startswith("HORA_TEST_") or name in SUITE_SETTINGS
    return not name.startswith("JUPYTER_") and name not in _HIDDEN


def _private_environment(real_home: Path, private_home: Path) -> None:
    """Make ``os.environ`` hermetic (see the module docstring)."""
    caches = {
        "HORA_IMAGE_CACHE": str(real_home / ".cache" / "hora" / "images"),
        "PIP_CACHE_DIR": str(real_home / ".cache" / "pip"),
    }
    for conf in (real_home / ".config" / "pip" / "pip.conf", real_home / ".pip" / "pip.conf"):
        if conf.is_file():
            caches["PIP_CONFIG_FILE"] = str(conf)
            break
    for name in [n for n in os.environ if not _kept(n)]:
        del os.environ[name]
    for name, value in caches.items():
        os.environ.setdefault(name, value)
    os.environ.update(SUITE_DEFAULTS)
    os.environ["HOME"] = str(private_home)


_REAL_HOME = Path(os.environ.get("HOME") or Path.home())
_PRIVATE_ROOT = Path(tempfile.mkdtemp(prefix="hora-tests-"))
(_PRIVATE_ROOT / "home").mkdir(mode=0o700)
_private_environment(_REAL_HOME, _PRIVATE_ROOT / "home")
# removed at exit, after the in-process IPython shells' own atexit (registered later, run
# earlier) has closed their history database under ~/.ipython
atexit.register(shutil.rmtree, _PRIVATE_ROOT, ignore_errors=True)


# each test's lease directory lies in here, removed at exit: a module's kernel may outlive the
# test that started it and still use (or make again) that test's directory. In /tmp, not under
# the private root (0700): kernels of other accounts must reach it.
_LEASES_ROOT = Path(tempfile.mkdtemp(prefix="hora-test-leases-"))
_LEASES_ROOT.chmod(0o755)
atexit.register(shutil.rmtree, _LEASES_ROOT, ignore_errors=True)
# what a module- or session-scoped fixture (started before any test's own directory is set)
# gets: the suite's own directory, never the machine's /run/lock/hora-leases, which other
# checkouts' services and kernels on this machine use
_SUITE_LEASES = _LEASES_ROOT / "suite"
_SUITE_LEASES.mkdir()
_SUITE_LEASES.chmod(0o1777)
os.environ["HORA_LEASE_DIR"] = str(_SUITE_LEASES)


@pytest.fixture(autouse=True)
def _own_lease_dir(monkeypatch: pytest.MonkeyPatch) -> Path:
    """A lease directory of this test's own (see the module docstring)."""
    path = Path(tempfile.mkdtemp(prefix="test-", dir=_LEASES_ROOT))
    path.chmod(0o1777)
    monkeypatch.setenv("HORA_LEASE_DIR", str(path))
    return path


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--record-durations", action="store_true",
        help="write each test module's seconds into tests/durations.json (helpers/workers.py)",
    )  # fmt: skip


def pytest_configure(config: pytest.Config) -> None:
    """Under ``--dist loadgroup``, the workers take the groups in collection order, which
    :func:`pytest_collection_modifyitems` makes longest first (helpers/workers.py)."""
    from helpers.workers import DurationRecorder, by_group

    if by_group(config):
        config.option.loadscopereorder = False
    if config.getoption("--record-durations") and not hasattr(config, "workerinput"):
        config.pluginmanager.register(DurationRecorder(), "hora-durations")


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own hook reads the groups
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under ``-n 2 --dist loadgroup`` (CI), which tests share a worker, longest group first:
    helpers/workers.py."""
    from helpers.workers import mark_groups

    mark_groups(config, items)
