"""This service's part in the machine-wide slot leases (control plane; see :mod:`hora.leases`).

:class:`SlotLeases` is the manager's collaborator for leases: the scheduling pass asks it
which free slots someone else holds (:meth:`SlotLeases.others`: another hora service, a
notebook's kernel-local engines) and takes the leases of the slots it places
(:meth:`SlotLeases.take`) before any rank starts; at the end of every pass the monitor hands
it which attempt holds which slot (:meth:`SlotLeases.sync`), and it lets go of the rest and
names the attempt in each lease. So whatever gives an attempt slots or takes them away (a
finish, an elastic shrink, a hand-off, parking) moves the leases with it.

A restarted service finds the leases of its re-adopted attempts held by their rank shims
(which inherited them): it knows them for its own by the claim in the file (this data
directory's instance, the job and the attempt, in a file of this account) and names
itself in them; their lock goes with the last shim.

:class:`DataDirLock` is the one service per data directory: an ``flock`` on
``DATA_DIR/service.lock`` held while the service runs.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

from hora.errors import HoraError
from hora.inventory import Slot
from hora.kinds import HolderKind
from hora.leases import Lease, LeaseDir, LeaseHolder

log = logging.getLogger(__name__)

Owner = tuple[int, int]  # (job id, attempt)


class SlotLeases:
    """The leases of this service's slots (see the module docstring).

    Args:
        directory: the machine's lease directory.
        inventory: the slots this service schedules.
        me: what every lease of this service says about it (``kind``, ``url``, ``instance``).
    """

    def __init__(
        self, directory: LeaseDir, inventory: Sequence[Slot], me: Mapping[str, object]
    ) -> None:
        self.dir = directory
        self._names = {s.index: f"{s.kind}{s.index}" for s in inventory}
        self._me = dict(me)
        self._held: dict[int, Lease] = {}
        self._owner: dict[int, Owner | None] = {}
        self._adopted: dict[int, Owner] = {}  # held by the shims of an earlier run's ranks
        self._reported: set[tuple[int, int | None]] = set()

    def name(self, slot: int) -> str:
        """The lease name of ``slot`` (``gpu0``, ``cpu1``)."""
        return self._names[slot]

    def others(self, slots: Iterable[int]) -> dict[int, LeaseHolder]:
        """Which of ``slots`` someone else holds, and who (a free one is left out)."""
        asked = {self._names[s]: s for s in slots if s not in self._held and s not in self._adopted}
        return {asked[n]: h for n, h in self.dir.held(asked).items()}

    def take(self, slots: Iterable[int]) -> dict[int, LeaseHolder]:
        """Take the leases of ``slots``; the ones others hold, with their holders ({}: all)."""
        blocked: dict[int, LeaseHolder] = {}
        for slot in slots:
            if slot in self._held or slot in self._adopted:
                continue
            got = self.dir.take(self._names[slot], self._claims(None))
            if isinstance(got, Lease):
                self._held[slot], self._owner[slot] = got, None
            else:
                blocked[slot] = got
        return blocked

    def fds(self, slots: Sequence[int]) -> tuple[int, ...]:
        """The open lease files of ``slots``, for rank shims to inherit (() unless all held)."""
        if not all(s in self._held for s in slots):
            return ()
        return tuple(self._held[s].fileno() for s in slots)

    def sync(self, owners: Mapping[int, Owner]) -> None:
        """Hold the leases of exactly the slots in ``owners`` (slot -> its job and attempt)."""
        for slot in [s for s in self._held if s not in owners]:
            self._held.pop(slot).close()
            self._owner.pop(slot, None)
        for slot in [s for s in self._adopted if s not in owners]:
            del self._adopted[slot]
        for slot, owner in owners.items():
            if slot in self._held:
                if self._owner.get(slot) != owner:
                    self._held[slot].describe(self._claims(owner))
                    self._owner[slot] = owner
            elif slot not in self._adopted:
                self._take_back(slot, owner)

    def close(self) -> None:
        """Let go of every lease this process holds (rank shims keep theirs)."""
        for lease in self._held.values():
            lease.close()
        self._held.clear()
        self._owner.clear()
        self._adopted.clear()

    def _take_back(self, slot: int, owner: Owner) -> None:
        """Lease a slot a running attempt holds already (re-adopted after a restart)."""
        name = self._names[slot]
        got = self.dir.take(name, self._claims(owner))
        if isinstance(got, Lease):
            self._held[slot], self._owner[slot] = got, owner
            return
        if self._mine(got, owner):
            self._adopted[slot] = owner
            claims = {**self._claims(owner), "locker": got.locker or got.pid or 0}
            self.dir.redescribe(name, claims)
            return
        if (slot, got.pid) not in self._reported:
            self._reported.add((slot, got.pid))
            log.error(
                "job %d runs on %s, whose lease %s holds as well (it was taken while this "
                "service was down); two holders share the slot until one ends",
                owner[0], name, got.words(),
            )  # fmt: skip

    def _mine(self, holder: LeaseHolder, owner: Owner) -> bool:
        """The lease is this service's own, kept by the ranks of ``owner`` across a restart."""
        return (
            holder.instance == self._me.get("instance")
            and (holder.job, holder.attempt) == owner
            and holder.file_uid == os.geteuid()
        )

    def _claims(self, owner: Owner | None) -> dict[str, object]:
        claims = dict(self._me)
        if owner is not None:
            claims["job"], claims["attempt"] = owner
        return claims


class DataDirLock:
    """One service per data directory: the lock on ``DATA_DIR/service.lock`` while it runs.

    Args:
        data_dir: the service's data directory (made already, mode 0700).
        url: where this service answers (named to a second one).
    """

    def __init__(self, data_dir: Path, url: str) -> None:
        self.data_dir = data_dir
        self.url = url
        self._lease: Lease | None = None

    def take(self) -> None:
        """Hold the data directory, or refuse.

        Raises:
            HoraError: another service holds it (naming its pid and URL), or the lock file
                cannot be used.
        """
        claims = {"kind": HolderKind.service.value, "url": self.url}
        got = LeaseDir(self.data_dir).take("service", claims)
        if isinstance(got, Lease):
            self._lease = got
            return
        if got.problem is not None:
            raise HoraError(f"cannot lock the data directory {self.data_dir}: {got.problem}")
        raise HoraError(
            f"another hora service (pid {got.pid}, {got.url or 'URL unknown'}) is using the "
            f"data directory {self.data_dir}; stop it first, or give this one a --data-dir "
            "of its own"
        )

    def release(self) -> None:
        """Let the data directory go (at stop)."""
        if self._lease is not None:
            self._lease.close()
            self._lease = None
