"""Job service cost against the size of its store: does a request cost the same at 10^5 jobs?

Protocol (../shared/BENCH.md): one real uvicorn service per store size (10^2, 10^3, 10^4,
10^5 finished jobs, copied from rows the service itself wrote: ``bench/_scale_store.py``),
all running at once on 127.0.0.1, each with the same live load: ``--sessions`` notebook
sessions running (one slot each, every slot of the service, so queued jobs stay queued) and
heartbeating every 10 s (the default lease's third; every 2 s with ``--quick``) from a
separate process, and the same number of queued jobs (``--queued`` 10, 100, 1,000: the queue
grows through the API between phases). In each phase the sizes are measured in interleaved
rounds (A B C D, then D C B A, ...; one warm-up round), one request at a time on a keep-alive
connection:

* ``submit``: ``POST /v1/jobs`` (the job joins the queue);
* ``get``: ``GET /v1/jobs/{id}`` of that job, the first read after its write (not cached);
* ``list``: ``GET /v1/jobs`` (page 1 of the user's own, ``limit=20``: a full page at every
  size, so every size serialises the same number of jobs) after that write;
* ``list_cached``: the same page again, nothing written in between;
* ``get_queued``: ``GET /v1/jobs/{id}`` of the last job in the queue (its place and reason);
* ``metrics``: ``GET /metrics`` (as an admin);
* ``heartbeat``: ``POST /v1/sessions/{id}/heartbeat`` (the heartbeat process's own timings);
* ``pass``: one scheduling pass (``Monitor.schedule``, under the manager's lock, with
  every queued job examined and none placed), timed inside the served process;
* ``tick``: one monitor pass (``JobManager.tick``: polls every attempt, the sessions' leases
  and CPU time, the slot leases), timed inside the served process.

The jobs submitted in a round are cancelled and deleted after it (not timed), so every store
keeps its size. Correct first: before each phase every service must report exactly the jobs
it holds by state (the copied history, the sessions running, the queue).

The ratio of an operation at size N is its median at N over its median at the smallest size,
in the same round; the table gives the median of those per-round ratios with min and max.
Targets: every ratio <= 1.5 at the largest size; a scheduling pass <= 10 ms with 1,000 queued.
A cell with no samples (``nan``: a phase too short for one heartbeat of a size's sessions)
is named, and the run does not pass: it would prove nothing. The sizes' sessions heartbeat
in turn, so each size is timed from a phase's first seconds.

Usage: python bench/service_scale.py [--quick] [--sizes 100,1000,10000,100000]
       [--queued 10,100,1000] [--sessions 100] [--rounds 5] [--ops 20] [--plot PATH]
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import math
import multiprocessing as mp
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

HERE = Path(__file__).resolve().parent
spec = importlib.util.spec_from_file_location("_scale_store", HERE / "_scale_store.py")
assert spec is not None and spec.loader is not None
store = importlib.util.module_from_spec(spec)
sys.modules["_scale_store"] = store
spec.loader.exec_module(store)

OPS = ("submit", "get", "list", "list_cached", "get_queued", "metrics", "heartbeat", "pass",
       "tick")  # fmt: skip
TARGET_RATIO = 1.5
PAGE = 20  # the user owns more than this at every size (sessions, history, queue)
TARGET_PASS_MS = 10.0
# the sessions heartbeat every 10 s, the third of the default 30 s lease; the services give
# them a longer lease (store.LEASE_S) so that opening 100 sessions a service on a loaded
# machine does not outlast it before the heartbeats begin
BEAT_S = 10.0
# --quick: 10 sessions a service and phases of a few seconds; every 2 s gives each size's
# heartbeat cell a few dozen samples instead of about one a session
QUICK_BEAT_S = 2.0
CONNECTION = {
    "interface": "tcp://127.0.0.1", "registration": 10001, "control": 10002, "mux": 10003,
    "task": 10004, "iopub": 10005, "hb_ping": 10006, "hb_pong": 10007, "key": "bench",
}  # fmt: skip


def timed(fn: Callable[[], httpx.Response], expect: int = 200) -> tuple[float, httpx.Response]:
    """Milliseconds one request took, and its answer (which must be ``expect``)."""
    t0 = time.perf_counter()
    r = fn()
    ms = (time.perf_counter() - t0) * 1000
    if r.status_code != expect:
        raise SystemExit(f"{r.request.method} {r.request.url}: {r.status_code} {r.text[:300]}")
    return ms, r


class Fleet:
    """One service per store size, with its sessions and queue (see the module docstring)."""

    def __init__(self, tmp: Path, sizes: list[int], sessions: int) -> None:
        self.sizes = sizes
        self.sessions = sessions
        base = tmp / "template"
        base.mkdir()
        self.tokens = store.make_users(base)
        templates = store.record_templates(base, self.tokens)
        self.history: dict[int, Counter[str]] = {}
        self.servers: dict[int, Any] = {}
        now = time.time()
        for n in sizes:
            d = tmp / f"n{n}"
            d.mkdir()
            for name in ("hora.db", "hora.db-wal"):
                if (base / name).exists():
                    shutil.copy(base / name, d / name)
            self.history[n] = store.fill(d / "hora.db", n, templates, now)
            self.servers[n] = store.ScaleServer(d, slots=sessions, tokens=self.tokens)
        self.session_ids: dict[int, list[tuple[int, str]]] = {}
        self.queued: dict[int, list[int]] = {n: [] for n in sizes}
        try:
            for srv in self.servers.values():
                srv.start()
            for srv in self.servers.values():
                srv.wait_ready()
            self._each(self._open_sessions)
        except BaseException:  # an interrupted set-up leaves no service behind
            self.stop()
            raise

    def _each(self, fn: Callable[[int], None]) -> None:
        with ThreadPoolExecutor(len(self.sizes)) as pool:
            list(pool.map(fn, self.sizes))

    def client(self, n: int, user: str = store.USERS[0]) -> httpx.Client:
        """A keep-alive client of size ``n``'s service, as ``user``."""
        srv = self.servers[n]
        return httpx.Client(base_url=srv.url, headers=srv.headers(user), timeout=120)

    def _open_sessions(self, n: int) -> None:
        users = store.USERS
        ids = []
        with self.client(n) as c:
            for i in range(self.sessions):
                user = users[i % len(users)]
                body = {"name": f"nb{i}", "workers": 1, "connection": CONNECTION}
                r = c.post("/v1/sessions", json=body, headers=self.servers[n].headers(user))
                if r.status_code != 201:
                    raise SystemExit(f"session: {r.status_code} {r.text}")
                ids.append((r.json()["id"], user))
        self.session_ids[n] = ids
        self._wait_count(n, "running", self.sessions, 60 + self.sessions)

    def _wait_count(self, n: int, state: str, want: int, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        with self.client(n, store.ADMIN) as c:
            while time.monotonic() < deadline:
                got = c.get("/v1/jobs", params={"state": state, "limit": 1}).json()["total"]
                if got == want:
                    return
                time.sleep(0.5)
        raise SystemExit(f"size {n}: {got} jobs {state}, expected {want}")

    def grow_queue(self, queued: int) -> None:
        """Submit jobs (as every user in turn) until each service has ``queued`` waiting."""

        def grow(n: int) -> None:
            with self.client(n) as c:
                while len(self.queued[n]) < queued:
                    user = store.USERS[len(self.queued[n]) % len(store.USERS)]
                    body = {"command": ["true"], "name": "waiting"}
                    r = c.post("/v1/jobs", json=body, headers=self.servers[n].headers(user))
                    if r.status_code != 201:
                        raise SystemExit(f"submit: {r.status_code} {r.text}")
                    self.queued[n].append(r.json()["id"])

        self._each(grow)

    def check(self) -> None:
        """Correct first: each service reports exactly the jobs it holds, by state."""
        for n in self.sizes:
            want: Counter[str] = Counter()
            for (_, state), count in self.history[n].items():
                want[state] += count
            want["running"] = self.sessions
            want["queued"] = len(self.queued[n])
            with self.client(n, store.ADMIN) as c:
                for state in ("succeeded", "failed", "cancelled", "running", "queued"):
                    got = c.get("/v1/jobs", params={"state": state, "limit": 1}).json()["total"]
                    if got != want[state]:
                        raise SystemExit(f"size {n}: {got} {state}, expected {want[state]}")

    def stop(self) -> None:
        """Stop every service and what it started."""
        for srv in self.servers.values():
            srv.stop()


def measure_round(fleet: Fleet, n: int, ops: int, scrapes: int) -> dict[str, list[float]]:
    """One round of every operation on size ``n``'s service; op -> milliseconds."""
    out: dict[str, list[float]] = {op: [] for op in OPS if op != "heartbeat"}
    made: list[int] = []
    page = {"limit": PAGE}
    with fleet.client(n) as c:
        for _ in range(ops):
            ms, r = timed(lambda: c.post("/v1/jobs", json={"command": ["true"]}), 201)
            out["submit"].append(ms)
            made.append(r.json()["id"])
            out["get"].append(timed(lambda: c.get(f"/v1/jobs/{made[-1]}"))[0])
            out["list"].append(timed(lambda: c.get("/v1/jobs", params=page))[0])
        for _ in range(ops):
            out["list_cached"].append(timed(lambda: c.get("/v1/jobs", params=page))[0])
        for _ in range(ops):
            out["get_queued"].append(timed(lambda: c.get(f"/v1/jobs/{made[-1]}"))[0])
        with fleet.client(n, store.ADMIN) as a:
            for _ in range(scrapes):
                out["metrics"].append(timed(lambda: a.get("/metrics"))[0])
            _, r = timed(lambda: a.post("/bench/passes", params={"n": ops, "gap_s": 0.05}))
            out["pass"] = [s * 1000 for s in r.json()["pass"]]
            out["tick"] = [s * 1000 for s in r.json()["tick"]]
        for job_id in made:  # the store keeps its size
            c.post(f"/v1/jobs/{job_id}/cancel")
            c.delete(f"/v1/jobs/{job_id}")
    return out


def heartbeats(
    targets: list[tuple[int, str, list[tuple[int, str]], dict[str, str]]],
    period_s: float,
    phase: Any,
    stop: Any,
    results: Any,
) -> None:
    """Heartbeat every session every ``period_s``; put {(size, phase): [ms, ...]} at the end."""
    per_size = [[(n, url, sid, tokens[user]) for sid, user in ids]
                for n, url, ids, tokens in targets]
    # the sizes take turns, so that a phase shorter than one sweep still times every size
    beats = [b for turn in itertools.zip_longest(*per_size) for b in turn if b is not None]
    got: dict[tuple[int, int], list[float]] = {}
    clients = {url: httpx.Client(base_url=url, timeout=60) for _, url, _, _ in targets}
    gap = period_s / max(1, len(beats))
    while not stop.is_set():
        for n, url, sid, token in beats:
            t0 = time.perf_counter()
            r = clients[url].post(
                f"/v1/sessions/{sid}/heartbeat", json={"idle_s": 0},
                headers={"Authorization": f"Bearer {token}"},
            )  # fmt: skip
            if r.status_code == 200:
                got.setdefault((n, phase.value), []).append((time.perf_counter() - t0) * 1000)
            if stop.wait(gap):
                break
    results.put(got)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Every phase and round; the samples by (queued, size, round, op)."""
    samples: dict[int, dict[int, list[dict[str, list[float]]]]] = {}
    rss: dict[int, dict[int, float]] = {}
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="hora-scale-") as tmp:
        t0 = time.monotonic()
        fleet = Fleet(Path(tmp), args.sizes, args.sessions)
        print(f"setup: {time.monotonic() - t0:.0f}s", flush=True)
        phase, stop, results = ctx.Value("i", 0), ctx.Event(), ctx.Queue()
        targets = [(n, fleet.servers[n].url, fleet.session_ids[n], dict(fleet.tokens))
                   for n in args.sizes]  # fmt: skip
        period = QUICK_BEAT_S if args.quick else BEAT_S
        beat = ctx.Process(target=heartbeats, args=(targets, period, phase, stop, results))
        beat.start()
        try:
            for q in args.queued:
                fleet.grow_queue(q)
                fleet.check()
                phase.value = q
                samples[q] = {n: [] for n in args.sizes}
                for r in range(args.rounds + 1):  # round 0 is the warm-up
                    order = args.sizes if r % 2 == 0 else args.sizes[::-1]
                    for n in order:
                        got = measure_round(fleet, n, args.ops, args.scrapes)
                        if r:
                            samples[q][n].append(got)
                rss[q] = {n: fleet.servers[n].rss_mb() for n in args.sizes}
                print(f"phase queued={q}: done at {time.monotonic() - t0:.0f}s", flush=True)
        finally:
            stop.set()
            beats = results.get(timeout=60)
            beat.join(timeout=30)
            fleet.stop()
    return {"samples": samples, "beats": beats, "rss": rss}


def summarise(
    samples: Mapping[int, Mapping[int, list[dict[str, list[float]]]]],
    beats: Mapping[tuple[int, int], list[float]],
    sizes: list[int],
) -> dict[int, dict[str, dict[str, Any]]]:
    """Per phase and op: the median ms at each size, and per-round ratios to the smallest."""
    out: dict[int, dict[str, dict[str, Any]]] = {}
    for q, by_size in samples.items():
        out[q] = {}
        for op in OPS:
            row: dict[str, Any] = {"ms": {}, "ratio": {}}
            for n in sizes:
                if op == "heartbeat":
                    row["ms"][n] = statistics.median(beats.get((n, q), [float("nan")]))
                    continue
                row["ms"][n] = statistics.median(x for rnd in by_size[n] for x in rnd[op])
            for n in sizes[1:]:
                if op == "heartbeat":  # no rounds: one ratio of the phase's medians
                    r = row["ms"][n] / row["ms"][sizes[0]]
                    row["ratio"][n] = (r, r, r)
                    continue
                per = [statistics.median(a[op]) / statistics.median(b[op])
                       for a, b in zip(by_size[n], by_size[sizes[0]], strict=True)]  # fmt: skip
                row["ratio"][n] = (statistics.median(per), min(per), max(per))
            out[q][op] = row
    return out


def report(args: argparse.Namespace, table: dict[int, dict[str, dict[str, Any]]],
           rss: Mapping[int, Mapping[int, float]]) -> dict[str, Any]:  # fmt: skip
    """Print the tables; the final JSON line's fields."""
    sizes = args.sizes
    print(
        f"\nhora service cost against the store (python {sys.version.split()[0]}, "
        f"{os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}; {args.sessions} sessions "
        f"heartbeating, {args.rounds} rounds of {args.ops} ops)"
    )
    worst, worst_op, unmeasured = 0.0, "", []
    for q, rows in table.items():
        print(f"\n{q} queued: median ms by jobs in the store; "
              f"ratio to {sizes[0]:,} (med, min..max)")  # fmt: skip
        head = "".join(f"{n:>10,}" for n in sizes)
        print(f"{'op':>12}{head}   ratio at {sizes[-1]:,}")
        for op, row in rows.items():
            cells = "".join(f"{row['ms'][n]:>10.2f}" for n in sizes)
            med, lo, hi = row["ratio"].get(sizes[-1], (1.0, 1.0, 1.0))
            print(f"{op:>12}{cells}   {med:5.2f} ({lo:.2f}..{hi:.2f})")
            missing = [n for n in sizes if math.isnan(row["ms"][n])]
            unmeasured += [f"{op} at {n:,} stored, {q} queued" for n in missing]
            if med > worst:
                worst, worst_op = med, f"{op} at {q} queued"
        print(f"{'server MB':>12}" + "".join(f"{rss[q][n]:>10.0f}" for n in sizes))
    big_q = max(table)
    pass_ms = max(table[big_q]["pass"]["ms"].values())
    ok = worst <= TARGET_RATIO and (big_q < 1000 or pass_ms <= TARGET_PASS_MS)
    ok = ok and not unmeasured  # a cell without samples (nan) proves nothing
    if unmeasured:
        print(f"\nno samples (nan): {'; '.join(unmeasured)}")
    print(
        f"\ntargets: worst ratio {worst:.2f} ({worst_op}) <= {TARGET_RATIO}; scheduling pass "
        f"{pass_ms:.2f} ms at {big_q} queued <= {TARGET_PASS_MS} ms (at 1,000): "
        f"{'ok' if ok else 'MISS'}"
    )
    return {
        "bench": "service_scale",
        "metric": f"worst per-request cost ratio, {sizes[-1]:,} vs {sizes[0]:,} jobs stored",
        "hora": round(worst, 3), "baseline": 1.0, "ratio": round(worst, 3),
        "target": TARGET_RATIO, "pass": ok,
        "details": {"worst": worst_op, "pass_ms": round(pass_ms, 3), "queued": big_q,
                    "unmeasured": unmeasured,
                    "ms": {q: {op: {n: round(v, 3) for n, v in row["ms"].items()}
                               for op, row in rows.items()} for q, rows in table.items()}},
    }  # fmt: skip


def plot(path: Path, sizes: list[int], table: dict[int, dict[str, dict[str, Any]]]) -> None:
    """Median ms per op against jobs stored, one panel per queue length (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(table), figsize=(5 * len(table), 4.2), squeeze=False)
    for ax, (q, rows) in zip(axes[0], table.items(), strict=True):
        for op, row in rows.items():
            ax.plot(sizes, [row["ms"][n] for n in sizes], marker="o", label=op)
        ax.set(xscale="log", yscale="log", title=f"{q} queued", xlabel="jobs in the store",
               ylabel="median ms")  # fmt: skip
        ax.grid(True, which="both", alpha=0.3)
    axes[0][-1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.suptitle("hora service: cost of one operation against the size of its store")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="reduced run (< 60 s)")
    p.add_argument("--sizes", type=lambda s: [int(x) for x in s.split(",")])
    p.add_argument("--queued", type=lambda s: [int(x) for x in s.split(",")])
    p.add_argument("--sessions", type=int)
    p.add_argument("--rounds", type=int)
    p.add_argument("--ops", type=int)
    p.add_argument("--scrapes", type=int, default=5)
    p.add_argument("--plot", type=Path, default=None, help="write the plot here (PNG)")
    p.add_argument("--json", type=Path, default=None, help="write the summary here")
    args = p.parse_args()
    quick = {"sizes": [100, 10_000], "queued": [10, 100], "sessions": 10, "rounds": 2, "ops": 5}
    full = {"sizes": [100, 1000, 10_000, 100_000], "queued": [10, 100, 1000], "sessions": 100,
            "rounds": 5, "ops": 20}  # fmt: skip
    for k, v in (quick if args.quick else full).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.quick:
        args.scrapes = min(args.scrapes, 3)
    got = run(args)
    table = summarise(got["samples"], got["beats"], args.sizes)
    line = report(args, table, got["rss"])
    if args.plot is not None:
        plot(args.plot, args.sizes, table)
    if args.json is not None:
        args.json.write_text(json.dumps({"args": vars(args) | {"plot": str(args.plot),
                                         "json": str(args.json)}, "table": table}, default=str))
    print(json.dumps(line))
    return 0 if line["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
