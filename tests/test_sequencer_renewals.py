"""Signed sequencers follow renewals, on real server processes: a lease renewed past its
first sequencer's expiry (by the session keep-alive, by EXTEND) carries a re-signed one with
the same token and a later expiry; election terms expose theirs; ``fastlock run`` rewrites
FASTLOCK_SEQUENCER_FILE; the wire refuses bad flags and bounds what one session re-signs.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time

import pytest

import fastlock
from fastlock import protocol as P
from fastlock import sequencer as S
from fastlock._testbase.cluster import RawNode, poll, run, status_of
from fastlock._testbase.servers import CredentialsDir, ServerProcess
from fastlock.auth.sequencer_keys import read_keys
from fastlock.client.session import MAX_SEQUENCED
from fastlock.errors import InvalidArgument, LimitExceeded
from fastlock.server.sessions import MAX_SEQUENCED_PER_SESSION
from fastlock.sync import SyncClient


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


async def _wall_clock() -> float:
    return time.time()


class _Reader:
    """Reads a lease's (or term's) sequencer now; ``first`` is the one it had at the start."""

    def __init__(self, get):
        self.get = get
        self.first = get()

    def __call__(self) -> str:
        return self.get()


async def _outlives_first(reader: _Reader, keys, name: str, token: int) -> tuple[S.Sequencer, S.Sequencer]:
    """Wait (bounded) until the wall clock is past the first sequencer's expiry; return the
    first and the current one, the current verified with no skew allowance at that moment
    (when the first is refused as expired)."""
    first = S.verify(reader.first, keys, name=name, skew=None)
    assert first.token == token
    await poll(_wall_clock, lambda now: now * 1000 > first.expires_at_ms + 200, timeout=30,
               what="the first sequencer's expiry to pass")
    now = time.time()
    with pytest.raises(S.ExpiredSequencer):  # the grant's sequencer alone is refused now
        S.verify(reader.first, keys, name=name, now=now, skew=0)
    current = S.verify(reader(), keys, name=name, now=now, skew=0)
    return first, current


@pytest.mark.parametrize("session", [True, False], ids=["session-keepalive", "own-extends"])
async def test_a_lease_renewed_past_its_first_expiry_carries_a_fresh_sequencer(keyed_server, session):
    srv, creds = keyed_server
    keys = _keys(creds)
    async with fastlock.connect(srv.address, token_file=creds.token_file("app"), sequencers=True,
                                session=session) as client:
        async with client.lock("orders/9", ttl=1.0) as lease:
            reader = _Reader(lambda: lease.sequencer)
            first, current = await _outlives_first(reader, keys, "orders/9", lease.fencing_token)
            assert not lease.lost.is_set()
            assert (current.token, current.principal, current.mode) == (first.token, "app", "exclusive")
            assert current.expires_at_ms > first.expires_at_ms
            keeper = client.session_keeper
            if session:
                assert keeper is not None and keeper.keepalives > 0
            else:
                assert keeper is None or keeper.keepalives == 0
        # an explicit extend re-signs too
        lease = await client.acquire("orders/10", ttl=2.0, shared=True)
        before = S.verify(lease.sequencer, keys, name="orders/10")
        await asyncio.sleep(0.05)
        await client.extend(lease, ttl=3.0)
        after = S.verify(lease.sequencer, keys, name="orders/10")
        assert (after.token, after.mode) == (before.token, "shared")
        assert after.expires_at_ms > before.expires_at_ms
        await client.release(lease)


async def test_an_election_term_exposes_its_sequencer_re_signed_by_renewals(keyed_server):
    srv, creds = keyed_server
    keys = _keys(creds)
    async with fastlock.connect(srv.address, token_file=creds.token_file("app"), sequencers=True) as client:
        election = client.election("leader", "node-a", lease_duration=1.0, renew_deadline=0.8, retry_period=0.2)
        async with election.leadership() as term:
            reader = _Reader(lambda: term.sequencer)
            first, current = await _outlives_first(reader, keys, "leader", term.fencing_token)
            assert term.is_leader()
            assert current.token == term.fencing_token and current.expires_at_ms > first.expires_at_ms
    async with fastlock.connect(srv.address, token_file=creds.token_file("app")) as client:
        async with client.election("leader", "node-b").leadership() as term:
            assert term.sequencer is None  # not asked for


def test_a_blocking_term_exposes_its_sequencer(keyed_server):
    srv, creds = keyed_server
    with SyncClient(srv.address, token_file=creds.token_file("app"), sequencers=True) as client:
        with client.election("leader", "node-a").leadership() as term:
            assert S.verify(term.sequencer, _keys(creds), name="leader").token == term.fencing_token


CHILD = r"""
import base64, os, time
path = os.environ["FASTLOCK_SEQUENCER_FILE"]
first = os.environ["FASTLOCK_SEQUENCER"]
assert open(path).read().strip() == first
# the expiry of the grant's sequencer: bytes 22..30 of the documented format (big-endian Unix ms)
expires = int.from_bytes(base64.urlsafe_b64decode(first + "=" * (-len(first) % 4))[22:30], "big")
deadline = time.monotonic() + 30
while time.monotonic() < deadline:
    now = time.time()
    current = open(path).read().strip()
    if now * 1000 > expires + 200 and current != first:
        print(first, current, now, path)
        break
    time.sleep(0.05)
