"""The client's liveness watchdog (``request_timeout``) against frozen servers.

A frozen server (SIGSTOP here; a stalled VM or a black-holed network in
production) keeps its TCP connections open and answers nothing.  Every call
must then fail with ConnectionLost within about ``request_timeout`` seconds,
the next call must reconnect (to a promoted standby, when there is one), and
``lock()`` must keep its lease across that failover.  An idle client, with
nothing outstanding, must neither ping nor drop its connection.
"""

from __future__ import annotations

import asyncio

import pytest
from conftest import wait_until

import fastlock
from fastlock._testbase import CredentialsDir, ServerProcess

REQUEST_TIMEOUT = 1.0
#: a generous bound (CI runs on two loaded cores): a call that has not raised by then hangs
TIMEOUT = 15.0


async def _fails_fast(call, what: str) -> None:
    """``call`` raises ConnectionLost against the frozen server instead of hanging (the
    watchdog fires after about request_timeout; the test bounds the wait generously)."""
    try:
        with pytest.raises(fastlock.ConnectionLost):
            await asyncio.wait_for(call, TIMEOUT)
    except asyncio.TimeoutError:
        raise AssertionError(f"{what} did not raise within {TIMEOUT:g} s against a frozen server") from None


async def test_every_call_against_a_frozen_server_raises_connection_lost(server, connect):
    client = await connect("frozen", request_timeout=REQUEST_TIMEOUT, connect_timeout=REQUEST_TIMEOUT)
    holder = await connect("holder")
    lease = await client.acquire("x", ttl=30.0)
    held = await holder.acquire("held", ttl=30.0)
    waiting = asyncio.ensure_future(client.acquire("held", ttl=5.0, wait=None))
    await wait_until(lambda: _waiters(holder, 1), TIMEOUT, "the waiter to queue")
    server.pause()
    try:
        # each call has one deadline (request_timeout; connect_timeout for
        # acquire(wait=0)): the frozen kernel still accepts TCP connections,
        # then the handshake gets no answer, and no other address exists
        await _fails_fast(client.ping(), "ping()")
        await _fails_fast(client.acquire("y", ttl=5.0, wait=0), "acquire(wait=0)")
        await _fails_fast(client.check("x", lease.fencing_token), "check()")
        await _fails_fast(client.extend(lease), "extend()")
        # a waiting acquire(wait=None) has no deadline: it keeps looking for a primary
        assert not waiting.done()
    finally:
        server.resume()
    # the client recovers on its own; the waiter queued again (same owner key)
    assert await client.check("x", lease.fencing_token)
    await wait_until(lambda: _waiters(holder, 1), TIMEOUT, "the waiter to queue again")
    await holder.release(held)
    granted = await asyncio.wait_for(waiting, TIMEOUT)
    assert granted.fencing_token > held.fencing_token
    assert (await holder.holder("held"))["token"] == granted.fencing_token
    await client.release(granted)
    await client.release(lease)


async def _waiters(client, n: int) -> bool:
    return (await client.status())["waiters"] == n


async def test_a_watch_on_a_frozen_server_ends_with_connection_lost(server, connect):
    client = await connect("watcher", request_timeout=REQUEST_TIMEOUT)
    events = client.watch("w")
    assert (await events.__anext__()).kind == "free"
    server.pause()
    try:
        await _fails_fast(events.__anext__(), "a watch")
    finally:
        server.resume()


async def test_an_idle_client_neither_pings_nor_drops_a_frozen_server(server, connect):
    client = await connect("idle", request_timeout=0.3)
    proto = client.connection
    await client.ping()
    server.pause()
    try:
        # nothing outstanding: silence is expected and proves nothing
        await asyncio.sleep(5 * 0.3)
        assert client.connection is proto and not proto.closed
        assert proto._watchdog is None and proto.pings == 0
    finally:
        server.resume()
    await client.ping()
    assert client.connection is proto  # the same connection served it


