"""A rendezvous store that answers only processes holding the launch's secret (data plane).

torch's ``TCPStore`` answers whoever connects: with the keys and values sealed
(:mod:`hora.torch._sealed`) an outsider can neither read a value nor join, but its server
still lists the (opaque) keys, adds to them, deletes and overwrites them. Where a launcher
gave the ranks a secret (``HORA_RDZV_SECRET``), rank 0 hosts this store instead, and every
connection must first prove it holds the secret; one that does not is closed without a
single answer, so a process without the secret can neither list, read, write, add, wait on
nor delete anything. Values stay sealed on top, so the wire carries nothing readable.

The wire (integers big-endian):

* the client speaks first, ``MAGIC`` and a 16-byte nonce ``Nc`` (a plain connection that
  says nothing, such as ``shutdown()``'s watch of rank 0, hears nothing until the server
  closes);
* the server answers its own nonce ``Ns`` and ``HMAC(key, "server" Nc Ns)``: the client
  knows it reached a holder of the secret, not a process squatting on the port;
* the client proves itself with ``HMAC(key, "client" Ns Nc)``; a wrong proof closes the
  connection. The two labels differ, so neither side's answer can be replayed as the other's;
* then requests and replies, each a ``u32`` length and a body: an operation byte and
  length-prefixed fields; a reply's first byte says ``OK``, ``TIMEOUT`` or ``ERROR``.

:class:`StoreServer` is one thread in rank 0's process (``selectors``: idle connections
cost nothing, a ``wait`` parks its connection until its keys exist or its deadline passes).
:class:`AuthStore` is a ``torch.distributed.Store`` any rank uses (gloo and NCCL call it like
a ``TCPStore``); rank 0's owns the server, which closes when that store is collected, as a
``TCPStore`` server does.
"""

from __future__ import annotations

import datetime
import errno
import hashlib
import hmac
import os
import secrets
import selectors
import socket
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

MAGIC = b"HORA-RDZV1"
_NONCE = 16
_MAC = 32
_LEN = 4
MAX_FRAME = 1 << 30  # a request body (the ranks hold the secret: this guards only mistakes)
PREAUTH_MAX = 512  # connections yet to prove themselves; beyond, the oldest is dropped
_POLL_S = 0.005  # connect retry while rank 0 is not listening yet (doubles up to 0.1 s)
_MARGIN_S = 5.0  # a blocking request's socket waits this much past its own deadline

SET, GET, ADD, CAS, CHECK, WAIT, DELETE, NUM_KEYS = range(1, 9)
OK, TIMEOUT, ERROR = 0, 1, 2


def auth_key(store_key: bytes) -> bytes:
    """The key the handshake proves, derived from the store's key (its own label).

    Example:
        >>> len(auth_key(b"k" * 32))
        32
    """
    return hmac.new(store_key, b"hora-rendezvous-auth-v1", hashlib.sha256).digest()


def _mac(key: bytes, label: bytes, *parts: bytes) -> bytes:
    return hmac.new(key, label + b"".join(parts), hashlib.sha256).digest()


def pack(*fields: bytes) -> bytes:
    """Length-prefixed fields.

    Example:
        >>> unpack(pack(b"a", b"", b"bc"))
        [b'a', b'', b'bc']
    """
    return b"".join(len(f).to_bytes(_LEN, "big") + f for f in fields)


def unpack(data: bytes) -> list[bytes]:
    """The fields :func:`pack` wrote.

    Raises:
        ValueError: the data is not a sequence of length-prefixed fields.
    """
    out, at = [], 0
    while at < len(data):
        n = int.from_bytes(data[at : at + _LEN], "big")
        at += _LEN
        if at + n > len(data):
            raise ValueError("truncated field")
        out.append(data[at : at + n])
        at += n
    return out


def _frame(body: bytes) -> bytes:
    return len(body).to_bytes(_LEN, "big") + body


# --- the server ---------------------------------------------------------------------------


