"""Re-entrant locks (issue 29, item 1): a re-entry by the holding task returns the same
lease and fencing token and counts; the lease is released at zero; another caller waits;
the acquire limit fails at once; a property test checks sequences of acquires and releases
by several tasks against a reference model."""

from __future__ import annotations

import asyncio
import itertools
import threading

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fastlock
from fastlock import AcquireLimitReached, AlreadyHeld, LockNotAcquired, LockNotHeld
from fastlock.client.reentrant import MAX_ACQUIRE_LIMIT, check_acquire_limit
from fastlock.errors import InvalidArgument, WrongArgumentType
from fastlock.sync import SyncClient

TIMEOUT = 10.0


async def test_nested_three_times_one_token_count_three_freed_at_zero(client, connect):
    lock = client.reentrant_lock("re/1", ttl=10.0)
    async with asyncio.timeout(TIMEOUT):
        async with lock as a:
            async with lock as b:
                async with client.reentrant_lock("re/1", ttl=10.0) as c:  # another object, same hold
                    assert a.fencing_token == b.fencing_token == c.fencing_token
                    assert lock.hold_count == 3
                    holder = await client.holder("re/1")
                    assert holder is not None and holder["token"] == a.fencing_token
                assert lock.hold_count == 2
            assert lock.hold_count == 1
            assert await client.check("re/1", a.fencing_token)
        assert lock.hold_count == 0
        assert await client.holder("re/1") is None
        other = await connect("other")
        lease = await other.acquire("re/1", ttl=5.0, wait=0)
        assert lease.fencing_token > a.fencing_token
        await other.release(lease)


async def test_another_caller_waits_until_count_is_zero(client, connect):
    lock = client.reentrant_lock("re/2", ttl=10.0)
    other = await connect("other")

    async def hold_once(on):
        held = on.reentrant_lock("re/2", ttl=10.0)
        lease = await held.acquire()
        await held.release()
        return lease

    async with asyncio.timeout(TIMEOUT):
        first = await lock.acquire()
        await lock.acquire()
        waiter = asyncio.ensure_future(hold_once(other))  # another client
        # an unrelated task of the same client waits too (it is another caller)
        sibling = asyncio.get_running_loop().create_task(_new_caller_acquire(client, "re/2"))
        await lock.release()
        with pytest.raises(LockNotAcquired):
            await other.acquire("re/2", ttl=1.0, wait=0)
        assert not waiter.done() and not sibling.done()
        await lock.release()
        leases = await asyncio.gather(waiter, sibling)
        assert first.fencing_token < min(lease.fencing_token for lease in leases)
        assert leases[0].fencing_token != leases[1].fencing_token


async def _new_caller_acquire(client, name):
    fastlock.client.new_caller()  # a task of its own, acting for no ancestor
    lock = client.reentrant_lock(name, ttl=10.0)
    lease = await lock.acquire()
    await lock.release()
    return lease


async def test_acquire_limit_fails_at_once_and_sends_nothing(client):
    lock = client.reentrant_lock("re/3", ttl=10.0, acquire_limit=1)
    async with asyncio.timeout(TIMEOUT):
        lease = await lock.acquire()
        with pytest.raises(AcquireLimitReached) as err:
            await lock.acquire()
        assert err.value.token == lease.fencing_token and err.value.count == 1
        assert isinstance(err.value, AlreadyHeld) and isinstance(err.value, LockNotAcquired)
        assert lock.hold_count == 1  # the refused re-entry did not count
        limited = client.reentrant_lock("re/4", ttl=10.0, acquire_limit=3)
        for _ in range(3):
            await limited.acquire()
        with pytest.raises(AcquireLimitReached):
            await limited.acquire()
        for _ in range(3):
            await limited.release()
        await lock.release()
        assert await client.holder("re/3") is None and await client.holder("re/4") is None


async def test_release_by_a_caller_that_does_not_hold_it(client):
    lock = client.reentrant_lock("re/5", ttl=10.0)
    with pytest.raises(LockNotHeld):
        await lock.release()
    await lock.acquire()

    async def stranger():
        fastlock.client.new_caller()
        await lock.release()

    with pytest.raises(LockNotHeld):
        await asyncio.get_running_loop().create_task(stranger())
    assert lock.hold_count == 1
    await lock.release()


async def test_a_child_task_re_enters_its_parents_hold(client):
    lock = client.reentrant_lock("re/6", ttl=10.0)
    async with asyncio.timeout(TIMEOUT):
        async with lock as outer:
            async def child():
                async with lock as inner:
                    return inner.fencing_token, lock.hold_count
            [(token, count)] = await asyncio.gather(child())
            assert (token, count) == (outer.fencing_token, 2)
        assert await client.holder("re/6") is None


async def test_a_child_re_entering_while_the_first_acquire_waits_shares_its_grant(client, connect):
    lock = client.reentrant_lock("re/7", ttl=10.0)
    other = await connect("other")
    async with asyncio.timeout(TIMEOUT):
        blocker = await other.acquire("re/7", ttl=10.0)
        assert lock.hold_count == 0  # this task is a caller now: the child below acts for it
        entered = asyncio.Event()
        leave = asyncio.Event()

        async def child():
            async with lock as inner:
                entered.set()
                await leave.wait()
                return inner.fencing_token

        async def release_when_queued():
            while not (await other.contenders("re/7"))["waiters"]:
                await asyncio.sleep(0.01)
            await other.release(blocker)

        releaser = asyncio.get_running_loop().create_task(release_when_queued())
        task = asyncio.get_running_loop().create_task(child())
        lease = await lock.acquire()  # this task's own acquire: waits behind `blocker` on the server
        await releaser
        await entered.wait()
        assert lock.hold_count == 2
        leave.set()
        assert await task == lease.fencing_token
        await wait_released(lock, 1)
        await lock.release()
        assert await client.holder("re/7") is None