async def test_a_long_wait_on_a_live_server_is_kept_alive_by_pings(server, connect):
    holder = await connect("holder")
    waiter = await connect("waiter", request_timeout=0.3)
    lease = await holder.acquire("slow", ttl=30.0)
    proto = waiter.connection
    waiting = asyncio.ensure_future(waiter.acquire("slow", ttl=5.0, wait=None))
    await wait_until(lambda: _waiters(holder, 1), TIMEOUT, "the waiter to queue")
    # many request_timeouts with no reply to the acquire itself: the pings answer
    await wait_until(lambda: proto.pings >= 5, TIMEOUT, "several pings")
    assert not waiting.done() and not proto.closed
    await holder.release(lease)
    granted = await asyncio.wait_for(waiting, TIMEOUT)
    assert granted.fencing_token > lease.fencing_token and waiter.connection is proto
    await waiter.release(granted)


async def test_request_timeout_is_checked(server):
    for bad in (0, -1.0, float("nan"), float("inf")):
        with pytest.raises(fastlock.InvalidArgument):
            fastlock.connect(server.address, request_timeout=bad)
    with pytest.raises(fastlock.WrongArgumentType):
        fastlock.connect(server.address, request_timeout="5")
    async with fastlock.connect(server.address, request_timeout=None) as client:  # None: no watchdog
        assert client.request_timeout is None
        await client.ping()
        assert client.connection._watchdog is None


@pytest.fixture
def pair(tmp_path):
    """A primary and a standby that promotes itself after 1 s of primary silence."""
    creds = CredentialsDir(tmp_path / "credentials")  # a standby authenticates as a replica principal
    a = ServerProcess(tmp_path / "a", args=creds.server_args("node-1"))
    b = ServerProcess(tmp_path / "b")
    try:
        a.start()
        b.args = ["--standby-of", a.address, "--failover-after", "1", "--promotion-grace", "0.5",
                  *creds.server_args("node-2")]
        b.start()
        a.wait_for_log("standby .* attached", timeout=TIMEOUT)
        b.wait_for_log("applied snapshot", timeout=TIMEOUT)
        b.wait_for_log("paired: primary", timeout=TIMEOUT)  # automatic failover is armed
        yield a, b
    finally:
        if a.proc is not None and a.proc.poll() is None:
            a.resume()
        b.stop()
        a.stop()


async def test_lock_keeps_its_lease_when_the_primary_freezes_and_the_standby_takes_over(pair, loop_errors):
    a, b = pair
    ttl = 6.0
    async with fastlock.connect(a.address, b.address, client_name="keeper") as client:
        # default request_timeout (5 s): the renewal's own bound (ttl/3) is what
        # gets it off the frozen socket in time
        lease = await client.lock("keep", ttl=ttl)
        loop = asyncio.get_running_loop()
        a.pause()
        frozen_at = loop.time()
        b.wait_for_log("PROMOTED", timeout=TIMEOUT)
        # renewed on the new primary past the TTL the frozen one granted
        await wait_until(lambda: lease.expires_at > frozen_at + ttl + 0.5, 3 * ttl,
                         "a renewal on the promoted standby")
        assert not lease.lost.is_set()
        assert client.connection.address == ("127.0.0.1", b.port)
        assert await asyncio.wait_for(client.check("keep", lease.fencing_token), TIMEOUT) is True
        assert not lease.lost.is_set()
        await client.release(lease)


async def test_an_election_term_survives_the_primary_freezing(pair, loop_errors):
    a, b = pair
    async with fastlock.connect(a.address, b.address, client_name="leader") as client:
        election = client.election("leader", "me", lease_duration=6.0, renew_deadline=4.5, retry_period=0.5)
        term = await election.campaign(wait=TIMEOUT)
        loop = asyncio.get_running_loop()
        a.pause()
        frozen_at = loop.time()
        b.wait_for_log("PROMOTED", timeout=TIMEOUT)
        await wait_until(lambda: term.deadline > frozen_at + 4.5 + 0.5, TIMEOUT, "a renewal on the promoted standby")
        assert term.is_leader() and not term.lost.is_set()
        await term.resign()
