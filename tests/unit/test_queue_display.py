"""``%dist_start``'s queue display keeps the last place it showed until the slots are granted.

A CI run caught the cell ending on a bare "session 3 queued": between the job that held the
slots ending and the session starting, the service still calls the session queued but gives it
no place (``queue`` is None), and that answer replaced "queued: position 1" in place.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest
from hora.magics_display import QueueDisplay
from hora.spec import QueueInfo, SessionInfo


def info(queue: QueueInfo | None) -> SessionInfo:
    return SessionInfo(id=3, user="bob", name="s", state="queued", workers=1, slots=[],
                       created_at=datetime.now(UTC), lease_s=30, queue=queue)  # fmt: skip


def place(position: int) -> QueueInfo:
    return QueueInfo(position=position, need=1, free=0, holders=[], reason="waiting for 1 slot")


def test_a_place_is_not_replaced_by_a_queued_session_without_one(
    capsys: pytest.CaptureFixture[str],
) -> None:
    shown = QueueDisplay()
    shown.update(info(place(2)))
    shown.update(info(place(1)))
    shown.update(info(None))  # the slots are being handed over
    out = capsys.readouterr().out
    assert "session 3 queued: position 2" in out and "session 3 queued: position 1" in out, out
    assert out.rstrip().splitlines()[-1].startswith("session 3 queued: position 1"), out


def test_a_session_without_a_place_yet_is_still_shown(capsys: Any) -> None:
    shown = QueueDisplay()
    shown.update(info(None))
    assert capsys.readouterr().out.strip() == "session 3 queued"
