"""Which address of this machine the Slurm nodes reach, asked of Slurm at most once a while.

``GET /v1/session-address?runtime=slurm`` answers where a notebook kernel's controller must
listen for its engines on Slurm's nodes. Without the admin's ``HORA_SLURM_SESSION_ADDRESS``
the service asks ``scontrol`` for the first node and picks the local address of the route to
it (:meth:`hora_service.runtimes.slurm.SlurmRuntime.address_towards_nodes`). That is a
process per request; :class:`NodeRoute` keeps the answer for :data:`FOUND_S` seconds and a
failure for :data:`FAILED_S`, asks one request at a time (the others wait for its answer
instead of starting their own ``scontrol``), and says a failure in its own words: what
Slurm's tool printed goes to the service's log, never to the user (control plane).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from hora.errors import SpecError

from hora_service.runtimes.slurm import NodeRouteError

log = logging.getLogger(__name__)

FOUND_S = 300.0  # an address found is kept this long (nodes rarely move)
FAILED_S = 15.0  # a failure is kept (and said again) this long

Ask = Callable[[], tuple[str, str]]


@dataclass(frozen=True)
class _Answer:
    at: float
    node: str = ""
    address: str = ""
    error: str = ""


class NodeRoute:
    """The first Slurm node and this machine's address towards it, cached (module docstring).

    Args:
        ask: asks Slurm (``SlurmRuntime.address_towards_nodes``); raises ``NodeRouteError``.
        clock: monotonic seconds (tests pass their own).

    Example:
        >>> route = NodeRoute(lambda: ("n1", "10.0.0.5"))
        >>> route.get()
        ('n1', '10.0.0.5')
    """

    def __init__(self, ask: Ask, clock: Callable[[], float] = time.monotonic) -> None:
        self._ask = ask
        self._clock = clock
        self._answer: _Answer | None = None
        self._lock = threading.Lock()

    def get(self) -> tuple[str, str]:
        """The node and the address, from the cache or from Slurm.

        Raises:
            SpecError: (field ``runtime``) Slurm could not tell; the message says what failed
                and which setting to set, without the tool's output.
        """
        with self._lock:  # one scontrol at a time; the others take its answer
            answer = self._answer
            if answer is None or self._clock() - answer.at >= _keep(answer):
                answer = self._answer = self._fresh()
        if answer.error:
            raise SpecError(
                "runtime",
                f"cannot tell which address the Slurm nodes reach this machine at: "
                f"{answer.error}; an admin sets HORA_SLURM_SESSION_ADDRESS (or fixes Slurm "
                "on the service's machine; its log says more)",
            )
        return answer.node, answer.address

    def _fresh(self) -> _Answer:
        try:
            node, address = self._ask()
        except NodeRouteError as e:
            log.warning("session address towards the Slurm nodes: %s", e)
            return _Answer(self._clock(), error=e.brief)
        return _Answer(self._clock(), node=node, address=address)


def _keep(answer: _Answer) -> float:
    return FAILED_S if answer.error else FOUND_S
