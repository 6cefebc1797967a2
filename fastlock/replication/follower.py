"""The standby's side of replication: follow a primary, apply its log, watch for its silence.

:class:`StandbyFollower` follows the primary through a
:class:`~fastlock.replication.link.PrimaryLink` (the connection and its
handshake), asking for the stream from its position, and applies every
push to the standby's own lock table and WAL through
:func:`fastlock.wal.apply` - the rules recovery uses - with
:class:`StandbyApply` as the target.  Beside the table it keeps a deadline
for each lease on its own monotonic clock (what a promotion keeps), and a
watchdog that reports a silent paired primary to the failover policy.  The
rules (frozen time, kept deadlines, who may promote) are in
:mod:`fastlock.replication`.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from .. import protocol as P
from ..errors import FastlockError, ProtocolError
from ..logsafe import quote
from ..protocol.ops import PUSH_QUEUES
from ..protocol.priority import MAX_REVOKE_GRACE_MS
from ..roles import Role
from ..units import monotonic_ms, wall_ms
from ..wal import (
    Epoch,
    Expire,
    Extend,
    Grant,
    LeaseMeta,
    LockDelay,
    Record,
    Release,
    Revoke,
    RevokeRequest,
    apply,
    decode_frames,
)
from ..wal.keyspace import KeySpace
from ..wal.records import KeyDelete, KeyMoved, KeyPut, SlotsAdopted, SlotsUnadopted
from ..wal.records import decode as decode_record
from .link import PrimaryLink
from .messages import Heartbeat, SnapshotHolder, heartbeat_interval_ms, standby_identity
from .queues import QueueMirror
from .syncrep import SyncStatus

if TYPE_CHECKING:  # pragma: no cover
    from .host import ReplicationHost

log = logging.getLogger("fastlock.replication")


class StandbyApply:
    """The standby's table as the target of :func:`fastlock.wal.apply`: each change
    goes to its lock table (on frozen time, ``now = 0``), is logged to its own WAL,
    and updates the lease deadlines the follower keeps."""

    def __init__(self, follower: StandbyFollower):
        self.follower = follower
        self.table = follower.host.table
        self.wal = follower.host.wal
        #: the primary's LSN of the record being applied (0: a snapshot's change, no revision)
        self.lsn = 0
        #: what ended the lease of the record being applied ("released", "expired", "revoked")
        self.ended = "released"

    @property
    def epoch(self) -> int:
        return self.table.epoch

    @property
    def counter(self) -> int:
        return self.table.counter

    def holds(self, name: str, token: int) -> bool:
        return self.table.check(name, token, 0)

    def install(self, g: Grant) -> None:
        self.table.install_holder(g.name, g.token, g.owner_hash, g.ttl_ms, g.lock_delay_ms,
                                  LeaseMeta(g.client, g.correlation_id), 0, g.shared, g.limit)
        self.wal.log_grant(g.name, g.token, g.owner_hash, g.ttl_ms, g.lock_delay_ms, g.client, g.correlation_id,
                           g.shared, g.limit)
        self.follower.track(g.name, g.token, g.ttl_ms)
        self.follower.saw_ttl(g.ttl_ms)
        revisions = self.follower.revisions
        if self.lsn and revisions is not None:
            revisions.replicated(self.follower.primary_epoch, self.lsn, g.name, "granted", g.token,
                                 (g.client, g.correlation_id))

    def remove(self, record: Release | Expire | Revoke) -> None:
        revisions = self.follower.revisions
        what = "released" if isinstance(record, Release) else "revoked" if isinstance(record, Revoke) else "expired"
        self.ended = what  # the ``what`` of the lease's keys, if it has some (lease_ended, next)
        if self.lsn and revisions is not None:  # the lease's client and correlation id, for the watchers
            held = next((h for h in self.table.holders_of(record.name, 0) if h.token == record.token), None)
            revisions.replicated(self.follower.primary_epoch, self.lsn, record.name, what, record.token,
                                 held.meta if held is not None else None)
        self.table.remove_holder(record.name, record.token, 0)
        self.follower.lease_deadlines.pop(record.token, None)
        revokes = self.follower.host.revoke_deadlines
        if revokes.running:
            revokes.drop(record.name, record.token)
        if isinstance(record, Release):
            self.wal.log_release(record.name, record.token)
        elif isinstance(record, Revoke):
            self.wal.log_revoke(record.name, record.token, record.principal, record.reason)
        else:
            self.wal.log_expire(record.name, record.token)

    def set_ttl(self, record: Extend) -> None:
        h = next(h for h in self.table.holders_of(record.name, 0) if h.token == record.token)
        self.table.install_holder(record.name, record.token, h.owner, record.ttl_ms, h.lock_delay_ms, h.meta, 0,
                                  h.shared, h.limit)
        self.wal.log_extend(record.name, record.token, record.ttl_ms)
        self.follower.track(record.name, record.token, record.ttl_ms)
        self.follower.saw_ttl(record.ttl_ms, persist=False)

    def raise_epoch(self, epoch: int) -> None:
        self.table.set_epoch(epoch)
        self.wal.log_epoch(epoch)

    def raise_counter(self, counter: int) -> None:
        self.table.advance_counter(counter)

    def set_lock_delay(self, record: LockDelay) -> None:
        # on this node's monotonic clock (its table runs on frozen time 0 until a
        # promotion), capped at the longest lock-delay as recovery does
        left = min(record.until_wall_ms - wall_ms(), P.MAX_LOCK_DELAY_MS)
        if left > 0:
            self.table.install_lock_delay(record.name, monotonic_ms() + left, 0)
            self.wal.log_lock_delay(record.name, record.until_wall_ms)
    @property
    def keys(self) -> KeySpace:
        return self.follower.host.keys.space

    def put_key(self, record: KeyPut) -> None:
        self.keys.put(record.key, record.value, record.lease_name, record.token, record.principal, record.wall_ms)
        self.wal.log_key_put(record.key, record.value, record.lease_name, record.token, record.principal)
        self._key_changed(0, record.key, "put", record.value)

    def delete_key(self, record: KeyDelete | KeyMoved) -> None:
        self.keys.delete(record.key)
        if type(record) is KeyMoved:
            self.wal.log_key_moved(record.key, record.to_group)
            self._key_changed(0, record.key, "moved", None)
            return
        self.wal.log_key_delete(record.key)
        self._key_changed(0, record.key, "delete", None)

    def lease_ended(self, name: str, token: int) -> None:
        # the standby's own RELEASE/EXPIRE/REVOKE record implies it; the keys go in key order, as on the primary
        for index, (key, _) in enumerate(self.keys.lease_ended(name, token)):
            self._key_changed(index, key, self.ended, None)

    def _key_changed(self, index: int, key: str, what: str, value: bytes | None) -> None:
        """Keep a key change of the primary's record being applied (none for a snapshot's)."""
        key_revisions = self.follower.key_revisions
        if self.lsn and key_revisions is not None:
            key_revisions.replicated(self.follower.primary_epoch, self.lsn, index, key, what, value)

    def request_revoke(self, record: RevokeRequest) -> None:
        # kept without a timer until a promotion arms it; the deadline counts from the
        # push's arrival, so it is never earlier than the primary's (as track does)
        grace_ms = min(max(0, record.grace_ms), MAX_REVOKE_GRACE_MS)
        self.follower.host.revoke_deadlines.replicated(record, self.follower._received_ms + grace_ms)
        self.wal.log_revoke_request(record.name, record.token, record.principal, record.until_wall_ms,
                                    record.grace_ms)

    def adopt_slots(self, record: SlotsAdopted) -> None:
        # the adopted epoch is kept beyond the log (node state: an election never goes below it), and
        # the sharded node's gate learns the import (it takes a map giving those slots to its group)
        host = self.follower.host
        self.wal.log_slots_adopted(record.first, record.last, record.floor, record.epoch, record.queues)
        host.node_state.raise_epoch(record.epoch)
        gate = getattr(host, "shard_gate", None)
        if gate is not None:
            gate.adopted_by_log(record)

    def unadopt_slots(self, record: SlotsUnadopted) -> None:
        # the sharded node's gate answers those slots' names Unavailable, promoted, until their floor is adopted
        self.wal.log_slots_unadopted(record.first, record.last)
        gate = getattr(self.follower.host, "shard_gate", None)
        if gate is not None:
            gate.unadopted_by_log(record)


class StandbyFollower:
    """The standby's side: follow a primary, apply its log, promote when told or when it is silent.

    Args:
        host: the standby's server, as :class:`~fastlock.replication.host.ReplicationHost`.
        primary: ``(host, port)`` of the primary.
        failover_after_ms: promote after this much silence (0: only on command).
        token: this standby's replica token (see :mod:`fastlock.auth`), or None
            (then its mutual-TLS certificate must identify a replica principal).
        name: ``[label@]node-id`` this standby announces.
        on_primary_silent: called (on the loop) when the paired primary has been
            silent for ``failover_after_ms``; the failover policy promotes.
        tls: connect to the primary over TLS with this client context (it
            verifies the primary's certificate against the primary's host
            name, and carries this node's certificate for mutual TLS); None:
            plain TCP.  Replaced on a certificate reload; used from the next
            connection on.
    """

    def __init__(self, host: ReplicationHost, primary: tuple[str, int], failover_after_ms: int = 0,
                 token: str | None = None, name: str | None = None,
                 on_primary_silent: Callable[[], object] | None = None, tls: ssl.SSLContext | None = None,
                 stream_limits: P.DecodeLimits | None = None):
        self.host = host
        self.on_primary_silent = on_primary_silent
        self.failover_after_ms = failover_after_ms
        # what the primary's stream may hold (a snapshot is one frame with every lease)
        self.link = PrimaryLink(self, primary, tls, token, name,
                                stream_limits or P.stream_limits(256 << 20, 1_000_000))
        self.applied_lsn = 0
        #: watch revisions (fastlock.server.watchlog.Revisions), set by the server: the changes applied are kept
        self.revisions: Any = None
        #: key revisions (fastlock.server.keyrevisions.KeyRevisions), set by the server, likewise
        self.key_revisions: Any = None
        #: the primary's waiter queues as last shipped (kept in place by a promotion: fastlock.server.reclaim)
        self.queues = QueueMirror()
        self.incarnation: str | None = None
        self.primary_epoch = 0
        self.primary_last_lsn = 0
        self.last_heard_ms = 0
        self.last_hb_primary_ms = 0
        self.synced = False  # has applied at least one snapshot or stream from this primary
        self.refused: str | None = None  # why this node refuses to follow its primary
        self.pair_confirmed = False  # the primary's heartbeats say it fences itself for this node
        self._node = standby_identity(name or "")
        self.max_ttl_ms = 0
        #: lease name -> (token, deadline): a conservative deadline (this node's monotonic
        #: ms) of each replicated lease, kept by a promotion (see track)
        self.lease_deadlines: dict[int, tuple[str, int]] = {}  # token -> (name, deadline ms)
        self._received_ms = 0  # when the push being applied arrived (this node's monotonic ms)
        self._watchdog: asyncio.TimerHandle | None = None
        #: synchronous replication: the primary's ack point, and whether it says this node is in sync
        self.sync = SyncStatus(self)
        #: an old primary following the new one: its first snapshot logs every lease it discards
        self.rejoining = False

    @property
    def tls(self) -> ssl.SSLContext | None:
        """The client TLS context for the primary (replace it on a certificate reload)."""
        return self.link.tls

    @tls.setter
    def tls(self, context: ssl.SSLContext | None) -> None:
        self.link.tls = context

    @property
    def connected(self) -> bool:
        return self.link.connected

    @property
    def principal(self) -> str | None:
        return self.link.principal

    @property
    def ident(self) -> str:
        """The identity the primary pairs with: ``replica principal/node id`` (the principal
        comes from the token, or - over mutual TLS without one - from the primary's HELLO answer)."""
        return f"{self.principal}/{self._node}"

    @property
    def primary_address(self) -> str:
        return self.link.address

    @property
    def stopped(self) -> bool:
        """Is this follower not following (never started, or stopped)?"""
        return self.link.stopped

    def start(self) -> None:
        """Start (or, after :meth:`stop`, resume) following the primary."""
        self.link.start()
        if self.failover_after_ms > 0 and self._watchdog is None:
            self._arm_watchdog()

    async def depose(self, epoch: int) -> bool:
        """Ask the primary to step down for ``epoch`` (``STEP_DOWN``) and wait for its answer.

        The primary steps down (durably) before it replies, so True means it
        has stopped granting.  False: not connected, refused, or no answer in
        time (frozen, partitioned, dead).  The request echoes the primary's
        newest heartbeat time, and the primary honours it only within
        ``STEP_DOWN_FRESH_MS`` of that on its own clock; this side waits that
        long plus half a second for the answer, so a request that arrives after
        the wait was given up is refused by the primary instead of deposing it.
        """
        if not self.link.is_open or not self.last_hb_primary_ms:
            return False
        timeout_s = P.STEP_DOWN_FRESH_MS / 1000.0 + 0.5
        try:
            info = await self.link.request(timeout_s, P.OP_STEP_DOWN, epoch, self.last_hb_primary_ms)
        except (ConnectionError, asyncio.TimeoutError, FastlockError) as exc:
            log.warning("primary %s did not step down for epoch %d: %s", self.primary_address, epoch, exc)
            return False
        return type(info) is dict and info.get("role") != "primary"

    def stop(self) -> None:
        """Stop following (the connection is closed)."""
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None
        self.link.stop()

    # -- the stream -------------------------------------------------------------------------
    def on_push(self, kind: Any, payload: Any) -> None:
        """Apply one push of the primary's stream (the link calls this in order).

        An error raised here (a gap, a lower epoch, a malformed payload) makes
        the link drop the connection; the follower reconnects and resyncs.
        """
        if kind not in P.REPLICATION_PUSH_KINDS:
            if kind == PUSH_QUEUES:  # the waiter queues (fastlock.replication.queues)
                self.queues.apply(payload)
            return
        self.last_heard_ms = self._received_ms = monotonic_ms()
        self.link.ack_due = True
        if kind == P.PUSH_HEARTBEAT:
            self._on_heartbeat(Heartbeat.decode(payload))
        elif kind == P.PUSH_RECORDS:
            first, last, data = payload
            self._apply_records(decode_frames(data, first))
            self.primary_last_lsn = max(self.primary_last_lsn, last)
        elif kind == P.PUSH_RECORD:
            lsn, body = payload
            try:
                record = decode_record(body)
            except ValueError as exc:
                raise ProtocolError(f"replicated record at LSN {lsn}: {exc}") from None
            self._apply_records([(lsn, record)])
        elif kind == P.PUSH_SNAPSHOT:
            self._apply_snapshot(*payload)
        elif kind == P.PUSH_SYNC:
            self.sync.on_status(payload)
            return
        if self.sync.ack is not None:
            self.sync.applied(self.applied_lsn)

    def _on_heartbeat(self, hb: Heartbeat) -> None:
        P.check_epoch(hb.epoch, "heartbeat epoch")
        # Automatic promotion is safe only once the primary fences itself for us: it has
        # paired with this node's id and this failover window (it says so in heartbeats).
        confirmed = (hb.paired_id is not None and standby_identity(hb.paired_id) == self.ident
                     and hb.paired_window_ms == self.failover_after_ms)
        if confirmed != self.pair_confirmed:
            self.pair_confirmed = confirmed
            if confirmed:
                log.info("paired: primary %s fences itself for this standby (failover window %d ms)",
                         self.primary_address, hb.paired_window_ms)
            else:
                log.warning("primary %s no longer reports this standby as paired: no automatic failover",
                            self.primary_address)
        self.last_hb_primary_ms = hb.primary_ms
        self.primary_last_lsn = hb.last_lsn
        self.primary_epoch = max(self.primary_epoch, hb.epoch)
        # the longest TTL the primary has granted: the default promotion grace
        self.saw_ttl(hb.max_ttl_ms)
        self.host.node_state.raise_epoch(hb.epoch)

    def _apply_snapshot(self, lsn: int, epoch: int, counter: int, holders: list, incarnation: str,
                        keys: list | None = None) -> None:
        """Make the table the snapshot's: every lease it lacks or holds with another
        token is released, every lease it holds differently is granted, then every
        key is made the snapshot's (all through :func:`fastlock.wal.apply`, so the
        standby's WAL records each change)."""
        table = self.host.table
        target = StandbyApply(self)
        P.check_epoch(epoch, "snapshot epoch")
        if epoch < table.epoch:
            # never replace a newer epoch's leases with an older primary's state
            raise ProtocolError(f"snapshot at epoch {epoch} is below this node's epoch {table.epoch}")
        wanted = {h.token: h for h in (SnapshotHolder.decode(h) for h in holders)}  # checked before any change
        try:
            wanted_keys = KeySpace.from_list(keys if keys is not None else [])
        except ValueError as exc:
            raise ProtocolError(f"snapshot keys: {exc}") from None
        own_epoch = table.epoch
        if epoch > table.epoch:
            target.raise_epoch(epoch)
        table.advance_counter(counter)
        have = {}
        discarded: list[tuple[str, int, int]] = []  # (name, token, ttl_ms) of leases the primary lacks
        for h in table.holders():
            w = wanted.get(h.token)
            if w is None or w.name != h.name:
                discarded.append((h.name, h.token, h.ttl_ms))
                apply(Release(h.name, h.token, 0), target)
            else:
                have[h.token] = h
        self.lease_deadlines.clear()
        changed: list[tuple[str, int, int, int]] = []  # (name, token, own ttl_ms, the primary's)
        for w in wanted.values():
            current = have.get(w.token)
            if current is None or current.ttl_ms != w.ttl_ms or current.shared != w.shared or current.limit != w.limit:
                if current is not None:
                    changed.append((w.name, w.token, current.ttl_ms, w.ttl_ms))
                apply(w.grant(), target)
            self.track(w.name, w.token, w.remaining_ms)
        space = target.keys
        stale_keys = [k for k, e in space.entries.items() if wanted_keys.get(k) != e]
        if self.rejoining:
            self.rejoining = False
            self._log_rewind(lsn, epoch, own_epoch, discarded, changed, stale_keys)
        for key in stale_keys:
            apply(KeyDelete(key, 0), target)
        for key, e in wanted_keys.entries.items():
            if space.get(key) is None:
                apply(KeyPut(key, e.value, e.lease_name, e.token, e.principal, e.updated_wall_ms), target)
        table.drain_events()
        self.applied_lsn = lsn
        self.incarnation = incarnation
        self.primary_epoch = max(self.primary_epoch, epoch)
        self.synced = True
        if self.revisions is not None:  # the changes before the snapshot are not known here
            self.revisions.snapshot(self.primary_epoch, lsn)
        if self.key_revisions is not None:
            self.key_revisions.snapshot(self.primary_epoch, lsn)
        log.info("applied snapshot at primary LSN %d: %d leases, epoch %d", lsn, len(wanted), epoch)

    def _log_rewind(self, lsn: int, epoch: int, own_epoch: int, discarded: list, changed: list,
                    stale_keys: list) -> None:
        """An old primary's first snapshot from the new one: say exactly what it discards."""
        primary = self.primary_address
        if not discarded and not changed and not stale_keys:
            log.warning("rejoined %s (epoch %d, this node's was %d): this node's table matches its snapshot at "
                        "LSN %d - nothing discarded", primary, epoch, own_epoch, lsn)
            return
        log.warning("rejoined %s (epoch %d, this node's was %d): discarding what its snapshot at LSN %d lacks - %d "
                    "leases, %d lease TTLs, %d keys (granted, extended or written here and never acknowledged "
                    "by the standby, or changed there since)", primary, epoch, own_epoch, lsn, len(discarded),
                    len(changed), len(stale_keys))
        for name, token, ttl_ms in discarded:
            log.warning("rejoin discarded lease %s token %d (TTL %d ms): not held on the new primary",
                        quote(name), token, ttl_ms)
        for name, token, own_ttl, ttl in changed:
            log.warning("rejoin discarded lease %s token %d's TTL %d ms: the new primary has %d ms",
                        quote(name), token, own_ttl, ttl)
        for key in stale_keys:
            log.warning("rejoin discarded key %s: not the new primary's", quote(key))

    def saw_ttl(self, ttl_ms: int, persist: bool = True) -> None:
        """Remember the longest TTL seen (the default promotion grace); ``persist``:
        in the node state too, so that it survives a restart."""
        if ttl_ms > self.max_ttl_ms:
            self.max_ttl_ms = ttl_ms
            if persist:
                self.host.node_state.raise_ttl(ttl_ms)

    def track(self, name: str, token: int, remaining_ms: int) -> None:
        """Keep the lease's deadline: the push's arrival plus the time it had left.

        The primary sends a grant or extend record after making it, and a snapshot's
        ``remaining_ms`` after measuring it, so on clocks running at the same rate
        this deadline is never earlier than the primary's - nor than the holder's
        own, which counts from before it asked.  Only a promotion reads it; the
        standby's table itself expires nothing.
        """
        self.lease_deadlines[token] = (name, self._received_ms + remaining_ms)

    def lease_deadline(self, name: str, token: int) -> int | None:
        """The kept deadline (this node's monotonic ms) of lease ``name`` with ``token``,
        or None if this standby has not received it since it started (recovered
        from its own log: its remaining time is unknown)."""
        kept = self.lease_deadlines.get(token)
        return kept[1] if kept is not None and kept[0] == name else None

    def _apply_records(self, records: Iterable[tuple[int, Record]]) -> None:
        """Apply records in LSN order (those already applied are skipped).

        :raises ProtocolError: a gap in the LSNs.
        :raises InvalidArgument: an EPOCH record beyond the encodable range.
        """
        table = self.host.table
        target = StandbyApply(self)
        applied = self.applied_lsn
        for lsn, rec in records:
            if lsn <= applied:
                continue  # already in the snapshot
            if lsn != applied + 1:
                raise ProtocolError(f"replication gap: expected LSN {applied + 1}, got {lsn}")
            if type(rec) is Epoch or type(rec) is SlotsAdopted:
                self.primary_epoch = max(self.primary_epoch, P.check_epoch(rec.epoch, "epoch record"))
            target.lsn = lsn
            apply(rec, target)
            applied = lsn
        table.drain_events()
        self.applied_lsn = applied
        if self.revisions is not None:
            self.revisions.applied(self.primary_epoch, applied)
        if self.key_revisions is not None:
            self.key_revisions.applied(self.primary_epoch, applied)
        self.synced = True

    # -- failover ---------------------------------------------------------------------------
    def _arm_watchdog(self) -> None:
        interval_ms = heartbeat_interval_ms(self.failover_after_ms)
        due_ms = monotonic_ms() + interval_ms
        self._watchdog = self.host.loop.call_later(interval_ms / 1000.0,
                                                   lambda: self._check_silence(late_ms=monotonic_ms() - due_ms))

    def _check_silence(self, late_ms: int = 0) -> None:
        """The watchdog: promote (through ``on_primary_silent``) once the paired
        primary has been silent for the failover window.  ``late_ms`` is how late
        the watchdog ran: more than a heartbeat interval means this process was
        stalled itself (SIGSTOP, a VM pause) and has not yet read what the
        primary sent meanwhile, so it checks again one interval later instead of
        promoting over a primary that only this node failed to hear."""
        self._watchdog = None
        if self.link.stopping:
            return
        if self.host.roles.role is not Role.STANDBY:  # a manual promotion in progress: it may yet be refused
            self._arm_watchdog()
            return
        now = monotonic_ms()
        if (self.synced and self.pair_confirmed and self.last_heard_ms
                and now - self.last_heard_ms >= self.failover_after_ms):
            if late_ms > heartbeat_interval_ms(self.failover_after_ms):
                log.warning("primary %s silent for %d ms, but this standby was stalled itself (its watchdog "
                            "ran %d ms late): reading what the primary sent before deciding",
                            self.primary_address, now - self.last_heard_ms, late_ms)
                self._arm_watchdog()
                return
            log.warning("primary %s silent for %d ms (failover after %d ms): promoting",
                        self.primary_address, now - self.last_heard_ms, self.failover_after_ms)
            if self.on_primary_silent is not None:
                self.on_primary_silent()
        self._arm_watchdog()  # a refused or failed promotion leaves a standby that keeps watching

    def status(self) -> dict:
        now = monotonic_ms()
        return {
            "primary": self.primary_address,
            "ident": self.ident,  # as the primary names this standby (replication.standbys[].name)
            "connected": self.connected,
            "synced": self.synced,
            "applied_lsn": self.applied_lsn,
            "primary_last_lsn": self.primary_last_lsn,
            "lag_records": max(0, self.primary_last_lsn - self.applied_lsn),
            "last_heard_ms_ago": (now - self.last_heard_ms) if self.last_heard_ms else None,
            "failover_after_ms": self.failover_after_ms,
            "primary_epoch": self.primary_epoch,
            "refused": self.refused,
            "pair_confirmed": self.pair_confirmed,
            "mirrored_waiters": sum(len(owners) for owners in self.queues.queues.values()),
            "sync": {"ack": self.sync.ack.value if self.sync.ack else None, "in_sync": self.sync.in_sync,
                     "acked_lsn": self.sync.acked_lsn},
        }
