"""Multi-locks across shards: wound-wait reservations on each shard (fastlock.server.woundwait)
and ``lock_across`` in the client (fastlock.client.across).

Three lone ``fastlock serve`` processes are the shards; a router sends names ``a/...``,
``b/...`` and ``c/...`` to the first, second and third shard of the global order.  The
rule's cases are driven with raw msgpack peers (:class:`test_limits.Raw`) that choose their
own age stamps; the client's behaviour with real clients.
"""

from __future__ import annotations

import asyncio
import functools
import os
import random
import threading
import time
from contextlib import asynccontextmanager, contextmanager

import msgpack
import pytest
from test_limits import Raw, error_of

import fastlock
from fastlock import protocol as P
from fastlock._testbase import HistoryChecker
from fastlock._testbase.proxy import TcpProxy
from fastlock.auth import generate
from fastlock.client.across import acquire_across, lock_across, lock_across_sync, release_across, shard_key
from fastlock.errors import (
    Cancelled,
    InvalidArgument,
    LeaseLost,
    LimitExceeded,
    LockNotAcquired,
    PermissionDenied,
    Wounded,
    WrongArgumentType,
)
from fastlock.protocol.ops import MAX_STAMP_AGE_MS, OP_COMMIT_RESERVATION, OP_RESERVE, PUSH_WOUNDED
from fastlock.sync import SyncClient

TTL_MS = 60_000


def now_ms() -> int:
    return int(time.time() * 1000)


class PrefixRouter:
    """``a/...``, ``b/...``, ``c/...``: the first, second and third shard in the global order."""

    def __init__(self, clients):
        self.clients = sorted(clients, key=shard_key)

    def client_for(self, name: str):
        return self.clients["abc".index(name[0])]


@pytest.fixture
def shards(server_factory):
    """Three lone servers, in the global order of shards (a client's addresses, sorted as text)."""
    servers = [server_factory(f"shard{i}", fsync="never") for i in range(3)]
    return sorted(servers, key=lambda s: str(("127.0.0.1", s.port)))


@asynccontextmanager
async def routed(servers, name: str = "across"):
    clients = [await fastlock.connect(s.address, client_name=f"{name}-{i}") for i, s in enumerate(servers)]
    try:
        router = PrefixRouter(clients)
        yield router
    finally:
        for c in clients:
            await c.close()


def reserve(peer: Raw, names, stamp: int, multi_id: bytes, *, wait_ms: int = 0, ttl_ms: int = TTL_MS,
            owner: bytes | None = None) -> int:
    """Send a RESERVE; returns its request id."""
    return peer.send(OP_RESERVE, list(names), owner or os.urandom(16), ttl_ms, wait_ms, None, stamp, multi_id)


def reply_to(peer: Raw, rid: int, pushes: list | None = None):
    """The reply to request ``rid`` (pushes met on the way kept in ``pushes``)."""
    while True:
        msg = peer.recv()
        assert msg is not None, "connection closed"
        if msg[0] == rid:
            return msg
        if msg[0] == 0 and pushes is not None:
            pushes.append(msg)


def replies(peer: Raw, *rids: int) -> dict:
    """The replies to the requests ``rids``, in whatever order they come."""
    got: dict = {}
    while len(got) < len(rids):
        msg = peer.recv()
        assert msg is not None, "connection closed"
        if msg[0] in rids:
            got[msg[0]] = msg
    return got


def read_before(peer: Raw) -> None:
    """Wait until the server has read every request ``peer`` sent so far (a PING's reply comes
    after them on its connection), so that another peer's question sees their effect.  Only
    after requests that wait (their replies come later)."""
    reply = peer.call(P.OP_PING)
    assert reply is not None and reply[1] == 0, reply


def contenders(peer: Raw, name: str) -> dict:
    reply = peer.call(P.OP_CONTENDERS, name)
    assert reply[1] == 0, reply
    return reply[2]


def holder_token(peer: Raw, name: str) -> int | None:
    reply = peer.call(P.OP_HOLDER, name)
    assert reply[1] == 0, reply
    return None if reply[2] is None else reply[2]["token"]


def status(peer: Raw) -> dict:
    return peer.call(P.OP_STATUS)[2]


@contextmanager
def peers(address: str, count: int):
    made = [Raw(address, name=f"peer-{i}") for i in range(count)]
    try:
        yield made
    finally:
        for p in made:
            p.close()


# -- the rule on one shard ---------------------------------------------------------------------


def test_an_older_reservation_wounds_a_younger_holder_which_is_told_and_cannot_commit(server):
    with peers(server.address, 3) as (young, old, look):
        stamp = now_ms()
        reply = reply_to(young, reserve(young, ["a/1", "a/2"], stamp, b"young"))
        assert reply[1] == 0, reply
        young_tokens = reply[2][0]
        reply = reply_to(old, reserve(old, ["a/2", "a/3"], stamp - 10_000, b"old", wait_ms=30_000))
        assert reply[1] == 0, reply  # granted at once: the younger's parts were taken
        assert reply[2][0][0] > young_tokens[1]
        push = young.recv()
        assert push == [0, PUSH_WOUNDED, [b"young", stamp, stamp - 10_000]]
        assert holder_token(look, "a/1") is None  # every part of the wounded one went, not only a/2
        assert error_of(young.call(OP_COMMIT_RESERVATION, b"young"))[0] == Wounded.code
        assert old.call(OP_COMMIT_RESERVATION, b"old")[1] == 0


