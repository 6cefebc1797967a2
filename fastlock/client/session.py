"""The client's session: one keep-alive per renewal interval for every lease it renews.

A :class:`SessionKeeper` belongs to one :class:`~fastlock.client.Client` and holds
the auto-renewals (:class:`~fastlock.client.renewer.Renewer`) of every lease the
client keeps alive - ``lock()``, ``lock_many()``, semaphores, election terms, and so
the keys attached to those leases.  Instead of one EXTEND per lease it sends, per
round:

1. ``SESSION_OPEN`` with the session key, when the session is not open on the node
   it talks to (first use, after a failover or a server restart: the same key gives
   the same session id everywhere);
2. one ``SESSION_KEEPALIVE``, which renews every attached lease for its own TTL;
3. ``SESSION_ATTACH`` pages (pipelined) naming the leases not yet attached there (each
   proved by its own owner key, and renewed by being attached) and those released
   since the last round.

A round runs every renewal interval: the shortest interval any of its renewers wants
(about a third of the shortest TTL, minus 10-20 % jitter), sooner when a lease is added
that needs it.  The reply names the leases the server no longer holds for the client
(released elsewhere, revoked, expired): those are lost at once.  Every other lease
attached before the keep-alive was sent is renewed from the *sending* time (the
deadline each renewer keeps is conservative, as a single EXTEND's is).  A reply whose
renewed and lost leases number fewer than the leases attached (the server's session is
not the one they were attached to) renews none of them: the keeper opens the session
again at once and attaches every lease (each renewed by being attached).  Each request
of a round rides through a failover as a lease's own renewal does (an attempt bounded
by a third of the shortest renewal window, the request by one window); a lease whose
deadline passes first is marked lost by its own deadline timer, exactly as with
per-lease renewal.

A lease that carries a signed sequencer (``connect(sequencers=True)``) is attached with
the ``sequencer`` flag: each attach and keep-alive reply brings its sequencer re-signed
with the renewed expiry, and ``lease.sequencer`` is replaced at once.  At most
:data:`MAX_SEQUENCED` such leases are kept alive by the session (the server's bound on
what one keep-alive signs); the others renew themselves with EXTENDs that ask for the
same re-signing.

A server without session ops (an older fastlock) answers the first ``SESSION_OPEN``
with a protocol error (a replica principal: PermissionDenied): the keeper then hands
every renewer its own EXTEND loop.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .. import protocol as P
from ..errors import (
    ConnectionLost,
    FastlockError,
    InvalidArgument,
    LeaseLost,
    LimitExceeded,
    PermissionDenied,
    ProtocolError,
    WrongArgumentType,
)
from .calls import call
from .connection import BACKOFF_MAX, RideThrough
from .owner_keys import new_owner_key

if TYPE_CHECKING:  # pragma: no cover
    from .client import Client
    from .renewer import Renewer

log = logging.getLogger(__name__)

__all__ = ["SessionKeeper", "SessionInfo", "SessionClosed", "SessionAdminMethods", "ATTACH_PAGE",
           "DEFAULT_SESSION_TTL"]

#: leases per SESSION_ATTACH request (the server's fastlock.server.sessions.MAX_ATTACH_PER_REQUEST)
ATTACH_PAGE = 60
#: SESSION_ATTACH requests in flight at once
ATTACH_IN_FLIGHT = 8
#: the session's own TTL (seconds): how long the server keeps it with no lease attached
DEFAULT_SESSION_TTL = 10.0
#: keep-alives sent again in one round while the server says it listed only part of the lost leases
MAX_MORE_ROUNDS = 64
#: seconds a client's close waits for SESSION_CLOSE's answer at most
SESSION_CLOSE_TIMEOUT = 1.0


#: leases with a signed sequencer one session renews (the server's
#: fastlock.server.sessions.MAX_SEQUENCED_PER_SESSION); the others send their own EXTENDs
MAX_SEQUENCED = 256


def _sequenced(renewer: Renewer) -> bool:
    """Does ``renewer``'s lease carry a signed sequencer (re-signed at each renewal)?"""
    return renewer.lease.state.sequencer is not None


def _resigned(reply: dict[str, Any]) -> dict[tuple[str, int], bytes]:
    """The re-signed sequencers a SESSION_ATTACH or SESSION_KEEPALIVE reply carries: (name, token) -> bytes."""
    out: dict[tuple[str, int], bytes] = {}
    for item in reply.get("sequencers", ()):
        if type(item) is list and len(item) == 3 and type(item[2]) is bytes:
            out[(item[0], item[1])] = item[2]
    return out


