"""The asyncio client's compiled request path (fastlock/client/_path.pyx) gives what the
Python definitions give.

- ``acquire_request``: for common and uncommon argument shapes, the checked request the
  Python checks build (:func:`reference_request`, the checks ``Client.acquire`` makes one
  by one), and for bad arguments the same exception class with the same message.
- ``grant_lease``: the ``Lease`` and ``LeaseState`` that their constructors make, every
  slot of the state included; the connector's ``max_epoch`` raised to the token's epoch.
- ``acquire_tail``: ``acquire_call``'s op and trailing arguments.
- ``Client.acquire`` of a name that is no str (hashable or not) raises ``WrongArgumentType``
  whatever the wait, before the self-wait check looks the name up.
- ``Client.acquire`` and ``Client.release`` send by a C call on the connection, unless its
  class overrides ``request``: then through that method.
- ``AttemptBounds``: a due bound whose server stayed silent resets the connection, one
  whose reply came or whose server spoke does not; many bounds share one timer.
"""

from __future__ import annotations

import asyncio
import math
import sys
import threading
import types
from pathlib import Path
from typing import Any

import msgpack
import pytest
from test_owner_keys import keys_of_a_forked_child

from fastlock import protocol as P
from fastlock.client import Client
from fastlock.client._lease_slots import LeaseSlots
from fastlock.client._path import AttemptBounds, acquire_request, acquire_tail, grant_lease
from fastlock.client.acquire import AcquireRequest, Caller, acquire_call, current_caller, duration_ms
from fastlock.client.connection import ClientConnection
from fastlock.client.kinds import kind_args
from fastlock.client.lease import Lease, LeaseState
from fastlock.client.owner_keys import KEYS_PER_DRAW, OWNER_KEY_BYTES
from fastlock.client.preempt import grace_ms
from fastlock.errors import FastlockError, WrongArgumentType
from fastlock.protocol.priority import check_priority
from fastlock.tokens import TOKEN_EPOCH_SHIFT

# benches/ is not installed with the package: import it from the source tree
# (appended, so that ``fastlock`` itself still comes from the installed package)
_ROOT = str(Path(__file__).resolve().parents[1])
if _ROOT not in sys.path:
    sys.path.append(_ROOT)

from benches.null_transport import NullTransport  # noqa: E402


def reference_request(name: Any, ttl: Any, wait: Any, lock_delay: Any, correlation_id: Any, shared: Any,
                      limit: Any, priority: Any, preempt: Any) -> tuple[Any, ...]:
    """The checks of an acquire one by one, as the Python definitions make them (no owner key)."""
    P.check_name(name)
    ttl_ms = P.check_ttl_ms(duration_ms(ttl, "ttl"))
    wait_ms = P.check_wait_ms(-1 if wait is None else duration_ms(wait, "wait", allow_zero=True))
    delay_ms = P.check_lock_delay_ms(0 if lock_delay == 0.0 and type(lock_delay) is float
                                     else duration_ms(lock_delay, "lock_delay", allow_zero=True))
    if correlation_id is not None:
        P.check_optional_str(correlation_id, "correlation_id", P.MAX_CORRELATION_ID_CHARS)
    kind = kind_args(shared, limit)
    if priority:
        check_priority(priority)
    grace = None if preempt is None else grace_ms(preempt)
    return (name, ttl_ms, wait_ms, delay_ms, correlation_id, kind, priority, grace)


DEFAULTS = dict(name="k", ttl=10.0, wait=None, lock_delay=0.0, correlation_id=None, shared=False, limit=0,
                priority=0, preempt=None)