def test_a_held_uncommitted_part_goes_with_its_connection_a_committed_one_stays(server):
    """A reservation is committed only on its own connection: once that connection closes its
    held uncommitted part can never become a lease anyone uses, so the server takes it away at
    once (a REVOKE) and the plain acquire queued behind it is granted - not after the part's
    TTL (60 s).  A committed part is an ordinary lease and stays."""
    with peers(server.address, 2) as (waiter, look):
        gone = Raw(server.address, name="gone")
        reply = reply_to(gone, reserve(gone, ["a/1", "a/2"], now_ms(), b"gone"))
        assert reply[1] == 0, reply
        kept = Raw(server.address, name="kept")
        kept_reply = reply_to(kept, reserve(kept, ["a/3"], now_ms(), b"kept"))
        assert kept_reply[1] == 0 and kept.call(OP_COMMIT_RESERVATION, b"kept")[1] == 0
        rid = waiter.send(P.OP_ACQUIRE, "a/1", os.urandom(16), TTL_MS, 30_000, 0, None)
        gone.close()
        kept.close()
        granted = reply_to(waiter, rid)
        assert granted[1] == 0 and granted[2][0] > reply[2][0][0]
        assert holder_token(look, "a/2") is None
        assert holder_token(look, "a/3") == kept_reply[2][0][0]


def test_a_committed_part_an_older_holder_and_a_plain_lease_are_waited_on(server):
    with peers(server.address, 4) as (first, second, third, look):
        stamp = now_ms()
        owner = os.urandom(16)
        reply = reply_to(first, reserve(first, ["a/1"], stamp, b"m1", owner=owner))
        assert reply[1] == 0
        token = reply[2][0][0]
        assert first.call(OP_COMMIT_RESERVATION, b"m1")[1] == 0
        # committed: an older reservation waits for it (no wound)
        second_owner = os.urandom(16)
        rid = reserve(second, ["a/1"], stamp - 20_000, b"m2", wait_ms=30_000, owner=second_owner)
        read_before(second)
        assert len(contenders(look, "a/1")["waiters"]) == 1
        assert holder_token(look, "a/1") == token
        assert first.call(P.OP_RELEASE, "a/1", token, owner)[1] == 0
        reply = reply_to(second, rid)
        assert reply[1] == 0
        second_token = reply[2][0][0]
        # an older holder (uncommitted): a younger one waits for it
        rid = reserve(third, ["a/1"], stamp, b"m3", wait_ms=30_000)
        read_before(third)
        assert len(contenders(look, "a/1")["waiters"]) == 1
        assert error_of(third.call(OP_COMMIT_RESERVATION, b"m3"))[0] == InvalidArgument.code  # not granted yet
        assert second.call(OP_COMMIT_RESERVATION, b"m2")[1] == 0
        # a plain lease: waited on by the oldest
        plain_owner = os.urandom(16)
        assert look.call(P.OP_ACQUIRE, "a/9", plain_owner, TTL_MS, 0, 0, None)[1] == 0
        rid9 = reserve(first, ["a/9"], stamp - 30_000, b"m4", wait_ms=30_000)
        read_before(first)
        assert len(contenders(look, "a/9")["waiters"]) == 1
        plain = holder_token(look, "a/9")
        assert look.call(P.OP_RELEASE, "a/9", plain, plain_owner)[1] == 0
        assert reply_to(first, rid9)[1] == 0
        # the committed older part released: the younger waiter gets it
        assert second.call(P.OP_RELEASE, "a/1", second_token, second_owner)[1] == 0
        reply = reply_to(third, rid)
        assert reply[1] == 0 and reply[2][0][0] > second_token


def test_an_older_arrival_wounds_a_younger_waiting_ahead_of_it(server):
    """A younger reservation waiting in the queue of a name the older one needs is withdrawn
    (answered Wounded, told by a push): the older one never waits behind a younger one."""
    with peers(server.address, 3) as (young, old, look):
        plain_owner = os.urandom(16)
        assert look.call(P.OP_ACQUIRE, "a/1", plain_owner, TTL_MS, 0, 0, None)[1] == 0
        stamp = now_ms()
        rid_young = reserve(young, ["a/1", "a/2"], stamp, b"young", wait_ms=30_000)
        read_before(young)
        assert len(contenders(look, "a/1")["waiters"]) == 1
        rid_old = reserve(old, ["a/1"], stamp - 5_000, b"old", wait_ms=30_000)
        pushes: list = []
        reply = reply_to(young, rid_young, pushes)
        assert reply[1] == Wounded.code, reply
        if not pushes:
            pushes.append(young.recv())
        assert pushes[0][1] == PUSH_WOUNDED
        waiters = contenders(look, "a/1")["waiters"]
        assert len(waiters) == 1  # the older one alone
        token = holder_token(look, "a/1")
        assert look.call(P.OP_RELEASE, "a/1", token, plain_owner)[1] == 0
        assert reply_to(old, rid_old)[1] == 0


