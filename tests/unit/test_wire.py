"""hora.spec's wire models read back what the service emits: jobs, transitions, slots, sessions.

The service answers through these models (``response_model``) and the client and the kernel
parse its answers into the same classes; here records made by a real job manager (scripted
ranks, no processes, no server) are serialized as the API serializes them and parsed back.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hora.spec import JobInfo, JobSpec, JobState, SessionInfo, SlotInfo, Transition
from hora_service.manager import JobManager
from hora_service.models import JobRecord
from hora_service.sessions.session_manager import SessionManager
from hora_service.settings import Settings
from test_service_core import ScriptedRuntime
from test_sessions import request


@pytest.fixture
def rt() -> ScriptedRuntime:
    return ScriptedRuntime()


@pytest.fixture
def mgr(tmp_path: Path, rt: ScriptedRuntime) -> JobManager:
    settings = Settings(
        data_dir=tmp_path / "data", work_root=tmp_path, gpus="0", cpu_slots=4, kill_grace_s=5,
        containment="tag", session_lease_s=30,
    )  # fmt: skip
    m = JobManager(settings, runtimes={"local": rt})
    m.open_store()
    return m


@pytest.fixture
def sessions(mgr: JobManager) -> SessionManager:
    return SessionManager(mgr, mgr.settings)


def wire(model: Any) -> dict[str, Any]:
    """What the API sends for ``model``: its JSON, as a client receives it."""
    data: dict[str, Any] = json.loads(model.model_dump_json())
    return data


def test_each_resource_has_one_class_on_both_sides() -> None:
    import hora.client
    import hora.engines.session
    import hora_service.models
    import hora_service.sessions.session_manager

    assert hora.client.JobInfo is JobInfo and issubclass(JobRecord, JobInfo)
    assert hora.engines.session.SessionInfo is SessionInfo
    assert hora_service.sessions.session_manager.SessionRecord is SessionInfo
    assert hora_service.models.Transition is Transition
    assert hora_service.models.SlotInfo is SlotInfo


def test_a_job_the_service_emits_reads_back_whole(mgr: JobManager, rt: ScriptedRuntime) -> None:
    spec = JobSpec(command=["python", "train.py"], workers=2, env={"SEED": "1"})
    job = mgr.submit("ann", spec)
    mgr.tick()
    rt.started[0][1][1].status = 3
    mgr.tick()  # rank 1 failed: rank 0 gets SIGTERM and exits from it
    mgr.tick()
    record = mgr.get(job.id)
    assert record is not None and record.state.terminal
    data = wire(record)
    info = JobInfo.model_validate(data)
    assert info.model_dump(mode="json") == data  # the service's own fields are kept
    assert all(isinstance(t, Transition) for t in info.transitions)
    assert [t.state for t in info.transitions] == [t.state for t in record.transitions]
    assert info.exit_codes == record.exit_codes and info.spec == record.spec
    assert info.state is JobState.failed and info.reason == record.reason


def test_a_slot_the_service_emits_reads_back(mgr: JobManager) -> None:
    mgr.submit("ann", JobSpec(command=["python", "train.py"], workers=2))
    mgr.tick()
    slots = mgr.slots()
    assert any(s.job_id is not None for s in slots)
    assert [SlotInfo.model_validate(wire(s)) for s in slots] == slots


def test_a_session_the_service_emits_reads_back(mgr: JobManager, sessions: SessionManager) -> None:
    created = sessions.create("ann", request())
    mgr.tick()
    job = mgr.get(created.id)
    assert job is not None
    view = sessions.view(job)
    info = SessionInfo.model_validate(wire(view))
    assert info == view and info.state is JobState.running and not info.ended
    done = sessions.delete(job)  # the session as it stood; from then on a 404
    assert SessionInfo.model_validate(wire(done)) == done
    mgr.tick()
    assert mgr.get(done.id) is None


@pytest.mark.parametrize("state", list(JobState))
def test_a_session_has_ended_exactly_when_its_state_is_terminal(state: JobState) -> None:
    data = {
        "id": 1, "user": "ann", "name": "s", "state": state.value, "workers": 1, "slots": [],
        "created_at": "2026-01-01T00:00:00Z", "lease_s": 30, "added_later": 1,
    }  # fmt: skip
    assert SessionInfo.model_validate(data).ended is state.terminal


def test_the_client_s_bodies_are_the_service_s_classes() -> None:
    import hora.service_wire as w
    import hora_service.api.jobs
    import hora_service.api.system
    import hora_service.observability.jobtrace

    assert hora_service.api.system.Health is w.Health
    assert hora_service.observability.jobtrace.JobScaling is w.JobScaling
    assert issubclass(hora_service.api.jobs.JobList, w.JobList)
    fields = hora_service.api.jobs.JobList.model_fields
    assert list(fields) == list(w.JobList.model_fields)  # the page's fields are declared once
    assert fields["items"].annotation == list[JobRecord]


def test_a_page_of_jobs_the_service_emits_reads_back(mgr: JobManager) -> None:
    from hora.service_wire import JobList

    for _ in range(3):
        mgr.submit("ann", JobSpec(command=["python", "train.py"], workers=1))
    mgr.tick()
    body = mgr.list_json(None, None, 2, 0)  # GET /v1/jobs's body, as the service sends it
    page = JobList[JobInfo].model_validate_json(body)
    assert (page.total, page.limit, page.offset, page.next_offset) == (3, 2, 0, 2)
    assert [j.id for j in page.items] == [3, 2]  # newest first
    records = [mgr.get(j.id) for j in page.items]
    assert [j.model_dump(mode="json") for j in page.items] == [wire(r) for r in records]
    last = JobList[JobInfo].model_validate_json(mgr.list_json(None, None, 2, 2))
    assert [j.id for j in last.items] == [1] and last.next_offset is None


def test_a_scaling_report_the_service_emits_reads_back(mgr: JobManager, tmp_path: Path) -> None:
    from hora.jobs_text import scaling_text
    from hora.service_wire import JobScaling
    from hora_service.observability.jobtrace import job_scaling
    from test_scaling import S, ev

    trace = [ev(0, "ALLREDUCE", 0.2 * S, 0.9 * S), ev(1, "ALLREDUCE", 1.0 * S, 0.1 * S)]
    (tmp_path / "trace.json").write_text(json.dumps({"traceEvents": trace}))
    env = {"HOROVOD_TIMELINE": "trace.json"}  # under the work root, the job's working dir
    spec = JobSpec(command=["python", "train.py"], workers=2, env=env)
    job = mgr.submit("ann", spec)
    record = mgr.get(job.id)
    assert record is not None
    report = job_scaling(mgr, record)  # what GET /v1/jobs/{id}/scaling answers
    assert report is not None
    data = wire(report)
    back = JobScaling.model_validate(data)
    assert back == report and back.model_dump(mode="json") == data
    assert back.rows[1]["rank"] == 1 and back.rows[1]["reduced"] == "1.0 MiB"
    assert [r.rank for r in back.ranks] == [0, 1] and back.slowest == 1
    assert scaling_text(back).splitlines()[-1] == back.verdict.strip()


@pytest.mark.parametrize("reason", [None, "the store is not writable"])
def test_a_health_answer_reads_back(reason: str | None) -> None:
    import hora
    from hora.service_wire import Health

    sent = Health(status="degraded" if reason else "ok", version=hora.__version__, reason=reason)
    data = sent.model_dump(exclude_none=True)  # as /healthz sends it
    assert Health.model_validate(json.loads(json.dumps(data))) == sent
