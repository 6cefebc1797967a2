"""Failover policy in one place: promote, step down, serve alone, and what a node is at start.

The server's handlers and the standby's follower call :class:`FailoverPolicy`;
it changes the node's role only through :meth:`fastlock.roles.NodeRole.transition`
and sees the server only through :class:`~fastlock.replication.host.ReplicationHost`.

Promotion (:meth:`FailoverPolicy.promote`)
    First makes sure the old primary cannot grant any more: on command, it
    is asked to step down (``STEP_DOWN`` with the new epoch) and must confirm;
    if it does not answer (frozen, partitioned, dead), promotion waits until
    the primary's own fence has certainly closed (``--failover-after`` since
    it was last heard), or - when the primary does not fence itself - refuses
    unless ``force`` (the operator's word that it is dead).  Automatic
    promotion happens only after that much silence already.  Then it raises
    the epoch above every epoch seen and fsyncs it, keeps every replicated
    lease until the deadline the standby kept for it (its record's or
    snapshot's arrival plus the time it had left, see
    :meth:`~fastlock.replication.StandbyFollower.lease_deadline`; never
    earlier than the holder's own deadline on clocks running at the same
    rate), expires those whose deadline has passed (logged and WAL-recorded
    like any expiry), gives a full TTL from now only to a lease recovered from
    the node's own log (its remaining time is unknown), and holds new grants
    for the grace period.  Before the new epoch, once the old primary serves
    no more, a sharded node following its map in etcd reads the map there
    (:attr:`FailoverPolicy.before_serving`), so it never serves slots a move
    took from its group while its watch lagged.  A
    promotion that is refused or fails returns the node to ``STANDBY``
    (logged), following its primary again unless the new epoch already
    reached the log; it never stays ``PROMOTING``.

Rejoining (:meth:`FailoverPolicy.check_peer`)
    A primary fenced while paired with a standby that fails over by itself
    (restarted while paired, or resumed after a pause, or cut off), or one
    deposed by its standby's ``STEP_DOWN``, asks the node at the standby's
    announced address, once a second while it stays so, what it is now (:func:`~fastlock.replication.rejoin.ask_peer`,
    with this node's replica credential and the standby's node id expected).
    If that node is the primary at a higher epoch, this node steps down
    (``deposed.json``, as on ``STEP_DOWN``), forgets its pairing and follows
    it as its standby: the new primary's snapshot replaces its table, and
    every lease it held that the new primary does not - granted or extended
    here and never acknowledged by the standby, or released there since - is
    discarded and logged one by one (as pg_rewind discards a diverged
    primary's tail).  It never grants meanwhile: it is fenced until it steps
    down.  When it cannot follow (no replica credential, the node refuses
    it), its log names the address to restart it ``--standby-of``.

Stepping down (:meth:`FailoverPolicy.on_step_down_request`)
    Only on an explicit ``STEP_DOWN`` whose epoch is exactly above the node's
    own (at most epoch + 1, within ``MAX_EPOCH``); a client's HELLO never
    deposes a node.  The step-down is fsynced to ``deposed.json`` before the
    reply, so a restart does not bring the node back as a primary, and client
    connections are closed so that waiters and renewers look for the new
    primary at once.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from .. import protocol as P
from ..errors import FastlockError, InvalidArgument, NotPrimary, Unavailable
from ..replication import (
    DEPOSED_FILE,
    STATE_FILE,
    NodeState,
    ReplicationSource,
    StandbyFollower,
    read_deposed,
    read_pairing,
    write_deposed,
)
from ..replication.messages import standby_identity
from ..replication.rejoin import PeerAnswer, ask_peer
from ..roles import Role
from ..units import monotonic_ms, parse_address
from .tasks import BackgroundTasks

if TYPE_CHECKING:  # pragma: no cover
    from ..replication.host import ReplicationHost
    from ..replication.witnesslink import WitnessLink
    from .config import ServerConfig
    from .coordinated import CoordinatedNode

log = logging.getLogger(__name__)

#: how often a fenced paired primary asks its standby's address what is there (seconds)
PEER_CHECK_INTERVAL_S = 1.0
#: epochs a fenced primary's ``serve-alone`` moves up: its standby may have promoted itself to
#: the next one, so the one after that keeps every token this node grants above the standby's
SERVE_ALONE_EPOCH_STEP = 2


def primary_to_follow(config: ServerConfig, state: NodeState) -> tuple[str, int] | None:
    """The primary a node follows at start: ``--standby-of`` (recorded in ``state``); else, for
    a node with a replica credential outside an etcd group, the one its ``node-state.json``
    names (a standby, or an old primary that rejoined its promoted standby, restarted without
    ``--standby-of``); else None (the node starts as a primary, and a standby's data directory
    is refused there)."""
    if config.standby_of is not None:
        state.set_standby_of(f"{config.standby_of[0]}:{config.standby_of[1]}")
        return config.standby_of
    may_follow = config.standby_token is not None or bool(config.tls_cert)
    if config.coordinator or not may_follow or not state.standby_of:
        return None
    try:
        address = parse_address(state.standby_of, default_port=None)
    except FastlockError:
        return None
    log.warning("started without --standby-of: following %s, the primary %s names", state.standby_of, STATE_FILE)
    return address


def check_step_down_epoch(epoch: Any, own_epoch: int) -> int:
    """The epoch a peer announces to depose this node: an int with
    ``own_epoch < epoch <= own_epoch + 1`` and ``epoch <= MAX_EPOCH``.

    A promoting standby always announces its primary's epoch + 1; anything
    higher would be a guess (or an attack: with 2**63-1 a pair could never
    promote again), anything lower or equal is not newer.

    Raises:
        WrongArgumentType: not an int.
        InvalidArgument: out of those bounds (the caller changes nothing).
    """
    P.check_epoch(epoch, "step-down epoch")
    if epoch <= own_epoch:
        raise InvalidArgument(f"step-down epoch {epoch} is not above this node's epoch {own_epoch}")
    if epoch > own_epoch + 1:
        raise InvalidArgument(f"step-down epoch {epoch} is more than one above this node's epoch "
                              f"{own_epoch}: refused")
    return epoch


def _no_epoch() -> int:
    """No epoch known (:attr:`FailoverPolicy.known_epoch` of a node that is not sharded)."""
    return 0


class FailoverPolicy:
    """Promote, step down, serve alone - and the node's role at start.

    Args:
        host: the server (:class:`~fastlock.replication.host.ReplicationHost`).
        source: the primary's replication side (pairing, fence).
        follower: the standby's side, or None on a node started as primary.
        promotion_grace_ms: grace after promotion (ms); None: the longest TTL seen.
        tasks: where an automatic promotion runs (its failure is logged as an error
            and counted in ``tasks.status()``); None: a set of its own.
        clock: the monotonic clock in milliseconds (the host's in tests).
    """

    def __init__(self, host: ReplicationHost, source: ReplicationSource,
                 follower: StandbyFollower | None, *, promotion_grace_ms: int | None = None,
                 tasks: BackgroundTasks | None = None, clock: Callable[[], int] = monotonic_ms):
        self.host = host
        self.source = source
        self.follower = follower
        self.promotion_grace_ms = promotion_grace_ms
        self.tasks = tasks if tasks is not None else BackgroundTasks()
        self.clock = clock
        self._auto: asyncio.Task | None = None
        #: etcd decides who is primary (``--coordinator``); None: the pair decides
        self.coordinated: CoordinatedNode | None = None
        #: the pair's witness (``--witness``): a promotion takes its lease for the new epoch first
        self.witness: WitnessLink | None = None
        #: awaited by each promotion once the old primary serves no more, before the new epoch is
        #: logged (a sharded node following the map in etcd reads it: ShardGate.take_stored_map);
        #: raises Unavailable to refuse the promotion (the node stays a standby)
        self.before_serving: Callable[[], Awaitable[None]] | None = None
        #: called by each promotion once this node is the primary, before its first grant (a sharded
        #: node drops what moves aborted while it was a standby had imported: ShardGate.promoted)
        self.after_promotion: Callable[[], None] | None = None
        #: an epoch this node's group is known to go to (a sharded node: the epoch above its map's
        #: token floors, ShardGate.floors_epoch, where its primary raises the group's epoch): a
        #: promotion goes above it
        self.known_epoch: Callable[[], int] = _no_epoch
        self._auto_retry_at_ms = 0
        self._peer_check: asyncio.Task | None = None
        self._peer_timer: asyncio.TimerHandle | None = None  # the next look at the fence (a primary's)
        self._peer_said: str | None = None  # the last thing logged about the peer (each said once)

    # -- start ---------------------------------------------------------------------------------
    def on_start(self) -> None:
        """A primary that stepped down before stays deposed; otherwise restore its pairing,
        and hold grants for a whole promotion grace again if it stopped during one."""
        host = self.host
        if host.roles.role is not Role.PRIMARY:
            return
        marker = read_deposed(host.data_dir)
        if marker is not None and marker.get("epoch", 0) > host.table.epoch:
            host.roles.transition(Role.DEPOSED, f"{DEPOSED_FILE}: stepped down for epoch {marker.get('epoch')}")
            pairing = read_pairing(host.data_dir)
            self.source.paired_address = pairing.address if pairing is not None else None
            log.critical("this node stepped down for epoch %s (%s) and stays deposed until it follows the primary "
                         "at its paired standby's address (%s) once that answers, or it is restarted with "
                         "--standby-of the current primary (or %s is deleted to override)",
                         marker.get("epoch"), marker.get("why"), self.source.paired_address or "never announced",
                         DEPOSED_FILE)
            self._arm_peer_check()
        else:
            self.source.load_pairing()
            self._arm_peer_check()
            grace = host.node_state.grace_ms
            if grace:
                host.roles.hold_grace(self.clock() + grace, "restarted during its promotion grace: "
                                                          "no new grants for the whole grace again",
                                      reason="the promotion grace period, again from the start (this node "
                                             "restarted during it)")
                self._end_grace_later(grace)
            self._unsynced_restart_grace()

    def _unsynced_restart_grace(self) -> None:
        """After an unclean stop of a run in a relaxed fsync mode (``interval``,
        ``never``), an OS crash may have taken acknowledged grants with it that
        recovery cannot see: hold grants of free locks for the longest TTL this node
        has granted (persisted before any grant used it), as a promoted standby does,
        so that no lock goes to a second holder while the first may still believe it
        holds it (a holder whose grant was lost learns it at its next renewal).  The
        WAL's marker stays until the grace ends: a restart during it holds it again."""
        host = self.host
        wal = host.wal
        grace = host.max_ttl_ms
        if not wal.unsynced_before or not grace:
            return
        wal.keep_unsynced_marker = True
        host.roles.hold_grace(self.clock() + grace, f"restarted after an unclean stop of a run with --fsync "
                                                    f"interval or never (an OS crash may have lost acknowledged "
                                                    f"grants): no new grants for the longest TTL, {grace} ms",
                              reason="the grace period after an unclean stop of a run with --fsync interval or "
                                     "never (grants it acknowledged may have been lost: their holders may "
                                     "still act)")

        def ended() -> None:
            left = host.roles.grace_remaining_ms(self.clock())
            if left:
                host.loop.call_later(left / 1000.0, ended)
            else:
                wal.keep_unsynced_marker = False

        host.loop.call_later(grace / 1000.0, ended)

    def _end_grace_later(self, grace_ms: int) -> None:
        def ended() -> None:
            roles = self.host.roles
            if roles.role is Role.PRIMARY and roles.grace_remaining_ms(self.clock()) == 0:
                self.host.node_state.grace_ended()

        self.host.loop.call_later(grace_ms / 1000.0, ended)

    # -- rejoining as the new primary's standby -------------------------------------------------
    def listening(self, address: str) -> None:
        """The node serves clients at ``address`` (``host:port``): a standby announces it to its
        primary, which looks for it there after a failover."""
        if self.follower is not None:
            self.follower.link.advertise = address

    def _arm_peer_check(self) -> None:
        """Look at the fence once a second while this node is a primary of a pair (started as
        one, or promoted): fenced, it asks its paired standby's address (:meth:`check_peer`)."""
        if self._peer_timer is None and self.coordinated is None:
            self._peer_timer = self.host.loop.call_later(PEER_CHECK_INTERVAL_S, self._peer_tick)

    def close(self) -> None:
        """Stop looking at the fence (the server is closing)."""
        if self._peer_timer is not None:
            self._peer_timer.cancel()
            self._peer_timer = None

    def _peer_tick(self) -> None:
        self._peer_timer = None
        roles = self.host.roles
        if roles.role not in (Role.PRIMARY, Role.DEPOSED):
            return  # a standby: nothing more to find (a promotion arms it again)
        if (roles.fenced or roles.role is Role.DEPOSED) and (self._peer_check is None or self._peer_check.done()):
            self._peer_check = self.tasks.spawn(self.check_peer(), "ask the paired standby's address")
        self._arm_peer_check()

    def _say(self, level: int, message: str, *args: object) -> None:
        text = message % args
        if text != self._peer_said:
            self._peer_said = text
            log.log(level, "%s", text)

    def _looking(self) -> bool:
        """Is this node one that looks for a newer primary: a fenced primary, or a deposed node?"""
        roles = self.host.roles
        return self.coordinated is None and ((roles.role is Role.PRIMARY and roles.fenced)
                                             or roles.role is Role.DEPOSED)

    async def check_peer(self) -> PeerAnswer | None:
        """A fenced paired primary, or a deposed one: ask the paired standby's address what
        is there, and rejoin as its standby if it is the primary at a higher epoch (see the
        module docstring).  Returns the answer, or None when there was nothing to ask."""
        host = self.host
        address = self.source.paired_address
        if not self._looking() or address is None:
            return None
        if self.follower is None:
            self._say(logging.CRITICAL, "fenced, and this node has no replica credential (--standby-token-file or "
                      "a replica --tls-cert) to ask its paired standby at %s whether it was promoted: if it was, "
                      "restart this node with --standby-of %s", address, address)
            return None
        expect = standby_identity(self.source.paired_id or "").partition("/")[2] or None
        answer = await ask_peer(self.follower.link, address, expect, host.table.epoch)
        if not self._looking():
            return answer  # unfenced (the standby came back) meanwhile
        if answer.role == "primary" and answer.epoch > host.table.epoch:
            self.rejoin(answer)
        elif answer.role == "primary":
            self._say(logging.WARNING, "the paired standby's address %s answers as a primary at epoch %d, not above "
                      "this node's %d: not following it; still fenced", address, answer.epoch, host.table.epoch)
        elif answer.role == "promoting":
            self._say(logging.INFO, "the paired standby at %s is promoting", address)
        elif answer.role == "standby":
            self._say(logging.INFO, "the paired standby at %s is a standby (of %s): waiting for it to attach",
                      address, answer.follows)
        else:
            self._say(logging.WARNING, "fenced: cannot ask the paired standby at %s whether it was promoted (%s); "
                      "retrying every %g s - if another node is the primary, restart this node with --standby-of "
                      "it", address, answer.error, PEER_CHECK_INTERVAL_S)
        return answer

    def rejoin(self, answer: PeerAnswer) -> None:
        """Step down for the primary ``answer`` names and follow it as its standby.

        Raises:
            NotPrimary: this node is not a primary or deposed, with a follower (nothing changes).
        """
        host = self.host
        follower = self._standby_follower()
        if host.roles.role not in (Role.PRIMARY, Role.DEPOSED):
            raise NotPrimary(f"this node is {host.roles.role.value}: it has nothing to rejoin from", None)
        address = answer.address
        if host.roles.role is Role.PRIMARY:
            self.step_down(f"the paired standby at {address} is the primary at epoch {answer.epoch}", answer.epoch)
        self.source.stand_down()  # no pairing, no heartbeats: a standby from now on
        host.roles.transition(Role.STANDBY, f"rejoining: following the new primary at {address} "
                                            f"(epoch {answer.epoch})")
        host.roles.primary_address = address
        host.node_state.set_standby_of(address)  # a restart follows it too
        follower.link.primary = parse_address(address, default_port=None)
        follower.refused = None
        follower.synced = False
        follower.rejoining = True  # the first snapshot logs every lease it discards
        follower.start()
        log.warning("REJOINING as a standby of %s (epoch %d, this node's was %d): its snapshot replaces this "
                    "node's table; leases it lacks are discarded (logged)", address, answer.epoch,
                    host.table.epoch)

    # -- stepping down ------------------------------------------------------------------------
    def on_step_down_request(self, epoch: Any, seen_primary_ms: Any, requester: str) -> dict:
        """A peer's ``STEP_DOWN``: a standby promoting to ``epoch`` asks this primary to stop.

        ``seen_primary_ms`` is the newest time of this node's monotonic clock
        (ms) the standby had heard when it asked; a request older than
        ``protocol.STEP_DOWN_FRESH_MS`` by this node's clock is refused, since
        the standby no longer waits for its answer (it may have stayed a standby).

        Returns ``{"role", "epoch"}`` (the confirmation the standby waits for).
        A node that is already deposed confirms again without changing anything.

        Raises:
            NotPrimary: this node is a standby or promoting (it grants nothing anyway).
            InvalidArgument: ``epoch`` out of bounds (see :func:`check_step_down_epoch`),
                or ``seen_primary_ms`` not an int, in the future or stale; nothing changes.
        """
        host = self.host
        role = host.roles.role
        if role is Role.DEPOSED:
            P.check_epoch(epoch, "step-down epoch")
            return {"role": role.value, "epoch": host.table.epoch}
        if role is not Role.PRIMARY:
            raise NotPrimary(f"this node is {role.value}: it has nothing to step down from", None)
        epoch = check_step_down_epoch(epoch, host.table.epoch)
        if type(seen_primary_ms) is not int:
            raise InvalidArgument(f"step-down seen_primary_ms must be int, not {type(seen_primary_ms).__name__}")
        age_ms = self.clock() - seen_primary_ms
        if not 0 <= age_ms <= P.STEP_DOWN_FRESH_MS:
            raise InvalidArgument(f"step-down request echoes this node's clock from {age_ms} ms ago (must be "
                                  f"0..{P.STEP_DOWN_FRESH_MS} ms): too old or not this node's; refused")
        self.step_down(f"{requester} is promoting to epoch {epoch}", epoch)
        return {"role": host.roles.role.value, "epoch": host.table.epoch}

    def step_down(self, why: str, epoch: int) -> None:
        """Refuse every lock operation from now on - and after a restart: the step-down
        is written to ``<data dir>/deposed.json`` (fsynced) before anyone hears of it."""
        host = self.host
        log.critical("stepping down: %s (own epoch %d); refusing every lock operation", why, host.table.epoch)
        host.roles.transition(Role.DEPOSED, why)
        write_deposed(host.data_dir, epoch, why)
        host.node_state.raise_epoch(epoch)
        host.close_client_connections("this node stepped down")

    # -- promotion --------------------------------------------------------------------------
    def check_promotable(self, force: bool) -> None:
        """Refuse an operator's promotion that cannot start (nothing changes).

        Raises:
            InvalidArgument: already the primary, or run with ``--coordinator``.
            NotPrimary: promoting or deposed.
            Unavailable: never synchronised with a primary, and not ``force``.
        """
        role = self.host.roles.role
        if self.coordinated is not None:
            raise InvalidArgument("this node is run with --coordinator: etcd decides which node is primary (stop "
                                  "the primary, or let its lease run out, to move the role)")
        if role is Role.PRIMARY:
            raise InvalidArgument("this node is already the primary")
        if role is not Role.STANDBY:
            raise NotPrimary(f"this node is {role.value} and cannot be promoted", None)
        if not self._standby_follower().synced and not force:
            raise Unavailable("this standby has never synchronised with a primary; promote with force "
                              "only if its data directory is known to be current")

    def _standby_follower(self) -> StandbyFollower:
        """The follower of this standby (a node started as primary has none, and never
        becomes a standby: it can only be deposed).

        Raises:
            NotPrimary: this node has no primary to follow.
        """
        if self.follower is None:
            raise NotPrimary("this node was started as a primary: it follows no primary", None)
        return self.follower

    def on_primary_silent(self) -> asyncio.Task | None:
        """The follower's watchdog: the paired primary was silent for the failover window.

        Starts an automatic promotion unless one runs, or one failed less than a
        failover window ago (the watchdog keeps asking while the node is a standby).
        Returns the promotion's task (kept in ``tasks``: a failure is logged as an
        error and counted there), or None when none starts.
        """
        if self._auto is not None and not self._auto.done():
            return None
        if self.clock() < self._auto_retry_at_ms:
            return None

        async def run() -> None:
            try:
                await self.promote(reason="primary silent", automatic=True)
            except BaseException:
                self._auto_retry_at_ms = self.clock() + self._standby_follower().failover_after_ms
                raise  # logged as an error and counted by self.tasks

        self._auto = self.tasks.spawn(run(), "automatic promotion")
        return self._auto

    async def promote(self, reason: str, *, force: bool = False, automatic: bool = False,
                      epoch: int | None = None, in_sync: str | None = None) -> dict:
        """Turn this standby into the primary (see the module docstring).

        ``epoch``: the epoch an arbiter handed out (``--coordinator``); it must
        be above every epoch this node has seen, else the promotion is refused.
        ``in_sync``: why the arbiter found this node in the group's in-sync set
        (:mod:`fastlock.replication.groupsync`): no grace period; None: the pair's rules.

        Returns ``{"epoch", "grace_ms", "leases", "primary_confirmed"}``.

        Raises:
            NotPrimary: this node is not a standby.
            Unavailable: the old primary may still be granting, or the epoch
                would leave the encodable range; the node stays a standby.
        """
        host = self.host
        roles = host.roles
        if roles.role is not Role.STANDBY:
            raise NotPrimary(f"this node is {roles.role.value}", None)
        follower = self._standby_follower()
        deposed = read_deposed(host.data_dir) or {}
        least = max(host.table.epoch, follower.primary_epoch, host.node_state.max_epoch_seen,
                    int(deposed.get("epoch", 0)), self.known_epoch()) + 1
        if epoch is not None and epoch < least:
            raise Unavailable(f"cannot promote at epoch {epoch} from the coordinator: this node has seen "
                              f"epoch {least - 1} already")
        epoch = least if epoch is None else epoch
        if epoch > P.MAX_EPOCH:
            raise Unavailable(f"cannot promote: epoch {epoch} would exceed {P.MAX_EPOCH} (tokens must stay "
                              f"below 2**63)")
        roles.transition(Role.PROMOTING, reason)  # stops the watchdog and any concurrent promotion
        try:
            return await self._promote(reason, epoch, force=force, automatic=automatic, in_sync=in_sync)
        except BaseException as exc:
            if roles.role is Role.PROMOTING:
                outcome = "refused" if isinstance(exc, FastlockError) else "failed"
                roles.transition(Role.STANDBY, f"promotion {outcome}: {exc.__class__.__name__}: {exc}")
                if host.table.epoch >= epoch:  # the new epoch reached the log: the old primary is below it
                    log.critical("promotion failed after epoch %d reached the log: not following the old "
                                 "primary again; restart this node", epoch)
                elif follower.stopped:
                    follower.start()
            raise

    async def _promote(self, reason: str, epoch: int, *, force: bool, automatic: bool,
                       in_sync: str | None = None) -> dict:
        host = self.host
        follower = self._standby_follower()
        table = host.table
        confirmed = False
        if not automatic:
            confirmed = await follower.depose(epoch)
            if confirmed:
                log.warning("primary %s confirmed it stepped down for epoch %d", follower.primary_address, epoch)
            elif not (force or (follower.failover_after_ms > 0 and follower.pair_confirmed)):
                raise Unavailable(
                    f"primary {follower.primary_address} did not confirm that it stepped down, and it is not "
                    f"known to fence itself for this standby (no --failover-after, or not paired yet): make "
                    f"sure it is dead, then promote with --force")
        # From here on this node acknowledges nothing more to the old primary, so its
        # fence (if any) can only close: stop following before waiting for it.
        follower.stop()
        # from when no other node serves (this node's monotonic ms): the old primary answered
        # that it stepped down, or it stopped by its own fence, F after the standby last heard
        # it (F - margin on its own clock: docs/failover-safety.md); None: not known (forced)
        if confirmed:
            alone_since: int | None = self.clock()
        elif follower.failover_after_ms > 0 and follower.pair_confirmed and follower.last_heard_ms:
            alone_since = follower.last_heard_ms + follower.failover_after_ms
        else:
            alone_since = None
        if not confirmed and not force and not automatic:
            wait_ms = max(0, follower.last_heard_ms + follower.failover_after_ms - self.clock())
            log.warning("primary %s did not confirm stepping down: waiting %d ms until its own "
                        "fence has closed", follower.primary_address, wait_ms)
            if wait_ms > 0:
                await asyncio.sleep(wait_ms / 1000.0)
        out_of_sync = False  # the witness's word that the old primary acknowledged grants this node may lack
        witnessed_ttl_ms = 0  # the longest TTL the old primary told the witness (replication/ttlbound.py)
        if self.witness is not None:
            verdict = await self.witness.vote(epoch, max(follower.failover_after_ms, 1000),
                                              required=not (confirmed or force))
            out_of_sync, witnessed_ttl_ms = verdict.out_of_sync, verdict.max_ttl_ms
        if self.before_serving is not None:  # once the old primary serves no more: it moves no slot after
            await self.before_serving()
            known = self.known_epoch()
            if known >= epoch:  # the map it read names floors this bid did not go above: bid again above them
                raise Unavailable(f"cannot promote at epoch {epoch}: the shard map read now has token floors "
                                  f"of this group's slots whose next epoch is {known} (its primary may have "
                                  f"raised the group's epoch there)")
        table.set_epoch(epoch)
        host.wal.log_epoch(epoch)
        durable = host.loop.create_future()

        def on_durable() -> None:
            if not durable.done():
                durable.set_result(None)

        host.wal.when_durable(on_durable)
        await durable
        host.node_state.raise_epoch(epoch)
        holders = table.holders()
        longest = max([follower.max_ttl_ms, host.max_ttl_ms, host.node_state.max_ttl_ms, witnessed_ttl_ms]
                      + [h.ttl_ms for h in holders])
        grace = self.promotion_grace_ms if self.promotion_grace_ms is not None else longest
        # synchronous replication: in sync, this node has every grant a client was told of
        no_grace = in_sync or follower.sync.covers_promotion(confirmed=confirmed, forced=force,
                                                             automatic=automatic)
        if no_grace is not None and out_of_sync and not confirmed:  # a confirmed step-down: every status read
            log.warning("no promotion without a grace period (%s): the witness says the old primary acknowledged "
                        "grants without its standby", no_grace)
            no_grace = None
        if no_grace is not None:
            grace = 0
            log.warning("promotion without a grace period: %s", no_grace)
        # a primary now: it may start as one, and a restart before the grace ends holds it again
        host.node_state.promoted(grace)
        now = self.clock()
        unknown = ran_out = 0
        for h in holders:
            # the deadline kept since the lease arrived; unknown (recovered from this
            # node's own log after a restart): a fresh full TTL from now
            deadline = follower.lease_deadline(h.name, h.token)
            if deadline is None:
                deadline = now + h.ttl_ms
                unknown += 1
            elif deadline <= now:
                ran_out += 1
            # install_holder sets deadline = now + ttl_ms: keep ttl_ms, place the deadline
            table.install_holder(h.name, h.token, h.owner, h.ttl_ms, h.lock_delay_ms, h.meta,
                                 max(0, deadline - h.ttl_ms), h.shared, h.limit)
        table.drain_events()
        host.roles.alone_since = None if alone_since is None else (epoch, min(alone_since, now))
        host.roles.transition(Role.PRIMARY, f"promoted ({reason}) at epoch {epoch}", grace_until_ms=now + grace)
        revokes = host.revoke_deadlines.arm_all()  # replicated revoke requests: revoked at their deadline
        follower.queues.promoted()  # the old primary's waiters keep their places (fastlock.server.reclaim)
        if self.after_promotion is not None:
            self.after_promotion()
        self._arm_peer_check()  # fenced later (its new standby silent), it looks for a newer primary
        table.expire(now)  # leases whose kept deadline passed: logged and WAL-recorded like any expiry
        host.after_batch()
        if grace:
            self._end_grace_later(grace)
        log.warning(
            "PROMOTED to primary (%s): epoch %d, %d replicated leases kept until their replicated deadline "
            "(%d with an unknown one given a full TTL from now, %d ran out and expired), %d revoke requests "
            "kept, no new grants for %d ms (grace)", reason, epoch, len(holders) - ran_out, unknown, ran_out,
            revokes, grace,
        )
        return {"epoch": epoch, "grace_ms": grace, "leases": len(holders) - ran_out, "primary_confirmed": confirmed}

    # -- the operator's word -----------------------------------------------------------------
    def serve_alone(self) -> dict:
        """Unpair from the standby and stop fencing (see ``ReplicationSource.serve_alone``).
        A fenced node first moves its epoch SERVE_ALONE_EPOCH_STEP above the highest it knows
        (logged in its WAL), so its tokens stay above any its standby granted if that standby
        was promoted meanwhile; ``epoch`` in the answer then.  Two holders of one lock remain
        possible in that case (the operator's call): fencing tokens tell them apart.

        Raises:
            NotPrimary: this node is not the primary.
        """
        if self.host.roles.role is not Role.PRIMARY:
            raise NotPrimary(f"this node is {self.host.roles.role.value}", self.host.roles.primary_address)
        if self.source.coordinated:
            raise InvalidArgument("this node is run with --coordinator: the coordinator decides, not serve-alone")
        host = self.host
        epoch = None
        if self.source.fenced:
            # Fenced, its standby may have been promoted meanwhile (a promotion takes the epoch one
            # above the primary's) and have granted: this node serves at two epochs above the
            # highest it knows, so that every token it grants is above any that standby granted.
            epoch = max(host.table.epoch, host.node_state.max_epoch_seen) + SERVE_ALONE_EPOCH_STEP
            host.table.set_epoch(epoch)
            host.wal.log_epoch(epoch)  # before any grant of the new epoch in the log
            host.node_state.raise_epoch(epoch)
            log.warning("serving alone while fenced: epoch %d (its standby may have been promoted to %d and "
                        "granted: every token of this node is above its)", epoch, epoch - 1)
        answer = self.source.serve_alone()
        if epoch is not None:
            answer["epoch"] = epoch
        return answer