def test_a_younger_newcomer_waits_before_the_queue_behind_an_older_waiter_and_can_cancel(server):
    with peers(server.address, 4) as (old, young, other, look):
        plain_owner = os.urandom(16)
        assert look.call(P.OP_ACQUIRE, "a/1", plain_owner, TTL_MS, 0, 0, None)[1] == 0
        stamp = now_ms()
        old_owner = os.urandom(16)
        rid_old = reserve(old, ["a/1", "a/2"], stamp - 5_000, b"old", wait_ms=30_000, owner=old_owner)
        read_before(old)
        assert len(contenders(look, "a/2")["waiters"]) == 1
        # a/2 is free, yet the younger one is not granted it while the older one waits on it
        young_owner = os.urandom(16)
        rid_young = reserve(young, ["a/2"], stamp, b"young", wait_ms=30_000, owner=young_owner)
        assert young.call(P.OP_PING)[1] == 0
        assert holder_token(look, "a/2") is None
        assert len(contenders(look, "a/2")["waiters"]) == 1  # parked: not in the queue
        # one that waits there too can withdraw
        other_owner = os.urandom(16)
        rid_other = reserve(other, ["a/2"], stamp + 1, b"other", wait_ms=30_000, owner=other_owner)
        rid_cancel = other.send(P.OP_CANCEL, "a/2", other_owner)
        got = replies(other, rid_other, rid_cancel)
        assert got[rid_cancel][2] == "cancelled" and got[rid_other][1] == Cancelled.code
        # the older one is granted; the younger one then waits in the queue, and gets it after
        token = holder_token(look, "a/1")
        assert look.call(P.OP_RELEASE, "a/1", token, plain_owner)[1] == 0
        old_reply = reply_to(old, rid_old)
        assert old_reply[1] == 0
        assert old.call(OP_COMMIT_RESERVATION, b"old")[1] == 0
        assert len(contenders(look, "a/2")["waiters"]) == 1  # the younger one, in the queue now
        assert old.call(P.OP_RELEASE, "a/2", old_reply[2][0][1], old_owner)[1] == 0
        reply = reply_to(young, rid_young)
        assert reply[1] == 0 and reply[2][0][0] > old_reply[2][0][1]


def test_parked_reservations_enter_the_queue_oldest_first_and_the_younger_is_not_wounded(server):
    """Two reservations parked behind an older waiter: the younger parked first, the older
    (a wounded multi-lock taking its part again with its stamp) after.  When the waiter is
    granted, the older parked one enters the queue first and the younger one stays parked
    behind it: it is granted in its turn, never wounded."""
    with peers(server.address, 4) as (old, middle, young, look):
        plain_owner = os.urandom(16)
        assert look.call(P.OP_ACQUIRE, "a/1", plain_owner, TTL_MS, 0, 0, None)[1] == 0
        stamp = now_ms()
        old_owner, middle_owner = os.urandom(16), os.urandom(16)
        rid_old = reserve(old, ["a/1", "a/2"], stamp - 5_000, b"old", wait_ms=30_000, owner=old_owner)
        read_before(old)
        assert len(contenders(look, "a/2")["waiters"]) == 1
        rid_young = reserve(young, ["a/2"], stamp, b"young", wait_ms=30_000)
        assert young.call(P.OP_PING)[1] == 0
        rid_middle = reserve(middle, ["a/2"], stamp - 2_000, b"middle", wait_ms=30_000, owner=middle_owner)
        assert middle.call(P.OP_PING)[1] == 0
        assert len(contenders(look, "a/2")["waiters"]) == 1  # both parked, the oldest waits alone
        token = holder_token(look, "a/1")
        assert look.call(P.OP_RELEASE, "a/1", token, plain_owner)[1] == 0
        old_reply = reply_to(old, rid_old)
        assert old_reply[1] == 0
        assert old.call(OP_COMMIT_RESERVATION, b"old")[1] == 0
        assert old.call(P.OP_RELEASE, "a/2", old_reply[2][0][1], old_owner)[1] == 0
        middle_reply = reply_to(middle, rid_middle)
        assert middle_reply[1] == 0, middle_reply
        assert middle.call(OP_COMMIT_RESERVATION, b"middle")[1] == 0
        assert middle.call(P.OP_RELEASE, "a/2", middle_reply[2][0][0], middle_owner)[1] == 0
        pushes: list = []
        young_reply = reply_to(young, rid_young, pushes)
        assert young_reply[1] == 0, young_reply  # granted, not Wounded
        assert young_reply[2][0][0] > middle_reply[2][0][0]
        assert not [p for p in pushes if p[1] == PUSH_WOUNDED]


def send_together(peer: Raw, *requests: tuple) -> list[int]:
    """Send ``requests`` (``(op, *args)`` each) in one write, so that the server reads them in
    one batch; their request ids."""
    rids = list(range(peer.next_id, peer.next_id + len(requests)))
    peer.next_id += len(requests)
    peer.sock.sendall(b"".join(msgpack.packb([rid, *req], use_bin_type=True) for rid, req in zip(rids, requests)))
    return rids