def _lost(reply: dict[str, Any]) -> dict[tuple[str, int], str]:
    """The lost leases a SESSION_ATTACH or SESSION_KEEPALIVE reply names: (name, token) -> why."""
    return {(item[0], item[1]): str(item[2]) if len(item) > 2 else "not held" for item in reply["lost"]}


class SessionKeeper:
    """One client's session (module docstring).

    ``id``: the session id the server gave (None until opened); ``keepalives``: the
    SESSION_KEEPALIVE requests sent; ``supported``: False once a server refused the ops.
    """

    def __init__(self, client: Client, ttl: float = DEFAULT_SESSION_TTL):
        self.client = client
        self.ttl = ttl
        self.key = new_owner_key()
        self.id: str | None = None
        self.keepalives = 0
        self.supported: bool | None = None
        self._renewers: dict[int, Renewer] = {}  # by id(renewer)
        self._attached: set[int] = set()  # renewers attached on the node the session is open on
        self._detach: list[list[Any]] = []  # [name, token] released since the last round
        self._open = False
        self._task: asyncio.Task[None] | None = None
        self._wake: asyncio.Event | None = None
        self._next_at = 0.0  # loop.time() of the next round
        self._window = ttl  # the shortest renewal window (seconds) of the leases, as of the last round
        self._closed = False
        self._sequenced: set[int] = set()  # renewers whose leases carry sequencers (at most MAX_SEQUENCED)

    def __len__(self) -> int:
        return len(self._renewers)

    def add(self, renewer: Renewer) -> bool:
        """Keep ``renewer``'s lease alive from now on; False if sessions are not
        available (closed keeper, a server without them): the renewer runs its own loop."""
        if self._closed or self.supported is False:
            return False
        if _sequenced(renewer):
            if len(self._sequenced) >= MAX_SEQUENCED:
                return False
            self._sequenced.add(id(renewer))
        self._renewers[id(renewer)] = renewer
        if self._task is None or self._task.done():
            self._wake = asyncio.Event()
            self._task = asyncio.ensure_future(self._run())
        elif self._wake is not None and asyncio.get_running_loop().time() + renewer.session_interval() < self._next_at:
            self._wake.set()  # this lease needs the next round sooner
        return True

    def discard(self, renewer: Renewer) -> None:
        """Stop keeping ``renewer``'s lease alive (released, lost or stopped)."""
        key = id(renewer)
        if self._renewers.pop(key, None) is None:
            return
        self._sequenced.discard(key)
        if key in self._attached:
            self._attached.discard(key)
            lease = renewer.lease
            self._detach.append([lease.name, lease.fencing_token])

    def close(self) -> None:
        """Stop the keeper (the server ends the session by its TTL)."""
        self._closed = True
        if self._task is not None and self._task is not asyncio.current_task():
            self._task.cancel()

    async def end(self, timeout: float = SESSION_CLOSE_TIMEOUT) -> None:
        """Stop the keeper and end the session on the server (``SESSION_CLOSE``), best
        effort: at most ``timeout`` seconds, any error ignored (the server then ends it by
        its TTL).  Its leases stay held until released or expired by their own TTLs."""
        ended, self._closed = self._closed, True
        self.close()
        if ended or self.id is None or self.supported is False:
            return  # ended already, or never opened: nothing to end
        try:
            await asyncio.wait_for(call(self.client.connector, P.OP_SESSION_CLOSE, (self.key,), timeout), timeout)
        except (FastlockError, asyncio.TimeoutError, OSError) as exc:
            log.debug("session %s not closed on the server (it ends by its TTL): %s", self.id, exc)

    # -- the rounds --------------------------------------------------------------------------
    def _interval(self) -> float:
        renewers = list(self._renewers.values())
        if not renewers:
            return self.ttl / 3.0
        return min(r.session_interval() for r in renewers)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        started = loop.time()  # rounds are paced from the start of the one before (not its end)
        try:
            while self._renewers and not self._closed:
                wake = self._wake
                assert wake is not None
                wake.clear()
                while True:  # a renewer added meanwhile may need a sooner round
                    self._next_at = started + self._interval()
                    left = self._next_at - loop.time()
                    if left <= 0:
                        break
                    try:
                        await asyncio.wait_for(wake.wait(), left)
                    except asyncio.TimeoutError:
                        break
                    wake.clear()
                if not self._renewers:
                    break
                started = loop.time()
                try:
                    await self._round(loop)
                except ConnectionLost as exc:
                    if self.client.connector.closed:
                        return
                    log.info("session keep-alive found no primary in time: %s", exc)
                except (ProtocolError, PermissionDenied) as exc:
                    if self.supported is None:
                        log.info("the server has no sessions (%s): each lease renews itself", exc)
                        self._fall_back()
                        return
                    raise
                except LimitExceeded as exc:  # a session limit of the server: expected, not a fault
                    log.warning("the server refused this client a session (%s): each lease renews itself", exc)
                    self._fall_back()
                    return
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("session keep-alive failed unexpectedly; each lease renews itself")
            self._fall_back()

    def _fall_back(self) -> None:
        self.supported = False
        renewers = list(self._renewers.values())
        self._renewers.clear()
        self._attached.clear()
        self._sequenced.clear()
        for renewer in renewers:
            renewer.run_alone()

    async def _send(self, op: int, args: tuple[Any, ...]) -> Any:
        # each request has one renewal window (from its own start) to find a primary
        deadline = asyncio.get_running_loop().time() + self._window
        pacing = RideThrough(self.client.connector, deadline, max_backoff=min(BACKOFF_MAX, self._window / 10.0))
        return await pacing.send(op, args, attempt_timeout=self._window / 3.0)

    async def _round(self, loop: asyncio.AbstractEventLoop) -> None:
        renewers = self._renewers
        # as a lease's own renewal: each attempt bounded by a third of the (shortest) renewal
        # window, each request by one window; a lease whose deadline passes first is lost by its
        # own timer, the round goes on for the others
        self._window = min(r.window for r in renewers.values())
        for attempt in range(2):
            reopened = not self._open
            if reopened:
                opened = await self._send(P.OP_SESSION_OPEN, (self.key, P.seconds_to_ms(self.ttl, "ttl")))
                self.supported = True
                self.id = opened["id"]
                self._open = True
                self._attached.clear()  # attach every lease again there (proved by its owner key)
                self._detach.clear()
            try:
                # the leases attached already are renewed first; the new ones (granted
                # since the last round, with their full TTL) are attached after it
                if self._attached:
                    await self._keepalive(loop)
                await self._attach_pending(loop)  # attaching renews each lease it attaches
                return
            except LeaseLost as exc:  # no such session there: a failover, a restart, an operator
                if attempt:
                    raise ConnectionLost(f"the session could not be opened again: {exc}") from exc
                log.info("session %s not found on the primary (%s): opening it again", self.id, exc)
                self._open = False

    async def _attach_pending(self, loop: asyncio.AbstractEventLoop) -> None:
        pending = [r for key, r in self._renewers.items() if key not in self._attached]
        pages = []
        while pending or self._detach:
            # the detached first: the server counts the leases it re-signs for (MAX_SEQUENCED)
            detach, self._detach = self._detach[:ATTACH_PAGE], self._detach[ATTACH_PAGE:]
            room = ATTACH_PAGE - len(detach)
            page, pending = pending[:room], pending[room:]
            pages.append((page, detach))
        for first in range(0, len(pages), ATTACH_IN_FLIGHT):  # pipelined, a few pages at a time
            await asyncio.gather(*(self._attach_page(loop, page, detach)
                                   for page, detach in pages[first:first + ATTACH_IN_FLIGHT]))

    async def _attach_page(self, loop: asyncio.AbstractEventLoop, page: list[Renewer],
                           detach: list[list[Any]]) -> None:
        leases = [[r.lease.name, r.lease.fencing_token, r.lease.owner, True] if _sequenced(r)
                  else [r.lease.name, r.lease.fencing_token, r.lease.owner] for r in page]
        sent = loop.time()
        reply = await self._send(P.OP_SESSION_ATTACH, (self.key, leases, detach))
        self._take_sequencers(reply)
        lost = _lost(reply)
        for r in page:
            if id(r) not in self._renewers:
                continue
            why = lost.get((r.lease.name, r.lease.fencing_token))
            if why is not None:
                self._renewers.pop(id(r), None)
                self._sequenced.discard(id(r))
                r.lose_by_session(f"attaching it to the session: {why}")
            else:
                self._attached.add(id(r))
                r.renewed_by_session(sent)

    async def _keepalive(self, loop: asyncio.AbstractEventLoop) -> None:
        for _ in range(MAX_MORE_ROUNDS):
            attached = [r for key, r in self._renewers.items() if key in self._attached]
            sent = loop.time()
            self.keepalives += 1
            reply = await self._send(P.OP_SESSION_KEEPALIVE, (self.key,))
            self._take_sequencers(reply)
            lost = _lost(reply)
            if lost:
                for r in list(self._renewers.values()):
                    why = lost.get((r.lease.name, r.lease.fencing_token))
                    if why is not None:
                        self._renewers.pop(id(r), None)
                        self._sequenced.discard(id(r))
                        self._attached.discard(id(r))
                        r.lose_by_session(f"session keep-alive: {why}")
            if reply["more"]:
                continue  # renewed only part: every one is renewed by the next keep-alive
            if reply["renewed"] + len(lost) < len(attached):
                # the server's session names fewer leases than were attached to it: it is not the
                # session they were attached to (a stale one); which were renewed is unknown
                raise LeaseLost(f"the session on the primary knows {reply['renewed'] + len(lost)} of the "
                                f"{len(attached)} leases attached to it: open it again")
            for r in attached:
                if id(r) in self._renewers:
                    r.renewed_by_session(sent)
            return
        raise FastlockError("the session keep-alive kept naming lost leases")

    def _take_sequencers(self, reply: dict[str, Any]) -> None:
        """Give each lease the sequencer ``reply`` brings re-signed for it (its renewed expiry)."""
        resigned = _resigned(reply)
        if not resigned:
            return
        for key in self._sequenced:
            r = self._renewers.get(key)
            if r is not None:
                blob = resigned.get((r.lease.name, r.lease.fencing_token))
                if blob is not None:
                    r.lease.state.sequencer = blob


