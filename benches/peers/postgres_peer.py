"""PostgreSQL advisory locks: ``pg_advisory_lock(key)`` / ``pg_advisory_unlock(key)``.

One asyncpg connection per client (advisory locks belong to the session, so
the connection *is* the lease: no TTL, no fencing token).  A waiter blocks in
the server's lock manager (no polling); ``lock_timeout`` bounds the wait.

The server is started by this module: ``initdb`` + ``postgres`` on 127.0.0.1
with a throwaway data dir.  ``postgres`` refuses to run as root, so as root it
runs as the ``postgres`` user (created by the Debian package), or ``nobody``.
"""

from __future__ import annotations

import os
import pwd
import subprocess
import time
import zlib

from benches import harness
from benches.peers.install import postgres_bindir


def _lock_key(name: str) -> int:
    return zlib.crc32(name.encode())


class PgSession(harness.Session):
    def __init__(self, conn) -> None:
        self.conn = conn
        self.round_trips = 0
        self.wasted = 0

    async def acquire(self, name: str) -> None:
        self.round_trips += 1
        await self.conn.fetchval("SELECT pg_advisory_lock($1)", _lock_key(name))
        return None

    async def release(self, name: str) -> None:
        self.round_trips += 1
        if not await self.conn.fetchval("SELECT pg_advisory_unlock($1)", _lock_key(name)):
            raise RuntimeError(f"advisory lock {name!r} was not held")

    async def close(self) -> None:
        await self.conn.close()


class PostgresTarget(harness.Target):
    name = "postgres advisory"
    system = "postgres"
    fencing = False
    polling = False
    notes = "pg_advisory_lock on one connection per client; lock lives with the session, no TTL or token"

    def __init__(self) -> None:
        super().__init__()
        self.port: int | None = None
        self.user: str | None = None

    def _run_as(self) -> str | None:
        if os.geteuid() != 0:
            return None
        for u in ("postgres", "nobody"):
            try:
                pwd.getpwnam(u)
                return u
            except KeyError:
                continue
        raise RuntimeError("running as root and no 'postgres' or 'nobody' user to run PostgreSQL as")

    def start(self) -> None:
        bindir = postgres_bindir()
        if bindir is None:
            raise RuntimeError("PostgreSQL server binaries not found (Debian package postgresql)")
        d = self.make_tmpdir()
        self.user = self._run_as()
        if self.user:
            pw = pwd.getpwnam(self.user)
            os.chown(d, pw.pw_uid, pw.pw_gid)
        data = os.path.join(d, "data")
        init = [os.path.join(bindir, "initdb"), "-D", data, "-A", "trust", "-U", "bench", "-E", "UTF8",
                "--no-sync", "--no-locale"]
        if self.user:
            init = ["runuser", "-u", self.user, "--"] + init
        r = subprocess.run(init, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=120, cwd=d)
        if r.returncode != 0:
            raise RuntimeError(f"initdb failed: {r.stdout.decode(errors='replace')[-1500:]}")
        self.port = harness.free_port()
        argv = [os.path.join(bindir, "postgres"), "-D", data, "-p", str(self.port),
                "-c", "listen_addresses=127.0.0.1", "-c", f"unix_socket_directories={d}",
                "-c", "max_connections=100", "-c", "shared_buffers=64MB", "-c", "logging_collector=off"]
        srv = harness.ServerProcess("postgres", argv, log_path=os.path.join(d, "postgres.log"), cwd=d,
                                    user=self.user)
        self.servers.append(srv)
        srv.start(ready_port=self.port)
        deadline = time.monotonic() + harness.READY_TIMEOUT
        while "ready to accept connections" not in srv.tail(100_000):
            if time.monotonic() > deadline:
                raise TimeoutError(f"postgres not ready: {srv.tail()}")
            time.sleep(0.05)

    def stop(self) -> None:
        # SIGTERM is a "smart" shutdown that waits for clients; clients are closed by now,
        # and ServerProcess.stop falls back to SIGKILL after its grace period anyway.
        super().stop()

    async def open(self, idx: int) -> harness.Session:
        import asyncpg
        conn = await asyncpg.connect(host=harness.LOOPBACK, port=self.port, user="bench", database="postgres",
                                     timeout=10)
        await conn.execute(f"SET lock_timeout = '{int(harness.DEFAULT_WAIT * 1000)}ms'")
        return PgSession(conn)
