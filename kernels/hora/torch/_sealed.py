"""A rendezvous store sealed with the launch's secret (data plane).

torch's ``TCPStore`` has no authentication: whoever reaches its port can list its keys
(``list_keys`` since torch 2.8), read and overwrite them, and join the world by writing a
rank's arrival and gloo address. :class:`SealedStore` wraps the store of one ``init()`` so
that only a process holding the launch's secret (``HORA_RDZV_SECRET``, see
:mod:`hora.env`) can use it:

* every key is replaced by ``s/`` and an HMAC-SHA256 of it under the secret: a listing shows
  opaque names, and a process without the secret cannot name the key it wants;
* every value is encrypted (an HMAC-SHA256 keystream, its nonce derived from the key and
  the value) and authenticated (an HMAC tag over the key, nonce and ciphertext): a reader
  learns nothing, and a value written without the secret, or copied from another key, is
  refused on reading (:class:`RendezvousForgery`), so a forged arrival or gloo address
  never joins anyone.

Counters (``add``) cannot be sealed (the server adds to them); their names still are.
Sealing alone leaves the server answering anyone (a ``TCPStore`` lists its keys and adds to
them for whoever connects): where hora's ``init()`` hosts the store, it is hora's own
(:mod:`hora.torch._authstore`), which answers only a connection that proves it holds the
secret. What a secret cannot stop on a shared network is a process that races to gloo's
listening port or floods the store's port with connections: that is a denial of service, not
a join, and where hora's service runs the job, its network namespace keeps every other
process off these ports (see the security model in the docs).
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
from typing import Any

import torch.distributed as dist

_NONCE = 16
_TAG = 16


class RendezvousForgery(RuntimeError):
    """A store value failed authentication: it was not written by a rank of this world."""


def store_key(secret: str) -> bytes:
    """The 32-byte key derived from a launch's secret.

    Example:
        >>> len(store_key("s3cret"))
        32
    """
    return hashlib.sha256(b"hora-rendezvous-v1\0" + secret.encode()).digest()


def _mac(key: bytes, *parts: bytes) -> bytes:
    return hmac.new(key, b"".join(parts), hashlib.sha256).digest()


def _stream(key: bytes, nonce: bytes, n: int) -> bytes:
    blocks = (_mac(key, b"s", nonce, i.to_bytes(8, "big")) for i in range(-(-n // 32)))
    return b"".join(blocks)[:n]


def _xor(data: bytes, pad: bytes) -> bytes:
    return (int.from_bytes(data, "big") ^ int.from_bytes(pad, "big")).to_bytes(len(data), "big")


def seal_name(key: bytes, name: str) -> str:
    """The store key under which ``name`` lives.

    Example:
        >>> seal_name(store_key("s"), "hora/arrived/0").startswith("s/")
        True
    """
    return "s/" + _mac(key, b"k", name.encode()).hex()[:32]


def seal(key: bytes, name: str, value: bytes) -> bytes:
    """``value`` encrypted and authenticated for the sealed key ``name``.

    The nonce is derived from the name and the value, so the same value seals the same way
    (``compare_set`` needs that); it reveals only that two values at one key are equal.
    """
    nonce = _mac(key, b"n", name.encode(), b"\0", value)[:_NONCE]
    body = _xor(value, _stream(key, nonce, len(value)))
    return nonce + _mac(key, b"t", name.encode(), b"\0", nonce, body)[:_TAG] + body


def unseal(key: bytes, name: str, blob: bytes) -> bytes:
    """The value sealed in ``blob`` for ``name``.

    Raises:
        RendezvousForgery: the blob was not sealed with this key for this name.
    """
    nonce, tag, body = blob[:_NONCE], blob[_NONCE : _NONCE + _TAG], blob[_NONCE + _TAG :]
    want = _mac(key, b"t", name.encode(), b"\0", nonce, body)[:_TAG]
    if len(blob) < _NONCE + _TAG or not hmac.compare_digest(tag, want):
        raise RendezvousForgery(
            "a rendezvous value failed authentication: a process without this launch's "
            "HORA_RDZV_SECRET wrote to the store (or the ranks were given different secrets)"
        )
    return _xor(body, _stream(key, nonce, len(body)))


def _bytes(value: Any) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


class SealedStore(dist.Store):
    """A store whose keys and values are sealed with a launch's secret (module docstring).

    Example:
        >>> inner = dist.HashStore()
        >>> store = SealedStore(inner, store_key("s3cret"))
        >>> store.set("hora/arrived/0", "1"); store.get("hora/arrived/0")
        b'1'
        >>> any("arrived" in k for k in [seal_name(store_key("s3cret"), "hora/arrived/0")])
        False
    """

    def __init__(self, inner: Any, key: bytes, prefix: str = "") -> None:
        super().__init__()
        self._inner = inner
        self._key = key
        self._prefix = prefix

    def _name(self, name: str) -> str:
        scoped = f"{self._prefix}/{name}" if self._prefix else name  # a PrefixStore's, sealed
        return seal_name(self._key, scoped)

    def set(self, key: str, value: Any) -> None:  # noqa: D102
        name = self._name(key)
        self._inner.set(name, seal(self._key, name, _bytes(value)))

    def get(self, key: str) -> bytes:  # noqa: D102
        name = self._name(key)
        return unseal(self._key, name, self._inner.get(name))

    def add(self, key: str, amount: int) -> int:  # noqa: D102
        return int(self._inner.add(self._name(key), amount))

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:  # noqa: D102
        name = self._name(key)
        old = _bytes(expected)
        sealed_old = seal(self._key, name, old) if old else b""
        got = self._inner.compare_set(name, sealed_old, seal(self._key, name, _bytes(desired)))
        return unseal(self._key, name, got) if got else b""

    def check(self, keys: list[str]) -> bool:  # noqa: D102
        return bool(self._inner.check([self._name(k) for k in keys]))

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:  # noqa: D102
        names = [self._name(k) for k in keys]
        if timeout is None:
            self._inner.wait(names)
        else:
            self._inner.wait(names, timeout)

    def delete_key(self, key: str) -> bool:  # noqa: D102
        return bool(self._inner.delete_key(self._name(key)))

    def num_keys(self) -> int:  # noqa: D102
        return int(self._inner.num_keys())

    def set_timeout(self, timeout: datetime.timedelta) -> None:  # noqa: D102
        self._inner.set_timeout(timeout)

    @property
    def timeout(self) -> datetime.timedelta:  # noqa: D102
        return self._inner.timeout  # type: ignore[no-any-return]

    def clone(self) -> SealedStore:
        """A second connection to the same store, sealed alike (heartbeats use their own)."""
        return SealedStore(self._inner.clone(), self._key, self._prefix)