@dataclass(eq=False)
class _Conn:
    sock: socket.socket
    since: float
    inbuf: bytearray = field(default_factory=bytearray)
    out: bytearray = field(default_factory=bytearray)
    client_nonce: bytes = b""
    server_nonce: bytes = b""
    ready: bool = False  # proved itself
    parked: tuple[int, list[bytes], float] | None = None  # (op, keys, deadline)


class StoreServer:
    """The store's server, one thread in rank 0's process (see the module docstring).

    Args:
        port: where to listen (0: a free port); on every interface, as a ``TCPStore``.
        key: the store's key (:func:`hora.torch._sealed.store_key` of the secret).

    Raises:
        OSError: the port cannot be bound (``EADDRINUSE``: another process holds it).
    """

    def __init__(self, port: int, key: bytes) -> None:
        self._key = auth_key(key)
        self._data: dict[bytes, bytes] = {}
        self._conns: dict[socket.socket, _Conn] = {}
        self._pid = os.getpid()
        self._listener = _listen(port)
        self.port = int(self._listener.getsockname()[1])
        self._wake_r, self._wake_w = socket.socketpair()
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._listener, selectors.EVENT_READ, "accept")
        self._sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="hora-rdzv-store", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop listening, drop every connection, end the thread (idempotent)."""
        if self._closing or os.getpid() != self._pid:  # a forked child's copy is not ours
            return
        self._closing = True
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=5.0)

    # the loop -------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._closing:
                for sel_key, events in self._sel.select(self._next_deadline()):
                    self._event(sel_key, events)
                self._expire(time.monotonic())
        finally:
            self._shut()

    def _shut(self) -> None:
        self._sel.unregister(self._listener)
        self._listener.close()  # the port is free before the connections drop
        for conn in list(self._conns.values()):
            self._drop(conn)
        self._sel.close()
        self._wake_r.close()
        self._wake_w.close()

    def _event(self, sel_key: selectors.SelectorKey, events: int) -> None:
        if sel_key.data == "accept":
            self._accept()
        elif sel_key.data == "wake":
            self._wake_r.recv(64)
        else:
            conn = sel_key.data
            if events & selectors.EVENT_WRITE:
                self._flush(conn)
            if events & selectors.EVENT_READ and conn.sock in self._conns:
                self._read(conn)

    def _accept(self) -> None:
        try:
            sock, _ = self._listener.accept()
        except OSError:
            return
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn = _Conn(sock, time.monotonic())
        self._conns[sock] = conn
        self._sel.register(sock, selectors.EVENT_READ, conn)
        waiting = [c for c in self._conns.values() if not c.ready]
        if len(waiting) > PREAUTH_MAX:
            self._drop(min(waiting, key=lambda c: c.since))

    def _drop(self, conn: _Conn) -> None:
        self._conns.pop(conn.sock, None)
        try:
            self._sel.unregister(conn.sock)
        except (KeyError, ValueError):
            pass
        conn.sock.close()

    def _read(self, conn: _Conn) -> None:
        try:
            chunk = conn.sock.recv(1 << 16)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            chunk = b""
        if not chunk:
            self._drop(conn)
            return
        conn.inbuf += chunk
        if self._handshake(conn):
            self._process(conn)

    def _process(self, conn: _Conn) -> None:
        """Serve the whole requests buffered, one at a time (a parked one holds the rest)."""
        while conn.parked is None and len(conn.inbuf) >= _LEN and conn.sock in self._conns:
            n = int.from_bytes(conn.inbuf[:_LEN], "big")
            if n > MAX_FRAME or n == 0:
                self._drop(conn)
                return
            if len(conn.inbuf) < _LEN + n:
                return
            body = bytes(conn.inbuf[_LEN : _LEN + n])
            del conn.inbuf[: _LEN + n]
            self._request(conn, body)

    def _handshake(self, conn: _Conn) -> bool:
        """Advance the handshake with what arrived; True once the connection proved itself."""
        if conn.ready:
            return True
        if not conn.client_nonce:
            said = bytes(conn.inbuf[: len(MAGIC)])
            if not MAGIC.startswith(said):  # another protocol (a TCPStore client): no answer
                self._drop(conn)
                return False
            hello = len(MAGIC) + _NONCE
            if len(conn.inbuf) < hello:
                return False
            conn.client_nonce = bytes(conn.inbuf[len(MAGIC) : hello])
            del conn.inbuf[:hello]
            conn.server_nonce = secrets.token_bytes(_NONCE)
            proof = _mac(self._key, b"server", conn.client_nonce, conn.server_nonce)
            self._send(conn, conn.server_nonce + proof)
        if len(conn.inbuf) < _MAC:
            return False
        want = _mac(self._key, b"client", conn.server_nonce, conn.client_nonce)
        if not hmac.compare_digest(bytes(conn.inbuf[:_MAC]), want):
            self._drop(conn)  # no answer at all to a process without the secret
            return False
        del conn.inbuf[:_MAC]
        conn.ready = True
        return True

    def _send(self, conn: _Conn, data: bytes) -> None:
        conn.out += data
        self._flush(conn)

    def _flush(self, conn: _Conn) -> None:
        try:
            sent = conn.sock.send(conn.out) if conn.out else 0
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError:
            self._drop(conn)
            return
        del conn.out[:sent]
        events = selectors.EVENT_READ | (selectors.EVENT_WRITE if conn.out else 0)
        self._sel.modify(conn.sock, events, conn)

    def _reply(self, conn: _Conn, status: int, *fields: bytes) -> None:
        self._send(conn, _frame(bytes([status]) + pack(*fields)))

    # requests ---------------------------------------------------------------------------

    def _request(self, conn: _Conn, body: bytes) -> None:
        try:
            op, args = body[0], unpack(body[1:])
            self._apply(conn, op, args)
        except (ValueError, IndexError) as e:
            self._reply(conn, ERROR, f"bad request: {e}".encode())

    def _apply(self, conn: _Conn, op: int, args: list[bytes]) -> None:
        data = self._data
        if op == SET:
            data[args[0]] = args[1]
            self._reply(conn, OK)
            self._unpark()
        elif op == ADD:
            now = int(data.get(args[0], b"0")) + int(args[1])
            data[args[0]] = str(now).encode()
            self._reply(conn, OK, data[args[0]])
            self._unpark()
        elif op == CAS:
            self._compare_set(conn, *args[:3])
        elif op == CHECK:
            self._reply(conn, OK, b"1" if all(k in data for k in args) else b"0")
        elif op == DELETE:
            self._reply(conn, OK, b"1" if data.pop(args[0], None) is not None else b"0")
        elif op == NUM_KEYS:
            self._reply(conn, OK, str(len(data)).encode())
        elif op in (GET, WAIT):
            deadline = time.monotonic() + int(args[0]) / 1000
            conn.parked = (op, args[1:], deadline)
            self._answer_parked(conn, time.monotonic())
        else:
            raise ValueError(f"unknown operation {op}")

    def _compare_set(self, conn: _Conn, key: bytes, expected: bytes, desired: bytes) -> None:
        current = self._data.get(key)
        if current is None and not expected or current == expected:
            self._data[key] = desired
            self._reply(conn, OK, desired)
            self._unpark()
        else:
            self._reply(conn, OK, expected if current is None else current)

    def _answer_parked(self, conn: _Conn, now: float) -> None:
        assert conn.parked is not None
        op, keys, deadline = conn.parked
        if all(k in self._data for k in keys):
            conn.parked = None
            self._reply(conn, OK, *([self._data[keys[0]]] if op == GET else []))
        elif now >= deadline:
            conn.parked = None
            self._reply(conn, TIMEOUT)
        else:
            return
        self._process(conn)  # a request sent behind the parked one

    def _unpark(self) -> None:
        now = time.monotonic()
        for conn in [c for c in self._conns.values() if c.parked is not None]:
            self._answer_parked(conn, now)

    def _expire(self, now: float) -> None:
        for conn in [c for c in self._conns.values() if c.parked is not None]:
            if now >= conn.parked[2]:  # type: ignore[index]
                self._answer_parked(conn, now)

    def _next_deadline(self) -> float | None:
        deadlines = [c.parked[2] for c in self._conns.values() if c.parked is not None]
        return max(0.0, min(deadlines) - time.monotonic()) if deadlines else None


def _listen(port: int) -> socket.socket:
    """A listening socket on every interface (IPv6 and IPv4 where the host has IPv6)."""
    if socket.has_dualstack_ipv6():
        try:
            return socket.create_server(
                ("", port), family=socket.AF_INET6, dualstack_ipv6=True, backlog=1024
            )
        except OSError as e:
            if e.errno not in (errno.EAFNOSUPPORT, errno.EADDRNOTAVAIL):
                raise
    return socket.create_server(("", port), backlog=1024)


# --- the client ---------------------------------------------------------------------------


class AuthStore(dist.Store):
    """A ``torch.distributed.Store`` on a :class:`StoreServer` (see the module docstring).

    Args:
        host: the server's address.
        port: its port.
        key: the store's key (:func:`hora.torch._sealed.store_key` of the secret).
        timeout: how long a request (and connecting) may take; ``get`` and ``wait`` wait for
            their keys that long.
        server: rank 0's server, closed when this store is collected.

    Raises:
        torch.distributed.DistNetworkError: nothing holding the secret answered in time.

    Example:
        >>> server = StoreServer(0, b"k" * 32)
        >>> store = AuthStore("127.0.0.1", server.port, b"k" * 32, server=server)
        >>> store.set("a", b"1"); store.get("a"), store.add("n", 2)
        (b'1', 2)
    """

    def __init__(
        self,
        host: str,
        port: int,
        key: bytes,
        timeout: datetime.timedelta = datetime.timedelta(seconds=300),
        server: StoreServer | None = None,
    ) -> None:
        super().__init__()
        self.host, self.port = host, int(port)
        self._key = key
        self._timeout = timeout
        self._lock = threading.Lock()
        self._server = server
        if server is not None:
            weakref.finalize(self, server.close)
        self._sock: socket.socket | None = _connect(host, self.port, auth_key(key), timeout)

    def _call(self, op: int, *fields: bytes, wait_s: float | None = None) -> list[bytes]:
        """Send one request and read its reply; ``wait_s``: the server parks it that long."""
        budget = self._timeout.total_seconds() if wait_s is None else wait_s + _MARGIN_S
        with self._lock:
            sock = self._sock
            if sock is None:
                raise dist.DistNetworkError(f"{self._where()}: the store was closed")
            try:
                sock.settimeout(budget)
                sock.sendall(_frame(bytes([op]) + pack(*fields)))
                body = _recv_frame(sock)
            except TimeoutError:
                raise dist.DistStoreError(
                    f"{self._where()}: no answer within {budget:g}s"
                ) from None
            except OSError as e:
                raise dist.DistNetworkError(f"{self._where()}: {e}") from None
        status, values = body[0], unpack(body[1:])
        if status == TIMEOUT:
            raise dist.DistStoreError(f"{self._where()}: wait timeout after {wait_s:g}s")
        if status == ERROR:
            raise dist.DistStoreError(f"{self._where()}: {values[0].decode(errors='replace')}")
        return values

    def _where(self) -> str:
        return f"rendezvous store {self.host}:{self.port}"

    def set(self, key: str, value: Any) -> None:  # noqa: D102
        self._call(SET, key.encode(), _bytes(value))

    def get(self, key: str) -> bytes:  # noqa: D102
        wait_s = self._timeout.total_seconds()
        return self._call(GET, _ms(wait_s), key.encode(), wait_s=wait_s)[0]

    def add(self, key: str, amount: int) -> int:  # noqa: D102
        return int(self._call(ADD, key.encode(), str(int(amount)).encode())[0])

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:  # noqa: D102
        return self._call(CAS, key.encode(), _bytes(expected), _bytes(desired))[0]

    def check(self, keys: list[str]) -> bool:  # noqa: D102
        return self._call(CHECK, *(k.encode() for k in keys))[0] == b"1"

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:  # noqa: D102
        wait_s = (timeout or self._timeout).total_seconds()
        self._call(WAIT, _ms(wait_s), *(k.encode() for k in keys), wait_s=wait_s)

    def delete_key(self, key: str) -> bool:  # noqa: D102
        return self._call(DELETE, key.encode())[0] == b"1"

    def num_keys(self) -> int:  # noqa: D102
        return int(self._call(NUM_KEYS)[0])

    def set_timeout(self, timeout: datetime.timedelta) -> None:  # noqa: D102
        self._timeout = timeout

    @property
    def timeout(self) -> datetime.timedelta:  # noqa: D102
        return self._timeout

    def clone(self) -> AuthStore:
        """A second connection to the same server (it does not own the server)."""
        return AuthStore(self.host, self.port, self._key, self._timeout)

    def close(self) -> None:
        """Drop this connection (and stop rank 0's server, on the store that owns it)."""
        with self._lock:
            sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()
        if self._server is not None:
            self._server.close()


def _ms(seconds: float) -> bytes:
    return str(max(0, int(min(seconds, 1e9) * 1000))).encode()


def _bytes(value: Any) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    data = bytearray()
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionResetError("the server closed the connection")
        data += chunk
    return bytes(data)


def _recv_frame(sock: socket.socket) -> bytes:
    n = int.from_bytes(_recv_exactly(sock, _LEN), "big")
    if n == 0 or n > MAX_FRAME:
        raise ConnectionResetError(f"a reply of {n} bytes")
    return _recv_exactly(sock, n)


def _connect(host: str, port: int, key: bytes, timeout: datetime.timedelta) -> socket.socket:
    """Connect (retrying until ``timeout`` while nothing listens) and authenticate both ways.

    Raises:
        torch.distributed.DistNetworkError: no server in time, or it does not hold the secret.
    """
    timeout_s = timeout.total_seconds()
    deadline = time.monotonic() + timeout_s
    delay = _POLL_S
    while True:
        try:
            sock = socket.create_connection((host, port), timeout=max(0.1, min(5.0, timeout_s)))
            break
        except OSError as e:
            if time.monotonic() > deadline:
                raise dist.DistNetworkError(
                    f"rendezvous store {host}:{port}: nothing answered within {timeout_s:g}s ({e})"
                ) from None
            time.sleep(delay)
            delay = min(2 * delay, 0.1)
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.settimeout(max(0.1, deadline - time.monotonic()))
        _prove(sock, key, f"{host}:{port}")
    except BaseException:
        sock.close()
        raise
    return sock


def _prove(sock: socket.socket, key: bytes, where: str) -> None:
    mine = secrets.token_bytes(_NONCE)
    try:
        sock.sendall(MAGIC + mine)
        answer = _recv_exactly(sock, _NONCE + _MAC)
    except OSError as e:
        raise dist.DistNetworkError(
            f"rendezvous store {where} closed the connection while authenticating ({e}): "
            "it is not this launch's store"
        ) from None
    theirs, proof = answer[:_NONCE], answer[_NONCE:]
    if not hmac.compare_digest(proof, _mac(key, b"server", mine, theirs)):
        raise dist.DistNetworkError(
            f"rendezvous store {where}: the process listening there does not hold this "
            "launch's HORA_RDZV_SECRET (another program took the port, or the ranks were "
            "given different secrets)"
        )
    sock.sendall(_mac(key, b"client", theirs, mine))
