"""The etcd arbiter: which node is the primary, held as a key under an etcd lease.

Keys under the coordinator's ``PREFIX`` (one prefix per fastlock group):

``PREFIX/primary``
    ``{"node", "address", "epoch"}`` (JSON) of the primary, attached to that
    node's etcd lease: it disappears when the lease runs out (the node died,
    froze or lost etcd) or is revoked (the node stopped cleanly).
``PREFIX/epoch``
    the highest epoch ever taken (decimal).  Taking the primary key raises
    it in the same transaction, which also checks that it did not change
    since it was read: two nodes can never take the same epoch, and epochs
    only grow (fastlock tokens are ``epoch << 40 | counter``).  The new epoch
    is also above every epoch the node has seen itself (``min_epoch``), so a
    wiped etcd never hands out an epoch again.  A value that is not credible
    (:mod:`~fastlock.coordination.records`) is refused and logged: a primary
    rewrites it to its own epoch, a bid to the one after what the node knows.
``PREFIX/members/NODE``
    ``{"node", "address", "position", "epoch", "lease", "ident"[, "principal"]}`` of each live
    node (its WAL position: the applied LSN of a standby, the last LSN of the
    primary; ``ident``: its data directory's permanent identity, the
    ``node-id`` file; ``principal``: the replica principal its standby token names,
    absent for a node without a token), attached to the node's lease; at every renewal one transaction
    checks it is still under that lease, rewriting it if it changed, or creates it if
    it is absent: never over another lease, so one node id is one live
    process.  A node that finds the key under another lease waits up to twice
    the TTL for that lease to run out (its data directory's previous run, dead
    with its lease still alive, lets it go within the TTL), then refuses
    (:class:`NodeIdInUse`, naming the other node's address; a copy of a live
    node's data directory has its ``ident``).  No node revokes a lease it did
    not take.  Until it holds its member key a node neither follows nor bids.

How a node holds the primary role (:class:`EtcdArbiter`): it renews its
lease every quarter TTL and counts the lease valid until the time it *sent*
the last successful renewal plus the TTL, minus a self-fencing margin
(default a quarter of the TTL), all on its own monotonic clock.  etcd counts
the TTL from when it *received* the renewal, later, so the node's view
always ends first (as long as the two clocks run at rates that differ by
less than margin / TTL): the node stops granting (:meth:`EtcdArbiter.may_grant`
turns False, ``on_fenced(True)``) before etcd can free the key for another
node.  A renewal that says the lease is gone, or a read of the primary key
that shows another lease or no key, means the role is lost:
``on_lost(why)`` at once, and the node stops being a candidate.

How a standby takes the key: when it reads no primary key, it compares its
position with the other live members'; behind one of them it waits
``behind_delay_ms`` (so the caught-up one wins if it is alive), then tries
the transaction ``create_revision(primary) == 0 and mod_revision(epoch) ==
<read>``; only one of several racing nodes can succeed.

The heartbeat rule (``heartbeat=True``, the default): without it a dead
primary's key goes only when etcd expires its lease, one TTL after etcd
received the last renewal *plus* up to 500 ms (etcd 3.4 checks expiries every
500 ms).  With it a standby deletes a silent primary's key itself:

``PREFIX/heartbeat``
    ``{"node", "epoch"}`` (JSON, no lease).  The bid that takes the primary key
    writes it in the same transaction, and the primary key's value says
    ``"heartbeat": TTL`` (the primary's TTL, ms).  At each of its steps (every quarter TTL) the
    primary writes it again by a transaction conditional on the primary key's
    ``create_revision`` being the one its bid created, and between its steps whenever
    :data:`BEATS_PER_TTL`-th of the TTL has passed since its last heartbeat was sent (a
    heartbeat alone, one request, with a lease renewal beside it when the last one is as old:
    after a stall both go out first, before the step's renewal and member key).

The primary's clock
    A heartbeat sent at local monotonic time ``t`` that succeeds makes the
    primary valid until ``t + TTL * (1 - HEARTBEAT_DRIFT) - margin``; the
    primary may grant until the *earlier* of that and the lease deadline
    above (the key can go either way; the fence timer closes at the earlier).
The standby's clock
    A standby notes each heartbeat revision (from its watch of the key, or
    read with the primary key at each step) with the time it *first* saw it
    on its own monotonic clock, ``t_observed``.  etcd applied the heartbeat
    before any reply or watch event could carry its revision, and the
    primary sent it before etcd applied it: ``t_observed >= t_sent`` in real
    time (a step that cannot reach etcd forgets the sighting: the next
    revision read is first seen then, so an etcd outage is never counted
    against a live primary).  Once that revision has stood for one TTL on the standby's clock
    (the longer of its own TTL and the one the primary key states) it
    deletes the primary key by a transaction comparing the key's
    ``create_revision`` and the heartbeat's ``mod_revision``.
Why two primaries never grant at once
    A heartbeat newer than the one the standby saw fails the delete; a
    delete that succeeds makes every later heartbeat fail (the key is gone,
    or re-created with another ``create_revision``).  So the old primary's
    last successful heartbeat is the one the standby saw (or an older one),
    and its validity ended ``TTL * (1 - HEARTBEAT_DRIFT) - margin`` after its
    send on its clock, before the delete one TTL after ``t_observed`` on the
    standby's clock, as long as the two clocks' rates differ by less than
    the drift margin (1 %; ``margin`` adds a quarter TTL on top).  Only
    then can a bid take the key.  A delete delayed in the network (or sent by
    a standby partitioned from etcd, once it gets through) is only later:
    its compares still hold or it fails.  Two standbys deleting at once
    compare the same revisions: one succeeds, the other finds the key gone
    (or new) and fails; either then bids as usual, and the bid's
    ``create_revision == 0`` lets one win.  A primary cut off from etcd
    cannot heartbeat: it fences itself by its own clock, before any standby's
    TTL has passed.
What a stall costs
    A primary that stalls (SIGSTOP, a VM freeze, a loaded core) for ``S`` right after
    a heartbeat, whose next heartbeat was due ``TTL / BEATS_PER_TTL`` later, sends it
    (and a lease renewal) at once on resuming; a standby deletes the key only if that
    heartbeat lands more than one TTL after its sighting of the previous one, and etcd
    frees it only if the renewal lands more than one TTL after the previous one: a stall
    of up to about ``TTL * (1 - 1 / BEATS_PER_TTL)`` minus one etcd request keeps the primary (it
    may be fenced for a moment: its own validity ends ``TTL * (1 - HEARTBEAT_DRIFT) -
    margin`` after its last heartbeat's send).  The standby's wait stays one TTL: a longer wait would add to every
    failover after a crash.
Fallback and mixed versions
    The lease is untouched: a dead primary's key still goes with its lease
    when no standby deletes it first (no standby reaching etcd, or the rule
    off).  A standby deletes only a key whose value states a
    ``"heartbeat"`` TTL: a primary that does not know the rule (an older version, or
    ``heartbeat=False``) writes no such flag and keeps the lease-only
    behaviour; a standby that does not know the rule never deletes.  Both
    mixes are safe.  The pair witness (:mod:`fastlock.replication.witness`) is not
    involved.

This module speaks etcd's v3 JSON gateway through
:class:`~fastlock.coordination.gateway.EtcdGateway` (httpx, the optional
extra ``fastlock[etcd]``).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable
from typing import NamedTuple

from ..errors import FastlockError, InvalidArgument
from ..logsafe import RateLimitedLog
from ..protocol import MAX_EPOCH
from ..units import monotonic_ms
from .gateway import EtcdGateway, EtcdRefused, EtcdUnavailable, KeyValue, b64
from .records import (
    EPOCH_ALLOWANCE,
    ArbiterListener,
    EpochReading,
    MemberKey,
    PrimaryRecord,
    credible_epoch,
    json_object,
    read_epoch,
)

log = logging.getLogger("fastlock.coordination")

#: the most member keys read when choosing the most caught-up standby
MAX_MEMBERS = 1000
#: the longest node id (characters)
MAX_NODE_ID = 128
#: the heartbeat rule's rate-drift margin: a heartbeat keeps the primary valid for
#: ``TTL * (1 - HEARTBEAT_DRIFT) - margin`` (own clock), shorter than the TTL a standby waits
#: (its own clock) by more than two clocks running at rates 1 % apart can make up
HEARTBEAT_DRIFT = 0.01
#: the longest primary TTL (ms) a standby accepts from a primary key's ``heartbeat`` field
MAX_HEARTBEAT_TTL_MS = 3_600_000
#: a primary heartbeats and renews its lease at least every ``TTL / BEATS_PER_TTL`` (its steps do
#: both every quarter TTL; its own heartbeats go between them): the longest stall a primary
#: survives is about ``TTL`` less this period less one etcd request (the module docstring)
BEATS_PER_TTL = 8


class BeatSighting(NamedTuple):
    """A heartbeat revision as a standby first saw it."""

    primary_rev: int  #: the primary key's create_revision read with it (0: none)
    revision: int  #: the heartbeat key's mod_revision (0: no such key)
    seen_at: int  #: own monotonic clock (ms) when this node first saw it (after etcd applied it)


class ArbiterTiming(NamedTuple):
    """An arbiter's times, all in milliseconds."""

    ttl_ms: int  #: the etcd lease TTL (whole seconds)
    margin_ms: int  #: how long before the lease's end (own clock) the node stops granting
    behind_delay_ms: int  #: how long a standby behind another live one waits before it bids