def test_a_parked_reservation_enters_the_queue_when_its_older_waiter_is_granted_in_a_busy_batch(server):
    """The older waiter a reservation is parked behind is granted (a release hands it the name)
    and, in the same batch, before the grant is delivered, another RESERVE on that name finds
    it no longer waiting: the parked one must still be woken and enter the queue.  (It was
    left parked - holding up, across shards, every multi-lock waiting on its other parts -
    until its wait ran out.)"""
    with peers(server.address, 4) as (old, middle, young, look):
        h_owner, v_owner, old_owner = os.urandom(16), os.urandom(16), os.urandom(16)
        assert look.call(P.OP_ACQUIRE, "a/1", h_owner, TTL_MS, 0, 0, None)[1] == 0
        assert look.call(P.OP_ACQUIRE, "a/2", v_owner, TTL_MS, 0, 0, None)[1] == 0
        stamp = now_ms()
        rid_old = reserve(old, ["a/1"], stamp - 5_000, b"old", wait_ms=30_000, owner=old_owner)
        reserve(middle, ["a/2"], stamp - 4_000, b"middle", wait_ms=30_000)
        assert old.call(P.OP_PING)[1] == 0 and middle.call(P.OP_PING)[1] == 0  # both queued
        rid_young = reserve(young, ["a/1"], stamp, b"young", wait_ms=30_000)
        assert young.call(P.OP_PING)[1] == 0
        assert len(contenders(look, "a/1")["waiters"]) == 1  # the young one is parked behind the old one
        assert len(contenders(look, "a/2")["waiters"]) == 1
        # one batch: a/1 goes to the old reservation; a RESERVE of a/1 and a/2 then finds the old one no
        # longer waiting on a/1, and is itself parked behind the middle one on a/2
        token = holder_token(look, "a/1")
        rid_release, _rid_other = send_together(
            look, (P.OP_RELEASE, "a/1", token, h_owner),
            (OP_RESERVE, ["a/1", "a/2"], os.urandom(16), TTL_MS, 30_000, None, stamp - 1_000, b"other"))
        assert reply_to(look, rid_release)[1] == 0
        old_reply = reply_to(old, rid_old)
        assert old_reply[1] == 0, old_reply
        # nothing older waits on a/1 now: the young one waits in its queue, behind the old one's lease
        deadline = time.monotonic() + 5.0
        while len(contenders(look, "a/1")["waiters"]) != 1:
            assert time.monotonic() < deadline, "the parked reservation never entered the queue"
            time.sleep(0.01)
        assert old.call(OP_COMMIT_RESERVATION, b"old")[1] == 0
        assert old.call(P.OP_RELEASE, "a/1", old_reply[2][0][0], old_owner)[1] == 0
        young_reply = reply_to(young, rid_young)
        assert young_reply[1] == 0 and young_reply[2][0][0] > old_reply[2][0][0], young_reply


def test_a_parked_reservations_grant_counts_its_time_parked_in_the_wait_it_reports(server):
    """A reservation parked behind an older waiter reports, with its grant, the time from its
    RESERVE's arrival (parked, then queued), from which the client dates its leases' expiry
    and the time its part waited in the shard."""
    with peers(server.address, 3) as (old, young, look):
        plain_owner, old_owner = os.urandom(16), os.urandom(16)
        assert look.call(P.OP_ACQUIRE, "a/1", plain_owner, TTL_MS, 0, 0, None)[1] == 0
        stamp = now_ms()
        rid_old = reserve(old, ["a/1", "a/2"], stamp - 5_000, b"old", wait_ms=30_000, owner=old_owner)
        read_before(old)
        assert len(contenders(look, "a/2")["waiters"]) == 1
        sent = time.monotonic()
        rid_young = reserve(young, ["a/2"], stamp, b"young", wait_ms=30_000)
        assert young.call(P.OP_PING)[1] == 0
        assert len(contenders(look, "a/2")["waiters"]) == 1  # parked: the older one waits alone
        time.sleep(0.3)  # the time it stays parked, which its grant must report
        assert look.call(P.OP_RELEASE, "a/1", holder_token(look, "a/1"), plain_owner)[1] == 0
        old_reply = reply_to(old, rid_old)
        assert old_reply[1] == 0
        assert old.call(OP_COMMIT_RESERVATION, b"old")[1] == 0
        assert old.call(P.OP_RELEASE, "a/2", old_reply[2][0][1], old_owner)[1] == 0
        young_reply = reply_to(young, rid_young)
        elapsed_ms = (time.monotonic() - sent) * 1000
        assert young_reply[1] == 0, young_reply
        waited_ms = young_reply[2][2]
        assert 300 <= waited_ms <= elapsed_ms + 1, (waited_ms, elapsed_ms)  # + 1: the server counts whole ms


def test_stamps_and_arguments_out_of_bounds_are_refused_and_change_nothing(server):
    with peers(server.address, 2) as (peer, look):
        now = now_ms()
        good = (["a/1"], os.urandom(16), TTL_MS, 0, None, now, b"m")
        bad = [
            ((["a/1"], os.urandom(16), TTL_MS, 0, None, now - MAX_STAMP_AGE_MS - 5_000, b"m"), InvalidArgument),
            ((["a/1"], os.urandom(16), TTL_MS, 0, None, now + 60_000, b"m"), InvalidArgument),
            ((["a/1"], os.urandom(16), TTL_MS, 0, None, True, b"m"), WrongArgumentType),
            ((["a/1"], os.urandom(16), TTL_MS, 0, None, 1.5, b"m"), WrongArgumentType),
            ((["a/1"], os.urandom(16), TTL_MS, 0, None, now, b""), InvalidArgument),
            ((["a/1"], os.urandom(16), TTL_MS, 0, None, now, b"x" * 33), InvalidArgument),
            ((["a/1"], os.urandom(16), TTL_MS, 0, None, now, "m"), WrongArgumentType),
            ((["a/1", "a/1"], os.urandom(16), TTL_MS, 0, None, now, b"m"), InvalidArgument),
            (([], os.urandom(16), TTL_MS, 0, None, now, b"m"), InvalidArgument),
            (("a/1", os.urandom(16), TTL_MS, 0, None, now, b"m"), WrongArgumentType),
            (([7], os.urandom(16), TTL_MS, 0, None, now, b"m"), WrongArgumentType),
            ((["a/1"], os.urandom(16), 0, 0, None, now, b"m"), InvalidArgument),
        ]
        before = status(peer)
        for args, exc in bad:
            code, message = error_of(peer.call(OP_RESERVE, *args))
            assert code == exc.code, (args, message)
        for args in ((b"",), ("m",), (None,), (b"nobody",)):
            assert error_of(peer.call(OP_COMMIT_RESERVATION, *args))[1]
        after = status(peer)
        assert (after["locks_held"], after["waiters"]) == (before["locks_held"], before["waiters"]) == (0, 0)
        assert peer.call(OP_RESERVE, *good)[1] == 0  # the connection still serves
        assert error_of(peer.call(OP_RESERVE, *good))[0] == InvalidArgument.code  # one reservation per id


