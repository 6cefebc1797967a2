"""The nemesis's worker and prober processes (see :mod:`benches.nemesis`)."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import signal
import sqlite3
import time
from pathlib import Path
from typing import Any

# =========================================================================== workers


STORE_SCHEMA = ("CREATE TABLE IF NOT EXISTS writes (seq INTEGER PRIMARY KEY AUTOINCREMENT, lock TEXT NOT NULL, "
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
        self.client = None  # the connected client (a ShardedClient against a sharded deployment)

    def group_of(self, name: str) -> str | None:
        """The shard group the client routes ``name`` to (None: not sharded)."""
        shard_map = getattr(self.client, "shard_map", None)
        return None if shard_map is None else shard_map.owner(name).name

    def log(self, ev: str, **fields: Any) -> None:
        fields["ev"] = ev
        if ev == "grant":
            group = self.group_of(fields["lock"])
            if group is not None:
                fields["group"] = group
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
        pairs = self.index > cfg["workers"]
        client = await fastlock.connect(*cfg["addresses"], client_name=("prober" if probe else f"worker-{self.index}"),
                                        connect_timeout=1.0, request_timeout=cfg["request_timeout"])
        self.client = client
        self.log("started", pid=os.getpid())
        try:
            await (self.probe(client) if probe else self.pairs(client) if pairs else self.work(client))
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
                self.log("error", op=phase, lock=name, holding=f"w{self.index}#{self.holdings}" if phase == "release"
                         else None, sent=sent, type=type(exc).__name__, msg=str(exc))
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
                # a clean release: the primary holding the grant knew it (the report's rule for late grants)
                self.log("end", lock=name, token=lease.fencing_token, holding=f"p#{n}", reason="done")
            except LockNotAcquired as exc:
                self.log("not_acquired", op=phase, lock=name, sent=sent, msg=str(exc))
            except (FastlockError, OSError) as exc:
                self.log("error", op=phase, lock=name, holding=f"p#{n}", sent=sent, type=type(exc).__name__,
                         msg=str(exc))
            await asyncio.sleep(0.05)

    async def pairs(self, client) -> None:
        """W2: one-shot ``acquire`` + ``release`` pairs on 16 names of this worker's own
        (spread over every slot by their hash), ``pair_pause`` s (20 ms) apart, until stopped."""
        from fastlock.errors import FastlockError, LockNotAcquired

        cfg = self.cfg
        names = [f"pairs/{self.index}/{k}" for k in range(16)]
        n = 0
        while not self.stop.is_set():
            n += 1
            name = names[n % len(names)]
            holding = f"w{self.index}p#{n}"
            sent = time.monotonic()
            phase = "pair-acquire"
            try:
                entered, lease = await self._until_stopped(client.acquire(name, ttl=cfg["ttl"], wait=cfg["wait"]))
                if not entered:
                    break
                self.log("grant", lock=name, token=lease.fencing_token, holding=holding, sent=sent,
                         at=time.monotonic(), ttl=lease.ttl)
                phase = "pair-release"
                await client.release(lease)
                self.log("end", lock=name, token=lease.fencing_token, holding=holding, reason="done")
            except LockNotAcquired as exc:
                self.log("not_acquired", op=phase, lock=name, sent=sent, msg=str(exc))
            except (FastlockError, OSError) as exc:
                self.log("error", op=phase, lock=name, holding=holding if phase == "pair-release" else None,
                         sent=sent, type=type(exc).__name__, msg=str(exc))
                if phase == "pair-release":
                    self.log("end", lock=name, token=lease.fencing_token, holding=holding, reason="release-error")
            await asyncio.sleep(cfg.get("pair_pause", 0.02))

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


