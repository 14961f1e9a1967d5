"""An interrupt during the request that creates a notebook's session is held until its answer
is kept (hora.engines.session_launcher.interrupt_after).

Real signals to this process: a SIGINT (what Jupyter's interrupt sends to a local kernel)
inside the block does not cut it short; it is raised as KeyboardInterrupt once the block
ends, and the handler that was there before is back. Without the hold, an interrupt between
the service queueing the session and the kernel reading the answer left the session queued
on the service, unknown to the kernel, until its lease ran out (seen once in CI's
``test_ctrl_c_while_queued_withdraws_the_request``).
"""

from __future__ import annotations

import os
import signal
import threading

import pytest
from hora.engines.session_launcher import interrupt_after


def _interrupt_here() -> None:
    os.kill(os.getpid(), signal.SIGINT)  # delivered at once: Python runs the handler next


def test_an_interrupt_in_the_block_is_raised_after_it() -> None:
    before = signal.getsignal(signal.SIGINT)
    steps = []
    with pytest.raises(KeyboardInterrupt):
        with interrupt_after():
            _interrupt_here()
            steps.append("answer kept")
    assert steps == ["answer kept"]
    assert signal.getsignal(signal.SIGINT) is before


def test_no_interrupt_no_error_and_the_handler_is_back() -> None:
    before = signal.getsignal(signal.SIGINT)
    with interrupt_after():
        pass
    assert signal.getsignal(signal.SIGINT) is before
    with pytest.raises(KeyboardInterrupt):  # the usual handler again: raises at once
        _interrupt_here()


def test_an_error_from_the_block_goes_out_and_the_handler_is_back() -> None:
    before = signal.getsignal(signal.SIGINT)
    with pytest.raises(ValueError, match="refused"):
        with interrupt_after():
            _interrupt_here()
            raise ValueError("the service refused")
    assert signal.getsignal(signal.SIGINT) is before


def test_outside_the_main_thread_it_holds_nothing() -> None:
    seen: list[object] = []

    def body() -> None:
        with interrupt_after():
            seen.append(signal.getsignal(signal.SIGINT))

    before = signal.getsignal(signal.SIGINT)
    t = threading.Thread(target=body)
    t.start()
    t.join(timeout=10)
    assert seen == [before]
