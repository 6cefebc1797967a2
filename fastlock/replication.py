"""Log shipping to a standby, standby apply, promotion, and the primary's self-fencing.

Roles
-----
primary
    Serves clients.  Each standby that connects gets a snapshot (when it is
    new, or its position is no longer in the log) and then every WAL batch as
    it is written - *after* its fsync in ``--fsync always`` mode, so a standby
    never holds a record the primary could still lose.  Replication is
    asynchronous: the primary never waits for a standby.
standby
    Applies the stream to its own lock table and its own WAL, and answers
    clients with ``NotPrimary`` naming the primary.  Its table runs on frozen
    time (``now = 0``): only a primary expires leases (as in etcd, where only
    the leader revokes leases); expiries arrive as records.
promotion
    On ``fastlock promote`` or, with ``--failover-after S``, after the primary
    has been silent for S seconds, the standby: raises the epoch above every
    epoch it has seen and fsyncs it; gives every replicated lease a fresh full
    TTL from now (holders reconnect and keep renewing with the lease they
    have); and grants nothing new for a grace period (default: the longest TTL
    it has seen), because the old primary may have granted locks whose records
    never arrived - as Chubby's new master waits out the old master's leases.
    Every token it issues is ``(epoch << 40) | counter`` with a higher epoch,
    so it is greater than every token the old primary issued, replicated or not.

No split brain: the primary fences itself
-----------------------------------------
A standby started with ``--failover-after F`` tells the primary F when it
connects.  The primary sends heartbeats carrying its own monotonic send time;
the standby echoes the newest one it has received.  The primary may grant and
extend only while ``now < echoed_send_time + F - margin`` (margin defaults to
F/4): past that the standby may be promoting, so the primary holds every grant
and refuses extends (``Unavailable``) until a fresh echo arrives, or until an
operator runs ``fastlock serve-alone`` (declaring the standby gone).  Because
the echoed time was taken on the primary's clock *before* the heartbeat was
sent, a heartbeat delayed or queued during a pause (SIGSTOP, a VM stall) can
only make the primary stop earlier, never later.

The timing assumption: the two clocks run at rates that differ by at most a
factor (1 + rho), with ``margin >= 2 * rho * F`` (F/4 allows rho up to 12 %);
clocks need not be synchronised, since each node only compares times on its
own clock.  The standby also sees F of silence only after the primary's last
heartbeat, which was sent after the echoed time - so the standby promotes
after the primary has stopped.

A node that learns of a higher epoch than its own from its paired standby's
replica principal (a standby's HELLO carries the highest epoch it has seen;
clients' and admins' epoch hints are ignored) steps down: it refuses every lock
operation from then on, and records it in ``deposed.json`` (fsynced before it
answers) so that a restart does not bring it back as a primary.

Pairing and promotion rules (each one closes a split brain found by testing):

* only an authenticated replica principal may attach, acknowledge or announce
  an epoch (see :mod:`fastlock.auth`); before the standby sends its token, the
  primary proves it holds the standby's credential (a challenge-response), so
  a standby never follows, nor takes a snapshot from, an impostor;
* one standby per primary, identified by its replica principal and its
  ``node-id`` file (``label@principal/node-id``, composed by the primary); the
  primary pairs with it on its first echoed heartbeat and persists that in
  ``pairing.json``; a second standby, or a live clone with the same identity, is
  refused;
* the primary's heartbeats say whom it is paired with and with which window;
  a standby fails over automatically only once that confirms the pairing;
* a manual promotion asks the primary to step down and waits for the answer;
  without one it stops following (no more acknowledgements that could reopen
  the primary's fence), waits until the fence has closed, and only then
  promotes - or, with no confirmed fence, refuses without ``--force``;
* a standby refuses to follow, or to take a snapshot from, a lower epoch.

Wire messages (see :mod:`fastlock.protocol` for the framing)::

    standby -> primary  [id, HELLO, version, name, {"principal", "challenge"}]      -> {"principal", "proof"}
                        [id, HELLO, version, name, replica_token, epoch]          -> hello info
                        [id, REPLICATE, from_lsn, incarnation|None, failover_after_ms, "[label@]node_id"]
                        [id, REPL_ACK, echoed_primary_ms, applied_lsn]          (no reply)
    primary -> standby  [0, "snap", [lsn, epoch, counter, holders, incarnation]]   (owner keys as hashes)
                        [0, "repl", [first_lsn, last_lsn, frames]]               (WAL batch bytes)
                        [0, "hb",   [primary_ms, last_lsn, epoch, longest_ttl_ms, paired_id, paired_window_ms]]
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import os
import ssl
import time
from collections import deque
from typing import TYPE_CHECKING, Any

from . import protocol as P
from .auth import primary_proof, primary_proof_key, token_principal
from .errors import AuthError, FastlockError, InvalidArgument, PermissionDenied, ProtocolError, Unavailable
from .wal import EPOCH, EXPIRE, EXTEND, GRANT, RELEASE, RESERVE, WalCompacted, _fsync_dir, decode_frames

if TYPE_CHECKING:  # pragma: no cover
    from .server import LockServer, _Connection

log = logging.getLogger(__name__)

PUSH_SNAPSHOT = "snap"
PUSH_RECORDS = "repl"
PUSH_HEARTBEAT = "hb"

#: A standby whose unsent output exceeds this many bytes is disconnected (it resyncs).
MAX_STANDBY_BACKLOG_BYTES = 64 << 20

_FOREVER_MS = 10 * 365 * 24 * 3600 * 1000


def _now_ms() -> int:
    return time.monotonic_ns() // 1_000_000


def heartbeat_interval_ms(failover_after_ms: int) -> int:
    """Heartbeats 8 per failover window, between 10 ms and 500 ms."""
    if failover_after_ms <= 0:
        return 500
    return max(10, min(500, failover_after_ms // 8))


def standby_identity(name: str) -> str:
    """A standby names itself ``[display@]node-id``; only the node id identifies it."""
    return name.rpartition("@")[2]


class _Replica:
    __slots__ = ("conn", "name", "ident", "failover_after_ms", "acked_lsn", "contact_ms", "sent", "attached_ms",
                 "last_ack_ms")

    def __init__(self, conn: "_Connection", name: str | None, failover_after_ms: int):
        self.conn = conn
        self.name = name or conn.peer
        self.ident = standby_identity(self.name)
        self.last_ack_ms = 0  # primary time of the last acknowledgement received
        self.failover_after_ms = failover_after_ms
        self.acked_lsn = 0
        self.contact_ms = _now_ms()  # primary time echoed by the standby
        self.sent: deque[tuple[int, int]] = deque()  # (last_lsn of a batch, primary ms when sent)
        self.attached_ms = _now_ms()


PAIRING_FILE = "pairing.json"
NODE_ID_FILE = "node-id"


def _write_atomically(directory: str, name: str, data: bytes) -> None:
    path = os.path.join(directory, name)
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(directory)


DEPOSED_FILE = "deposed.json"
STATE_FILE = "node-state.json"


class NodeState:
    """What a node must remember about the cluster beyond its WAL, in
    ``<data dir>/node-state.json`` (written atomically and fsynced, only when a
    value changes - rarely):

    ``max_epoch_seen``
        the highest epoch this node has heard of (its primary's, a deposing
        HELLO's): a promotion starts above it, so a node whose WAL never
        received a newer primary's epoch still never reuses it;
    ``max_ttl_ms``
        the longest lease TTL granted in the cluster as far as this node knows:
        the default promotion grace, which must survive a restart;
    ``standby_of``
        set while the node is a standby: started without ``--standby-of`` it
        would otherwise come up as a second primary at the old epoch, so it
        refuses until it is promoted (or the file is deleted).
    """

    def __init__(self, directory: str):
        self.directory = directory
        try:
            with open(os.path.join(directory, STATE_FILE), encoding="utf-8") as f:
                self._data = json.load(f)
        except FileNotFoundError:
            self._data = {}

    @property
    def max_epoch_seen(self) -> int:
        return int(self._data.get("max_epoch_seen", 0))

    @property
    def max_ttl_ms(self) -> int:
        return int(self._data.get("max_ttl_ms", 0))

    @property
    def standby_of(self) -> str | None:
        return self._data.get("standby_of")

    def raise_epoch(self, epoch: int) -> None:
        if epoch > self.max_epoch_seen:
            self._set(max_epoch_seen=epoch)

    def raise_ttl(self, ttl_ms: int) -> None:
        # Stored rounded up to whole seconds: a client stepping its TTL up by 1 ms at a
        # time then costs at most one fsynced write per second of TTL, not one per
        # acquire; the grace it feeds may only be up to 1 s longer (the safe side).
        if ttl_ms > self.max_ttl_ms:
            self._set(max_ttl_ms=-(-ttl_ms // 1000) * 1000)

    def set_standby_of(self, address: str | None) -> None:
        if address != self.standby_of:
            self._set(standby_of=address)

    def _set(self, **changes) -> None:
        data = dict(self._data, **changes)
        os.makedirs(self.directory, exist_ok=True)
        _write_atomically(self.directory, STATE_FILE, json.dumps(data, sort_keys=True).encode())
        self._data = data


def write_deposed(directory: str, epoch: int, why: str) -> None:
    """Remember (durably) that this node stepped down for ``epoch``."""
    _write_atomically(directory, DEPOSED_FILE, json.dumps({"epoch": epoch, "why": why}).encode())


def read_deposed(directory: str) -> dict | None:
    try:
        with open(os.path.join(directory, DEPOSED_FILE), encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        return None


def node_id(directory: str) -> str:
    """This node's permanent identity, kept in ``<data dir>/node-id`` (made on first use).

    A primary pairs with exactly one standby and knows it by this id.
    """
    path = os.path.join(directory, NODE_ID_FILE)
    try:
        with open(path, encoding="ascii") as f:
            value = f.read().strip()
        if value:
            return value
    except FileNotFoundError:
        pass
    os.makedirs(directory, exist_ok=True)
    value = os.urandom(8).hex()
    _write_atomically(directory, NODE_ID_FILE, value.encode() + b"\n")
    return value


class ReplicationSource:
    """The primary's side: streams the WAL to its standby and fences the primary.

    One standby per primary.  The first standby that acknowledges a heartbeat
    is *paired*: its id and failover window are written to
    ``<data dir>/pairing.json`` (atomically), another standby is refused until
    an operator unpairs with ``fastlock serve-alone``, and a primary restarted
    while paired with a failover window starts fenced - its standby may have
    promoted while it was down - until that standby attaches again.

    ``fence_margin_ms``: how long before a standby could promote the primary
    stops granting (default: a quarter of the standby's failover window).
    """

    def __init__(self, server: "LockServer", *, fence_margin_ms: int | None = None):
        self.server = server
        self.incarnation = os.urandom(8).hex()  # changes on every start: a standby resyncs
        self.replicas: dict[int, _Replica] = {}  # by session
        self.fence_margin_ms = fence_margin_ms
        self.serving_alone = False
        self.fenced = False
        self.paired_id: str | None = None
        # the strictest failover window of any standby that ever attached (ms, 0 = none)
        self._paired_window_ms = 0
        self._contact_ms = 0
        self._hb_timer: asyncio.TimerHandle | None = None
        self._fence_timer: asyncio.TimerHandle | None = None
        self._fence_timer_at = 0
        self._listening = False

    # -- pairing ---------------------------------------------------------------------------
    def load_pairing(self) -> None:
        """At start: restore the pairing; a primary paired with a failover window starts fenced."""
        path = os.path.join(self.server.config.data_dir, PAIRING_FILE)
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
        except FileNotFoundError:
            return
        self.paired_id = data["standby"]
        self._paired_window_ms = int(data["failover_after_ms"])
        if self._paired_window_ms > 0:
            log.warning(
                "restarted while paired with standby %s (failover window %d ms): not granting until it "
                "attaches again - it may have been promoted meanwhile - or `fastlock serve-alone`",
                self.paired_id, self._paired_window_ms,
            )
            self._fence(_now_ms())

    def _pair(self, replica: _Replica) -> None:
        self.paired_id = replica.name
        self._paired_window_ms = replica.failover_after_ms
        self.serving_alone = False
        _write_atomically(self.server.config.data_dir, PAIRING_FILE, json.dumps(
            {"standby": replica.name, "failover_after_ms": replica.failover_after_ms}).encode())
        log.info("paired with standby %s (failover window %d ms)", replica.name, replica.failover_after_ms)

    def may_announce_epoch(self, principal: str) -> bool:
        """May replica ``principal`` depose this primary with a higher epoch?  Only the
        paired standby's principal (any replica principal while unpaired)."""
        if self.paired_id is None:
            return True
        return standby_identity(self.paired_id).partition("/")[0] == principal

    def _unpair(self) -> None:
        path = os.path.join(self.server.config.data_dir, PAIRING_FILE)
        try:
            os.unlink(path)
            _fsync_dir(self.server.config.data_dir)
        except FileNotFoundError:
            pass
        self.paired_id = None
        self._paired_window_ms = 0

    # -- attach / detach ------------------------------------------------------------------
    def attach(self, conn: "_Connection", req_id: int, from_lsn: int, incarnation: Any,
               failover_after_ms: int, name: str | None) -> None:
        server = self.server
        wal = server.wal
        if not name:
            raise InvalidArgument("a standby must name itself (its node id)")
        ident = standby_identity(name)
        if self.paired_id is not None and ident != standby_identity(self.paired_id):
            raise Unavailable(
                f"this primary is paired with standby {self.paired_id!r}; fastlock supports one standby. "
                f"Run `fastlock serve-alone` on the primary to unpair it first")
        now = _now_ms()
        for other in list(self.replicas.values()):
            if other.ident != ident:
                raise Unavailable(f"standby {other.name!r} is attached; fastlock supports one standby")
            alive_ms = 4 * heartbeat_interval_ms(other.failover_after_ms)
            if other.last_ack_ms and now - other.last_ack_ms < alive_ms and not other.conn.closed:
                # not a reconnect: a live standby with this node id is attached
                raise Unavailable(
                    f"a live standby with node id {ident} is already attached (a copied data directory? "
                    f"delete the copy's node-id file so it gets its own identity)")
            # the same standby reconnecting: its old connection is dead or half-open
            log.warning("standby %s reconnected; dropping its previous connection", name)
            self.replicas.pop(other.conn.session, None)
            other.conn.closed = True
            other.conn.transport.abort()
        replica = _Replica(conn, name, failover_after_ms)
        # Contact comes only from echoes of heartbeats sent from now on: this REPLICATE may have
        # been delayed in the network and come from a standby that has promoted since.
        replica.contact_ms = self._contact_ms
        self.replicas[conn.session] = replica
        mode = "stream"
        backlog: list[tuple[int, list]] = []
        if incarnation != self.incarnation or from_lsn < 1:
            mode = "snapshot"
        else:
            try:
                backlog = list(wal.read_from(from_lsn))
            except WalCompacted:
                mode = "snapshot"
        conn.send(P.encode_ok(req_id, {"incarnation": self.incarnation, "mode": mode,
                                       "epoch": server.table.epoch}))
        if mode == "snapshot":
            lsn = wal.stats()["last_lsn"]
            epoch, counter, holders = server._snapshot_state()
            conn.send(P.encode_push(PUSH_SNAPSHOT, [lsn, epoch, counter, [list(h) for h in holders],
                                                    self.incarnation]))
            replica.acked_lsn = 0
        else:
            for lsn, rec in backlog:
                conn.send(P.encode_push("rec", [lsn, rec]))
        if not self._listening:
            wal.add_listener(self._on_batch)
            self._listening = True
        log.info("standby %s attached (%s from LSN %d, failover window %d ms)",
                 replica.name, mode, from_lsn, failover_after_ms)
        self._heartbeat()

    def detach(self, conn: "_Connection") -> None:
        replica = self.replicas.pop(conn.session, None)
        if replica is not None:
            log.warning("standby %s detached (acked LSN %d)", replica.name, replica.acked_lsn)

    # -- streaming ------------------------------------------------------------------------
    def _on_batch(self, first_lsn: int, last_lsn: int, data: bytes) -> None:
        if not self.replicas:
            return
        msg = P.encode_push(PUSH_RECORDS, [first_lsn, last_lsn, data])
        now = _now_ms()
        for replica in list(self.replicas.values()):
            conn = replica.conn
            if conn.closed:
                continue
            transport = conn.transport
            if transport.get_write_buffer_size() > MAX_STANDBY_BACKLOG_BYTES:
                log.error("standby %s is too far behind; disconnecting it (it will resync)", replica.name)
                conn.closed = True
                transport.abort()
                continue
            conn.send(msg)
            conn.flush()
            replica.sent.append((last_lsn, now))

    def _heartbeat(self) -> None:
        self._hb_timer = None
        if not self.replicas:
            return
        server = self.server
        now = _now_ms()
        msg = P.encode_push(PUSH_HEARTBEAT, [now, server.wal.stats()["last_lsn"], server.table.epoch,
                                              server.max_ttl_ms, self.paired_id, self._paired_window_ms])
        interval = 500
        for replica in self.replicas.values():
            if not replica.conn.closed:
                replica.conn.send(msg)
                replica.conn.flush()
            interval = min(interval, heartbeat_interval_ms(replica.failover_after_ms))
        self._check_fence(now)
        self._hb_timer = server._loop.call_later(interval / 1000.0, self._heartbeat)

    def on_ack(self, conn: "_Connection", echoed_ms: Any, applied_lsn: Any) -> None:
        replica = self.replicas.get(conn.session)
        if replica is None:
            raise ProtocolError("REPL_ACK before REPLICATE")
        if type(echoed_ms) is not int or type(applied_lsn) is not int:
            raise ProtocolError("REPL_ACK takes two integers")
        now = _now_ms()
        replica.last_ack_ms = now
        if replica.contact_ms < echoed_ms <= now:
            replica.contact_ms = echoed_ms
            if echoed_ms > self._contact_ms:
                self._contact_ms = echoed_ms
            if (self.paired_id is None or self._paired_window_ms != replica.failover_after_ms
                    or self.paired_id != replica.name):
                # a standby that echoed our heartbeat is real: pair with it (persisted)
                self._pair(replica)
        if applied_lsn > replica.acked_lsn:
            replica.acked_lsn = applied_lsn
            sent = replica.sent
            while sent and sent[0][0] <= applied_lsn:
                sent.popleft()
        self._check_fence(now)

    # -- fencing ----------------------------------------------------------------------------
    def may_act(self, now: int) -> bool:
        """May the primary grant and extend at ``now``?  Updates the fence."""
        if self._paired_window_ms == 0 or self.serving_alone:
            return True
        return self._check_fence(now)

    @property
    def fencing(self) -> bool:
        """Is a standby with a failover window paired (so the fence applies)?"""
        return self._paired_window_ms != 0 and not self.serving_alone

    def fence_if_due(self, now: int) -> None:
        """Fence now if the deadline has passed; never unfences (acks and timers do that).

        The server calls this before anything that can make the lock table
        grant (a release or an expiry hands the lock to a waiter), so that
        after a stall - SIGSTOP, a VM pause - no callback that runs before the
        fence timer can grant past the deadline.  It only raises the table's
        hold, which produces no events, so it is safe anywhere.
        """
        if self.fencing and not self.fenced and now >= self._fence_deadline():
            self._fence(now)

    def _margin(self) -> int:
        return self.fence_margin_ms if self.fence_margin_ms is not None else self._paired_window_ms // 4

    def _fence_deadline(self) -> int:
        return self._contact_ms + self._paired_window_ms - self._margin()

    def _check_fence(self, now: int) -> bool:
        window = self._paired_window_ms
        if window == 0 or self.serving_alone:
            if self.fenced:
                self._unfence()
            return True
        deadline = self._fence_deadline()
        ok = now < deadline
        if ok:
            if self.fenced:
                self._unfence()
            if self._fence_timer is None or self._fence_timer_at > deadline:
                # Fence on time even when no heartbeat, ack or request comes (no standby attached).
                # An earlier deadline re-arms it; a later one is picked up when it fires.
                if self._fence_timer is not None:
                    self._fence_timer.cancel()
                self._fence_timer_at = deadline
                self._fence_timer = self.server._loop.call_later((deadline - now + 1) / 1000.0,
                                                                 self._on_fence_timer)
        elif not self.fenced:
            self._fence(now)
        return ok

    def _on_fence_timer(self) -> None:
        self._fence_timer = None
        self._check_fence(_now_ms())

    def _fence(self, now: int) -> None:
        window = self._paired_window_ms
        self.fenced = True
        self.server.table.hold_grants_until(now + _FOREVER_MS)
        log.warning(
            "no word from the standby for %d ms (failover window %d ms, margin %d ms): "
            "holding all grants and refusing extends until it is back or `fastlock serve-alone`",
            now - self._contact_ms, window, self._margin(),
        )

    def _unfence(self) -> None:
        self.fenced = False
        server = self.server
        server.table.hold_grants_until(max(_now_ms(), server.grace_until_ms))
        server.table.expire(_now_ms())
        log.warning("fence lifted: granting again")
        server._after_batch()

    def serve_alone(self) -> dict:
        """Operator's word that the standby is gone for good: unpair and stop fencing.

        If that standby was in fact promoted, this makes two primaries: it is
        the operator's call.  A standby that attaches and acknowledges later
        pairs again.
        """
        was = self.paired_id
        self.serving_alone = True
        self._unpair()
        self._check_fence(_now_ms())
        log.warning("operator: serving alone (unpaired from standby %s); a standby that attaches later "
                    "pairs again", was)
        return {"serving_alone": True, "unpaired": was}

    def status(self) -> dict:
        now = _now_ms()
        last_lsn = self.server.wal.stats()["last_lsn"]
        standbys = []
        for r in self.replicas.values():
            standbys.append({
                "name": r.name,
                "acked_lsn": r.acked_lsn,
                "lag_records": max(0, last_lsn - r.acked_lsn),
                "lag_ms": (now - r.sent[0][1]) if r.sent else 0,
                "contact_age_ms": now - r.contact_ms,
                "failover_after_ms": r.failover_after_ms,
            })
        return {
            "standbys": standbys,
            "fenced": self.fenced,
            "serving_alone": self.serving_alone,
            "paired_window_ms": self._paired_window_ms,
            "paired_standby": self.paired_id,
            "incarnation": self.incarnation,
        }

    def close(self) -> None:
        if self._hb_timer is not None:
            self._hb_timer.cancel()
            self._hb_timer = None
        if self._fence_timer is not None:
            self._fence_timer.cancel()
            self._fence_timer = None


class _FollowerProtocol(asyncio.Protocol):
    def __init__(self, follower: "StandbyFollower"):
        self.follower = follower
        self.decoder = P.FrameDecoder(256 << 20)
        self.transport: asyncio.Transport | None = None
        self.replies: dict[int, asyncio.Future] = {}
        self.lost = asyncio.get_running_loop().create_future()

    def connection_made(self, transport):
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        try:
            messages = self.decoder.feed(data)
            ack = False
            for msg in messages:
                ack = self.follower._on_message(self, msg) or ack
            if ack:  # one acknowledgement per read, however many batches it held
                self.follower._ack(self)
        except FastlockError as exc:
            log.error("replication stream error: %s", exc)
            self.transport.abort()
        except Exception:
            log.exception("failed to apply the replication stream; reconnecting")
            self.transport.abort()

    def connection_lost(self, exc):
        why = f"replication connection lost: {exc}" if exc else "replication connection lost"
        for fut in self.replies.values():
            if not fut.done():
                fut.set_exception(ConnectionError(why))
        if not self.lost.done():
            self.lost.set_result(None)

    def request(self, req_id: int, op: int, *args) -> asyncio.Future:
        fut = asyncio.get_running_loop().create_future()
        self.replies[req_id] = fut
        self.transport.write(P.packb([req_id, op, *args]))
        return fut


class StandbyFollower:
    """The standby's side: follow a primary, apply its log, promote when told or when it is silent.

    Args:
        server: the standby's :class:`~fastlock.server.LockServer`.
        primary: ``(host, port)`` of the primary.
        failover_after_ms: promote after this much silence (0: only on command).
        tls: connect to the primary over TLS with this client context (it
            verifies the primary's certificate against the primary's host
            name, and carries this node's certificate for mutual TLS); None:
            plain TCP.  Replaced on a certificate reload; used from the next
            connection on.
    """

    def __init__(self, server: "LockServer", primary: tuple[str, int], failover_after_ms: int = 0,
                 token: str | None = None, name: str | None = None, tls: ssl.SSLContext | None = None):
        self.server = server
        self.primary = primary
        self.tls = tls
        self._connect_error: str | None = None  # the last connection failure logged
        self.failover_after_ms = failover_after_ms
        self.token = token
        #: the replica principal this standby authenticates as (from its token)
        self.principal = token_principal(token) if token else None
        self.name = name
        self.applied_lsn = 0
        self.incarnation: str | None = None
        self.primary_epoch = 0
        self.primary_last_lsn = 0
        self.last_heard_ms = 0
        self.last_hb_primary_ms = 0
        self.synced = False  # has applied at least one snapshot or stream from this primary
        self.refused: str | None = None  # why this node refuses to follow its primary
        self._refused_credentials: str | None = None  # the primary's last refusal, logged once
        self.pair_confirmed = False  # the primary's heartbeats say it fences itself for this node
        self._node = standby_identity(name or "")
        self.max_ttl_ms = 0
        self.connected = False
        self._task: asyncio.Task | None = None
        self._proto: _FollowerProtocol | None = None
        self._watchdog: asyncio.TimerHandle | None = None
        self._stopping = False

    @property
    def ident(self) -> str:
        """The identity the primary pairs with: ``replica principal/node id`` (the principal
        comes from the token, or - over mutual TLS without one - from the primary's HELLO answer)."""
        return f"{self.principal}/{self._node}"

    @property
    def primary_address(self) -> str:
        return f"{self.primary[0]}:{self.primary[1]}"

    def start(self) -> None:
        self._task = asyncio.ensure_future(self._run())
        if self.failover_after_ms > 0:
            self._arm_watchdog()

    async def depose(self, epoch: int, timeout_s: float = 2.0) -> bool:
        """Tell the primary that ``epoch`` begins and wait for its answer.

        A HELLO carrying a higher epoch makes the primary step down before it
        replies, so True means it has stopped granting.  False: not connected,
        or no answer within ``timeout_s`` seconds (frozen, partitioned, dead).
        """
        proto = self._proto
        if proto is None or proto.transport is None or proto.transport.is_closing():
            return False
        try:
            info = await asyncio.wait_for(
                proto.request(4, P.OP_HELLO, P.PROTOCOL_VERSION, f"standby:{self.name}", self.token, epoch),
                timeout_s)
        except (ConnectionError, asyncio.TimeoutError, FastlockError):
            return False
        return info.get("role") != "primary" or info.get("epoch", 0) >= epoch

    def stop(self) -> None:
        """Stop following (the connection is closed)."""
        self._stopping = True
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None
        if self._proto is not None and self._proto.transport is not None:
            self._proto.transport.close()
        if self._task is not None:
            self._task.cancel()

    async def _run(self) -> None:
        backoff = 0.05
        loop = asyncio.get_running_loop()
        while not self._stopping:
            tls = self.tls
            try:
                _, proto = await asyncio.wait_for(
                    loop.create_connection(lambda: _FollowerProtocol(self), *self.primary, ssl=tls,
                                           server_hostname=self.primary[0] if tls else None,
                                           ssl_handshake_timeout=5.0 if tls else None), 5.0)
            except (OSError, asyncio.TimeoutError) as exc:
                if isinstance(exc, ssl.SSLError) and str(exc) != self._connect_error:
                    # a certificate problem does not fix itself: say it once, not every retry
                    self._connect_error = str(exc)
                    log.error("TLS handshake with primary %s failed: %s", self.primary_address, exc)
                log.debug("cannot reach primary %s: %s", self.primary_address, exc)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 1.0)
                continue
            self._proto = proto
            try:
                if not await self._primary_proves_itself(proto):
                    proto.transport.close()
                    await asyncio.sleep(backoff)
                    backoff = min(backoff * 2, 5.0)
                    continue
                # our epoch travels in the HELLO: a primary with a lower one steps down
                # (this node was promoted since it last followed it) and refuses REPLICATE
                hello = await asyncio.wait_for(
                    proto.request(1, P.OP_HELLO, P.PROTOCOL_VERSION, f"standby:{self.name or os.getpid()}",
                                  self.token, self.server.table.epoch), 5.0)
                if self.principal is None and type(hello.get("principal")) is str:
                    self.principal = hello["principal"]  # authenticated by our certificate
                self.primary_epoch = max(self.primary_epoch, hello.get("epoch", 0))
                self.server.node_state.raise_epoch(self.primary_epoch)
                if hello.get("epoch", 0) < self.server.table.epoch:
                    self.refused = (f"{self.primary_address} is at epoch {hello.get('epoch')}, below this "
                                    f"node's epoch {self.server.table.epoch}: it is a deposed primary")
                    log.critical("refusing to follow: %s; restart this node as the primary, or point it "
                                 "at the current primary", self.refused)
                    proto.transport.close()
                    return
                info = await asyncio.wait_for(
                    proto.request(2, P.OP_REPLICATE, self.applied_lsn + 1 if self.synced else 0,
                                  self.incarnation, self.failover_after_ms, self.name), 5.0)
                self.connected = True
                self._refused_credentials = None
                self._connect_error = None
                backoff = 0.05
                log.info("replicating from %s (%s)", self.primary_address, info.get("mode"))
                await proto.lost
            except (ConnectionError, asyncio.TimeoutError, FastlockError) as exc:
                if isinstance(exc, (AuthError, PermissionDenied)):
                    # credentials do not fix themselves: say it once, not on every retry
                    if str(exc) != self._refused_credentials:
                        self._refused_credentials = str(exc)
                        log.error("primary %s refused this standby's credentials: %s (retrying)",
                                  self.primary_address, exc)
                else:
                    log.warning("replication from %s failed: %s", self.primary_address, exc)
                proto.transport.close()
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 1.0)
            finally:
                self.connected = False
                self._proto = None
            if not self._stopping:
                log.warning("lost the replication connection to %s", self.primary_address)

    async def _primary_proves_itself(self, proto: "_FollowerProtocol") -> bool:
        """Before our token goes out: the primary must answer our random challenge with
        the proof only a holder of our credential can make (see :mod:`fastlock.auth`).

        Raises what the request raises (AuthError if the primary does not know our
        principal); returns False if the proof is wrong.
        """
        if self.principal is None:
            return True  # no replica token: the primary refuses REPLICATE, nothing to protect
        challenge = os.urandom(32)
        answer = await asyncio.wait_for(
            proto.request(5, P.OP_HELLO, P.PROTOCOL_VERSION, f"standby:{self.name or os.getpid()}",
                          {"principal": self.principal, "challenge": challenge}), 5.0)
        expected = primary_proof(primary_proof_key(self.token), self.principal, challenge)
        proof = answer.get("proof") if isinstance(answer, dict) else None
        if type(proof) is bytes and hmac.compare_digest(proof, expected):
            if self.refused is not None and "could not prove" in self.refused:
                self.refused = None
            return True
        self.refused = f"{self.primary_address} could not prove that it holds this standby's credential"
        log.critical("not following %s: it could not prove that it holds this standby's credential "
                     "(replica principal %s): an impostor, or a different credentials file", self.primary_address,
                     self.principal)
        return False

    # -- the stream -------------------------------------------------------------------------
    def _on_message(self, proto: _FollowerProtocol, msg: list) -> bool:
        """Apply one message; True if the primary should hear an acknowledgement."""
        req_id = msg[0]
        if req_id != 0:
            fut = proto.replies.pop(req_id, None)
            if fut is not None and not fut.done():
                if msg[1] == 0:
                    fut.set_result(msg[2])
                else:
                    from .errors import error_from_wire

                    fut.set_exception(error_from_wire(msg[1], msg[2], msg[3] if len(msg) > 3 else None))
            return False
        kind, payload = msg[1], msg[2]
        self.last_heard_ms = _now_ms()
        if kind == PUSH_HEARTBEAT:
            primary_ms, last_lsn, epoch, max_ttl_ms, paired_id, paired_window_ms = payload
            # Automatic promotion is safe only once the primary fences itself for us: it has
            # paired with this node's id and this failover window (it says so in heartbeats).
            confirmed = (paired_id is not None and standby_identity(paired_id) == self.ident
                         and paired_window_ms == self.failover_after_ms)
            if confirmed != self.pair_confirmed:
                self.pair_confirmed = confirmed
                if confirmed:
                    log.info("paired: primary %s fences itself for this standby (failover window %d ms)",
                             self.primary_address, paired_window_ms)
                else:
                    log.warning("primary %s no longer reports this standby as paired: no automatic failover",
                                self.primary_address)
            self.last_hb_primary_ms = primary_ms
            self.primary_last_lsn = last_lsn
            self.primary_epoch = max(self.primary_epoch, epoch)
            # the longest TTL the primary has granted: the default promotion grace
            if max_ttl_ms > self.max_ttl_ms:
                self.max_ttl_ms = max_ttl_ms
                self.server.node_state.raise_ttl(max_ttl_ms)
            self.server.node_state.raise_epoch(epoch)
        elif kind == PUSH_RECORDS:
            first, last, data = payload
            self._apply_records(decode_frames(data, first))
            self.primary_last_lsn = max(self.primary_last_lsn, last)
        elif kind == "rec":
            lsn, rec = payload
            self._apply_records([(lsn, rec)])
        elif kind == PUSH_SNAPSHOT:
            self._apply_snapshot(*payload)
        else:
            return False
        return True

    def _ack(self, proto: _FollowerProtocol) -> None:
        if self.last_hb_primary_ms and proto.transport is not None and not proto.transport.is_closing():
            proto.transport.write(P.packb([3, P.OP_REPL_ACK, self.last_hb_primary_ms, self.applied_lsn]))

    def _apply_snapshot(self, lsn: int, epoch: int, counter: int, holders: list, incarnation: str) -> None:
        server = self.server
        table = server.table
        wal = server.wal
        if epoch < table.epoch:
            # never replace a newer epoch's leases with an older primary's state
            raise ProtocolError(f"snapshot at epoch {epoch} is below this node's epoch {table.epoch}")
        if epoch > table.epoch:
            table.set_epoch(epoch)
            wal.log_epoch(epoch)
        table.advance_counter(counter)
        wanted = {h[0]: h for h in holders}
        for h in table.holders():
            w = wanted.get(h.name)
            if w is None or w[1] != h.token:
                table.remove_holder(h.name, h.token, 0)
                wal.log_release(h.name, h.token)
        for name, token, owner, ttl_ms, delay_ms, client, corr, _wall in holders:
            current = table.holder(name, 0)
            if current is None or current.token != token or current.ttl_ms != ttl_ms:
                self._install(name, token, owner, ttl_ms, delay_ms, client, corr)
        table.drain_events()
        self.applied_lsn = lsn
        self.incarnation = incarnation
        self.primary_epoch = max(self.primary_epoch, epoch)
        self.synced = True
        log.info("applied snapshot at primary LSN %d: %d leases, epoch %d", lsn, len(holders), epoch)

    def _install(self, name, token, owner, ttl_ms, delay_ms, client, corr) -> None:
        server = self.server
        server.table.install_holder(name, token, owner, ttl_ms, delay_ms, (client, corr), 0)
        server.wal.log_grant(name, token, owner, ttl_ms, delay_ms, client, corr)
        if ttl_ms > self.max_ttl_ms:
            self.max_ttl_ms = ttl_ms
            self.server.node_state.raise_ttl(ttl_ms)

    def _apply_records(self, records) -> None:
        server = self.server
        table = server.table
        wal = server.wal
        applied = self.applied_lsn
        for lsn, rec in records:
            if lsn <= applied:
                continue  # already in the snapshot
            if lsn != applied + 1:
                raise ProtocolError(f"replication gap: expected LSN {applied + 1}, got {lsn}")
            kind = rec[0]
            if kind == GRANT:
                _, name, token, owner, ttl_ms, delay_ms, client, corr, _wall = rec
                self._install(name, token, owner, ttl_ms, delay_ms, client, corr)
            elif kind == RELEASE or kind == EXPIRE:
                name, token = rec[1], rec[2]
                if table.remove_holder(name, token, 0):
                    if kind == RELEASE:
                        wal.log_release(name, token)
                    else:
                        wal.log_expire(name, token)
            elif kind == EXTEND:
                _, name, token, ttl_ms, _wall = rec
                h = table.holder(name, 0)
                if h is not None and h.token == token:
                    table.install_holder(name, token, h.owner, ttl_ms, h.lock_delay_ms, h.meta, 0)
                    wal.log_extend(name, token, ttl_ms)
                    self.max_ttl_ms = max(self.max_ttl_ms, ttl_ms)
            elif kind == EPOCH:
                epoch = rec[1]
                if epoch > table.epoch:
                    table.set_epoch(epoch)
                    wal.log_epoch(epoch)
                self.primary_epoch = max(self.primary_epoch, epoch)
            elif kind == RESERVE:
                table.advance_counter(rec[1])
            applied = lsn
        table.drain_events()
        self.applied_lsn = applied
        self.synced = True

    # -- failover ---------------------------------------------------------------------------
    def _arm_watchdog(self) -> None:
        interval = heartbeat_interval_ms(self.failover_after_ms) / 1000.0
        self._watchdog = self.server._loop.call_later(interval, self._check_silence)

    def _check_silence(self) -> None:
        self._watchdog = None
        if self._stopping:
            return
        if self.server.role != "standby":  # a manual promotion in progress: it may yet be refused
            self._arm_watchdog()
            return
        now = _now_ms()
        if (self.synced and self.pair_confirmed and self.last_heard_ms
                and now - self.last_heard_ms >= self.failover_after_ms):
            log.warning("primary %s silent for %d ms (failover after %d ms): promoting",
                        self.primary_address, now - self.last_heard_ms, self.failover_after_ms)
            asyncio.ensure_future(self.server.promote(reason="primary silent", automatic=True))
            return
        self._arm_watchdog()

    def status(self) -> dict:
        now = _now_ms()
        return {
            "primary": self.primary_address,
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
        }
