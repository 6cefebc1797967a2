"""Fenced writes (fastlock.fencing) against real SQLite files and a real,
throwaway PostgreSQL server started by these tests (see tests/pgserver.py).

The PostgreSQL tests skip when no PostgreSQL server binaries or no psycopg are
found, unless FASTLOCK_REQUIRE_POSTGRES=1 (set it in CI), which turns the skip
into a failure.
"""

from __future__ import annotations

import asyncio
import os
import random
import sqlite3
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest

from fastlock.errors import FastlockError, StaleFencingToken
from fastlock.fencing import (
    MAX_TOKEN,
    AsyncPostgresFence,
    PostgresFence,
    SQLiteFence,
    fenced_execute,
    validate_token,
)

sys.path.insert(0, os.path.dirname(__file__))
import pgserver

REQUIRE_PG = os.environ.get("FASTLOCK_REQUIRE_POSTGRES") == "1"


def _pg_unavailable(reason: str):
    if REQUIRE_PG:
        pytest.fail(f"FASTLOCK_REQUIRE_POSTGRES=1 but {reason}")
    pytest.skip(reason)


# --------------------------------------------------------------------------- backends


@pytest.fixture(scope="module")
def pg_server():
    try:
        import psycopg  # noqa: F401
    except ImportError:
        _pg_unavailable("psycopg 3 is not installed (pip install 'fastlock[postgres]')")
    try:
        server = pgserver.PostgresServer()
    except pgserver.PostgresUnavailable as exc:
        _pg_unavailable(str(exc))
    server.start()
    try:
        yield server
    finally:
        server.stop()


@dataclass
class Backend:
    """What a test needs to run the same scenario on SQLite and PostgreSQL."""

    name: str
    connect: Callable[[], Any]  # a new connection to the same database
    fence: Callable[..., Any]  # fence class
    ph: str  # parameter placeholder of the caller's SQL
    table: str  # a fence table unique to this test
    closers: list

    def new(self):
        conn = self.connect()
        self.closers.append(conn)
        return conn

    def sql(self, text: str) -> str:
        return text.replace("?", self.ph)

    def commit_ddl(self, conn, text: str) -> None:
        conn.execute(text)
        conn.commit()


@pytest.fixture(params=["sqlite", "postgres"])
def backend(request, tmp_path):
    closers: list = []
    table = "fence_" + uuid.uuid4().hex[:12]
    if request.param == "sqlite":
        path = str(tmp_path / "fence.db")

        def connect():
            return sqlite3.connect(path, timeout=30, check_same_thread=False)

        b = Backend("sqlite", connect, SQLiteFence, "?", table, closers)
    else:
        pg = request.getfixturevalue("pg_server")
        import psycopg

        def connect():
            return psycopg.connect(pg.dsn)

        b = Backend("postgres", connect, PostgresFence, "%s", table, closers)
    try:
        yield b
    finally:
        for c in closers:
            c.close()


def _writes_table(b: Backend, conn) -> str:
    name = "writes_" + b.table
    if b.name == "sqlite":
        b.commit_ddl(conn, f"CREATE TABLE {name} (seq INTEGER PRIMARY KEY AUTOINCREMENT, token INTEGER, who TEXT)")
    else:
        b.commit_ddl(conn, f"CREATE TABLE {name} (seq BIGSERIAL PRIMARY KEY, token BIGINT, who TEXT)")
    return name


def _rows(conn, table: str) -> list[tuple]:
    rows = conn.execute(f"SELECT token, who FROM {table} ORDER BY seq").fetchall()
    conn.commit()
    return [tuple(r) for r in rows]


# --------------------------------------------------------------------------- shared behaviour


def test_schema_creation_is_idempotent(backend):
    conn = backend.new()
    fence = backend.fence(conn, backend.table)
    fence.ensure_schema()
    fence.ensure_schema()
    backend.fence(backend.new(), backend.table).ensure_schema()
    assert fence.highest("r") is None
    fence.execute("r", 3, backend.sql("SELECT 1"))
    fence.ensure_schema()  # does not wipe what is recorded
    assert fence.highest("r") == 3


def test_first_write_records_token_and_applies(backend):
    conn = backend.new()
    w = _writes_table(backend, conn)
    fence = backend.fence(conn, backend.table)
    fence.ensure_schema()
    with fence.fenced("ledger", 7) as cur:
        cur.execute(backend.sql(f"INSERT INTO {w} (token, who) VALUES (?, ?)"), (7, "a"))
    assert fence.highest("ledger") == 7
    assert _rows(backend.new(), w) == [(7, "a")]  # committed: visible to another connection