class NodeIdInUse(FastlockError, RuntimeError):
    """Another live node (another data directory) holds this node id's member key in etcd:
    two processes under one ``--node-id`` would overwrite each other's advertised position
    and take each other's primary key for their own."""


def _no_epoch() -> int:
    """No epoch known (:attr:`EtcdArbiter.known_epoch` of a node that is not sharded)."""
    return 0


def _no_move_in() -> bool:
    """No move into this node's group (:attr:`EtcdArbiter.moving_in` of a node that is not sharded)."""
    return False


async def _nothing_to_read() -> None:
    """Nothing to read before a bid (:attr:`EtcdArbiter.before_bid` of a node that is not sharded)."""


class EtcdArbiter:
    """One node's view of, and bid for, the primary key (see the module docstring).

    Args:
        gateway: the etcd client.
        prefix: the group's key prefix (``/fastlock``).
        node: this node's id (at most :data:`MAX_NODE_ID` characters).
        address: ``host:port`` clients and standbys reach this node at.
        listener: asked for the node's position, epoch and candidacy; told of
            elections, fences, losses and other primaries.
        ttl_ms: the etcd lease TTL (ms; rounded up to whole seconds, at least 1 s).
        margin_ms: how long before the lease's end (by this node's clock) it
            stops granting (default: a quarter of the TTL).
        behind_delay_ms: how long a standby behind another live one waits
            before it bids (default: half the TTL).
        clock: monotonic ms.
        ident: this node's data directory identity (its ``node-id`` file), kept in its
            member key (a refusal says when the live holder has the same one: a copy).
        heartbeat: follow the heartbeat rule (the module docstring): as a primary, write
            ``PREFIX/heartbeat`` at each step and count validity from it too; as a standby,
            delete the primary key of a primary that follows the rule once its heartbeat has
            not moved for one TTL.  False: a dead primary's key goes only with its lease.
        principal: this node's replica principal (the name its standby token claims; "":
            none), kept in its member key: a primary counts an in-sync copy of this node only
            from a standby that authenticated as it (:mod:`fastlock.replication.groupsync`).

    Raises:
        InvalidArgument: a node id that is empty or too long, a TTL or margin out of range.
    """

    def __init__(self, gateway: EtcdGateway, prefix: str, node: str, address: str, listener: ArbiterListener, *,
                 ttl_ms: int = 2000, margin_ms: int | None = None, behind_delay_ms: int | None = None,
                 clock: Callable[[], int] = monotonic_ms, ident: str = "", heartbeat: bool = True,
                 principal: str = ""):
        if type(node) is not str or not 0 < len(node) <= MAX_NODE_ID or "/" in node or not node.isprintable():
            raise InvalidArgument(f"node id must be 1..{MAX_NODE_ID} printable characters without '/', "
                                  f"not {node!r}")
        ttl = max(1, -(-ttl_ms // 1000)) * 1000
        margin = ttl // 4 if margin_ms is None else margin_ms
        if not 0 <= margin < ttl // 2:
            raise InvalidArgument(f"coordinator margin must be 0..{ttl // 2 - 1} ms (under half the "
                                  f"{ttl} ms lease TTL), not {margin}")
        self.timing = ArbiterTiming(ttl, margin, ttl // 2 if behind_delay_ms is None else behind_delay_ms)
        self.gateway = gateway
        self.prefix = prefix.rstrip("/")
        self.node = node
        self.address = address
        self.listener = listener
        self.clock = clock
        #: does this node hold the primary key (it may still be fenced: see may_grant)?
        self.holding = False
        self.fenced = False
        self.epoch = 0
        self.lease = 0
        self.primary: PrimaryRecord | None = None
        self.stepped_down = False  # lost the key: no bids until the node rejoins (see rejoined)
        self.last_error: str | None = None
        self._renewed_at = 0  # send time (own clock, ms) of the last successful grant or renewal
        self._advertised_at: int | None = None  # own clock (ms) when the member key was last found this node's
        self._bid_epoch: EpochReading | None = None  # PREFIX/epoch as read for the bid under way
        self._free_since: int | None = None
        self._task: asyncio.Task | None = None
        self._watch_task: asyncio.Task | None = None  # the primary key's watch (see _watch_key)
        self._fence_timer: asyncio.TimerHandle | None = None
        self._wake: asyncio.Event | None = asyncio.Event()  # None once closed
        self._member = MemberKey(ident)
        #: this node's replica principal (from its token; "": unknown), named in its member key
        self.principal = principal
        #: the heartbeat rule (see the module docstring); off: a dead primary's key goes with its lease
        self.heartbeat = heartbeat
        self._primary_rev = 0  # create_revision of the primary key this node took (the heartbeat's condition)
        self._beat_at = 0  # send time (own clock, ms) of the last successful heartbeat (or bid)
        self._beat_sent = 0  # send time (own clock, ms) of the last heartbeat sent, answered or not
        self._pulse_task: asyncio.Task | None = None  # the primary's heartbeats between steps (_pulse)
        #: an epoch this node's group is known to go to (read at each use; 0: none): a bid goes above
        #: it, and etcd's epoch up to :data:`~fastlock.coordination.records.EPOCH_ALLOWANCE` above it
        #: is credible as above :meth:`seen_epoch`.  A shard group's node gives the epoch above the
        #: token floors its shard map records for the group's slots
        #: (:meth:`fastlock.server.sharded.ShardGate.floors_epoch`): its primary raises the group's
        #: epoch in etcd there before it grants those slots' names
        self.known_epoch: Callable[[], int] = _no_epoch
        #: whether a move into this node's group is under way (read at each use): its primary's
        #: import may raise the group's epoch to the source's, by any amount, which its standbys
        #: learn only by replication; while it is, etcd's epoch is credible whatever it is, so a
        #: standby that missed the import still bids above it
        #: (:meth:`fastlock.server.sharded.ShardGate.moving_in`)
        self.moving_in: Callable[[], bool] = _no_move_in
        #: awaited before a bid reads ``PREFIX/epoch``: a shard group's node reads its map in etcd
        #: there (:meth:`fastlock.server.sharded.ShardGate.read_before_bid`), so that :attr:`moving_in`
        #: and :attr:`known_epoch` judge the epoch by the map as etcd holds it, not by a watch that
        #: may lag (a standby whose watch had not yet delivered a move's mark would bid below the
        #: epoch the move's import raised its group to); it raises :class:`EtcdUnavailable` when it
        #: has no map to judge by, and the bid waits for the next step
        self.before_bid: Callable[[], Awaitable[None]] = _nothing_to_read
        self._beat: BeatSighting | None = None  # the heartbeat revision as this node first saw it
        self._beat_timer: asyncio.TimerHandle | None = None
        self._beat_watch_task: asyncio.Task | None = None
        #: primary keys this node deleted by the heartbeat rule (for STATUS)
        self.heartbeat_deletes = 0
        #: a refused ``PREFIX/epoch`` is logged at most every 10 s (someone may rewrite it in a loop)
        self._refused_epoch = RateLimitedLog(log, logging.ERROR, 10.0)

    @property
    def ttl_ms(self) -> int:
        """The etcd lease TTL (ms, whole seconds)."""
        return self.timing.ttl_ms

    @property
    def margin_ms(self) -> int:
        """How long before the lease's end (own clock) this node stops granting (ms)."""
        return self.timing.margin_ms

    # -- the keys -----------------------------------------------------------------------------
    @property
    def primary_key(self) -> str:
        return f"{self.prefix}/primary"

    @property
    def heartbeat_key(self) -> str:
        return f"{self.prefix}/heartbeat"

    @property
    def epoch_key(self) -> str:
        return f"{self.prefix}/epoch"

    @property
    def members_prefix(self) -> str:
        return f"{self.prefix}/members/"

    # -- the answer ----------------------------------------------------------------------------
    @property
    def valid_until_ms(self) -> int:
        """Until when (own monotonic ms) this node may grant, if it holds the key: the lease's
        deadline, and with the heartbeat rule the earlier of it and the last heartbeat's."""
        lease_until = self._renewed_at + self.ttl_ms - self.margin_ms
        if not self.heartbeat:
            return lease_until
        return min(lease_until, self._beat_at + int(self.ttl_ms * (1 - HEARTBEAT_DRIFT)) - self.margin_ms)

    def may_grant(self, now: int | None = None) -> bool:
        """Does this node hold the key with a lease not yet past its fencing deadline?"""
        return self.holding and (self.clock() if now is None else now) < self.valid_until_ms

    def fence_if_due(self, now: int) -> None:
        """Tell the listener the fence closed if the deadline has passed (before a grant
        is acknowledged, a timer callback may not have run yet after a stall)."""
        if self.holding and not self.fenced and now >= self.valid_until_ms:
            self._set_fenced(True)

    # -- life cycle ----------------------------------------------------------------------------
    def start(self) -> None:
        """Start renewing, watching and bidding (on the running loop)."""
        if self._task is None:
            self._task = asyncio.ensure_future(self._run())
            self._watch_task = asyncio.ensure_future(self._watch_key(self.primary_key, lambda kind: self.poke()))
            if self.heartbeat:
                self._beat_watch_task = asyncio.ensure_future(
                    self._watch_key(self.heartbeat_key, lambda kind: None, self._on_beat_event))
                self._pulse_task = asyncio.ensure_future(self._pulse())

    async def claim(self) -> None:
        """Take this node id's member key before :meth:`start` (see the module docstring):
        return once it is this node's, or at once if etcd does not answer (the steps
        claim it then).

        Raises:
            NodeIdInUse: another live node holds it (after waiting twice the TTL).
            EtcdRefused: etcd refused this node (TLS, login or permission on the prefix):
                the node must not start.
        """
        try:
            await self.gateway.probe()
        except EtcdRefused:
            raise
        except EtcdUnavailable as exc:
            log.warning("etcd: %s (node id %r is claimed once etcd answers)", exc, self.node)
            return
        while True:
            try:
                await self._renew()
                if await self._advertise():
                    return
            except EtcdRefused as exc:
                raise EtcdRefused(f"{exc} (the group's prefix is {self.prefix}/)") from None
            except EtcdUnavailable as exc:
                log.warning("etcd: %s (node id %r is claimed once etcd answers)", exc, self.node)
                return
            await asyncio.sleep(max(50, self.ttl_ms // 4) / 1000.0)

    async def close(self, *, revoke: bool = True) -> None:
        """Stop; with ``revoke`` give the lease back (the key is free at once for another node)."""
        if self._wake is None:
            return
        self._wake = None
        for watch in (self._watch_task, self._beat_watch_task, self._pulse_task):
            if watch is not None:
                watch.cancel()
        self._watch_task = self._beat_watch_task = self._pulse_task = None
        if self._beat_timer is not None:
            self._beat_timer.cancel()
            self._beat_timer = None
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            try:
                await task
            except (asyncio.CancelledError, Exception):  # noqa: BLE001 - stopping
                pass
        if self._fence_timer is not None:
            self._fence_timer.cancel()
        if revoke and self.lease:
            try:
                await self.gateway.revoke(self.lease)
            except EtcdUnavailable as exc:
                log.warning("could not revoke the etcd lease at stop (it runs out by itself): %s", exc)
        self.holding = False
        await self.gateway.close()

    async def resign(self) -> None:
        """Give the key up (this node could not become the primary after taking it): the
        lease is revoked, so the key is free at once, and the next step bids again with a
        new lease.

        Raises:
            EtcdUnavailable: etcd did not answer; the key then goes when the lease runs out
                (this node no longer renews it).
        """
        lease, self.lease = self.lease, 0
        self.holding = self.fenced = False
        if self._fence_timer is not None:
            self._fence_timer.cancel()
            self._fence_timer = None
        log.warning("etcd: giving the primary role up (lease %x revoked)", lease)
        if lease:
            await self.gateway.revoke(lease)

    def rejoined(self) -> None:
        """The node that lost the key follows the new primary as a standby: it may bid again."""
        self.stepped_down = False

    def poke(self) -> None:
        """Run the next step now instead of at the next quarter TTL."""
        if self._wake is not None:
            self._wake.set()

    async def _run(self) -> None:
        interval = max(50, self.ttl_ms // 4) / 1000.0
        while True:
            wake = self._wake
            if wake is None:
                return
            wake.clear()  # before the step: a poke during it (the watch's) runs the next one at once
            try:
                await self.step()
                self.last_error = None
            except NodeIdInUse as exc:
                log.critical("etcd: %s", exc)
                self.listener.on_refused(str(exc))
                return
            except EtcdUnavailable as exc:
                if self.last_error is None:
                    log.warning("etcd: %s", exc)
                self.last_error = str(exc)
                self._forget_beat()
            except Exception:
                log.exception("etcd arbiter step failed")
            if self._wake is None:
                return
            try:
                await asyncio.wait_for(wake.wait(), interval)
            except asyncio.TimeoutError:
                pass

    async def _watch_key(self, key: str, on_event: Callable[[str], None],
                         on_value: Callable[[KeyValue], None] | None = None) -> None:
        """Watch ``key`` until closed, reopening the stream after a pause.  The primary key's
        watch runs a step at each change: a standby sees the key freed as soon as etcd frees
        it (not at its next step), a primary sees it taken or gone.  The heartbeat's watch
        notes each new heartbeat revision as soon as etcd applies it.  The steps still run
        every quarter TTL and read both keys: a change missed while a watch reconnects is seen
        then."""
        backoff = 0.1
        while self._wake is not None:
            started = self.clock()
            try:
                await self.gateway.watch(key, on_event, on_value)
            except EtcdUnavailable as exc:
                log.debug("etcd: watch of %s: %s (again in %.1f s)", key, exc, backoff)
            except Exception:
                log.exception("etcd: watch of %s failed", key)
            await asyncio.sleep(backoff)
            long_lived = self.clock() - started > self.ttl_ms
            backoff = 0.1 if long_lived else min(backoff * 2, self.ttl_ms / 4000.0)

    # -- one step -----------------------------------------------------------------------------
    async def step(self) -> None:
        """Renew (or get) the lease, advertise this member, then check or bid for the key.

        Raises:
            EtcdUnavailable: etcd did not answer; the fence timer still closes on time.
        """
        if not self._checked_lately():
            await self._renew()
            if not await self._advertise():
                return  # another live node holds this node id: neither follow nor bid
        kv = await self._read_primary()
        record = PrimaryRecord.decode(kv) if kv is not None else None
        if kv is not None and kv.lease and not self.holding and await self._delete_silent(kv):
            kv = record = None
        if kv is not None and not kv.lease:
            # fastlock writes this key only under a lease: one with none was put by hand
            # and would never expire, so no node could ever take the key
            log.error("etcd: %s is attached to no lease (not written by a fastlock node): deleting it",
                      self.primary_key)
            await self.gateway.txn(
                [{"target": "MOD", "key": b64(self.primary_key), "mod_revision": str(kv.mod_revision),
                  "result": "EQUAL"}],
                [{"request_delete_range": {"key": b64(self.primary_key)}}])
            kv = record = None
        elif record is not None and record != self.primary and (record.node == "?" or not record.address):
            log.error("etcd: %s does not name a node and an address this node can follow (%r); it goes "
                      "when its lease %x runs out", self.primary_key, kv.value[:100] if kv else b"", record.lease)
        if self.holding:
            if record is None or record.lease != self.lease:
                self._lose("the primary key is gone" if record is None
                           else f"the primary key names node {record.node!r} now")
            elif (stored := (await self._read_epoch()).stored) > self.epoch:
                # a node that saw a newer epoch than this primary's raised the group's (etcd lost
                # its data and this node was elected below it): step down and free the key, so
                # that the next primary's tokens are above every token ever granted
                self._lose(f"etcd's epoch is {stored}, above this primary's {self.epoch}: a node has "
                           f"seen a newer history")
                await self.resign()
            elif self.fenced and self.clock() < self.valid_until_ms:
                self._set_fenced(False)  # renewed, and the key is still this node's
            return
        if record != self.primary:
            self.primary = record
            if record is None:
                log.warning("etcd: no primary")
            else:
                log.info("etcd: primary is node %r at %s (epoch %d)", record.node, record.address, record.epoch)
        self.listener.on_primary(record)  # at every step: a node busy promoting may act on it only later
        if record is None:
            await self._maybe_bid()
        else:
            self._free_since = None

    async def _read_primary(self) -> KeyValue | None:
        """The primary key.  With the heartbeat rule a primary writes its heartbeat in the same
        request, conditional on its primary key's create_revision (a success moves its validity
        on, counted from the send time), and a standby reads the heartbeat with it (a new
        revision is noted as first seen now, after etcd applied it).

        Raises:
            EtcdUnavailable: etcd did not answer.
        """
        if not self.heartbeat:
            return await self.gateway.get(self.primary_key)
        primary, beat = b64(self.primary_key), b64(self.heartbeat_key)
        read = [{"request_range": {"key": primary}}]
        if self.holding:
            sent = self._beat_sent = self.clock()
            answer = await self.gateway.txn(
                [{"target": "CREATE", "key": primary, "create_revision": str(self._primary_rev), "result": "EQUAL"}],
                [{"request_put": {"key": beat, "value": b64(self._beat_value())}}, *read], read)
            if answer.get("succeeded") and self.holding:
                self._beat_at = max(self._beat_at, sent)
                self._arm_fence_timer()
            return _range_kv(answer, -1)
        answer = await self.gateway.txn([], [*read, {"request_range": {"key": beat}}])
        kv, beat_kv = _range_kv(answer, 0), _range_kv(answer, 1)
        self._note_beat(kv.create_revision if kv else 0, beat_kv.mod_revision if beat_kv else 0)
        return kv

    def _beat_value(self) -> bytes:
        return json.dumps({"node": self.node, "epoch": self.epoch}).encode()

    @property
    def beat_period_ms(self) -> int:
        """The longest time (ms, own clock) between two heartbeats a primary sends."""
        return max(25, self.ttl_ms // BEATS_PER_TTL)

    async def _pulse(self) -> None:
        """While this node holds the key, send a heartbeat whenever :attr:`beat_period_ms`
        has passed since the last one was sent (by a step or here), until closed; with it a
        lease renewal when the last successful one was sent that long ago too.  A stall makes
        both overdue: they go out together, before the step's, as soon as the loop runs again."""
        while self._wake is not None:
            now = self.clock()
            wait = self._beat_sent + self.beat_period_ms - now
            if wait <= 0 and not self.holding:
                wait = self.beat_period_ms
            if wait > 0:
                await asyncio.sleep(wait / 1000.0)
                continue
            overdue = now - self._renewed_at >= self.beat_period_ms
            sends = [self.beat(), self._keep_lease()] if overdue else [self.beat()]
            outcomes = await asyncio.gather(*sends, return_exceptions=True)
            for outcome in outcomes:
                if isinstance(outcome, EtcdUnavailable):
                    log.debug("etcd: heartbeat: %s", outcome)
                elif isinstance(outcome, BaseException):
                    log.error("etcd: heartbeat failed: %r", outcome)
            if self.fenced and self.holding and outcomes[0] is True and self.clock() < self.valid_until_ms:
                self.poke()  # etcd answers again (after an outage or a stall): the step lifts the fence now

    async def _keep_lease(self) -> None:
        """Renew the held lease between steps (only a renewal: a lease gone is the step's to
        handle, run at once).

        Raises:
            EtcdUnavailable: etcd did not answer.
        """
        lease, sent = self.lease, self.clock()
        if not lease:
            return
        if await self.gateway.keepalive(lease) <= 0:
            self.poke()
        elif self.holding and self.lease == lease and sent > self._renewed_at:
            self._renewed(sent)

    async def beat(self) -> bool:
        """Write this primary's heartbeat alone (a transaction conditional on its primary key's
        create_revision); a success moves its validity on, counted from the send time.  A
        failure means the key is gone or another's: the next step runs at once and finds
        out.  True: the heartbeat landed.

        Raises:
            EtcdUnavailable: etcd did not answer.
        """
        rev = self._primary_rev
        sent = self._beat_sent = self.clock()
        answer = await self.gateway.txn(
            [{"target": "CREATE", "key": b64(self.primary_key), "create_revision": str(rev), "result": "EQUAL"}],
            [{"request_put": {"key": b64(self.heartbeat_key), "value": b64(self._beat_value())}}])
        if not answer.get("succeeded"):
            self.poke()
            return False
        if self.holding and self._primary_rev == rev:
            self._beat_at = max(self._beat_at, sent)
            self._arm_fence_timer()
        return True

    def _on_beat_event(self, kv: KeyValue) -> None:
        """The heartbeat's watch: a new revision, first seen now."""
        self._note_beat(self._beat.primary_rev if self._beat is not None else 0, kv.mod_revision)

    def _note_beat(self, primary_rev: int, revision: int) -> None:
        """Note the heartbeat ``revision`` with the primary key's create_revision ``primary_rev``
        (read together, or the last one read): a new pair, or a newer revision of the same
        primary key, is first seen now.  An older revision (a read sent before a watch event
        arrived) changes nothing."""
        beat = self._beat
        if beat is not None and beat.primary_rev == primary_rev and revision <= beat.revision:
            return
        self._beat = BeatSighting(primary_rev, revision, self.clock())
        if not self.holding:
            self._arm_beat_timer()

    def _forget_beat(self) -> None:
        """A step could not reach etcd: forget the heartbeat sighting, so the revision read at
        the next step that reaches etcd is first seen then.  While etcd cannot be reached the
        primary cannot heartbeat either (an etcd restart, a partition of this node), and a
        sighting kept across it would count the outage against a live primary; a later
        ``t_observed`` only delays a delete."""
        self._beat = None
        if self._beat_timer is not None:
            self._beat_timer.cancel()
            self._beat_timer = None

    def _arm_beat_timer(self, wait: int | None = None) -> None:
        """Run a step when the heartbeat as last seen has stood for ``wait`` ms (default
        one TTL; own clock)."""
        if self._beat_timer is not None:
            self._beat_timer.cancel()
            self._beat_timer = None
        beat = self._beat
        if beat is None or self._wake is None or self._task is None:
            return
        delay = max(0, beat.seen_at + (wait or self.ttl_ms) - self.clock()) + 1
        self._beat_timer = asyncio.get_running_loop().call_later(delay / 1000.0, self.poke)

    async def _delete_silent(self, kv: KeyValue) -> bool:
        """With the heartbeat rule, delete the primary key ``kv`` (another node's) if its
        primary follows the rule and the heartbeat has stood at the revision this node saw
        with ``kv`` for one TTL since it first saw it (own clock): one transaction compares
        the key's create_revision and the heartbeat's mod_revision, so a newer heartbeat (or
        a newer primary key) fails it.  True: this node deleted it.

        Raises:
            EtcdUnavailable: etcd did not answer (whether it was deleted is seen at the next step).
        """
        beat = self._beat
        if not self.heartbeat or beat is None or beat.primary_rev != kv.create_revision:
            return False
        ttl = json_object(kv.value).get("heartbeat")
        if type(ttl) is not int or not 0 < ttl <= MAX_HEARTBEAT_TTL_MS:
            return False  # a primary that does not write heartbeats: its key goes with its lease
        wait = max(self.ttl_ms, ttl)  # the primary's TTL, never shorter than this node's
        if self.clock() - beat.seen_at < wait:
            self._arm_beat_timer(wait)
            return False
        primary = b64(self.primary_key)
        answer = await self.gateway.txn(
            [{"target": "CREATE", "key": primary, "create_revision": str(kv.create_revision), "result": "EQUAL"},
             {"target": "MOD", "key": b64(self.heartbeat_key), "mod_revision": str(beat.revision),
              "result": "EQUAL"}],
            [{"request_delete_range": {"key": primary}}])
        if not answer.get("succeeded"):
            log.info("etcd: %s not deleted: a newer heartbeat or primary key", self.primary_key)
            return False
        self.heartbeat_deletes += 1
        log.warning("etcd: deleted %s (node %r, epoch %d): its heartbeat stood at revision %d for %d ms "
                    "(one TTL)", self.primary_key, PrimaryRecord.decode(kv).node, PrimaryRecord.decode(kv).epoch,
                    beat.revision, self.clock() - beat.seen_at)
        return True

    def _member_value(self) -> bytes:
        """This node's member key value now (JSON)."""
        value = {"node": self.node, "address": self.address, "position": self.listener.position(),
                 "epoch": self.epoch, "lease": self.lease, "ident": self._member.ident}
        if self.principal:  # the one replica principal a primary counts as this node's copy
            value["principal"] = self.principal
        return json.dumps(value).encode()

    def _checked_lately(self) -> bool:
        """May this step skip the renewal and the member key check?  Only a node that does
        not hold the primary key, whose lease was renewed and whose unchanged member key was
        found its own less than a quarter TTL ago (own clock): a step the watch or a hurry
        runs between two regular ones goes straight to the primary key.  A renewal is then at
        most about half a TTL apart (the lease lives a whole TTL), and a bid still counts its
        validity from the send time of the last renewal."""
        now = self.clock()
        quarter = self.ttl_ms // 4
        return (not self.holding and self.lease != 0 and now - self._renewed_at < quarter
                and self._advertised_at is not None and now - self._advertised_at < quarter
                and self._member_value() == self._member.written)

    async def _advertise(self) -> bool:
        """Check that this node's member key is under its lease, writing it when its value
        changed (every write is an etcd revision), or create it if it is absent.  A key
        under another lease is never revoked (even one with this data directory's identity:
        a copy of the directory may be running, and a primary whose lease someone else
        revokes keeps granting until its own TTL runs out): this node waits for that lease
        to run out, as after any crash.  True: the key is this node's.

        Raises:
            NodeIdInUse: another live node has held it for twice the TTL.
            EtcdUnavailable: etcd did not answer.
        """
        if not self.lease:  # given up meanwhile (resign): a key written under no lease would never go
            return False
        mine = self._member
        member = self._member_value()
        key = b64(self.members_prefix + self.node)
        put = [{"request_put": {"key": key, "value": b64(member), "lease": str(self.lease)}}]
        read = [{"request_range": {"key": key}}]
        other = None
        for compare, then in (({"target": "LEASE", "lease": str(self.lease)}, [] if member == mine.written else put),
                              ({"target": "CREATE", "create_revision": "0"}, put)):
            answer = await self.gateway.txn([{**compare, "key": key, "result": "EQUAL"}], then, read)
            if answer.get("succeeded"):
                mine.written = member
                mine.taken_since = None
                self._advertised_at = self.clock()
                return True
            kvs = ((answer.get("responses") or [{}])[0].get("response_range") or {}).get("kvs")
            if kvs:
                other = KeyValue.decode(kvs[0])
                break
        if other is None:
            return False  # gone between the two reads: the next step creates it
        data = json_object(other.value)
        same_dir = bool(mine.ident) and data.get("ident") == mine.ident
        wait = 2 * self.ttl_ms  # a dead holder's lease runs out within its TTL (etcd frees it a little later)
        if mine.taken_since is None:
            mine.taken_since = self.clock()
            log.warning("etcd: node id %r is held by %s at %s (lease %x): waiting up to %d ms for that lease to "
                        "run out", self.node, "this data directory's previous run" if same_dir else "another node",
                        data.get("address", "?"), other.lease, wait)
        if self.clock() - mine.taken_since >= wait:
            whose = ("a data directory with this one's identity: a copy? delete the copy's node-id file"
                     if same_dir else "a data directory with another identity")
            raise NodeIdInUse(
                f"node id {self.node!r} is in use by another live node at {data.get('address', '?')} (its etcd "
                f"key {self.members_prefix}{self.node} stays under lease {other.lease:x}, {whose}): give each "
                f"node its own --node-id")
        return False

    async def _renew(self) -> None:
        sent = self.clock()
        if self.lease:
            ttl_s = await self.gateway.keepalive(self.lease)
            if ttl_s > 0:
                self._renewed(sent)
                return
            log.warning("etcd: lease %x has run out", self.lease)
            self.lease = 0
            if self.holding:
                self._lose("its etcd lease ran out before it could renew it")
        self.lease, granted_s = await self.gateway.grant(self.ttl_ms // 1000)
        if granted_s * 1000 > self.ttl_ms:
            # etcd raises a TTL below its minimum (1.5 election timeouts): this node still fences
            # itself by the TTL it asked for (earlier: safe), but a dead primary's key lives longer
            log.warning("etcd granted a %d s lease for the %d s asked: a failover takes that long",
                        granted_s, self.ttl_ms // 1000)
        self._renewed(sent)

    def _renewed(self, sent: int) -> None:
        self._renewed_at = sent
        if self.holding:
            self._arm_fence_timer()

    def _arm_fence_timer(self) -> None:
        if self._fence_timer is not None:
            self._fence_timer.cancel()
        delay = max(0, self.valid_until_ms - self.clock())
        self._fence_timer = asyncio.get_running_loop().call_later(delay / 1000.0, self._on_fence_timer)

    def _on_fence_timer(self) -> None:
        self._fence_timer = None
        self.fence_if_due(self.clock())

    def _set_fenced(self, fenced: bool) -> None:
        self.fenced = fenced
        if fenced:
            log.warning("etcd: lease not renewed in time (%d ms TTL, %d ms margin): not granting",
                        self.ttl_ms, self.margin_ms)
        else:
            log.warning("etcd: lease renewed: granting again")
        self.listener.on_fenced(fenced)

    def _lose(self, why: str) -> None:
        self.holding = False
        self.fenced = False
        self.stepped_down = True
        if self._fence_timer is not None:
            self._fence_timer.cancel()
            self._fence_timer = None
        log.critical("etcd: lost the primary role: %s", why)
        self.listener.on_lost(why)

    async def _maybe_bid(self) -> None:
        if self.stepped_down or not self.listener.candidate():
            return
        now = self.clock()
        if self._free_since is None:
            self._free_since = now
        mine = self.listener.position()
        ahead = []
        advertised = 0  # the highest credible epoch a live member advertises (its term as primary)
        self._bid_epoch = None
        members, _ = await asyncio.gather(self.gateway.get_prefix(self.members_prefix, MAX_MEMBERS),
                                          self.prefetch_for_bid())
        for kv in members:
            data = json_object(kv.value)
            position, epoch = data.get("position"), data.get("epoch")
            if data.get("node") != self.node and type(position) is int and position > mine:
                ahead.append(f"{data.get('node')!r} at {position}")
            if type(epoch) is int and epoch > advertised and self.credible_epoch(epoch):
                advertised = epoch
        ahead += await self.bid_preferred(members)
        delay = self.timing.behind_delay_ms
        if ahead and now - self._free_since < delay:
            log.info("etcd: no primary, but %s ahead of this node (at %d): waiting %d ms before bidding",
                     ", ".join(ahead[:3]), mine, delay)
            return
        await self.bid(advertised)

    def seen_epoch(self) -> int:
        """The highest epoch this node has seen (its own as primary, or the listener's)."""
        return max(self.epoch, self.listener.min_epoch())

    def credible_epoch(self, epoch: int) -> bool:
        """Is ``epoch``, read from etcd, at most :data:`~fastlock.coordination.records.EPOCH_ALLOWANCE`
        above :meth:`seen_epoch` or :attr:`known_epoch`, or any epoch while :attr:`moving_in` (see
        :func:`~fastlock.coordination.records.credible_epoch`)?"""
        return credible_epoch(epoch, self._credible_base())

    def _credible_base(self) -> int:
        """The epoch etcd's epoch is judged against: the higher of :meth:`seen_epoch` and
        :attr:`known_epoch`, or the last epoch while :attr:`moving_in` (any epoch is credible)."""
        return MAX_EPOCH if self.moving_in() else max(self.seen_epoch(), self.known_epoch())

    async def _read_epoch(self) -> EpochReading:
        """``PREFIX/epoch`` as :func:`~fastlock.coordination.records.read_epoch` judges it; a
        refused value is logged (at most every 10 s) and, by a primary, rewritten to its own
        epoch (compare-and-set on the key's revision); a bid rewrites it anyway.

        Raises:
            EtcdUnavailable: etcd did not answer.
        """
        seen = self._credible_base()
        reading = read_epoch(await self.gateway.get(self.epoch_key), seen)
        if reading.refused:
            kv = reading.kv
            assert kv is not None
            self._refused_epoch("etcd: refusing %s = %r: not an epoch at most %d above the highest this node has "
                                "seen or its shard map's token floors name (%d); the next epoch comes from what the "
                                "nodes know", self.epoch_key,
                                kv.value[:40], EPOCH_ALLOWANCE, seen)
            if self.holding:
                await self.gateway.txn(
                    [{"target": "MOD", "key": b64(self.epoch_key), "mod_revision": str(kv.mod_revision),
                      "result": "EQUAL"}],
                    [{"request_put": {"key": b64(self.epoch_key), "value": b64(str(self.epoch))}}])
        return reading

    async def raise_epoch(self, epoch: int) -> None:
        """Raise ``PREFIX/epoch`` to ``epoch`` if it is lower (a compare-and-set on its
        revision): the primary then steps down at its next step, and the next bid is
        above ``epoch``.  Called by a node that saw a newer epoch than the primary etcd
        names (etcd lost its data).

        Raises:
            EtcdUnavailable: etcd did not answer.
        """
        reading = await self._read_epoch()
        kv, stored = reading.kv, reading.stored
        if stored >= epoch:
            return
        answer = await self.gateway.txn(
            [{"target": "MOD", "key": b64(self.epoch_key), "mod_revision": str(kv.mod_revision if kv else 0),
              "result": "EQUAL"}],
            [{"request_put": {"key": b64(self.epoch_key), "value": b64(str(epoch))}}])
        if answer.get("succeeded"):
            log.critical("etcd: raised %s from %d to %d, the epoch this node has seen", self.epoch_key, stored,
                         epoch)

    async def adopt_epoch(self, epoch: int) -> bool:
        """Raise this primary's epoch to ``epoch`` in etcd without stepping down: one transaction,
        while the primary key is still the one this node created (its ``create_revision``) and
        ``PREFIX/epoch`` is as just read, puts ``PREFIX/epoch``, the primary key (same lease, same
        node and address) and the heartbeat at ``epoch``, with :meth:`adopt_guard`'s.  A slot move's
        destination adopting the source's token floor calls it (:mod:`fastlock.server.slotmove`)
        before it logs the epoch, so that its standbys, which learn the epoch from the log, never
        see their primary named in etcd below it (they would raise ``PREFIX/epoch`` and make the
        primary step down).  Every later bid is above ``epoch`` (it reads ``PREFIX/epoch``).

        Returns True when etcd names this node primary at ``epoch`` or above; False when this
        node does not hold the primary key, etcd's epoch is at or above ``epoch`` already (a
        newer history: the primary steps down at its next step), ``epoch`` is beyond
        :data:`~fastlock.protocol.MAX_EPOCH`, or the key changed under the transaction.

        Raises:
            EtcdUnavailable: etcd did not answer (it may or may not have it: call again).
        """
        if self.holding and epoch <= self.epoch:
            return True
        if not self.holding or not self.lease or epoch > MAX_EPOCH:
            return False
        reading = await self._read_epoch()
        kv = reading.kv
        if reading.stored >= epoch or not self.holding:
            return False
        fields = {"node": self.node, "address": self.address, "epoch": epoch}
        puts = [{"request_put": {"key": b64(self.epoch_key), "value": b64(str(epoch))}}]
        if self.heartbeat:
            fields["heartbeat"] = self.ttl_ms
            puts.append({"request_put": {"key": b64(self.heartbeat_key),
                                         "value": b64(json.dumps({"node": self.node, "epoch": epoch}))}})
        puts.append({"request_put": {"key": b64(self.primary_key), "value": b64(json.dumps(fields)),
                                     "lease": str(self.lease)}})
        compare, put = await self.adopt_guard(epoch)
        answer = await self.gateway.txn(
            [{"target": "CREATE", "key": b64(self.primary_key), "create_revision": str(self._primary_rev),
              "result": "EQUAL"},
             {"target": "MOD", "key": b64(self.epoch_key), "mod_revision": str(kv.mod_revision if kv else 0),
              "result": "EQUAL"}, *compare],
            [*puts, *put])
        if not answer.get("succeeded") or not self.holding:
            log.warning("etcd: epoch %d not adopted (the primary key or %s changed meanwhile)", epoch, self.epoch_key)
            return False
        log.warning("etcd: primary %r raised its epoch from %d to %d (a slot move's token floor)", self.node,
                    self.epoch, epoch)
        self.epoch = epoch
        self.primary = PrimaryRecord(self.node, self.address, epoch, self.lease)
        return True

    async def adopt_epoch_above(self, epoch: int) -> int:
        """Raise this primary's epoch in etcd to ``epoch`` or, when ``PREFIX/epoch`` holds ``epoch``
        or more already (credibly: a primary of this group reached it, and may have issued tokens
        at it), to one above that (:meth:`adopt_epoch`).  A shard group's primary raising its
        tokens above a slot's token floor from the shard map calls it
        (:meth:`fastlock.server.sharded.ShardGate.settle_floors`).

        Returns the epoch etcd names this node primary at, or 0 when it could not be raised (see
        :meth:`adopt_epoch`; or the epoch would pass :data:`~fastlock.protocol.MAX_EPOCH`).

        Raises:
            EtcdUnavailable: etcd did not answer (call again).
        """
        stored = (await self._read_epoch()).stored
        target = max(epoch, stored + 1)
        if target > MAX_EPOCH:
            return 0
        return self.epoch if await self.adopt_epoch(target) else 0

    async def adopt_guard(self, epoch: int) -> tuple[list[dict], list[dict]]:
        """More compares and puts for :meth:`adopt_epoch`'s transaction at ``epoch``; none here."""
        return [], []

    async def bid(self, advertised: int = 0) -> bool:
        """Try to take the free primary key with the next epoch; True if this node took it.

        The epoch is one above the highest of: ``PREFIX/epoch`` when credible, every epoch
        this node has seen, :attr:`known_epoch` (a shard group's node: the epoch above its map's
        token floors), and ``advertised`` (the highest credible epoch a live member
        advertises, so that a node that has not synced yet still goes above the last
        primary's epoch when someone overwrote ``PREFIX/epoch``).  Each is at most
        :data:`~fastlock.coordination.records.EPOCH_ALLOWANCE` above what this node has
        seen or :attr:`known_epoch`: one election moves the group's epoch by at most that much + 1.

        Raises:
            EtcdUnavailable: etcd did not answer (whether the bid landed is then
                learned at the next step, which reads the key).
        """
        if not self.lease:  # given up meanwhile (resign): the key is taken only under a lease, the next step's
            return False
        sent = self._renewed_at
        reading = await self.epoch_for_bid()
        self._bid_epoch = None  # the next bid reads it again
        if not self.lease:
            return False
        kv = reading.kv
        epoch = max(reading.stored, self.seen_epoch(), self.known_epoch(),
                    advertised if self.credible_epoch(advertised) else 0) + 1
        if epoch > MAX_EPOCH:
            log.critical("etcd: cannot take the primary role: epoch %d would exceed %d", epoch, MAX_EPOCH)
            return False
        compare, put = await self.bid_guard(epoch)
        put = list(put)
        fields = {"node": self.node, "address": self.address, "epoch": epoch}
        if self.heartbeat:
            fields["heartbeat"] = self.ttl_ms  # standbys may delete this key once its heartbeat stands this long
            put.append({"request_put": {"key": b64(self.heartbeat_key),
                                        "value": b64(json.dumps({"node": self.node, "epoch": epoch}))}})
        value = json.dumps(fields).encode()
        primary, epoch_b = b64(self.primary_key), b64(self.epoch_key)
        beat_sent = self.clock()
        answer = await self.gateway.txn(
            [{"target": "CREATE", "key": primary, "create_revision": "0", "result": "EQUAL"},
             {"target": "MOD", "key": epoch_b, "mod_revision": str(kv.mod_revision if kv else 0), "result": "EQUAL"},
             *compare],
            [{"request_put": {"key": primary, "value": b64(value), "lease": str(self.lease)}},
             {"request_put": {"key": epoch_b, "value": b64(str(epoch))}}, *put])
        if not answer.get("succeeded"):
            log.info("etcd: bid for epoch %d lost (another node took the key or the epoch first)", epoch)
            return False
        self.holding = True
        self.fenced = False
        self.epoch = epoch
        self._free_since = None
        self._renewed_at = sent
        self._beat_at = beat_sent  # the bid wrote the first heartbeat
        header = answer.get("header")
        self._primary_rev = _int(header.get("revision")) if type(header) is dict else 0
        if self._beat_timer is not None:
            self._beat_timer.cancel()
            self._beat_timer = None
        self.primary = PrimaryRecord(self.node, self.address, epoch, self.lease)
        self._arm_fence_timer()
        log.warning("etcd: took the primary role at epoch %d (lease %x, valid %d ms more)", epoch, self.lease,
                    self.valid_until_ms - self.clock())
        self.listener.on_elected(epoch)
        return True

    async def prefetch_for_bid(self) -> None:
        """Read what the bid will compare (``PREFIX/epoch``), together with the members."""
        await self.epoch_for_bid()

    async def epoch_for_bid(self) -> EpochReading:
        """``PREFIX/epoch`` as read for the bid under way (read now if it was not yet): the bid's
        transaction compares its revision, so a change since fails the bid.

        Raises:
            EtcdUnavailable: etcd did not answer.
        """
        if self._bid_epoch is None:
            await self.before_bid()
            self._bid_epoch = await self._read_epoch()
        return self._bid_epoch

    async def bid_preferred(self, members: list[KeyValue]) -> list[str]:
        """Live nodes a bid should wait for (``behind_delay_ms``) besides those ahead; none here.
        ``members``: the member keys as just read."""
        return []

    async def bid_guard(self, epoch: int) -> tuple[list[dict], list[dict]]:
        """More compares and puts for the bid's transaction at ``epoch``; none here."""
        return [], []

    def status(self) -> dict:
        """The arbiter's state for STATUS."""
        now = self.clock()
        p = self.primary
        return {
            "coordinator": "etcd",
            "node": self.node,
            "holding": self.holding,
            "may_grant": self.may_grant(now),
            "valid_ms": max(0, self.valid_until_ms - now) if self.holding else 0,
            "ttl_ms": self.ttl_ms,
            "margin_ms": self.margin_ms,
            "epoch": self.epoch,
            "primary": None if p is None else {"node": p.node, "address": p.address, "epoch": p.epoch},
            "stepped_down": self.stepped_down,
            "last_error": self.last_error,
            "heartbeat": {"rule": self.heartbeat, "deletes": self.heartbeat_deletes,
                          "seen_revision": self._beat.revision if self._beat else 0,
                          "seen_ms_ago": now - self._beat.seen_at if self._beat else None},
        }


def _int(value: object) -> int:
    """A revision as etcd's JSON gateway sends it (a decimal string); 0 if it is not one."""
    if not isinstance(value, (int, str)):
        return 0
    try:
        return int(value)
    except ValueError:
        return 0


def _range_kv(answer: dict, index: int) -> KeyValue | None:
    """The first key of the ``index``-th range response of a transaction's answer (None: none)."""
    responses = answer.get("responses")
    if type(responses) is not list or not responses or not -len(responses) <= index < len(responses):
        return None
    response = responses[index]
    found = response.get("response_range") if type(response) is dict else None
    kvs = found.get("kvs") if type(found) is dict else None
    return KeyValue.decode(kvs[0]) if type(kvs) is list and kvs and type(kvs[0]) is dict else None
