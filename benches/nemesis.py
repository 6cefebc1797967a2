"""Nemesis: a primary and a standby under a cycle of faults, clients holding locks through it all.

    python -m benches.nemesis --duration S [--seed N] [--failover-after F] [--workers W]
        [--ttl 8] [--wait 20] [--request-timeout 5] [--promotion-grace 2] [--kinds kill,pause,...]
        [--json PATH] [--keep DIR]

What runs
---------
Two real ``fastlock serve`` processes on 127.0.0.1, nodes ``a`` and ``b``,
each on a fixed port with its own data dir, and in front of each a
:class:`fastlock._testbase.TcpProxy` that labels a standby's replication
connection.  ``a`` starts as the primary, ``b`` as ``--standby-of`` a's
PROXY with ``--failover-after F --promotion-grace G``, so the replication
link can be cut without touching the clients' own connections.

``--workers`` worker PROCESSES each open ``fastlock.connect(a, b)`` (both
node addresses, ``request_timeout`` as given) and loop: pick one of
``--locks`` lock names (default twice the workers; seeded RNG), ``async with client.lock(name, ttl=TTL,
wait=WAIT)``, and while holding, every 0.2 s, a fenced write to one SQLite
store (:class:`fastlock.fencing.SQLiteFence`: accepted only if the token is at
least the highest seen for that lock) of a row (lock, token, holding,
monotonic time read inside the transaction).  Holds are short (0.05-0.5 s)
or, one in seven, long (2.5-4 s: past the first renewal at TTL/3 minus
10-20 % jitter, so renewals meet faults).  Each
worker logs every grant, write, lost lease and error (type and message) as
JSON lines; the controller reads them after the run.

TTL: 8 s by default, longer than ``--failover-after`` (1 s) plus the client's
``request_timeout`` (5 s), the README's condition for ``lock()`` to keep a
lease across a failover: a renewal stuck on a dead or frozen primary is given
up after at most ``request_timeout`` and retried on the new primary, which
gave every replicated lease a fresh TTL; 2 s are left for the retry.  WAIT:
20 s, longer than any outage the bound below allows, so an acquire that
fails (rather than waits) during a fault is a failure to ride through it.

The nemesis
-----------
A controller cycles through the fault kinds (``--kinds``, in a seeded
shuffled order per round), one fault at a time, each against the current
primary P with standby S:

``kill``       SIGKILL P.  S promotes itself after F.
``pause``      SIGSTOP P until S has promoted (past the failover window),
               plus a random 0-1 s, then SIGCONT: P resumes fenced.
``partition``  black-hole the replication link (or, one time in two, reset it
               and hold reconnections) until S has promoted, plus 0-1 s, then
               heal: P is alive, fenced, and reachable by clients throughout.
``promote``    ``fastlock promote --server S`` with P alive: P confirms it
               steps down (``deposed``).

A surviving old primary lingers a random 0-1.5 s (clients may still reach
it), then is re-paired the documented way (README, "Replication and
failover"): stopped (SIGTERM) and restarted on the SAME port with the same
data dir as ``--standby-of`` the new primary's proxy, where its
``deposed.json``/``node-state.json`` let it follow the higher epoch.  The
controller then waits, at most ``--heal-timeout`` s, for a healthy cluster:
one primary, unfenced and past its grace, with its standby attached, synced
and ``pair_confirmed``, and a grant to the prober (below) since the re-pair;
then lets the load run 0.5-1.5 s (seeded) before the next fault.  A cluster
that does not heal in time ends the run (reported).

Checks and figures
------------------
Safety (:mod:`fastlock._testbase.history`), each violation listed:

* the store's accepted writes: tokens never go backwards per lock in commit
  order; no token accepted from two holdings; no two critical sections
  (a holding's accepted writes) overlap (:func:`check_store`);
* the grants workers received: no token granted twice; no grant sent after
  another was received carries a lower token (:func:`check_grants`).

Availability (the acceptance figures of issue 10, reported and checked):

* leases lost by ``lock()`` holders (``lease.lost`` set while holding), with
  TTL > F + request_timeout; and releases that failed at ``lock()``'s exit
  (it swallows ``LeaseLost``/``ConnectionLost`` and sets ``lease.lost``).
  Counted apart: leases granted after a fault began and before the standby
  promoted - by a partitioned or freezing primary whose records could no
  longer reach the standby (asynchronous replication: the new primary never
  knew them; its grace period, not the lease, protects the lock);
* locks the primary still shows held after every worker stopped (orphans:
  a release acknowledged by a primary whose record never reached the standby
  leaves the replicated lease held until its TTL on the new primary);
* errors surfaced to worker code: from ``lock()`` entry (acquires whose
  ``wait`` covered the outage), from its exit (the release), and exceptions
  the event loop saw unretrieved, each by type with sample messages;
* per kill, the longest window without any grant, from the SIGKILL until the
  cluster is healthy again, against the bound F + G + 1 s; the same window
  for every other fault, and outside faults (the baseline).  A *prober*
  process (one more worker) takes and releases a fresh, uncontended lock
  every 50 ms with one-shot ``acquire``/``release``, so that the windows
  measure the cluster, not the workers' contention; its errors count too;
* errors by the fault window they fell in (or "steady");
* stale writes the fence refused (a holder that still acted as the holder);
* two holders believing they held one lock at once (client view,
  :func:`check_holdings`); meaningful as a violation only with G >= TTL.

Figures are printed at the end, and written as JSON with ``--json``.
``tests/test_nemesis.py`` runs a short version in CI.

Bounds: every wait has a deadline; the run stops starting faults after
``--duration`` s, then waits at most ``--heal-timeout`` s; workers get
SIGTERM (finish the current holding, release) and SIGKILL after 15 s; every
server and worker is stopped by PID in ``finally`` blocks and at exit.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import bisect
import dataclasses
import json
import logging
import os
import random
import re
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

KINDS = ("kill", "pause", "partition", "promote")
EPOCH_SHIFT = 40


@dataclasses.dataclass
class NemesisConfig:
    duration: float = 60.0          # s during which faults are started
    seed: int = 20261201
    failover_after: float = 1.0     # s, the standby's --failover-after
    promotion_grace: float = 2.0    # s, --promotion-grace (the writers fence, so a short grace is safe)
    workers: int = 6                # worker processes
    locks: int = 0                  # lock names (0: twice as many as workers)
    ttl: float = 8.0                # s, lock() TTL: > failover_after + request_timeout (see the docstring)
    wait: float = 20.0              # s, lock() wait: covers any allowed outage
    request_timeout: float = 5.0    # s, the clients' request_timeout (the library default)
    kinds: tuple = KINDS
    heal_timeout: float = 30.0      # s to become healthy after a fault
    promote_timeout: float = 15.0   # s for a promotion to show after a fault
    warmup: float = 2.0             # s of load before the first fault
    fsync: str = "always"
    max_faults: int = 0             # 0: no limit but --duration


@dataclasses.dataclass
class Fault:
    index: int
    kind: str
    mode: str = ""                  # partition: blackhole | reset
    old_primary: str = ""
    new_primary: str = ""
    at: float = 0.0                 # monotonic, the fault began
    promoted_s: float | None = None  # the standby logged PROMOTED, after the fault began
    ended_s: float | None = None    # SIGCONT / heal / promote returned
    repaired_s: float | None = None  # the old primary answered as a standby of the new one
    healthy_s: float | None = None
    first_grant_s: float | None = None  # the first grant any worker received after the fault began
    no_grant_s: float | None = None  # the longest window without any grant, from the fault until healthy
    note: str = ""


def _fastlock_env(extra_paths: list[str]) -> dict[str, str]:
    """The environment for subprocesses: the same fastlock package as this
    process (installed, or a source tree built in place), then ``extra_paths``."""
    import importlib.util

    env = dict(os.environ)
    spec = importlib.util.find_spec("fastlock")
    paths = []
    if spec is not None and spec.origin:
        paths.append(os.path.dirname(os.path.dirname(os.path.abspath(spec.origin))))
    paths += extra_paths
    paths += [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    return env


# =========================================================================== workers


_STORE_SCHEMA = ("CREATE TABLE IF NOT EXISTS writes (seq INTEGER PRIMARY KEY AUTOINCREMENT, lock TEXT NOT NULL, "
                 "token INTEGER NOT NULL, holding TEXT NOT NULL, worker INTEGER NOT NULL, at REAL NOT NULL)")


def worker_main(run_dir: str, index: int) -> int:
    """Entry point of one worker process (``python -m benches.nemesis --worker DIR --index I``)."""
    cfg = json.loads(Path(run_dir, "config.json").read_text())
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s",
                        handlers=[logging.FileHandler(Path(run_dir, f"worker-{index}.log"))])
    try:
        import uvloop
        runner = uvloop.run
    except ImportError:  # pragma: no cover
        runner = asyncio.run
    return runner(_Worker(cfg, run_dir, index).run())


class _Worker:
    def __init__(self, cfg: dict, run_dir: str, index: int):
        self.cfg = cfg
        self.index = index
        self.rng = random.Random(cfg["seed"] * 1000 + index)
        self.events = open(Path(run_dir, f"worker-{index}.jsonl"), "a", buffering=1)
        self.db = sqlite3.connect(cfg["store"], timeout=30, isolation_level=None)
        self.db.execute("PRAGMA synchronous=NORMAL")
        from fastlock.fencing import SQLiteFence

        self.fence = SQLiteFence(self.db)
        self.stop = asyncio.Event()
        self.holdings = 0

    def log(self, ev: str, **fields: Any) -> None:
        fields["ev"] = ev
        fields.setdefault("at", time.monotonic())
        self.events.write(json.dumps(fields) + "\n")

    def _loop_error(self, loop, context: dict) -> None:
        exc = context.get("exception")
        self.log("loop_error", type=type(exc).__name__ if exc else None,
                 msg=str(context.get("message")) + (f": {exc}" if exc else ""))

    def write(self, name: str, token: int, holding: str) -> tuple[bool, str | None]:
        from fastlock.errors import StaleFencingToken

        try:
            with self.fence.fenced(name, token) as cur:
                cur.execute("INSERT INTO writes (lock, token, holding, worker, at) VALUES (?, ?, ?, ?, ?)",
                            (name, token, holding, self.index, time.monotonic()))
            return True, None
        except StaleFencingToken as exc:
            return False, str(exc)

    async def run(self) -> int:
        import fastlock

        loop = asyncio.get_running_loop()
        loop.set_exception_handler(self._loop_error)
        loop.add_signal_handler(signal.SIGTERM, self.stop.set)
        cfg = self.cfg
        probe = self.index == cfg["workers"]
        client = await fastlock.connect(*cfg["addresses"], client_name=("prober" if probe else f"worker-{self.index}"),
                                        connect_timeout=1.0, request_timeout=cfg["request_timeout"])
        self.log("started", pid=os.getpid())
        try:
            await (self.probe(client) if probe else self.work(client))
        finally:
            self.log("stopped")
            await client.close()
            self.db.close()
            self.events.close()
        return 0

    async def _until_stopped(self, coro) -> tuple[bool, Any]:
        """Run ``coro``; if a stop comes first, cancel it and return ``(False, None)``."""
        task = asyncio.ensure_future(coro)
        stopping = asyncio.ensure_future(self.stop.wait())
        await asyncio.wait([task, stopping], return_when=asyncio.FIRST_COMPLETED)
        stopping.cancel()
        if not task.done():  # shutting down while waiting: not a failure
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            return False, None
        return True, task.result()

    async def work(self, client) -> None:
        """Hold random locks through ``client.lock()`` with fenced writes, until stopped."""
        from fastlock.errors import FastlockError, LockNotAcquired

        cfg = self.cfg
        names = [f"acct/{i}" for i in range(cfg["locks"])]
        while not self.stop.is_set():
            name = self.rng.choice(names)
            hold = self.rng.uniform(2.5, 4.0) if self.rng.random() < 0.15 else self.rng.uniform(0.05, 0.5)
            phase = "acquire"
            sent = time.monotonic()
            ctx = client.lock(name, ttl=cfg["ttl"], wait=cfg["wait"])
            try:
                entered, lease = await self._until_stopped(ctx.__aenter__())
                if not entered:
                    break
                phase = "release"
                await self.hold(ctx, lease, name, sent, hold)
            except LockNotAcquired as exc:
                self.log("not_acquired", op=phase, lock=name, sent=sent, msg=str(exc))
            except (FastlockError, OSError, sqlite3.Error) as exc:
                self.log("error", op=phase, lock=name, sent=sent, type=type(exc).__name__, msg=str(exc))
                await asyncio.sleep(0.05)

    async def probe(self, client) -> None:
        """One-shot ``acquire`` + ``release`` of a fresh, uncontended lock every
        50 ms: its grants time the outages, free of the workers' contention."""
        from fastlock.errors import FastlockError, LockNotAcquired

        cfg = self.cfg
        n = 0
        while not self.stop.is_set():
            n += 1
            name = f"probe/{n}"
            sent = time.monotonic()
            phase = "probe-acquire"
            try:
                entered, lease = await self._until_stopped(client.acquire(name, ttl=cfg["ttl"], wait=cfg["wait"]))
                if not entered:
                    break
                self.log("grant", lock=name, token=lease.fencing_token, holding=f"p#{n}", sent=sent,
                         at=time.monotonic(), ttl=lease.ttl, probe=True)
                phase = "probe-release"
                await client.release(lease)
            except LockNotAcquired as exc:
                self.log("not_acquired", op=phase, lock=name, sent=sent, msg=str(exc))
            except (FastlockError, OSError) as exc:
                self.log("error", op=phase, lock=name, sent=sent, type=type(exc).__name__, msg=str(exc))
            await asyncio.sleep(0.05)

    async def hold(self, ctx, lease, name: str, sent: float, hold: float) -> None:
        """Act as the holder for ``hold`` s: a fenced write every 0.2 s while the lease
        is not lost; then leave ``ctx`` (its release errors propagate to ``run``)."""
        self.holdings += 1
        holding = f"w{self.index}#{self.holdings}"
        received = time.monotonic()
        self.log("grant", lock=name, token=lease.fencing_token, holding=holding, sent=sent, at=received,
                 ttl=lease.ttl)
        lease.health.add_listener(lambda state: self.log("health", lock=name, holding=holding, state=state))
        end_reason = "done"
        try:
            until = received + hold
            while True:
                if lease.lost.is_set():
                    end_reason = "lost"
                    break
                ok, err = self.write(name, lease.fencing_token, holding)
                self.log("write", lock=name, token=lease.fencing_token, holding=holding, ok=ok, msg=err)
                if not ok:
                    end_reason = "stale"
                    break
                left = until - time.monotonic()
                if left <= 0 or self.stop.is_set():
                    break
                try:
                    await asyncio.wait_for(lease.lost.wait(), min(0.2, left))
                except asyncio.TimeoutError:
                    pass
        finally:
            self.log("end", lock=name, token=lease.fencing_token, holding=holding, reason=end_reason)
            try:
                await ctx.__aexit__(None, None, None)
            finally:
                if end_reason != "lost" and lease.lost.is_set():
                    # lock()'s exit could not release: LeaseLost (the lease was gone) or
                    # ConnectionLost (no primary reached), which it logs; either way it sets lost
                    self.log("release_failed", lock=name, token=lease.fencing_token, holding=holding)