GOOD = [
    {}, dict(ttl=10), dict(ttl=1e-9), dict(ttl=0.001), dict(ttl=0.0015), dict(ttl=3600), dict(ttl=3600.0),
    dict(ttl=0.1 + 0.2), dict(ttl=2.675), dict(wait=0), dict(wait=0.0), dict(wait=-0.0), dict(wait=1e-7),
    dict(wait=5), dict(wait=86400), dict(wait=86400.0), dict(lock_delay=0), dict(lock_delay=-0.0),
    dict(lock_delay=0.5), dict(lock_delay=60), dict(correlation_id="job-7"), dict(shared=True), dict(limit=3),
    dict(priority=5), dict(priority=5, preempt=2.0), dict(name="x" * 512), dict(name="\u00e9t\u00e9"),
    dict(name="\u00e9" * 256), dict(ttl=7, wait=3, lock_delay=1, correlation_id="", shared=False, limit=0),
]

BAD = [
    dict(name=""), dict(name="x" * 513), dict(name=b"x"), dict(name=None), dict(name="a\x00b"),
    dict(name="\u00e9" * 257), dict(name="\ud800"), dict(ttl=0), dict(ttl=0.0), dict(ttl=-1.0),
    dict(ttl=float("nan")), dict(ttl=float("inf")), dict(ttl=True), dict(ttl="1"), dict(ttl=None),
    dict(ttl=3600.001), dict(ttl=10000), dict(ttl=1 << 70), dict(ttl=-(1 << 70)), dict(wait=-0.5),
    dict(wait=86400.001), dict(wait=True), dict(wait="5"), dict(wait=float("nan")), dict(wait=1 << 64),
    dict(lock_delay=61), dict(lock_delay=-1), dict(lock_delay=None), dict(lock_delay=False),
    dict(correlation_id=7), dict(correlation_id="c" * 257), dict(shared=1), dict(shared=True, limit=2),
    dict(limit=-1), dict(limit=1.0), dict(priority=100), dict(priority=True), dict(priority="1"),
    dict(priority=5, preempt=0.0), dict(priority=5, preempt="1"), dict(name="", ttl=0),
    dict(ttl=-1, wait=-1, lock_delay=-1),
]


@pytest.mark.parametrize("given", GOOD)
def test_acquire_request_is_what_the_python_checks_give(given):
    args = {**DEFAULTS, **given}
    request = acquire_request(*args.values())
    assert type(request) is AcquireRequest
    assert type(request.owner) is bytes and len(request.owner) == 16
    mine = (request.name, request.ttl_ms, request.wait_ms, request.lock_delay_ms, request.correlation_id,
            request.kind, request.priority, request.preempt_ms)
    assert mine == reference_request(*args.values())
    assert [type(v) for v in mine] == [type(v) for v in reference_request(*args.values())]


@pytest.mark.parametrize("given", BAD)
def test_acquire_request_refuses_as_the_python_checks_do(given):
    args = {**DEFAULTS, **given}
    with pytest.raises(FastlockError) as python:
        reference_request(*args.values())
    with pytest.raises(FastlockError) as compiled:
        acquire_request(*args.values())
    assert type(compiled.value) is type(python.value)
    assert str(compiled.value) == str(python.value)


def test_owner_keys_differ():
    keys = {acquire_request(*DEFAULTS.values()).owner for _ in range(1000)}
    assert len(keys) == 1000
    assert {len(key) for key in keys} == {OWNER_KEY_BYTES}


def test_a_forked_child_draws_acquire_keys_its_parent_never_draws():
    """The compiled path's own buffer of keys (fastlock/client/_path.pyx) is emptied in a
    forked child, as fastlock.client.owner_keys' is."""
    acquire_request(*DEFAULTS.values())  # the buffer now holds keys the child inherits
    child = keys_of_a_forked_child(lambda: acquire_request(*DEFAULTS.values()).owner)
    parent = {acquire_request(*DEFAULTS.values()).owner for _ in range(KEYS_PER_DRAW)}
    assert not child & parent


class _Connector:
    def __init__(self, server_info: dict[str, Any] | None = None, sequencers: bool = False):
        self.max_epoch = 0
        self.server_info = server_info or {}
        self.sequencers = sequencers


