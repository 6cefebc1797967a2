"""Signed sequencers from real servers: a grant's sequencer on the asyncio and blocking
clients and for ``fastlock run``; a stale holder (paused past its TTL, and across an
asynchronous failover) refused by the SQLite, PostgreSQL and HTTP fences once the new
holder has written, beside a forged write.
"""

from __future__ import annotations

import asyncio
import os
import sqlite3
import subprocess
import sys
import time

import pgserver
import pytest

import fastlock
from fastlock import protocol as P
from fastlock import sequencer as S
from fastlock._testbase.cluster import RawNode, poll, run, status_of
from fastlock._testbase.servers import CredentialsDir, ServerProcess
from fastlock.auth.sequencer_keys import read_keys
from fastlock.contrib.asgi import FencingMiddleware
from fastlock.errors import InvalidArgument, NotPrimary, StaleFencingToken
from fastlock.fencing import PostgresFence, SQLiteFence
from fastlock.sync import SyncClient
from fastlock.tokens import epoch_of
from fastlock.watermarks import SequencerFence

FAILOVER = 1.0  # --failover-after, seconds
GRACE = 0.2  # --promotion-grace


@pytest.fixture
def keyed_server(tmp_path):
    """A server whose credentials hold a sequencer key, and those credentials."""
    creds = CredentialsDir(tmp_path / "credentials")
    srv = ServerProcess(tmp_path / "data", args=["--credentials", creds.file]).start()
    try:
        yield srv, creds
    finally:
        srv.stop()


def _keys(creds: CredentialsDir) -> list[S.VerifyKey]:
    return read_keys(creds.file).verify_keys


async def test_a_grant_carries_a_sequencer_of_its_name_token_principal_and_mode(keyed_server):
    srv, creds = keyed_server
    keys = _keys(creds)
    signing = read_keys(creds.file).signing
    srv.wait_for_log(rf"sequencers: signed with ed25519 key {signing.key_id.hex()} \(1 key", 10)
    assert not any(signing.secret.hex() in line for line in srv.lines)
    async with fastlock.connect(srv.address, token_file=creds.token_file("app"), sequencers=True) as client:
        before = time.time()
        lease = await client.acquire("orders/1", ttl=5.0)
        seq = S.verify(lease.sequencer, keys, name="orders/1")
        assert (seq.token, seq.epoch, seq.principal, seq.mode) == (lease.fencing_token, 0, "app", "exclusive")
        # the server's wall clock at signing plus what was left of the lease (both clocks are this host's)
        assert before * 1000 < seq.expires_at_ms <= time.time() * 1000 + 5000
        await client.release(lease)
        # a prioritized acquire (ACQUIRE_PRIORITY) carries one as well
        urgent = await client.acquire("orders/3", ttl=5.0, priority=5)
        assert S.verify(urgent.sequencer, keys, name="orders/3").token == urgent.fencing_token
        await client.release(urgent)
        async with client.lock("reports", ttl=5.0, shared=True) as shared:
            assert S.verify(shared.sequencer, keys, name="reports").mode == "shared"
        permit = await client.acquire("pool", ttl=5.0, limit=2)
        assert S.verify(permit.sequencer, keys, name="pool").mode == "permit"
        # the one-request multi-lock: a sequencer per name, in the tokens' order
        multi = await client.acquire_many(["b/2", "b/1", "b/3"], ttl=5.0, shared=["b/3"])
        for lease in multi.leases:
            seq = S.verify(lease.sequencer, keys, name=lease.name)
            assert seq.token == lease.fencing_token
            assert seq.mode == ("shared" if lease.name == "b/3" else "exclusive")
        await client.release_many(multi)
    async with fastlock.connect(srv.address, token_file=creds.token_file("app")) as client:
        assert (await client.acquire("orders/2", ttl=5.0)).sequencer is None  # not asked for