def test_reservations_need_acquire_on_every_name_and_count_against_the_quotas(server_factory, tmp_path):
    paths = generate(tmp_path / "creds", clients=[("billing", "billing/")], replicas=[], admins=["admin"])
    srv = server_factory("acl", fsync="never",
                         args=["--credentials", str(tmp_path / "creds" / "credentials.toml"),
                               "--max-leases-per-principal", "3"])
    token = open(paths["billing"]).read().strip()
    with Raw(srv.address, credential=token) as peer:
        now = now_ms()
        code, _ = error_of(peer.call(OP_RESERVE, ["billing/1", "orders/1"], os.urandom(16), TTL_MS, 0, None, now,
                                     b"m1"))
        assert code == PermissionDenied.code
        code, message = error_of(peer.call(OP_RESERVE, [f"billing/{i}" for i in range(4)], os.urandom(16), TTL_MS,
                                           0, None, now, b"m2"))
        assert code == LimitExceeded.code and "--max-leases-per-principal" in message
        assert status(peer)["locks_held"] == 0
        assert peer.call(OP_RESERVE, ["billing/1", "billing/2", "billing/3"], os.urandom(16), TTL_MS, 0, None, now,
                         b"m3")[1] == 0
        code, message = error_of(peer.call(OP_RESERVE, ["billing/4"], os.urandom(16), TTL_MS, 0, None, now, b"m4"))
        assert code == LimitExceeded.code


# -- the client ----------------------------------------------------------------------------------


async def test_lock_across_holds_every_name_on_its_shard_and_releases_all(shards, loop_errors):
    async with routed(shards) as router:
        multi = await acquire_across(router, ["c/1", "a/2", "b/1", "a/1"], ttl=10)
        assert multi.names == ("a/1", "a/2", "b/1", "c/1") and multi.attempts == 1
        for name, token in multi.fencing_tokens.items():
            holder = await router.client_for(name).holder(name)
            assert holder is not None and holder["token"] == token
        await release_across(multi)
        for name in multi.names:
            assert await router.client_for(name).holder(name) is None
        async with lock_across(router, ["a/1", "c/1"], ttl=10) as held:
            assert set(held.fencing_tokens) == {"a/1", "c/1"}
            assert not held.lost.is_set()
        assert await router.client_for("a/1").holder("a/1") is None


@pytest.mark.parametrize("in_order", [True, False], ids=["in-order", "all-at-once"])
async def test_a_wound_takes_the_part_again_and_the_retry_keeps_its_stamp(shards, loop_errors, in_order):
    """The younger multi-lock holds a/1 and waits for b/1 (held plainly); an older
    reservation takes a/1: the younger is told and waits again for a/1 behind the older one
    (all at once: that part alone, its wait for b/1 kept; in the global order: it lets go of
    everything and waits at the first shard only, holding nothing) and ends up with both names."""
    async with routed(shards, "young") as router:
        plain = await router.client_for("b/1").acquire("b/1", ttl=30)
        young = asyncio.ensure_future(acquire_across(router, ["a/1", "b/1"], ttl=10, wait=30, in_order=in_order))
        with Raw(shards[1].address) as look_b, Raw(shards[0].address) as old:
            await wait_for(lambda: len(contenders(look_b, "b/1")["waiters"]) == 1, "the younger waits for b/1")
            first_wait = contenders(look_b, "b/1")["waiters"][0]
            cancels_b = status(look_b)["cancels"]
            assert holder_token(old, "a/1") is not None  # its part on the first shard
            old_owner = os.urandom(16)
            rid = reserve(old, ["a/1"], now_ms() - 10_000, b"older", wait_ms=30_000, owner=old_owner)
            reply = reply_to(old, rid)
            assert reply[1] == 0
            await wait_for(lambda: len(contenders(old, "a/1")["waiters"]) == 1, "the retry waits for a/1")
            assert not young.done()
            if in_order:
                assert not contenders(look_b, "b/1")["waiters"]
            else:
                assert contenders(look_b, "b/1")["waiters"] == [first_wait]  # the same wait, kept:
                assert status(look_b)["cancels"] == cancels_b  # never withdrawn
            # nothing of the wounded attempt is held anywhere: a/1 is the older one's, b/1 the plain lease's
            assert holder_token(old, "a/1") == reply[2][0][0]
            assert holder_token(look_b, "b/1") == plain.fencing_token
            assert old.call(OP_COMMIT_RESERVATION, b"older")[1] == 0
            await router.client_for("b/1").release(plain)
            assert old.call(P.OP_RELEASE, "a/1", reply[2][0][0], old_owner)[1] == 0
        multi = await young
        assert multi.attempts >= 2
        assert multi["a/1"].fencing_token > reply[2][0][0]
        await release_across(multi)


