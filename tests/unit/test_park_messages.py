"""What the notebook says about a park and a resume, word for word (issue 28)."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from hora.engines.park import Unsaveable
from hora.engines.parking import ParkRefusedError, ParkReport, ResumeReport, parked_table
from hora.magics_park import session_cluster
from hora.spec import JobState, ParkedRank, ParkInfo, SessionInfo
from IPython.core.error import UsageError

PARK = ParkInfo(
    phase="parked", parked_at=datetime(2026, 1, 2, 10, 2, 11, tzinfo=UTC),
    reason="its slots were wanted by job 17 (bob, priority high) after 6 min idle",
    bytes=412 << 20, world=2, directory="/w/.hora-parked/session-12-0123456789abcdef",
    ranks=[ParkedRank(rank=0, bytes=1, crc32=1, names=["a", "b", "c"], dropped=["f (file)"]),
           ParkedRank(rank=1, bytes=1, crc32=2, names=["a", "b", "c"])],
)  # fmt: skip


def test_the_refusal_names_each_variable_with_its_rank_type_and_why() -> None:
    err = ParkRefusedError({
        0: [Unsaveable("log", "_io.TextIOWrapper", "an open file")],
        1: [Unsaveable("it", "generator", "a generator")], 2: [],
    })  # fmt: skip
    assert str(err).splitlines() == [
        "these variables cannot be saved; nothing was parked, the engines run on:",
        "  rank 0: log (_io.TextIOWrapper): an open file",
        "  rank 1: it (generator): a generator",
        "drop them with %dist_park --drop it log, or park without whatever cannot be saved "
        "with --force",
    ]
    assert err._render_traceback_() == [f"ParkRefusedError: {err}"]  # no stack in the notebook


def test_the_park_and_resume_lines() -> None:
    parked = ParkReport(session=12, seconds=2.34, bytes=412 << 20, names="3", dropped=["f (x)"])
    assert parked.line() == (
        "parked session 12 in 2.3 s: 412.0 MiB (3 names a rank); slots freed; the next "
        "%%distributed cell resumes it\nleft out (not saved): f (x)"
    )
    resumed = ResumeReport(session=12, seconds=6.1, queued_s=0.4, engines_s=3.9, restore_s=1.8,
                           names="3", bytes=412 << 20, parked=PARK, lost=[])  # fmt: skip
    assert resumed.line() == (
        "resumed session 12 in 6.1 s (queued 0.4 s, engines 3.9 s, restore 1.8 s: 3 names a "
        "rank, 412.0 MiB)\nnot restored (left out at the park): f (file)"
    )
    assert resumed.why().startswith("session 12 was parked at ")
    assert resumed.why().endswith(": its slots were wanted by job 17 (bob, priority high) after "
                                  "6 min idle")  # fmt: skip


def test_the_table_of_parked_sessions() -> None:
    info = SessionInfo(id=12, user="ann", name="notebook", state=JobState.parked, workers=2,
                       slots=[], created_at=PARK.parked_at, lease_s=30, park=PARK)  # fmt: skip
    (row,) = parked_table([info])
    assert {k: row[k] for k in ("session", "engines", "size")} == {
        "session": 12, "engines": 2, "size": "412.0 MiB"
    }


@pytest.mark.parametrize("cluster", [None, object()])
def test_only_a_session_of_the_service_parks(cluster: object) -> None:
    with pytest.raises(UsageError, match="only a session of the hora service parks"):
        session_cluster(cluster, "%dist_park")