def test_stale_token_rejected_and_nothing_written(backend):
    conn = backend.new()
    w = _writes_table(backend, conn)
    fence = backend.fence(conn, backend.table)
    fence.ensure_schema()
    fence.execute("ledger", 10, backend.sql(f"INSERT INTO {w} (token, who) VALUES (?, ?)"), (10, "new"))
    ran = False
    with pytest.raises(StaleFencingToken) as info:
        with fence.fenced("ledger", 9) as cur:
            ran = True
            cur.execute(backend.sql(f"INSERT INTO {w} (token, who) VALUES (?, ?)"), (9, "stale"))
    assert not ran, "the caller's block must not run for a stale token"
    err = info.value
    assert isinstance(err, FastlockError)
    assert (err.token, err.highest) == (9, 10)
    assert "9" in str(err) and "10" in str(err)
    assert fence.highest("ledger") == 10
    assert _rows(backend.new(), w) == [(10, "new")]
    # one-shot form too
    with pytest.raises(StaleFencingToken):
        fence.execute("ledger", 0, backend.sql(f"INSERT INTO {w} (token, who) VALUES (?, ?)"), (0, "stale"))
    assert _rows(backend.new(), w) == [(10, "new")]
    # the connection is usable afterwards (no transaction left open or aborted)
    fence.execute("ledger", 11, backend.sql(f"INSERT INTO {w} (token, who) VALUES (?, ?)"), (11, "after"))
    assert _rows(backend.new(), w) == [(10, "new"), (11, "after")]


def test_equal_token_accepted_many_times(backend):
    conn = backend.new()
    w = _writes_table(backend, conn)
    fence = backend.fence(conn, backend.table)
    fence.ensure_schema()
    for i in range(3):
        n = fence.execute("ledger", 5, backend.sql(f"INSERT INTO {w} (token, who) VALUES (?, ?)"), (5, str(i)))
        assert n == 1
    assert fence.highest("ledger") == 5
    assert _rows(backend.new(), w) == [(5, "0"), (5, "1"), (5, "2")]


def test_higher_token_accepted_and_recorded(backend):
    conn = backend.new()
    w = _writes_table(backend, conn)
    fence = backend.fence(conn, backend.table)
    fence.ensure_schema()
    for t in (1, 2, 40, 1 << 40, MAX_TOKEN):  # up to 63 bits: needs BIGINT on PostgreSQL
        fence.execute("ledger", t, backend.sql(f"INSERT INTO {w} (token, who) VALUES (?, ?)"), (t, "x"))
        assert fence.highest("ledger") == t
    with pytest.raises(StaleFencingToken) as info:
        fence.execute("ledger", MAX_TOKEN - 1, backend.sql("SELECT 1"))
    assert info.value.highest == MAX_TOKEN


def test_resources_are_fenced_independently(backend):
    fence = backend.fence(backend.new(), backend.table)
    fence.ensure_schema()
    fence.execute("a", 100, backend.sql("SELECT 1"))
    fence.execute("b", 1, backend.sql("SELECT 1"))  # b's history is its own
    assert (fence.highest("a"), fence.highest("b")) == (100, 1)


def test_failing_block_rolls_back_the_token_too(backend):
    conn = backend.new()
    w = _writes_table(backend, conn)
    fence = backend.fence(conn, backend.table)
    fence.ensure_schema()
    fence.execute("ledger", 1, backend.sql("SELECT 1"))
    with pytest.raises(RuntimeError):
        with fence.fenced("ledger", 50) as cur:
            cur.execute(backend.sql(f"INSERT INTO {w} (token, who) VALUES (?, ?)"), (50, "x"))
            raise RuntimeError("application failed mid-write")
    assert fence.highest("ledger") == 1  # token 50 was never recorded
    assert _rows(backend.new(), w) == []
    fence.execute("ledger", 2, backend.sql("SELECT 1"))  # so 2 is still acceptable


