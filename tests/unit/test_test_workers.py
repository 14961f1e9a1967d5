"""How CI spreads a folder over two pytest-xdist workers (tests/helpers/workers.py), in a real
pytest run with two real workers: which modules share a worker, that the longest group starts
first, and what ``--record-durations`` writes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

HELPERS = Path(__file__).parents[1]

# each test appends "worker module" to ran.txt when it runs
TEST_BODY = """
import os
from pathlib import Path


def record():
    with open(Path(__file__).parent / "ran.txt", "a") as f:
        f.write(f"{os.environ.get('PYTEST_XDIST_WORKER', 'main')} {Path(__file__).name}\\n")
"""

CONFTEST = f"""
import sys

import pytest

sys.path.insert(0, {str(HELPERS)!r})
from helpers.workers import by_group, mark_groups  # noqa: E402


@pytest.fixture
def docker_engine():
    return "the Docker engine"


def pytest_configure(config):
    if by_group(config):
        config.option.loadscopereorder = False


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    mark_groups(config, items, durations={{"test_long.py": 100.0, "test_short.py": 1.0}})
"""


def make_suite(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    # the inner run's own workers name themselves; an outer worker's name (this suite run
    # under -n) must not leak into a plain inner run
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(
        # collected first, three tests: pytest-xdist's own order (by test count) starts it first
        test_aaa_many=TEST_BODY + "".join(f"\ndef test_{i}():\n    record()\n" for i in range(3)),
        test_short=TEST_BODY + "\ndef test_s():\n    record()\n",
        test_long=TEST_BODY + "\ndef test_l():\n    record()\n",
        test_docker_a=TEST_BODY + "\ndef test_a(docker_engine):\n    record()\n",
        test_docker_b=TEST_BODY + "\ndef test_b(docker_engine):\n    record()\n",
    )


def ran(pytester: pytest.Pytester) -> list[tuple[str, str]]:
    lines = (pytester.path / "ran.txt").read_text().split("\n")
    return [(w, m) for w, m in (line.split() for line in lines if line)]


def test_the_longest_group_starts_first_and_docker_modules_share_a_worker(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    make_suite(pytester, monkeypatch)
    result = pytester.runpytest_subprocess(
        "-n", "2", "--dist", "loadgroup", "-p", "no:cacheprovider"
    )  # fmt: skip
    result.assert_outcomes(passed=7)
    order = ran(pytester)
    # longest first: the recorded 100 s module, then the unknown ones at 5 s a test (the
    # three-test module, 15 s, then the docker group, 10 s), the recorded 1 s module last. By
    # test count (pytest-xdist's own order) the one-test long module would start last.
    firsts: dict[str, str] = {}
    for worker, module in order:
        firsts.setdefault(worker, module)
    assert set(firsts.values()) == {"test_long.py", "test_aaa_many.py"}, order
    docker_workers = {w for w, m in order if m.startswith("test_docker_")}
    assert len(docker_workers) == 1, order
    many_workers = {w for w, m in order if m == "test_aaa_many.py"}
    assert len(many_workers) == 1, order


def test_without_loadgroup_nothing_is_marked_or_reordered(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    make_suite(pytester, monkeypatch)
    pytester.makepyfile(
        test_zzz_check="""
def test_marks(request):
    items = request.session.items
    assert not any(i.get_closest_marker("xdist_group") for i in items)
    assert [i.module.__name__ for i in items] == [
        "test_zzz_check", "test_aaa_many", "test_aaa_many", "test_aaa_many", "test_docker_a"]
""",
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "test_zzz_check.py",
                                           "test_aaa_many.py", "test_docker_a.py")  # fmt: skip
    result.assert_outcomes(passed=5)
    assert {w for w, _ in ran(pytester)} == {"main"}


def test_record_durations_rewrites_the_modules_it_ran_and_keeps_the_others(
    pytester: pytest.Pytester, tmp_path: Path
) -> None:
    durations = tmp_path / "durations.json"
    durations.write_text(json.dumps({"test_gone.py": 7.0, "test_slow.py": 999.0}))
    pytester.makeconftest(f"""
import sys

sys.path.insert(0, {str(HELPERS)!r})
from pathlib import Path  # noqa: E402

from helpers.workers import DurationRecorder  # noqa: E402


def pytest_configure(config):
    config.pluginmanager.register(DurationRecorder(Path({str(durations)!r})), "durations")
""")
    pytester.makepyfile(test_slow="import time\n\ndef test_a():\n    time.sleep(0.3)\n")
    pytester.runpytest_subprocess("-p", "no:cacheprovider").assert_outcomes(passed=1)
    written = json.loads(durations.read_text())
    assert written["test_gone.py"] == 7.0
    assert 0.3 <= written["test_slow.py"] < 30
