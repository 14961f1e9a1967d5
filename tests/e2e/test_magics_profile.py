"""``%dist_start``'s preflight line and ``%%distributed --profile`` on real engines (CPU, gloo).

The profiled cell's communication share is known by construction: rank 0 computes (sleeps)
0.2 s and rank 1 1.0 s, then both run four blocking allreduces of 1 MiB. So rank 0 waits
about 0.8 s for rank 1 inside the first allreduce, rank 1 is the slowest rank because of
compute, each rank reduces exactly 4 MiB, and the scaling efficiency (median compute over the
slowest wall time) is about 0.6 / 1.0. Tolerances are wide (the machine is shared): waits
within 0.8 s +- 0.4 s, efficiency in 0.3..0.8; byte counts are exact.
"""

from __future__ import annotations

import pytest
from _magics_util import group_members, wait_gone
from IPython.core.interactiveshell import InteractiveShell
from IPython.utils.capture import capture_output

pytestmark = pytest.mark.timeout(150)

CELL = """%%distributed --profile
import time
time.sleep(0.2 if hvd.rank() == 0 else 1.0)
for i in range(4):
    hvd.allreduce(torch.ones(262144), name=f"profiled.{i}")
"""
START: list[str] = []


@pytest.fixture(scope="module")
def ip():
    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "hora")
    with capture_output() as cap:
        shell.run_line_magic("dist_start", "-n 2 --timeout 20")
    shown = "".join(o.data.get("text/plain", "") + "\n" for o in cap.outputs)
    START[:] = [shown, cap.stderr, cap.stdout]
    from hora import magics

    members = group_members(magics._MAGICS.cluster.pids)
    yield shell
    shell.run_line_magic("unload_ext", "hora")
    assert wait_gone(members) == []


def test_dist_start_prints_one_preflight_line(ip):
    from hora import magics

    out, err, stdout = START
    lines = [x for x in out.splitlines() if x.startswith("preflight (2 ranks, ")]
    assert len(lines) == 1, (out, err)
    assert "preflight" not in stdout  # displayed with the start's table, never in the stdout
    assert "gloo 4 MiB busbw" in lines[0] and " GB/s" in lines[0]
    report = magics._MAGICS.cluster.preflight
    assert report["size"] == 2 and report["paths"][0]["path"] == "gloo"
    assert [r["rank"] for r in report["paths"][0]["ranks"]] == [0, 1]


def test_profile_reports_the_known_communication_share(ip):
    from hora.engines import profile

    seen: list[profile.ProfileReport] = []
    real = profile.summarise

    def keep(*a, **kw):
        seen.append(real(*a, **kw))
        return seen[-1]

    profile.summarise = keep
    try:
        with capture_output() as cap:
            result = ip.run_cell(CELL)
    finally:
        profile.summarise = real
    assert result.success, cap.stderr
    (report,) = seen
    r0, r1 = report.ranks
    assert (r0.rank, r1.rank) == (0, 1)
    assert r0.bytes_reduced == r1.bytes_reduced == 4 * 1024 * 1024
    assert 0.4 <= r0.wait_s <= 1.2, report  # rank 0 waited for rank 1's extra 0.8 s
    assert r1.wait_s < r0.wait_s and r1.wait_s < 0.4, report
    assert r0.comm_s >= r0.wait_s and r1.compute_s >= 0.9, report
    assert report.slowest == 1 and report.why.startswith("compute"), report
    assert 0.3 <= report.efficiency <= 0.8, report
    assert r0.of_preflight is not None and r0.busbw_gbps > 0
    # what the notebook shows: the table (text and HTML), the chart, the verdict line
    texts = [o.data.get("text/plain", "") for o in cap.outputs]
    assert any(t.startswith("scaling report (--profile)") for t in texts), texts
    assert any("<svg" in o.data.get("text/html", "") for o in cap.outputs)
    assert "slowest rank 1 (compute: " in cap.stdout and "scaling efficiency" in cap.stdout


def test_a_failed_profiled_cell_stops_recording_on_every_engine(ip):
    from hora import magics

    with capture_output():
        result = ip.run_cell("%%distributed --profile\nraise ValueError('boom')")
    assert not result.success
    with capture_output():
        ip.run_cell("%distributed from hora.torch import timeline; n = len(timeline.LISTENERS)")
    assert magics._MAGICS.cluster.pull("n") == [0, 0]
