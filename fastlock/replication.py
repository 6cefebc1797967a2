"""Log shipping to a standby, standby apply, and the primary's self-fencing.

This module sees the server only through
:class:`~fastlock.replication_host.ReplicationHost` (the table, the WAL, a
snapshot, the batch end, the loop, the node state and the role object).  The
node's role is declared in :mod:`fastlock.roles` and changes only there; the
decisions to promote, step down or serve alone are in :mod:`fastlock.failover`.

Roles
-----
primary
    Serves clients.  Each standby that connects gets a snapshot (when it is
    new, or its position is no longer in the log) or the log from its
    position, both prepared off the event loop and sent only as fast as the
    standby reads them, and then every WAL batch as it is written - *after*
    its fsync in ``--fsync always`` mode, so a standby never holds a record
    the primary could still lose.  Replication is asynchronous: the primary
    never waits for a standby, and drops one that leaves more than
    ``--max-replica-output-bytes`` unread (it reconnects and resyncs).
standby
    Applies the stream to its own lock table and its own WAL, and answers
    clients with ``NotPrimary`` naming the primary.  Its table runs on frozen
    time (``now = 0``): only a primary expires leases (as in etcd, where only
    the leader revokes leases); expiries arrive as records.  Beside the table
    it keeps, for each lease it received, a deadline on its own monotonic
    clock: the arrival of the lease's grant or extend record plus its TTL (the
    primary sends a record after making it, and logs every extend, even one
    that keeps the TTL), or the arrival of a snapshot plus the time the lease
    had left when the primary took it (``remaining_ms`` in the snapshot).
promotion
    On ``fastlock promote`` or, with ``--failover-after S``, after the primary
    has been silent for S seconds, the standby: raises the epoch above every
    epoch it has seen and fsyncs it; keeps every replicated lease until the
    deadline it kept for it (a lease whose deadline has passed expires at
    promotion, logged and WAL-recorded like any expiry; one recovered from the
    standby's own log after a restart, whose remaining time is unknown, gets a
    full TTL from the promotion), so holders reconnect and keep renewing with
    the lease they have, while a lease whose release never arrived expires
    about one TTL after its last grant or extend however many failovers follow
    (a fresh TTL at each promotion would keep it alive for good); and grants
    nothing new for a grace period (default: the longest TTL it has seen),
    because the old primary may have granted locks whose records never
    arrived - as Chubby's new master waits out the old master's leases.
    The kept deadline is never earlier than the holder's own: the holder counts
    its TTL from before it sent the request, the standby from after the
    primary made it - safe as long as the two clocks run at the same rate
    (the rate assumption below; a difference of rho shortens a lease by at
    most rho times its remaining time, which the holder's renewal at a third
    of its TTL absorbs).
    Every token it issues is ``(epoch << 40) | counter`` with a higher epoch,
    so it is greater than every token the old primary issued, replicated or not.

No split brain: the primary fences itself
-----------------------------------------
A standby started with ``--failover-after F`` tells the primary F when it
connects.  The primary sends heartbeats carrying its own monotonic send time;
the standby echoes the newest one it has received.  The primary may grant,
extend and release only while ``now < echoed_send_time + F - margin`` (margin
defaults to F/4): past that the standby may be promoting, so the primary is
*fenced* (:mod:`fastlock.roles`): it holds every grant and refuses extends and
releases (``Unavailable``) until a fresh echo arrives, or until an operator
runs ``fastlock serve-alone`` (declaring the standby gone); a whole window
after the last echo it closes the client connections that wait or watch, so
they look for the (maybe promoted) standby.  Because
the echoed time was taken on the primary's clock *before* the heartbeat was
sent, a heartbeat delayed or queued during a pause (SIGSTOP, a VM stall) can
only make the primary stop earlier, never later.  The fence is checked again
when a grant, or an extend that lengthens a TTL, is acknowledged after its
fsync (not only when it is decided): a primary frozen in between answers
``Unavailable``, never a token its promoted standby may not know.

The timing assumption: the two clocks run at rates that differ by at most a
factor (1 + rho), with ``margin >= 2 * rho * F`` (F/4 allows rho up to 12 %);
clocks need not be synchronised, since each node only compares times on its
own clock.  The standby also sees F of silence only after the primary's last
heartbeat, which was sent after the echoed time - so the standby promotes
after the primary has stopped.

A primary steps down only when a standby that promotes asks it to, with
``STEP_DOWN`` for exactly the next epoch (its own + 1) echoing a recent time
of the primary's own clock; a client's HELLO epoch is a hint that never
deposes a node (anyone could send 2**63-1 and wedge the pair), and only the
replica principal of the paired standby (any replica principal while unpaired)
may send ``STEP_DOWN`` (see :mod:`fastlock.auth`).  A node that
steps down refuses every lock operation from then on, records it in
``deposed.json`` (fsynced before it answers) so that a restart does not bring
it back as a primary, and closes its client connections so that their waiters
and renewals look for the new primary at once.

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
* a manual promotion asks the primary to step down (``STEP_DOWN``) and waits for the answer;
  without one it stops following (no more acknowledgements that could reopen
  the primary's fence), waits until the fence has closed, and only then
  promotes - or, with no confirmed fence, refuses without ``--force``;
* a standby refuses to follow, or to take a snapshot from, a lower epoch, and asks
  such a node (a primary deposed while it was away) to step down;
* every epoch a peer announces must be encodable (at most ``MAX_EPOCH``), or the
  message is refused and the connection dropped.

Wire messages (see :mod:`fastlock.protocol` for the framing)::

    standby -> primary  [id, HELLO, version, name, {"principal", "challenge"}]      -> {"principal", "proof"}
                        [id, HELLO, version, name, replica_token, epoch]          -> hello info
                        [id, REPLICATE, from_lsn, incarnation|None, failover_after_ms, "[label@]node_id"]
                        [id, REPL_ACK, echoed_primary_ms, applied_lsn]          (no reply)
                        [id, STEP_DOWN, new_epoch, echoed_primary_ms]           -> {"role", "epoch"}
    primary -> standby  [0, "snap", [lsn, epoch, counter, holders, incarnation]]
                        (holder: [name, token, owner_hash, ttl_ms, lock_delay_ms, client, corr, 0, remaining_ms];
                        owner keys travel only as their hashes)
                        [0, "repl", [first_lsn, last_lsn, frames]]               (WAL batch bytes)
                        [0, "rec",  [lsn, record]]              (one record: accepted from older primaries)
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
from typing import TYPE_CHECKING, Any, Callable

import msgpack

from . import protocol as P
from . import rpc
from .auth import primary_proof, primary_proof_key, token_principal
from .errors import AuthError, FastlockError, InvalidArgument, PermissionDenied, ProtocolError, Unavailable
from .logsafe import quote
from .roles import Role
from .wal import (
    DIR_MODE,
    EPOCH,
    EXPIRE,
    EXTEND,
    FILE_MODE,
    GRANT,
    RELEASE,
    RESERVE,
    BacklogReader,
    WalCompacted,
    _fsync_dir,
    decode_frames,
)

if TYPE_CHECKING:  # pragma: no cover
    from .replication_host import ReplicaConnection, ReplicationHost

log = logging.getLogger(__name__)

# the push kinds are declared with the op codes
PUSH_SNAPSHOT = P.PUSH_SNAPSHOT
PUSH_RECORDS = P.PUSH_RECORDS
PUSH_RECORD = P.PUSH_RECORD
PUSH_HEARTBEAT = P.PUSH_HEARTBEAT

#: bytes of log read per step when a standby catches up from a position
BACKLOG_CHUNK_BYTES = 256 << 10
#: a snapshot of at most this many leases is encoded on the loop (about 10 ms), a larger one off it
INLINE_SNAPSHOT_LEASES = 10_000


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
                 "last_ack_ms", "catching_up", "task", "base_cap")

    def __init__(self, conn: "ReplicaConnection", name: str | None, failover_after_ms: int):
        self.conn = conn
        self.name = name or conn.peer
        self.ident = standby_identity(self.name)
        self.last_ack_ms = 0  # primary time of the last acknowledgement received
        self.failover_after_ms = failover_after_ms
        self.acked_lsn = 0
        self.contact_ms = _now_ms()  # primary time echoed by the standby
        self.sent: deque[tuple[int, int]] = deque()  # (last_lsn of a batch, primary ms when sent)
        self.attached_ms = _now_ms()
        self.catching_up = False  # the backlog is being streamed; live batches wait
        self.task: asyncio.Future | None = None
        self.base_cap = 0  # the connection's output cap before any snapshot was added to it


def _encode_snapshot(lsn: int, epoch: int, counter: int, holders: list, incarnation: str, now: int) -> bytes:
    """The snapshot push ``[0, "snap", [lsn, epoch, counter, holders, incarnation]]``,
    encoded a holder at a time (so that, on a worker thread, it lets the event
    loop run between holders); ``holders``: :class:`~fastlock._core.Holder`.

    Each holder is ``[name, token, owner, ttl_ms, lock_delay_ms, client, corr, 0,
    remaining_ms]``, ``remaining_ms`` being its deadline minus ``now`` (the
    primary's monotonic ms when the snapshot was taken), at least 0.
    """
    packer = msgpack.Packer(use_bin_type=True)
    pack = packer.pack
    parts = [packer.pack_array_header(3), pack(0), pack(PUSH_SNAPSHOT), packer.pack_array_header(5),
             pack(lsn), pack(epoch), pack(counter), packer.pack_array_header(len(holders))]
    append = parts.append
    for h in holders:
        client, corr = h.meta if h.meta else (None, None)
        append(pack([h.name, h.token, h.owner, h.ttl_ms, h.lock_delay_ms, client, corr, 0,
                     min(h.ttl_ms, max(0, h.deadline_ms - now))]))
    append(pack(incarnation))
    return b"".join(parts)


def _snapshot_holder(h: Any) -> tuple:
    """One holder of a snapshot push as ``(name, token, owner, ttl_ms, lock_delay_ms,
    client, corr, remaining_ms)``; a holder without ``remaining_ms`` (8 items, an
    older primary) has its full ``ttl_ms`` left.

    Raises:
        ProtocolError: not a list of 8 or 9 items, or ``remaining_ms`` not an int
            in ``0..ttl_ms``.
        WrongArgumentType, InvalidArgument: ``ttl_ms`` not a valid TTL.
        (The link drops the connection on any of them; nothing is applied.)
    """
    if type(h) is not list or len(h) not in (8, 9):
        raise ProtocolError("snapshot holder must be a list of 8 or 9 items")
    ttl_ms = P.check_ttl_ms(h[3])
    remaining_ms = h[8] if len(h) == 9 else ttl_ms
    if type(remaining_ms) is not int or not 0 <= remaining_ms <= ttl_ms:
        raise ProtocolError(f"snapshot holder remaining_ms must be an int in 0..{ttl_ms}, not {remaining_ms!r}")
    return (h[0], h[1], h[2], ttl_ms, h[4], h[5], h[6], remaining_ms)


PAIRING_FILE = "pairing.json"
NODE_ID_FILE = "node-id"


def _write_atomically(directory: str, name: str, data: bytes) -> None:
    path = os.path.join(directory, name)
    tmp = path + ".tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0), FILE_MODE)
    with open(fd, "wb") as f:
        os.fchmod(fd, FILE_MODE)  # a leftover .tmp may have had another mode
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(directory)


DEPOSED_FILE = "deposed.json"
STATE_FILE = "node-state.json"


class NodeFileDamaged(RuntimeError):
    """A node state file (``node-state.json``, ``pairing.json``, ``deposed.json``)
    is not the JSON object, with the field types, this node writes: the server
    refuses to start rather than guess its epoch, pairing or role."""


def _load_json(directory: str, name: str, fields: dict[str, tuple[type, ...]]) -> dict | None:
    """The JSON object in ``<directory>/<name>``, or None if the file does not exist.

    ``fields`` maps each key to the types its value may have (a missing key is
    fine: it has its default).

    Raises:
        NodeFileDamaged: unreadable JSON, not an object, or a field of another type.
    """
    path = os.path.join(directory, name)
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        return None
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise NodeFileDamaged(f"{path} is damaged ({exc}): restore it or repair it by hand") from None
    if type(data) is not dict:
        raise NodeFileDamaged(f"{path} is damaged (not a JSON object): restore it or repair it by hand")
    for key, types in fields.items():
        if key in data and type(data[key]) not in types:
            raise NodeFileDamaged(f"{path} is damaged ({key!r} is {type(data[key]).__name__}, not "
                                  f"{' or '.join(t.__name__ for t in types)}): restore it or repair it by hand")
    return data


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
        refuses until it is promoted (or the file is deleted);
    ``grace_ms``
        the promotion grace (ms) of a primary whose grace has not yet run out:
        a restart during it cannot know how long it was down, so it holds new
        grants for the whole grace again (as recovered leases get a fresh full
        TTL); 0 once the grace has ended.
    """

    def __init__(self, directory: str):
        """Raises NodeFileDamaged: the file exists but is not what this class writes."""
        self.directory = directory
        self._data = _load_json(directory, STATE_FILE, {
            "max_epoch_seen": (int,), "max_ttl_ms": (int,), "grace_ms": (int,), "standby_of": (str, type(None)),
        }) or {}

    @property
    def max_epoch_seen(self) -> int:
        return int(self._data.get("max_epoch_seen", 0))

    @property
    def max_ttl_ms(self) -> int:
        return int(self._data.get("max_ttl_ms", 0))

    @property
    def standby_of(self) -> str | None:
        return self._data.get("standby_of")

    @property
    def grace_ms(self) -> int:
        return int(self._data.get("grace_ms", 0))

    def promoted(self, grace_ms: int) -> None:
        """Record a promotion: no longer a standby, ``grace_ms`` of grace pending."""
        self._set(standby_of=None, grace_ms=grace_ms)

    def grace_ended(self) -> None:
        if self.grace_ms:
            self._set(grace_ms=0)

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
        os.makedirs(self.directory, mode=DIR_MODE, exist_ok=True)
        _write_atomically(self.directory, STATE_FILE, json.dumps(data, sort_keys=True).encode())
        self._data = data


def write_deposed(directory: str, epoch: int, why: str) -> None:
    """Remember (durably) that this node stepped down for ``epoch``."""
    _write_atomically(directory, DEPOSED_FILE, json.dumps({"epoch": epoch, "why": why}).encode())


def read_deposed(directory: str) -> dict | None:
    """Raises NodeFileDamaged: the file exists but is not what :func:`write_deposed` writes."""
    return _load_json(directory, DEPOSED_FILE, {"epoch": (int,), "why": (str,)})


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
    os.makedirs(directory, mode=DIR_MODE, exist_ok=True)
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

    def __init__(self, host: "ReplicationHost", *, fence_margin_ms: int | None = None):
        self.host = host
        self.incarnation = os.urandom(8).hex()  # changes on every start: a standby resyncs
        self.replicas: dict[int, _Replica] = {}  # by session
        self.fence_margin_ms = fence_margin_ms
        self.serving_alone = False
        self.paired_id: str | None = None
        # the strictest failover window of any standby that ever attached (ms, 0 = none)
        self._paired_window_ms = 0
        self._contact_ms = 0
        self._hb_timer: asyncio.TimerHandle | None = None
        self._fence_timer: asyncio.TimerHandle | None = None
        self._takeover_timer: asyncio.TimerHandle | None = None  # fenced: when the standby may promote
        self._fence_timer_at = 0
        self._listening = False

    # -- pairing ---------------------------------------------------------------------------
    def load_pairing(self) -> None:
        """At start: restore the pairing; a primary paired with a failover window starts fenced."""
        data = _load_json(self.host.data_dir, PAIRING_FILE, {"standby": (str,), "failover_after_ms": (int,)})
        if data is None:
            return
        if "standby" not in data or "failover_after_ms" not in data:
            raise NodeFileDamaged(f"{os.path.join(self.host.data_dir, PAIRING_FILE)} is damaged (it must name "
                                  f"'standby' and 'failover_after_ms'): restore it or repair it by hand")
        self.paired_id = data["standby"]
        self._paired_window_ms = int(data["failover_after_ms"])
        if self._paired_window_ms > 0:
            log.warning(
                "restarted while paired with standby %s (failover window %d ms): not granting until it "
                "attaches again - it may have been promoted meanwhile - or `fastlock serve-alone`",
                quote(self.paired_id), self._paired_window_ms,
            )
            self._fence(_now_ms())

    def _pair(self, replica: _Replica) -> None:
        self.paired_id = replica.name
        self._paired_window_ms = replica.failover_after_ms
        self.serving_alone = False
        _write_atomically(self.host.data_dir, PAIRING_FILE, json.dumps(
            {"standby": replica.name, "failover_after_ms": replica.failover_after_ms}).encode())
        log.info("paired with standby %s (failover window %d ms)", quote(replica.name), replica.failover_after_ms)
        window = replica.failover_after_ms
        if window and self.fence_margin_ms is not None and self.fence_margin_ms > window - 2 * heartbeat_interval_ms(window):
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
        path = os.path.join(self.host.data_dir, PAIRING_FILE)
        try:
            os.unlink(path)
            _fsync_dir(self.host.data_dir)
        except FileNotFoundError:
            pass
        self.paired_id = None
        self._paired_window_ms = 0

    # -- attach / detach ------------------------------------------------------------------
    def attach(self, conn: "ReplicaConnection", req_id: int, from_lsn: int, incarnation: Any,
               failover_after_ms: int, name: str | None) -> None:
        host = self.host
        wal = host.wal
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
            log.warning("standby %s reconnected; dropping its previous connection", quote(name))
            self.replicas.pop(other.conn.session, None)
            other.conn.closed = True
            other.conn.transport.abort()
        replica = _Replica(conn, name, failover_after_ms)
        # Contact comes only from echoes of heartbeats sent from now on: this REPLICATE may have
        # been delayed in the network and come from a standby that has promoted since.
        replica.contact_ms = self._contact_ms
        self.replicas[conn.session] = replica
        mode = "stream"
        if incarnation != self.incarnation or from_lsn < 1 or not wal.has_lsn(from_lsn):
            mode = "snapshot"
        conn.send(P.encode_ok(req_id, {"incarnation": self.incarnation, "mode": mode,
                                       "epoch": host.table.epoch}))
        replica.base_cap = conn.out_cap
        if mode == "snapshot" and len(host.table) <= INLINE_SNAPSHOT_LEASES:
            # small: at once, and every later record follows in the live stream
            self._deliver_snapshot(replica, *self._take_snapshot(), None)
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
            conn.closed = True
            conn.transport.abort()
            return
        if conn.closed:
            return
        replica.catching_up = False  # same loop step as the last check: no batch falls between
        log.info("standby %s caught up: %d records from LSN %d", quote(replica.name), records, from_lsn)

    def _take_snapshot(self) -> tuple[int, int, int, list, int]:
        """``(lsn, epoch, counter, holders, now)``: the table now, the LSN it matches
        and the monotonic ms it was taken at."""
        table = self.host.table
        return self.host.wal.stats()["last_lsn"], table.epoch, table.counter, table.holders(), _now_ms()

    async def _send_snapshot(self, replica: _Replica) -> int:
        """Send the lock table as a snapshot, encoded off the loop; return the LSN it matches."""
        lsn, epoch, counter, holders, now = self._take_snapshot()
        frame = await asyncio.get_running_loop().run_in_executor(
            None, _encode_snapshot, lsn, epoch, counter, holders, self.incarnation, now)
        self._deliver_snapshot(replica, lsn, epoch, counter, holders, now, frame)
        return lsn

    def _deliver_snapshot(self, replica: _Replica, lsn: int, epoch: int, counter: int, holders: list, now: int,
                          frame: bytes | None) -> None:
        if frame is None:
            frame = _encode_snapshot(lsn, epoch, counter, holders, self.incarnation, now)
        conn = replica.conn
        # a standby may leave its snapshot unread plus the output cap (not just the cap)
        conn.out_cap = replica.base_cap + len(frame)
        conn.send(frame)
        conn.flush()
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
            conn.send(P.encode_push(PUSH_RECORDS, [first, last, data]))
            conn.flush()
            replica.sent.append((last, _now_ms()))
            records += last - first + 1
            await conn.drained()
        return records

    def detach(self, conn: "ReplicaConnection") -> None:
        replica = self.replicas.pop(conn.session, None)
        if replica is not None:
            if replica.task is not None:
                replica.task.cancel()
            log.warning("standby %s detached (acked LSN %d)", quote(replica.name), replica.acked_lsn)

    # -- streaming ------------------------------------------------------------------------
    def _on_batch(self, first_lsn: int, last_lsn: int, data: bytes) -> None:
        if not self.replicas:
            return
        msg = P.encode_push(PUSH_RECORDS, [first_lsn, last_lsn, data])
        now = _now_ms()
        for replica in list(self.replicas.values()):
            conn = replica.conn
            if conn.closed or replica.catching_up:
                continue
            conn.send(msg)
            conn.flush()  # drops a standby too far behind (it resyncs): see the server's output caps
            replica.sent.append((last_lsn, now))

    def _heartbeat(self) -> None:
        self._hb_timer = None
        if not self.replicas:
            return
        host = self.host
        now = _now_ms()
        msg = P.encode_push(PUSH_HEARTBEAT, [now, host.wal.stats()["last_lsn"], host.table.epoch,
                                              host.max_ttl_ms, self.paired_id, self._paired_window_ms])
        interval = 500
        for replica in self.replicas.values():
            if not replica.conn.closed:
                replica.conn.send(msg)
                replica.conn.flush()
            interval = min(interval, heartbeat_interval_ms(replica.failover_after_ms))
        self._check_fence(now)
        self._hb_timer = host.loop.call_later(interval / 1000.0, self._heartbeat)

    def on_ack(self, conn: "ReplicaConnection", echoed_ms: Any, applied_lsn: Any) -> None:
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
    @property
    def fenced(self) -> bool:
        """Is this primary fenced (as the node's role says)?"""
        return self.host.roles.fenced

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
        if self.fencing and not self.host.roles.fenced and now >= self._fence_deadline():
            self._fence(now)

    def _margin(self) -> int:
        return self.fence_margin_ms if self.fence_margin_ms is not None else self._paired_window_ms // 4

    def _fence_deadline(self) -> int:
        return self._contact_ms + self._paired_window_ms - self._margin()

    def _check_fence(self, now: int) -> bool:
        """Fence or unfence by the contact deadline; True if the primary may act at ``now``."""
        fenced = self.host.roles.fenced
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
        self._check_fence(_now_ms())

    def _fence(self, now: int) -> None:
        roles = self.host.roles
        if roles.role is not Role.PRIMARY:
            return  # a standby, promoting or deposed node grants nothing anyway
        window = self._paired_window_ms
        roles.set_fenced(True)  # holds every grant (the role decides the table's hold)
        log.warning(
            "no word from the standby for %d ms (failover window %d ms, margin %d ms): "
            "holding all grants, refusing extends and releases until it is back or `fastlock serve-alone`",
            now - self._contact_ms, window, self._margin(),
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
            host.table.expire(_now_ms())  # hand blocked locks to their waiters
        log.warning("fence lifted: granting again")
        host.after_batch()

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
                    "pairs again", quote(was))
        return {"serving_alone": True, "unpaired": was}

    def status(self) -> dict:
        now = _now_ms()
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
        if self._takeover_timer is not None:
            self._takeover_timer.cancel()
            self._takeover_timer = None
        if self._fence_timer is not None:
            self._fence_timer.cancel()
            self._fence_timer = None


class StandbyFollower:
    """The standby's side: follow a primary, apply its log, promote when told or when it is silent.

    Args:
        host: the standby's server, as :class:`~fastlock.replication_host.ReplicationHost`.
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

    def __init__(self, host: "ReplicationHost", primary: tuple[str, int], failover_after_ms: int = 0,
                 token: str | None = None, name: str | None = None,
                 on_primary_silent: Callable[[], None] | None = None, tls: ssl.SSLContext | None = None,
                 stream_limits: P.DecodeLimits | None = None):
        self.host = host
        # what the primary's stream may hold (a snapshot is one frame with every lease)
        self.stream_limits = stream_limits or P.stream_limits(256 << 20, 1_000_000)
        self.on_primary_silent = on_primary_silent
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
        #: lease name -> (token, deadline): a conservative deadline (this node's monotonic
        #: ms) of each replicated lease, kept by a promotion (see _track)
        self.lease_deadlines: dict[str, tuple[int, int]] = {}
        self._received_ms = 0  # when the push being applied arrived (this node's monotonic ms)
        self.connected = False
        self._task: asyncio.Task | None = None
        self._link: rpc.RpcConnection | None = None  # the connection to the primary
        self._ack_id = 0  # the request id every REPL_ACK on the link carries (acks get no reply)
        self._ack_due = False
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

    @property
    def stopped(self) -> bool:
        """Is this follower not following (never started, or stopped)?"""
        return self._task is None or self._task.done() or self._stopping

    def start(self) -> None:
        """Start (or, after :meth:`stop`, resume) following the primary."""
        self._stopping = False
        self._task = asyncio.ensure_future(self._run())
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
        link = self._link
        if link is None or link.closed or not self.last_hb_primary_ms:
            return False
        timeout_s = P.STEP_DOWN_FRESH_MS / 1000.0 + 0.5
        try:
            info = await asyncio.wait_for(link.request(P.OP_STEP_DOWN, epoch, self.last_hb_primary_ms), timeout_s)
        except (ConnectionError, asyncio.TimeoutError, FastlockError) as exc:
            log.warning("primary %s did not step down for epoch %d: %s", self.primary_address, epoch, exc)
            return False
        return type(info) is dict and info.get("role") != "primary"

    def stop(self) -> None:
        """Stop following (the connection is closed)."""
        self._stopping = True
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None
        if self._link is not None:
            self._link.close()
        if self._task is not None:
            self._task.cancel()

    async def _run(self) -> None:
        backoff = 0.05
        loop = asyncio.get_running_loop()
        while not self._stopping:
            lost = loop.create_future()

            def on_close(_conn: rpc.RpcConnection, error: Exception, lost: asyncio.Future = lost) -> None:
                if not lost.done():
                    lost.set_result(error)

            tls = self.tls
            address = self.primary
            try:
                _, link = await asyncio.wait_for(loop.create_connection(
                    lambda: rpc.RpcConnection(address, max_frame=None, limits=self.stream_limits,
                                              on_push=self._on_push,
                                              on_read_end=self._on_read_end, on_close=on_close),
                    *address, ssl=tls, server_hostname=address[0] if tls else None,
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
            self._link = link
            self._ack_id = link.next_id()
            host = self.host
            try:
                if not await self._primary_proves_itself(link):
                    link.close()
                    await asyncio.sleep(backoff)
                    backoff = min(backoff * 2, 5.0)
                    continue
                hello = await asyncio.wait_for(
                    link.request(P.OP_HELLO, P.PROTOCOL_VERSION, f"standby:{self.name or os.getpid()}",
                                  self.token, host.table.epoch), 5.0)
                if self.principal is None and type(hello.get("principal")) is str:
                    self.principal = hello["principal"]  # authenticated by our certificate
                their_epoch = P.check_epoch(hello.get("epoch", 0), "primary's epoch")
                self.primary_epoch = max(self.primary_epoch, their_epoch)
                host.node_state.raise_epoch(self.primary_epoch)
                if their_epoch < host.table.epoch:
                    # this node was promoted since it last followed that node: never follow
                    # a lower epoch, and ask it to step down (it may still think it is primary)
                    self.refused = (f"{self.primary_address} is at epoch {their_epoch}, below this "
                                    f"node's epoch {host.table.epoch}: it is a deposed primary")
                    log.critical("refusing to follow: %s; restart this node as the primary, or point it "
                                 "at the current primary", self.refused)
                    if hello.get("role") == "primary":
                        try:
                            await asyncio.wait_for(link.request(P.OP_STEP_DOWN, host.table.epoch,
                                                                hello.get("clock_ms")), 5.0)
                        except (ConnectionError, asyncio.TimeoutError, FastlockError) as exc:
                            log.error("%s did not step down for epoch %d: %s", self.primary_address,
                                      host.table.epoch, exc)
                    link.close()
                    return
                info = await asyncio.wait_for(
                    link.request(P.OP_REPLICATE, self.applied_lsn + 1 if self.synced else 0,
                                  self.incarnation, self.failover_after_ms, self.name), 5.0)
                self.connected = True
                self._refused_credentials = None
                self._connect_error = None
                backoff = 0.05
                log.info("replicating from %s (%s)", self.primary_address, quote(info.get("mode")))
                await lost
            except (ConnectionError, asyncio.TimeoutError, FastlockError) as exc:
                if isinstance(exc, (AuthError, PermissionDenied)):
                    # credentials do not fix themselves: say it once, not on every retry
                    if str(exc) != self._refused_credentials:
                        self._refused_credentials = str(exc)
                        log.error("primary %s refused this standby's credentials: %s (retrying)",
                                  self.primary_address, quote(str(exc)))
                else:
                    log.warning("replication from %s failed: %s", self.primary_address, quote(str(exc)))
                link.close()
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 1.0)
            finally:
                self.connected = False
                self._link = None
            if not self._stopping:
                log.warning("lost the replication connection to %s", self.primary_address)

    async def _primary_proves_itself(self, link: "rpc.RpcConnection") -> bool:
        """Before our token goes out: the primary must answer our random challenge with
        the proof only a holder of our credential can make (see :mod:`fastlock.auth`).

        Raises what the request raises (AuthError if the primary does not know our
        principal); returns False if the proof is wrong.
        """
        if self.principal is None:
            return True  # no replica token: the primary refuses REPLICATE, nothing to protect
        challenge = os.urandom(32)
        answer = await asyncio.wait_for(
            link.request(P.OP_HELLO, P.PROTOCOL_VERSION, f"standby:{self.name or os.getpid()}",
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
    def _on_push(self, kind: Any, payload: Any) -> None:
        """Apply one push of the primary's stream (the link calls this in order).

        An error raised here (a gap, a lower epoch, a malformed payload) makes
        the link drop the connection; the follower reconnects and resyncs.
        """
        if kind not in P.REPLICATION_PUSH_KINDS:
            return
        self.last_heard_ms = self._received_ms = _now_ms()
        self._ack_due = True
        if kind == PUSH_HEARTBEAT:
            primary_ms, last_lsn, epoch, max_ttl_ms, paired_id, paired_window_ms = payload
            P.check_epoch(epoch, "heartbeat epoch")
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
                self.host.node_state.raise_ttl(max_ttl_ms)
            self.host.node_state.raise_epoch(epoch)
        elif kind == PUSH_RECORDS:
            first, last, data = payload
            self._apply_records(decode_frames(data, first))
            self.primary_last_lsn = max(self.primary_last_lsn, last)
        elif kind == PUSH_RECORD:
            lsn, rec = payload
            self._apply_records([(lsn, rec)])
        elif kind == PUSH_SNAPSHOT:
            self._apply_snapshot(*payload)

    def _on_read_end(self) -> None:
        """One acknowledgement per read, however many batches it held."""
        link = self._link
        if self._ack_due and self.last_hb_primary_ms and link is not None and not link.closed:
            self._ack_due = False
            link.write_raw(P.encode_request(self._ack_id, P.OP_REPL_ACK, self.last_hb_primary_ms,
                                            self.applied_lsn))

    def _apply_snapshot(self, lsn: int, epoch: int, counter: int, holders: list, incarnation: str) -> None:
        host = self.host
        table = host.table
        wal = host.wal
        P.check_epoch(epoch, "snapshot epoch")
        if epoch < table.epoch:
            # never replace a newer epoch's leases with an older primary's state
            raise ProtocolError(f"snapshot at epoch {epoch} is below this node's epoch {table.epoch}")
        if epoch > table.epoch:
            table.set_epoch(epoch)
            wal.log_epoch(epoch)
        table.advance_counter(counter)
        holders = [_snapshot_holder(h) for h in holders]
        wanted = {h[0]: h for h in holders}
        for h in table.holders():
            w = wanted.get(h.name)
            if w is None or w[1] != h.token:
                table.remove_holder(h.name, h.token, 0)
                wal.log_release(h.name, h.token)
        self.lease_deadlines.clear()
        for name, token, owner, ttl_ms, delay_ms, client, corr, remaining_ms in holders:
            current = table.holder(name, 0)
            if current is None or current.token != token or current.ttl_ms != ttl_ms:
                self._install(name, token, owner, ttl_ms, delay_ms, client, corr)
            self._track(name, token, remaining_ms)
        table.drain_events()
        self.applied_lsn = lsn
        self.incarnation = incarnation
        self.primary_epoch = max(self.primary_epoch, epoch)
        self.synced = True
        log.info("applied snapshot at primary LSN %d: %d leases, epoch %d", lsn, len(holders), epoch)

    def _install(self, name, token, owner, ttl_ms, delay_ms, client, corr) -> None:
        host = self.host
        host.table.install_holder(name, token, owner, ttl_ms, delay_ms, (client, corr), 0)
        host.wal.log_grant(name, token, owner, ttl_ms, delay_ms, client, corr)
        self._track(name, token, ttl_ms)
        if ttl_ms > self.max_ttl_ms:
            self.max_ttl_ms = ttl_ms
            host.node_state.raise_ttl(ttl_ms)

    def _track(self, name: str, token: int, remaining_ms: int) -> None:
        """Keep the lease's deadline: the push's arrival plus the time it had left.

        The primary sends a grant or extend record after making it, and a snapshot's
        ``remaining_ms`` after measuring it, so on clocks running at the same rate
        this deadline is never earlier than the primary's - nor than the holder's
        own, which counts from before it asked.  Only a promotion reads it; the
        standby's table itself expires nothing.
        """
        self.lease_deadlines[name] = (token, self._received_ms + remaining_ms)

    def lease_deadline(self, name: str, token: int) -> int | None:
        """The kept deadline (this node's monotonic ms) of lease ``name`` with ``token``,
        or None if this standby has not received it since it started (recovered
        from its own log: its remaining time is unknown)."""
        kept = self.lease_deadlines.get(name)
        return kept[1] if kept is not None and kept[0] == token else None

    def _apply_records(self, records) -> None:
        host = self.host
        table = host.table
        wal = host.wal
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
                    self.lease_deadlines.pop(name, None)
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
                    self._track(name, token, ttl_ms)
                    self.max_ttl_ms = max(self.max_ttl_ms, ttl_ms)
            elif kind == EPOCH:
                epoch = P.check_epoch(rec[1], "epoch record")
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
        interval_ms = heartbeat_interval_ms(self.failover_after_ms)
        due_ms = _now_ms() + interval_ms
        self._watchdog = self.host.loop.call_later(interval_ms / 1000.0,
                                                   lambda: self._check_silence(late_ms=_now_ms() - due_ms))

    def _check_silence(self, late_ms: int = 0) -> None:
        """The watchdog: promote (through ``on_primary_silent``) once the paired
        primary has been silent for the failover window.  ``late_ms`` is how late
        the watchdog ran: more than a heartbeat interval means this process was
        stalled itself (SIGSTOP, a VM pause) and has not yet read what the
        primary sent meanwhile, so it checks again one interval later instead of
        promoting over a primary that only this node failed to hear."""
        self._watchdog = None
        if self._stopping:
            return
        if self.host.roles.role is not Role.STANDBY:  # a manual promotion in progress: it may yet be refused
            self._arm_watchdog()
            return
        now = _now_ms()
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
