"""One live notebook for the end-to-end tests: a real kernel started by nbclient.

:class:`Notebook` runs cells one at a time; :func:`hora_notebook` opens one with hora loaded,
talking to a test's own service as one user, and at its end checks that no process of the
notebook's is left (the kernel, its engines, their children).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import nbformat
from e2e._notebooks_procs import describe, kill_tagged, new_tag, tagged_env, wait_gone
from helpers.service_server import ServiceServer
from nbclient import NotebookClient


class Notebook:
    """One live notebook: a kernel started by nbclient, cells added and run one at a time.

    Everything runs on the notebook's own event loop (whichever thread calls), so its
    kernel client's sockets are always driven by the loop they were made on: a suite's
    shared per-thread loop, or a first cell run from another thread, once left a cell
    waiting for a send that never went out.
    """

    def __init__(self, env: dict[str, str], workdir: Path) -> None:
        self.nb = nbformat.v4.new_notebook()
        self.loop = asyncio.new_event_loop()
        self.lock = threading.Lock()
        self.client = NotebookClient(
            self.nb,
            timeout=120,
            startup_timeout=60,
            kernel_name="python3",
            allow_errors=True,
            resources={"metadata": {"path": str(workdir)}},
        )
        self.client.km = self.client.create_kernel_manager()
        self._sync(self.client.async_start_new_kernel(env=env))
        self._sync(self.client.async_start_new_kernel_client())

    def _sync(self, coro: Any) -> Any:
        with self.lock:
            return self.loop.run_until_complete(coro)

    @property
    def pid(self) -> int:
        return int(self.client.km.provisioner.process.pid)  # type: ignore[union-attr]

    def run(self, source: str) -> str:
        cell = nbformat.v4.new_code_cell(source)
        self.nb.cells.append(cell)
        self._sync(self.client.async_execute_cell(cell, len(self.nb.cells) - 1))
        return text_of(cell)

    def close(self) -> None:
        try:
            self._sync(self.client._async_cleanup_kernel())
        except Exception:  # a kernel killed by the test is already gone
            pass
        finally:
            self.loop.close()


def text_of(cell: nbformat.NotebookNode) -> str:
    parts = []
    for out in cell.outputs:
        if out.output_type == "stream":
            parts.append(out.text)
        elif out.output_type == "error":
            parts.append(f"{out.ename}: {out.evalue}\n" + "\n".join(out.traceback))
        else:
            parts.append(str(out.get("data", {}).get("text/plain", "")) + "\n")
    return "".join(parts)


def wait_for(what: str, check, timeout: float = 30.0):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


@contextmanager
def hora_notebook(
    server: ServiceServer,
    workdir: Path,
    user: str = "ann",
    start: str | None = None,
    ready: str = "engines ready",
) -> Iterator[Notebook]:
    """A notebook of ``user`` with hora loaded, on ``server``; nothing of it left at its end.

    ``start``: a first cell run after loading (``%dist_start ...``), whose output must say
    ``ready``; ``%dist_stop`` is then run at the end.
    """
    tag = new_tag()
    env = tagged_env(tag)
    env.update(
        HORA_URL=server.url, HORA_TOKEN=server.tokens[user], HORA_CONFIG=str(workdir / "none")
    )
    nb = Notebook(env, workdir)
    try:
        nb.run("%load_ext hora")
        if start is not None:
            out = nb.run(start)
            assert ready in out and "from the hora service" in out, out
        yield nb
        if start is not None:
            nb.run("%dist_stop")
    finally:
        close_checked(nb, tag)


def close_checked(nb: Notebook, tag: str) -> None:
    """Close ``nb`` and check that no process of its (tagged ``tag``) is left."""
    nb.close()
    left = wait_gone(tag, timeout=30)
    kill_tagged(tag)
    assert left == [], "processes left behind:\n" + describe(left)
