"""Redis: ``SET key token NX PX ttl`` + a Lua check-and-delete, waiting by retry-sleep.

Two recipes, both one connection per client (redis-py asyncio, hiredis parser
when installed):

- ``redis SET NX``: the hand-written recipe.  A failed SET is a wasted round
  trip; the waiter sleeps ``retry`` seconds and tries again.  No fencing token,
  no FIFO: whoever polls at the right moment wins.
- ``redis-py Lock``: redis-py's own ``Lock`` (same SET NX PX + Lua release),
  with ``sleep`` set to the same retry interval (its default is 0.1 s, which
  would make the waiting figures 100x worse).

Persistence: ``--appendonly no --save ""`` for the main table (Redis' default
keeps only periodic RDB snapshots, which never trigger in a short run), and
``appendfsync always`` / ``everysec`` for the durability-matched W4 rows.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import time
import uuid

from benches import harness

RELEASE_LUA = """
if redis.call('get', KEYS[1]) == ARGV[1] then
    return redis.call('del', KEYS[1])
end
return 0
"""


class RedisSetNxSession(harness.Session):
    def __init__(self, r, retry: float) -> None:
        self.r = r
        self.retry = retry
        self.release_script = r.register_script(RELEASE_LUA)
        self.values: dict[str, str] = {}
        self.prefix = uuid.uuid4().hex
        self.n = 0
        self.round_trips = 0
        self.wasted = 0

    async def acquire(self, name: str) -> None:
        self.n += 1
        value = f"{self.prefix}:{self.n}"
        ttl_ms = int(harness.DEFAULT_TTL * 1000)
        deadline = time.monotonic() + harness.DEFAULT_WAIT
        while True:
            self.round_trips += 1
            if await self.r.set(name, value, nx=True, px=ttl_ms):
                self.values[name] = value
                return None
            self.wasted += 1
            if time.monotonic() >= deadline:
                raise TimeoutError(f"redis lock {name!r} not acquired in {harness.DEFAULT_WAIT} s")
            await asyncio.sleep(self.retry)

    async def release(self, name: str) -> None:
        self.round_trips += 1
        if not await self.release_script(keys=[name], args=[self.values.pop(name)]):
            raise RuntimeError(f"redis lock {name!r} was not ours any more")

    async def close(self) -> None:
        await self.r.aclose()


class RedisPyLockSession(harness.Session):
    """redis-py's ``Lock``; ``do_acquire`` is wrapped only to count attempts."""

    def __init__(self, r, retry: float) -> None:
        from redis.asyncio.lock import Lock

        session = self

        class CountingLock(Lock):
            async def do_acquire(self, token):
                session.round_trips += 1
                ok = await super().do_acquire(token)
                if not ok:
                    session.wasted += 1
                return ok

        self.r = r
        self.retry = retry
        self.lock_cls = CountingLock
        self.locks: dict[str, object] = {}
        self.round_trips = 0
        self.wasted = 0

    async def acquire(self, name: str) -> None:
        lock = self.locks.get(name)
        if lock is None:
            lock = self.locks[name] = self.lock_cls(self.r, name, timeout=harness.DEFAULT_TTL, sleep=self.retry,
                                                    blocking_timeout=harness.DEFAULT_WAIT, thread_local=False)
        if not await lock.acquire():
            raise TimeoutError(f"redis-py Lock {name!r} not acquired in {harness.DEFAULT_WAIT} s")
        return None

    async def release(self, name: str) -> None:
        self.round_trips += 1
        await self.locks[name].release()

    async def close(self) -> None:
        await self.r.aclose()


class RedisTarget(harness.Target):
    system = "redis"
    fencing = False
    polling = True

    def __init__(self, *, recipe: str = "setnx", persistence: str = "none", retry: float = 0.001) -> None:
        super().__init__()
        assert recipe in ("setnx", "redis-py"), recipe
        assert persistence in ("none", "always", "everysec"), persistence
        self.recipe = recipe
        self.persistence = persistence
        self.retry = retry
        label = "redis SET NX" if recipe == "setnx" else "redis-py Lock"
        if persistence != "none":
            label += f" aof={persistence}"
        self.name = label
        self.notes = (f"retry-sleep {retry * 1e3:g} ms, no fencing token, no FIFO; "
                      + ("no persistence" if persistence == "none" else f"appendonly yes, appendfsync {persistence}"))
        self.port: int | None = None

    def describe(self):
        d = super().describe()
        d.update(recipe=self.recipe, persistence=self.persistence, retry_ms=self.retry * 1e3)
        return d

    def start(self) -> None:
        d = self.make_tmpdir()
        self.port = harness.free_port()
        argv = [shutil.which("redis-server") or "redis-server", "--port", str(self.port), "--bind", "127.0.0.1",
                "--dir", d, "--save", "", "--daemonize", "no", "--protected-mode", "yes",
                "--logfile", "", "--loglevel", "warning"]
        if self.persistence == "none":
            argv += ["--appendonly", "no"]
        else:
            argv += ["--appendonly", "yes", "--appendfsync", self.persistence]
        srv = harness.ServerProcess("redis", argv, log_path=os.path.join(d, "redis.log"), cwd=d)
        self.servers.append(srv)
        srv.start(ready_port=self.port)

    async def open(self, idx: int) -> harness.Session:
        import redis.asyncio as aioredis
        r = aioredis.Redis(host=harness.LOOPBACK, port=self.port, single_connection_client=True)
        await r.ping()
        if self.recipe == "setnx":
            return RedisSetNxSession(r, self.retry)
        return RedisPyLockSession(r, self.retry)