async def test_a_part_is_reserved_again_alone_after_a_wound_and_after_its_shard_restarts(shards, loop_errors):
    """The younger multi-lock holds a/1 and waits for b/1 (held plainly).  Its shard a
    restarts (its table of reservations gone; the lease a/1 recovered as a plain one): the
    client counts the lost connection as a wound, lets go of a/1 and reserves it again, so an
    older reservation still takes a/1 while b/1 stays held - no wait nobody can break.  The
    younger's wait on b/1 is kept throughout (only the wounded part is taken again)."""
    async with routed(shards, "young") as router:
        plain = await router.client_for("b/1").acquire("b/1", ttl=30)
        # renewed from the grant: a/1 outlives its TTL (3 s) across the restart unless let go
        young = asyncio.ensure_future(acquire_across(router, ["a/1", "b/1"], ttl=3, wait=60, renew=True))
        with Raw(shards[1].address) as look_b:
            await wait_for(lambda: len(contenders(look_b, "b/1")["waiters"]) == 1, "the younger waits for b/1")
            first_wait = contenders(look_b, "b/1")["waiters"][0]
            cancels_b = status(look_b)["cancels"]
            shards[0].stop()
            shards[0].start()
            with Raw(shards[0].address) as old:
                old_owner = os.urandom(16)
                rid = reserve(old, ["a/1"], now_ms() - 10_000, b"older", wait_ms=30_000, owner=old_owner)
                reply = await asyncio.to_thread(reply_to, old, rid)
                assert reply[1] == 0  # granted while b/1 is still held plainly
                assert contenders(look_b, "b/1")["waiters"] == [first_wait]
                assert status(look_b)["cancels"] == cancels_b  # the wait for b/1 was never withdrawn
                assert not young.done()
                assert old.call(OP_COMMIT_RESERVATION, b"older")[1] == 0
                assert old.call(P.OP_RELEASE, "a/1", reply[2][0][0], old_owner)[1] == 0
        await router.client_for("b/1").release(plain)
        multi = await asyncio.wait_for(young, 30)
        assert multi.attempts >= 2 and multi["a/1"].fencing_token > reply[2][0][0]
        await release_across(multi)


async def test_a_dead_clients_reservation_blocks_only_until_its_ttl(shards, loop_errors):
    """An older reservation whose client died cannot be wounded: it blocks the younger only
    until its TTL (its part goes sooner, with its connection)."""
    dead = Raw(shards[0].address)
    reply = reply_to(dead, reserve(dead, ["a/1"], now_ms() - 30_000, b"dead", ttl_ms=1_500))
    assert reply[1] == 0
    dead_token = reply[2][0][0]
    dead.close()
    async with routed(shards) as router:
        multi = await acquire_across(router, ["a/1", "b/1"], ttl=10, wait=30)
        assert multi["a/1"].fencing_token > dead_token
        await release_across(multi)


async def test_concurrent_overlapping_multi_locks_all_finish_and_never_overlap(shards, loop_errors):
    """A property of the rule: many multi-locks over few names on three shards, each from
    one of two clients per shard: every one finishes (no deadlock), holdings of a name never
    overlap and its tokens rise; wounds happen along the way."""
    names = [f"{shard}/{i}" for shard in "abc" for i in range(3)]
    checker = HistoryChecker()
    attempts: list[int] = []
    holdings = 0
    async with routed(shards, "one") as r1, routed(shards, "two") as r2:
        async def worker(k: int) -> None:
            rng = random.Random(k)
            for _ in range(25):
                chosen = rng.sample(names, rng.randrange(2, 5))
                multi = await acquire_across(r1 if k % 2 else r2, chosen, ttl=10, wait=60)
                nonlocal holdings
                holdings += len(multi)
                now = time.monotonic()
                for lease in multi:
                    checker.held(lease.name, lease.fencing_token, now)
                attempts.append(multi.attempts)
                await asyncio.sleep(0)
                now = time.monotonic()
                for lease in multi:
                    checker.released(lease.name, lease.fencing_token, now)
                await release_across(multi)

        await asyncio.gather(*(worker(k) for k in range(8)))
    assert len(attempts) == 200
    assert checker.check() == holdings
    assert max(attempts) > 1  # the run wounded some


async def test_many_overlapping_multi_locks_never_wait_for_a_parts_ttl(shards, loop_errors):
    """Liveness under contention: 24 tasks over two clients per shard take 1,920 multi-locks of
    2-4 of 15 names on three shards, each released at once.  None waits anywhere near its parts'
    TTL (10 s): a part is never left held - by a client that lost track of it, or by a
    multi-lock stuck behind a reservation nobody wakes - until its TTL ends it.  (Parked
    reservations that were not woken stalled such runs for a whole TTL.)"""
    names = [f"{shard}/{i}" for shard in "abc" for i in range(5)]
    waits: list[float] = []
    async with routed(shards, "one") as r1, routed(shards, "two") as r2:
        async def worker(k: int) -> None:
            rng = random.Random(1000 + k)
            for _ in range(80):
                chosen = rng.sample(names, rng.randrange(2, 5))
                began = time.monotonic()
                multi = await acquire_across(r1 if k % 2 else r2, chosen, ttl=10, wait=60)
                waits.append(time.monotonic() - began)
                await asyncio.sleep(0)
                await release_across(multi)

        await asyncio.gather(*(worker(k) for k in range(24)))
    assert len(waits) == 1920
    slow = sorted(waits)[-3:]
    assert max(waits) < 5.0, f"the slowest multi-locks waited {', '.join(f'{w:.1f}' for w in slow)} s (TTL 10 s)"


async def test_wait_zero_fails_at_once_and_holds_nothing(shards, loop_errors):
    async with routed(shards) as router:
        plain = await router.client_for("b/1").acquire("b/1", ttl=30)
        with pytest.raises(LockNotAcquired):
            await acquire_across(router, ["a/1", "b/1"], ttl=10, wait=0)
        assert await router.client_for("a/1").holder("a/1") is None
        await router.client_for("b/1").release(plain)


