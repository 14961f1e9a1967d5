"""A session's job spec, and where its controller may run (control plane).

:func:`session_spec` is the job spec of N engines that connect to the kernel's controller;
:func:`check_controller` checks a Slurm session's controller address. The bodies of
``/v1/sessions`` are the kernel's: :mod:`hora.session_wire`.
"""

from __future__ import annotations

import sys

from hora.env import RankEnv
from hora.errors import HoraError, SpecError
from hora.net import is_local_address
from hora.session_wire import SessionRequest
from hora.spec import JobSpec, RuntimeName, SessionInfo

from hora_service.settings import Settings

CONNECTION_VAR = RankEnv.var("engine_connection")
INLINE_MPL = "module://matplotlib_inline.backend_inline"


def check_controller(settings: Settings, host: str) -> None:
    """A Slurm session's controller runs on this machine or on a node of the cluster.

    On a node: the kernel of a user's server that runs as a Slurm job (batchspawner).

    Raises:
        SpecError: ``host`` is neither (field ``connection.interface``).
    """
    if is_local_address(host):
        return
    from hora_service.runtimes.slurm import SlurmRuntime  # only where Slurm is used

    try:
        nodes = SlurmRuntime.from_settings(settings).node_addresses()
    except (HoraError, OSError):
        nodes = set()
    if host not in nodes:
        raise SpecError(
            "connection.interface",
            f"{host} is not an address of the service's machine or of a Slurm node, "
            "where the kernel's controller must run",
        )


# the wire model lives in hora.spec, shared with the kernel; its old name here stays
SessionRecord = SessionInfo


def session_spec(req: SessionRequest, backend: str, python: str = sys.executable) -> JobSpec:
    """The job spec of a session: N engines that connect to the kernel's controller.

    Example:
        >>> session_spec(req, "gloo").command[-1]  # doctest: +SKIP
        'session-engine'
    """
    own = RankEnv(
        engine_connection=req.connection.model_dump_json(),
        backend=req.backend or backend,
        timeout=req.timeout_s,
        start_timeout=req.start_timeout_s,
        engine_world=req.world_file,
    )
    env = {
        **own.to_environ(),
        "OMP_NUM_THREADS": str(req.threads),
        "MPLBACKEND": INLINE_MPL,
    }
    # in a container the image's own python runs the engine (the image must have hora)
    exe = "python" if req.runtime == RuntimeName.docker else python
    return JobSpec(
        name=req.name,
        command=[exe, "-m", "hora.engines._child", "session-engine"],
        workers=req.workers,
        gpus_per_worker=req.gpus_per_worker,
        env=env,
        priority=req.priority,
        runtime=req.runtime,
        image=req.image,
    )
