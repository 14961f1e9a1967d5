"""How a process ended, in words, and how its process group is signalled (data plane, POSIX).

The one vocabulary for a process's end that hora and its service share: a ``Popen.returncode``
(negative: killed by that signal) becomes ``"exit code 3"`` or ``"killed by SIGSEGV
(segmentation fault)"`` (:func:`exit_words`), or the verb phrase ``"exited with code 3"`` /
``"was killed by SIGKILL"`` (:func:`ended`) that follows a subject (``"rank 1 "``). Every
process hora starts leads its own session, so :func:`signal_group` with its pid reaches it and
whatever it forked. Standard library only; the service's container init (started with
``python -I``) keeps a copy of the group signaller that a unit test holds to this one.
"""

from __future__ import annotations

import os
import signal

_NOTES = {"SIGKILL": " (out of memory?)", "SIGSEGV": " (segmentation fault)", "SIGABRT": " (abort)"}


def signal_name(signum: int) -> str:
    """Name a signal number.

    Args:
        signum: the signal number (positive).

    Returns:
        Its name, or ``"signal N"`` for a number the platform does not name.

    Example:
        >>> signal_name(9), signal_name(99)
        ('SIGKILL', 'signal 99')
    """
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def exit_words(code: int) -> str:
    """Describe a process's exit the way a user reads it, with a hint for the usual signals.

    Args:
        code: ``Popen.returncode`` (negative: killed by that signal).

    Returns:
        e.g. ``"exit code 3"``, ``"killed by SIGKILL (out of memory?)"``.

    Example:
        >>> exit_words(3), exit_words(-11)
        ('exit code 3', 'killed by SIGSEGV (segmentation fault)')
    """
    if code >= 0:
        return f"exit code {code}"
    name = signal_name(-code)
    return f"killed by {name}{_NOTES.get(name, '')}"


def ended(code: int) -> str:
    """The verb phrase for a process's exit, to follow its name.

    Args:
        code: ``Popen.returncode`` (negative: killed by that signal).

    Returns:
        ``"exited with code N"`` or ``"was killed by SIGNAME"`` (no hint).

    Example:
        >>> "rank 1 " + ended(3), "rank 0 " + ended(-9)
        ('rank 1 exited with code 3', 'rank 0 was killed by SIGKILL')
    """
    return f"was killed by {signal_name(-code)}" if code < 0 else f"exited with code {code}"


def signal_group(pgid: int, sig: int) -> bool:
    """Send ``sig`` to the process group ``pgid``, ignoring a group that is gone or not ours.

    Args:
        pgid: the group id (the pid of a process that leads its own session; 0: our own group).
        sig: the signal number.

    Returns:
        True when the group still had a member to signal, False when it is empty (or a member
        changed its uid, so nothing may be done).
    """
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        return False
    return True
