"""The dashboard's queue view (``GET /ui/api/queue``) with many queued jobs, before and after.

Two real services side by side, each a ``uvicorn`` on 127.0.0.1 with its own temp data dir
(SQLite file), 2 CPU slots held by a blocker job and N jobs of two users queued behind it:
one runs the sources of ``--before`` (a git revision, checked out into a temp worktree), the
other this checkout's. The admin's dashboard session asks for the queue; blocks of requests
alternate between the two (B A, A B, ...) after a warm-up pair, for each N of the sweep, and
optionally with ``--load`` clients polling the same server's ``/v1/queue`` meanwhile (the
dashboards of other users). Each block's median latency is recorded; the table quotes the
medians of the blocks and the median (min, max) of the per-pair ratios after / before.

Both services must answer the same entries (checked before timing). Target: after, median
≤ 200 ms at 200 queued jobs.

Usage: python bench/queue_view.py [--before REV] [--jobs 50,100,200] [--pairs 5]
       [--requests 5] [--load 0,4] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
from hora.net import free_port

REPO = Path(__file__).resolve().parents[1]
SERVE = (
    "import uvicorn;"
    "from hora_service.settings import Settings;"
    "from hora_service.api.app import create_app;"
    "s = Settings();"
    "uvicorn.run(create_app(s), host=s.host, port=s.port, log_level='warning')"
)
USERS = (
    "import json, sys;"
    "from hora_service.manager import JobManager;"
    "from hora_service.settings import Settings;"
    "m = JobManager(Settings());"
    "m.open_store();"
    "print(json.dumps({u: str(m.users.create(u, admin=u == 'root')) for u in sys.argv[1:]}))"
)
TARGET_MS = 200.0


class Service:
    """A real service running the sources under ``src``, with users ann, bob and root."""

    def __init__(self, src: Path, where: Path) -> None:
        self.src = src
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        data = where / "data"
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("HORA_")}
        self.env.update({
            "PYTHONPATH": f"{src}/kernels:{src}/service", "HORA_DATA_DIR": str(data),
            "HORA_WORK_ROOT": str(where), "HORA_HOST": "127.0.0.1", "HORA_PORT": str(self.port),
            "HORA_GPUS": "0", "HORA_CPU_SLOTS": "2", "HORA_USER_MODE": "shared",
            "HORA_KILL_GRACE_S": "2", "OMP_NUM_THREADS": "1",
        })  # fmt: skip
        made = subprocess.run(
            [sys.executable, "-c", USERS, "ann", "bob", "root"], env=self.env, check=True,
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        self.tokens: dict[str, str] = json.loads(made.stdout)
        self.log = where / "server.log"
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", SERVE], env=self.env, stdout=out,
                stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url + "/healthz", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        else:
            raise SystemExit(f"server did not start:\n{self.log.read_text()}")
        self.page = httpx.Client(base_url=self.url, timeout=120)
        assert self.page.post("/ui/login", json={"token": self.tokens["root"]}).status_code == 200
        self.queued = 0
        self.blocker = self.submit("ann", ["sleep", "3600"], 2)
        with self.api("ann") as c:
            while c.get(f"/v1/jobs/{self.blocker}").json()["state"] != "running":
                time.sleep(0.2)

    def api(self, user: str) -> httpx.Client:
        auth = {"Authorization": f"Bearer {self.tokens[user]}"}
        return httpx.Client(base_url=self.url, headers=auth, timeout=120)

    def submit(self, user: str, command: list[str], workers: int) -> int:
        with self.api(user) as c:
            r = c.post("/v1/jobs", json={"command": command, "workers": workers})
            if r.status_code != 201:
                raise SystemExit(f"submit failed: {r.status_code} {r.text}")
            return int(r.json()["id"])

    def fill(self, n: int) -> None:
        """Queue jobs until ``n`` wait (1 or 2 slots each, ann's and bob's in turn)."""
        while self.queued < n:
            i = self.queued
            self.submit(("ann", "bob")[i % 2], ["true"], 1 + i % 2)
            self.queued += 1

    def block(self, requests: int) -> float:
        """Median latency (ms) of ``requests`` queue views."""
        times = []
        for _ in range(requests):
            t0 = time.perf_counter()
            r = self.page.get("/ui/api/queue")
            times.append((time.perf_counter() - t0) * 1000)
            if r.status_code != 200 or len(r.json()) != self.queued:
                raise SystemExit(f"queue view: {r.status_code}, {len(r.json())} entries")
        return statistics.median(times)

    def stop(self) -> None:
        self.page.close()
        with self.api("root") as c:  # the queue first, so that nothing starts, then the blocker
            for job in c.get("/v1/jobs", params={"state": "queued", "limit": 500}).json()["items"]:
                c.post(f"/v1/jobs/{job['id']}/cancel")
            c.post(f"/v1/jobs/{self.blocker}/cancel")
            deadline = time.monotonic() + 60
            while c.get(f"/v1/jobs/{self.blocker}").json()["state"] != "cancelled":
                if time.monotonic() > deadline:
                    break
                time.sleep(0.2)
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)


class Load:
    """``clients`` threads polling ``GET /v1/queue`` of one service until stopped."""

    def __init__(self, svc: Service, clients: int) -> None:
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._poll, args=(svc, ("ann", "bob")[i % 2]), daemon=True)
            for i in range(clients)
        ]
        for t in self._threads:
            t.start()

    def _poll(self, svc: Service, user: str) -> None:
        with svc.api(user) as c:
            while not self._stop.is_set():
                c.get("/v1/queue")

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=300)


def timed(svc: Service, requests: int, clients: int) -> float:
    load = Load(svc, clients) if clients else None
    try:
        return svc.block(requests)
    finally:
        if load is not None:
            load.stop()


def same_entries(before: Service, after: Service) -> None:
    """Both services answer the same queue (ids differ by nothing: same submissions)."""
    b, a = before.page.get("/ui/api/queue").json(), after.page.get("/ui/api/queue").json()
    strip = ("queued_at", "reason")
    key = [[{k: v for k, v in e.items() if k not in strip} for e in x] for x in (b, a)]
    kinds = [[(e.get("reason") or {}).get("kind") for e in x] for x in (b, a)]
    if key[0] != key[1] or kinds[0] != kinds[1]:
        raise SystemExit("the two services answer different queues")


def checkout(rev: str, where: Path) -> Path:
    path = where / "before"
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "-q", "--detach", str(path), rev],
                   check=True, timeout=120)  # fmt: skip
    return path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", default="main", help="git revision of the baseline")
    ap.add_argument("--jobs", default="50,100,200")
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--requests", type=int, default=5, help="queue views per block")
    ap.add_argument("--load", default="0,4", help="concurrent /v1/queue pollers, a sweep")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    if args.quick:
        args.jobs, args.pairs, args.requests, args.load = "200", 2, 2, "0"
    sizes = [int(x) for x in args.jobs.split(",")]
    loads = [int(x) for x in args.load.split(",")]
    tmp = Path(tempfile.mkdtemp(prefix="hora-queue-view-"))
    src = checkout(args.before, tmp)
    services: list[Service] = []
    rows = []
    try:
        before = Service(src, tmp / "b")
        services.append(before)
        after = Service(REPO, tmp / "a")
        services.append(after)
        rev = subprocess.run(["git", "-C", str(src), "rev-parse", "--short", "HEAD"],
                             capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
        print(f"GET /ui/api/queue (admin), 2 CPU slots held, before = {args.before} ({rev}), "
              f"{args.requests} views a block, {args.pairs} pairs after a warm-up")  # fmt: skip
        print(f"{'queued':>7} {'load':>5} {'before ms':>10} {'after ms':>9} "
              f"{'ratio med':>9} {'min':>6} {'max':>6}")  # fmt: skip
        for n in sizes:
            before.fill(n)
            after.fill(n)
            same_entries(before, after)
            for clients in loads:
                rows.append(_row(before, after, n, clients, args))
    finally:
        for svc in services:
            svc.stop()
        subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(src)],
                       check=False, timeout=120)  # fmt: skip
    at = [r for r in rows if r["queued"] == 200] or rows[-1:]
    worst = max(r["after_ms"] for r in at)
    print(json.dumps({
        "bench": "queue_view", "metric": "GET /ui/api/queue median ms at 200 queued jobs",
        "hora": worst, "baseline": max(r["before_ms"] for r in at),
        "ratio": max(r["ratio"] for r in at), "target": TARGET_MS, "pass": worst <= TARGET_MS,
    }))  # fmt: skip
    return 0


def _row(before: Service, after: Service, n: int, clients: int, args: argparse.Namespace) -> dict:
    b_ms, a_ms, ratios = [], [], []
    for pair in range(args.pairs + 1):  # pair 0 warms up
        order = (before, after) if pair % 2 else (after, before)
        got = {svc.src: timed(svc, args.requests, clients) for svc in order}
        if pair:
            b_ms.append(got[before.src])
            a_ms.append(got[after.src])
            ratios.append(got[after.src] / got[before.src])
    row = {
        "queued": n, "load": clients, "before_ms": statistics.median(b_ms),
        "after_ms": statistics.median(a_ms), "ratio": statistics.median(ratios),
    }  # fmt: skip
    print(f"{n:>7} {clients:>5} {row['before_ms']:>10.1f} {row['after_ms']:>9.1f} "
          f"{row['ratio']:>9.3f} {min(ratios):>6.3f} {max(ratios):>6.3f}", flush=True)  # fmt: skip
    return row


if __name__ == "__main__":
    sys.exit(main())
