"""hora's rendezvous store answers only holders of the launch's secret (hora.torch._authstore).

A real server (a thread, a real socket on 127.0.0.1) and real clients: torch's own
``TCPStore`` client (what the red team used to list a sealed store's keys and ``add()`` to
them), hora's client with another secret, and raw sockets that skip or fake the handshake.
None of them gets a single byte of an answer; a holder of the secret gets the store torch's
process groups expect (set, get waiting for its key, add, compare_set, check, wait with a
timeout, delete, num_keys, clone), and the server goes with the store that hosts it.
"""

from __future__ import annotations

import datetime
import gc
import socket
import threading
import time
from collections.abc import Iterator

import pytest
import torch.distributed as dist
from hora.torch import _authstore
from hora.torch._authstore import MAGIC, AuthStore, StoreServer, pack
from hora.torch._sealed import store_key

KEY = store_key("the launch's secret")
SHORT = datetime.timedelta(seconds=2)


@pytest.fixture
def store() -> Iterator[AuthStore]:
    server = StoreServer(0, KEY)
    hosted = AuthStore("127.0.0.1", server.port, KEY, SHORT, server=server)
    hosted.set("hora/g1/hora/arrived/0", "1")
    yield hosted
    hosted.close()


def _silent(sock: socket.socket) -> bytes:
    """What the server says before it closes the connection (b"" when it says nothing)."""
    sock.settimeout(5)
    data = b""
    try:
        while chunk := sock.recv(4096):
            data += chunk
    except ConnectionResetError:  # closed before it was accepted (a listener's backlog): RST
        pass
    return data


def test_a_tcpstore_client_gets_nothing(store: AuthStore) -> None:
    with pytest.raises((RuntimeError, dist.DistError)):
        outsider = dist.TCPStore("127.0.0.1", store.port, 2, False, timeout=SHORT)
        outsider.list_keys()  # not reached: the client never gets past its own handshake
        outsider.add("hora/g1/hora/arrived/0", 1)
    assert store.get("hora/g1/hora/arrived/0") == b"1" and store.num_keys() == 1


def test_hora_s_client_with_another_secret_is_refused(store: AuthStore) -> None:
    with pytest.raises(dist.DistNetworkError, match="does not hold this launch's"):
        AuthStore("127.0.0.1", store.port, store_key("a guess"), SHORT)


@pytest.mark.parametrize(
    "first",
    [
        _authstore._frame(bytes([_authstore.NUM_KEYS])),  # a request, no handshake
        b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + b"x" * 64,  # something else entirely
    ],
    ids=["request-without-handshake", "http"],
)
def test_a_connection_that_skips_the_handshake_gets_no_byte(store: AuthStore, first: bytes) -> None:
    with socket.create_connection(("127.0.0.1", store.port)) as sock:
        sock.sendall(first)
        assert _silent(sock) == b""


def test_a_wrong_proof_gets_no_answer_to_its_requests(store: AuthStore) -> None:
    with socket.create_connection(("127.0.0.1", store.port)) as sock:
        sock.sendall(MAGIC + b"n" * 16)
        sock.recv(48)  # the server's nonce and its own proof (it proves, it tells nothing)
        request = _authstore._frame(bytes([_authstore.ADD]) + pack(b"k", b"1"))
        sock.sendall(b"\0" * 32 + request)
        assert _silent(sock) == b""
    assert not store.check(["k"])


def test_the_holder_gets_a_whole_store(store: AuthStore) -> None:
    other = store.clone()
    assert store.add("n", 2) == 2 and other.add("n", 3) == 5 and other.get("n") == b"5"
    assert store.compare_set("c", "", "a") == b"a" and store.compare_set("c", "a", "b") == b"b"
    assert store.compare_set("c", "x", "z") == b"b"
    assert store.check(["c", "n"]) and not store.check(["c", "missing"])
    threading.Timer(0.2, lambda: other.set("late", b"v")).start()
    assert store.get("late") == b"v"  # get waits for its key, as a TCPStore's does
    with pytest.raises(dist.DistStoreError, match="timeout"):
        store.wait(["never"], datetime.timedelta(seconds=0.2))
    store.wait(["late", "c"], datetime.timedelta(seconds=1))
    assert store.delete_key("c") and not store.delete_key("c")
    assert store.num_keys() == 3  # arrived/0, n, late
    other.close()


def test_the_server_goes_with_the_store_that_hosts_it() -> None:
    server = StoreServer(0, KEY)
    hosted = AuthStore("127.0.0.1", server.port, KEY, SHORT, server=server)
    watch = socket.create_connection(("127.0.0.1", hosted.port))  # a silent watcher
    port = hosted.port
    del hosted
    gc.collect()
    assert _silent(watch) == b""  # closed, having said nothing
    watch.close()
    deadline = time.monotonic() + 5
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
        except OSError:
            break  # nothing listens any more: the next init() may take the port
        assert time.monotonic() < deadline
        time.sleep(0.05)
