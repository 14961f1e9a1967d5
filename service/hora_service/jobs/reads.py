"""Reads of jobs for the API: one job, and pages of them, served from caches.

Each job's JSON is serialised once and kept until the job changes; a page's ids and total
are kept until the next write to any job (the generation that :meth:`ManagerState.forget`
moves on), so a busy list endpoint costs dictionary lookups.
"""

from __future__ import annotations

from hora.spec import JobState

from hora_service.jobs.state import CACHE_MAX, PAGES_MAX, ManagerState
from hora_service.models import JobRecord


class Reads:
    """One job and pages of jobs, as the monitor knows them.

    Args:
        state: the manager's state (its caches, the store, the journal).
    """

    def __init__(self, state: ManagerState) -> None:
        self.state = state

    def get(self, job_id: int) -> JobRecord | None:
        """One job as the monitor knows it (with changes the store has yet to take), or None.

        A session its owner deleted is None at once (its row goes once its engines are gone).
        """
        if job_id in self.state.dropped:
            return None
        hit = self.state.cache.get(job_id)
        if hit is not None:
            return hit[0]
        return self._load([job_id]).get(job_id, (None, b""))[0]

    def records(self, ids: list[int]) -> dict[int, JobRecord]:
        """The jobs with these ids that exist, by id.

        Cached ones as they are; the rest are read from the store in one query (and cached).
        """
        ids = [i for i in ids if i not in self.state.dropped]
        found = {i: hit[0] for i in ids if (hit := self.state.cache.get(i)) is not None}
        missing = [i for i in ids if i not in found]
        if missing:
            found.update((i, record) for i, (record, _) in self._load(missing).items())
        return found

    def list_jobs(
        self, user: str | None, state: JobState | None, limit: int, offset: int
    ) -> tuple[list[JobRecord], int]:
        """A page of jobs (``user=None``: everyone's), newest first, and the total."""
        page, total = self._page(user, state, limit, offset)
        return [record for record, _ in page], total

    def list_json(self, user: str | None, state: JobState | None, limit: int, offset: int) -> bytes:
        """The same page as :meth:`list_jobs`, as the JSON body of ``GET /v1/jobs``.

        Each job's JSON is serialised once and cached until the job changes, and a page's ids
        and total are reused until the next write, so a busy list endpoint costs dictionary
        lookups and a join of bytes. A page ends early when it would pass
        ``max_page_bytes``; ``next_offset`` is where the next page starts (null at the end).
        """
        page, total = self._page(user, state, limit, offset)
        bodies: list[bytes] = []
        size = 0
        for _, body in page:  # a page stops before max_page_bytes (always one job at least)
            if bodies and size + len(body) + 1 > self.state.settings.max_page_bytes:
                break
            bodies.append(body)
            size += len(body) + 1
        after = offset + len(bodies)
        more = "null" if after >= total else str(after)
        items = b",".join(bodies)
        tail = f'],"total":{total},"limit":{limit},"offset":{offset},"next_offset":{more}}}'
        return b'{"items":[' + items + tail.encode()

    def _page(
        self, user: str | None, state: JobState | None, limit: int, offset: int
    ) -> tuple[list[tuple[JobRecord, bytes]], int]:
        key = (user, state, limit, offset)
        generation = self.state.generation
        memo = self.state.pages.get(key)
        if memo is not None and memo[0] == generation:
            ids, total = memo[1], memo[2]
        else:  # a page read is reused until the next write to any job
            hidden = list(self.state.dropped)  # deleted sessions whose rows are still there
            ids, total = self.state.open_store().list_ids(user, state, limit, offset, hidden)
            with self.state.cache_lock:
                if len(self.state.pages) > PAGES_MAX:
                    self.state.pages.clear()
                self.state.pages[key] = (generation, ids, total)
        found = {i: hit for i in ids if (hit := self.state.cache.get(i)) is not None}
        if len(found) < len(ids):
            found.update(self._load([i for i in ids if i not in found]))
        return [found[i] for i in ids if i in found], total

    def _load(self, ids: list[int]) -> dict[int, tuple[JobRecord, bytes]]:
        """Read jobs from the store and cache them unless one changed meanwhile."""
        generation = self.state.generation
        records = self.state.open_store().records(ids)
        if len(self.state.journal):
            records = {i: self.state.journal.overlay(r) for i, r in records.items()}
        loaded = {i: (record, record.model_dump_json().encode()) for i, record in records.items()}
        with self.state.cache_lock:
            if generation == self.state.generation:  # no write since the read began
                if len(self.state.cache) + len(loaded) > CACHE_MAX:
                    self.state.cache.clear()
                self.state.cache.update(loaded)
        return loaded