# =========================================================================== the cluster


class _Node:
    """One of the two node slots: fixed port, data dir and proxy; a process when running."""

    def __init__(self, name: str, root: Path, cfg: NemesisConfig, env: dict):
        self.name = name
        self.root = root
        self.cfg = cfg
        self.env = env
        self.data_dir = root / name
        self.port = 0
        self.proc = None  # ServerProcess
        self.proxy = None  # TcpProxy to this node's port
        self.incarnation = 0

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, standby_of: "_Node | None") -> None:
        from fastlock._testbase import ServerProcess

        args = ["--name", self.name]
        if standby_of is not None:
            args += ["--standby-of", standby_of.proxy.address, "--failover-after", f"{self.cfg.failover_after:g}",
                     "--promotion-grace", f"{self.cfg.promotion_grace:g}"]
        self.incarnation += 1
        last: Exception | None = None
        for _ in range(5):  # the port may be briefly unavailable right after the old process died
            srv = ServerProcess(self.data_dir, fsync=self.cfg.fsync, port=self.port, args=args, env=self.env,
                                log_path=self.root / f"{self.name}.log")
            try:
                srv.start(timeout=20)
            except RuntimeError as exc:
                last = exc
                srv.stop(5)
                time.sleep(0.3)
                continue
            self.proc, self.port = srv, srv.port
            return
        raise RuntimeError(f"node {self.name} did not start: {last}")

    def status(self) -> dict | None:
        if self.proc is None or not self.proc.alive:
            return None
        try:
            return self.proc.status(timeout=1.0)
        except Exception:  # noqa: BLE001 - a node that cannot answer has no status
            return None

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop(10)


