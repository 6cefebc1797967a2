"""The caller's identity follows structured concurrency (issue 26): a task created in
the context of a task that holds a lock - by ``asyncio.wait_for`` (a new task on Python
3.10/3.11), ``gather``, ``TaskGroup``, ``create_task`` - acts for it: its self-wait gets
``AlreadyHeld`` at once, and its wait counts as its holding ancestor's in the server's
deadlock detection.  Unrelated tasks, and siblings, sharing a client queue as usual."""

from __future__ import annotations

import asyncio
import sys

import pytest
from conftest import wait_until

import fastlock
from fastlock import AlreadyHeld
from fastlock.client.acquire import Caller, actor_id, acts_for, current_caller
from fastlock.errors import DeadlockDetected

TIMEOUT = 10.0


async def test_wait_for_gather_task_group_and_create_task_self_waits_get_already_held(server):
    async with await fastlock.connect(server.address) as client:
        async with client.lock("sc/1", ttl=30.0) as lease:
            with pytest.raises(AlreadyHeld) as err:
                await asyncio.wait_for(client.acquire("sc/1", ttl=5.0, wait=None), TIMEOUT)
            assert err.value.token == lease.fencing_token
            results = await asyncio.wait_for(
                asyncio.gather(client.acquire("sc/1", ttl=5.0, wait=None), return_exceptions=True), TIMEOUT)
            assert [type(r) for r in results] == [AlreadyHeld]
            if sys.version_info >= (3, 11):
                with pytest.raises(Exception) as group:  # an ExceptionGroup
                    async with asyncio.timeout(TIMEOUT):
                        async with asyncio.TaskGroup() as tg:
                            tg.create_task(client.acquire("sc/1", ttl=5.0, wait=None))
                assert [type(e) for e in group.value.exceptions] == [AlreadyHeld]

            async def grandchild():  # two generations down: still the holder's
                return await asyncio.create_task(client.acquire("sc/1", ttl=5.0, wait=None))

            with pytest.raises(AlreadyHeld):
                await asyncio.wait_for(asyncio.create_task(grandchild()), TIMEOUT)
            # the lease is untouched: still held, by the same token
            assert (await client.holder("sc/1"))["token"] == lease.fencing_token


async def test_unrelated_tasks_and_siblings_still_queue(server):
    async with await fastlock.connect(server.address) as client:
        first_held = asyncio.Event()
        release = asyncio.Event()

        async def first():
            async with client.lock("sc/q", ttl=30.0) as lease:
                first_held.set()
                await release.wait()
                return lease.fencing_token

        async def second():
            await first_held.wait()
            async with client.lock("sc/q", ttl=30.0, wait=TIMEOUT) as lease:
                return lease.fencing_token

        async def unblock():  # the second sibling is queued as a waiter, then the first lets go
            await wait_until(lambda: _has_waiter(client, "sc/q"), TIMEOUT, "the sibling queued")
            release.set()

        # siblings under gather: neither acts for the other
        tokens = await asyncio.wait_for(asyncio.gather(first(), second(), unblock()), TIMEOUT)
        assert tokens[1] > tokens[0]
        # a task created before its creator held anything is unrelated to that holding
        first_held.clear(), release.clear()
        other = asyncio.create_task(second())
        held = await client.acquire("sc/q", ttl=30.0)
        first_held.set()
        await wait_until(lambda: _has_waiter(client, "sc/q"), TIMEOUT, "the earlier task queued")
        await client.release(held)
        assert await asyncio.wait_for(other, TIMEOUT) > held.fencing_token


async def _has_waiter(client, name):
    return (await client.lock_info(name)).waiters != []


async def test_new_caller_makes_a_child_queue_as_an_unrelated_task(server):
    async with await fastlock.connect(server.address) as client:
        held = await client.acquire("sc/n", ttl=30.0)

        async def worker():
            fastlock.client.new_caller()
            return await client.acquire("sc/n", ttl=30.0, wait=TIMEOUT)

        task = asyncio.create_task(worker())
        await wait_until(lambda: _has_waiter(client, "sc/n"), TIMEOUT, "the worker queued")
        await client.release(held)
        lease = await asyncio.wait_for(task, TIMEOUT)
        assert lease.fencing_token > held.fencing_token


@pytest.mark.skipif(sys.version_info < (3, 11), reason="asyncio.TaskGroup")
async def test_a_deadlock_through_a_parent_and_its_child_tasks_is_broken(server_factory):
    # client a: a parent holds x and awaits children, one of which waits for y; client b
    # holds y and waits for x.  The child's wait is its parent's: the server sees the cycle.
    srv = server_factory("dl-children", args=["--deadlock-timeout", "0.5"])
    a = await fastlock.connect(srv.address, client_name="parent")
    b = await fastlock.connect(srv.address, client_name="other")
    try:
        y = await b.acquire("y", ttl=30.0)
        outcome: list[BaseException] = []
        failed = asyncio.Event()

        async def child():
            try:
                return await a.acquire("y", ttl=30.0, wait=None)
            except DeadlockDetected as exc:
                outcome.append(exc)
                failed.set()
                raise

        async def parent():
            x = await a.acquire("x", ttl=30.0)
            try:
                async with asyncio.TaskGroup() as tg:
                    tg.create_task(asyncio.sleep(0))  # an unrelated sibling, done at once
                    tg.create_task(child())
            finally:
                await a.release(x)

        async def other():
            try:
                return await b.acquire("x", ttl=30.0, wait=None)
            except DeadlockDetected as exc:
                outcome.append(exc)
                failed.set()
                await b.release(y)  # the victim gives up y: the child is granted it
                raise

        parent_task = asyncio.create_task(parent())
        await wait_until(lambda: _has_waiter(a, "y"), TIMEOUT, "the child waits for y")
        other_task = asyncio.create_task(other())
        await wait_until(lambda: _has_waiter(a, "x"), TIMEOUT, "b waits for x")
        await asyncio.wait_for(failed.wait(), 0.5 + 1.0)  # within --deadlock-timeout + 1 s
        assert len(outcome) == 1 and "deadlock detected" in str(outcome[0])
        for task in (parent_task, other_task):
            task.cancel()
        await asyncio.gather(parent_task, other_task, return_exceptions=True)
    finally:
        await a.close()
        await b.close()


async def test_the_caller_tree():
    me = current_caller()
    assert type(me) is Caller and current_caller() is me and me.parent is None

    async def child():
        return current_caller(), actor_id()

    node, actor = await asyncio.create_task(child())
    assert node is not me and node.parent is me and acts_for(node, me) and not acts_for(me, node)
    assert actor == node.actor  # the parent holds nothing: the child is its own party
    me.held = {id(None): 1}  # as if it held a lease through the client ``None``
    try:
        node2, actor2 = await asyncio.create_task(child())
        assert actor2 == me.actor  # a holding parent's child waits for it
    finally:
        me.held = None
    # an ended ancestor is skipped: the chain stays as deep as the live nesting
    async def grandchild_of_ended():
        return await asyncio.create_task(child())

    inner = await asyncio.create_task(grandchild_of_ended())
    assert inner[0].parent is me
