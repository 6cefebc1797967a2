"""Synchronous replication in an etcd group: the primary waits for its in-sync set.

A node run with ``--coordinator`` and ``--replication sync`` acknowledges a
grant or an extend (the replies :mod:`fastlock.replication.syncrep` holds) once

(a) its own log has it (``--fsync``, as always),
(b) every standby of its *required set* has acknowledged it at the ack point
    (``--sync-ack``), and
(c) at least ``--sync-standbys`` (k, default 1) standbys have acknowledged it,
    counting only standbys a live member key of the group names, unless the
    primary has *degraded* (``--sync-on-timeout degrade``).

The in-sync set
---------------
The *published set* is ``PREFIX/sync`` in etcd (:mod:`fastlock.coordination.insync`):
the standbys (by data directory identity) that have every reply this primary
acknowledged.  At most k standbys are in it.  The primary changes it by one rule:

* **joining**: a standby whose acknowledged LSN covers everything the primary has
  released (and everything logged before it became the primary), and whose data
  directory identity a live member key of the group names (a standby that no
  election can promote, such as a plain ``--standby-of`` node, is no copy a
  promotion can rely on), joins the required set at once, in the same loop step as that check; only then is the
  set with it written to etcd.  A primary in its promotion grace adds nobody (its
  own table may lack grants a client holds).
* **leaving**: a member that is detached, or has not acknowledged the oldest
  waiting reply within ``--sync-timeout``, is written out of the set in etcd
  first; only once etcd confirmed the write does the primary stop waiting for it.
  A write whose outcome is unknown (etcd did not answer) changes nothing here:
  the primary keeps waiting for the member, and the next heartbeat retries.
  A member that left joins again once it has caught up.

Replies that wait longer than ``--sync-timeout``: with ``fence`` (strict)
they fail with ``Unavailable`` (retryable: the same owner key finds its lease);
with ``degrade`` (the default) the primary stops asking for (c), loudly (CRITICAL log,
``sync.degradations``, ``fastlock_sync_degradations_total``, ``sync.state =
"degraded"``), until k standbys have everything again; (b) always holds, so a
reply still waits for a member until etcd confirmed that member's removal (at
most twice ``--sync-timeout``, then it fails with ``Unavailable``).

Promotion without a grace period, and why it is safe
---------------------------------------------------
A node that takes the primary key at epoch E+1 skips the promotion grace only
when the ``PREFIX/sync`` its winning bid compared (same transaction) names the
primary it was following, at epoch E, with E the epoch in ``PREFIX/epoch`` at
the bid, and lists this node's identity; the node has synced with that
primary (its replicated epoch is E); and that primary's last ``"sync"`` push to
it, over the authenticated replication link, said it is a member (the primary
says so only to a standby in both its required and its published set, so a
record forged in etcd alone makes no node skip the grace, unless the node was a
member and missed the push that told it it left).  Claim: such a node has every grant and
extend any client was told of that may still be live.

1. *Invariant*: every identity in the published set at epoch E is in the old
   primary's required set, and has acknowledged every LSN that primary released
   since it joined.  Joining puts it in the required set before the write, with
   everything released by then already acknowledged; (b) makes every later
   release wait for it; leaving drops it from the required set only after etcd
   confirmed the set without it (and a join after that checks again).
2. *The record cannot change after the bid*: the bid compares the record's
   revision, and the primary writes it only under a compare that the primary key
   is under its own lease; once the key is the new node's, the old primary's writes
   fail.  So the record the new node judges is the set at the end of epoch E.
3. *Everything before the old primary's own promotion*: joining requires the
   acknowledged LSN to reach what was logged when it became primary, and no join
   happens during its grace; after its grace every lease an earlier primary
   granted without it has run out (the grace is the longest TTL).
4. An acknowledged LSN is applied to the standby's table and written (``written``)
   or fsynced (``fsynced``) to its own WAL before it is acknowledged, so the node
   has it at its promotion (with ``written``: unless its machine lost power too).
   Its lease deadlines are the replicated ones (:mod:`fastlock.replication`), and
   the epoch rises, so tokens stay above every token of epoch E.

Any other promotion (a node not in the record, a record of another epoch or
primary, an asynchronous group) keeps the grace period, exactly as before.
Releases, expiries and key writes are not waited for (a release the new primary
lacks keeps the lock held there until its lease's deadline: never two holders).
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, NamedTuple

from .. import protocol as P
from ..errors import FastlockError, ProtocolError, Unavailable
from ..logsafe import RateLimitedLog
from ..roles import Role
from ..units import monotonic_ms
from ._wire import SyncWire
from .messages import standby_identity
from .syncrep import MAX_WAITING, ReplicationMode, SyncOnTimeout, SyncSettings

if TYPE_CHECKING:  # pragma: no cover
    from .host import ReplicaConnection, ReplicationHost
    from .source import ReplicationSource

__all__ = ["GroupSyncGate", "HeldReply", "StandbyAck"]

log = logging.getLogger("fastlock.replication")

#: a set etcd did not confirm is logged at most every 10 s (etcd may be down for long)
_UNCONFIRMED = RateLimitedLog(log, logging.WARNING, 10.0)
#: standbys whose acknowledgements are kept (beyond: those gone and not members are forgotten)
MAX_ACKED = 64
#: writes the in-sync set to etcd (True: confirmed); raises when etcd does not answer
Publisher = Callable[[frozenset[str]], Awaitable[bool]]


class HeldReply(NamedTuple):
    """A reply waiting for the in-sync set: the LSN it needs, how to send it, since when (ms)."""

    lsn: int
    deliver: Callable[..., Any]
    since_ms: int


class StandbyAck(NamedTuple):
    """The last ``SYNC_ACK`` of one standby: its connection's session and the primary LSN."""

    session: int
    lsn: int


