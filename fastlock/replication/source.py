"""The primary's side of replication: stream the WAL to the standby, and fence the primary.

:class:`ReplicationSource` attaches a standby (a snapshot when it is new or
its position was compacted away, else the log from its position, both
prepared off the event loop), then forwards every written WAL batch, sends
heartbeats, pairs with the standby that echoes them (``pairing.json``), and
fences the primary when the echoes stop - the "No split brain" rules of
:mod:`fastlock.replication`.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .. import protocol as P
from ..errors import InvalidArgument, LimitExceeded, PermissionDenied, ProtocolError, Unavailable
from ..logsafe import quote
from ..roles import Role
from ..units import monotonic_ms
from ..wal import BacklogReader, WalCompacted
from ._wire import SourceWire
from .messages import encode_snapshot, heartbeat_interval_ms, standby_identity
from .node_state import Pairing, read_pairing, remove_pairing, write_pairing
from .syncrep import SyncGate, SyncSettings
from .ttlbound import GROUP_LIVE_MS, MAX_UNCONFIRMED_HEARTBEATS, SentTtl, TtlBound, TtlCounted

if TYPE_CHECKING:  # pragma: no cover
    from .groupsync import GroupSyncGate
    from .host import ReplicaConnection, ReplicationHost

log = logging.getLogger("fastlock.replication")

#: bytes of log read per step when a standby catches up from a position
BACKLOG_CHUNK_BYTES = 256 << 10
#: a snapshot of at most this many leases is encoded on the loop (about 10 ms), a larger one off it
INLINE_SNAPSHOT_LEASES = 10_000
#: standby identities whose last sent LSN is kept for a resume (beyond: the oldest is forgotten,
#: and that standby gets a snapshot instead of resuming)
MAX_RESUMABLE = 256
#: standbys one replica principal may have attached at once (a group's primary; a pair's has one):
#: each attach costs a copy of the table and a snapshot
MAX_STANDBYS_PER_PRINCIPAL = 2


class SentWindow:
    """The primary LSNs one replication connection carried: what its standby may acknowledge.

    A standby acknowledges an LSN (``SYNC_ACK``, the applied LSN of ``REPL_ACK``) only once it
    has applied that record, and it can have applied only what its connection carried: the
    snapshot and the records after it, or the records after the position it resumed from.  So
    an acknowledgement counts only inside ``floor..upto``:

    * ``upto``: the highest LSN sent (a snapshot's LSN once its frame is written to the
      connection, a batch's last LSN once the batch is); -1: nothing sent yet, nothing counts.
    * ``floor``: the first snapshot's LSN (0 for a resumed stream): a lower number is a position
      in another log (a previous primary's), not one this connection carried.
    """

    __slots__ = ("floor", "upto")

    def __init__(self) -> None:
        self.floor = 0
        self.upto = -1

    def resumed(self, lsn: int) -> None:
        """The standby resumes after ``lsn``, which this primary had sent to it before."""
        self.floor = 0
        self.upto = lsn

    def snapshot(self, lsn: int) -> None:
        """A snapshot at ``lsn`` was written to the connection (a second one, after compaction,
        keeps the first one's floor: what came between was carried too)."""
        if self.upto < 0:
            self.floor = lsn
        if lsn > self.upto:
            self.upto = lsn

    def records(self, last_lsn: int) -> None:
        """A batch of records up to ``last_lsn`` was written to the connection."""
        if last_lsn > self.upto:
            self.upto = last_lsn

    def admits(self, lsn: int) -> bool:
        """May the standby acknowledge ``lsn`` on this connection?"""
        return self.floor <= lsn <= self.upto

    def describe(self) -> str:
        """The window for a log line: ``"nothing yet"`` or ``"LSNs floor..upto"``."""
        return "nothing yet" if self.upto < 0 else f"LSNs {self.floor}..{self.upto}"


class _Replica:
    """One attached standby, as the source tracks it."""

    __slots__ = ("conn", "name", "ident", "failover_after_ms", "acked_lsn", "contact_ms", "sent",
                 "last_ack_ms", "catching_up", "task", "base_cap", "address", "witness", "unconfirmed",
                 "window", "ack_warned", "hb_sent_ms")

    def __init__(self, conn: ReplicaConnection, name: str | None, failover_after_ms: int,
                 address: str | None = None, witness: str | None = None):
        self.conn = conn
        self.witness = witness  # the witness it asks before promoting, as it names it (None: none)
        self.address = address  # where it serves clients (as it announced it), or None
        self.name = name or conn.peer
        self.ident = standby_identity(self.name)
        self.last_ack_ms = 0  # primary time of the last acknowledgement received
        self.failover_after_ms = failover_after_ms
        self.acked_lsn = 0
        self.contact_ms = monotonic_ms()  # primary time echoed by the standby
        self.sent: deque[tuple[int, int]] = deque()  # (last_lsn of a batch, primary ms when sent)
        self.catching_up = False  # the backlog is being streamed; live batches wait
        self.task: asyncio.Future | None = None
        self.base_cap = 0  # the connection's output cap before any snapshot was added to it
        #: heartbeats sent to it that carried a longer TTL than the one before, not echoed yet
        self.unconfirmed: deque[SentTtl] = deque()
        #: the LSNs this connection carried: what an acknowledgement on it may name
        self.window = SentWindow()
        self.ack_warned = False  # an acknowledgement outside the window was logged (once per connection)
        self.hb_sent_ms = 0  # primary time of the last heartbeat sent on this connection (an echo names no later one)


class ReplicationSource(SourceWire):
    """The primary's side: streams the WAL to its standby and fences the primary.

    One standby per primary.  The first standby that acknowledges a heartbeat
    is *paired*: its id and failover window are written to
    ``<data dir>/pairing.json`` (atomically), another standby is refused until
    an operator unpairs with ``fastlock serve-alone``, and a primary restarted
    while paired with a failover window starts fenced - its standby may have
    promoted while it was down - until that standby attaches again.

    ``fence_margin_ms``: how long before a standby could promote the primary
    stops granting (default: a quarter of the standby's failover window).
    ``sync``: synchronous replication's settings (None: asynchronous), see
    :mod:`fastlock.replication.syncrep`; its gate is :attr:`sync`.

    *Coordinated* (:meth:`coordinate`, a node run with ``--coordinator``): an
    external arbiter decides who is primary and fences it, so any number of
    standbys may attach, none is paired, and the standbys' echoes never fence
    or unfence this primary; :meth:`fence_if_due` asks the arbiter instead.

    ``fencing``, ``sync``, ``ttl`` and ``replicas`` are slots of its compiled base
    (:class:`~fastlock.replication._wire.SourceWire`), read by the server's request path in C.
    """

    def __init__(self, host: ReplicationHost, *, fence_margin_ms: int | None = None,
                 sync: SyncSettings | None = None):
        self.host = host
        self.incarnation = os.urandom(8).hex()  # changes on every start: a standby resyncs
        self.replicas: dict[int, _Replica] = {}  # by session
        #: synchronous replication: replies that wait for the standby (None settings: async, a no-op)
        self.sync: SyncGate | GroupSyncGate = SyncGate(host, self, sync)  # a group's: coordinated.py
        #: replies acknowledging a TTL the standbys may not know wait for their echo (ttlbound.py)
        self.ttl = TtlBound(host, self._ttl_counted, self._heartbeat_now)
        self._last_hb_ms = 0  # when the last heartbeat went out (monotonic ms)
        self.fence_margin_ms = fence_margin_ms
        self.serving_alone = False
        self.paired_id: str | None = None
        #: where the paired standby serves clients (from pairing.json; None: unknown)
        self.paired_address: str | None = None
        #: the witness the paired standby asks before promoting (from pairing.json; None: none)
        self.paired_witness: str | None = None
        #: this node's own witness (``--witness``, ``host:port``); its lease counts only when the
        #: paired standby names the same one (a standby without it would not ask it)
        self.witness_address: str | None = None
        # the strictest failover window of any standby that ever attached (ms, 0 = none)
        self._paired_window_ms = 0
        self._contact_ms = 0
        #: this primary's monotonic ms until which a witness lease lets it grant without its standby (0: none)
        self._witness_until_ms = 0
        self._hb_timer: asyncio.TimerHandle | None = None
        self._fence_timer: asyncio.TimerHandle | None = None
        self._takeover_timer: asyncio.TimerHandle | None = None  # fenced: when the standby may promote
        self._fence_timer_at = 0
        self._listening = False
        #: the arbiter's fence check (coordinated mode), called with the monotonic ms; None: the pair's own
        self._external_fence: Callable[[int], None] | None = None
        #: is a standby with a failover window paired, or an arbiter in charge (so the fence applies)?
        #: (kept by _fencing_changed wherever what it depends on changes)
        self.fencing = False
        #: standby identity -> the highest LSN this process sent it (a resume may not claim more)
        self._sent_to: dict[str, int] = {}

    def coordinate(self, fence_if_due: Callable[[int], None]) -> None:
        """Hand fencing to an external arbiter (see the class docstring); ``fence_if_due(now_ms)``
        fences this primary if the arbiter's deadline has passed."""
        self._external_fence = fence_if_due
        self._fencing_changed()

    @property
    def coordinated(self) -> bool:
        return self._external_fence is not None

    # -- pairing ---------------------------------------------------------------------------
    def load_pairing(self) -> None:
        """At start: restore the pairing; a primary paired with a failover window starts fenced."""
        pairing = read_pairing(self.host.data_dir)
        if pairing is None:
            return
        self.paired_id = pairing.standby
        self.paired_address = pairing.address
        self.paired_witness = pairing.witness
        self._paired_window_ms = pairing.failover_after_ms
        self._fencing_changed()
        if self._paired_window_ms > 0:
            log.warning(
                "restarted while paired with standby %s at %s (failover window %d ms): not granting until it "
                "attaches again - it may have been promoted meanwhile: then this node follows it once it "
                "answers there, or restart this node with --standby-of %s - or, if that standby is gone for "
                "good, `fastlock serve-alone` (this node then serves at an epoch above any the standby could "
                "have taken; if it was promoted and granted, a lock it granted can have a second holder here, "
                "with a higher fencing token)",
                quote(self.paired_id), self.paired_address or "an address it never announced",
                self._paired_window_ms, self.paired_address or "<its address>",
            )
            self._fence(monotonic_ms())

    def _pair(self, replica: _Replica) -> None:
        self.paired_id = replica.name
        self.paired_address = replica.address
        self.paired_witness = replica.witness
        self._paired_window_ms = replica.failover_after_ms
        self.serving_alone = False
        self._fencing_changed()
        write_pairing(self.host.data_dir, Pairing(replica.name, replica.failover_after_ms, replica.address,
                                                  replica.witness))
        log.info("paired with standby %s (failover window %d ms)", quote(replica.name), replica.failover_after_ms)
        window = replica.failover_after_ms
        if (window and self.fence_margin_ms is not None
                and self.fence_margin_ms > window - 2 * heartbeat_interval_ms(window)):
            log.critical("--fence-margin %d ms leaves less than two heartbeat intervals (%d ms each) of the standby's "
                         "failover window (%d ms): this primary fences itself between heartbeats (at a margin >= "
                         "the window, always) and refuses grants; restart it with a smaller --fence-margin",
                         self.fence_margin_ms, heartbeat_interval_ms(window), window)

    def may_announce_epoch(self, principal: str) -> bool:
        """May replica ``principal`` depose this primary with a higher epoch?  Only the
        paired standby's principal (any replica principal while unpaired)."""
        if self.paired_id is None:
            return True
        return standby_identity(self.paired_id).partition("/")[0] == principal

    def _unpair(self) -> None:
        remove_pairing(self.host.data_dir)
        self.paired_id = None
        self.paired_address = None
        self.paired_witness = None
        self._paired_window_ms = 0
        self._fencing_changed()

    def stand_down(self) -> None:
        """This node stops being a primary for good (it rejoins as a standby): forget the
        pairing (durably) and stop the heartbeats and the fence timers."""
        self._unpair()
        self._sent_to.clear()  # its log may be rewound: a standby that follows it again gets a snapshot
        self.close()

    # -- attach / detach ------------------------------------------------------------------
    def attach(self, conn: ReplicaConnection, req_id: int, from_lsn: int, incarnation: Any,
               failover_after_ms: int, name: str | None, address: str | None = None, *,
               witness: str | None = None) -> None:
        """Attach a standby (see the class docstring); ``address``: where it serves clients,
        as it announced it, and ``witness``: the witness it asks before promoting, as it names
        it (both kept in the pairing)."""
        host = self.host
        wal = host.wal
        if not name:
            raise InvalidArgument("a standby must name itself (its node id)")
        ident = standby_identity(name)
        if conn.session in self.replicas:
            raise InvalidArgument(f"this connection already replicates as standby "
                                  f"{self.replicas[conn.session].name!r}: one REPLICATE per connection")
        coordinated = self.coordinated
        if coordinated:
            principal = ident.partition("/")[0]
            others = sum(1 for r in self.replicas.values()
                         if r.ident != ident and r.ident.partition("/")[0] == principal and not r.conn.closed)
            if others >= MAX_STANDBYS_PER_PRINCIPAL:
                raise LimitExceeded(f"replica principal {principal!r} already has {others} standbys attached "
                                    f"(at most {MAX_STANDBYS_PER_PRINCIPAL}); each node needs its own replica "
                                    f"credential")
        if not coordinated and self.paired_id is not None and ident != standby_identity(self.paired_id):
            raise Unavailable(
                f"this primary is paired with standby {self.paired_id!r}; fastlock supports one standby. "
                f"Run `fastlock serve-alone` on the primary to unpair it first")
        if (not coordinated and self.paired_id is not None and self._paired_window_ms
                and failover_after_ms != self._paired_window_ms):
            # the window decides when this primary fences: only an operator changes it (serve-alone, re-pair);
            # from 0 (no fence: that standby never promotes by itself) any window only adds a fence
            raise PermissionDenied(
                f"this primary is paired with standby {self.paired_id!r} at a failover window of "
                f"{self._paired_window_ms} ms; a re-attach cannot change it (asked for {failover_after_ms} ms). "
                f"Run `fastlock serve-alone` on the primary to unpair it first")
        now = monotonic_ms()
        for other in list(self.replicas.values()):
            if other.ident != ident:
                if coordinated:
                    continue  # any number of standbys
                raise Unavailable(f"standby {other.name!r} is attached; fastlock supports one standby")
            alive_ms = 4 * heartbeat_interval_ms(other.failover_after_ms)
            if other.last_ack_ms and now - other.last_ack_ms < alive_ms and not other.conn.closed:
                # not a reconnect: a live standby with this node id is attached
                raise Unavailable(
                    f"a live standby with node id {ident} is already attached (a copied data directory? "
                    f"delete the copy's node-id file so it gets its own identity)")
            # the same standby reconnecting: its old connection is dead or half-open
            log.warning("standby %s reconnected; dropping its previous connection", quote(name))
            self._remember_sent(other)
            self.replicas.pop(other.conn.session, None)
            other.conn.abort()
        replica = _Replica(conn, name, failover_after_ms, address, witness)
        # Contact comes only from echoes of heartbeats sent from now on: this REPLICATE may have
        # been delayed in the network and come from a standby that has promoted since.
        replica.contact_ms = self._contact_ms
        self.replicas[conn.session] = replica
        mode = "stream"
        if incarnation != self.incarnation or from_lsn < 1 or not wal.has_lsn(from_lsn):
            mode = "snapshot"
        elif from_lsn - 1 > self._sent_to.get(ident, 0):
            # it claims records this primary never sent it (a copied data directory, a faulty
            # or hostile peer): it gets them, as a snapshot, before any acknowledgement counts
            log.warning("standby %s asks to resume after LSN %d, but this primary sent it only up to LSN %d: "
                        "sending a snapshot", quote(name), from_lsn - 1, self._sent_to.get(ident, 0))
            mode = "snapshot"
        else:
            replica.window.resumed(from_lsn - 1)
        conn.send(P.encode_ok(req_id, {"incarnation": self.incarnation, "mode": mode,
                                       "epoch": host.table.epoch}))
        replica.base_cap = conn.out_cap
        if mode == "snapshot" and len(host.table) <= INLINE_SNAPSHOT_LEASES:
            # small: at once, and every later record follows in the live stream
            lsn, epoch, counter, holders, now = self._take_snapshot()
            self._deliver_snapshot(replica, lsn, epoch, counter, holders, now, None)
        else:
            # the snapshot and the backlog are prepared off the loop and streamed; live
            # batches follow once the standby has caught up (see _bring_up_to_date)
            replica.catching_up = True
            replica.task = asyncio.ensure_future(self._bring_up_to_date(replica, from_lsn, mode == "snapshot"))
        if not self._listening:
            wal.add_listener(self._on_batch)
            self._listening = True
        log.info("standby %s attached (%s from LSN %d, failover window %d ms)",
                 quote(replica.name), mode, from_lsn, failover_after_ms)
        self._heartbeat()

    async def _bring_up_to_date(self, replica: _Replica, from_lsn: int, snapshot: bool) -> None:
        """Send a standby what it lacks - a snapshot if it needs one, then the log
        after it - and hand it to the live stream (:meth:`_on_batch`).

        Neither blocks the event loop for long: the snapshot is encoded on a
        worker thread from the table's holders (taken on the loop, with the LSN
        they match), and the log is read on a worker thread, a chunk
        (:data:`BACKLOG_CHUNK_BYTES`) at a time, each chunk only once the standby
        has taken the previous one (the connection's write buffer drained).  If
        compaction deletes records meanwhile, the standby gets a snapshot instead.
        """
        conn = replica.conn
        records = 0
        try:
            if snapshot:
                from_lsn = await self._send_snapshot(replica) + 1
            while True:
                try:
                    records += await self._stream_log(replica, from_lsn)
                    break
                except WalCompacted as exc:
                    if conn.closed:
                        return
                    log.warning("standby %s: %s; sending a snapshot instead", quote(replica.name), exc)
                    from_lsn = await self._send_snapshot(replica) + 1
        except Exception:
            log.exception("preparing the stream for standby %s failed; disconnecting it", quote(replica.name))
            conn.abort()
            return
        if conn.closed:
            return
        replica.catching_up = False  # same loop step as the last check: no batch falls between
        log.info("standby %s caught up: %d records from LSN %d", quote(replica.name), records, from_lsn)

    def _take_snapshot(self) -> tuple[int, int, int, list, int]:
        """``(lsn, epoch, counter, holders, now)``: the table now, the LSN it matches
        and the monotonic ms it was taken at."""
        table = self.host.table
        wal = self.host.wal
        snapshot = wal.stats()["last_lsn"], table.epoch, table.counter, table.holders(), monotonic_ms()
        # a snapshot holds leases only: running lock-delays follow it in the stream
        wal.log_lock_delays(table.lock_delays(), snapshot[4])
        self.host.revoke_deadlines.relog(wal, snapshot[4])  # and running revoke requests
        gate = getattr(self.host, "shard_gate", None)
        if gate is not None:  # and the slots a move imported here and has not flipped (SLOTS_ADOPTED)
            gate.relog_imports(wal, table.last_token, table.epoch)
            gate.relog_owned(wal, table.last_token, table.epoch)  # and the slots its group owns with their floor
            gate.relog_unadopted(wal)  # and the slots it owns without their token floor (SLOTS_UNADOPTED)
        return snapshot

    async def _send_snapshot(self, replica: _Replica) -> int:
        """Send the lock table as a snapshot, encoded off the loop; return the LSN it matches."""
        lsn, epoch, counter, holders, now = self._take_snapshot()
        keys = self.host.keys.space.to_list()  # taken in the same loop step as the table
        frame = await asyncio.get_running_loop().run_in_executor(
            None, encode_snapshot, lsn, epoch, counter, holders, self.incarnation, now, keys)
        self._deliver_snapshot(replica, lsn, epoch, counter, holders, now, frame)
        return lsn

    def _deliver_snapshot(self, replica: _Replica, lsn: int, epoch: int, counter: int, holders: list, now: int,
                          frame: bytes | None) -> None:
        if frame is None:
            frame = encode_snapshot(lsn, epoch, counter, holders, self.incarnation, now,
                                    self.host.keys.space.to_list())
        conn = replica.conn
        # a standby may leave its snapshot unread plus the output cap (not just the cap)
        conn.out_cap = replica.base_cap + len(frame)
        conn.send(frame)
        conn.flush()
        replica.window.snapshot(lsn)
        replica.acked_lsn = 0
        log.info("standby %s: sent a snapshot at LSN %d (%d leases, %d bytes)", quote(replica.name), lsn,
                 len(holders), len(frame))

    async def _stream_log(self, replica: _Replica, from_lsn: int) -> int:
        """Stream the log from ``from_lsn`` up to the last record written; return
        the number of records sent.  Raises WalCompacted."""
        wal = self.host.wal
        conn = replica.conn
        loop = asyncio.get_running_loop()
        reader = BacklogReader(wal, from_lsn)
        records = 0
        while not conn.closed:
            upto = wal.written_lsn
            if reader.next_lsn > upto:
                break
            chunk = await loop.run_in_executor(None, reader.read, BACKLOG_CHUNK_BYTES, upto)
            if conn.closed or chunk is None:
                continue
            first, last, data = chunk
            conn.send(P.encode_push(P.PUSH_RECORDS, [first, last, data]))
            conn.flush()
            replica.window.records(last)
            replica.sent.append((last, monotonic_ms()))
            records += last - first + 1
            await conn.drained()
        return records

    def detach(self, conn: ReplicaConnection) -> None:
        replica = self.replicas.pop(conn.session, None)
        if replica is not None:
            self._remember_sent(replica)
            if replica.task is not None:
                replica.task.cancel()
            log.warning("standby %s detached (acked LSN %d)", quote(replica.name), replica.acked_lsn)

    def _remember_sent(self, replica: _Replica) -> None:
        """Keep what ``replica``'s connection carried: its next connection may resume from there."""
        upto = replica.window.upto
        if upto <= self._sent_to.get(replica.ident, 0):
            return
        self._sent_to.pop(replica.ident, None)
        self._sent_to[replica.ident] = upto
        while len(self._sent_to) > MAX_RESUMABLE:
            del self._sent_to[next(iter(self._sent_to))]

    def admit_sync_ack(self, conn: ReplicaConnection, lsn: int) -> bool:
        """May ``lsn``, a ``SYNC_ACK`` on ``conn``, count?  Only an LSN this connection carried
        (:class:`SentWindow`); another is logged at WARNING once per connection and counts nothing
        (the synchronous gates count the refusals: ``sync.acks_rejected`` in STATUS)."""
        replica = self.replicas.get(conn.session)
        if replica is None:
            return False
        if replica.window.admits(lsn):
            return True
        if not replica.ack_warned:
            replica.ack_warned = True
            log.warning("standby %s acknowledged LSN %d, which its connection never carried (it was sent %s): "
                        "not counted - a standby of another version, a faulty one, or one acknowledging another "
                        "primary's log (logged once per connection)", quote(replica.name), lsn,
                        replica.window.describe())
        return False

    # -- streaming ------------------------------------------------------------------------
    def _on_batch(self, first_lsn: int, last_lsn: int, data: bytes) -> None:
        if not self.replicas:
            return
        msg = P.encode_push(P.PUSH_RECORDS, [first_lsn, last_lsn, data])
        now = monotonic_ms()
        for replica in list(self.replicas.values()):
            conn = replica.conn
            if conn.closed or replica.catching_up:
                continue
            conn.send(msg)
            conn.flush()  # drops a standby too far behind (it resyncs): see the server's output caps
            replica.window.records(last_lsn)
            replica.sent.append((last_lsn, now))

    def _ttl_counted(self) -> TtlCounted | None:
        """Whose known TTL bounds what this primary acknowledges (ttlbound.py): the paired
        standby, or the witness it asks before promoting; in a group every attached standby;
        None: nothing promotes on this primary's silence."""
        if not self.fencing:
            return None
        if self.coordinated:  # those heard from lately (one catching up or stalled does not hold grants up)
            now = monotonic_ms()
            echoed = [r for r in self.replicas.values() if r.last_ack_ms]
            live = [r.ident for r in echoed if now - r.last_ack_ms < GROUP_LIVE_MS]
            idents = live or [r.ident for r in echoed]  # none heard lately: this primary may be the one cut off
            return TtlCounted(idents, False) if idents else None
        if self.paired_id is None:
            return None
        witness = self.witness_address is not None and self.paired_witness == self.witness_address
        return TtlCounted([standby_identity(self.paired_id)], witness)

    def _heartbeat_now(self) -> None:
        """Send a heartbeat at once (it carries a new longest TTL), and the next ones on time."""
        if self._hb_timer is not None:
            self._hb_timer.cancel()
        self._heartbeat()

    def _heartbeat(self) -> None:
        self._hb_timer = None
        if not self.replicas:
            return
        host = self.host
        now = monotonic_ms()
        max_ttl_ms = host.max_ttl_ms
        if now <= self._last_hb_ms and max_ttl_ms > self.ttl.sent_ttl_ms:
            # an echo names a heartbeat by its send time: one with a longer TTL goes in the next ms
            self._hb_timer = host.loop.call_later(0.002, self._heartbeat)
            return
        self._last_hb_ms = now
        msg = P.encode_push(P.PUSH_HEARTBEAT, [now, host.wal.stats()["last_lsn"], host.table.epoch,
                                              max_ttl_ms, self.paired_id, self._paired_window_ms])
        self.ttl.heartbeat_sent(max_ttl_ms)
        self.ttl.wait_ms = max(self.ttl.wait_ms, self._paired_window_ms)
        interval = 500
        extra = self.sync.status_push()  # synchronous replication's status (None: async)
        for replica in self.replicas.values():
            unconfirmed = replica.unconfirmed
            if not unconfirmed or max_ttl_ms > unconfirmed[-1].ttl_ms:
                if len(unconfirmed) >= MAX_UNCONFIRMED_HEARTBEATS:
                    unconfirmed.pop()
                unconfirmed.append(SentTtl(now, max_ttl_ms))
            if not replica.conn.closed:
                replica.conn.send(msg)
                replica.hb_sent_ms = now
                if extra is not None:
                    replica.conn.send(extra)
                replica.conn.flush()
            interval = min(interval, heartbeat_interval_ms(replica.failover_after_ms))
        self._check_fence(now)
        self._hb_timer = host.loop.call_later(interval / 1000.0, self._heartbeat)

    def on_ack(self, conn: ReplicaConnection, echoed_ms: Any, applied_lsn: Any) -> None:
        replica = self.replicas.get(conn.session)
        if replica is None:
            raise ProtocolError("REPL_ACK before REPLICATE")
        if type(echoed_ms) is not int or type(applied_lsn) is not int:
            raise ProtocolError("REPL_ACK takes two integers")
        now = monotonic_ms()
        replica.last_ack_ms = now
        known = 0  # the longest TTL (ms) of the heartbeats this echo confirms
        if replica.contact_ms < echoed_ms <= min(now, replica.hb_sent_ms):
            # (an echo of a time no heartbeat on this connection carried proves no contact, nor any TTL heard)
            replica.contact_ms = echoed_ms
            if echoed_ms > self._contact_ms:
                self._contact_ms = echoed_ms
            self.sync.on_contact(echoed_ms)  # a degrade waits for the standby to hear it
            unconfirmed = replica.unconfirmed
            while unconfirmed and unconfirmed[0].sent_ms <= echoed_ms:
                known = unconfirmed.popleft().ttl_ms
            if not self.coordinated and (self.paired_id is None or self._paired_window_ms != replica.failover_after_ms
                    or self.paired_id != replica.name
                    or (replica.address is not None and self.paired_address != replica.address)
                    or self.paired_witness != replica.witness):
                # a standby that echoed our heartbeat is real: pair with it (persisted)
                self._pair(replica)
        if applied_lsn > replica.acked_lsn and replica.window.admits(applied_lsn):
            # (an applied LSN outside what the connection carried is a position in another log,
            # as a standby's before its snapshot: not its progress here)
            replica.acked_lsn = applied_lsn
            sent = replica.sent
            while sent and sent[0][0] <= applied_lsn:
                sent.popleft()
        self._check_fence(now)
        if known:
            self.ttl.confirmed(replica.ident, known)  # releases replies that waited for it

    # -- fencing ----------------------------------------------------------------------------
    @property
    def fenced(self) -> bool:
        """Is this primary fenced (as the node's role says)?"""
        return self.host.roles.fenced

    def _fencing_changed(self) -> None:
        """Set :attr:`fencing` from what it depends on (the arbiter, the paired window, serve-alone);
        called wherever one of them changes, so the request path reads a plain attribute."""
        self.fencing = self._external_fence is not None or (self._paired_window_ms != 0 and not self.serving_alone)

    def fence_if_due(self, now: int) -> None:
        """Fence now if the deadline has passed; never unfences (acks and timers do that).

        The server calls this before anything that can make the lock table
        grant (a release or an expiry hands the lock to a waiter), so that
        after a stall - SIGSTOP, a VM pause - no callback that runs before the
        fence timer can grant past the deadline.  It only raises the table's
        hold, which produces no events, so it is safe anywhere.
        """
        if self._external_fence is not None:
            self._external_fence(now)
        elif self.fencing and not self.host.roles.fenced and now >= self._fence_deadline():
            self._fence(now)

    def _margin(self) -> int:
        return self.fence_margin_ms if self.fence_margin_ms is not None else self._paired_window_ms // 4

    def _fence_deadline(self) -> int:
        return max(self._contact_ms + self._paired_window_ms - self._margin(), self._witness_until_ms)

    def lease_window_ms(self, own_window_ms: int) -> int:
        """The witness lease this primary asks for (ms): its paired standby's failover window,
        else ``own_window_ms`` (its own ``--failover-after``); 0: none."""
        return self._paired_window_ms or own_window_ms

    def witness_granted(self, sent_ms: int, lease_ms: int, max_ttl_ms: int = 0) -> None:
        """The witness granted this primary the lease of its epoch for ``lease_ms`` (ms),
        asked at ``sent_ms`` (this node's monotonic ms): grant until ``sent_ms + lease_ms``
        minus the fence margin even when the standby is silent (see
        :mod:`fastlock.replication.witness`); it recorded ``max_ttl_ms`` (ms) as this
        primary's longest TTL, which the next epoch's holder learns (ttlbound.py)."""
        if self._paired_window_ms and self.paired_witness != self.witness_address:
            return  # the paired standby would promote without asking this witness: its lease proves nothing
        self.ttl.witness_confirmed(max_ttl_ms)
        margin = self.fence_margin_ms if self.fence_margin_ms is not None else lease_ms // 4
        until = sent_ms + lease_ms - margin
        if until > self._witness_until_ms:
            self._witness_until_ms = until
            self._check_fence(monotonic_ms())

    def _check_fence(self, now: int) -> bool:
        """Fence or unfence by the contact deadline; True if the primary may act at ``now``."""
        fenced = self.host.roles.fenced
        if self.coordinated:
            return not fenced  # the arbiter fences and unfences
        window = self._paired_window_ms
        if window == 0 or self.serving_alone:
            if fenced:
                self._unfence()
            return True
        deadline = self._fence_deadline()
        ok = now < deadline
        if ok:
            if fenced:
                self._unfence()
            if self._fence_timer is None or self._fence_timer_at > deadline:
                # Fence on time even when no heartbeat, ack or request comes (no standby attached).
                # An earlier deadline re-arms it; a later one is picked up when it fires.
                if self._fence_timer is not None:
                    self._fence_timer.cancel()
                self._fence_timer_at = deadline
                self._fence_timer = self.host.loop.call_later((deadline - now + 1) / 1000.0,
                                                              self._on_fence_timer)
        elif not fenced:
            self._fence(now)
        return ok

    def _on_fence_timer(self) -> None:
        self._fence_timer = None
        self._check_fence(monotonic_ms())

    def _fence(self, now: int) -> None:
        roles = self.host.roles
        if roles.role is not Role.PRIMARY:
            return  # a standby, promoting or deposed node grants nothing anyway
        window = self._paired_window_ms
        roles.set_fenced(True)  # holds every grant (the role decides the table's hold)
        self.ttl.recheck()  # replies waiting for the standby to confirm a TTL fail
        # no contact since this process started: its monotonic clock says nothing about the silence
        silence = f"for {now - self._contact_ms} ms" if self._contact_ms else "since this node started"
        log.warning(
            "no word from the standby %s %s (failover window %d ms, margin %d ms): holding all grants, refusing "
            "extends and releases until it is back or `fastlock serve-alone`; if it was promoted, this node "
            "follows it once it answers there (or restart this node with --standby-of %s)",
            self.paired_address or "(address not announced)", silence, window, self._margin(),
            self.paired_address or "<the new primary>",
        )
        if self._takeover_timer is None:
            at = self._contact_ms + window  # from then on the standby may have promoted
            self._takeover_timer = self.host.loop.call_later(max(0, at - now + 1) / 1000.0,
                                                             self._on_standby_may_have_promoted)

    def _on_standby_may_have_promoted(self) -> None:
        """Still fenced a whole failover window after the last contact: waiters queued
        here and watchers would wait on a node that may no longer be the primary.
        Close their connections so that they look for the primary (leases stay)."""
        self._takeover_timer = None
        if self.host.roles.fenced:
            self.host.close_client_connections(
                "fenced for a whole failover window: the standby may have been promoted", waiting_only=True)

    def _unfence(self) -> None:
        host = self.host
        host.roles.set_fenced(False)  # the hold falls back to the grace period, if any
        if self._takeover_timer is not None:
            self._takeover_timer.cancel()
            self._takeover_timer = None
        if host.roles.expires_leases:
            host.table.expire(monotonic_ms())  # hand blocked locks to their waiters
        log.warning("fence lifted: granting again")
        host.after_batch()

    def serve_alone(self) -> dict:
        """Operator's word that the standby is gone for good: unpair and stop fencing.

        If that standby was in fact promoted, this makes two primaries: it is
        the operator's call.  A standby that attaches and acknowledges later
        pairs again.
        """
        was = self.paired_id
        self.sync.serve_alone()  # synchronous replication stops waiting for the standby too
        self.serving_alone = True
        self._fencing_changed()
        self._unpair()
        self._check_fence(monotonic_ms())
        log.warning("operator: serving alone (unpaired from standby %s); a standby that attaches later "
                    "pairs again", quote(was))
        return {"serving_alone": True, "unpaired": was}

    def status(self) -> dict:
        now = monotonic_ms()
        last_lsn = self.host.wal.stats()["last_lsn"]
        standbys = []
        for r in self.replicas.values():
            standbys.append({
                "name": r.name,
                "acked_lsn": r.acked_lsn,
                "lag_records": max(0, last_lsn - r.acked_lsn),
                "lag_ms": (now - r.sent[0][1]) if r.sent else 0,
                "contact_age_ms": now - r.contact_ms,
                "failover_after_ms": r.failover_after_ms,
                "address": r.address,
            })
        return {
            "standbys": standbys,
            "fenced": self.fenced,
            "serving_alone": self.serving_alone,
            "paired_window_ms": self._paired_window_ms,
            "paired_standby": self.paired_id,
            "paired_standby_address": self.paired_address,
            "witness_lease_ms_left": max(0, self._witness_until_ms - now),
            "paired_standby_witness": self.paired_witness,
            "incarnation": self.incarnation,
            "ttl_bound": self.ttl.status(),
        }

    def close(self) -> None:
        if self._hb_timer is not None:
            self._hb_timer.cancel()
            self._hb_timer = None
        if self._takeover_timer is not None:
            self._takeover_timer.cancel()
            self._takeover_timer = None
        if self._fence_timer is not None:
            self._fence_timer.cancel()
            self._fence_timer = None
        self.ttl.fail_all("this node stopped")
        self.ttl.close()
        self.sync.close()