@dataclass(frozen=True)
class SessionInfo:
    """One client session as ``fastlock sessions`` lists it: ``id``, the ``principal``
    (authenticated), the ``client`` name it declared (not verified), its ``address``,
    the number of ``leases`` attached, and seconds: ``last_heard`` (since the last
    request on it), ``ttl`` (the session's own), ``ttl_left`` (until the server ends it
    unless heard from), ``age``."""

    id: str
    principal: str
    client: str | None
    address: str
    leases: int
    last_heard: float
    ttl: float
    ttl_left: float
    age: float

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> SessionInfo:
        return cls(d["id"], d["principal"], d.get("client"), d.get("address") or "?", d["leases"],
                   d["last_heard_ms"] / 1000.0, d["ttl_ms"] / 1000.0, d["ttl_left_ms"] / 1000.0,
                   d["age_ms"] / 1000.0)


@dataclass(frozen=True)
class SessionClosed:
    """What :meth:`SessionAdminMethods.close_session` did: session ``id`` of
    ``principal`` is closed and ``revoked`` of its leases were revoked."""

    id: str
    principal: str
    revoked: int


class SessionAdminMethods:
    """The operator's session requests (server side: :mod:`fastlock.server.sessions`; an
    admin principal, or anyone in open mode, else :class:`~fastlock.errors.PermissionDenied`)."""

    async def _request(self, op: int, *args: Any) -> Any:  # pragma: no cover - Client's
        raise NotImplementedError

    async def sessions(self, principal: str | None = None) -> list[SessionInfo]:
        """The open client sessions (of ``principal``; None: of everyone), most recently
        heard first, at most 1,000 (:data:`fastlock.server.sessions.MAX_SESSIONS_LISTED`)."""
        if principal is not None and type(principal) is not str:
            raise WrongArgumentType("principal must be a str or None")
        reply = await self._request(P.OP_SESSIONS, principal)
        return [SessionInfo.from_wire(row) for row in reply["sessions"]]

    async def close_session(self, session_id: str, *, reason: str | None = None) -> SessionClosed:
        """Close session ``session_id`` and revoke every lease attached to it at once (each
        next grant gets a higher fencing token; REVOKE records name who and why).

        Raises:
            LockNotHeld: no such session on the primary.
            PermissionDenied: not an admin (outside open mode).
        """
        if type(session_id) is not str or not session_id:
            raise WrongArgumentType("a session id is a non-empty str")
        if reason is not None and (type(reason) is not str or len(reason) > 256):
            raise InvalidArgument("reason must be a str of at most 256 characters")
        reply = await self._request(P.OP_SESSION_REVOKE, session_id, reason)
        return SessionClosed(reply["id"], reply["principal"], reply["revoked"])