def test_rejected_write_inside_callers_transaction_keeps_earlier_work(backend):
    """In a transaction the caller opened, the fence nests in a savepoint: a
    stale write is undone, the caller's earlier statements stay, and the
    caller's COMMIT decides."""
    conn = backend.new()
    w = _writes_table(backend, conn)
    fence = backend.fence(conn, backend.table)
    fence.ensure_schema()
    fence.execute("ledger", 10, backend.sql("SELECT 1"))
    if backend.name == "sqlite":
        conn.execute("BEGIN")
    conn.execute(backend.sql(f"INSERT INTO {w} (token, who) VALUES (?, ?)"), (0, "unfenced"))
    with pytest.raises(StaleFencingToken):
        with fence.fenced("ledger", 3) as cur:
            cur.execute(backend.sql(f"INSERT INTO {w} (token, who) VALUES (?, ?)"), (3, "stale"))
    with fence.fenced("ledger", 12) as cur:
        cur.execute(backend.sql(f"INSERT INTO {w} (token, who) VALUES (?, ?)"), (12, "ok"))
    assert _rows(backend.new(), w) == []  # nothing visible before the caller commits
    conn.commit()
    assert _rows(backend.new(), w) == [(0, "unfenced"), (12, "ok")]


def test_bad_arguments(backend):
    fence = backend.fence(backend.new(), backend.table)
    fence.ensure_schema()
    for bad in (True, False, 1.0, "5", None, b"1", 2.5):
        with pytest.raises(TypeError):
            with fence.fenced("r", bad):
                pass
    for bad in (-1, -(1 << 70), MAX_TOKEN + 1, 1 << 64):
        with pytest.raises(ValueError) as info:
            with fence.fenced("r", bad):
                pass
        assert not isinstance(info.value, TypeError)
        assert isinstance(info.value, FastlockError)
    with pytest.raises(ValueError):
        fence.execute("", 1, backend.sql("SELECT 1"))
    with pytest.raises(TypeError):
        fence.execute(b"r", 1, backend.sql("SELECT 1"))
    with pytest.raises(TypeError):
        fence.execute(None, 1, backend.sql("SELECT 1"))
    for bad_table in ("x; DROP TABLE y", "", "1abc", 'a"b', "a.b.c", "a b"):
        with pytest.raises(ValueError):
            backend.fence(backend.new(), bad_table)
    with pytest.raises(TypeError):
        backend.fence(backend.new(), 42)
    assert fence.highest("r") is None  # nothing was recorded by any of the above


def test_concurrent_writers_with_interleaved_tokens(backend):
    """Threads, each on its own connection, write with tokens drawn from one
    shuffled sequence.  Every accepted write must carry a token at least as
    high as every write committed before it; the highest token always wins;
    each refusal names a higher token already accepted."""
    setup = backend.new()
    w = _writes_table(backend, setup)
    reg = "register_" + backend.table
    backend.commit_ddl(setup, f"CREATE TABLE {reg} (id INTEGER PRIMARY KEY, token BIGINT, who TEXT)")
    setup.execute(f"INSERT INTO {reg} (id, token, who) VALUES (1, -1, 'nobody')")
    setup.commit()
    backend.fence(setup, backend.table).ensure_schema()

    n_threads, n_tokens = 8, 240
    tokens = list(range(1, n_tokens + 1))
    random.Random(1234).shuffle(tokens)
    shares = [tokens[i::n_threads] for i in range(n_threads)]
    conns = [backend.new() for _ in range(n_threads)]
    start = threading.Barrier(n_threads, timeout=30)
    accepted: list[int] = []
    rejected: list[tuple[int, int]] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def writer(i: int) -> None:
        try:
            fence = backend.fence(conns[i], backend.table)
            start.wait()
            for t in shares[i]:
                try:
                    with fence.fenced("ledger", t) as cur:
                        cur.execute(backend.sql(f"INSERT INTO {w} (token, who) VALUES (?, ?)"), (t, f"w{i}"))
                        cur.execute(backend.sql(f"UPDATE {reg} SET token = ?, who = ? WHERE id = 1"), (t, f"w{i}"))
                except StaleFencingToken as exc:
                    with lock:
                        rejected.append((t, exc.highest))
                else:
                    with lock:
                        accepted.append(t)
        except BaseException as exc:  # noqa: BLE001 - surfaced below, in the test thread
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "writers did not finish in time"
    assert not errors, errors

    assert len(accepted) + len(rejected) == n_tokens
    assert n_tokens in accepted  # nothing can be higher than the highest token
    assert all(highest is not None and highest > t for t, highest in rejected)
    check = backend.new()
    rows = _rows(check, w)
    committed = [t for t, _ in rows]
    assert sorted(committed) == sorted(accepted)
    assert committed == sorted(committed), "a write with a lower token committed after a higher one"
    assert committed[-1] == n_tokens
    final = check.execute(f"SELECT token FROM {reg} WHERE id = 1").fetchone()
    check.commit()
    assert final[0] == n_tokens  # the highest token's write is what stays
    assert backend.fence(check, backend.table).highest("ledger") == n_tokens
    assert rejected, "the shuffled tokens should have produced stale writes"