#: the fields LeaseState.__init__ sets, each a slot of LeaseSlots
STATE_FIELDS = ("_lost", "expires_at", "_health", "sequencer", "revoke_request", "_revoke_requested")


@pytest.mark.parametrize("reply", [
    [5 << TOKEN_EPOCH_SHIFT | 9, 10_000, 0],
    [1, 2_500],
    [3 << TOKEN_EPOCH_SHIFT | 1, 1, 750, {"sequencer": b"signed"}],
    [2 << TOKEN_EPOCH_SHIFT, 60_000, 12, {}],
    [7, 1000, 0, None],
])
def test_grant_lease_is_what_the_constructors_make(reply):
    connector = _Connector()
    connector.max_epoch = 2
    lease = grant_lease("n", b"o" * 16, reply, 100.25, connector)
    waited = reply[2] / 1000.0 if len(reply) > 2 else 0.0
    expected = Lease("n", reply[0], reply[1] / 1000.0, b"o" * 16, LeaseState(100.25 + waited + reply[1] / 1000.0))
    if len(reply) > 3 and type(reply[3]) is dict:
        expected.state.sequencer = reply[3].get("sequencer")
    assert type(lease) is Lease and type(lease.state) is LeaseState
    assert list(vars(lease)) == list(vars(expected))  # the same fields, in the same order
    for field in ("name", "fencing_token", "ttl", "owner"):
        assert getattr(lease, field) == getattr(expected, field) and type(getattr(lease, field)) is type(
            getattr(expected, field)), field
    slots = [name for name, member in vars(LeaseSlots).items() if type(member) is types.GetSetDescriptorType]
    assert sorted(slots) == sorted(STATE_FIELDS)
    for slot in slots:
        assert getattr(lease.state, slot) == getattr(expected.state, slot), slot
    assert connector.max_epoch == max(2, reply[0] >> TOKEN_EPOCH_SHIFT)
    assert not lease.lost.is_set()


@pytest.mark.parametrize("reply", [None, [], [1], ["t", 1000], [1, "1000"]])
def test_grant_lease_refuses_a_reply_of_another_shape(reply):
    with pytest.raises((TypeError, IndexError)):
        grant_lease("n", b"o", reply, 1.0, _Connector())


async def test_acquire_tail_is_acquire_call():
    who = current_caller()
    assert type(who) is Caller
    shapes = [((), 0), ((True,), 0), ((False, 3), 0), ((), 5), ((True,), 7)]
    for info in ({}, {"actors": True}, {"actors": True, "sequencers": True}):
        for sequencers in (False, True) if info.get("sequencers") else (False,):
            connector = _Connector(info, sequencers)
            for kind, priority in shapes:
                for caller in (who, None, threading.current_thread()):
                    assert acquire_tail(connector, kind, priority, caller) == acquire_call(connector, kind,
                                                                                         priority, caller)


@pytest.mark.parametrize("name", [["k"], {"k": 1}, {"k"}, b"k", 5])
@pytest.mark.parametrize("wait", [None, 1.0, 0])
async def test_a_name_that_is_no_str_is_a_wrong_argument_type(name, wait):
    client = Client(["127.0.0.1:1"])
    try:
        with pytest.raises(WrongArgumentType, match="lock name must be str"):
            await client.acquire(name, ttl=1, wait=wait)
        assert not client._held.by_name
    finally:
        await client.close()


class _AnsweringTransport(NullTransport):
    """Answers each request frame in the next loop turn: a grant for ACQUIRE, None otherwise."""

    def __init__(self, proto: ClientConnection) -> None:
        self.proto = proto
        self.unpacker = msgpack.Unpacker(raw=False)
        self.token = 1 << 40

    def write(self, data: bytes) -> None:
        self.unpacker.feed(data)
        for req in self.unpacker:
            self.token += 1
            value = [self.token, req[4], 0] if req[1] == P.OP_ACQUIRE else None
            asyncio.get_running_loop().call_soon(self.proto.data_received, msgpack.packb([req[0], 0, value]))