class Nemesis:
    def __init__(self, cfg: NemesisConfig, root: Path):
        self.cfg = cfg
        self.root = root
        self.rng = random.Random(cfg.seed)
        bench_root = str(Path(__file__).resolve().parents[1])
        self.env = _fastlock_env([bench_root])
        self.nodes = {n: _Node(n, root, cfg, self.env) for n in ("a", "b")}
        self.primary, self.standby = self.nodes["a"], self.nodes["b"]
        self.workers: list[subprocess.Popen] = []
        self.faults: list[Fault] = []
        self.aborted: str | None = None
        self.store = root / "store.db"
        self.started = 0.0
        self.stopped_at = 0.0
        self._probe_feed = None
        self._probe_rest = ""
        self.leftover_checked = False
        self.leftover: list[dict] | str = []
        self._probe_grant_at = 0.0
        self.log = logging.getLogger("nemesis")

    # -- set-up and tear-down --------------------------------------------------------
    def start_cluster(self) -> None:
        from fastlock._testbase import TcpProxy, classify_fastlock

        a, b = self.nodes["a"], self.nodes["b"]
        a.start(None)
        # b needs a's proxy to start; a's and b's proxies target their fixed ports from then on
        a.proxy = TcpProxy(a.address, classify=classify_fastlock).start()
        b.start(a)
        b.proxy = TcpProxy(b.address, classify=classify_fastlock).start()
        b.proc.wait_for_log(r"paired: primary", 20)

    def start_workers(self) -> None:
        cfg = self.cfg
        conn = sqlite3.connect(self.store, isolation_level=None)
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute(_STORE_SCHEMA)
        from fastlock.fencing import SQLiteFence

        SQLiteFence(conn).ensure_schema()
        conn.close()
        wcfg = {"seed": cfg.seed, "workers": cfg.workers, "locks": cfg.locks or 2 * cfg.workers, "ttl": cfg.ttl, "wait": cfg.wait,
                "request_timeout": cfg.request_timeout, "store": str(self.store),
                "addresses": [self.nodes["a"].address, self.nodes["b"].address]}
        (self.root / "config.json").write_text(json.dumps(wcfg))
        for i in range(cfg.workers + 1):  # the last one is the prober
            err = open(self.root / f"worker-{i}.stderr", "w")
            self.workers.append(subprocess.Popen(
                [sys.executable, "-m", "benches.nemesis", "--worker", str(self.root), "--index", str(i)],
                cwd=str(self.root), env=self.env, stdin=subprocess.DEVNULL, stdout=err, stderr=err))
            err.close()

    def stop_all(self) -> None:
        """Stop every worker and server by PID (SIGTERM, then SIGKILL), and the proxies."""
        if not self.stopped_at:
            self.stopped_at = time.monotonic()
        for w in self.workers:
            if w.poll() is None:
                try:
                    w.send_signal(signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + 15
        for w in self.workers:
            try:
                w.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                w.kill()
                w.wait(5)
        if self.workers and not self.leftover_checked:
            self.leftover_checked = True
            self.leftover = self.held_after_workers_stopped()
        for node in self.nodes.values():
            try:
                node.stop()
            except Exception:  # noqa: BLE001 - keep stopping the others
                self.log.exception("stopping node %s", node.name)
            if node.proxy is not None:
                node.proxy.close()
        if self._probe_feed is not None:
            self._probe_feed.close()

    def held_after_workers_stopped(self) -> list[dict] | str:
        """Locks the primary still shows held once every worker has stopped (each
        released what it held on the way out): orphans, with their holder info."""
        from fastlock import cli, protocol as P

        node = self.primary
        if node.proc is None or not node.proc.alive:
            return "no primary running"
        held = []
        try:
            for i in range(self.cfg.locks or 2 * self.cfg.workers):
                info = cli._admin(("127.0.0.1", node.port), None, P.OP_HOLDER, f"acct/{i}", reply_timeout=2.0)
                if info:
                    held.append({"lock": f"acct/{i}", **{k: info.get(k) for k in ("token", "client", "remaining_ms")}})
        except Exception as exc:  # noqa: BLE001 - reported instead
            return f"{type(exc).__name__}: {exc}"
        return held

    # -- observation --------------------------------------------------------------------
    def last_probe_grant(self) -> float:
        """When the prober last received a grant (read from its event log as it grows)."""
        if self._probe_feed is None:
            path = self.root / f"worker-{self.cfg.workers}.jsonl"
            if not path.exists():
                return 0.0
            self._probe_feed = open(path)
        self._probe_rest += self._probe_feed.read()
        *lines, self._probe_rest = self._probe_rest.split("\n")  # the last piece may be half written
        for line in lines:
            try:
                ev = json.loads(line)
            except ValueError:
                continue
            if ev.get("ev") == "grant":
                self._probe_grant_at = ev["at"]
        return self._probe_grant_at

    def dead_worker(self) -> str | None:
        """The last lines of a worker process that exited (they never exit on their own)."""
        for i, w in enumerate(self.workers):
            if w.poll() is not None:
                tail = (self.root / f"worker-{i}.stderr").read_text(errors="replace").strip().splitlines()[-3:]
                return f"worker {i} exited with {w.returncode}: " + " | ".join(tail)
        return None

    def healthy(self, since: float) -> tuple[bool, str]:
        p, s = self.primary.status(), self.standby.status()
        if p is None:
            return False, f"primary {self.primary.name} does not answer"
        if p["role"] != "primary" or p["replication"]["fenced"] or p.get("grace_remaining_ms", 0) > 0:
            return False, (f"primary {self.primary.name}: role {p['role']}, fenced {p['replication']['fenced']}, "
                           f"grace {p.get('grace_remaining_ms')} ms")
        if s is None:
            return False, f"standby {self.standby.name} does not answer"
        r = s["replication"]
        if s["role"] != "standby" or not r.get("connected") or not r.get("synced") or not r.get("pair_confirmed"):
            return False, (f"standby {self.standby.name}: role {s['role']}, connected {r.get('connected')}, "
                           f"synced {r.get('synced')}, paired {r.get('pair_confirmed')}")
        if self.last_probe_grant() <= since:
            return False, "the prober was granted nothing since the re-pair"
        return True, "healthy"

    def wait_healthy(self, since: float, timeout: float) -> float | None:
        deadline = time.monotonic() + timeout
        why = ""
        while time.monotonic() < deadline:
            dead = self.dead_worker()
            if dead:
                self.aborted = dead
                return None
            ok, why = self.healthy(since)
            if ok:
                return time.monotonic()
            time.sleep(0.1)
        self.log.warning("not healthy after %.0f s: %s", timeout, why)
        self.aborted = f"cluster not healthy {timeout:.0f} s after fault {len(self.faults)}: {why}"
        return None

    # -- faults ---------------------------------------------------------------------------
    def _promoted(self, node: _Node, start_line: int, fault: Fault) -> bool:
        try:
            node.proc.wait_for_log(r"PROMOTED", self.cfg.promote_timeout, start=start_line)
        except RuntimeError as exc:
            fault.note = f"{node.name} did not promote: {str(exc).splitlines()[0]}"
            return False
        fault.promoted_s = time.monotonic() - fault.at
        return True

    def inject(self, kind: str) -> Fault:
        p, s = self.primary, self.standby
        fault = Fault(index=len(self.faults) + 1, kind=kind, old_primary=p.name)
        self.faults.append(fault)
        mark = len(s.proc.lines)
        promoted = False
        if kind == "kill":
            fault.at = time.monotonic()
            p.proc.kill()
            promoted = self._promoted(s, mark, fault)
            fault.ended_s = time.monotonic() - fault.at
        elif kind == "pause":
            fault.at = time.monotonic()
            p.proc.pause()
            try:
                promoted = self._promoted(s, mark, fault)
                time.sleep(self.rng.uniform(0.0, 1.0))  # the experiment: how long past the promotion
            finally:
                p.proc.resume()
            fault.ended_s = time.monotonic() - fault.at
        elif kind == "partition":
            fault.mode = self.rng.choice(["blackhole", "reset"])
            fault.at = time.monotonic()
            p.proxy.blackhole("replication")
            if fault.mode == "reset":
                p.proxy.cut("replication")
            try:
                promoted = self._promoted(s, mark, fault)
                time.sleep(self.rng.uniform(0.0, 1.0))
            finally:
                p.proxy.heal()
            fault.ended_s = time.monotonic() - fault.at
        elif kind == "promote":
            fault.at = time.monotonic()
            res = subprocess.run([sys.executable, "-m", "fastlock", "promote", "--server", s.address,
                                  "--timeout", "20"], capture_output=True, text=True, timeout=40,
                                 cwd=str(self.root), env=self.env)
            fault.ended_s = time.monotonic() - fault.at
            if res.returncode != 0:
                fault.note = f"promote exited {res.returncode}: {(res.stderr or res.stdout).strip()[-300:]}"
            promoted = self._promoted(s, mark, fault)
        else:
            raise ValueError(f"unknown fault kind {kind!r}")

        if not promoted:
            # no failover: the old primary (if it lives) stays primary; restart it if it died
            if not p.proc.alive:
                p.start(None)
            fault.new_primary = p.name
            healthy_at = self.wait_healthy(time.monotonic(), self.cfg.heal_timeout)
            fault.healthy_s = None if healthy_at is None else healthy_at - fault.at
            return fault

        fault.new_primary = s.name
        self.primary, self.standby = s, p
        if p.proc.alive:
            time.sleep(self.rng.uniform(0.0, 1.5))  # clients may still reach the old primary meanwhile
            p.proc.stop(10)
        # the documented re-pairing: same port, same data dir, --standby-of the new primary
        p.start(s)
        try:
            p.proc.wait_for_log(r"paired: primary", 20)
        except RuntimeError as exc:
            fault.note = (fault.note + "; " if fault.note else "") + f"re-pair: {str(exc).splitlines()[0]}"
        repaired = time.monotonic()
        fault.repaired_s = repaired - fault.at
        healthy_at = self.wait_healthy(repaired, self.cfg.heal_timeout)
        fault.healthy_s = None if healthy_at is None else healthy_at - fault.at
        return fault

    def run(self) -> None:
        cfg = self.cfg
        self.started = time.monotonic()
        self.start_cluster()
        self.start_workers()
        time.sleep(cfg.warmup)  # load before the first fault (the experiment, not a wait for a condition)
        if self.wait_healthy(self.started, cfg.heal_timeout) is None:
            return
        end = time.monotonic() + cfg.duration
        order: list[str] = []
        while time.monotonic() < end and (not cfg.max_faults or len(self.faults) < cfg.max_faults):
            if not order:
                order = list(cfg.kinds)
                self.rng.shuffle(order)
            fault = self.inject(order.pop(0))
            self.log.info("fault %d %s%s: promoted %s, healthy %s %s", fault.index, fault.kind,
                          f"/{fault.mode}" if fault.mode else "", _s(fault.promoted_s), _s(fault.healthy_s),
                          fault.note)
            if self.aborted:
                return
            time.sleep(self.rng.uniform(0.5, 1.5))  # steady load between faults


def _longest_gap(times: list[float], start: float, end: float, clip: bool = False) -> float | None:
    """The longest interval from ``start`` without any of ``times`` (sorted):
    up to the first time after ``end``, or with ``clip`` up to ``end`` at most;
    None if no time follows ``start``."""
    i = bisect.bisect_right(times, start)
    if i >= len(times):
        return None
    gap, prev = 0.0, start
    while i < len(times):
        gap = max(gap, (min(times[i], end) if clip else times[i]) - prev)
        if times[i] > end:
            break
        prev = times[i]
        i += 1
    return gap


def _s(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}s"


# =========================================================================== the report


def _read_events(root: Path, workers: int) -> list[dict]:
    events = []
    for i in range(workers + 1):
        path = root / f"worker-{i}.jsonl"
        if not path.exists():
            continue
        for line in path.read_text().splitlines():
            try:
                ev = json.loads(line)
            except ValueError:  # a line cut by SIGKILL
                continue
            ev["worker"] = i
            events.append(ev)
    return events


_NUMBERS = re.compile(r"\d+(\.\d+)?")


def _normalise(msg: str) -> str:
    return _NUMBERS.sub("N", msg or "")[:200]


def build_report(nem: Nemesis, elapsed: float) -> dict:
    from fastlock._testbase import GrantRecord, Holding, StoreWrite, check_grants, check_holdings, check_store

    cfg = nem.cfg
    events = _read_events(nem.root, cfg.workers)
    grants = [e for e in events if e["ev"] == "grant"]
    conn = sqlite3.connect(nem.store, timeout=10)
    try:
        rows = conn.execute("SELECT seq, lock, token, holding, at FROM writes").fetchall()
    finally:
        conn.close()
    store_violations = check_store(StoreWrite(*r) for r in rows)
    # the prober's locks are all fresh: its grants are checked as one sequence
    grant_violations = check_grants(GrantRecord("probe/*" if g.get("probe") else g["lock"], g["token"], g["holding"],
                                                g["sent"], g["at"]) for g in grants)
    ends = {e["holding"]: e["at"] for e in events if e["ev"] == "end"}
    holdings = [Holding(g["lock"], g["token"], g["holding"], g["at"], ends[g["holding"]])
                for g in grants if g["holding"] in ends]
    holder_overlaps = check_holdings(holdings)

    lost_during = [e for e in events if e["ev"] == "end" and e["reason"] == "lost"]
    release_failed = [e for e in events if e["ev"] == "release_failed"]
    stale = [e for e in events if e["ev"] == "write" and not e["ok"]]
    errors = [e for e in events if e["ev"] == "error"]
    loop_errors = [e for e in events if e["ev"] == "loop_error"]
    not_acquired = [e for e in events if e["ev"] == "not_acquired"]

    def by_type(evs: list[dict]) -> dict:
        out: dict[str, dict] = {}
        for e in evs:
            key = f"{e.get('op', '-')}:{e.get('type') or 'LockNotAcquired'}"
            slot = out.setdefault(key, {"count": 0, "messages": Counter()})
            slot["count"] += 1
            slot["messages"][_normalise(e.get("msg") or "")] += 1
        return {k: {"count": v["count"], "messages": v["messages"].most_common(4)} for k, v in sorted(out.items())}

    grant_times = sorted(g["at"] for g in grants)
    windows = []  # (start, end, fault) of every fault, until healthy (or the next fault)
    for n, f in enumerate(nem.faults):
        end = f.at + (f.healthy_s if f.healthy_s is not None else cfg.heal_timeout)
        if n + 1 < len(nem.faults):
            end = min(end, nem.faults[n + 1].at)
        windows.append((f.at, end, f))
    fault_rows = []
    for start, end, f in windows:
        i = bisect.bisect_right(grant_times, start)
        f.first_grant_s = grant_times[i] - start if i < len(grant_times) else None
        f.no_grant_s = _longest_gap(grant_times, start, end)
        fault_rows.append(dataclasses.asdict(f))
    steady_gap = 0.0  # the longest window without grants outside every fault window: the baseline
    prev = grant_times[0] if grant_times else nem.stopped_at
    for start, end, _ in windows + [(nem.stopped_at, nem.stopped_at, None)]:
        if start > prev:
            steady_gap = max(steady_gap, _longest_gap(grant_times, prev, start, clip=True) or 0.0)
        prev = max(prev, end)
    bound = cfg.failover_after + cfg.promotion_grace + 1.0
    kills = [f for f in nem.faults if f.kind == "kill"]
    kill_windows = [f.no_grant_s for f in kills]
    over_bound = [f.index for f in kills if f.no_grant_s is None or f.no_grant_s > bound]

    def phase_of(t: float) -> str:
        for start, end, f in windows:
            if start <= t <= end:
                return f.kind
        return "steady"

    grant_of = {g["holding"]: g for g in grants}

    def granted_mid_fault(e: dict) -> bool:
        """Was this holding granted after a fault began and before the standby promoted?
        (by the old primary, whose records could no longer reach the standby)"""
        g = grant_of.get(e.get("holding"))
        if g is None:
            return False
        for f in nem.faults:
            if f.at <= g["at"] <= f.at + (f.promoted_s if f.promoted_s is not None else cfg.heal_timeout):
                return True
        return False

    lost_mid = [e for e in lost_during if granted_mid_fault(e)]
    failed_mid = [e for e in release_failed if granted_mid_fault(e)]
    errors_by_fault = {}
    for e in errors + loop_errors:
        slot = errors_by_fault.setdefault(phase_of(e["at"]), Counter())
        slot[f"{e.get('op', 'loop')}:{e.get('type')}"] += 1
    for e in lost_during + release_failed:
        slot = errors_by_fault.setdefault(phase_of(e["at"]), Counter())
        slot["lease lost" if e["ev"] == "end" else "release failed"] += 1
    early = [e for e in errors if e["op"] in ("acquire", "probe-acquire") and e["at"] - e["sent"] < cfg.wait]
    connection_lost = [e for e in errors if e["type"] == "ConnectionLost"]
    counter_msgs = Counter()
    for i in range(cfg.workers + 1):
        path = nem.root / f"worker-{i}.log"
        if path.exists():
            for line in path.read_text(errors="replace").splitlines():
                if " WARNING " in line or " ERROR " in line:
                    counter_msgs[_normalise(line.split(" ", 4)[-1])] += 1

    report = {
        "config": dataclasses.asdict(nem.cfg),
        "elapsed_s": round(elapsed, 1),
        "aborted": nem.aborted,
        "faults": len(nem.faults),
        "faults_by_kind": dict(Counter(f.kind + (f"/{f.mode}" if f.mode else "") for f in nem.faults)),
        "faults_without_promotion": [f.index for f in nem.faults if f.promoted_s is None],
        "grants": len(grants),
        "grants_by_worker": dict(sorted(Counter("probe" if g.get("probe") else f"w{g['worker']}"
                                                for g in grants).items())),
        "store_rows": len(rows),
        "safety": {
            "violations": len(store_violations) + len(grant_violations),
            "store": store_violations[:20],
            "grants": grant_violations[:20],
        },
        "availability": {
            "ttl_s": cfg.ttl,
            "ttl_exceeds_failover_plus_request_timeout": cfg.ttl > cfg.failover_after + cfg.request_timeout,
            "leases_lost": len(lost_during) - len(lost_mid),
            "releases_failed_at_exit": len(release_failed) - len(failed_mid),
            "leases_lost_granted_mid_fault": len(lost_mid),
            "releases_failed_granted_mid_fault": len(failed_mid),
            "held_after_workers_stopped": nem.leftover,
            "stale_writes_refused": len(stale),
            "connection_lost_surfaced": len(connection_lost),
            "errors_surfaced": len(errors),
            "errors_by_op_and_type": by_type(errors),
            "acquire_errors_before_wait_ran_out": len(early),
            "errors_by_fault_kind": {k: dict(v) for k, v in sorted(errors_by_fault.items())},
            "not_acquired_within_wait": len(not_acquired),
            "loop_errors": len(loop_errors),
            "loop_error_messages": Counter(_normalise(e["msg"]) for e in loop_errors).most_common(4),
            "holders_overlapping_client_view": len(holder_overlaps),
            "holder_overlap_samples": holder_overlaps[:5],
            "outage_bound_s": bound,
            "kill_no_grant_s": [None if w is None else round(w, 3) for w in kill_windows],
            "kill_no_grant_max_s": max((w for w in kill_windows if w is not None), default=None),
            "kills_over_bound": over_bound,
            "no_grant_max_s_by_kind": {k: round(max(f.no_grant_s or 0.0 for f in nem.faults if f.kind == k), 3)
                                       for k in sorted({f.kind for f in nem.faults})},
            "steady_no_grant_max_s": round(steady_gap, 3),
        },
        "client_log_warnings": counter_msgs.most_common(8),
        "fault_log": fault_rows,
    }
    return report


def print_report(r: dict) -> None:
    a, s = r["availability"], r["safety"]
    cfg = r["config"]
    print(f"\nnemesis: {r['faults']} faults in {r['elapsed_s']} s (seed {cfg['seed']}, failover_after "
          f"{cfg['failover_after']} s, promotion_grace {cfg['promotion_grace']} s, ttl {cfg['ttl']} s, "
          f"wait {cfg['wait']} s, request_timeout {cfg['request_timeout']} s, {cfg['workers']} workers)")
    if r["aborted"]:
        print(f"  ABORTED: {r['aborted']}")
    print("  faults by kind:      " + ", ".join(f"{k} {v}" for k, v in sorted(r["faults_by_kind"].items())))
    if r["faults_without_promotion"]:
        print(f"  no promotion after faults {r['faults_without_promotion']}")
    print(f"  grants:              {r['grants']} ("
          + ", ".join(f"{k} {v}" for k, v in r["grants_by_worker"].items()) + f"); store rows {r['store_rows']}")
    print(f"  SAFETY violations:   {s['violations']}")
    for v in s["store"] + s["grants"]:
        print(f"    - {v}")
    print(f"  leases lost by lock() holders (ttl > F + request_timeout: "
          f"{a['ttl_exceeds_failover_plus_request_timeout']}): {a['leases_lost']}; releases failed at lock() exit "
          f"(lease.lost set by the exit): {a['releases_failed_at_exit']}")
    print(f"    not counted above - granted by the old primary after the fault began, before the promotion "
          f"(never replicated): {a['leases_lost_granted_mid_fault']} lost, {a['releases_failed_granted_mid_fault']} "
          f"failed releases")
    print(f"  locks still held on the primary after every worker stopped (orphans): {a['held_after_workers_stopped']}")
    print(f"  stale writes refused by the fence: {a['stale_writes_refused']}")
    print(f"  ConnectionLost surfaced: {a['connection_lost_surfaced']}; errors surfaced: {a['errors_surfaced']} "
          f"({a['acquire_errors_before_wait_ran_out']} from acquires before their {cfg['wait']:g} s wait ran out); "
          f"LockNotAcquired: {a['not_acquired_within_wait']}; loop errors: {a['loop_errors']}")
    for key, v in a["errors_by_op_and_type"].items():
        print(f"    {key}: {v['count']}")
        for msg, n in v["messages"]:
            print(f"        {n:4d} x {msg}")
    for msg, n in a["loop_error_messages"]:
        print(f"    loop: {n} x {msg}")
    print("  errors and lost leases by fault window: " + "; ".join(
        f"{k}: " + ", ".join(f"{t} {n}" for t, n in sorted(v.items())) for k, v in a["errors_by_fault_kind"].items()))
    print(f"  holders overlapping (client view): {a['holders_overlapping_client_view']}")
    for v in a["holder_overlap_samples"][:3]:
        print(f"    - {v}")
    print(f"  longest window without a grant after each kill (bound F + grace + 1 s = {a['outage_bound_s']:.1f} s): "
          + ", ".join("-" if w is None else f"{w:.2f}" for w in a["kill_no_grant_s"])
          + (f"; over the bound: faults {a['kills_over_bound']}" if a["kills_over_bound"] else ""))
    print("  longest window without a grant, by fault kind: "
          + ", ".join(f"{k} {v:.2f}" for k, v in a["no_grant_max_s_by_kind"].items())
          + f"; outside faults (baseline): {a['steady_no_grant_max_s']:.2f}")
    print("  fault log (s after the fault: promoted / ended / re-paired / healthy / first grant / longest no-grant):")
    for f in r["fault_log"]:
        kind = f["kind"] + (f"/{f['mode']}" if f["mode"] else "")
        print(f"    {f['index']:3d} {kind:20s} {f['old_primary']}->{f['new_primary']}  {_s(f['promoted_s']):>7} "
              f"{_s(f['ended_s']):>7} {_s(f['repaired_s']):>7} {_s(f['healthy_s']):>7} "
              f"{_s(f['first_grant_s']):>7} {_s(f['no_grant_s']):>7}  {f['note']}")
    if r["client_log_warnings"]:
        print("  client log warnings (normalised):")
        for msg, n in r["client_log_warnings"]:
            print(f"    {n:5d} x {msg}")


def run_nemesis(cfg: NemesisConfig, root: str | None = None) -> dict:
    """Run the nemesis (see the module docstring) and return its report (a dict).

    ``root``: a directory for data dirs, logs, the store and the worker event
    logs (kept); by default a temporary one, removed afterwards.
    """
    own = root is None
    base = Path(tempfile.mkdtemp(prefix="fastlock-nemesis-") if own else root)
    base.mkdir(parents=True, exist_ok=True)
    nem = Nemesis(cfg, base)
    atexit.register(nem.stop_all)
    t0 = time.monotonic()
    try:
        nem.run()
    except Exception as exc:  # noqa: BLE001 - reported, after stopping everything
        nem.aborted = f"{type(exc).__name__}: {exc}"
        nem.log.exception("nemesis run failed")
    finally:
        nem.stop_all()
        atexit.unregister(nem.stop_all)
    report = build_report(nem, time.monotonic() - t0)
    report["run_dir"] = str(base)
    if own:
        shutil.rmtree(base, ignore_errors=True)
    return report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benches.nemesis", description=__doc__.split("\n")[0])
    ap.add_argument("--duration", type=float, default=60.0, help="seconds during which faults are started")
    ap.add_argument("--seed", type=int, default=NemesisConfig.seed)
    ap.add_argument("--failover-after", type=float, default=1.0, help="the standby's --failover-after, seconds")
    ap.add_argument("--promotion-grace", type=float, default=2.0, help="seconds")
    ap.add_argument("--workers", type=int, default=6, help="worker processes")
    ap.add_argument("--locks", type=int, default=0, help="lock names (default: twice as many as workers)")
    ap.add_argument("--ttl", type=float, default=8.0, help="lock() TTL, seconds")
    ap.add_argument("--wait", type=float, default=20.0, help="lock() wait, seconds")
    ap.add_argument("--request-timeout", type=float, default=5.0, help="the clients' request_timeout, seconds")
    ap.add_argument("--kinds", default=",".join(KINDS), help="fault kinds to cycle through")
    ap.add_argument("--max-faults", type=int, default=0)
    ap.add_argument("--heal-timeout", type=float, default=30.0, help="seconds to become healthy after a fault")
    ap.add_argument("--fsync", default="always", choices=("always", "interval", "never"))
    ap.add_argument("--json", metavar="PATH", help="also write the report as JSON")
    ap.add_argument("--keep", metavar="DIR", help="keep data dirs, logs and event logs in DIR")
    ap.add_argument("--worker", metavar="DIR", help=argparse.SUPPRESS)
    ap.add_argument("--index", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return worker_main(args.worker, args.index)
    kinds = tuple(k for k in args.kinds.split(",") if k)
    bad = [k for k in kinds if k not in KINDS]
    if bad or not kinds:
        ap.error(f"--kinds: unknown {bad}; choose from {','.join(KINDS)}")
    cfg = NemesisConfig(duration=args.duration, seed=args.seed, failover_after=args.failover_after,
                        promotion_grace=args.promotion_grace, workers=args.workers, locks=args.locks,
                        ttl=args.ttl, wait=args.wait, request_timeout=args.request_timeout, kinds=kinds,
                        heal_timeout=args.heal_timeout, fsync=args.fsync, max_faults=args.max_faults)
    if cfg.ttl <= cfg.failover_after + cfg.request_timeout:
        print(f"note: ttl {cfg.ttl} s is not above failover_after + request_timeout; lost leases are expected",
              file=sys.stderr)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    report = run_nemesis(cfg, args.keep)
    print_report(report)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2, default=str))
    return 0 if report["safety"]["violations"] == 0 and not report["aborted"] else 1


if __name__ == "__main__":
    sys.exit(main())