async def test_a_shard_down_is_retried_with_pauses_until_the_wait_ends(shards, loop_errors):
    """A shard that refuses connections: each attempt takes and lets go of the live shards'
    parts, so attempts are paced (as a client rides through a failover), not spun."""
    async with routed(shards) as router:
        shards[2].kill()
        before = (await router.client_for("a/1").status())["grants"]
        with pytest.raises(LockNotAcquired, match="attempts"):
            await acquire_across(router, ["a/1", "b/1", "c/1"], ttl=10, wait=3)
        grants = (await router.client_for("a/1").status())["grants"] - before
        assert 1 <= grants <= 30  # 3 s of pauses from 20 ms doubling to 0.5 s: about 10 attempts
        assert await router.client_for("a/1").holder("a/1") is None
        assert await router.client_for("b/1").holder("b/1") is None


class NamedRouter:
    """``a/...``, ``b/...``, ``c/...``: the clients given, in that order (any addresses)."""

    def __init__(self, clients):
        self.clients = clients

    def client_for(self, name: str):
        return self.clients["abc".index(name[0])]


async def test_a_part_granted_as_its_connection_failed_is_let_go_not_left_to_its_ttl(shards, loop_errors):
    """Shard a is reached through a proxy.  The multi-lock's part a/1 waits behind a plain
    lease; the proxy stops forwarding, the plain lease is released, so the server grants the
    part while its reply cannot arrive; then the link is cut.  The client cannot know whether
    it was granted: it withdraws it by owner on its next connection (CANCEL releases a grant)
    before reserving the part again, so the new reservation gets a/1 at once instead of
    queueing behind its own lost grant until that grant's TTL (60 s, longer than the wait)."""
    with TcpProxy(shards[0].address) as proxy, Raw(shards[0].address) as look:
        clients = [await fastlock.connect(proxy.address, client_name="cut-a")]
        clients += [await fastlock.connect(s.address, client_name=f"cut-{i}") for i, s in enumerate(shards[1:])]
        try:
            router = NamedRouter(clients)
            plain_client = await fastlock.connect(shards[0].address, client_name="plain")
            plain = await plain_client.acquire("a/1", ttl=60)
            multi_task = asyncio.ensure_future(acquire_across(router, ["a/1", "b/1"], ttl=60, wait=20))
            await wait_for(lambda: len(contenders(look, "a/1")["waiters"]) == 1, "the part waits for a/1")
            proxy.blackhole()
            await plain_client.release(plain)
            await plain_client.close()
            await wait_for(lambda: holder_token(look, "a/1") not in (None, plain.fencing_token),
                           "the part is granted on the server")
            lost_grant = holder_token(look, "a/1")
            proxy.cut()
            proxy.heal()
            multi = await asyncio.wait_for(multi_task, 30)
            assert multi["a/1"].fencing_token > lost_grant
            assert holder_token(look, "a/1") == multi["a/1"].fencing_token  # the lost grant is gone
            await release_across(multi)
            assert holder_token(look, "a/1") is None
        finally:
            for c in clients:
                await c.close()


async def test_a_release_cancelled_before_its_requests_ran_still_releases_every_part(shards, loop_errors):
    """``release_across`` cancelled at once (its per-shard requests scheduled, none sent yet):
    every release is still sent, so no part is left held until its TTL (60 s)."""
    async with routed(shards) as router:
        multi = await acquire_across(router, ["a/1", "a/2", "b/1", "c/1"], ttl=60)
        task = asyncio.ensure_future(release_across(multi))
        await asyncio.sleep(0)  # it runs up to its first await: the requests are scheduled, not sent
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for name in multi.names:
            owner = router.client_for(name)
            await wait_for_async(functools.partial(owner.holder, name), f"{name} released")


async def test_a_part_released_in_one_write_reports_a_lost_lease_and_releases_the_others(shards, loop_errors):
    """A shard's part of two leases, one of them revoked meanwhile: ``release_across`` releases
    every other lease and raises LeaseLost, marking that lease and the set lost."""
    async with routed(shards) as router:
        multi = await acquire_across(router, ["a/1", "a/2", "b/1"], ttl=60)
        await router.client_for("a/1").revoke("a/1", reason="test")
        with pytest.raises(LeaseLost):
            await release_across(multi)
        assert multi["a/1"].lost.is_set() and multi.lost.is_set()
        assert not multi["a/2"].lost.is_set()
        for name in ("a/1", "a/2", "b/1"):
            assert await router.client_for(name).holder(name) is None


