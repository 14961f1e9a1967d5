"""An interrupt during the request that creates a notebook's session is held until its answer
is kept (hora.engines.session_launcher.interrupt_after).

Real signals to this process, with Python's own SIGINT handler installed (a kernel's, which
raises KeyboardInterrupt): a SIGINT (what Jupyter's interrupt sends to a local kernel) inside
the block does not cut it short; it reaches that handler once the block ends, and the handler
is back. Where SIGINT is ignored (CI runs the unit tests so), it stays ignored. Without the
hold, an interrupt between the service queueing the session and the kernel reading the answer
left the session queued on the service, unknown to the kernel, until its lease ran out (seen
once in CI's ``test_ctrl_c_while_queued_withdraws_the_request``).
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator

import pytest
from hora.engines.session_launcher import interrupt_after


@pytest.fixture(autouse=True)
def _python_handler() -> Iterator[None]:
    """Python's default SIGINT handler for the test, whatever this process had before."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)


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


def test_where_sigint_is_ignored_it_stays_ignored() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    with interrupt_after():
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
        _interrupt_here()
    assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
