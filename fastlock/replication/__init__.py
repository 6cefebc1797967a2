"""Log shipping to a standby, standby apply, and the primary's self-fencing.

This package sees the server only through
:class:`~fastlock.replication.host.ReplicationHost` (the table, the WAL, a
snapshot, the batch end, the loop, the node state and the role object) and
never imports it.  Its modules: :mod:`~fastlock.replication.host` (that
interface), :mod:`~fastlock.replication.source` (the primary's side),
:mod:`~fastlock.replication.follower` (the standby's side) with
:mod:`~fastlock.replication.link` (its connection to the primary),
:mod:`~fastlock.replication.messages` (the stream's payloads),
:mod:`~fastlock.replication.syncrep` (synchronous replication) and
:mod:`~fastlock.replication.node_state` (pairing, epochs and role files).  The
node's role is declared in :mod:`fastlock.roles` and changes only there; the
decisions to promote, step down or serve alone are in :mod:`fastlock.server.failover`.

Roles
-----
primary
    Serves clients.  Each standby that connects gets a snapshot (when it is
    new, or its position is no longer in the log) or the log from its
    position, both prepared off the event loop and sent only as fast as the
    standby reads them, and then every WAL batch as it is written - *after*
    its fsync in ``--fsync always`` mode, so a standby never holds a record
    the primary could still lose.  Replication is asynchronous by default: the
    primary never waits for a standby, and drops one that leaves more than
    ``--max-replica-output-bytes`` unread (it reconnects and resyncs).  With
    ``--replication sync`` grant and extend replies wait for the standby's
    ``SYNC_ACK`` (:mod:`~fastlock.replication.syncrep`, which also says when a
    promotion needs no grace period).
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
and renewals look for the new primary at once.  A fenced primary also asks
its paired standby's address (announced in ``REPLICATE``) what is there, and
steps down and follows it when it is the primary at a higher epoch
(:mod:`~fastlock.replication.rejoin`, :mod:`fastlock.server.failover`).

With ``--coordinator`` (:mod:`fastlock.coordination`, :mod:`fastlock.server.coordinated`)
etcd decides instead: the primary's etcd lease is its fence (the source is
*coordinated*: any number of standbys attach, none is paired, their echoes
fence nothing), and standbys never promote on silence.

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

Wire messages (see :mod:`fastlock.protocol` for the framing, and
:mod:`~fastlock.replication.messages` for the payloads' types)::

    standby -> primary  [id, HELLO, version, name, {"principal", "challenge"}]      -> {"principal", "proof"}
                        [id, HELLO, version, name, replica_token, epoch]          -> hello info
                        [id, REPLICATE, from_lsn, incarnation|None, failover_after_ms, "[label@]node_id"
                         (, "host:port" where it serves clients or None (, "host:port" of the witness it
                         asks before promoting, fastlock.replication.witness)): kept in pairing.json)]
                        [id, REPL_ACK, echoed_primary_ms, applied_lsn]          (no reply)
                        [id, STEP_DOWN, new_epoch, echoed_primary_ms]           -> {"role", "epoch"}
                        [id, SYNC_ACK, lsn]          (no reply; --replication sync, see syncrep)
    primary -> standby  [0, "snap", [lsn, epoch, counter, holders, incarnation]]
                        (holder: [name, token, owner_hash, ttl_ms, lock_delay_ms, client, corr, 0, remaining_ms];
                        owner keys travel only as their hashes)
                        [0, "repl", [first_lsn, last_lsn, frames]]               (WAL batch bytes)
                        [0, "rec",  [lsn, record]]              (one record: accepted from older primaries)
                        [0, "hb",   [primary_ms, last_lsn, epoch, longest_ttl_ms, paired_id, paired_window_ms]]
                        [0, "sync", [ack_point, in_sync, on_timeout]]   (with each heartbeat, sync mode only)
"""

from ..errors import NodeFileDamaged
from .follower import StandbyApply, StandbyFollower
from .host import ReplicaConnection, ReplicationHost
from .link import PrimaryLink
from .messages import Heartbeat, SnapshotHolder, heartbeat_interval_ms, standby_identity
from .node_state import (
    DEPOSED_FILE,
    NODE_ID_FILE,
    PAIRING_FILE,
    STATE_FILE,
    NodeState,
    Pairing,
    node_id,
    read_deposed,
    read_pairing,
    remove_pairing,
    write_deposed,
    write_pairing,
)
from .source import BACKLOG_CHUNK_BYTES, INLINE_SNAPSHOT_LEASES, ReplicationSource

__all__ = [
    "ReplicationSource",
    "StandbyFollower",
    "StandbyApply",
    "PrimaryLink",
    "ReplicationHost",
    "ReplicaConnection",
    "NodeState",
    "NodeFileDamaged",
    "Pairing",
    "Heartbeat",
    "SnapshotHolder",
    "heartbeat_interval_ms",
    "standby_identity",
    "node_id",
    "read_deposed",
    "write_deposed",
    "read_pairing",
    "write_pairing",
    "remove_pairing",
    "DEPOSED_FILE",
    "NODE_ID_FILE",
    "PAIRING_FILE",
    "STATE_FILE",
    "BACKLOG_CHUNK_BYTES",
    "INLINE_SNAPSHOT_LEASES",
]
