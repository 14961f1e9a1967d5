"""The job manager's code, cut by role; :mod:`hora_service.manager` puts it together.

:class:`~hora_service.manager.JobManager` owns one
:class:`~hora_service.jobs.state.ManagerState` (the shared state and the journaled writes) and
hands it to a collaborator per role, each constructed with the state and the collaborators it
calls: :mod:`~hora_service.jobs.admission` (submissions and the job commands),
:mod:`~hora_service.jobs.reads` (cached job reads and pages), :mod:`~hora_service.jobs.slots`
(slots, the queue view, metrics), :mod:`~hora_service.jobs.elastic_slots` (elastic growth and
shrinking), :mod:`~hora_service.jobs.launch` (starting attempts),
:mod:`~hora_service.jobs.recovery` (re-adopting attempts after a restart) and
:mod:`~hora_service.jobs.monitor` (the monitor loop). None inherits from another.
:mod:`~hora_service.jobs.attempt` holds the plain types they share.
"""
