"""Clients that ride through a failover (issue 10's six scenarios), on real processes.

Each test starts a real primary and standby (``fastlock serve``), drives a real
:class:`fastlock.Client` that lists both addresses, injects the fault (kill -9,
``fastlock promote`` with the old primary alive, a cut replication link, a
frozen client process) and checks what the caller sees:

1. after kill -9 of the primary, ``acquire(wait=15)`` is granted by the
   promoted standby (no ConnectionLost);
2. ``fastlock promote`` with the old primary alive, and fail-back: a renewing
   ``lock(ttl=10)`` is never lost and its exit does not raise;
3. a waiter frozen (SIGSTOP) while queued is never handed a dead lease;
4. a renewal that meets ``Unavailable`` keeps retrying, goes ``in_jeopardy``
   then ``lost`` when it cannot succeed, and never dies unseen;
5. a client on a deposed or fenced node finds the new primary;
6. a release refused by a fenced old primary takes effect at the new primary.
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import tempfile
import time

import pytest

import fastlock
from fastlock._testbase.cluster import RawNode, poll, run, status_of
from fastlock.errors import ConnectionLost, NotPrimary, Unavailable
from fastlock.tokens import epoch_of as epoch

FAILOVER = 1.0  # --failover-after, seconds
GRACE = 0.3  # --promotion-grace, seconds


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fastlock", *args], capture_output=True, text=True,
                          timeout=60, cwd=tempfile.gettempdir())


class LoopErrors:
    """Collect what the event loop reports unseen ("Task exception was never retrieved")."""

    def __init__(self) -> None:
        self.errors: list[str] = []
        asyncio.get_running_loop().set_exception_handler(
            lambda _loop, ctx: self.errors.append(str(ctx.get("exception") or ctx.get("message"))))

    def check(self) -> None:
        assert not self.errors, f"unhandled errors reported to the event loop: {self.errors}"


class Refusals(list):
    """The ride-through log lines (one per refusal the client followed: INFO, or DEBUG when the
    INFO line for the same refusal is rate-limited)."""

    def __init__(self) -> None:
        super().__init__()
        import logging

        class Handler(logging.Handler):
            def emit(inner, record):
                if "refused a request" in record.getMessage():
                    self.append(record.getMessage())

        self._handler = Handler()
        self._logger = logging.getLogger("fastlock.client")
        self._logger.addHandler(self._handler)
        self._level = self._logger.level
        self._logger.setLevel(logging.DEBUG)

    def close(self) -> None:
        self._logger.removeHandler(self._handler)
        self._logger.setLevel(self._level)


# --------------------------------------------------------------------------- 1: kill -9


def test_1_acquire_after_kill9_is_granted_by_the_promoted_standby(cluster):
    p = cluster.primary()
    s = cluster.standby(p.address, failover_after=FAILOVER, grace=GRACE)

    async def main():
        errors = LoopErrors()
        async with fastlock.connect(p.address, s.address, client_name="rider", connect_timeout=1.0) as client:
            first = await client.acquire("before", ttl=5.0)
            await client.release(first)
            p.kill()
            killed_at = time.monotonic()
            lease = await client.acquire("after", ttl=5.0, wait=15.0)
            took = time.monotonic() - killed_at
            assert epoch(lease.fencing_token) == 1 and lease.fencing_token > first.fencing_token
            assert client.server_info["role"] == "primary" and client.server_info["epoch"] == 1
            assert await client.check("after", lease.fencing_token)
            assert 0 < lease.time_left() <= 5.0
            await client.release(lease)
        errors.check()
        print(f"\nkill -9 -> acquire(wait=15) granted by the promoted standby after {took:.3f} s "
              f"(--failover-after {FAILOVER}, --promotion-grace {GRACE})")
        # promotion after F of silence, the grace, and the client's backoff (at most 0.5 s)
        assert took <= FAILOVER + GRACE + 3.0, f"the grant took {took:.2f} s after the kill"

    run(main())


# --------------------------------------------------------------------------- 2: promote, fail-back


async def _renewed_on(address: str, name: str, token: int, timeout: float) -> dict:
    """Wait until ``address`` (once a primary) sees ``name``'s lease renewed: the
    moment its current TTL started (now - (ttl - remaining)) moves forward, which
    only an EXTEND does."""
    await poll(lambda: status_of(address), lambda st: st["role"] == "primary", timeout=timeout,
               what=f"{address} to be primary", interval=0.02)
    node = await RawNode.open(address)

    async def started() -> tuple[dict | None, float]:
        h = await node.holder(name)
        return h, (time.monotonic() - (h["ttl_ms"] - h["remaining_ms"]) / 1000.0) if h else 0.0

    try:
        first, since = await started()
        assert first is not None and first["token"] == token, first
        h, _ = await poll(started, lambda r: r[0] is not None and r[0]["token"] == token and r[1] > since + 0.1,
                          timeout=timeout, what=f"a renewal of {name!r} at {address}", interval=0.05)
        return h
    finally:
        await node.close()


def test_2_lock_survives_a_manual_promotion_and_the_fail_back(cluster):
    p = cluster.primary()
    s = cluster.standby(p.address)  # promotion by command only

    async def main():
        errors = LoopErrors()
        refusals = Refusals()
        try:
            async with fastlock.connect(p.address, s.address, client_name="holder", connect_timeout=1.0) as client:
                states: list[str] = []
                async with client.lock("job", ttl=6.0) as lease:
                    lease.health.add_listener(states.append)
                    await poll(lambda: status_of(s.address), lambda st: st["locks_held"] == 1, timeout=5,
                               what="the lease replicated")
                    res = await asyncio.to_thread(cli, "promote", "--server", s.address)
                    assert res.returncode == 0, res.stderr
                    assert json.loads(res.stdout)["epoch"] == 1
                    await poll(lambda: status_of(p.address), lambda st: st["role"] != "primary", timeout=5,
                               what="the old primary to step down")
                    # the next renewal lands on the new primary (renewals every ~1.7 s)
                    await _renewed_on(s.address, "job", lease.fencing_token, timeout=8)
                    assert client.server_info["epoch"] == 1
                    assert not lease.lost.is_set()

                    # fail-back, the documented way: the deposed node rejoins as a standby
                    # of the new primary (same port), then is promoted with B alive
                    p.stop()
                    rejoined = cluster._start(type(p)(p.data_dir, port=p.port,
                                                      args=["--standby-of", s.address, "--name", "old",
                                                            *cluster.auth_args("primary")]))
                    rejoined.wait_for_log(r"replicating from", 10)
                    await poll(lambda: status_of(rejoined.address), lambda st: st["locks_held"] == 1, timeout=5,
                               what="the lease replicated back")
                    res = await asyncio.to_thread(cli, "promote", "--server", rejoined.address)
                    assert res.returncode == 0, res.stderr
                    assert json.loads(res.stdout)["epoch"] == 2
                    await _renewed_on(rejoined.address, "job", lease.fencing_token, timeout=8)
                    assert client.server_info["epoch"] == 2
                    assert not lease.lost.is_set()
                # the exit released at the current primary, and raised nothing
                assert not lease.lost.is_set()
                assert "lost" not in states
                node = await RawNode.open(rejoined.address)
                try:
                    assert await node.holder("job") is None
                finally:
                    await node.close()
        finally:
            refusals.close()
        errors.check()
        # each node that stopped being primary was dropped after a refusal or two, not retried
        assert len(refusals) <= 6, refusals

    run(main(), timeout=60)


# --------------------------------------------------------------------------- 3: frozen waiter

_WAITER = r"""
import asyncio, json, sys
import fastlock

