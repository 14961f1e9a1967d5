"""A process without the launch's secret gets nothing from rank 0's rendezvous store.

The red team's concern (issue 25, item 5): with ``job_private_network`` off, another user's
process listed a sealed store's keys and called ``add()`` on them (only the join was
refused). Here a real 2-rank world meets with ``HORA_RDZV_SECRET`` (as ``hora run``, the
service and ``%%distributed`` give it); once both ranks are in, rank 0 starts a separate
process **without** the secret that connects to ``MASTER_ADDR:MASTER_PORT`` and tries what
the red team did and more, each on a fresh connection:

* torch's own ``TCPStore`` client: connect, ``list_keys``, ``add`` to a key, ``get``,
  ``wait``, ``set``, ``num_keys``;
* hora's own store client with a guessed secret;
* raw sockets: an HTTP request, hora's hello followed by a forged proof and a request.

Every one must be refused and learn nothing (no byte of an answer on the raw sockets), and
the world must be intact afterwards: an allreduce over both ranks sums 2 and a second
``init()`` at the same address still meets. The same world without a secret (a plain
torchrun's) keeps torch's ``TCPStore``, where the same client does get in: that is the
difference the secret makes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

ATTACK = r"""
import datetime, json, os, socket, sys
import torch.distributed as dist
addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
short = datetime.timedelta(seconds=3)
out = {}

def attempt(name, fn):
    try:
        out[name] = "LEAK " + repr(fn())[:200]
    except Exception as e:
        out[name] = "refused " + type(e).__name__

def tcp():
    return dist.TCPStore(addr, port, 2, False, timeout=short, wait_for_workers=False)

attempt("tcpstore list_keys", lambda: tcp().list_keys())
attempt("tcpstore add", lambda: tcp().add("hora/g1/hora/ready/0", 1))
attempt("tcpstore get", lambda: tcp().get("hora/g1/hora/ready/0"))
attempt("tcpstore wait", lambda: tcp().wait(["hora/g1/hora/ready/0"], short))
attempt("tcpstore set", lambda: tcp().set("hora/g1/hora/ready/1", "1"))
attempt("tcpstore num_keys", lambda: tcp().num_keys())

def hora_client():
    from hora.torch._authstore import AuthStore
    from hora.torch._sealed import store_key
    return AuthStore(addr, port, store_key("a guess"), short).num_keys()

attempt("hora client, guessed secret", hora_client)

def raw(payload):
    s = socket.create_connection((addr, port), timeout=5)
    s.sendall(payload)
    got = b""
    try:
        while chunk := s.recv(4096):
            got += chunk
    except OSError:
        pass
    s.close()
    return got

from hora.torch import _authstore as a
out["raw http bytes"] = len(raw(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"))
forged = a.MAGIC + b"n" * 16 + b"\0" * 32 + a._frame(bytes([a.NUM_KEYS]))
out["raw forged proof bytes"] = len(raw(forged)) - 48  # past the server's own hello
print(json.dumps(out), flush=True)
"""
# rank 1 waits in a collective while rank 0 runs the attacker (a torch import, and a few
# seconds per refused TCPStore connect on a loaded machine)
SLOW_ENV = {"HORA_TIMEOUT": "150"}


def _attack_env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("HORA_RDZV_SECRET", None)
    return env


def _rank_body(rank: int, size: int) -> dict[str, Any]:
    import hora.torch as hvd
    import torch

    hvd.init()
    result: dict[str, Any] = {"secret": bool(os.environ.get("HORA_RDZV_SECRET"))}
    if rank == 0:
        done = subprocess.run(
            [sys.executable, "-c", ATTACK],
            env=_attack_env(),
            capture_output=True,
            text=True,
            timeout=120,
        )
        lines = done.stdout.strip().splitlines()
        result["attack"] = json.loads(lines[-1]) if lines else done.stderr[-2000:]
    hvd.broadcast_object(0)  # rank 1 waits in the world while rank 0's store is attacked
    result["sum"] = float(hvd.allreduce(torch.ones(1), op=hvd.Sum).item())
    hvd.shutdown()
    hvd.init()  # the store still hosts a second world at this address
    result["again"] = float(hvd.allreduce(torch.ones(1), op=hvd.Sum).item())
    hvd.shutdown()
    return result


def test_a_process_without_the_secret_gets_nothing_from_rank_0_s_store(run_world: Any) -> None:
    results = run_world(__file__, "_rank_body", 2, env=SLOW_ENV, timeout=240)
    attack = results[0]["attack"]
    assert isinstance(attack, dict), attack
    assert results[0]["secret"] and results[1]["secret"]
    for what, said in attack.items():
        if what.startswith("raw"):
            assert said <= 0, (what, attack)  # not one byte of an answer
        else:
            assert said.startswith("refused"), (what, attack)
    assert [r["sum"] for r in results] == [2.0, 2.0]
    assert [r["again"] for r in results] == [2.0, 2.0]


def test_without_a_secret_the_store_is_torch_s_own_as_before(run_world: Any) -> None:
    """A plain torchrun's world (no secret) is unchanged: a TCPStore anyone may reach."""
    results = run_world(
        __file__, "_rank_body", 2, env={**SLOW_ENV, "HORA_RDZV_SECRET": ""}, timeout=240
    )
    attack = results[0]["attack"]
    assert not results[0]["secret"]
    assert attack["tcpstore num_keys"].startswith("LEAK"), attack
    assert attack["hora client, guessed secret"].startswith("refused"), attack
    assert [r["sum"] for r in results] == [2.0, 2.0]