async def wait_released(lock, count):
    for _ in range(1000):
        if lock.hold_count == count:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"hold count stayed at {lock.hold_count}")


async def test_re_entry_into_a_lost_lease_raises(client, connect):
    lock = client.reentrant_lock("re/8", ttl=10.0)
    lease = await lock.acquire()
    lease.lost.set()  # as the renewer does when a renewal is refused
    with pytest.raises(fastlock.LeaseLost):
        await lock.acquire()
    assert lock.hold_count == 1
    await lock.release()


def test_arguments_are_checked():
    assert check_acquire_limit(None) == MAX_ACQUIRE_LIMIT
    assert check_acquire_limit(5) == 5
    for bad in (0, -1, MAX_ACQUIRE_LIMIT + 1):
        with pytest.raises(InvalidArgument):
            check_acquire_limit(bad)
    for bad in (1.0, "2", True):
        with pytest.raises(WrongArgumentType):
            check_acquire_limit(bad)


def test_blocking_client_counts_per_thread(server):
    with SyncClient(server.address) as client:
        lock = client.reentrant_lock("re/sync", ttl=10.0)
        with lock as a:
            with lock as b:
                assert a.fencing_token == b.fencing_token
                assert lock.hold_count == 2
                got: list[object] = []

                def other_thread():
                    try:
                        client.reentrant_lock("re/sync", ttl=10.0, wait=0.2).acquire()
                    except LockNotAcquired as exc:
                        got.append(exc)

                t = threading.Thread(target=other_thread)
                t.start()
                t.join(TIMEOUT)
                assert len(got) == 1 and not isinstance(got[0], AlreadyHeld)
        assert lock.hold_count == 0
        assert client.holder("re/sync") is None
        limited = client.reentrant_lock("re/sync", ttl=10.0, acquire_limit=1)
        with limited:
            with pytest.raises(AcquireLimitReached):
                limited.acquire()


# -- property test: sequences of acquires and releases by a few tasks against a model --------

#: (caller index, "acquire" | "release")
STEPS = st.lists(st.tuples(st.integers(0, 2), st.sampled_from(["acquire", "release"])), min_size=1, max_size=25)


class Model:
    """The reference: one holder and its count, or none; another caller waits (here: is refused
    with wait=0, the test's stand-in for waiting); a re-entry at the limit is refused."""

    def __init__(self, limit: int):
        self.limit = limit
        self.holder: int | None = None
        self.count = 0

    def acquire(self, who: int) -> str:
        if self.holder is None:
            self.holder, self.count = who, 1
            return "granted"
        if self.holder != who:
            return "not_acquired"
        if self.count >= self.limit:
            return "limit"
        self.count += 1
        return "reentered"

    def release(self, who: int) -> str:
        if self.holder != who:
            return "not_held"
        self.count -= 1
        if self.count == 0:
            self.holder = None
            return "released"
        return "counted"


@pytest.mark.one_loop
def test_property_reentrant_against_the_model(server):
    @settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(steps=STEPS, limit=st.integers(1, 4))
    def check(steps, limit):
        asyncio.run(_run_steps(server.address, steps, limit))

    check()


_EXAMPLES = itertools.count()


async def _run_steps(address, steps, limit):
    async with await fastlock.connect(address) as client:
        name = f"re/prop/{next(_EXAMPLES)}"  # each example on a name of its own
        model = Model(limit)
        callers = [_Caller(client, name, limit) for _ in range(3)]
        tokens: set[int] = set()
        last_token = 0
        try:
            for who, op in steps:
                expected = model.acquire(who) if op == "acquire" else model.release(who)
                got, token = await callers[who].do(op)
                assert got == expected, (steps, who, op)
                if got == "granted":
                    assert token > last_token  # a new hold: a new, higher fencing token
                    last_token = token
                    tokens = {token}
                elif got == "reentered":
                    assert token in tokens  # the same token
                holder = await client.holder(name)
                assert (holder is None) == (model.holder is None)
                count, _ = await callers[who].do("count")
                assert count == (model.count if model.holder == who else 0)
        finally:
            for c in callers:
                await c.stop()


class _Caller:
    """A task of its own (its own caller identity) running one operation at a time."""

    def __init__(self, client, name, limit):
        self.inbox: asyncio.Queue = asyncio.Queue()
        self.lock = client.reentrant_lock(name, ttl=10.0, wait=0, acquire_limit=limit)
        self.task = asyncio.get_running_loop().create_task(self._serve())

    async def _serve(self):
        fastlock.client.new_caller()
        while True:
            op, reply = await self.inbox.get()
            if op is None:
                return
            try:
                if op == "count":
                    reply.set_result((self.lock.hold_count, 0))
                elif op == "acquire":
                    before = self.lock.hold_count
                    lease = await self.lock.acquire()
                    reply.set_result(("granted" if before == 0 else "reentered", lease.fencing_token))
                else:
                    before = self.lock.hold_count
                    await self.lock.release()
                    reply.set_result(("released" if before == 1 else "counted", 0))
            except AcquireLimitReached:
                reply.set_result(("limit", 0))
            except LockNotHeld:
                reply.set_result(("not_held", 0))
            except LockNotAcquired:
                reply.set_result(("not_acquired", 0))

    async def do(self, op):
        reply = asyncio.get_running_loop().create_future()
        await self.inbox.put((op, reply))
        async with asyncio.timeout(TIMEOUT):
            return await reply

    async def stop(self):
        await self.inbox.put((None, None))
        await self.task
