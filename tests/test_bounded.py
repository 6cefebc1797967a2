"""Lease-bounded execution (issue 26): work protected by a lease is stopped before the
server could grant the lock to another holder - the earliest re-grant, from the send
time of the last grant or renewal the server confirmed, less a margin."""

from __future__ import annotations

import asyncio
import math
import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import wait_until

import fastlock
from fastlock import InvalidArgument, LeaseExpiring, LeaseLost
from fastlock._testbase.proxy import TcpProxy
from fastlock.client.bounded import DRIFT_BOUND, SERVER_CLOCK_STEP, WorkBound, earliest_regrant, stop_at
from fastlock.sync import SyncClient

TIMEOUT = 15.0


def test_the_earliest_regrant_counts_from_the_confirmed_send():
    # the server's millisecond clock may start the TTL up to 1 ms early, and report a wait 1 ms long
    assert earliest_regrant(100.0, 10.0, 0.0) == pytest.approx(110.0 - SERVER_CLOCK_STEP)
    assert earliest_regrant(100.0, 10.0, 1e-3) == pytest.approx(109.99 - SERVER_CLOCK_STEP)
    assert earliest_regrant(100.0, 10.0) == earliest_regrant(100.0, 10.0, DRIFT_BOUND)


async def test_a_partitioned_holder_s_body_is_stopped_before_the_next_grant(server):
    with TcpProxy(server.address) as proxy:
        holder = await fastlock.connect(proxy.address, request_timeout=0.5)
        other = await fastlock.connect(server.address)
        steps: list[float] = []
        try:
            with pytest.raises(LeaseExpiring) as err:
                async with holder.lock("bw/p", ttl=1.0, bounded=True, margin=0.2) as lease:
                    assert lease.remaining(0.2) > 0
                    proxy.blackhole()  # renewals go unanswered from now on
                    # the next holder queues; it is granted once the server expires the lease
                    taker = asyncio.create_task(other.acquire("bw/p", ttl=5.0, wait=TIMEOUT))
                    while True:
                        steps.append(time.monotonic())  # a side effect, timestamped
                        await asyncio.sleep(0.005)
            assert err.value.token == lease.fencing_token and err.value.name == "bw/p"
            assert isinstance(err.value, LeaseLost)
            # stopped at the bound: not after the earliest re-grant less the margin (plus
            # one step of the body), by the confirmed send time of its last renewal
            assert steps[-1] <= earliest_regrant(lease.expires_at - lease.ttl, lease.ttl)
            taken = await asyncio.wait_for(taker, TIMEOUT)
            # the grant cannot have come before the taker's request reached the server and
            # waited: its reported wait, counted from its send, bounds it from below
            assert taken.fencing_token > lease.fencing_token
            assert steps[-1] < taken.expires_at - taken.ttl  # = the taker's send + its reported wait
            await other.release(taken)
        finally:
            proxy.heal()
            await holder.close()
            await other.close()


async def test_a_renewed_bounded_lock_runs_its_body_to_the_end(server):
    async with await fastlock.connect(server.address) as client:
        async with client.lock("bw/r", ttl=0.6, bounded=True, margin=0.1) as lease:
            first_deadline = lease.deadline(0.1)
            # several TTLs: renewals move the deadline forward, the body is not stopped
            await wait_until(lambda: lease.deadline(0.1) > first_deadline + 1.2, TIMEOUT, "renewals")
        assert not lease.lost.is_set()
        assert await client.holder("bw/r") is None  # released on the way out


async def test_another_cancellation_of_the_body_is_not_turned_into_lease_expiring(server):
    async with await fastlock.connect(server.address) as client:
        entered = asyncio.Event()

        async def body():
            async with client.lock("bw/c", ttl=5.0, bounded=True):
                entered.set()
                await asyncio.sleep(TIMEOUT)

        task = asyncio.create_task(body())
        await asyncio.wait_for(entered.wait(), TIMEOUT)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert await client.holder("bw/c") is None


async def test_a_lost_lease_stops_the_body_at_once(server):
    async with await fastlock.connect(server.address) as client:
        with pytest.raises(LeaseExpiring):
            async with client.lock("bw/l", ttl=30.0, bounded=True) as lease:
                assert lease.deadline() == pytest.approx(stop_at(lease, WorkBound(0.0)))
                lease.lost.set()  # as a refused renewal sets it
                assert lease.deadline() == -math.inf
                await asyncio.sleep(TIMEOUT)


async def test_bad_bounded_arguments_are_refused_before_anything_is_sent(server):
    async with await fastlock.connect(server.address) as client:
        with pytest.raises(InvalidArgument):
            client.lock("bw/a", ttl=5.0, margin=1.0)  # a margin without bounded=True
        with pytest.raises(InvalidArgument):
            client.lock("bw/a", ttl=5.0, bounded=True, margin=5.0)  # no time left to work
        with pytest.raises(InvalidArgument):
            client.lock("bw/a", ttl=5.0, bounded=True, margin=-1.0)
        with pytest.raises(InvalidArgument):
            client.lock("bw/a", ttl=5.0, bounded=True, drift=0.7)
        with pytest.raises(InvalidArgument):
            await client.lock("bw/a", ttl=5.0, bounded=True)  # only `async with` has a body to stop
        assert await client.holder("bw/a") is None


CHILD = """
import sys, time
open(sys.argv[1], "w").write("started\\n")
while True:
    time.sleep(0.01)
"""


def test_the_blocking_lease_guards_a_subprocess_and_offers_its_deadline(server, tmp_path):
    with TcpProxy(server.address) as proxy, SyncClient(proxy.address, request_timeout=0.5) as holder, \
            SyncClient(server.address) as other:
        with holder.lock("bw/s", ttl=1.2) as lease:
            assert 0 < lease.remaining(0.2) < 1.2 and lease.deadline(0.2) < lease.deadline()
            started = tmp_path / "started"
            child = subprocess.Popen([sys.executable, "-c", CHILD, str(started)], start_new_session=True)
            guard = lease.guard_process(child.pid, margin=0.2, grace=0.2, group=True)
            try:
                deadline = time.monotonic() + TIMEOUT
                while not started.exists():
                    assert time.monotonic() < deadline and child.poll() is None
                    time.sleep(0.01)
                pidfd = os.pidfd_open(child.pid)
                proxy.blackhole()
                taken = other.acquire("bw/s", ttl=5.0, wait=TIMEOUT)
                # dead once the next holder has the lock (benches/bounded.py: before the grant)
                assert os.waitid(os.P_PIDFD, pidfd, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
                os.close(pidfd)
                assert guard.termed is not None
                assert child.wait(TIMEOUT) == -signal.SIGTERM  # SIGTERM came first (its default ends it)
            finally:
                guard.stop()
                if child.poll() is None:
                    child.kill()
                    child.wait()
            proxy.heal()
            other.release(taken)