class _Recording(ClientConnection):
    """A connection whose class overrides ``request``: it records each op it sends."""

    __slots__ = ("ops",)

    def request(self, op, *args):
        self.ops.append(op)
        return super().request(op, *args)


async def _pairs_through(cls: type) -> list[int]:
    """Two acquire+release pairs on a connection of class ``cls``; the ops it recorded."""
    client = Client(["127.0.0.1:1"])
    proto = cls(("127.0.0.1", 1), lambda *_: None, 5.0)
    ops: list[int] = []
    if cls is _Recording:
        proto.ops = ops
    proto.connection_made(_AnsweringTransport(proto))
    client.connector.proto = proto
    try:
        for _ in range(2):
            lease = await client.acquire("k", ttl=10)
            assert lease.fencing_token > 1 << 40
            await client.release(lease)
        assert not proto.pending
    finally:
        proto.close()
        await client.close()
    return ops


async def test_acquire_and_release_go_through_a_connections_own_request():
    # a plain connection first (its class is then sent to by C calls), then one whose
    # class overrides request, then a plain one again
    assert await _pairs_through(ClientConnection) == []
    assert await _pairs_through(_Recording) == [P.OP_ACQUIRE, P.OP_RELEASE] * 2
    assert await _pairs_through(ClientConnection) == []


class _Bounded:
    """A connector whose connection has, or has not, heard from the server."""

    def __init__(self) -> None:
        self.last_recv = -math.inf
        self.resets: list[tuple[float, str]] = []
        self.reset_seen = asyncio.Event()

    def reset_if_silent_since(self, started: float, reason: str) -> None:
        if self.last_recv > started:
            return
        self.resets.append((started, reason))
        self.reset_seen.set()


async def test_a_due_bound_of_a_silent_server_resets_and_others_do_not():
    loop = asyncio.get_running_loop()
    connector = _Bounded()
    bounds = AttemptBounds(connector, loop)
    now = loop.time()
    answered = bounds.begin(now, 0.05, P.OP_RELEASE)
    silent = bounds.begin(now, 0.1, P.OP_HOLDER)
    bounds.end(answered)
    assert list(bounds.outstanding) == [silent]
    await asyncio.wait_for(connector.reset_seen.wait(), 10)
    assert connector.resets == [(now, "holder got no reply in time")]
    assert bounds.outstanding == {}
    # a server that spoke after the request went out keeps its connection
    connector.reset_seen.clear()
    spoke = bounds.begin(loop.time(), 0.05, P.OP_STATUS)
    connector.last_recv = loop.time() + 1e-6
    late = bounds.begin(connector.last_recv + 1e-6, 0.06, P.OP_PING)
    await asyncio.wait_for(connector.reset_seen.wait(), 10)
    assert [reason for _, reason in connector.resets[1:]] == ["ping got no reply in time"]
    assert spoke not in bounds.outstanding and late not in bounds.outstanding


async def test_many_bounds_share_one_timer():
    loop = asyncio.get_running_loop()
    armed = []

    class CountingLoop:
        def time(self) -> float:
            return loop.time()

        def call_at(self, when: float, callback: Any, *args: Any) -> asyncio.TimerHandle:
            armed.append(when)
            return loop.call_at(when, callback, *args)

    bounds = AttemptBounds(_Bounded(), CountingLoop())
    keys = [bounds.begin(loop.time(), 30.0, P.OP_RELEASE) for _ in range(1000)]
    for key in keys:
        bounds.end(key)
    assert len(armed) == 1 and bounds.outstanding == {}
    earlier = bounds.begin(loop.time(), 1.0, P.OP_RELEASE)  # an earlier bound re-arms it, once
    assert len(armed) == 2
    bounds.end(earlier)
