"""One rank of the conformance run: Horovod's Gloo-runner variables, then pytest on the suite.

Started by ``hora run`` as ``python _rank.py SHIM SUITE OUT [pytest args...]``: sets
``HOROVOD_RANK`` / ``HOROVOD_SIZE`` (and the local ones) from the launcher's ``RANK`` /
``WORLD_SIZE`` as Horovod's Gloo runner does (the suite's ``tearDown`` then calls
``hvd.barrier(); hvd.shutdown()`` after every test), puts the ``horovod`` shim first on the
path and runs pytest on SUITE, writing a JUnit XML report to ``OUT/rank<R>.xml``. This is a
fresh child process, so it sets its own environment.
"""

from __future__ import annotations

import os
import sys

import pytest


def main() -> int:
    shim, suite, out, *extra = sys.argv[1:]
    rank = os.environ["RANK"]
    os.environ.update(
        HOROVOD_RANK=rank,
        HOROVOD_SIZE=os.environ["WORLD_SIZE"],
        HOROVOD_LOCAL_RANK=os.environ.get("LOCAL_RANK", rank),
        HOROVOD_LOCAL_SIZE=os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"]),
    )
    sys.path.insert(0, shim)
    os.environ["PYTHONPATH"] = os.pathsep.join([shim, os.environ.get("PYTHONPATH", "")])
    args = [
        suite,
        "-q",
        "-p",
        "no:cacheprovider",
        "-c",
        os.path.join(shim, "pytest.ini"),
        "--rootdir",
        shim,
        f"--junitxml={os.path.join(out, f'rank{rank}.xml')}",
        *extra,
    ]
    return int(pytest.main(args))


if __name__ == "__main__":
    sys.exit(main())