"""


def test_fastlock_run_rewrites_the_sequencer_file_after_renewals(keyed_server):
    srv, creds = keyed_server
    keys = _keys(creds)
    env = {**os.environ, "FASTLOCK_TOKEN_FILE": creds.token_file("app")}
    out = subprocess.run([sys.executable, "-m", "fastlock", "run", "job", "--ttl", "1", "--server", srv.address,
                          "--sequencer", "--", sys.executable, "-c", CHILD],
                         capture_output=True, text=True, env=env, timeout=90)
    assert out.returncode == 0, out.stderr
    first_text, current_text, seen, path = out.stdout.split()
    first = S.verify(first_text, keys, name="job", skew=None)
    # read by the command once the wall clock was past the grant's expiry: still valid then
    current = S.verify(current_text, keys, name="job", now=float(seen), skew=0)
    assert current.token == first.token and current.expires_at_ms > first.expires_at_ms
    assert not os.path.exists(os.path.dirname(path))  # removed when the command ended


async def test_the_wire_refuses_bad_flags_and_bounds_what_a_session_re_signs(keyed_server):
    srv, creds = keyed_server
    keys = _keys(creds)
    node = await RawNode.open(srv.address, token=open(creds.token_file("app")).read().strip())
    try:
        owner = os.urandom(16)
        reply = await node.request(P.OP_ACQUIRE, "w", owner, 5000, 0, 0, None, False, 0, 0, True)
        token = reply[0]
        assert await node.request(P.OP_EXTEND, "w", token, owner, 5000) == 5000  # the plain reply
        assert await node.request(P.OP_EXTEND, "w", token, owner, 4000, False) == 4000  # not asked
        ttl_ms, signed = await node.request(P.OP_EXTEND, "w", token, owner, 6000, True)
        assert ttl_ms == 6000 and S.verify(signed["sequencer"], keys, name="w").token == token
        with pytest.raises(InvalidArgument, match="sequencer must be a bool"):
            await node.request(P.OP_EXTEND, "w", token, owner, 6000, 1)
        key = os.urandom(16)
        await node.request(P.OP_SESSION_OPEN, key, 10_000)
        with pytest.raises(InvalidArgument, match="sequencer must be a bool"):
            await node.request(P.OP_SESSION_ATTACH, key, [["w", token, owner, "yes"]], [])
        attached = await node.request(P.OP_SESSION_ATTACH, key, [["w", token, owner, True]], [])
        assert attached["attached"] == 1
        [[name, tok, blob]] = attached["sequencers"]
        assert (name, tok) == ("w", token) and S.verify(blob, keys, name="w").token == token
        renewed = await node.request(P.OP_SESSION_KEEPALIVE, key)
        assert renewed["renewed"] == 1 and S.verify(renewed["sequencers"][0][2], keys, name="w").token == token
        # the bound: MAX_SEQUENCED_PER_SESSION re-signed leases per session (the first is "w")
        held = []
        for n in range(MAX_SEQUENCED_PER_SESSION):
            o = os.urandom(16)
            r = await node.request(P.OP_ACQUIRE, f"m/{n}", o, 10_000, 0, 0, None, False, 0, 0, True)
            held.append([f"m/{n}", r[0], o, True])
        for start in range(0, MAX_SEQUENCED_PER_SESSION - 1, 60):
            page = held[start:min(start + 60, MAX_SEQUENCED_PER_SESSION - 1)]
            assert (await node.request(P.OP_SESSION_ATTACH, key, page, []))["attached"] == len(page)
        with pytest.raises(LimitExceeded, match="at most"):
            await node.request(P.OP_SESSION_ATTACH, key, [held[-1]], [])
        # detaching one in the same request makes room
        done = await node.request(P.OP_SESSION_ATTACH, key, [held[-1]], [["w", token]])
        assert done["attached"] == 1
        # attached without the flag: renewed, not re-signed
        assert "sequencers" not in await node.request(P.OP_SESSION_ATTACH, key, [["w", token, owner]], [])
    finally:
        await node.close()


def test_after_a_failover_the_new_primary_re_signs_the_held_lease(cluster):
    """The primary dies (kill -9); the promoted standby renews the client's lease when the
    session is opened there again, and re-signs its sequencer: the same token (epoch 0), an
    expiry only a signature made after the kill can have."""
    p = cluster.primary()
    s = cluster.standby(p.address, failover_after=1.0, grace=0.2)
    keys = _keys(cluster.creds)
    ttl = 5.0

    async def main():
        async with fastlock.connect(p.address, s.address, token_file=cluster.creds.token_file("app"),
                                    sequencers=True) as client:
            async with client.lock("ledger", ttl=ttl) as lease:
                first = S.verify(lease.sequencer, keys, name="ledger")
                await poll(lambda: status_of(s.address), lambda st: st["locks_held"] == 1, timeout=10,
                           what="standby caught up")
                killed_ms = int(time.time() * 1000)
                await asyncio.to_thread(p.kill)
                await asyncio.to_thread(s.wait_for_log, r"PROMOTED", 15)

                async def current() -> S.Sequencer:
                    return S.verify(lease.sequencer, keys, name="ledger")

                # signed by the old primary: expiry <= killed_ms + ttl; by the new one: later
                fresh = await poll(current, lambda seq: seq.expires_at_ms > killed_ms + ttl * 1000 + 1,
                                   timeout=30, what="a sequencer re-signed by the promoted standby")
                assert not lease.lost.is_set()
                assert (fresh.token, fresh.epoch, fresh.principal) == (first.token, 0, "app")

    run(main(), timeout=90)


async def test_leases_past_the_session_bound_re_sign_with_their_own_extends(keyed_server):
    srv, creds = keyed_server
    keys = _keys(creds)
    async with fastlock.connect(srv.address, token_file=creds.token_file("app"), sequencers=True) as client:
        leases = [await client.lock(f"many/{i}", ttl=2.0) for i in range(MAX_SEQUENCED + 1)]
        keeper = client.session_keeper
        assert keeper is not None and len(keeper) == MAX_SEQUENCED  # the last one renews itself
        reader = _Reader(lambda: leases[-1].sequencer)
        await _outlives_first(reader, keys, leases[-1].name, leases[-1].fencing_token)
        now = time.time()
        for lease in leases:  # every one, through the session or its own EXTENDs, is current
            assert not lease.lost.is_set()
            assert S.verify(lease.sequencer, keys, name=lease.name, now=now, skew=0).token == lease.fencing_token
        for lease in leases:
            await client.release(lease)
