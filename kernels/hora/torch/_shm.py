"""Same-host shared memory for a process set's CPU traffic (data plane, launch layer).

On CPU, gloo carries a collective between two processes of one machine over TCP loopback:
every byte goes through the kernel's socket buffers, in chunks, on gloo's threads. When every
member of a process set can map the same file in ``/dev/shm`` (they run on one host, in one
IPC namespace), its CPU traffic goes through that file instead, the way MPI works inside a
node: the engine's negotiation rounds (:meth:`Ring.allgather_ints`, one barrier), plain
``hvd.allreduce`` calls and the DistributedOptimizer's gradient buckets
(:mod:`hora.torch._shm_ops`, :mod:`hora.torch._arena`).

An allreduce is a reduce-scatter and an allgather in shared memory: each member copies the
slices of its tensor that the others sum into its own slot, sums its own slice (read from its
tensor) and that slice of every other slot into its own slot, and copies every summed slice
back. Each slice is summed by exactly one member and copied by all, so every
member ends with the same bits. The ring is cut into ``NBUF`` buffers used in turn, one per
barrier: a tensor larger than a slot goes in chunks, pipelined so that one barrier separates
the copy-in of a chunk, the sum of the one before and the copy-out of the one before that,
and nothing is overwritten before every member has read it. Members that outnumber the CPUs
they can run on (:mod:`hora.torch._cpus`) take bigger slots: a barrier can cost them a
millisecond, so fewer barriers.

A barrier is a per-rank counter in the segment. Next to it each rank writes what it reduces
(element count, chunk, a checksum of name and dtype, the operation's number), and a flag once
it left an operation early. Members that
reached different tensors all raise TensorMismatchError at the same point, still in step,
instead of summing unrelated bytes; members that drifted an operation apart raise it too,
instead of reading each other's stale slots. A wait spins briefly, yields the CPU, then
sleeps in growing steps, within the group timeout: a member whose process exited is named at
once (RankFailedError), one that never arrives is named at the timeout (CollectiveTimeout).

The segment holds two rings. The first runs its operations in the calling thread, in program
order, which is the same on every member: rounds pair with rounds, buckets are reduced in
``synchronize()``. The second, a *lane* (:mod:`hora.torch._lane`), runs plain
``hvd.allreduce`` data on a thread of its own, in launch order, so that it progresses in the
background as gloo's would.

Used only where it is safe: x86-64 (its store order, plus a locked instruction before each
counter store, makes a rank's data visible before its counter), every member mapped the
segment. Otherwise, or with ``HORA_SHM=off``, everything goes over gloo as before. The
decision is taken together, once per process set (at its first negotiation round or bucket),
on the set's gloo side group. The file is unlinked as soon as every member has mapped it, so
nothing is left in ``/dev/shm`` even when a process is killed.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import mmap
import os
import platform
import signal
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from hora.errors import CollectiveTimeout, HoraError, PeerFailedError, TensorMismatchError
from hora.torch import _cpus, _lane, _shm_ops, _state
from hora.torch._segfile import SHM_DIR, create, open_segment
from hora.torch._stall import run_guarded

log = logging.getLogger(__name__)

LINE = 64  # one counter (and its signatures) per cache line
ALIGN = 4096
NBUF = 3  # buffers used in turn, one per barrier (a chunk is read up to two barriers later)
SPIN = 200  # counter checks before yielding the CPU
YIELDS = 2000  # sched_yield()s before the first sleep
SLEEP_MAX_S = 1e-3
PID_CHECK_S = 0.5
# One ring: NBUF buffers x members x slot. A slot of 4 MiB for 2 ranks (24 MiB a ring), a
# ring never over 24 MiB, so a segment's two rings fit Docker's default /dev/shm (64 MiB);
# a slot never under 256 KiB.
SEGMENT_BUDGET = 24 * 1024 * 1024
SLOT_MAX = 4 * 1024 * 1024
SLOT_MIN = 256 * 1024
# Members that outnumber their CPUs (hora.torch._cpus) can pay a millisecond a barrier: a
# slot of up to 8 MiB, a ring of up to 96 MiB (a segment that /dev/shm cannot hold falls back
# to the sizes above).
CROWDED_BUDGET = 96 * 1024 * 1024
CROWDED_SLOT_MAX = 8 * 1024 * 1024

# The C functions the signal module wraps: its wrappers turn every handler they return into
# an enum member (or fail to, by an exception), 14 us for the three calls an operation makes
# in the main thread against 0.6 us; the handlers set and put back are the same objects.
_SIG: Any = importlib.import_module("_signal")

_FENCE = threading.Lock()
_OPS_MASK = 0xFFFFFF  # the operation number's bits in a signature (it wraps, harmlessly)
_SIGNS = 3  # ints a member signs at each barrier: element count, chunk, name and op number
# In a member's line, after its counter and two sets of signatures: set when it left an
# operation early and the ring is unusable. A flag beside the counter, not a counter value:
# a member that passed a barrier and then aborts (a deadlock found in a round, then init())
# must still count as arrived for a slower member that has not looked at the counter yet.
_ABORTED_AT = 1 + 2 * _SIGNS


def enabled(environ: dict[str, str] | None = None) -> bool:
    """Whether this process offers the shared-memory path (``HORA_SHM``, the CPU, /dev/shm).

    Args:
        environ: the environment to read (default ``os.environ``).

    Returns:
        False when ``HORA_SHM`` is 0/off/false/no, the machine is not x86-64, or there is no
        writable ``/dev/shm``.

    Example:
        >>> enabled({"HORA_SHM": "off"})
        False
    """
    env = os.environ if environ is None else environ
    if env.get("HORA_SHM", "").strip().lower() in ("0", "off", "false", "no"):
        return False
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    return os.path.isdir(SHM_DIR) and os.access(SHM_DIR, os.W_OK)


def host_key(environ: dict[str, str] | None = None) -> str:
    """Which host this rank counts as for shared memory: ``HORA_HOST_KEY``, else the host name.

    Example:
        >>> host_key({"HORA_HOST_KEY": "node7"})
        'node7'
    """
    env = os.environ if environ is None else environ
    return env.get("HORA_HOST_KEY") or socket.gethostname()


def slot_bytes(members: int, crowded: bool = False) -> int:
    """Bytes of one rank's slot in one buffer of the segment, for ``members`` ranks.

    ``crowded``: the members outnumber the CPUs they can run on (bigger slots, fewer barriers).

    Example:
        >>> slot_bytes(2) // 1024, slot_bytes(64) // 1024, slot_bytes(3, crowded=True) // 1024
        (4096, 256, 8192)
    """
    budget, most = (CROWDED_BUDGET, CROWDED_SLOT_MAX) if crowded else (SEGMENT_BUDGET, SLOT_MAX)
    per = budget // (NBUF * max(members, 1))
    per = max(SLOT_MIN, min(most, per))
    return per - per % ALIGN


def header_bytes(members: int) -> int:
    """Bytes of the segment's control part (counters, signatures, pids), page-aligned."""
    raw = LINE * (2 * members + 1)
    return -(-raw // ALIGN) * ALIGN


def ring_bytes(members: int, slot: int | None = None) -> int:
    """Bytes of one ring (control part and buffers) for ``members`` ranks.

    ``slot``: bytes of a slot (:func:`slot_bytes` by default).
    """
    return header_bytes(members) + NBUF * members * (slot or slot_bytes(members))


def segment_bytes(members: int, rings: int = 2, slot: int | None = None) -> int:
    """Bytes of a segment of ``rings`` rings (a set's ring and its lane) for ``members`` ranks."""
    return rings * ring_bytes(members, slot)


def _start_time(pid: int) -> int:
    """The start time of a process (clock ticks since boot); -1 when it exited (or is a zombie)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return -1
    fields = stat[stat.rfind(b")") + 2 :].split()
    if fields[0] in (b"Z", b"X"):  # exited, not yet reaped by its parent
        return -1
    return int(fields[19])


class Ring:
    """One process set's mapped segment on this rank: its barriers and its operations.

    Args:
        mm: the mapped segment.
        ranks: the members' global ranks (slot ``i`` belongs to ``ranks[i]``).
        index: this rank's position in ``ranks``.
        slot: bytes per slot.
        base: where this ring starts in the segment (a lane follows the first ring).
    """

    def __init__(self, mm: mmap.mmap, ranks: list[int], index: int, slot: int,
                 base: int = 0) -> None:
        self.mm, self.ranks, self.index, self.slot = mm, ranks, index, slot
        n = len(ranks)
        self.size = n
        self.header = header_bytes(n)
        self.ctl = memoryview(mm)[base : base + self.header].cast("q")
        step = LINE // 8
        self.counter = [step * (1 + i) for i in range(n)]
        self.pid_cell = [step * (1 + n + i) for i in range(n)]
        self.others = [self.counter[i] for i in range(n) if i != index]
        self.data = torch.frombuffer(mm, dtype=torch.uint8, offset=base + self.header,
                                     count=NBUF * n * slot)
        self.bufs = [[self.data[(b * n + i) * slot : (b * n + i + 1) * slot] for i in range(n)]
                     for b in range(NBUF)]
        # the same slots as int64 memoryviews, for the negotiation tables: a few ints each,
        # which torch's per-op cost would make 14x slower to write and read
        raw = memoryview(mm)
        first = base + self.header
        self.ints = [[raw[first + (b * n + i) * slot : first + (b * n + i + 1) * slot].cast("q")
                      for i in range(n)] for b in range(NBUF)]
        raw.release()
        self.epoch = 0  # barriers passed
        self.seq = 0  # operations started (in the signatures: members an op apart differ)
        self.closed = False
        self.broken = ""  # why this ring cannot be used any more ("" while it can)
        self.interrupted = False  # a SIGINT arrived during an operation (delivered at its end)
        self.stopped = False  # set from another thread: a wait here ends at once
        self.peers: dict[int, tuple[int, int]] = {}  # member index -> (pid, start time)

    @property
    def ops(self) -> int:
        """Barriers passed so far (every operation passes at least one)."""
        return self.epoch

    def next_buffer(self) -> list[torch.Tensor]:
        """The members' slots (uint8) of the buffer written before the next barrier."""
        return self.bufs[(self.epoch + 1) % NBUF]

    def next_ints(self) -> list[memoryview]:
        """The same slots as :meth:`next_buffer`, as int64 memoryviews."""
        return self.ints[(self.epoch + 1) % NBUF]

    # -- set-up -------------------------------------------------------------------------------
    def publish_pid(self) -> None:
        """Write this process's pid and start time where the other members can read them."""
        pid = os.getpid()
        self.ctl[self.pid_cell[self.index]] = (pid << 32) | (_start_time(pid) & 0xFFFFFFFF)

    def read_pids(self) -> None:
        """Remember the members whose process this rank can see (same PID namespace)."""
        for i, cell in enumerate(self.pid_cell):
            if i == self.index:
                continue
            packed = self.ctl[cell]
            pid, start = packed >> 32, packed & 0xFFFFFFFF
            if pid > 0 and (_start_time(pid) & 0xFFFFFFFF) == start:
                self.peers[i] = (pid, start)

    def close(self, abort: bool = False) -> None:
        """Unmap the segment (every view of it is dropped first).

        Args:
            abort: first tell the members (their waits for this rank fail at once), for a
                group that is aborted rather than shut down cleanly.
        """
        if self.closed:
            return
        if abort:
            self.abort()
        self.closed = True
        self.bufs = []
        self.data = torch.empty(0, dtype=torch.uint8)
        for row in self.ints:
            for v in row:
                v.release()
        self.ints = []
        self.ctl.release()
        try:
            self.mm.close()
        except BufferError:  # a view is still referenced (a traceback): freed with it
            log.debug("shared-memory segment still referenced; unmapped when freed")

    # -- operations ---------------------------------------------------------------------------
    def allreduce_(self, t: torch.Tensor, op: str, name: str, reduce: str = "sum",
                   tag: str | None = None, source: torch.Tensor | None = None) -> None:
        """Reduce ``t`` (contiguous, CPU) over the members, in place.

        Args:
            t: the tensor, the same size and dtype on every member.
            op: the public collective's name, for errors.
            name: the tensor's name, checked on every member (errors name it).
            reduce: ``sum``, ``min``, ``max`` or ``product``.
            tag: what is checked instead of ``name`` (negotiated collectives, whose names
                were matched already and which a joined member serves without one).
            source: where the values come from (contiguous, like ``t``); default ``t``.

        Raises:
            CollectiveTimeout: a member did not arrive within the group timeout (named).
            RankFailedError: a member's process exited or left a collective early (named).
            TensorMismatchError: the members reached different tensors (on every member).
        """
        self.run(op, name, _shm_ops.allreduce, self, t, op, name, reduce,
                 name if tag is None else tag, t if source is None else source)

    def broadcast_(self, t: torch.Tensor, op: str, name: str) -> None:
        """Copy member 0's ``t`` (contiguous, CPU) into every member's, in place.

        One barrier per chunk. Raises like :meth:`allreduce_`.
        """
        self.run(op, name, _shm_ops.broadcast, self, t, op, name)

    def allgather_ints(self, mine: list[int], op: str, name: str,
                       what: str = "") -> list[list[int]] | None:
        """Every member's list of ints (the engine's negotiation tables), in member order.

        One barrier: a member writes its list into its slot and reads the others' after it.
        Returns None, on every member alike, when some list does not fit a slot (the caller
        then uses the group). ``what`` names another kind of exchange than a negotiation
        round (``"host updates"``): members signing different kinds raise
        TensorMismatchError. Raises like :meth:`allreduce_`.
        """
        return self.run(op, name, _shm_ops.allgather_ints,  # type: ignore[no-any-return]
                        self, mine, op, name, what)

    def run(self, op: str, name: str, body: Callable[..., Any], *args: Any) -> Any:
        """Run one operation to its end, or leave the ring unusable and tell the members.

        A SIGINT is held until the operation ends (a collective in C++ is deaf to it the same
        way), then delivered to the handler that was there, so an interrupted rank leaves in
        step with the others. A timeout or a dead member ends the operation on every waiting
        member alike (the world is then marked broken, as after a gloo timeout: ``init()``
        starts anew). Anything else that ends it midway on this rank (an unexpected error)
        leaves the ring unusable here and sets this rank's aborted flag, so members
        waiting for it fail at once, naming it; later operations here fail at once too.
        """
        if self.broken:
            raise HoraError(f"{op} {name!r}: {self.broken}; call hvd.shutdown() and hvd.init()")
        if self.closed:
            raise HoraError(f"{op} {name!r}: hora.torch was shut down while this was in flight")
        self.seq += 1
        before = self.hold_sigint()
        try:
            return body(*args)
        except HoraError:  # a timeout, a dead member, a mismatch: every member sees it alike
            raise
        except BaseException as e:  # failed here: only the counter tells the others
            self.abort(f"an earlier collective ({op} {name!r}) ended early on this rank "
                       f"({type(e).__name__})")
            _state.require_init(op).broken = True
            raise
        finally:
            self.put_back_sigint(before)

    def hold_sigint(self) -> Any:
        """In the main thread, make SIGINT only note itself until :meth:`put_back_sigint`.

        Returns the handler to put back (None off the main thread, which never gets SIGINT).
        Holds nest: an inner hold puts back the outer's note, which keeps what it noted.
        """
        if threading.current_thread() is not threading.main_thread():
            return None
        if _SIG.getsignal(signal.SIGINT) is None:  # set outside Python: cannot put it back
            return None
        return _SIG.signal(signal.SIGINT, self._note_sigint)

    def put_back_sigint(self, before: Any) -> None:
        """Put back the handler :meth:`hold_sigint` returned; deliver a SIGINT held meanwhile."""
        if before is not None:
            _SIG.signal(signal.SIGINT, before)
            if self.interrupted:  # delivered now, to whatever handler was there
                self.interrupted = False
                signal.raise_signal(signal.SIGINT)

    def _note_sigint(self, _sig: int, _frame: Any) -> None:
        self.interrupted = True

    def stop(self) -> None:
        """Make a wait in another thread (a lane's) end at once, with HoraError."""
        self.stopped = True

    def abort(self, reason: str = "the process group was aborted") -> None:
        """Make the ring unusable here and tell the members (their waits fail at once)."""
        if not self.broken:
            self.broken = reason
        if not self.closed:
            self.ctl[self.counter[self.index] + _ABORTED_AT] = 1

    # -- barriers -----------------------------------------------------------------------------
    def step(self, op: str, name: str, total: int, start: int, check: int) -> None:
        """Sign, pass the next barrier, and check that every member signed the same.

        Args:
            op: the public collective's name, for errors.
            name: the tensor's name, for errors.
            total: elements of the whole tensor.
            start: the chunk's first element (``total`` once every chunk was written).
            check: a checksum of what the operation is (name, dtype, kind:
                :func:`hora.torch._shm_ops.checksum`).
        """
        sig = check | ((self.seq & _OPS_MASK) << 32)
        at = self.counter[self.index] + 1 + _SIGNS * ((self.epoch + 1) & 1)
        self.ctl[at], self.ctl[at + 1], self.ctl[at + 2] = total, start, sig
        self._barrier(op, name)
        self._check_signs(op, name, (total, start, sig))

    def _check_signs(self, op: str, name: str, mine: tuple[int, int, int]) -> None:
        """Every member sees the same table, so every member raises alike, still in step.

        The signatures have a place per parity of the barrier: a member that has passed
        this barrier and signs the next one never overwrites what a slower member checks.
        """
        ctl, off = self.ctl, 1 + _SIGNS * (self.epoch & 1)
        rows = [(ctl[c + off], ctl[c + off + 1], ctl[c + off + 2]) for c in self.counter]
        if all(r == mine for r in rows):
            return
        what = "; ".join(f"rank {self.ranks[i]}: {r[0]} elements" + (
            f" (chunk at {r[1]})" if r[1] and r[1] < r[0] else "") + f" (operation {r[2] >> 32})"
            for i, r in enumerate(rows))
        raise TensorMismatchError(
            op, name, "members reached different tensors (synchronize optimizers and "
            f"reduce buckets in the same order on every rank): {what}", self.ranks)

    def _barrier(self, op: str, name: str) -> None:
        self.epoch += 1
        e, ctl = self.epoch, self.ctl
        with _FENCE:  # a locked instruction: the data stores above are visible first
            pass
        ctl[self.counter[self.index]] = e
        others = self.others
        for _ in range(SPIN):
            if all(ctl[c] >= e for c in others):
                return
        self._wait(e, op, name)

    def _wait(self, e: int, op: str, name: str) -> None:
        state = _state.require_init(op)
        t0 = time.monotonic()
        deadline = t0 + state.timeout_s
        next_check = t0 + PID_CHECK_S
        ctl, others = self.ctl, self.others
        for _ in range(YIELDS):  # a peer on this CPU, or one about to arrive, goes first
            os.sched_yield()
            if all(ctl[c] >= e for c in others):
                return
        nap = 2e-5
        while True:
            if self._arrived(e, op, name):
                return
            if self.stopped:
                raise HoraError(f"{op} {name!r}: hora.torch was shut down during it")
            now = time.monotonic()
            if now >= next_check:
                self._check_peers(op, name, state)
                next_check = now + PID_CHECK_S
            if now >= deadline:
                missing = [self.ranks[i] for i, c in enumerate(self.counter)
                           if self.ctl[c] < e]
                state.broken = True
                raise CollectiveTimeout(op, missing, state.timeout_s, name=name)
            time.sleep(nap)
            nap = min(nap * 2, SLEEP_MAX_S)

    def _arrived(self, e: int, op: str, name: str) -> bool:
        ctl = self.ctl
        if all(ctl[c] >= e for c in self.others):
            return True
        for i, c in enumerate(self.counter):
            if i != self.index and ctl[c] < e and ctl[c + _ABORTED_AT]:
                _state.require_init(op).broken = True
                raise PeerFailedError(self.ranks[i], detail=(
                    f"it left {op} {name!r} early (interrupted, timed out, or its process "
                    "group was aborted)"))
        return False

    def _check_peers(self, op: str, name: str, state: Any) -> None:
        for i, (pid, start) in self.peers.items():
            if (_start_time(pid) & 0xFFFFFFFF) != start:
                state.broken = True
                raise PeerFailedError(self.ranks[i], detail=(
                    f"its process (pid {pid}) exited during {op} {name!r}"))


def ring_of(comm: Any, op: str, cpus: int | None = None) -> Ring | None:
    """The process set's segment, set up together by its members on the first call.

    For members on one host; :func:`hora.torch._hier.ring_of` is the entry that also
    handles members on several hosts, and tells ``cpus``: how many members can run at once
    (:func:`hora.torch._cpus.at_once`; the members find it out together when it is None).

    Every member must make the first call at the same point (the engine's first round or
    the optimizer's first bucket). Returns None, on every member alike, when any member
    cannot use it. The set-up's collectives run on the side group, within its timeout, and
    fail like any other (CollectiveTimeout or RankFailedError naming the rank).
    """
    if comm.shm_decided:
        return comm.shm  # type: ignore[no-any-return]
    comm.shm_decided = True
    if comm.size < 2 or comm.side is None:
        return None
    n, me = comm.size, comm.index
    if cpus is None:
        rows: list[Any] = [None] * n
        run_guarded(op, "shm", dist.all_gather_object, rows, _cpus.mine(), group=comm.side)
        cpus = _cpus.at_once(rows)
    want = enabled()
    box = [create_for(n, n > cpus) if me == 0 and want else ("", 0)]
    run_guarded(op, "shm", dist.broadcast_object_list, box, src=comm.ranks[0], group=comm.side)
    path, slot = box[0]
    size = segment_bytes(n, slot=slot)
    mm = open_segment(path, size) if (want and path) else None
    ring = Ring(mm, comm.ranks, me, slot) if mm is not None else None
    lane = (Ring(mm, comm.ranks, me, slot, base=ring_bytes(n, slot))
            if mm is not None else None)
    if ring is not None:
        ring.publish_pid()
    flag = torch.tensor([1 if ring is not None else 0], dtype=torch.int64)
    run_guarded(op, "shm", dist.all_reduce, flag, op=dist.ReduceOp.MIN, group=comm.side)
    if me == 0 and path:
        with contextlib.suppress(OSError):
            os.unlink(path)
    if int(flag.item()) == 0:
        for r in (lane, ring):
            if r is not None:
                r.close()
        log.debug("%s: shared memory not usable by every member; gloo carries the buckets", op)
        return None
    assert ring is not None and lane is not None  # noqa: S101  (every member mapped it)
    ring.read_pids()
    lane.peers = ring.peers
    # no member leaves set-up (and may exit) before every member has seen its process
    run_guarded(op, "shm", dist.all_reduce, flag, op=dist.ReduceOp.MIN, group=comm.side)
    comm.shm, comm.shm_lane = ring, _lane.Lane(lane)
    return ring


def create_for(members: int, crowded: bool, rings: int = 2) -> tuple[str, int]:
    """A new segment of ``rings`` rings for ``members``, and its slot size.

    A crowded set's bigger segment where /dev/shm holds it, else the usual one; ``("", 0)``
    when neither fits.
    """
    for slot in dict.fromkeys((slot_bytes(members, crowded), slot_bytes(members))):
        path = create(segment_bytes(members, rings, slot))
        if path:
            return path, slot
    return "", 0