# --------------------------------------------------------------------------- SQLite only


def test_sqlite_fenced_execute_one_shot(tmp_path):
    conn = sqlite3.connect(str(tmp_path / "one.db"))
    conn.execute("CREATE TABLE t (v INTEGER)")
    conn.commit()
    assert fenced_execute(conn, "res", 4, "INSERT INTO t VALUES (?)", (4,)) == 1
    assert fenced_execute(conn, "res", 4, "INSERT INTO t VALUES (:v)", {"v": 44}) == 1
    with pytest.raises(StaleFencingToken):
        fenced_execute(conn, "res", 3, "INSERT INTO t VALUES (?)", (3,))
    assert [r[0] for r in conn.execute("SELECT v FROM t")] == [4, 44]
    assert not conn.in_transaction
    other = sqlite3.connect(str(tmp_path / "one.db"))
    assert other.execute("SELECT token FROM fastlock_fence WHERE resource = 'res'").fetchone() == (4,)
    other.close()
    conn.close()


def test_sqlite_autocommit_connection(tmp_path):
    conn = sqlite3.connect(str(tmp_path / "ac.db"), isolation_level=None)
    fence = SQLiteFence(conn)
    fence.ensure_schema()
    conn.execute("CREATE TABLE t (v INTEGER)")
    with fence.fenced("r", 2) as cur:
        cur.execute("INSERT INTO t VALUES (2)")
    with pytest.raises(StaleFencingToken):
        fence.execute("r", 1, "INSERT INTO t VALUES (1)")
    assert [r[0] for r in conn.execute("SELECT v FROM t")] == [2]
    assert not conn.in_transaction
    conn.close()


def test_sqlite_fence_rejects_non_sqlite_connection():
    with pytest.raises(TypeError):
        SQLiteFence(object())  # type: ignore[arg-type]


def test_token_may_be_a_lease_like_object():
    class Lease:
        fencing_token = 17

    assert validate_token(Lease()) == 17


# --------------------------------------------------------------------------- PostgreSQL only


def test_postgres_concurrent_schema_creation(pg_server):
    import psycopg

    table = "fence_" + uuid.uuid4().hex[:12]
    n = 8
    conns = [psycopg.connect(pg_server.dsn) for _ in range(n)]
    start = threading.Barrier(n, timeout=30)
    errors: list[BaseException] = []

    def create(c):
        try:
            start.wait()
            PostgresFence(c, table).ensure_schema()
        except BaseException as exc:  # noqa: BLE001 - surfaced below, in the test thread
            errors.append(exc)

    threads = [threading.Thread(target=create, args=(c,)) for c in conns]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    try:
        assert not any(t.is_alive() for t in threads)
        assert not errors, errors
        assert PostgresFence(conns[0], table).highest("x") is None
    finally:
        for c in conns:
            c.close()


def test_postgres_schema_qualified_table(pg_server):
    import psycopg

    with psycopg.connect(pg_server.dsn) as conn:
        conn.execute("CREATE SCHEMA IF NOT EXISTS locks")
        conn.commit()
        fence = PostgresFence(conn, "locks.fence")
        fence.ensure_schema()
        fence.execute("r", 9, "SELECT 1")
        assert conn.execute("SELECT token FROM locks.fence WHERE resource = 'r'").fetchone() == (9,)


def test_postgres_async_fence(pg_server):
    import psycopg

    table = "fence_" + uuid.uuid4().hex[:12]

    async def scenario():
        async with await psycopg.AsyncConnection.connect(pg_server.dsn) as conn:
            await conn.execute(f"CREATE TABLE w_{table} (token BIGINT)")
            await conn.commit()
            fence = AsyncPostgresFence(conn, table)
            await fence.ensure_schema()
            await fence.ensure_schema()
            async with fence.fenced("ledger", 5) as cur:
                await cur.execute(f"INSERT INTO w_{table} VALUES (%s)", (5,))
            assert await fence.execute("ledger", 5, f"INSERT INTO w_{table} VALUES (%s)", (5,)) == 1
            with pytest.raises(StaleFencingToken) as info:
                async with fence.fenced("ledger", 4) as cur:
                    await cur.execute(f"INSERT INTO w_{table} VALUES (%s)", (4,))
            assert info.value.highest == 5
            with pytest.raises(TypeError):
                async with fence.fenced("ledger", True):
                    pass
            assert await fence.highest("ledger") == 5
            cur = await conn.execute(f"SELECT token FROM w_{table}")
            assert [r[0] for r in await cur.fetchall()] == [5, 5]
            await conn.commit()

    asyncio.run(asyncio.wait_for(scenario(), 60))


