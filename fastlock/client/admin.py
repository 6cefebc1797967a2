"""The operator's lock requests in the Python client: list held locks, show one, revoke.

:class:`LockAdminMethods` gives :class:`~fastlock.client.Client` ``locks()``,
``lock_info()`` and ``revoke()``; the server side is :mod:`fastlock.server.lockadmin`
(an admin principal, or anyone in open mode, else
:class:`~fastlock.errors.PermissionDenied`).  Times are float seconds, as in the rest
of the API; the wire carries milliseconds.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .. import protocol as P
from ..errors import InvalidArgument, LockNotHeld, PermissionDenied, WrongArgumentType

__all__ = ["LeaseInfo", "WaiterInfo", "LockInfo", "LockList", "LockAdminMethods", "MAX_REASON_CHARS",
           "PrincipalRevocation"]

#: the longest revocation reason the server keeps (characters)
MAX_REASON_CHARS = 256


@dataclass(frozen=True)
class PrincipalRevocation:
    """What :meth:`LockAdminMethods.revoke_principal` did: ``revoked`` leases of
    ``principal``; ``waiting`` of its acquires still queued (left in place); ``unreachable``:
    for a sharded deployment, the groups that could not be reached (group name -> the error),
    where nothing was revoked."""

    principal: str
    revoked: int
    waiting: int
    unreachable: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class LeaseInfo:
    """One held lease, as the server sees it now.

    ``principal`` acquired it (authenticated); ``client`` is the name it declared (not
    verified); ``ttl``, ``remaining`` and ``lock_delay`` are seconds; ``waiters`` is the
    number of requests queued on the lock (:meth:`LockAdminMethods.locks` only, else 0).
    """

    name: str
    fencing_token: int
    principal: str | None
    client: str | None
    correlation_id: str | None
    ttl: float
    remaining: float
    lock_delay: float
    shared: bool = False
    limit: int = 0
    waiters: int = 0

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> LeaseInfo:
        return cls(d["name"], d["token"], d.get("principal"), d.get("client"), d.get("correlation_id"),
                   d["ttl_ms"] / 1000.0, d["remaining_ms"] / 1000.0, d.get("lock_delay_ms", 0) / 1000.0,
                   bool(d.get("shared")), d.get("limit", 0), d.get("waiters", 0))


@dataclass(frozen=True)
class WaiterInfo:
    """One queued acquire: who (``principal``, ``client``, ``correlation_id``, ``session``),
    how long it has waited (``waiting``, seconds), since when (``since``: Unix time in
    seconds, the server's clock) and how long it may still wait (``wait_remaining``,
    seconds; None: without end)."""

    principal: str | None
    client: str | None
    correlation_id: str | None
    session: int
    waiting: float
    since: float
    wait_remaining: float | None
    shared: bool = False

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> WaiterInfo:
        rem = d.get("wait_remaining_ms")
        return cls(d.get("principal"), d.get("client"), d.get("correlation_id"), d["session"],
                   d["waiting_ms"] / 1000.0, d["since_wall_ms"] / 1000.0,
                   None if rem is None else rem / 1000.0, bool(d.get("shared")))


@dataclass(frozen=True)
class LockInfo:
    """A lock's holders (grant order; empty when free) and waiters (FIFO order; the
    server lists at most 1000 of each and about 64 KiB in all, ``waiter_count`` is the
    full number; :meth:`~fastlock.client.Client.contenders` lists every one)."""

    name: str
    holders: list[LeaseInfo]
    waiters: list[WaiterInfo]
    waiter_count: int


@dataclass(frozen=True)
class LockList:
    """One page of the held leases whose name starts with a prefix (by name, or most
    waiters first): ``matched`` of them exist (after the page's cursor), ``truncated``
    when more matched than were listed; ``next`` is then the cursor of the next page
    (``locks(prefix, after=next)``; None by waiters, or from a server without paging).
    ``unreachable``: for a sharded deployment (:class:`~fastlock.client.sharded.ShardedClient`),
    the groups that could not be reached (group name -> the error), whose leases are not listed."""

    locks: list[LeaseInfo]
    matched: int
    truncated: bool
    next: str | None = None
    unreachable: dict[str, str] = field(default_factory=dict)


class LockAdminMethods:
    """The operator's requests, mixed into :class:`~fastlock.client.Client`."""

    async def _request(self, op: int, *args: Any) -> Any:  # pragma: no cover - Client's
        raise NotImplementedError

    async def locks(self, prefix: str = "", *, most: int | None = None, after: str | None = None,
                    order: str = "name") -> LockList:
        """One page of the held leases whose name starts with ``prefix`` ("" for every
        one), at most ``most`` (1..10000; None: the server's limit, 10000; a lock's leases
        are never split over two pages).  ``order`` "name": sorted by name, names above
        ``after`` only (the previous page's :attr:`LockList.next`); "contended": the locks
        with the most waiters first, then by name (no ``after``).  The server builds only
        the page, so paging through a large table never stalls it for the whole listing.

        Example (every held lease, a page at a time)::

            page = await client.locks()
            while page.truncated:
                page = await client.locks(after=page.next)

        Raises:
            PermissionDenied: the principal is not an admin (and the server not in open mode).
            NotPrimary / ConnectionLost: as every request (see :class:`Client`).
        """
        if type(prefix) is not str:
            raise WrongArgumentType(f"prefix must be str, not {type(prefix).__name__}")
        if most is not None and (type(most) is not int or not 1 <= most <= 10_000):
            raise InvalidArgument("most must be 1..10000 or None")
        if order not in ("name", "contended"):
            raise InvalidArgument(f"order must be 'name' or 'contended', not {order!r}")
        if after is not None:
            P.check_name(after)
            if order != "name":
                raise InvalidArgument("after pages by name: not with order 'contended'")
        args = (prefix, most) if after is None and order == "name" else (prefix, most, after, order)
        value = await self._request(P.OP_LOCKS, *args)
        return LockList([LeaseInfo.from_wire(d) for d in value["locks"]], value["matched"], value["truncated"],
                        value.get("next"))

    async def lock_info(self, name: str) -> LockInfo:
        """The holders and the ordered waiters of ``name`` (as kazoo's ``contenders()``).

        Raises PermissionDenied as :meth:`locks`; InvalidArgument for a bad name.
        """
        P.check_name(name)
        value = await self._request(P.OP_LOCK_INFO, name)
        return LockInfo(value["name"], [LeaseInfo.from_wire(d) for d in value["holders"]],
                        [WaiterInfo.from_wire(d) for d in value["waiters"]], value["waiter_count"])

    async def revoke(self, name: str, *, fencing_token: int | None = None,
                     reason: str | None = None) -> list[LeaseInfo]:
        """Force-release ``name``: the lease ``fencing_token``, or every lease of it (None).

        The server logs a REVOKE record with this client's principal and ``reason``
        (at most 256 characters) before it answers; the lock goes to its first waiter
        with a higher token, the old holder's next renewal raises
        :class:`~fastlock.errors.LeaseLost`, and watchers see a ``"revoked"`` event.
        Returns the leases revoked.

        Raises:
            LockNotHeld: no holder (with that token); nothing changed.
            PermissionDenied: as :meth:`locks`.
            Unavailable: a fenced primary refuses it (as a release).
        """
        P.check_name(name)
        if fencing_token is not None:
            P.check_token(fencing_token)
        P.check_optional_str(reason, "reason", MAX_REASON_CHARS)
        if fencing_token is not None:
            tokens = [fencing_token]
        else:
            # named by token even then: a request repeated after a lost reply (a failover)
            # must not revoke the lease granted next
            try:
                holders = (await self.lock_info(name)).holders
            except PermissionDenied as exc:  # say what was refused: the revocation, not its lookup
                _, _, who = str(exc).partition("; ")
                raise PermissionDenied("revoke needs an admin principal" + (f"; {who}" if who else "")) from None
            tokens = [h.fencing_token for h in holders]
            if not tokens:
                raise LockNotHeld(f"{name!r} has no holder")
        revoked = []
        for token in tokens:
            value = await self._request(P.OP_REVOKE, name, token, reason)
            revoked += [LeaseInfo.from_wire(d) for d in value["revoked"]]
        return revoked

    async def revoke_principal(self, principal: str, *, reason: str | None = None) -> PrincipalRevocation:
        """Force-release every lease ``principal`` holds now, in one request (the server
        revokes them a page per loop turn, each logged as :meth:`revoke` logs one).

        Its waiting acquires stay queued (they end with their connections).  Repeating
        the request after a lost reply also revokes what the principal acquired since.

        Raises:
            InvalidArgument: an empty or over-long principal name.
            PermissionDenied: as :meth:`locks`.
            Unavailable, NotPrimary: the node is fenced or stopped being the primary
                (part way: the leases already revoked stay revoked).
        """
        if type(principal) is not str:
            raise WrongArgumentType(f"principal must be a str, not {type(principal).__name__}")
        P.check_optional_str(reason, "reason", MAX_REASON_CHARS)
        value = await self._request(P.OP_REVOKE, None, None, reason, principal)
        return PrincipalRevocation(value["principal"], value["revoked"], value["waiting"])
