"""Lock kinds on the client side: shared locks' and semaphores' arguments,
:class:`Semaphore`, and the one-request atomic multi-lock.

* ``shared=True`` / ``limit=N`` travel as ACQUIRE's two optional arguments,
  sent only when set (:func:`kind_args`), so an exclusive acquire is the request
  every fastlock server reads.
* :func:`acquire_set` takes a set of locks with ONE ``ACQUIRE_MANY`` request:
  the server grants all of them together or none, queues the request FIFO on
  every name, and holds none of them while it waits (see
  :meth:`fastlock.client.Client.acquire_many`).
* :func:`list_contenders` follows ``CONTENDERS``' pages (a lock's holders, then
  its waiters in FIFO order, about 64 KiB per reply) up to a bounded count.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from .. import protocol as P
from ..errors import FastlockError, InvalidArgument, LeaseLost
from ..tokens import epoch_of
from .acquire import actor_id
from .connection import RETRYABLE, RideThrough
from .lease import Lease, LeaseState
from .owner_keys import new_owner_key

if TYPE_CHECKING:  # pragma: no cover
    from .blocking import SyncClient, SyncLease, SyncLockContext
    from .client import Client
    from .renewer import LockContext

__all__ = ["kind_args", "check_semaphore", "Semaphore", "SyncSemaphore", "acquire_set", "list_contenders",
           "MAX_CONTENDERS"]

#: most contenders :func:`list_contenders` collects by default (the server's default ``--max-waiters``)
MAX_CONTENDERS = 100_000


async def list_contenders(request: Callable[..., Awaitable[Any]], name: str,
                          most: int = MAX_CONTENDERS) -> dict[str, Any]:
    """The holders (grant order) and waiters (FIFO order) of ``name``: ``{"holders": [...],
    "waiters": [...], "truncated": bool}``, following the server's CONTENDERS pages
    (``request(op, *args)`` sends one) until the last page or ``most`` contenders (int >= 1);
    ``truncated``: more remained.  Pages are read one after another, not at one instant: a
    contender that leaves or arrives meanwhile may be missed or listed twice.

    Raises:
        InvalidArgument / WrongArgumentType: a bad name, ``most`` not an int >= 1.
    """
    P.check_name(name)
    if type(most) is not int or most < 1:
        raise InvalidArgument(f"most must be an int >= 1, not {most!r}")
    holders: list[Any] = []
    waiters: list[Any] = []
    cursor = None
    while True:
        page = await request(P.OP_CONTENDERS, *((name,) if cursor is None else (name, cursor)))
        holders += page["holders"]
        waiters += page["waiters"]
        cursor = page.get("cursor")  # absent: a server that sends everything in one reply
        if cursor is None or len(holders) + len(waiters) >= most or not (page["holders"] or page["waiters"]):
            break
    truncated = cursor is not None or len(holders) + len(waiters) > most
    return {"holders": holders[:most], "waiters": waiters[:max(0, most - len(holders))], "truncated": truncated}


def kind_args(shared: Any, limit: Any) -> tuple[Any, ...]:
    """ACQUIRE's trailing arguments for a lease kind: ``()`` for an exclusive lock,
    ``(True,)`` for a shared lease, ``(False, limit)`` for a semaphore permit.

    Raises:
        WrongArgumentType: ``shared`` not a bool, ``limit`` not an int.
        InvalidArgument: ``limit`` out of 0..2**31-1, or both set.
    """
    if shared is False and limit == 0 and type(limit) is int:  # an exclusive lock: the common case
        return ()
    P.check_shared(shared)
    P.check_limit(limit)
    if shared and limit:
        raise InvalidArgument("a semaphore permit (limit > 0) cannot also be shared")
    if limit:
        return (False, limit)
    return (True,) if shared else ()


def check_semaphore(name: str, limit: int) -> None:
    """A semaphore's name and limit (1..``MAX_LIMIT`` holders).

    :raises InvalidArgument: a bad name, or a limit out of range (0 is a lock, not a semaphore).
    :raises WrongArgumentType: a limit that is not an int.
    """
    P.check_name(name)
    if type(limit) is bool or P.check_limit(limit) == 0:
        raise InvalidArgument(f"a semaphore's limit must be 1..{P.MAX_LIMIT}, got {limit!r}")


class Semaphore:
    """A counting semaphore: at most ``limit`` holders of ``name`` at once, FIFO,
    each permit a lease with its own fencing token (:meth:`Client.semaphore
    <fastlock.client.Client.semaphore>`).  The limit is kept by the server while
    the name has holders or waiters; an acquire with another limit meanwhile is
    refused with :class:`~fastlock.errors.LimitConflict`.
    """

    __slots__ = ("client", "name", "limit")

    def __init__(self, client: Client, name: str, limit: int):
        check_semaphore(name, limit)
        self.client = client
        self.name = name
        self.limit = limit

    async def acquire(self, *, ttl: float, wait: float | None = None, lock_delay: float = 0.0,
                      correlation_id: str | None = None) -> Lease:
        """Take a permit: :meth:`Client.acquire <fastlock.client.Client.acquire>` with ``limit``
        (arguments, seconds and errors as there); release it with ``client.release``."""
        return await self.client.acquire(self.name, ttl=ttl, wait=wait, lock_delay=lock_delay,
                                         correlation_id=correlation_id, limit=self.limit)

    def lock(self, *, ttl: float, wait: float | None = None, lock_delay: float = 0.0,
             correlation_id: str | None = None, renew: bool = True, jeopardy_fraction: float = 0.5) -> LockContext:
        """Take a permit and keep renewing it: :meth:`Client.lock <fastlock.client.Client.lock>`
        with ``limit`` (``async with sem.lock(ttl=10.0) as permit: ...``)."""
        return self.client.lock(self.name, ttl=ttl, wait=wait, lock_delay=lock_delay, correlation_id=correlation_id,
                                renew=renew, jeopardy_fraction=jeopardy_fraction, limit=self.limit)

    def __repr__(self) -> str:
        return f"<Semaphore {self.name!r} limit={self.limit}>"


class SyncSemaphore:
    """:class:`Semaphore` for the blocking client (:meth:`SyncClient.semaphore
    <fastlock.client.blocking.SyncClient.semaphore>`)."""

    __slots__ = ("client", "name", "limit")

    def __init__(self, client: SyncClient, name: str, limit: int):
        check_semaphore(name, limit)
        self.client = client
        self.name = name
        self.limit = limit

    def acquire(self, *, ttl: float, wait: float | None = None, lock_delay: float = 0.0,
                correlation_id: str | None = None) -> SyncLease:
        """Take a permit (not renewed); release it with ``client.release``."""
        return self.client.acquire(self.name, ttl=ttl, wait=wait, lock_delay=lock_delay,
                                 correlation_id=correlation_id, limit=self.limit)

    def lock(self, *, ttl: float, wait: float | None = None, lock_delay: float = 0.0,
             correlation_id: str | None = None, jeopardy_fraction: float = 0.5) -> SyncLockContext[SyncLease]:
        """``with sem.lock(ttl=10.0) as permit:`` - take a permit, renew it, release on exit."""
        return self.client.lock(self.name, ttl=ttl, wait=wait, lock_delay=lock_delay, correlation_id=correlation_id,
                              jeopardy_fraction=jeopardy_fraction, limit=self.limit)


async def acquire_set(client: Client, items: list[tuple[str, bool]], ttl_ms: int, wait_ms: int, delay_ms: int,
                      correlation_id: str | None) -> list[Lease]:
    """Send ONE ACQUIRE_MANY for ``items`` (``(name, shared)``, checked) and return one
    :class:`Lease` per name, in ``items`` order, all with the same owner key.

    Like :meth:`Client.acquire <fastlock.client.Client.acquire>`, it rides through a
    failover with the same owner key until ``wait + connect_timeout`` (the server
    finds the request, or its grant, again by that key).  Cancelling it cancels
    the request on the server (or releases what raced with the cancel).
    """
    connector = client.connector
    connect_timeout = connector.connect_timeout
    owner = new_owner_key()
    loop = asyncio.get_running_loop()
    started = loop.time()
    wait_end = None if wait_ms < 0 else started + wait_ms / 1000.0
    pacing = RideThrough(connector, None if wait_end is None else wait_end + connect_timeout)
    wire = [[name, shared] for name, shared in items]
    proto = connector.proto
    pause = False
    while True:
        if proto is None or proto.closed:
            try:
                proto = await pacing.connection(pause)
            except BaseException:
                _withdraw(connector, items, owner)
                raise
        left_ms = -1 if wait_end is None else max(0, int((wait_end - loop.time()) * 1000))
        sent = loop.time()
        try:
            actor: tuple[Any, ...] = (actor_id(connector),) if connector.server_info.get("actors") else ()
            if connector.sequencers:  # a signed sequencer per name (see with_actor)
                if not connector.server_info.get("sequencers"):
                    raise InvalidArgument("this client asks for sequencers and the server hands out none")
                actor = (actor_id(connector), True)
            reply = await proto.request(P.OP_ACQUIRE_MANY, wire, owner, ttl_ms, left_ms, delay_ms, correlation_id,
                                        *actor)
            break
        except asyncio.CancelledError:
            _withdraw(connector, items, owner, proto)
            raise
        except RETRYABLE as err:
            if connector.closed:
                _withdraw(connector, items, owner)
                raise
            pause = pacing.failed(proto, err)
            proto = None
    leases = leases_granted(connector, [name for name, _ in items], owner, reply, sent)
    ttl = leases[0].ttl
    if leases[0].state.expires_at - loop.time() >= ttl * 0.5:
        return leases
    # read late (a stalled loop or network): verified with one EXTEND each, as Client.acquire does
    try:
        return [await client.extend(lease) for lease in leases]
    except FastlockError as exc:
        for lease in leases:
            lease.lost.set()
            client.release_nowait(lease)
        raise LeaseLost(f"{len(leases)} locks were granted but the grant was read too late to prove "
                        f"every lease alive ({exc})") from None


def leases_granted(connector: Any, names: list[str] | tuple[str, ...], owner: bytes, reply: list[Any],
                   sent: float) -> list[Lease]:
    """The leases of a grant of several ``names`` at once (an ACQUIRE_MANY's or a RESERVE's
    ``reply``: ``[tokens, granted TTL ms, waited ms, {"sequencers": [...]}?]``, tokens in
    ``names`` order), all with the owner key ``owner``; ``sent``: the loop time (seconds) the
    request was sent at, from which each lease's expiry counts.  The connector's highest epoch
    seen rises to the tokens'."""
    tokens, granted_ms, waited_ms = reply[:3]
    ttl = granted_ms / 1000.0
    expires_at = sent + waited_ms / 1000.0 + ttl
    epoch = epoch_of(max(tokens))
    if epoch > connector.max_epoch:
        connector.max_epoch = epoch
    leases = [Lease(name, token, ttl, owner, LeaseState(expires_at)) for name, token in zip(names, tokens)]
    if len(reply) > 3 and type(reply[3]) is dict:  # signed sequencers, in the tokens' order
        for lease, blob in zip(leases, reply[3].get("sequencers", ())):
            lease.state.sequencer = blob
    return leases


def _withdraw(connector: Any, items: list[tuple[str, bool]], owner: bytes, proto: Any = None) -> None:
    """Cancel the request by owner on every name (a CANCEL of one name withdraws the
    whole request; a name already granted is released by its CANCEL)."""
    for name, _ in items:
        connector.withdraw(proto if proto is not None else connector.proto, name, owner)
