"""The longest-TTL rule: a primary acknowledges no lease whose TTL its standbys do not know.

A standby promoted after its primary went silent holds grants of free locks for the
longest TTL it has heard of (the default promotion grace, ``server/failover.py``): the
primary's heartbeats carry the longest TTL it has granted or extended to
(:class:`~fastlock.replication.messages.Heartbeat` ``max_ttl_ms``).  With asynchronous
replication a primary cut off from its standby keeps granting until it fences itself; a
lease longer than any the standby heard of, acknowledged in that window, would outlive
the promoted standby's grace: two holders at once.

So a reply that acknowledges a lease (a grant, or an extend to a longer TTL) whose TTL is
above :meth:`TtlBound.bound_ms` - the longest TTL every standby that could be promoted has
acknowledged knowing, by echoing a heartbeat that carried it - waits: the source sends a
heartbeat at once (:meth:`TtlBound.after` asks for it), and the reply goes out when the
standby's echo of it arrives (one round trip, paid only when a new longest TTL appears).
The reply fails with :class:`~fastlock.errors.Unavailable` (its lease stays in the table,
as a fenced primary's undelivered grants do) when the primary fences first, stops being
primary, or after :attr:`TtlBound.wait_ms` (a primary serving on its witness's lease while
its standby is gone: it grants no TTL longer than that standby knows).

Who counts: a pair's paired standby (whether attached or not: a cut-off standby is the one
that promotes), or the pair's witness when the standby asks it before promoting (the
witness keeps the longest TTL the primary reported with its lease renewal and hands it
to the node it votes in next: :mod:`fastlock.replication.witness`); in an etcd group
(coordinated) every attached standby heard from within :data:`GROUP_LIVE_MS` (one still
catching up, or stalled, does not hold grants up for longer than that while another is
heard; none heard: every attached one that has echoed).  No bound when nothing can promote on this
primary's silence (no paired failover window, serving alone, or a group primary with no
standby attached).  The whole argument: ``docs/failover-safety.md``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

from ..errors import FastlockError, Unavailable
from ..roles import Role
from ..units import monotonic_ms

if TYPE_CHECKING:  # pragma: no cover
    from .host import ReplicationHost

log = logging.getLogger("fastlock.replication")

#: replies that wait for a standby to confirm a TTL, at most (more fail with Unavailable at once)
MAX_WAITING = 10_000
#: the shortest wait for a confirmation before the reply fails (ms)
MIN_WAIT_MS = 1000
#: an etcd group's standby counts while its last acknowledgement is this recent (ms)
GROUP_LIVE_MS = 500
#: heartbeats whose TTL a standby has not confirmed yet, kept per standby at most (a longer
#: list merges its newest entries: the later send time only delays a confirmation)
MAX_UNCONFIRMED_HEARTBEATS = 64

Deliver = Callable[..., Any]


class SentTtl(NamedTuple):
    """A heartbeat that carried a longer TTL than the one before it (primary monotonic ms)."""

    sent_ms: int
    ttl_ms: int


class TtlCounted(NamedTuple):
    """Whose word bounds the TTLs a primary acknowledges: ``standbys`` (idents; each must
    know a TTL) or, when ``witness``, the witness alone."""

    standbys: list[str]
    witness: bool


class TtlWaiter(NamedTuple):
    """A reply held until the standbys know ``ttl_ms`` (``since_ms``: primary monotonic ms)."""

    ttl_ms: int
    deliver: Deliver
    since_ms: int


class TtlBound:
    """The primary's side of the rule (see the module docstring); one per
    :class:`~fastlock.replication.source.ReplicationSource`, its ``ttl``.

    Args:
        host: the server as replication sees it (its role and loop).
        bound_source: returns whose knowledge counts (:class:`TtlCounted`), or None when
            nothing can promote on this primary's silence (no bound).
        heartbeat_now: sends a heartbeat at once (it carries the primary's longest TTL).
    """

    def __init__(self, host: ReplicationHost, bound_source: Callable[[], TtlCounted | None],
                 heartbeat_now: Callable[[], None]):
        self.host = host
        self._counted = bound_source
        self._heartbeat_now = heartbeat_now
        #: by standby ident: the longest TTL (ms) it acknowledged knowing (an echoed heartbeat carried it)
        self.confirmed_ms: dict[str, int] = {}
        #: the longest TTL (ms) the witness recorded for this primary (its lease renewal carried it)
        self.witness_ms = 0
        #: the longest TTL (ms) a heartbeat has carried so far
        self.sent_ttl_ms = 0
        self.waiting: list[TtlWaiter] = []
        #: replies that waited for a confirmation, since start (a counter)
        self.waited = 0
        #: how long a reply waits for a confirmation before it fails (ms)
        self.wait_ms = MIN_WAIT_MS
        self._timer: asyncio.TimerHandle | None = None

    # -- the bound ------------------------------------------------------------------------
    def bound_ms(self) -> int | None:
        """The longest TTL (ms) a reply may acknowledge without waiting; None: no bound."""
        counted = self._counted()
        if counted is None:
            return None
        confirmed = self.confirmed_ms
        bound = min((confirmed.get(i, 0) for i in counted.standbys), default=0)
        return max(bound, self.witness_ms) if counted.witness else bound

    def covers(self, ttl_ms: int) -> bool:
        """May a reply acknowledge a lease of ``ttl_ms`` (ms) without waiting?"""
        bound = self.bound_ms()
        return bound is None or ttl_ms <= bound

    def heartbeat_sent(self, ttl_ms: int) -> None:
        """A heartbeat carrying ``ttl_ms`` (ms) went out."""
        if ttl_ms > self.sent_ttl_ms:
            self.sent_ttl_ms = ttl_ms

    def confirmed(self, ident: str, ttl_ms: int) -> None:
        """The standby ``ident`` echoed a heartbeat carrying ``ttl_ms`` (ms): release what it covers."""
        if ttl_ms > self.confirmed_ms.get(ident, 0):
            self.confirmed_ms[ident] = ttl_ms
        if self.waiting:
            self.recheck()

    def witness_confirmed(self, ttl_ms: int) -> None:
        """The witness recorded ``ttl_ms`` (ms) as this primary's longest TTL: release what it covers."""
        if ttl_ms > self.witness_ms:
            self.witness_ms = ttl_ms
            if self.waiting:
                self.recheck()

    # -- held replies -----------------------------------------------------------------------
    def after(self, deliver: Deliver, ttl_ms: int) -> Deliver:
        """``deliver`` wrapped to run once the standbys know ``ttl_ms`` (ms), the longest TTL
        the reply acknowledges; ``deliver(error)`` (:class:`~fastlock.errors.Unavailable`)
        when it must fail.  ``deliver`` itself when they know it already.  Call it right after
        the lease's TTL became the primary's longest; call what it returns when the reply is
        otherwise ready (durable, and with sync replication on the standby)."""
        if self.covers(ttl_ms):
            return deliver
        if ttl_ms > self.sent_ttl_ms:
            self._heartbeat_now()  # the round trip starts now, alongside the WAL write

        def held(refused: FastlockError | None = None) -> None:
            if refused is not None:
                deliver(refused)
            else:
                self._hold(ttl_ms, deliver)

        return held

    def _hold(self, ttl_ms: int, deliver: Deliver) -> None:
        if self.host.roles.role is not Role.PRIMARY or self.host.roles.fenced:
            deliver(self._refusal(ttl_ms, "this node is no longer an unfenced primary"))
        elif self.covers(ttl_ms):
            deliver()
        elif len(self.waiting) >= MAX_WAITING:
            deliver(Unavailable(f"{MAX_WAITING} replies already wait for the standby to confirm a TTL: "
                                f"not acknowledged; retry"))
        else:
            self.waited += 1
            if ttl_ms > self.sent_ttl_ms:
                self._heartbeat_now()
            self.waiting.append(TtlWaiter(ttl_ms, deliver, monotonic_ms()))
            if self._timer is None:
                self._timer = self.host.loop.call_later(self.wait_ms / 1000.0, self._on_timer)

    def recheck(self) -> None:
        """Release every held reply the bound now covers; fail them all when this node is no
        longer an unfenced primary (call it when the fence or the role changes)."""
        if not self.waiting:
            return
        roles = self.host.roles
        if roles.role is not Role.PRIMARY or roles.fenced:
            self.fail_all("this primary fenced itself, or stopped being primary,")
            return
        bound = self.bound_ms()
        keep = []
        for w in self.waiting:
            if bound is None or w.ttl_ms <= bound:
                w.deliver()
            else:
                keep.append(w)
        self.waiting = keep
        self._after_change()

    def fail_all(self, why: str) -> None:
        """Fail every held reply (``why``: what happened, for the error message)."""
        waiting, self.waiting = self.waiting, []
        for w in waiting:
            w.deliver(self._refusal(w.ttl_ms, why))
        if waiting:
            log.warning("%d replies with a TTL the standby had not confirmed were not acknowledged: %s",
                        len(waiting), why)
        self._after_change()

    def _on_timer(self) -> None:
        self._timer = None
        self.recheck()  # a group's stalled standby may have stopped counting meanwhile
        now = monotonic_ms()
        late = [w for w in self.waiting if now - w.since_ms >= self.wait_ms]
        if late:
            self.waiting = [w for w in self.waiting if now - w.since_ms < self.wait_ms]
            for w in late:
                w.deliver(self._refusal(w.ttl_ms, f"no standby confirmation within {self.wait_ms} ms:"))
            log.warning("%d replies with a TTL the standby had not confirmed within %d ms were not acknowledged",
                        len(late), self.wait_ms)
        self._after_change()

    def _after_change(self) -> None:
        if not self.waiting:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
        elif self._timer is None:
            due = min(w.since_ms for w in self.waiting) + self.wait_ms - monotonic_ms()
            self._timer = self.host.loop.call_later(max(0, due) / 1000.0, self._on_timer)

    @staticmethod
    def _refusal(ttl_ms: int, why: str) -> Unavailable:
        return Unavailable(f"{why} before the standby confirmed it knows a TTL of {ttl_ms} ms (the promotion "
                           f"grace it would keep): not acknowledged; retry")

    def status(self) -> dict:
        """``{"bound_ms": int | None, "witness_ms": int, "waiting": int, "waited": int}`` (ms; counters)."""
        return {"bound_ms": self.bound_ms(), "witness_ms": self.witness_ms, "waiting": len(self.waiting),
                "waited": self.waited}

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