def _call(deliver: Callable[..., Any], *error: FastlockError) -> None:
    try:
        deliver(*error)
    except Exception:
        log.exception("delivering a reply held for the in-sync set failed")


class GroupSyncGate(SyncWire):
    """The primary's side of synchronous replication in an etcd group (module docstring).

    Offers what :class:`~fastlock.replication.syncrep.SyncGate` offers to the server
    (``after``, ``on_ack``, ``handlers``, ``status_push``, ``status``, ``close``);
    ``enabled`` is a slot of its compiled base (:class:`~fastlock.replication._wire.SyncWire`).

    Args:
        host: the server.
        source: the replication source (its attached standbys).
        settings: ack point, timeout (ms) and policy.
        sync_standbys: k, the standbys that must have a reply (>= 1).

    Attributes:
        publisher: writes ``PREFIX/sync`` (set by the coordinated node; None: no set is
            published, nobody joins).
        member_idents: returns the data directory identities of the group's live member
            keys as last read in etcd (set by the coordinated node); only a standby one of
            them names may join the set.  None: any attached standby may join.

    Raises:
        ValueError: ``sync_standbys`` is not a positive int.
    """

    def __init__(self, host: ReplicationHost, source: ReplicationSource, settings: SyncSettings,
                 sync_standbys: int = 1):
        if type(sync_standbys) is not int or sync_standbys < 1:
            raise ValueError(f"sync_standbys must be a positive integer, not {sync_standbys!r}")
        self.host = host
        self.source = source
        self.settings = settings
        self.sync_standbys = sync_standbys
        self.enabled = True
        self.publisher: Publisher | None = None
        self.member_idents: Callable[[], set[str]] | None = None
        self.acked: dict[str, StandbyAck] = {}  # by standby identity
        self.required: set[str] = set()  # every release waits for each of these
        self.published: frozenset[str] = frozenset()  # the set etcd confirmed
        self.released_lsn = 0
        self._floor: int | None = None  # logged LSN when this node became the primary
        self.waiting: deque[HeldReply] = deque()
        self.degraded = False
        self.degradations = 0
        self.refusals = 0
        self.acks_rejected = 0  # SYNC_ACKs of an LSN their connection never carried
        self._timer: asyncio.TimerHandle | None = None
        self._publishing: asyncio.Future | None = None
        self._again = False
        self._epoch = -1  # the table's epoch of the term the state above belongs to

    # -- what the server calls ------------------------------------------------------------------
    def after(self, deliver: Callable[..., Any]) -> Callable[[], None]:
        """``deliver`` wrapped to run once the rules (a)-(c) hold for every record logged so
        far; ``deliver(error)`` with :class:`~fastlock.errors.Unavailable` when it must fail."""
        lsn = self.host.wal.logged_lsn
        return lambda: self._hold(lsn, deliver)

    def _term(self) -> bool:
        """Is this node the primary?  A new term (another epoch: a promotion, or a rejoin and
        a promotion again) starts from nothing: acknowledgements name LSNs of the old term."""
        if self.host.roles.role is not Role.PRIMARY:
            return False
        epoch = self.host.table.epoch
        if epoch != self._epoch:
            self._epoch = epoch
            self.acked.clear()
            self.required.clear()
            self.published = frozenset()
            self.released_lsn = 0
            self._floor = self.host.wal.logged_lsn  # everything before may have been acknowledged
            self.degraded = False
        return True

    def _hold(self, lsn: int, deliver: Callable[..., Any]) -> None:
        if not self._term():
            _call(deliver)  # refused there: this node does not grant
            return
        if not self.waiting and self._covered(lsn):
            self._release(lsn, deliver)
        elif len(self.waiting) >= MAX_WAITING:
            _call(deliver, Unavailable(f"{MAX_WAITING} batches of replies already wait for the in-sync "
                                       f"standbys: not acknowledged; retry"))
        else:
            now = monotonic_ms()
            self.waiting.append(HeldReply(lsn, deliver, now))
            if self._timer is None:
                self._arm(now + self.settings.timeout_ms)

    def _acked(self, ident: str) -> int:
        entry = self.acked.get(ident)
        return entry.lsn if entry is not None else 0

    def _copies(self, lsn: int) -> int:
        """The standbys a promotion may elect that acknowledged ``lsn``."""
        electable = self._electable()
        return sum(1 for ident, entry in self.acked.items() if entry.lsn >= lsn and electable(ident))

    def _covered(self, lsn: int) -> bool:
        """Rules (b) and (c) for ``lsn``."""
        if any(self._acked(m) < lsn for m in self.required):
            return False
        return self.degraded or self._copies(lsn) >= self.sync_standbys

    def _release(self, lsn: int, deliver: Callable[..., Any]) -> None:
        if lsn > self.released_lsn:
            self.released_lsn = lsn
        _call(deliver)

    def _release_covered(self) -> None:
        waiting = self.waiting
        while waiting and self._covered(waiting[0].lsn):
            held = waiting.popleft()
            self._release(held.lsn, held.deliver)

    def on_contact(self, echoed_ms: int) -> None:
        """A standby echoed a heartbeat sent at ``echoed_ms`` (the primary's monotonic ms).
        Nothing waits on it here: a group's degrade stops asking only for (c), and a member
        leaves the set in etcd before the primary stops waiting for it, so no standby that
        may be promoted without grace lacks an acknowledged reply (the pair's
        :meth:`SyncGate.on_contact <fastlock.replication.syncrep.SyncGate.on_contact>` waits
        for its one standby to hear a degrade instead)."""

    def on_ack(self, conn: ReplicaConnection, lsn: Any) -> None:
        """A standby's ``SYNC_ACK``: it has every record up to ``lsn`` at the ack point.

        Counted only when its connection carried ``lsn``
        (:meth:`ReplicationSource.admit_sync_ack <fastlock.replication.source.ReplicationSource.admit_sync_ack>`),
        and only forward on one connection; another ack is ignored (``acks_rejected``).

        Raises:
            ProtocolError: not an attached standby, or ``lsn`` not an int in ``0..`` the
                last LSN logged (the connection is dropped).
        """
        replica = self.source.replicas.get(conn.session)
        if replica is None:
            raise ProtocolError("SYNC_ACK before REPLICATE")
        if not self._term():
            return
        last = self.host.wal.logged_lsn
        if type(lsn) is not int or not 0 <= lsn <= last:
            raise ProtocolError(f"SYNC_ACK takes an LSN in 0..{last}, not {lsn!r}")
        if not self.source.admit_sync_ack(conn, lsn):
            self.acks_rejected += 1  # an LSN its connection never carried counts nothing (logged there)
            return
        ident = standby_identity(replica.name)
        entry = self.acked.get(ident)
        if entry is None or entry.session != conn.session or lsn > entry.lsn:
            # a new connection has only what it says; an old one only moves forward
            self.acked[ident] = StandbyAck(conn.session, lsn)
            if len(self.acked) > MAX_ACKED:  # forget standbys gone that are not members
                attached = self._attached()
                for gone in [i for i in self.acked if i not in attached and i not in self.required]:
                    del self.acked[gone]
        self._release_covered()
        if self.degraded and self._copies(self._must_have()) >= self.sync_standbys:
            self.degraded = False
            log.warning("%d standbys have every acknowledged record (LSN %d): replication is synchronous again",
                        self.sync_standbys, self._must_have())
        self.reconcile()

    # -- the in-sync set ------------------------------------------------------------------------
    def _must_have(self) -> int:
        """The LSN a standby must have acknowledged to join the set."""
        if self._floor is None:
            return 1 << 62  # not a primary yet: nobody joins
        return max(self._floor, self.released_lsn)

    def _attached(self) -> set[str]:
        return {standby_identity(r.name) for r in self.source.replicas.values() if not r.conn.closed}

    def _behind(self, ident: str, attached: set[str], now: int) -> bool:
        if ident not in attached:
            return True
        oldest = self.waiting[0] if self.waiting else None
        return (oldest is not None and now - oldest.since_ms >= self.settings.timeout_ms
                and self._acked(ident) < oldest.lsn)

    def _electable(self) -> Callable[[str], bool]:
        """Whether a standby identity (``replica principal/node id``) names a live member of
        the group (see :attr:`member_idents`): the whole identity when the member key names
        its replica principal (another replica credential cannot speak for that node), the
        node id alone when it names none."""
        if self.member_idents is None:
            return lambda ident: True
        live = self.member_idents()
        return lambda ident: ident in live or ident.rpartition("/")[2] in live

    def reconcile(self) -> None:
        """Compute the set (members that fell behind leave, caught-up standbys join up to k)
        and write it to etcd if it changed; one write at a time."""
        if self.publisher is None or not self._term():
            return
        if self._publishing is not None:
            self._again = True
            return
        now = monotonic_ms()
        attached = self._attached()
        keep = {m for m in self.required if not self._behind(m, attached, now)}
        if self.host.roles.grace_remaining_ms(now) == 0:
            must = self._must_have()
            electable = self._electable()
            # a standby behind the oldest held reply (as a member would leave) does not join: a member
            # that just left has every released reply, and would otherwise be back at once
            fits = sorted((i for i in attached - keep
                           if i in self.acked and self._acked(i) >= must and electable(i)
                           and not self._behind(i, attached, now)),
                          key=self._acked, reverse=True)
            joining = set(fits[:max(0, self.sync_standbys - len(keep))])
        else:
            joining = set()
        target = frozenset(keep | joining)
        if target == self.published and self.required == set(target):
            return
        self.required |= joining  # before the write: every later release waits for them
        self._publishing = asyncio.ensure_future(self._publish(target))

    async def _publish(self, target: frozenset[str]) -> None:
        publisher = self.publisher
        try:
            ok = publisher is not None and await publisher(target)
        except Exception as exc:  # noqa: BLE001 - etcd did not answer: unknown outcome, keep waiting
            _UNCONFIRMED("in-sync set %s not confirmed by etcd (%s): still waiting for its old members",
                         sorted(target), exc)
            ok = False
        finally:
            self._publishing = None
        if ok:
            left = self.required - target
            if left:
                log.warning("standbys %s left the in-sync set (behind or detached)", sorted(left))
            self.published = target
            self.required = set(target)
            self.status_push()  # the standbys hear whether they are members
            self._release_covered()
        if self._again:
            self._again = False
            if ok:
                self.reconcile()

    # -- timing out ---------------------------------------------------------------------------
    def _arm(self, at_ms: int) -> None:
        self._timer = self.host.loop.call_later(max(0, at_ms - monotonic_ms()) / 1000.0, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        if not self.waiting:
            return
        now = monotonic_ms()
        timeout = self.settings.timeout_ms
        oldest = self.waiting[0]
        if now < oldest.since_ms + timeout:
            self._arm(oldest.since_ms + timeout)
            return
        self.reconcile()  # members behind the oldest reply leave (once etcd confirms)
        degrade = self.settings.on_timeout is SyncOnTimeout.DEGRADE
        if degrade and not self.degraded and self._copies(oldest.lsn) < self.sync_standbys:
            self.degraded = True
            self.degradations += 1
            log.critical("synchronous replication DEGRADED: fewer than %d standbys acknowledged LSN %d within "
                         "--sync-timeout %d ms; acknowledging with the in-sync set %s only until they catch up "
                         "(--sync-on-timeout degrade)", self.sync_standbys, oldest.lsn, timeout,
                         sorted(self.required))
            self._release_covered()
        error = Unavailable(f"synchronous replication timed out (--sync-timeout {timeout} ms, "
                            f"--sync-standbys {self.sync_standbys}): not acknowledged, nothing lost; retry "
                            f"(the same owner key finds its lease)")
        while self.waiting:
            # fence: a reply fewer than k standbys have fails at the timeout; one that waits only
            # for a member whose removal etcd has not confirmed yet gets a second timeout
            waited, lsn = now - self.waiting[0].since_ms, self.waiting[0].lsn
            if waited < 2 * timeout and (degrade or waited < timeout or self._copies(lsn) >= self.sync_standbys):
                break
            self.refusals += 1
            _call(self.waiting.popleft().deliver, error)
        self._release_covered()  # those behind a failed one may be covered
        if self.waiting:
            self._arm(min(self.waiting[0].since_ms + timeout, now + timeout))

    # -- what the standbys and STATUS see -------------------------------------------------------
    def status_push(self) -> None:
        """Send each standby its ``"sync"`` push (every heartbeat, and when the set changed):
        the ack point, and ``in_sync`` true only for a member of both the required and the
        published set (a promotion without grace needs this word from the primary, over the
        authenticated link, besides ``PREFIX/sync``).  Also re-evaluates the set (a grace that
        ended, a standby that left).  Returns None: nothing for the caller to send."""
        self.reconcile()
        members = self.published & self.required
        for replica in self.source.replicas.values():
            if not replica.conn.closed:
                in_sync = standby_identity(replica.name) in members
                replica.conn.send(P.encode_push(P.PUSH_SYNC, [self.settings.ack.value, in_sync,
                                                              self.settings.on_timeout.value]))
                replica.conn.flush()

    def handlers(self) -> dict[int, Callable[[Any, int, list], None]]:
        """The server's handler for ``SYNC_ACK``."""
        return {P.OP_SYNC_ACK: lambda conn, req_id, msg: self.on_ack(conn, msg[2])}

    def serve_alone(self) -> None:
        """``serve-alone`` is refused in a group (etcd decides): nothing to do."""

    def status(self) -> dict:
        """``replication.sync`` of STATUS."""
        in_sync = len(self.published) >= self.sync_standbys
        return {"mode": ReplicationMode.SYNC.value, "ack": self.settings.ack.value,
                "on_timeout": self.settings.on_timeout.value, "timeout_ms": self.settings.timeout_ms,
                "sync_standbys": self.sync_standbys,
                "state": "degraded" if self.degraded else "in_sync" if in_sync else "not_in_sync",
                "members": sorted(self.published), "required": sorted(self.required),
                "acked": {ident: entry.lsn for ident, entry in self.acked.items()},
                "waiting": len(self.waiting), "degradations": self.degradations, "holds": 0,
                "refusals": self.refusals, "acks_rejected": self.acks_rejected}

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._publishing is not None:
            self._publishing.cancel()
            self._publishing = None
