"""The job manager's code, cut by role; :mod:`hora_service.manager` puts it together.

:class:`~hora_service.manager.JobManager` is one object that inherits a mixin per role, each
over :class:`~hora_service.jobs.core.ManagerCore` (the shared state and the journaled writes):
:mod:`~hora_service.jobs.admission` (submissions and the job commands),
:mod:`~hora_service.jobs.reads` (cached job reads and pages), :mod:`~hora_service.jobs.slots`
(slots, the queue view, metrics), :mod:`~hora_service.jobs.monitor` (the monitor loop),
:mod:`~hora_service.jobs.elastic_slots` (elastic growth and shrinking),
:mod:`~hora_service.jobs.launch` (starting attempts) and :mod:`~hora_service.jobs.recovery`
(re-adopting attempts after a restart). :mod:`~hora_service.jobs.attempt` holds the plain
types they share.
"""
