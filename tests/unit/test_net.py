"""hora.net.free_port: rendezvous ports come from below the OS's ephemeral range."""

from __future__ import annotations

import os
import select
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from hora import net


def test_a_free_port_lies_below_the_ephemeral_range_and_binds() -> None:
    low = net._ephemeral_low()
    if low - net._LISTEN_PORTS_LOW < 1000:
        pytest.fail(f"this machine's ephemeral range starts at {low}: the test needs >= 21000")
    ports = {net.free_port() for _ in range(20)}
    assert all(net._LISTEN_PORTS_LOW <= p < low for p in ports), ports
    assert len(ports) > 1, "the ports are drawn at random, not one fixed port"
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports.pop()))  # free: it binds


def test_a_taken_port_is_never_returned(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        port = taken.getsockname()[1]
        taken.listen()
        draws = iter([port, port])
        real = net.random.randrange
        monkeypatch.setattr(net.random, "randrange", lambda a, b: next(draws, None) or real(a, b))
        monkeypatch.setattr(net, "_ephemeral_low", lambda: 65535)
        monkeypatch.setattr(net, "_LISTEN_PORTS_LOW", 1024)
        got = net.free_port()
        assert got != port


def test_without_room_below_the_ephemeral_range_the_os_picks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(net, "_ephemeral_low", lambda: net._LISTEN_PORTS_LOW + 10)
    port = net.free_port()
    assert 0 < port < 65536


@pytest.mark.parametrize("content", [None, "", "not a number\n"])
def test_an_unreadable_range_falls_back_to_linuxs_default(
    tmp_path: Path, content: str | None
) -> None:
    where = tmp_path / "ip_local_port_range"
    if content is not None:
        where.write_text(content)
    assert net._ephemeral_low(str(where)) == 32768
    where.write_text("40000\t60999\n")
    assert net._ephemeral_low(str(where)) == 40000


_DRAW = """
import random, sys
from hora import net
real, forced = random.randrange, iter([int(sys.argv[1])])
random.randrange = lambda a, b: next(forced, None) or real(a, b)
print(net.free_port(), flush=True)
sys.stdin.readline()  # stay alive (and keep the claim) until told
"""


def _drawing(port: int) -> subprocess.Popen[str]:
    """Another process whose first draw is forced to try ``port`` (0: a draw at random); it
    prints what it got."""
    return subprocess.Popen(
        [sys.executable, "-c", _DRAW, str(port)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": str(Path(net.__file__).parents[1])},
    )  # fmt: skip


def _forced(monkeypatch: pytest.MonkeyPatch, *ports: int) -> None:
    draws, real = iter(ports), net.random.randrange
    monkeypatch.setattr(net.random, "randrange", lambda a, b: next(draws, None) or real(a, b))


def test_a_port_drawn_anywhere_is_not_drawn_again_while_its_claim_lasts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # a port is bound seconds after it is drawn (the controller's, a job's MASTER_PORT): a
    # second draw meanwhile, in this process or another (the service and a notebook kernel
    # on one machine), must not give it again; CI saw both binds race for one port
    monkeypatch.setattr(net, "_CLAIMS", {})
    first = net.free_port()
    _forced(monkeypatch, first)
    assert net.free_port() != first  # this process
    other = _drawing(first)
    got, _ = other.communicate("\n", timeout=30)
    assert int(got) != first  # another process
    with socket.socket() as s:
        s.bind(("127.0.0.1", first))  # it was free all along: only the claim refused it
    other = _drawing(0)
    try:
        assert other.stdout is not None
        ready, _, _ = select.select([other.stdout], [], [], 30)
        assert ready, "the other process printed no port within 30 s"
        theirs = int(other.stdout.readline())
        _forced(monkeypatch, theirs)
        assert net.free_port() != theirs  # claimed by a live process elsewhere
    finally:
        other.communicate("\n", timeout=30)
    _forced(monkeypatch, theirs)
    assert net.free_port() == theirs  # the claim went with the process
    monkeypatch.setattr(net.time, "monotonic", lambda: 1e12)  # long after: drawn again
    _forced(monkeypatch, first)
    assert net.free_port() == first


def test_where_no_claim_can_be_made_the_probe_alone_decides(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(net, "_CLAIMS", {})
    monkeypatch.setattr(net, "_CLAIM_PREFIX", "\0" + "x" * 200)  # too long: bind refuses it
    port = net.free_port()
    assert net._LISTEN_PORTS_LOW <= port < net._ephemeral_low() and net._CLAIMS == {}
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


def test_where_unix_sockets_are_refused_the_probe_alone_decides(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A sandbox that refuses AF_UNIX sockets (seccomp, a restricted container): stood in for
    here, since this machine allows them; the draw still hands out a free port."""
    real = socket.socket

    def refusing(family: int = socket.AF_INET, *args: object, **kwargs: object) -> socket.socket:
        if family == socket.AF_UNIX:
            raise PermissionError(1, "Operation not permitted")
        return real(family, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(net, "_CLAIMS", {})
    monkeypatch.setattr(net.socket, "socket", refusing)
    port = net.free_port()
    assert net._LISTEN_PORTS_LOW <= port < net._ephemeral_low() and net._CLAIMS == {}
    with real() as s:
        s.bind(("127.0.0.1", port))


def test_claims_beyond_the_cap_let_go_of_the_oldest(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(net, "_CLAIMS", {})
    monkeypatch.setattr(net, "_CLAIMS_MAX", 2)
    ports = [net.free_port() for _ in range(3)]
    assert sorted(net._CLAIMS) == sorted(ports[1:])
    _forced(monkeypatch, ports[0])
    assert net.free_port() == ports[0]  # its claim was let go: drawn again


def test_a_held_port_is_refused_to_other_draws_but_binds_for_the_process_it_is_for() -> None:
    import zmq

    hold = net.hold_ports(3)
    assert len(set(hold.ports)) == 3
    probe = "import socket, sys; socket.socket().bind(('127.0.0.1', int(sys.argv[1])))"
    other = subprocess.run([sys.executable, "-c", probe, str(hold.ports[0])], capture_output=True)
    assert b"Address already in use" in other.stderr  # free_port's probe elsewhere fails
    ctx = zmq.Context()
    try:
        server = ctx.socket(zmq.ROUTER)
        server.bind(f"tcp://127.0.0.1:{hold.ports[1]}")  # the controller binds and listens
        client = ctx.socket(zmq.DEALER)
        client.connect(f"tcp://127.0.0.1:{hold.ports[1]}")
        client.send(b"beat")
        assert server.poll(5000) and server.recv_multipart()[-1] == b"beat"
    finally:
        ctx.destroy(linger=0)
    hold.release()
    hold.release()  # harmless twice
    with socket.socket() as s:
        s.bind(("127.0.0.1", hold.ports[2]))  # never bound by anyone else: free once released


def test_a_hold_that_fails_midway_lets_go_of_the_ports_it_had(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # hold_ports(n) draws one port after another; when a draw fails (no address to bind, a
    # KeyboardInterrupt), the ports held so far go back at once instead of staying bound
    real, made, ports = net._drawn, [], []

    def drawn(host: str) -> socket.socket:
        if len(made) == 2:
            raise OSError("no port left")
        made.append(real(host))
        ports.append(made[-1].getsockname()[1])
        return made[-1]

    monkeypatch.setattr(net, "_drawn", drawn)
    with pytest.raises(OSError, match="no port left"):
        net.hold_ports(3)
    assert len(made) == 2 and all(s.fileno() == -1 for s in made)
    for port in ports:
        with socket.socket() as again:
            again.bind(("127.0.0.1", port))  # free again: a plain bind succeeds