async def main(address, wait):
    async with fastlock.connect(address, client_name="frozen-waiter") as client:
        print(json.dumps({"event": "connected"}), flush=True)
        try:
            lease = await client.acquire("w", ttl=1.0, wait=wait)
        except fastlock.FastlockError as exc:
            print(json.dumps({"event": "error", "type": type(exc).__name__, "message": str(exc)}), flush=True)
            return
        left = lease.time_left()
        ok = await client.check("w", lease.fencing_token)
        print(json.dumps({"event": "granted", "token": lease.fencing_token, "time_left": left, "check": ok,
                          "lost": lease.lost.is_set()}), flush=True)

asyncio.run(main(sys.argv[1], float(sys.argv[2])))
"""


@pytest.mark.parametrize("wait", [30.0, 2.5])
def test_3_a_frozen_waiter_is_never_handed_a_dead_lease(server, wait):
    """A holds ``w`` (ttl 3 s); B queues for it with ttl 1 s and is frozen; A
    releases, the server grants B, B's lease runs out on the server while B is
    frozen; B resumes.  With time left in its wait, B gives the dead grant back
    and queues again (a live lease, a new token); with none, ``LeaseLost``."""

    async def main():
        async with fastlock.connect(server.address, client_name="holder") as a:
            held = await a.acquire("w", ttl=3.0)
            proc = await asyncio.create_subprocess_exec(sys.executable, "-c", _WAITER, server.address, str(wait),
                                                        stdout=asyncio.subprocess.PIPE)
            try:
                line = json.loads(await asyncio.wait_for(proc.stdout.readline(), 20))
                assert line["event"] == "connected"
                await poll(a.status, lambda st: st["waiters"] == 1, timeout=10, what="B queued")
                proc.send_signal(signal.SIGSTOP)
                frozen_at = time.monotonic()
                await a.release(held)
                granted = await a.holder("w")
                assert granted is not None and granted["client"] == "frozen-waiter"
                dead_token = granted["token"]
                # the lease B was granted runs out on the server while B is frozen
                await poll(lambda: a.holder("w"), lambda h: h is None, timeout=5, what="B's lease to expire")
                if wait < 10:  # let B's whole wait run out while it is frozen
                    await asyncio.sleep(max(0.0, frozen_at + wait + 0.2 - time.monotonic()))
                proc.send_signal(signal.SIGCONT)
                line = json.loads(await asyncio.wait_for(proc.stdout.readline(), 20))
                await asyncio.wait_for(proc.wait(), 20)
            finally:
                if proc.returncode is None:
                    proc.send_signal(signal.SIGCONT)
                    proc.kill()
                    await proc.wait()
        if wait > 10:
            assert line["event"] == "granted", line
            assert line["token"] > dead_token, "the dead lease was returned as granted"
            assert line["check"] is True and not line["lost"]
            assert 0 < line["time_left"] <= 1.0
        else:
            assert line == {"event": "error", "type": "LeaseLost", "message": line["message"]}, line

    run(main())


# --------------------------------------------------------------------------- 4: Unavailable


@pytest.mark.parametrize("knows_standby", [False, True])
def test_4_a_renewal_meeting_unavailable_keeps_retrying_and_never_dies_unseen(cluster, knows_standby):
    """The replication link is cut: the primary fences itself and refuses the
    renewals with ``Unavailable``.  A client that knows only the primary rides
    on until the lease's deadline: ``in_jeopardy`` first, then ``lost``.  A
    client that knows the standby too renews there once it has promoted."""
    p = cluster.primary()
    px = cluster.proxy(p.address)
    s = cluster.standby(px.address, failover_after=FAILOVER, grace=GRACE)
    addresses = [p.address, s.address] if knows_standby else [p.address]

    async def main():
        errors = LoopErrors()
        async with fastlock.connect(*addresses, client_name="renewer", connect_timeout=1.0) as client:
            states: list[tuple[str, float]] = []
            lease = await client.lock("job", ttl=3.0)
            lease.health.add_listener(lambda st: states.append((st, time.monotonic())))
            await poll(lambda: status_of(s.address), lambda st: st["locks_held"] == 1, timeout=5,
                       what="the lease replicated")
            cut_at = time.monotonic()
            px.pause()
            px.cut()
            await poll(lambda: status_of(p.address), lambda st: st["replication"]["fenced"], timeout=FAILOVER + 2,
                       what="the primary to fence itself")
            if knows_standby:
                await _renewed_on(s.address, "job", lease.fencing_token, timeout=6)
                assert not lease.lost.is_set()
                assert client.server_info["epoch"] == 1
                await client.release(lease)
            else:
                # the old primary, once it has rejoined the new one as its standby (it reaches the
                # standby's own address: only the link is cut), redirects the renewals there
                rejoined = asyncio.ensure_future(_renewed_on(s.address, "job", lease.fencing_token, timeout=6))
                await asyncio.wait({rejoined, asyncio.ensure_future(lease.lost.wait())}, timeout=6,
                                   return_when=asyncio.FIRST_COMPLETED)
                if lease.lost.is_set():
                    rejoined.cancel()
                    lost_at = time.monotonic()
                    kinds = [st for st, _ in states]
                    assert kinds[-2:] == ["in_jeopardy", "lost"], states
                    # lost no later than the TTL after the last renewal (plus scheduling slack)
                    assert lost_at - cut_at <= 3.0 + 1.0
                else:
                    await rejoined
                    assert client.server_info["epoch"] == 1 and not lease.lost.is_set()
            await asyncio.sleep(0)
        errors.check()

    run(main())


# --------------------------------------------------------------------------- 5: deposed / fenced


@pytest.mark.parametrize("how", ["deposed", "fenced"])
def test_5_a_client_on_a_deposed_or_fenced_node_finds_the_new_primary(cluster, how):
    p = cluster.primary()
    if how == "fenced":
        px = cluster.proxy(p.address)
        s = cluster.standby(px.address, failover_after=FAILOVER, grace=GRACE)
    else:
        s = cluster.standby(p.address, grace=GRACE)

    async def main():
        errors = LoopErrors()
        refusals = Refusals()
        try:
            async with fastlock.connect(p.address, s.address, client_name="stayer", connect_timeout=1.0) as client:
                lease = await client.acquire("a", ttl=10.0)
                assert client.server_info["epoch"] == 0
                # replication is asynchronous: the grant must reach the standby before the fault,
                # or the promoted node rightly does not know it (LeaseLost on the extend below)
                await poll(lambda: status_of(s.address), lambda st: st["locks_held"] >= 1, timeout=5,
                           what="the standby to apply the grant")
                if how == "deposed":
                    res = await asyncio.to_thread(cli, "promote", "--server", s.address)
                    assert res.returncode == 0, res.stderr
                    await poll(lambda: status_of(p.address), lambda st: st["role"] != "primary", timeout=5,
                               what="the old primary to step down")
                else:
                    px.pause()
                    px.cut()
                    await poll(lambda: status_of(p.address), lambda st: st["replication"]["fenced"],
                               timeout=FAILOVER + 2, what="the primary to fence itself")
                # the open connection is to the old node: the next call finds the new primary
                extended = await client.extend(lease)
                assert extended.fencing_token == lease.fencing_token
                assert client.server_info["epoch"] == 1
                assert await client.check("a", lease.fencing_token)
                fresh = await client.acquire("b", ttl=5.0, wait=10.0)
                assert epoch(fresh.fencing_token) == 1
                await client.release(fresh)
                await client.release(lease)
        finally:
            refusals.close()
        errors.check()
        assert len(refusals) <= 4, refusals

    run(main())


# --------------------------------------------------------------------------- 6: release


def test_6_a_release_refused_by_a_fenced_old_primary_takes_effect_at_the_new_primary(cluster):
    p = cluster.primary()
    px = cluster.proxy(p.address)
    s = cluster.standby(px.address, failover_after=FAILOVER, grace=GRACE)

    async def main():
        errors = LoopErrors()
        async with fastlock.connect(p.address, s.address, client_name="releaser", connect_timeout=1.0,
                                    request_timeout=8.0) as client:
            async with client.lock("job", ttl=20.0) as lease:
                await poll(lambda: status_of(s.address), lambda st: st["locks_held"] == 1, timeout=5,
                           what="the lease replicated")
                px.pause()
                px.cut()
                await poll(lambda: status_of(p.address), lambda st: st["replication"]["fenced"],
                           timeout=FAILOVER + 2, what="the primary to fence itself")
                # the body ends while the client's connection is still to the fenced node
            assert not lease.lost.is_set()
        await poll(lambda: status_of(s.address), lambda st: st["role"] == "primary", timeout=FAILOVER + 2,
                   what="the standby to promote")
        node = await RawNode.open(s.address)
        try:
            assert await node.holder("job") is None, "the release never reached the new primary"
        finally:
            await node.close()
        # the fenced old primary changed nothing - or, once it has rejoined the new primary (it reaches
        # its address: only the link is cut), has the new primary's table, without the lease
        st = await status_of(p.address)
        assert (st["role"] == "primary" and st["locks_held"] == 1) or (st["role"] == "standby"
                                                                       and st["locks_held"] == 0), st
        errors.check()

    run(main())


def test_7_a_release_and_an_extend_sent_to_a_frozen_primary_ride_through_within_request_timeout(cluster):
    """The primary freezes (SIGSTOP) with a release and an extend in flight: each is given up
    on after half its deadline (the server sent nothing since), leaving the other half to
    reach the promoted standby - the liveness watchdog alone would take the whole
    ``request_timeout`` and surface ConnectionLost (the nemesis's failed releases)."""
    p = cluster.primary()
    s = cluster.standby(p.address, failover_after=FAILOVER, grace=GRACE)
    request_timeout = 4 * FAILOVER  # half of it: longer than the failover window

    async def main():
        errors = LoopErrors()
        async with fastlock.connect(p.address, s.address, client_name="frozen-primary", connect_timeout=1.0,
                                    request_timeout=request_timeout) as client:
            released = await client.acquire("released", ttl=30.0)
            extended = await client.acquire("extended", ttl=30.0)
            await poll(lambda: status_of(s.address), lambda st: st["locks_held"] == 2, timeout=5,
                       what="the leases replicated")
            p.pause()
            try:
                release, extend = await asyncio.gather(client.release(released), client.extend(extended, ttl=40.0),
                                                       return_exceptions=True)
            finally:
                p.resume()
            assert release is None, f"release raised {release!r}"
            assert not isinstance(extend, BaseException), f"extend raised {extend!r}"
            assert extend.ttl == 40.0 and client.server_info["epoch"] == 1
            assert client.connection.address[1] == s.port
            assert await client.holder("released") is None
            assert (await client.holder("extended"))["token"] == extended.fencing_token
        errors.check()

    run(main())


def test_errors_that_ride_through_are_the_documented_ones():
    """The classes the client retries (the docs' table) - and nothing that means
    "the server refused this request" for good."""
    from fastlock.client import RETRYABLE

    assert set(RETRYABLE) == {ConnectionLost, NotPrimary, Unavailable}


async def test_a_grant_read_late_is_verified_not_trusted(server, connect, caplog):
    """The waiter's own loop stalls (a blocking call) while its grant sits unread:
    the grant is checked with one EXTEND (the lease is still alive, so it is kept,
    same token, renewed from now) instead of being returned with most of its TTL
    gone.  On the normal path no EXTEND is sent."""
    holder = await connect("holder")
    waiter = await connect("waiter")
    held = await holder.acquire("late", ttl=5.0)
    waiting = asyncio.ensure_future(waiter.acquire("late", ttl=1.0, wait=10.0))
    await poll(holder.status, lambda st: st["waiters"] == 1, timeout=5, what="the waiter to queue")
    await holder.release(held)
    time.sleep(0.7)  # this loop (the waiter's too) stalls with the grant unread: 0.3 s of 1 s left
    lease = await asyncio.wait_for(waiting, 5)
    assert lease.fencing_token > held.fencing_token
    assert lease.time_left() > 0.8, "the verified lease is renewed from the verification"
    assert await holder.check("late", lease.fencing_token)
    assert any("verifying it with the server" in r.getMessage() for r in caplog.records)
    caplog.clear()
    await waiter.release(lease)
    # the normal path: a queued grant read at once is returned as it is
    held = await holder.acquire("late", ttl=5.0)
    waiting = asyncio.ensure_future(waiter.acquire("late", ttl=1.0, wait=10.0))
    await poll(holder.status, lambda st: st["waiters"] == 1, timeout=5, what="the waiter to queue")
    await holder.release(held)
    lease = await asyncio.wait_for(waiting, 5)
    assert lease.time_left() > 0.5
    assert not any("verifying" in r.getMessage() for r in caplog.records)
    await waiter.release(lease)


async def test_a_server_without_waited_ms_is_still_understood(loop_errors):
    """A server from before ``waited_ms`` answers ACQUIRE with ``[token, ttl_ms]``: the
    client takes ``waited_ms`` as 0 (the grant dated from the send, as conservative),
    and a reply that took most of the TTL to come is verified, not trusted."""
    from fastlock import protocol as P

    seen: list[int] = []

    async def handle(reader, writer):
        dec = P.FrameDecoder()
        while data := await reader.read(65536):
            for req_id, op, *args in dec.feed(data):
                seen.append(op)
                if op == P.OP_HELLO:
                    writer.write(P.encode_ok(req_id, {"role": "primary", "epoch": 0, "session": 1}))
                elif op == P.OP_ACQUIRE:
                    if args[0] == "slow":
                        await asyncio.sleep(0.7)  # of a 1 s TTL: verified by an EXTEND
                    writer.write(P.encode_ok(req_id, [7, args[2]]))
                elif op == P.OP_EXTEND:
                    writer.write(P.encode_ok(req_id, args[3]))
                else:
                    writer.write(P.encode_ok(req_id, None))
        writer.close()

    srv = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = srv.sockets[0].getsockname()[1]
    try:
        async with fastlock.connect(f"127.0.0.1:{port}") as client:
            lease = await client.acquire("fast", ttl=1.0)
            assert lease.fencing_token == 7 and 0.9 < lease.time_left() <= 1.0
            assert P.OP_EXTEND not in seen
            lease = await client.acquire("slow", ttl=1.0, wait=5.0)
            assert P.OP_EXTEND in seen and 0.9 < lease.time_left() <= 1.0
    finally:
        srv.close()
        await srv.wait_closed()


async def test_a_release_with_no_connection_open_reconnects_and_releases(connect):
    client = await connect("release-reconnects")
    other = await connect("release-waiter")
    lease = await client.acquire("ride/no-conn", ttl=60)
    proto = client.connector.proto
    proto.abort(ConnectionLost("dropped by the test"))  # the connector forgets it: nothing is open
    assert client.connector.proto is None
    await asyncio.wait_for(client.release(lease), 30)  # sent on a new connection
    assert client.connector.proto is not None and client.connector.proto is not proto
    assert not lease.lost.is_set()
    # released on the server, not left to its 60 s TTL: another client gets it at once
    granted = await asyncio.wait_for(other.acquire("ride/no-conn", ttl=5, wait=0), 30)
    assert granted.fencing_token > lease.fencing_token
