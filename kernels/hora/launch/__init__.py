"""``hora run``: start N local ranks of a training script and supervise them (data plane).

The horovodrun / torchrun equivalent for one machine:

* :mod:`hora.launch.config` parses the command line into a frozen
  :class:`~hora.launch.config.LaunchConfig` and builds every rank's environment (pure);
* :mod:`hora.launch.launcher` starts the ranks, streams their prefixed output, stops them all
  when one fails, forwards signals and leaves no orphans;
* :mod:`hora.launch.cli` is the ``hora run`` subcommand.

Importing this package loads only the standard library and :mod:`hora.env` (no torch).
"""

from __future__ import annotations

from hora.launch.config import LaunchConfig, build_rank_envs, parse_args
from hora.launch.launcher import LaunchResult, RankExit, Supervisor, launch

__all__ = [
    "LaunchConfig", "LaunchResult", "RankExit", "Supervisor", "build_rank_envs", "launch",
    "parse_args",
]
