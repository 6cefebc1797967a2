"""Crash run: SIGKILL the server at random moments under load and check durability.

    python -m benches.crash [--kills 100] [--workers 8] [--locks 6] [--seed N]
                            [--min-delay 0.02] [--max-delay 0.3] [--json PATH]

What runs
---------
One real ``fastlock serve --fsync always`` process on 127.0.0.1 and, in this
process, ``--workers`` asyncio tasks, each with its own client connection.
Each worker loops: pick one of ``--locks`` lock names at random,
``acquire(ttl=30 s, wait=5 s)``, hold a few random milliseconds, write one row
to a shared SQLite ledger through :class:`fastlock.fencing.SQLiteFence` with
its fencing token, hold a little more, ``release``.

A controller sleeps a random delay drawn from a seeded RNG (the experiment,
not a wait), sends the server SIGKILL, stops every worker (a client would ride
through a lost server until its call's deadline, so the controller cancels the
workers' tasks instead; a call cut off this way counts as one cut off by the
dead connection, and an acquire cancelled in flight is cancelled by owner on
the client's next connection), waits (bounded) for them to end, restarts the server on the SAME data dir and the
SAME port, and checks, before any worker touches the new server:

* **no acknowledged grant forgotten**: every lease whose acquire was
  acknowledged and whose release was not yet sent is still held, with the
  same token (``client.check(name, token)``);
* the server's fencing counter is at least every acknowledged token's counter.

Then the workers resume: a worker that was holding a lease at the kill
extends it with its lease (a recovered lease must accept that), does its
fenced write if it had not yet, and releases it (must succeed).  Every grant
acknowledged after a restart must carry a token strictly greater than every
token acknowledged before the kill.  A release that was acknowledged but lost
in the crash is allowed (``fastlock.server``: releases are acknowledged before
their record is durable; the lock then stays held by that lease until its TTL
or until the holder releases it again): every release acknowledged since the
last kill (in a worker's loop or while it resumes) is checked after the
restart; those the crash undid are counted, and the holder releases them again.
An acquire cut off by a kill is withdrawn by the client (cancel by owner) on
its next connection; if the server had granted it, a later kill can undo that
withdrawal the same way, and nobody holds the lease to release it again: such a
grant stays held until its TTL, and is counted (``lost_cancels``) rather than
reported.

After the last round every client reconnects (sending the withdrawals it still
owes), and every lock must be free but for such undone withdrawals; a clean stop
and a restart must leave exactly the same holders (a clean stop flushes
everything).  The fenced ledger must be consistent: its rows are exactly the
writes whose transaction committed, no lock's token ever goes down from one
row to the next, no fenced write was refused as stale (a refusal would mean
someone else wrote with a newer lease while the writer still believed it held
the lock), and :class:`fastlock._testbase.HistoryChecker` finds no two
client-side holdings of one lock overlapping and no token that does not grow.

Options: ``--snapshot-every N`` makes the server snapshot often, so kills also
land in snapshot writes and segment deletion (each restart counts the records
towards the next snapshot from zero, so a round must log that many records for
one to start: ``--min-round-grants`` starts a round's random delay only once the
round has made that many grants, however slow the machine); ``--startup-kill-every N`` kills
the restarting server a second time at a random moment of its start-up (often
before it listens) after every Nth kill; ``--fsync interval|never`` runs the
same checks in a relaxed mode (SIGKILL keeps the page cache, so those modes
must lose nothing acknowledged here either; a power cut is another matter,
see ``tests/test_crash.py``).

``tests/test_crash.py`` runs this with a small count; this module's ``main``
runs the bigger one and prints kills, grants, violations.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import random
import re
import shutil
import sqlite3
import sys
import tempfile
import time

import fastlock
from fastlock._testbase import HistoryChecker, ServerProcess
from fastlock.errors import ConnectionLost, LeaseLost, LockNotAcquired, StaleFencingToken
from fastlock.fencing import SQLiteFence

COUNTER_MASK = (1 << 40) - 1
_RECOVERED = re.compile(r"recovered (\d+) leases.* in ([0-9.]+) ms")

IDLE, ACQUIRING, HELD, RELEASING = "idle", "acquiring", "held", "releasing"


@dataclasses.dataclass
class CrashConfig:
    kills: int = 20
    workers: int = 8
    locks: int = 6
    seed: int = 20251130
    min_delay: float = 0.02     # s of load before a kill (uniform in [min, max])
    max_delay: float = 0.3
    max_hold: float = 0.004     # s, each of the two random holds around the write
    ttl: float = 30.0           # s: far longer than any restart + check
    wait: float = 5.0           # s a worker waits in a lock's queue
    fsync: str = "always"
    snapshot_every: int | None = None  # --snapshot-every: kills also land in snapshots/compaction
    extra_args: tuple = ()
    worker_exit_timeout: float = 10.0  # s for all workers to notice a kill
    startup_kill_every: int = 0  # every Nth kill is followed by a second one during the restart
    startup_kill_max_delay: float = 0.15  # s after starting the process (uniform in [0, max])
    min_round_grants: int = 0  # grants a round makes before its random delay to the kill starts
    round_work_timeout: float = 30.0  # s: the longest wait for them (then the delay starts anyway)


@dataclasses.dataclass
class CrashReport:
    seed: int = 0
    kills: int = 0
    grants: int = 0                 # acquires acknowledged
    releases: int = 0               # releases acknowledged
    writes: int = 0                 # fenced ledger rows committed
    startup_kills: int = 0          # kills of a restarting server before it listened (in recovery)
    startup_kills_after_listening: int = 0
    held_at_kill: int = 0           # leases held across a kill, each checked after restart
    resumed_writes: int = 0         # fenced writes done after a restart with a pre-crash lease
    lost_releases: int = 0          # acknowledged releases undone by a crash (allowed, see docstring)
    lost_cancels: int = 0           # withdrawn grants of cut-off acquires a crash brought back (allowed)
    ambiguous_releases: int = 0     # release sent, connection died before the reply
    unacked_acquires: int = 0       # acquire sent, connection died before the reply
    acquire_timeouts: int = 0       # wait ran out (a lock held over a crash until its holder resumed)
    ledger_rows: int = 0
    snapshots: int = 0              # snapshots the server wrote (each may be cut short by a kill)
    segments_deleted: int = 0       # WAL segments removed by compaction
    worker_exit_s_max: float = 0.0  # kill -> every worker saw its connection drop, seconds
    restart_s_max: float = 0.0      # process start -> "listening on", seconds
    restart_s_mean: float = 0.0
    recover_ms_max: float = 0.0     # the server's own "recovered ... in X ms"
    elapsed_s: float = 0.0
    violations: list = dataclasses.field(default_factory=list)

    def summary(self) -> str:
        return (f"kills={self.kills} grants={self.grants} releases={self.releases} writes={self.writes} "
                f"ledger_rows={self.ledger_rows} snapshots={self.snapshots} "
                f"segments_deleted={self.segments_deleted} startup_kills={self.startup_kills} "
                f"(+{self.startup_kills_after_listening} after listening) held_at_kill={self.held_at_kill} "
                f"resumed_writes={self.resumed_writes} lost_acked_releases={self.lost_releases} "
                f"lost_cancels={self.lost_cancels} "
                f"ambiguous_releases={self.ambiguous_releases} unacked_acquires={self.unacked_acquires} "
                f"acquire_timeouts={self.acquire_timeouts} worker_exit_max={self.worker_exit_s_max * 1000:.0f}ms "
                f"restart_max={self.restart_s_max * 1000:.0f}ms "
                f"restart_mean={self.restart_s_mean * 1000:.0f}ms recover_max={self.recover_ms_max:.1f}ms "
                f"elapsed={self.elapsed_s:.1f}s seed={self.seed} violations={len(self.violations)}")


class _Run:
    """Shared state of the whole run (the test process is single-threaded asyncio)."""

    def __init__(self, cfg: CrashConfig, report: CrashReport):
        self.cfg = cfg
        self.report = report
        self.stopped = False
        self.round = 0
        self.max_acked_before = -1  # highest token acknowledged before the last kill
        self.max_acked = -1
        self.acked_writes: list[tuple] = []
        self.history = HistoryChecker()
        self.round_grants = 0
        self.round_worked = asyncio.Event()  # set once the round made cfg.min_round_grants grants
        #: (lock name, correlation id) of acquires cut off by a kill before the last one: the
        #: withdrawal of each may have been answered, then undone by a later kill (module docstring)
        self.cut_before_a_kill: set[tuple[str, str]] = set()

    def new_round(self, r: int) -> None:
        self.round = r
        self.stopped = False
        self.round_grants = 0
        self.round_worked.clear()

    def violation(self, what: str) -> None:
        self.report.violations.append(f"round {self.round}: {what}")

    def granted(self, lease) -> None:
        self.report.grants += 1
        self.round_grants += 1
        if self.round_grants >= self.cfg.min_round_grants:
            self.round_worked.set()
        tok = lease.fencing_token
        if tok <= self.max_acked_before:
            self.violation(f"{lease.name}: token {tok} granted after a restart is not above "
                           f"{self.max_acked_before}, acknowledged before the kill")
        self.max_acked = max(self.max_acked, tok)
        try:
            self.history.held(lease.name, tok, time.monotonic())
        except AssertionError as exc:
            self.violation(str(exc))

    def stops_holding(self, lease) -> None:
        try:
            self.history.released(lease.name, lease.fencing_token, time.monotonic())
        except (AssertionError, KeyError) as exc:
            self.violation(f"history: {exc!r}")


class _Worker:
    def __init__(self, idx: int, client, db_path: str, run: _Run, rng: random.Random):
        self.idx = idx
        self.client = client
        self.run = run
        self.rng = rng
        self.db = sqlite3.connect(db_path, timeout=10, isolation_level=None)
        self.db.execute("PRAGMA synchronous=OFF")
        self.fence = SQLiteFence(self.db)
        self.phase = IDLE
        self.lease = None
        self.wrote = False
        self.seq = 0
        self.relapsed: list = []  # acknowledged releases the crash undid: released again on resume
        #: tokens of relapsed leases whose new release was sent but not answered (cut off by a kill)
        self.relapse_sent: set[int] = set()
        self.released: list = []  # leases whose release was acknowledged since the last kill
        #: (lock name, correlation id) of acquires cut off by a kill: the client withdraws each
        #: (cancel by owner) on its next connection
        self.cut_acquires: list[tuple[str, str]] = []

    def close(self) -> None:
        self.db.close()

    def _write(self) -> None:
        lease = self.lease
        self.seq += 1
        try:
            with self.fence.fenced(lease.name, lease.fencing_token) as cur:
                cur.execute("INSERT INTO ledger (lock, token, worker, seq) VALUES (?, ?, ?, ?)",
                            (lease.name, lease.fencing_token, self.idx, self.seq))
        except StaleFencingToken as exc:
            self.run.violation(f"worker {self.idx}: fenced write refused while holding {lease.name} "
                               f"token {lease.fencing_token}: {exc}")
            return
        self.wrote = True
        self.run.acked_writes.append((lease.name, lease.fencing_token, self.idx, self.seq))
        self.run.report.writes += 1

    async def _release_acked(self, lease) -> None:
        """Release ``lease``; once acknowledged it is checked after the next restart."""
        await self.client.release(lease)
        self.released.append(lease)

    async def _release(self) -> None:
        lease = self.lease
        self.run.stops_holding(lease)
        self.phase = RELEASING
        await self._release_acked(lease)
        self.run.report.releases += 1
        self.phase = IDLE
        self.lease = None

    async def resume(self) -> None:
        """After a restart: finish what the crash interrupted."""
        run = self.run
        while self.relapsed:
            lease = self.relapsed[0]
            sent_before = lease.fencing_token in self.relapse_sent  # then the server may have applied it
            self.relapse_sent.add(lease.fencing_token)
            try:
                await self._release_acked(lease)
            except LeaseLost:
                if not sent_before:
                    run.violation(f"worker {self.idx}: lease {lease.name} token {lease.fencing_token} was held "
                                  f"after the restart, but releasing it failed")
            self.relapse_sent.discard(lease.fencing_token)
            self.relapsed.pop(0)
        if self.phase == HELD:
            try:
                self.lease = await self.client.extend(self.lease)
            except LeaseLost:
                run.violation(f"worker {self.idx}: recovered lease {self.lease.name} token "
                              f"{self.lease.fencing_token} could not be extended")
                run.stops_holding(self.lease)
                self.phase, self.lease = IDLE, None
                return
            if not self.wrote:
                self._write()
                run.report.resumed_writes += 1
            try:
                await self._release()
            except LeaseLost:
                run.violation(f"worker {self.idx}: recovered lease {self.lease.name} token "
                              f"{self.lease.fencing_token} could not be released")
                self.phase, self.lease = IDLE, None
        elif self.phase == RELEASING:
            # outcome unknown: the server may or may not have seen it; either is fine
            try:
                await self._release_acked(self.lease)
            except LeaseLost:
                pass
            self.phase, self.lease = IDLE, None

    async def work(self) -> None:
        """One round: resume, then acquire/write/release until the controller kills the server."""
        run, cfg, rng = self.run, self.run.cfg, self.rng
        try:
            await self.resume()
            while not run.stopped:
                name = f"crash/lock-{rng.randrange(cfg.locks)}"
                self.phase = ACQUIRING
                asking = (name, f"w{self.idx}-{self.seq + 1}")
                try:
                    lease = await self.client.acquire(name, ttl=cfg.ttl, wait=cfg.wait, correlation_id=asking[1])
                except LockNotAcquired:
                    self.phase = IDLE
                    run.report.acquire_timeouts += 1
                    continue
                except (ConnectionLost, asyncio.CancelledError):
                    self.cut_acquires.append(asking)
                    raise
                self.phase, self.lease, self.wrote = HELD, lease, False
                run.granted(lease)
                await asyncio.sleep(rng.uniform(0, cfg.max_hold))
                if run.stopped:
                    return
                self._write()
                await asyncio.sleep(rng.uniform(0, cfg.max_hold))
                if run.stopped:
                    return
                await self._release()
        except (ConnectionLost, asyncio.CancelledError):  # the kill (see run_crash)
            if self.phase == ACQUIRING:
                self.phase = IDLE  # the client cancels it (by owner) when it reconnects
                run.report.unacked_acquires += 1
            elif self.phase == RELEASING:
                run.report.ambiguous_releases += 1


_SNAPSHOT = re.compile(r"snapshot \S+ written: .* (\d+) segments deleted")


def _count_snapshots(srv: ServerProcess, report: CrashReport) -> None:
    for line in list(srv.lines):
        m = _SNAPSHOT.search(line)
        if m:
            report.snapshots += 1
            report.segments_deleted += int(m.group(1))


async def _kill_during_startup(srv: ServerProcess, rng: random.Random, cfg: CrashConfig,
                               report: CrashReport) -> None:
    """Start the server and SIGKILL it again after a random delay, often before it
    listens: in the middle of recovery (torn-tail cut, new segment, directory fsync)."""
    old = srv.proc
    starting = asyncio.ensure_future(asyncio.to_thread(srv.start))
    deadline = time.monotonic() + 10
    while srv.proc is old and not starting.done() and time.monotonic() < deadline:
        await asyncio.sleep(0.001)  # until the new process exists (bounded)
    await asyncio.sleep(rng.uniform(0.0, cfg.startup_kill_max_delay))  # the experiment
    listening = starting.done() and starting.exception() is None
    if srv.proc is not old:  # the new process exists: kill it wherever it is
        srv.kill()
        report.kills += 1
        if listening:
            report.startup_kills_after_listening += 1
        else:
            report.startup_kills += 1
    try:
        await asyncio.wait_for(starting, 30)
    except RuntimeError:
        pass  # "server exited with -9 before logging 'listening on'": that was the point
    if srv.proc is not old and srv.proc.poll() is None:
        srv.kill()  # it got to listen after all, between the kill decision and now


def _recovery_ms(srv: ServerProcess) -> float:
    for line in srv.lines:
        m = _RECOVERED.search(line)
        if m:
            return float(m.group(2))
    return float("nan")


async def run_crash(cfg: CrashConfig, workdir: str, *, log=None) -> CrashReport:
    """Run ``cfg.kills`` kill/restart rounds in ``workdir``; return the report (never raises on a
    violation: they are listed in ``report.violations``)."""
    report = CrashReport(seed=cfg.seed)
    run = _Run(cfg, report)
    rng = random.Random(cfg.seed)
    db_path = os.path.join(workdir, "ledger.sqlite")
    db = sqlite3.connect(db_path, isolation_level=None)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("CREATE TABLE IF NOT EXISTS ledger (id INTEGER PRIMARY KEY AUTOINCREMENT, lock TEXT NOT NULL, "
               "token INTEGER NOT NULL, worker INTEGER NOT NULL, seq INTEGER NOT NULL)")
    SQLiteFence(db).ensure_schema()
    extra = list(cfg.extra_args)
    if cfg.snapshot_every:
        extra += ["--snapshot-every", str(cfg.snapshot_every)]
    srv = ServerProcess(os.path.join(workdir, "data"), fsync=cfg.fsync, args=extra)
    t_start = time.monotonic()
    workers: list[_Worker] = []
    restarts: list[float] = []
    try:
        await asyncio.to_thread(srv.start)
        for i in range(cfg.workers):
            client = await fastlock.connect(srv.address, client_name=f"crash-w{i}")
            workers.append(_Worker(i, client, db_path, run, random.Random(cfg.seed * 1000 + i)))
        for r in range(cfg.kills + 1):
            run.new_round(r)
            tasks = [asyncio.ensure_future(w.work()) for w in workers]
            if r == cfg.kills:
                # last round: only let the workers finish what the last crash interrupted
                run.stopped = True
                await asyncio.wait_for(asyncio.gather(*tasks), cfg.worker_exit_timeout + cfg.wait)
                break
            if cfg.min_round_grants:
                try:  # enough records in this server's life (see the module docstring); bounded
                    await asyncio.wait_for(run.round_worked.wait(), cfg.round_work_timeout)
                except asyncio.TimeoutError:
                    pass  # a stalled round is killed all the same: the report's counts show it
            await asyncio.sleep(rng.uniform(cfg.min_delay, cfg.max_delay))  # the experiment
            run.stopped = True
            t_kill = time.monotonic()
            srv.kill()  # SIGKILL, no chance to flush anything
            for w in workers:  # this kill may undo the withdrawals of acquires cut off before it
                run.cut_before_a_kill.update(w.cut_acquires)
            report.kills += 1
            _count_snapshots(srv, report)
            for t in tasks:  # calls in flight would ride through until their deadline
                t.cancel()
            done, pending = await asyncio.wait(tasks, timeout=cfg.worker_exit_timeout)
            for t in pending:
                t.cancel()
                run.violation("a worker did not notice the kill in time")
            for t in done:
                if not t.cancelled() and t.exception() is not None:
                    run.violation(f"worker failed: {t.exception()!r}")
            # every token acknowledged up to now (replies read after the kill included)
            run.max_acked_before = run.max_acked
            t_exit = time.monotonic()
            report.worker_exit_s_max = max(report.worker_exit_s_max, t_exit - t_kill)
            if cfg.startup_kill_every and r % cfg.startup_kill_every == cfg.startup_kill_every - 1:
                await _kill_during_startup(srv, rng, cfg, report)
                t_exit = time.monotonic()
            await asyncio.to_thread(srv.start)  # same data dir, same port
            restarts.append(time.monotonic() - t_exit)
            report.recover_ms_max = max(report.recover_ms_max, _recovery_ms(srv))
            await _check_recovered(srv, workers, run)
            if log is not None and (r + 1) % 10 == 0:
                log(f"  {r + 1} kills: {report.grants} grants, {len(report.violations)} violations")
        # a client whose acquire was cut off by a kill cancels it (by owner) when it next
        # connects: make every client reconnect, so that no unacknowledged grant is left
        for w in workers:
            await w.client.ping()
        before = await _holders_left(srv, run)
        await asyncio.to_thread(srv.stop)
        _count_snapshots(srv, report)
        # a clean stop flushes everything, releases included: it changes no holder
        await asyncio.to_thread(srv.start)
        async with fastlock.connect(srv.address, client_name="crash-checker") as chk:
            st = await chk.status()
            after = {name: await chk.holder(name) for name in before}
        if st["locks_held"] != len(before) or {n: h and h["token"] for n, h in after.items()} != before:
            run.violation(f"a clean stop changed the holders: {before} before it, {after} and "
                          f"{st['locks_held']} locks held after it")
        if st["counter"] < (run.max_acked & COUNTER_MASK):
            run.violation(f"server counter {st['counter']} below acknowledged token {run.max_acked}")
        await asyncio.to_thread(srv.stop)
        _check_ledger(db, run)
        try:
            run.history.check()
        except AssertionError as exc:
            run.violation(f"history: {exc}")
    finally:
        for w in workers:
            await w.client.close()
            w.close()
        db.close()
        await asyncio.to_thread(srv.stop)
    report.elapsed_s = time.monotonic() - t_start
    if restarts:
        report.restart_s_max = max(restarts)
        report.restart_s_mean = sum(restarts) / len(restarts)
    return report


async def _holders_left(srv: ServerProcess, run: _Run) -> dict[str, int]:
    """After the last round, every lease released and every withdrawal sent: the locks still
    held (name -> token), each a grant whose withdrawal a kill undid (counted); any other
    holder is a violation."""
    left = {}
    async with fastlock.connect(srv.address, client_name="crash-checker") as chk:
        for i in range(run.cfg.locks):
            name = f"crash/lock-{i}"
            h = await chk.holder(name)
            if h is None:
                continue
            left[name] = h["token"]
            if (name, h["correlation_id"]) in run.cut_before_a_kill:
                run.report.lost_cancels += 1
            else:
                run.violation(f"{name} held after every lease was released and every withdrawal sent: {h}")
        st = await chk.status()
    if st["locks_held"] != len(left):
        run.violation(f"{st['locks_held']} locks held, {len(left)} of them crash/lock-*")
    return left


async def _check_recovered(srv: ServerProcess, workers: list, run: _Run) -> None:
    """Right after a restart, before any worker acts: the recovered state must cover what
    was acknowledged."""
    async with fastlock.connect(srv.address, client_name="crash-checker") as chk:
        for w in workers:
            if w.phase == HELD:
                run.report.held_at_kill += 1
                lease = w.lease
                if not await chk.check(lease.name, lease.fencing_token):
                    holder = await chk.holder(lease.name)
                    run.violation(f"acknowledged grant forgotten: {lease.name} token {lease.fencing_token} "
                                  f"(worker {w.idx}) not held after the restart; holder now {holder}")
                else:
                    h = await chk.holder(lease.name)
                    # a fresh full TTL from recovery (minus the time this check took)
                    if h is None or h["remaining_ms"] < lease.ttl * 1000 - 5000:
                        run.violation(f"{lease.name}: recovered lease has {h} left, not a fresh TTL")
            for lease in w.released:
                if await chk.check(lease.name, lease.fencing_token):
                    run.report.lost_releases += 1  # allowed: releases are acked before they are durable
                    w.relapsed.append(lease)
                    w.relapse_sent.discard(lease.fencing_token)
            w.released = []
        st = await chk.status()
        if run.max_acked >= 0 and st["counter"] < (run.max_acked & COUNTER_MASK):
            run.violation(f"server counter {st['counter']} below acknowledged token {run.max_acked}")
        if st["waiters"] != 0:
            run.violation(f"{st['waiters']} waiters survived the restart")


def _check_ledger(db: sqlite3.Connection, run: _Run) -> None:
    rows = db.execute("SELECT lock, token, worker, seq FROM ledger ORDER BY id").fetchall()
    run.report.ledger_rows = len(rows)
    if sorted(rows) != sorted(run.acked_writes):
        run.violation(f"ledger rows ({len(rows)}) differ from committed writes ({len(run.acked_writes)})")
    last: dict[str, int] = {}
    for lock, token, worker, _seq in rows:
        if token < last.get(lock, -1):
            run.violation(f"ledger: {lock} write with token {token} (worker {worker}) after token {last[lock]}")
        last[lock] = max(token, last.get(lock, -1))
    fence = SQLiteFence(db)
    for lock, top in last.items():
        if fence.highest(lock) != top:
            run.violation(f"fence table: {lock} highest {fence.highest(lock)} != ledger max {top}")


def main(argv: list | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benches.crash", description=__doc__.split("\n\n")[0])
    ap.add_argument("--kills", type=int, default=100)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--locks", type=int, default=6)
    ap.add_argument("--seed", type=int, default=CrashConfig.seed)
    ap.add_argument("--min-delay", type=float, default=0.02, help="s of load before a kill (min)")
    ap.add_argument("--max-delay", type=float, default=0.3, help="s of load before a kill (max)")
    ap.add_argument("--fsync", choices=("always", "interval", "never"), default="always",
                    help="server fsync mode (SIGKILL keeps the page cache: relaxed modes lose nothing here)")
    ap.add_argument("--snapshot-every", type=int, default=None, metavar="RECORDS",
                    help="the server's --snapshot-every (small: kills also hit snapshots and compaction)")
    ap.add_argument("--startup-kill-every", type=int, default=0, metavar="N",
                    help="after every Nth kill, kill the restarting server again at a random moment of its "
                         "start-up (recovery) before restarting it for good")
    ap.add_argument("--min-round-grants", type=int, default=0, metavar="N",
                    help="start each round's random delay to the kill only once the round made N grants "
                         "(waiting at most 30 s), so a slow machine still logs enough records between kills")
    ap.add_argument("--keep", action="store_true", help="keep the work dir (data dir, ledger)")
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args(argv)
    cfg = CrashConfig(kills=args.kills, workers=args.workers, locks=args.locks, seed=args.seed,
                      min_delay=args.min_delay, max_delay=args.max_delay, snapshot_every=args.snapshot_every,
                      fsync=args.fsync, startup_kill_every=args.startup_kill_every,
                      min_round_grants=args.min_round_grants)
    workdir = tempfile.mkdtemp(prefix="fastlock-crash-")
    print(f"crash run: {cfg.kills} SIGKILLs, {cfg.workers} workers on {cfg.locks} locks, fsync={cfg.fsync}, "
          f"snapshot every {cfg.snapshot_every or 'default'} records, seed {cfg.seed}, work dir {workdir}")
    try:
        report = asyncio.run(run_crash(cfg, workdir, log=print))
    finally:
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    print(report.summary())
    for v in report.violations[:50]:
        print("VIOLATION:", v)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dataclasses.asdict(report), f, indent=2)
    return 1 if report.violations else 0


if __name__ == "__main__":
    sys.exit(main())
