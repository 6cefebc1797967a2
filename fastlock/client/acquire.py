"""The slow paths of :meth:`Client.acquire <fastlock.client.Client.acquire>`.

- :func:`acquire_retry` rides an acquire through a failover with the same
  owner key, so a grant made before the failure is found again, never made
  twice (as ZooKeeper's lock recipe finds its own node again);
- :class:`HeldLeases` refuses an acquire of a lock the same client
  holds already (it would queue behind itself);
- :func:`verify_late_grant` checks, with one EXTEND, a grant that was read
  with less than :data:`~fastlock.client.client.LATE_GRANT_FRACTION` of its
  TTL left, instead of returning a lease that may already be dead.

The first attempt of an acquire (the normal path) stays in ``Client.acquire``.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import threading
import weakref
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any, NamedTuple

from .. import protocol as P
from ..errors import AlreadyHeld, FastlockError, InvalidArgument, LeaseLost, ProtocolError
from ..logsafe import quote
from ..protocol.ops import OP_ACQUIRE_PRIORITY
from .connection import RETRYABLE, ClientConnection, Connector, RideThrough
from .lease import Lease
from .preempt import send_revoke_request

if TYPE_CHECKING:  # pragma: no cover
    from .client import Client

log = logging.getLogger(__name__)

__all__ = ["AcquireRequest", "SentReply", "acquire_retry", "duration_ms", "verify_late_grant", "HeldLease",
           "HeldLeases", "CALLER", "Caller", "current_caller", "new_caller", "acts_for", "party", "actor_id",
           "with_actor", "extend_args", "extended_ms"]


class AcquireRequest(NamedTuple):
    """One acquire as :meth:`Client.acquire <fastlock.client.Client.acquire>` checked it,
    for its slow paths (a retry through a failover, a late grant's verification)."""

    name: str
    owner: bytes  #: the owner key: the same on every retry, so a grant is found again, never made twice
    ttl_ms: int
    wait_ms: int  #: -1: wait forever, 0: try once
    lock_delay_ms: int
    correlation_id: str | None
    kind: tuple[Any, ...]  #: ACQUIRE's trailing kind arguments (see :func:`~fastlock.client.kinds.kind_args`)
    priority: int = 0  #: 0..MAX_PRIORITY; above 0 it is sent as ACQUIRE_PRIORITY (see :func:`acquire_call`)
    #: ms: the grace of the revoke request sent right behind each attempt that may wait (None: none)
    preempt_ms: int | None = None


class SentReply(NamedTuple):
    """An ACQUIRE's reply and when (``loop.time()``, seconds) its request was sent."""

    reply: list[Any]
    sent: float


def duration_ms(value: Any, what: str, *, allow_zero: bool = False) -> int:
    """:func:`fastlock.units.seconds_to_ms` (same result, same errors), with the
    common case - a finite positive ``float`` or ``int`` - decided in one test
    (the normal path of an acquire)."""
    if (type(value) is float or type(value) is int) and 0 < value < 1e9:  # NaN fails the test
        return max(1, math.ceil(value * 1000))
    return P.seconds_to_ms(value, what, allow_zero=allow_zero)

class Caller:
    """An asyncio task's identity as a caller of the client, for the self-wait check and
    the deadlock detector's ``actor``: a node of the tree of structured concurrency.

    A task's node is made the first time it acquires (or asks who it is), in its own
    context, with ``parent`` the node its context carried: the node of the task in whose
    context it was created (``asyncio.wait_for`` on Python 3.10/3.11, ``gather``,
    ``TaskGroup``, ``create_task``, ``ensure_future`` all copy the creating task's
    context), skipping ancestors whose task has ended.  A task *acts for* its ancestors:
    its waits are theirs.  See :func:`acts_for` and :func:`actor_id`.

    Attributes:
        task (weakref.ref[asyncio.Task]): the task this node stands for.
        parent (Caller | None): the nearest live ancestor's node, or None.
        held (dict[int, int] | None): per client (the ``id`` of its connector), the
            leases granted with this node as their party and not yet forgotten.
        actor (int): this process's number for the node (1, 2, ...; never reused).
    """

    __slots__ = ("task", "parent", "held", "actor")

    def __init__(self, task: asyncio.Task[Any], parent: Caller | None):
        self.task: weakref.ref[asyncio.Task[Any]] = weakref.ref(task)
        while parent is not None and _ended(parent):
            parent = parent.parent
        self.parent: Caller | None = parent
        self.held: dict[int, int] | None = None
        self.actor = next(_NEXT_ACTOR)

    def __repr__(self) -> str:
        parent = None if self.parent is None else self.parent.actor
        return f"<Caller actor={self.actor} held={self.held} parent={parent}>"


def party(who: Caller, key: int) -> Caller:
    """The node whose party a wait by ``who`` through the client ``key`` is: the nearest
    of ``who`` and its live ancestors that holds a lease through that client (their
    leases are what the wait keeps from being released), else ``who`` itself."""
    node: Caller | None = who
    for _ in range(MAX_ANCESTRY):
        if node is None:
            break
        held = node.held
        if held and held.get(key) and (node is who or not _ended(node)):
            return node
        node = node.parent
    return who


def _ended(node: Caller) -> bool:
    task = node.task()
    return task is None or task.done()


#: who acquires: the blocking client sets its calling thread (its tasks inherit the
#: context); otherwise the :class:`Caller` node of the current asyncio task, made on first use
CALLER: ContextVar[object | None] = ContextVar("fastlock_caller", default=None)

#: the longest chain of ancestors :func:`acts_for` and :func:`actor_id` walk
MAX_ANCESTRY = 256


def current_caller(loop: asyncio.AbstractEventLoop | None = None) -> object:
    """The thread (blocking client) or the :class:`Caller` node of the asyncio task that
    calls now (made, and set in the task's context, on first use); None outside a task.
    ``loop``: the running loop, if the caller has it (CPython finds it with a
    ``getpid()`` call otherwise)."""
    who = CALLER.get()
    if who is not None and type(who) is not Caller:
        return who
    task = asyncio.current_task(loop)
    if task is None:
        return None
    if who is not None and who.task() is task:
        return who
    node = Caller(task, who)
    CALLER.set(node)
    return node


def new_caller() -> None:
    """Make the calling asyncio task a caller of its own, acting for no ancestor (from
    now on, and for the tasks it creates afterwards): its waits for a lock an ancestor
    holds queue as another task's would, and the deadlock detector does not count them
    as its ancestors' waits.  For a long-lived task spawned by a lock holder that serves
    on its own (a connection handler, a worker).  No effect outside a task."""
    task = asyncio.current_task()
    if task is not None:
        CALLER.set(Caller(task, None))


def acts_for(who: object, holder: object) -> bool:
    """True if ``who`` (a :func:`current_caller`) is ``holder`` or a task created in
    ``holder``'s context, directly or through other tasks: a wait by ``who`` for a
    lease ``holder`` holds is a wait for itself."""
    if who is holder:
        return True
    if type(who) is not Caller:
        return False
    node = who.parent
    for _ in range(MAX_ANCESTRY):
        if node is None:
            return False
        if node is holder:
            return not _ended(node)
        node = node.parent
    return False


_ACTORS: weakref.WeakKeyDictionary[object, int] = weakref.WeakKeyDictionary()
_ACTORS_LOCK = threading.Lock()
_NEXT_ACTOR = itertools.count(1)


def actor_id(connector: object | None = None, who: object = None) -> int:
    """This process's number (1, 2, ...; never reused) for the party that waits when the
    caller waits: the ``actor`` by which the server's deadlock detection tells the waits
    of one connection apart; 0 outside a task.

    A blocking client's thread is its own party.  An asyncio task's party is
    :func:`party` for the client ``connector`` (the nearest of itself and its live
    ancestors that holds a lease through it, else itself): a child's wait blocks the
    parent that awaits it, so a parent holding ``a`` whose child waits for ``b``, held
    by a task waiting for ``a``, is a cycle the server sees.  ``who``: the
    :func:`current_caller`, if the caller has it."""
    if who is None:
        who = current_caller()
    if who is None:
        return 0
    if type(who) is Caller:
        return party(who, id(connector)).actor
    with _ACTORS_LOCK:
        n = _ACTORS.get(who)
        if n is None:
            n = _ACTORS[who] = next(_NEXT_ACTOR)
    return n


def with_actor(connector: Connector, kind: tuple[Any, ...], who: object = None) -> tuple[Any, ...]:
    """ACQUIRE's trailing arguments: ``kind`` (see :func:`~fastlock.client.kinds.kind_args`)
    and, to a server that reads it (HELLO's ``"actors"``), the caller's :func:`actor_id`
    (``who``: the :func:`current_caller`, if the caller has it); then ``True`` when the
    client asks for sequencers (``connect(sequencers=True)``).

    :raises InvalidArgument: sequencers asked for, and the server holds no sequencer key."""
    if asks_sequencers(connector):
        return (*kind_pair(kind), actor_id(connector, who), True)
    if not connector.server_info.get("actors"):
        return kind
    return (*kind_pair(kind), actor_id(connector, who))


def asks_sequencers(connector: Connector) -> bool:
    """True when the client asks for signed sequencers (``connect(sequencers=True)``).

    :raises InvalidArgument: sequencers asked for, and the server holds no sequencer key."""
    if not connector.sequencers:
        return False
    if not connector.server_info.get("sequencers"):
        raise InvalidArgument("this client asks for sequencers and the server hands out none "
                              "(no sequencer key in its credentials: `fastlock credentials sequencer-key`)")
    return True


def acquire_call(connector: Connector, kind: tuple[Any, ...], priority: int,
                 who: object = None) -> tuple[int, tuple[Any, ...]]:
    """The op and trailing arguments of an acquire: ACQUIRE with :func:`with_actor`'s, or for a
    priority above 0, ACQUIRE_PRIORITY with shared, limit, actor and the priority, then ``True``
    when the client asks for sequencers (:mod:`fastlock.server.preemption`).  ``who``: the
    :func:`current_caller`, if the caller has it.

    :raises InvalidArgument: sequencers asked for, and the server holds no sequencer key."""
    if not priority:
        return P.OP_ACQUIRE, with_actor(connector, kind, who)
    actor = actor_id(connector, who) if connector.server_info.get("actors") else 0
    if asks_sequencers(connector):
        return OP_ACQUIRE_PRIORITY, (*kind_pair(kind), actor, priority, True)
    return OP_ACQUIRE_PRIORITY, (*kind_pair(kind), actor, priority)


def kind_pair(kind: tuple[Any, ...]) -> tuple[bool, int]:
    """``(shared, limit)`` of ACQUIRE's trailing kind arguments (``()``, ``(True,)`` or ``(False, limit)``)."""
    return (bool(kind[0]) if kind else False, kind[1] if len(kind) > 1 else 0)


#: a :class:`HeldLease` made without its Python-level ``__new__`` (one per grant)
_new_entry = tuple.__new__

#: the smallest size at which :class:`HeldLeases` sweeps out ended leases
SWEEP_MIN = 1024


class HeldLease(NamedTuple):
    """An entry of :attr:`HeldLeases.by_name`: the last lease granted of a name, to whom."""

    lease: Lease
    caller: object  #: the task or thread it went to (see :func:`current_caller`)
    exclusive: bool  #: neither a shared lease nor a semaphore permit
    party: Caller | None  #: the caller node its hold is counted against (see :func:`party`), None: a thread


def _unhold(node: Caller | None, key: int) -> None:
    if node is not None and node.held:
        n = node.held.get(key, 0) - 1
        if n > 0:
            node.held[key] = n
        else:
            node.held.pop(key, None)


class HeldLeases:
    """The last lease a client was granted per lock name, and the caller (an asyncio
    task's :class:`Caller` node, or a blocking client's thread) it went to: the self-wait check of :meth:`Client.acquire
    <fastlock.client.Client.acquire>`.  An entry goes on release; entries of leases that
    ended otherwise (expired, lost) are swept out whenever the table has doubled since
    the last sweep, so it holds at most about twice the live leases."""

    __slots__ = ("by_name", "_sweep_at", "_key")

    def __init__(self, connector: object | None = None) -> None:
        #: lock name -> its entry; read directly by ``Client.acquire`` (one lookup)
        self.by_name: dict[str, HeldLease] = {}
        self._sweep_at = SWEEP_MIN
        #: the client, for :func:`party` (the ``id`` of its connector)
        self._key = id(self if connector is None else connector)

    def remember(self, lease: Lease, exclusive: bool, loop: asyncio.AbstractEventLoop | None = None,
                 who: object = None) -> None:
        """Record ``lease`` as the caller's grant of its name (``exclusive``: not a
        shared lease nor a semaphore permit; ``loop``: the running loop, if known;
        ``who``: the :func:`current_caller`, if the caller has it)."""
        by_name = self.by_name
        if who is None:
            who = current_caller(loop)
        key = self._key
        node = None
        if type(who) is Caller:
            node = party(who, key)
            held = node.held
            if held is None:
                held = node.held = {}
            held[key] = held.get(key, 0) + 1
        old_entry = by_name.get(lease.name)
        by_name[lease.name] = _new_entry(HeldLease, (lease, who, exclusive, node))
        if old_entry is not None:
            _unhold(old_entry.party, key)
        if len(by_name) >= self._sweep_at:
            for name, entry in list(by_name.items()):
                if entry.lease.lost.is_set() or entry.lease.time_left() <= 0:
                    del by_name[name]
                    _unhold(entry.party, key)
            self._sweep_at = max(SWEEP_MIN, 2 * len(by_name))

    def forget(self, lease: Lease) -> None:
        """Drop ``lease`` if it is the entry of its name (any copy of it)."""
        entry = self.by_name.get(lease.name)
        if entry is not None and entry.lease.state is lease.state:
            del self.by_name[lease.name]
            node = entry.party
            if node is not None and node.held:
                _unhold(node, self._key)

    def refuse_self_wait(self, entry: HeldLease, exclusive: bool) -> None:
        """Raise :class:`AlreadyHeld` if ``entry`` (from :attr:`by_name`) belongs to the
        caller, is still live (not lost, its TTL not passed by the client's estimate)
        and either it or the request (``exclusive``) is exclusive: a shared lease or a
        permit asked by a holder of a shared lease or a permit can be granted beside it.
        A dead entry is dropped."""
        lease = entry.lease
        if not (entry.exclusive or exclusive):
            return
        if lease.lost.is_set() or lease.time_left() <= 0:
            self.forget(lease)
            return
        if not acts_for(current_caller(), entry.caller):
            return  # an unrelated task or thread of this client: waiting for it is no deadlock
        raise AlreadyHeld(f"this client already holds {quote(lease.name)} (fencing token {lease.fencing_token}); "
                          "a second acquire would wait for itself (pass queue_behind_self=True to queue anyway)",
                          lease.fencing_token)


async def acquire_retry(connector: Connector, connect_timeout: float, request: AcquireRequest,
                        started: float, proto: ClientConnection | None = None,
                        exc: BaseException | None = None) -> SentReply:
    """Ride an acquire through a failover: same owner key, the wait that is
    left, until ``started + wait + connect_timeout`` (``started``: ``loop.time()``;
    ``connect_timeout`` in seconds).  ``proto`` and ``exc``: the connection of a first
    attempt and the error it ended with.  Returns the reply and when its request was sent.

    :raises: the last retryable error once the deadline has passed; ``asyncio.CancelledError``
        (the waiter is withdrawn by owner key)."""
    name, owner, ttl_ms, wait_ms, delay_ms, correlation_id, kind = request[:7]
    op, tail = acquire_call(connector, kind, request.priority)
    loop = asyncio.get_running_loop()
    wait_end = None if wait_ms < 0 else started + wait_ms / 1000.0
    deadline = None if wait_end is None else wait_end + connect_timeout
    pacing = RideThrough(connector, deadline)
    pause = False
    if exc is not None:
        if connector.closed:
            connector.orphans.append((name, owner))
            raise exc
        pause = pacing.failed(proto, exc)
    while True:
        try:
            proto = await pacing.connection(pause)
        except BaseException:
            # the grant may have been made before the failure: cancel by owner
            # (now, or on the next connection) so that it is released, not left to its TTL
            connector.withdraw(connector.proto, name, owner)
            raise
        if wait_end is None:
            left_ms = -1
        else:
            left_ms = max(0, int((wait_end - loop.time()) * 1000))
        sent = loop.time()
        try:
            fut = proto.request(op, name, owner, ttl_ms, left_ms, delay_ms, correlation_id, *tail)
            if request.preempt_ms is not None and left_ms != 0:
                # asked again at each node: a deadline the new primary already has (replicated) stays
                send_revoke_request(proto, name, owner, request.preempt_ms)
            reply = await fut
            return SentReply(reply, sent)
        except asyncio.CancelledError:
            connector.withdraw(proto, name, owner)
            raise
        except RETRYABLE as err:
            if connector.closed:
                connector.orphans.append((name, owner))
                raise
            pause = pacing.failed(proto, err)


async def verify_late_grant(client: Client, lease: Lease, request: AcquireRequest, started: float) -> Lease:
    """A grant read with less than :data:`LATE_GRANT_FRACTION` of its TTL
    left by the conservative estimate: verify it with one EXTEND, or give
    it back and queue again while the wait allows (see :meth:`Client.acquire`)."""
    loop = asyncio.get_running_loop()
    shared, limit = kind_pair(request.kind)
    log.warning("grant of %s token %d was read with %.3f s of its %.3f s TTL left (this process or the "
                "network stalled); verifying it with the server", quote(lease.name), lease.fencing_token,
                lease.expires_at - loop.time(), lease.ttl)
    try:
        verified = await client.extend(lease)
    except FastlockError as exc:
        log.warning("late grant of %s token %d could not be verified (%s); giving it back",
                    quote(lease.name), lease.fencing_token, exc)
        lease.lost.set()
        client.release_nowait(lease)
    else:
        if verified.expires_at > loop.time():
            return verified
        lease.lost.set()
        client.release_nowait(lease)
    left = started + request.wait_ms / 1000.0 - loop.time()
    if request.wait_ms < 0 or (request.wait_ms > 0 and left > 0):
        return await client.acquire(request.name, ttl=request.ttl_ms / 1000.0,
                                    wait=None if request.wait_ms < 0 else left,
                                    lock_delay=request.lock_delay_ms / 1000.0,
                                    correlation_id=request.correlation_id, shared=shared, limit=limit,
                                    priority=request.priority)
    raise LeaseLost(f"{request.name!r} was granted (token {lease.fencing_token}) but the grant was read too late to "
                    f"prove the lease alive, and the wait had no time left to queue again")


def extend_args(lease: Lease, ttl_ms: int) -> tuple[Any, ...]:
    """EXTEND's arguments for ``lease`` renewed for ``ttl_ms`` milliseconds: with the
    ``sequencer`` flag when the lease carries a signed sequencer, so the reply brings it
    re-signed with the renewed expiry (:func:`extended_ms`)."""
    if lease.state.sequencer is not None:
        return (lease.name, lease.fencing_token, lease.owner, ttl_ms, True)
    return (lease.name, lease.fencing_token, lease.owner, ttl_ms)


def extended_ms(lease: Lease, granted: Any) -> int:
    """The TTL (milliseconds) an EXTEND reply ``granted`` gave ``lease``; a reply
    ``[ttl_ms, {"sequencer": bytes}]`` (an EXTEND with the ``sequencer`` flag) also replaces
    the lease's sequencer by the re-signed one (every copy of the lease sees it).

    :raises ProtocolError: a reply of another shape."""
    if type(granted) is int:
        return granted
    if type(granted) is list and len(granted) == 2 and type(granted[0]) is int and type(granted[1]) is dict:
        blob = granted[1].get("sequencer")
        if type(blob) is bytes:
            lease.state.sequencer = blob
        return granted[0]
    raise ProtocolError(f"unexpected EXTEND reply: {type(granted).__name__}")