async def wait_for_async(ask, what: str, timeout: float = 10.0) -> None:
    """Until ``await ask()`` is None (a freed name), for at most ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while await ask() is not None:
        assert time.monotonic() < deadline, f"timed out waiting: {what}"
        await asyncio.sleep(0.01)


def test_the_blocking_client_locks_across_shards(shards):
    clients = [SyncClient(s.address, client_name=f"sync-{i}") for i, s in enumerate(shards)]
    try:
        router = PrefixRouter([])
        router.clients = sorted(clients, key=lambda c: shard_key(c.client))
        results = []

        def take() -> None:
            with lock_across_sync(router, ["a/1", "b/1", "c/1"], ttl=10, wait=30) as multi:
                results.append(multi.fencing_tokens)

        threads = [threading.Thread(target=take) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert len(results) == 3
        assert len({tokens["a/1"] for tokens in results}) == 3
        assert clients[0].holder("a/1") is None
    finally:
        for c in clients:
            c.close()


async def wait_for(predicate, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting: {what}"
        await asyncio.sleep(0.01)


def test_a_random_model_run_never_leaves_an_older_reservation_waiting_on_a_younger_holder(server):
    """A model of the rule, driven at random on one shard: four peers reserve 1-3 of four names
    with random stamps, commit, release; after every step every frame is read and the model
    updated (grants, Wounded answers, wound pushes).  Invariant: no reservation still waiting
    has, on one of its names, a holder that is a younger uncommitted reservation.  At the end,
    once everything held is released, every waiting reservation is granted (none is stuck)."""
    rng = random.Random(30)
    names = [f"a/{i}" for i in range(4)]
    base = now_ms()
    used_stamps: set[int] = set()
    with peers(server.address, 5) as all_peers:
        look, workers = all_peers[0], all_peers[1:]
        # per peer: None, or {"rid", "stamp", "names", "owner", "id", "state": waiting|held|committed, "tokens"}
        model: list[dict | None] = [None] * len(workers)
        by_token: dict[tuple[str, int], int] = {}  # (name, token) -> the peer whose reservation holds it
        wounds = grants = 0

        def drain(i: int) -> None:
            nonlocal wounds, grants
            peer = workers[i]
            rid = peer.send(P.OP_PING)
            while True:
                msg = peer.recv()
                assert msg is not None
                if msg[0] == rid:
                    return
                r = model[i]
                if msg[0] == 0:
                    assert msg[1] == PUSH_WOUNDED, msg
                    if r is not None and msg[2][0] == r["id"] and r["state"] != "committed":
                        assert msg[2][2] < r["stamp"]  # wounded by an older one only
                        model[i] = None
                        wounds += 1
                    continue
                if r is not None and msg[0] == r["rid"]:
                    if msg[1] == 0:
                        r["state"], r["tokens"] = "held", msg[2][0]
                        for name, token in zip(r["names"], r["tokens"]):
                            by_token[(name, token)] = i
                        grants += 1
                    else:
                        assert msg[1] == Wounded.code, msg
                        model[i] = None
                        wounds += 1

        def check() -> None:
            for i in range(len(workers)):
                drain(i)
            for i, r in enumerate(model):
                if r is None or r["state"] != "waiting":
                    continue
                for name in r["names"]:
                    holders = contenders(look, name)["holders"]
                    for h in holders:
                        j = by_token.get((name, h["token"]))
                        other = model[j] if j is not None else None
                        if other is None or other["state"] != "held" or j == i:
                            continue
                        assert other["stamp"] < r["stamp"], (
                            f"the reservation of stamp {r['stamp']} waits on {name!r} held by a younger "
                            f"uncommitted one (stamp {other['stamp']})")

        def release(i: int) -> None:
            r = model[i]
            assert r is not None
            for name, token in zip(r["names"], r["tokens"]):
                workers[i].send(P.OP_RELEASE, name, token, r["owner"])
            model[i] = None

        for step in range(120):
            i = rng.randrange(len(workers))
            r = model[i]
            if r is None:
                stamp = base - rng.randrange(0, 20_000)
                while stamp in used_stamps:
                    stamp -= 1
                used_stamps.add(stamp)
                chosen = rng.sample(names, rng.randrange(1, 4))
                owner = os.urandom(16)
                multi_id = f"m{step}".encode()
                rid = reserve(workers[i], chosen, stamp, multi_id, wait_ms=60_000, owner=owner)
                model[i] = {"rid": rid, "stamp": stamp, "names": chosen, "owner": owner, "id": multi_id,
                            "state": "waiting", "tokens": []}
            elif r["state"] == "held" and rng.random() < 0.6:
                reply = workers[i].call(OP_COMMIT_RESERVATION, r["id"])
                if reply[0] == 0:  # a wound push came first: the commit's answer follows
                    model[i] = None
                    wounds += 1
                    reply = workers[i].call(P.OP_PING)
                elif reply[1] == 0:
                    r["state"] = "committed"
                else:
                    assert reply[1] == Wounded.code, reply
                    model[i] = None
            elif r["state"] in ("held", "committed"):
                release(i)
            check()
        # the end: release what is held, until every reservation is granted and released
        for _ in range(200):
            check()
            if all(r is None for r in model):
                break
            for i, r in enumerate(model):
                if r is not None and r["state"] in ("held", "committed"):
                    release(i)
            time.sleep(0.01)
        assert all(r is None for r in model), model
        assert grants > 10 and wounds > 0, (grants, wounds)


def test_reservations_that_waited_before_the_queue_and_ended_leave_the_principals_count(server):
    """More reservations than MAX_RESERVATIONS_PER_PRINCIPAL park behind an older waiter one
    after the other, each ending when its wait runs out: none stays counted, so the principal
    can still reserve."""
    from fastlock.server.woundwait import MAX_RESERVATIONS_PER_PRINCIPAL

    with peers(server.address, 3) as (old, young, look):
        plain_owner = os.urandom(16)
        assert look.call(P.OP_ACQUIRE, "a/1", plain_owner, TTL_MS, 0, 0, None)[1] == 0
        stamp = now_ms()
        rid_old = reserve(old, ["a/1"], stamp - 5_000, b"old", wait_ms=60_000)
        read_before(old)
        assert len(contenders(look, "a/1")["waiters"]) == 1
        for i in range(MAX_RESERVATIONS_PER_PRINCIPAL + 5):
            reply = reply_to(young, reserve(young, ["a/1"], stamp, f"y{i}".encode(), wait_ms=1))
            assert reply[1] == LockNotAcquired.code, reply
        token = holder_token(look, "a/1")
        assert look.call(P.OP_RELEASE, "a/1", token, plain_owner)[1] == 0
        assert reply_to(old, rid_old)[1] == 0
        assert old.call(OP_COMMIT_RESERVATION, b"old")[1] == 0
        assert reply_to(young, reserve(young, ["a/2"], stamp, b"last"))[1] == 0
