"""A user's API token never starts with ``-``, so it can follow ``--token`` on a command line
(one in 64 did, and ``hora jobs --token TOKEN`` then failed: "expected one argument")."""

from __future__ import annotations

from hora_service.users.registry import new_token


def test_no_token_of_thousands_starts_with_a_dash_and_they_differ() -> None:
    tokens = [new_token() for _ in range(3000)]  # the old draw: ~47 would start with "-"
    assert not [t for t in tokens if t.startswith("-")]
    assert len(set(tokens)) == len(tokens)
    assert all(len(t) == 43 for t in tokens)  # 32 bytes, URL-safe base64, no padding

