"""Where one attempt's files live: :class:`JobPaths` (control plane).

Every attempt of a job has a run directory, ``LOGS_DIR/<job>/<attempt>`` (``LOGS_DIR`` is
``DATA_DIR/logs``), that the service creates and the rank shim writes into. This module names
its files once (as submitit's ``JobPaths`` does); the manager, every runtime, the logs route
and the tests take their paths from it instead of spelling them:

* per rank: ``rank<R>.log`` (output), ``rank<R>.pid`` (the shim's pid), ``rank<R>.exit`` (the
  exit code the shim recorded) and ``rank<R>.launch`` (the command, environment and account
  the service hands the shim);
* docker: ``container.json`` (the container's ranks) and ``container.hits`` (what its cgroup
  counted, written by its init on its way out);
* slurm: ``hora-batch.sh``, ``slurm.out`` and ``slurm.jobid``;
* an elastic job's slot file, ``elastic.hosts``;
* ``preflight.json``: the communication preflight's figures, which rank 0 hands its shim on a
  pipe (never through its log).

The standalone scripts that run without ``hora_service`` (the shim, the container's init, the
Slurm rank launcher: standard library only) keep their own one-line spelling of the per-rank
names; a unit test checks that it agrees with this one.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from hora_service.runtimes.elastic_run import HOSTS_FILE


@dataclass(frozen=True)
class JobPaths:
    """The files of one attempt of a job, under its run directory.

    Attributes:
        run_dir: the attempt's directory, ``LOGS_DIR/<job>/<attempt>``.

    Example:
        >>> p = JobPaths.of(Path("/data/logs"), 7, 2)
        >>> p.run_dir, p.job_dir
        (PosixPath('/data/logs/7/2'), PosixPath('/data/logs/7'))
        >>> p.log(0), p.exit(1)
        (PosixPath('/data/logs/7/2/rank0.log'), PosixPath('/data/logs/7/2/rank1.exit'))
        >>> JobPaths(Path("/data/logs/7/2")) == p
        True
        >>> p.container_hits.name
        'container.hits'
    """

    run_dir: Path

    @classmethod
    def of(cls, logs_dir: Path, job_id: int, attempt: int) -> JobPaths:
        """The paths of attempt ``attempt`` of job ``job_id`` (built from integers only).

        Args:
            logs_dir: the service's logs directory (``Settings.logs_dir``).
            job_id: the job.
            attempt: 1 for the first run, 2 for the first retry, ...
        """
        return cls(cls.job_dir_of(logs_dir, job_id) / str(int(attempt)))

    @staticmethod
    def job_dir_of(logs_dir: Path, job_id: int) -> Path:
        """The directory of every attempt of job ``job_id``: ``LOGS_DIR/<job>``."""
        return logs_dir / str(int(job_id))

    @property
    def job_dir(self) -> Path:
        """The job's directory, which holds this attempt's and the others'."""
        return self.run_dir.parent

    def _rank(self, rank: int, kind: str) -> Path:
        return self.run_dir / f"rank{int(rank)}.{kind}"

    def log(self, rank: int) -> Path:
        """Rank ``rank``'s output, written by its shim."""
        return self._rank(rank, "log")

    def pid(self, rank: int) -> Path:
        """The pid of rank ``rank``'s shim (the leader of the rank's process group)."""
        return self._rank(rank, "pid")

    def exit(self, rank: int) -> Path:
        """The exit code the shim recorded for rank ``rank`` (minus the signal if killed)."""
        return self._rank(rank, "exit")

    def launch(self, rank: int) -> Path:
        """Rank ``rank``'s launch file: what the service hands the shim (JSON)."""
        return self._rank(rank, "launch")

    @property
    def container_json(self) -> Path:
        """The ranks a docker attempt's container runs, read by its init (JSON)."""
        return self.run_dir / "container.json"

    @property
    def container_hits(self) -> Path:
        """What a docker container's cgroup counted, written by its init (JSON)."""
        return self.run_dir / "container.hits"

    @property
    def batch_script(self) -> Path:
        """A slurm attempt's batch script."""
        return self.run_dir / "hora-batch.sh"

    @property
    def slurm_out(self) -> Path:
        """A slurm attempt's batch output (what the batch script and its launcher said)."""
        return self.run_dir / "slurm.out"

    @property
    def slurm_jobid(self) -> Path:
        """The id of a slurm attempt's Slurm job (empty: sbatch refused it)."""
        return self.run_dir / "slurm.jobid"

    @property
    def preflight(self) -> Path:
        """The preflight's figures rank 0 measured (JSON, written by its shim)."""
        return self.run_dir / "preflight.json"

    @property
    def elastic_hosts(self) -> Path:
        """An elastic attempt's slot file, which the service rewrites as it grants slots."""
        return self.run_dir / HOSTS_FILE
