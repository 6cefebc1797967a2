"""Client sessions (fastlock.server.sessions, fastlock.client.session, docs/sessions.md).

Real server processes: one keep-alive per renewal interval renews every lease of a
client; a killed client's leases are freed by their TTL; an operator's close revokes
every lease of a session at once (the next grants get higher tokens); a session's
leases survive a SIGKILL of the server and its restart, and a failover to a promoted
standby; another principal cannot use a session; the limits answer clearly.
The time figures (kill -9 to freed) are measured in benches/sessions.py.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import wait_until

import fastlock
from fastlock import protocol as P
from fastlock._testbase import ServerProcess
from fastlock._testbase.cluster import RawNode, poll, status_of
from fastlock._testbase.proxy import free_port
from fastlock._testbase.servers import CredentialsDir
from fastlock.errors import LeaseLost, LimitExceeded, LockNotHeld, PermissionDenied
from fastlock.server.sessions import MAX_SESSIONS_PER_CONNECTION, MAX_SESSIONS_PER_PRINCIPAL

#: leases taken concurrently at a time while a test builds up its holdings
BATCH = 500


async def lock_all(client, names, ttl, **kwargs):
    leases = []
    for i in range(0, len(names), BATCH):
        leases += await asyncio.gather(*(client.lock(n, ttl=ttl, **kwargs) for n in names[i:i + BATCH]))
    return leases


async def sessions_status(client) -> dict:
    return (await client.status())["client_sessions"]


@pytest.mark.one_loop
async def test_one_keepalive_per_interval_renews_ten_thousand_leases(connect):
    c = await connect("many")
    ttl = 3.0
    leases = await lock_all(c, [f"many/{i}" for i in range(10_000)], ttl)
    await poll(lambda: sessions_status(c), lambda st: st["leases"] == 10_000, timeout=60,
               what="every lease attached to the session")
    first = await sessions_status(c)
    started = time.monotonic()
    # wait for a few keep-alives: each must renew every one of the 10,000 leases
    last = await poll(lambda: sessions_status(c), lambda st: st["keepalives"] >= first["keepalives"] + 4,
                      timeout=60, what="four more keep-alives")
    elapsed = time.monotonic() - started
    keepalives = last["keepalives"] - first["keepalives"]
    # a round comes at most every ttl/3 less 20 % jitter: at most one keep-alive per such interval
    assert keepalives <= elapsed / (ttl / 3.0 * 0.8) + 1
    assert last["renewals"] - first["renewals"] == 10_000 * keepalives
    assert last["open"] == 1
    assert not any(lease.lost.is_set() for lease in leases)
    assert c.session_keeper.keepalives >= keepalives


async def test_a_killed_client_frees_every_lease_by_the_ttl(server, connect):
    code = ("import asyncio, sys, fastlock\n"
            "async def main():\n"
            f"    c = await fastlock.connect({server.address!r}, client_name='doomed')\n"
            "    await asyncio.gather(*(c.lock(f'doomed/{i}', ttl=2.0) for i in range(1000)))\n"
            "    print('held', flush=True)\n"
            "    await asyncio.sleep(3600)\n"
            "asyncio.run(main())\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 60)
        assert line.strip() == "held"
        observer = await connect("observer")
        await poll(lambda: sessions_status(observer), lambda st: st["leases"] == 1000, timeout=30,
                   what="the doomed client's leases attached")
        held = await observer.holder("doomed/7")
        assert held is not None
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        await poll(lambda: observer.locks("doomed/"), lambda page: page.matched == 0, timeout=30,
                   what="every lease of the killed client freed")
        lease = await observer.acquire("doomed/7", ttl=5.0, wait=0)
        assert lease.fencing_token > held["token"]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


async def test_closing_a_session_revokes_every_lease_at_once_with_higher_tokens(connect, caplog):
    holder = await connect("holder")
    waiter = await connect("waiter")
    operator = await connect("operator")
    leases = await lock_all(holder, [f"held/{i}" for i in range(50)], 30.0)
    await poll(lambda: sessions_status(holder), lambda st: st["leases"] == 50, timeout=30, what="attached")
    waits = [asyncio.ensure_future(waiter.acquire(f"held/{i}", ttl=10.0, wait=60.0)) for i in range(5)]
    await poll(lambda: operator.lock_info("held/4"), lambda info: info.waiter_count == 1, timeout=10,
               what="the waiters queued")
    listed = await operator.sessions()
    mine = [s for s in listed if s.id == holder.session_keeper.id]
    assert len(mine) == 1 and mine[0].leases == 50 and mine[0].client == "holder"
    closed = await operator.close_session(holder.session_keeper.id, reason="maintenance")
    assert closed.revoked == 50
    granted = await asyncio.wait_for(asyncio.gather(*waits), 10)  # long before the 60 s TTL
    for new, old in zip(granted, leases[:5], strict=True):
        assert new.fencing_token > old.fencing_token
    page = await operator.locks("held/")
    assert {h.name for h in page.locks} == {f"held/{i}" for i in range(5)}
    # the holder learns at its next round: every lease lost, revoked by the operator
    await wait_until(lambda: all(lease.lost.is_set() for lease in leases), timeout=60, what="leases lost")
    assert "revoked by anonymous: maintenance" in caplog.text
    # (the holder opened its session again to say so: with no lease attached)
    assert all(s.leases == 0 for s in await operator.sessions() if s.id == closed.id)
    with pytest.raises(LockNotHeld):
        await operator.close_session("0" * 16)


async def test_a_closed_client_closes_its_session_on_the_server(connect):
    operator = await connect("operator")
    leaving = await connect("leaving")
    lease = await leaving.lock("leaving/1", ttl=30.0)
    await poll(lambda: sessions_status(leaving), lambda st: st["leases"] == 1, timeout=30, what="attached")
    session_id = leaving.session_keeper.id
    assert [s.client for s in await operator.sessions() if s.id == session_id] == ["leaving"]
    await leaving.close()
    assert not [s for s in await operator.sessions() if s.id == session_id]  # not kept for its TTL
    assert (await operator.holder("leaving/1"))["token"] == lease.fencing_token  # the lease keeps its TTL
    await leaving.close()  # closing again sends nothing and raises nothing


async def test_a_principal_at_its_session_limit_renews_each_lease_itself(server, connect, caplog):
    nodes = []
    try:
        for _ in range(MAX_SESSIONS_PER_PRINCIPAL // MAX_SESSIONS_PER_CONNECTION):  # the principal's every session
            node = await RawNode.open(server.address, token=None)
            nodes.append(node)
            for _ in range(MAX_SESSIONS_PER_CONNECTION):
                await node.request(P.OP_SESSION_OPEN, os.urandom(16), 600_000)
        over = await connect("over")
        with caplog.at_level(logging.INFO, logger="fastlock.client.session"):
            lease = await over.lock("over/1", ttl=1.0)
            first = lease.state.expires_at
            await wait_until(lambda: "refused this client a session" in caplog.text, timeout=30,
                             what="the refusal logged")
            await wait_until(lambda: lease.state.expires_at > first, timeout=30, what="a renewal by its own EXTEND")
        assert not lease.lost.is_set()
        mine = [r for r in caplog.records if r.name == "fastlock.client.session"]
        refused = [r for r in mine if "refused this client a session" in r.getMessage()]
        assert len(refused) == 1 and refused[0].levelno == logging.WARNING
        assert all(r.exc_info is None for r in mine) and "unexpectedly" not in caplog.text
    finally:
        for node in nodes:
            await node.close()


async def test_a_revoked_lease_takes_its_keys_with_it_however_it_was_revoked(connect):
    """A REVOKE record ends the lease's keys on a standby and in recovery; the primary deletes
    them too, whether the lease was revoked by name, by principal or by closing its session."""
    holder = await connect("holder")
    operator = await connect("operator")
    by_name, by_principal, by_session = await lock_all(holder, ["keys/1", "keys/2", "keys/3"], 30.0)
    for i, lease in enumerate((by_name, by_principal, by_session), 1):
        await holder.put(f"k/{i}", b"v", lease=lease)
    await poll(lambda: sessions_status(holder), lambda st: st["leases"] == 3, timeout=30, what="attached")
    await operator.revoke("keys/1", fencing_token=by_name.fencing_token)
    assert await operator.get("k/1") is None and await operator.get("k/2") is not None
    await operator.close_session(holder.session_keeper.id)
    assert await operator.get("k/2") is None and await operator.get("k/3") is None
    third = await holder.acquire("keys/4", ttl=30.0)
    await holder.put("k/4", b"v", lease=third)
    revoked = await operator.revoke_principal("anonymous")
    assert revoked.revoked == 1 and await operator.get("k/4") is None
    assert (await operator.locks("keys/")).locks == []


async def test_revoke_session_and_sessions_commands(server, connect):
    holder = await connect("cli-holder")
    await lock_all(holder, [f"cli/{i}" for i in range(3)], 30.0)
    await poll(lambda: sessions_status(holder), lambda st: st["leases"] == 3, timeout=30, what="attached")
    sid = holder.session_keeper.id

    def fastlock_cli(*argv):
        return subprocess.run([sys.executable, "-m", "fastlock", *argv, "--server", server.address],
                              capture_output=True, text=True, timeout=60)

    listed = await asyncio.to_thread(fastlock_cli, "sessions")
    assert listed.returncode == 0, listed.stderr
    row = next(line for line in listed.stdout.splitlines() if line.startswith(sid))
    assert "cli-holder" in row and " 3 " in row
    done = await asyncio.to_thread(fastlock_cli, "revoke", "--session", sid, "--reason", "test")
    assert done.returncode == 0, done.stderr
    assert "revoked 3 leases" in done.stdout
    assert (await holder.locks("cli/")).matched == 0
    unknown = await asyncio.to_thread(fastlock_cli, "sessions", "close", "0" * 16)
    assert unknown.returncode != 0 and "no session" in unknown.stderr


async def test_session_false_renews_each_lease_itself(connect):
    c = await connect("alone")
    async with c.lock("alone/1", ttl=0.6, session=False) as lease:
        await asyncio.sleep(0)
        await wait_until(lambda: lease.expires_at > time.monotonic() + 0.1 and c.renewers, timeout=5,
                         what="renewing")
        first = lease.expires_at
        await wait_until(lambda: lease.expires_at > first, timeout=10, what="a renewal by EXTEND")
        assert len(c.session_keeper) == 0
        assert (await sessions_status(c))["keepalives"] == 0
        assert not lease.lost.is_set()


@pytest.mark.one_loop
async def test_session_leases_survive_a_server_kill_and_restart(tmp_path, loop_errors):
    port = free_port()
    srv = ServerProcess(tmp_path / "data", port=port).start()
    c = await fastlock.connect(srv.address, client_name="survivor", request_timeout=2.0)
    try:
        leases = await lock_all(c, [f"keep/{i}" for i in range(100)], 2.0)
        await poll(lambda: sessions_status(c), lambda st: st["leases"] == 100, timeout=30, what="attached")
        old_id = c.session_keeper.id
        srv.kill()
        srv = ServerProcess(tmp_path / "data", port=port).start()
        # the client opens the same session on the restarted server and attaches its leases again
        st = await poll(lambda: sessions_status(c), lambda st: st["leases"] == 100, timeout=30,
                        what="the session re-opened")
        # more than two TTLs of keep-alives on the restarted server
        await poll(lambda: sessions_status(c), lambda s: s["keepalives"] >= st["keepalives"] + 6, timeout=30,
                   what="keep-alives after the restart")
        assert c.session_keeper.id == old_id
        assert not any(lease.lost.is_set() for lease in leases)
        holder = await c.holder("keep/42")
        assert holder is not None and holder["token"] == leases[42].fencing_token
    finally:
        await c.close()
        srv.stop()


@pytest.mark.one_loop
async def test_session_leases_survive_sigkill_of_the_primary_and_promotion(cluster, loop_errors):
    p = cluster.primary()
    s = cluster.standby(p.address, failover_after=1.0, grace=0.2)
    c = await fastlock.connect(p.address, s.address, client_name="rider", request_timeout=2.0)
    try:
        leases = await lock_all(c, [f"ride/{i}" for i in range(100)], 4.0)
        await poll(lambda: sessions_status(c), lambda st: st["leases"] == 100, timeout=30, what="attached")
        await poll(lambda: status_of(s.address), lambda st: st["locks_held"] == 100, timeout=10,
                   what="the standby caught up")
        p.kill()
        await asyncio.to_thread(s.wait_for_log, r"PROMOTED", 15)
        st = await poll(lambda: status_of(s.address), lambda st: st["client_sessions"]["leases"] == 100,
                        timeout=30, what="the session re-opened on the promoted standby")
        await poll(lambda: status_of(s.address),
                   lambda x: x["client_sessions"]["keepalives"] >= st["client_sessions"]["keepalives"] + 6,
                   timeout=30, what="keep-alives on the new primary")
        assert not any(lease.lost.is_set() for lease in leases)
        holder = await c.holder("ride/7")
        assert holder is not None and holder["token"] == leases[7].fencing_token
    finally:
        await c.close()


async def test_a_session_is_only_usable_by_its_principal_and_its_leases_by_their_keys(tmp_path, server_factory):
    creds = CredentialsDir(tmp_path / "creds")
    srv = server_factory("secured", args=["--credentials", creds.file])
    app = await RawNode.open(srv.address, token=creds.token("app"))
    anon = await RawNode.open(srv.address, token=None)
    try:
        key = os.urandom(16)
        opened = await app.request(P.OP_SESSION_OPEN, key, 5000)
        assert len(opened["id"]) == 16 and not opened["resumed"]
        token, _, owner = await app.acquire("mine", 5000)
        # another principal with the key itself: refused, nothing changes
        with pytest.raises(PermissionDenied):
            await anon.request(P.OP_SESSION_KEEPALIVE, key)
        with pytest.raises(PermissionDenied):
            await anon.request(P.OP_SESSION_OPEN, key, 5000)
        # a lease is attached only with its own owner key
        reply = await app.request(P.OP_SESSION_ATTACH, key, [["mine", token, os.urandom(16)]], [])
        assert reply["attached"] == 0 and [item[:2] for item in reply["lost"]] == [["mine", token]]
        assert "not the current holder" in reply["lost"][0][2]
        reply = await app.request(P.OP_SESSION_ATTACH, key, [["mine", token, owner]], [])
        assert reply == {"attached": 1, "lost": []}
        assert (await app.request(P.OP_SESSION_KEEPALIVE, key))["renewed"] == 1
        # the same key opens the same session again (as after a failover)
        again = await app.request(P.OP_SESSION_OPEN, key, 5000)
        assert again == {"id": opened["id"], "ttl_ms": 5000, "resumed": True, "leases": 1}
        # a key never opened
        with pytest.raises(LeaseLost):
            await app.request(P.OP_SESSION_KEEPALIVE, os.urandom(16))
        # listing and closing sessions is an operator's
        with pytest.raises(PermissionDenied):
            await app.request(P.OP_SESSIONS, None)
        with pytest.raises(PermissionDenied):
            await app.request(P.OP_SESSION_REVOKE, opened["id"], None)
    finally:
        await app.close()
        await anon.close()


async def test_session_limits_answer_clearly(server):
    node = await RawNode.open(server.address, token=None)
    try:
        for _ in range(4):
            await node.request(P.OP_SESSION_OPEN, os.urandom(16), 5000)
        with pytest.raises(LimitExceeded, match="sessions open"):
            await node.request(P.OP_SESSION_OPEN, os.urandom(16), 5000)
        key = os.urandom(16)
        other = await RawNode.open(server.address, token=None)
        try:
            await other.request(P.OP_SESSION_OPEN, key, 5000)
            too_many = [[f"x/{i}", 1, os.urandom(16)] for i in range(61)]
            with pytest.raises(Exception, match="at most 60|items|array"):
                await other.request(P.OP_SESSION_ATTACH, key, too_many, [])
        finally:
            await other.close()
    finally:
        await node.close()


class RawSocket:
    """A blocking protocol connection in open mode whose requests go out together in one write
    (so the server reads them in one turn): what the tests of a sliced keep-alive need."""

    def __init__(self, address: str):
        import socket

        import msgpack

        host, port = address.rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)), timeout=30)
        self.unpacker = msgpack.Unpacker()
        self.packb = msgpack.packb
        self.next_id = 1
        self.send([(P.OP_HELLO, P.PROTOCOL_VERSION, "raw", None)])

    def send(self, requests: list[tuple]) -> list[list]:
        """Send ``requests`` (op, *args) in one write; return their replies in arrival order."""
        out = b""
        for op, *args in requests:
            out += self.packb([self.next_id, op, *args])
            self.next_id += 1
        self.sock.sendall(out)
        replies: list[list] = []
        while len(replies) < len(requests):
            chunk = self.sock.recv(1 << 20)
            assert chunk, "the server closed the connection"
            self.unpacker.feed(chunk)
            replies.extend(r for r in self.unpacker if r[0] != 0)  # (pushes have id 0)
        return replies

    def close(self) -> None:
        self.sock.close()


def attached_session(raw: RawSocket, leases: int) -> bytes:
    """Open a session on ``raw`` and attach ``leases`` fresh leases (TTL 60 s) to it; its key."""
    from fastlock.server.sessions import MAX_ATTACH_PER_REQUEST

    key = os.urandom(16)
    assert raw.send([(P.OP_SESSION_OPEN, key, 60_000)])[0][1] == 0
    owners = [os.urandom(16) for _ in range(leases)]
    acquired = raw.send([(P.OP_ACQUIRE, f"sliced/{i}", owners[i], 60_000, 0, 0, None) for i in range(leases)])
    assert all(r[1] == 0 for r in acquired)
    tokens = {r[0]: r[2][0] for r in acquired}
    items = [[f"sliced/{i}", tokens[acquired[0][0] + i], owners[i]] for i in range(leases)]
    pages = [(P.OP_SESSION_ATTACH, key, items[i:i + MAX_ATTACH_PER_REQUEST], [])
             for i in range(0, leases, MAX_ATTACH_PER_REQUEST)]
    assert sum(r[2]["attached"] for r in raw.send(pages)) == leases
    return key


def test_a_large_keepalive_lets_requests_behind_it_be_answered_first(server):
    """A keep-alive renews KEEPALIVE_PAGE leases per loop turn: a PING sent right behind it, in
    the same write, is answered before the keep-alive, which still renews every lease."""
    from fastlock.server.sessions import KEEPALIVE_PAGE

    raw = RawSocket(server.address)
    try:
        leases = 2 * KEEPALIVE_PAGE + 500
        key = attached_session(raw, leases)
        keepalive_id = raw.next_id
        replies = raw.send([(P.OP_SESSION_KEEPALIVE, key), (P.OP_PING,)])
        assert [r[0] for r in replies] == [keepalive_id + 1, keepalive_id]  # the PING first
        assert replies[1][1] == 0 and replies[1][2] == {"renewed": leases, "lost": [], "more": False}
        st = raw.send([(P.OP_STATUS,)])[0][2]["client_sessions"]
        assert st["keepalives"] == 1 and st["renewals"] == leases
    finally:
        raw.close()


def test_a_session_closed_during_its_keepalive_ends_the_keepalive_with_lease_lost(server):
    """A SESSION_CLOSE handled between two pages of a keep-alive: the keep-alive stops at the
    next page with LeaseLost (the client opens the session again and re-attaches its leases)."""
    from fastlock.server.sessions import KEEPALIVE_PAGE

    raw = RawSocket(server.address)
    try:
        key = attached_session(raw, KEEPALIVE_PAGE + 10)
        keepalive_id = raw.next_id
        replies = {r[0]: r for r in raw.send([(P.OP_SESSION_KEEPALIVE, key), (P.OP_SESSION_CLOSE, key)])}
        assert replies[keepalive_id + 1][1] == 0
        refused = replies[keepalive_id]
        assert refused[1] == LeaseLost.code and "closed or ended during its keep-alive" in refused[2]
        # the session key opens it again, empty
        reopened = raw.send([(P.OP_SESSION_OPEN, key, 60_000)])[0][2]
        assert reopened["resumed"] is False and reopened["leases"] == 0
    finally:
        raw.close()


async def test_a_keepalive_reply_that_accounts_for_fewer_leases_renews_none():
    """A SESSION_KEEPALIVE reply whose renewed and lost leases number fewer than the leases
    the client attached comes from a session that is not the one they were attached to: no
    lease counts as renewed, and the keeper raises LeaseLost (its round opens the session
    again and attaches every lease)."""
    from types import SimpleNamespace

    from fastlock.client.session import SessionKeeper

    renewed = []

    class Attached:
        window = 5.0

        def __init__(self, i):
            self.lease = SimpleNamespace(name=f"acct/{i}", fencing_token=i + 1)

        def renewed_by_session(self, sent):
            renewed.append(self.lease.name)

        def lose_by_session(self, why):
            raise AssertionError(f"{self.lease.name} lost: {why}")

    keeper = SessionKeeper(SimpleNamespace())
    for i in range(3):
        r = Attached(i)
        keeper._renewers[id(r)] = r
        keeper._attached.add(id(r))

    def reply(renewed_count):
        async def send(op, args):
            assert op == P.OP_SESSION_KEEPALIVE
            return {"renewed": renewed_count, "lost": [], "more": False}
        keeper._send = send

    loop = asyncio.get_running_loop()
    reply(2)
    with pytest.raises(LeaseLost, match="knows 2 of the 3 leases"):
        await keeper._keepalive(loop)
    assert renewed == []
    reply(3)
    await keeper._keepalive(loop)
    assert sorted(renewed) == ["acct/0", "acct/1", "acct/2"]


def churned_leases(raw: RawSocket, key: bytes, rounds: int, prefix: str) -> None:
    """``rounds`` times: take 60 leases, attach them to session ``key``, release them (no keep-alive)."""
    from fastlock.server.sessions import MAX_ATTACH_PER_REQUEST

    for r in range(rounds):
        names = [f"{prefix}/{r}/{i}" for i in range(MAX_ATTACH_PER_REQUEST)]
        owners = [os.urandom(16) for _ in names]
        first = raw.next_id
        acquired = {x[0]: x for x in raw.send([(P.OP_ACQUIRE, n, o, 60_000, 0, 0, None)
                                               for n, o in zip(names, owners, strict=True)])}
        tokens = [acquired[first + i][2][0] for i in range(len(names))]
        attached = raw.send([(P.OP_SESSION_ATTACH, key, [[n, t, o] for n, t, o in zip(names, tokens, owners,
                                                                                        strict=True)], [])])
        assert attached[0][1] == 0 and attached[0][2]["attached"] == len(names)
        released = raw.send([(P.OP_RELEASE, n, t, o) for n, t, o in zip(names, tokens, owners, strict=True)])
        assert all(x[1] == 0 for x in released)


def test_a_session_keeps_no_lease_that_ended_beyond_a_bound(server):
    """A client that attaches leases, releases them and never sends a keep-alive (nor a detach)
    cannot make its session hold more than the leases it holds plus a bounded list of ended
    ones; the keep-alive still names each lease that ended since the last one as lost."""
    from fastlock.server.sessions import MAX_LOST_LISTED

    raw = RawSocket(server.address)
    try:
        key = os.urandom(16)
        assert raw.send([(P.OP_SESSION_OPEN, key, 60_000)])[0][1] == 0
        churned_leases(raw, key, 2, "told")
        keepalive = raw.send([(P.OP_SESSION_KEEPALIVE, key)])[0]
        assert keepalive[1] == 0
        assert keepalive[2]["renewed"] == 0 and len(keepalive[2]["lost"]) == 120 and not keepalive[2]["more"]
        rounds = 2 * MAX_LOST_LISTED // 60 + 2
        churned_leases(raw, key, rounds, "churn")
        st = raw.send([(P.OP_STATUS,)])[0][2]["client_sessions"]
        assert st["leases"] == 0  # none is held
        keepalive = raw.send([(P.OP_SESSION_KEEPALIVE, key)])[0]
        assert keepalive[1] == 0 and keepalive[2]["renewed"] == 0
        assert 0 < len(keepalive[2]["lost"]) <= MAX_LOST_LISTED
    finally:
        raw.close()


def test_a_lease_is_attached_to_one_session_at_a_time(server):
    """Attaching a lease to a second session moves it there: the sessions of one principal
    never hold a lease more than once between them (each would be renewed and listed again)."""
    raw = RawSocket(server.address)
    try:
        keys = [os.urandom(16) for _ in range(4)]
        assert all(r[1] == 0 for r in raw.send([(P.OP_SESSION_OPEN, k, 60_000) for k in keys]))
        owner = os.urandom(16)
        acquired = raw.send([(P.OP_ACQUIRE, "shared-by-sessions", owner, 60_000, 0, 0, None)])[0]
        token = acquired[2][0]
        attached = raw.send([(P.OP_SESSION_ATTACH, k, [["shared-by-sessions", token, owner]], []) for k in keys])
        assert all(r[1] == 0 and r[2]["attached"] == 1 for r in attached)
        st = raw.send([(P.OP_STATUS,)])[0][2]["client_sessions"]
        assert st["open"] == 4 and st["leases"] == 1
        renewed = [r[2]["renewed"] for r in raw.send([(P.OP_SESSION_KEEPALIVE, k) for k in keys])]
        assert renewed == [0, 0, 0, 1]  # the last session it was attached to renews it
    finally:
        raw.close()


def test_the_per_connection_session_limit_follows_a_session_to_the_connection_it_was_last_heard_from(server):
    """Sessions count against the connection each was last heard from: a keep-alive from
    another connection moves one there, and a closed session frees its place."""
    a, b = RawSocket(server.address), RawSocket(server.address)
    try:
        keys = [os.urandom(16) for _ in range(MAX_SESSIONS_PER_CONNECTION)]
        assert all(r[1] == 0 for r in a.send([(P.OP_SESSION_OPEN, k, 60_000) for k in keys]))
        refused = a.send([(P.OP_SESSION_OPEN, os.urandom(16), 60_000)])[0]
        assert refused[1] == LimitExceeded.code and "sessions open" in refused[2]
        assert b.send([(P.OP_SESSION_KEEPALIVE, keys[0])])[0][1] == 0  # heard from b now
        assert a.send([(P.OP_SESSION_OPEN, os.urandom(16), 60_000)])[0][1] == 0
        more = b.send([(P.OP_SESSION_OPEN, os.urandom(16), 60_000) for _ in range(MAX_SESSIONS_PER_CONNECTION)])
        assert [r[1] for r in more] == [0] * (MAX_SESSIONS_PER_CONNECTION - 1) + [LimitExceeded.code]
        assert b.send([(P.OP_SESSION_CLOSE, keys[0])])[0][1] == 0
        assert b.send([(P.OP_SESSION_OPEN, os.urandom(16), 60_000)])[0][1] == 0
    finally:
        a.close()
        b.close()