def test_the_blocking_client_and_fastlock_run_hand_out_the_sequencer(keyed_server, tmp_path):
    srv, creds = keyed_server
    keys = _keys(creds)
    with SyncClient(srv.address, token_file=creds.token_file("app"), sequencers=True) as client:
        with client.lock("nightly", ttl=5.0) as lease:
            assert S.verify(lease.sequencer, keys, name="nightly").token == lease.fencing_token
    env = {**os.environ, "FASTLOCK_TOKEN_FILE": creds.token_file("app")}
    out = subprocess.run([sys.executable, "-m", "fastlock", "run", "job", "--server", srv.address, "--sequencer",
                          "--", sys.executable, "-c", "import os; print(os.environ['FASTLOCK_SEQUENCER'])"],
                         capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 0, out.stderr
    assert S.verify(out.stdout.strip(), keys, name="job").principal == "app"


async def test_a_server_without_a_key_refuses_the_flag_and_the_client_says_so_first(server, tmp_path):
    async with fastlock.connect(server.address, sequencers=True) as client:
        assert client.server_info["sequencers"] is False
        with pytest.raises(InvalidArgument, match="hands out none"):
            await client.acquire("x", ttl=1.0)
    node = await RawNode.open(server.address, token=None)
    try:
        with pytest.raises(InvalidArgument, match="no sequencer key"):
            await node.request(P.OP_ACQUIRE, "x", os.urandom(16), 1000, 0, 0, None, False, 0, 0, True)
        with pytest.raises(InvalidArgument, match="sequencer must be a bool"):  # (TypeErrors travel so)
            await node.request(P.OP_ACQUIRE, "x", os.urandom(16), 1000, 0, 0, None, False, 0, 0, 1)
        assert await node.holder("x") is None  # refused before anything was granted
    finally:
        await node.close()


def _sqlite_fence(path, keys) -> SQLiteFence:
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE IF NOT EXISTS ledger (amount INTEGER)")
    conn.commit()
    fence = SQLiteFence(conn, keys=keys, skew=None)  # skew None: the high-water mark alone refuses
    fence.ensure_schema()
    return fence


def _forged(sequencer: str) -> bytes:
    """The holder's sequencer with its token raised to 2**62: the issue's attack."""
    blob = bytearray(S.from_text(sequencer))
    blob[10:18] = (2**62).to_bytes(8, "big")
    blob[18:22] = (2**62 >> 40).to_bytes(4, "big")
    return bytes(blob)


async def test_a_holder_paused_past_its_ttl_is_refused_once_the_next_holder_wrote(keyed_server, tmp_path):
    srv, creds = keyed_server
    keys = _keys(creds)
    fence = _sqlite_fence(tmp_path / "app.db", keys)
    insert = "INSERT INTO ledger (amount) VALUES (?)"
    async with fastlock.connect(srv.address, token_file=creds.token_file("app"), sequencers=True) as a, \
            fastlock.connect(srv.address, token_file=creds.token_file("app"), sequencers=True) as b:
        stale = await a.acquire("ledger", ttl=0.5)  # never renewed: A "pauses"
        fresh = await b.acquire("ledger", ttl=5.0, wait=30.0)  # granted once A's lease expired
        assert fresh.fencing_token > stale.fencing_token
        assert fence.execute("ledger", fresh.sequencer, insert, (2,)) == 1
        with pytest.raises(StaleFencingToken):
            fence.execute("ledger", stale.sequencer, insert, (1,))
        with pytest.raises(S.BadSequencerSignature):
            fence.execute("ledger", _forged(stale.sequencer), insert, (666,))
        with pytest.raises(S.MalformedSequencer):
            fence.execute("ledger", 2**62, insert, (666,))
    assert fence.conn.execute("SELECT amount FROM ledger").fetchall() == [(2,)]
    assert fence.highest("ledger") == fresh.fencing_token


@pytest.fixture(scope="module")
def pg_server():
    try:
        import psycopg  # noqa: F401
    except ImportError:
        if os.environ.get("FASTLOCK_REQUIRE_POSTGRES") == "1":
            pytest.fail("FASTLOCK_REQUIRE_POSTGRES=1 but psycopg is not installed")
        pytest.skip("psycopg 3 is not installed")
    try:
        server = pgserver.PostgresServer()
    except pgserver.PostgresUnavailable as exc:
        if os.environ.get("FASTLOCK_REQUIRE_POSTGRES") == "1":
            pytest.fail(f"FASTLOCK_REQUIRE_POSTGRES=1 but {exc}")
        pytest.skip(str(exc))
    server.start()
    try:
        yield server
    finally:
        server.stop()


async def _http(app, sequencer: str | bytes) -> int:
    value = sequencer if isinstance(sequencer, str) else S.to_text(sequencer)
    scope = {"type": "http", "method": "PUT", "path": "/ledger", "headers": [(b"if-fencing-sequencer",
                                                                               value.encode("ascii"))]}
    sent: list[dict] = []

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        sent.append(message)

    await app(scope, receive, send)
    return sent[0]["status"]


def _sequenced_acquire(node: RawNode, name: str, ttl_ms: int, wait_ms: int):
    """ACQUIRE with the sequencer flag: the reply ``[token, ttl_ms, waited_ms, {"sequencer": ...}]``."""
    return node.request(P.OP_ACQUIRE, name, os.urandom(16), ttl_ms, wait_ms, 0, None, False, 0, 0, True)


def test_a_stale_holder_across_an_async_failover_is_refused_by_sqlite_postgres_and_http(cluster, tmp_path,
                                                                                         pg_server):
    """The primary grants A's lease and dies (kill -9, asynchronous replication); the standby
    promotes with the same keys.  A's epoch-0 sequencer still verifies; once B (epoch 1) has
    written, every fence refuses A, and a forged sequencer beside it."""
    import psycopg

    p = cluster.primary()
    s = cluster.standby(p.address, failover_after=FAILOVER, grace=GRACE)
    keys = _keys(cluster.creds)
    app_token = cluster.creds.token("app")
    written: list[int] = []

    async def app(scope, receive, send):
        written.append(scope["fastlock.sequencer"].token)
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    http = FencingMiddleware(app, SequencerFence(keys, skew=None), resource=lambda scope: "ledger")
    sqlite_fence = _sqlite_fence(tmp_path / "app.db", keys)
    pg = psycopg.connect(pg_server.dsn, autocommit=True)
    pg.execute("CREATE TABLE IF NOT EXISTS ledger (amount INTEGER)")
    pg_fence = PostgresFence(pg, "seq_fence", keys=keys, skew=None)
    pg_fence.ensure_schema()

    async def main():
        a = await RawNode.open(p.address, token=app_token)
        try:
            token_a, _, _, extra = await _sequenced_acquire(a, "ledger", 1500, 0)
            stale = S.to_text(extra["sequencer"])
            await poll(lambda: status_of(s.address), lambda st: st["locks_held"] == 1, timeout=5,
                       what="standby caught up")
        finally:
            await a.close()
        standby = await RawNode.open(s.address, token=app_token)
        try:  # a standby never grants, so it never signs
            with pytest.raises(NotPrimary):
                await _sequenced_acquire(standby, "other", 1000, 0)
        finally:
            await standby.close()
        await asyncio.to_thread(p.kill)
        await asyncio.to_thread(s.wait_for_log, r"PROMOTED", 10)
        # a sequencer of epoch 0 verifies after the promotion (the same keys)
        assert S.verify(stale, keys, name="ledger", skew=None).epoch == 0
        b = await RawNode.open(s.address, token=app_token)
        try:  # granted once A's replicated lease ran out on the new primary
            token_b, _, _, extra = await asyncio.wait_for(_sequenced_acquire(b, "ledger", 5000, 10000), 15)
        finally:
            await b.close()
        fresh = extra["sequencer"]
        assert epoch_of(token_b) == 1 and token_b > token_a
        assert S.verify(fresh, keys, name="ledger").epoch == 1
        insert_sqlite = "INSERT INTO ledger (amount) VALUES (?)"
        insert_pg = "INSERT INTO ledger (amount) VALUES (%s)"
        assert sqlite_fence.execute("ledger", fresh, insert_sqlite, (2,)) == 1
        assert pg_fence.execute("ledger", fresh, insert_pg, (2,)) == 1
        assert await _http(http, fresh) == 204
        with pytest.raises(StaleFencingToken):
            sqlite_fence.execute("ledger", stale, insert_sqlite, (1,))
        with pytest.raises(StaleFencingToken):
            pg_fence.execute("ledger", stale, insert_pg, (1,))
        assert await _http(http, stale) == 409
        for fence, insert in ((sqlite_fence, insert_sqlite), (pg_fence, insert_pg)):
            with pytest.raises(S.BadSequencerSignature):
                fence.execute("ledger", _forged(stale), insert, (666,))
        assert await _http(http, _forged(stale)) == 403
        return token_b

    token_b = run(main(), timeout=60)
    assert sqlite_fence.conn.execute("SELECT amount FROM ledger").fetchall() == [(2,)]
    assert pg.execute("SELECT amount FROM ledger").fetchall() == [(2,)]
    assert written == [token_b]
    assert sqlite_fence.highest("ledger") == pg_fence.highest("ledger") == token_b
    pg.close()


async def test_the_async_postgres_fence_takes_only_verified_sequencers(pg_server):
    import psycopg

    from fastlock.fencing import AsyncPostgresFence
    from fastlock.tokens import make_token

    key = S.SigningKey.of("hmac-sha256", bytes(range(32)))
    conn = await psycopg.AsyncConnection.connect(pg_server.dsn, autocommit=True)
    try:
        fence = AsyncPostgresFence(conn, "seq_async_fence", keys=[key.verify_key], skew=None)
        await fence.ensure_schema()
        old = S.sign(key, "acct", make_token(0, 9), "app", S.EXCLUSIVE, 1000)
        new = S.sign(key, "acct", make_token(1, 2), "app", S.EXCLUSIVE, 1000)
        with pytest.raises(S.MalformedSequencer):
            async with fence.fenced("acct", 2**62):
                pass
        with pytest.raises(S.WrongSequencerName):
            async with fence.fenced("other", new):
                pass
        async with fence.fenced("acct", new):
            pass
        with pytest.raises(StaleFencingToken):
            async with fence.fenced("acct", old):
                pass
        assert await fence.highest("acct") == make_token(1, 2)
        assert await fence.highest("other") is None
    finally:
        await conn.close()