def test_postgres_autocommit_connection(pg_server):
    import psycopg

    table = "fence_" + uuid.uuid4().hex[:12]
    with psycopg.connect(pg_server.dsn, autocommit=True) as conn:
        conn.execute(f"CREATE TABLE w_{table} (token BIGINT)")
        fence = PostgresFence(conn, table)
        fence.ensure_schema()
        with fence.fenced("r", 8) as cur:
            cur.execute(f"INSERT INTO w_{table} VALUES (%s)", (8,))
        with pytest.raises(StaleFencingToken):
            fence.execute("r", 7, f"INSERT INTO w_{table} VALUES (%s)", (7,))
        assert [r[0] for r in conn.execute(f"SELECT token FROM w_{table}")] == [8]


@pytest.mark.parametrize("late_token, accepted", [(3, False), (5, True), (9, True)])
def test_postgres_writer_waits_for_the_holder_of_the_fence_row(pg_server, late_token, accepted):
    """READ COMMITTED: a writer whose upsert meets a row locked by an open
    fenced transaction (token 5) waits for it, then re-checks against the
    committed token: a lower token is refused, an equal or higher one applies
    after it.  Waiting is observed in pg_stat_activity, not guessed with sleeps."""
    import psycopg

    table = "fence_" + uuid.uuid4().hex[:12]
    first, second, observer = (psycopg.connect(pg_server.dsn) for _ in range(3))
    try:
        first.execute(f"CREATE TABLE w_{table} (seq BIGSERIAL PRIMARY KEY, token BIGINT)")
        first.commit()
        PostgresFence(first, table).ensure_schema()
        PostgresFence(first, table).execute("r", 1, "SELECT 1")
        second_pid = second.info.backend_pid
        inside, finish = threading.Event(), threading.Event()
        outcome: dict[str, Any] = {}

        def holder():
            try:
                with PostgresFence(first, table).fenced("r", 5) as cur:
                    cur.execute(f"INSERT INTO w_{table} (token) VALUES (5)")
                    inside.set()
                    if not finish.wait(30):
                        raise RuntimeError("test did not let the holder finish")
            except BaseException as exc:  # noqa: BLE001 - the outcome the test checks
                outcome["holder"] = exc

        def late():
            try:
                PostgresFence(second, table).execute("r", late_token, f"INSERT INTO w_{table} (token) VALUES (%s)",
                                                    (late_token,))
                outcome["late"] = "applied"
            except BaseException as exc:  # noqa: BLE001 - the outcome the test checks
                outcome["late"] = exc

        t1 = threading.Thread(target=holder)
        t1.start()
        assert inside.wait(30)
        t2 = threading.Thread(target=late)
        t2.start()
        deadline = time.monotonic() + 30
        while True:  # bounded wait until the late writer is blocked on the row lock
            row = observer.execute("SELECT wait_event_type FROM pg_stat_activity WHERE pid = %s",
                                   (second_pid,)).fetchone()
            observer.commit()
            if row and row[0] == "Lock":
                break
            assert "late" not in outcome, f"the late writer did not wait: {outcome['late']!r}"
            assert time.monotonic() < deadline, "the late writer never blocked on the fence row"
            time.sleep(0.01)
        finish.set()
        t1.join(30)
        t2.join(30)
        assert "holder" not in outcome
        tokens = [r[0] for r in observer.execute(f"SELECT token FROM w_{table} ORDER BY seq")]
        if accepted:
            assert outcome["late"] == "applied"
            assert tokens == [5, late_token]
            assert PostgresFence(observer, table).highest("r") == late_token
        else:
            assert isinstance(outcome["late"], StaleFencingToken)
            assert outcome["late"].highest == 5
            assert tokens == [5]
            assert PostgresFence(observer, table).highest("r") == 5
    finally:
        for c in (first, second, observer):
            c.close()
