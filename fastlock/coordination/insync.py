"""The group's in-sync set in etcd: ``PREFIX/sync``, as Patroni's ``/sync`` key.

``PREFIX/sync``
    ``{"node", "epoch", "members"}`` (JSON, attached to no lease: it outlives the
    primary that wrote it): the primary ``node`` at ``epoch`` and the identities
    (``replica principal/node id``) of the standbys that have every
    grant and extend it acknowledged to a client.

Who writes it
    Only the primary, with a transaction that compares the primary key's lease
    with its own (:meth:`SyncArbiter.publish`): a node that no longer holds the
    primary key cannot change it.  A bid writes it too, in the transaction that
    takes the primary key, naming the new primary, its epoch and no member.

What a candidate reads
    A bid reads it and compares its revision in the same transaction
    (:meth:`SyncArbiter.bid_guard`): the record a new primary judges is the one etcd
    held when it took the key, and nobody can change it after (the old primary's
    lease no longer holds the key).  A candidate not in the set waits
    ``behind_delay_ms`` before it bids while a member of the set is live
    (:meth:`SyncArbiter.bid_preferred`), so that an in-sync node wins when it can.

The value is untrusted input (:class:`~fastlock.coordination.records.SyncRecord`
never raises, and a record that is not exactly what a primary writes names no
member): a record that names no member, another epoch or another primary makes
every promotion keep its grace period.  The promotion rule and the safety
argument are in :mod:`fastlock.replication.groupsync`.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable

from .etcd import MAX_NODE_ID, EtcdArbiter
from .gateway import KeyValue, b64
from .records import SyncRecord, json_object

__all__ = ["SyncArbiter"]

log = logging.getLogger("fastlock.coordination")

#: the most member keys shown in STATUS (``coordinator.members``)
STATUS_MEMBERS = 64
#: seconds between two steps of a standby that lost its primary (see SyncArbiter.hurry)
HURRY_S = 0.1


class SyncArbiter(EtcdArbiter):
    """An :class:`~fastlock.coordination.etcd.EtcdArbiter` that keeps the group's in-sync set
    (see the module docstring); the same arguments.

    Attributes:
        sync: ``PREFIX/sync`` as last read (a step reads it).
        hurry: see below.
        sync_at_election: the record this node's last bid compared (the winning one when
            ``on_elected`` runs; None: no bid yet).
        members: the live members' keys as last read (node, address, position, epoch, ident),
            for STATUS (at most :data:`STATUS_MEMBERS`, strings cut at 256 characters).
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.ident = kwargs.get("ident", "")
        self.sync = SyncRecord.decode(None)
        self.sync_at_election: SyncRecord | None = None
        self.members: list[dict] = []
        #: asked at each step of a node not holding the key: True while it has lost its link to the
        #: primary (dead, frozen or cut off), so that it sees the key go free and a new primary soon
        self.hurry: Callable[[], bool] | None = None
        self._bid_sync: SyncRecord | None = None  # PREFIX/sync as read for the bid under way
        self._read_at = -(1 << 62)  # own clock (ms) of the last status reads

    @property
    def sync_key(self) -> str:
        return f"{self.prefix}/sync"

    async def read_sync(self) -> SyncRecord:
        """Read ``PREFIX/sync`` (decoded, never raising on its value).

        Raises:
            EtcdUnavailable: etcd did not answer.
        """
        self.sync = SyncRecord.decode(await self.gateway.get(self.sync_key))
        return self.sync

    async def step(self) -> None:
        """One arbiter step, then (at most every quarter TTL) read the in-sync set and the
        members (for STATUS).  While :attr:`hurry` says so, the next step comes after
        :data:`HURRY_S` instead of a quarter TTL."""
        hurry = self.hurry is not None and not self.holding and self.hurry()
        try:
            await self._step_and_read()
        finally:
            if hurry:  # armed once the step is over (a poke during a step is cleared after it)
                asyncio.get_running_loop().call_later(HURRY_S, self.poke)

    async def _step_and_read(self) -> None:
        await super().step()
        now = self.clock()
        if now - self._read_at < self.ttl_ms // 4:
            return  # a hurried step: the status reads wait for the next regular one
        self._read_at = now
        await self.read_sync()
        members = []
        for kv in await self.gateway.get_prefix(self.members_prefix, STATUS_MEMBERS):
            data = json_object(kv.value)  # untrusted: only short strings and ints are shown
            members.append({k: v[:MAX_NODE_ID * 2] if type(v) is str else v
                            for k in ("node", "address", "position", "epoch", "ident", "principal")
                            if type(v := data.get(k)) in (str, int)})
        self.members = members

    async def prefetch_for_bid(self) -> None:
        """Read ``PREFIX/epoch`` and ``PREFIX/sync`` for the bid (both compared by its transaction)."""
        self._bid_sync = None

        async def read() -> None:
            self._bid_sync = await self.read_sync()

        await asyncio.gather(super().prefetch_for_bid(), read())

    async def bid_preferred(self, members: list[KeyValue]) -> list[str]:
        """The live members (of ``members``, the member keys as just read) of the current
        in-sync set when this node is not one of them."""
        record = self._bid_sync or await self.read_sync()
        current = (await self.epoch_for_bid()).stored
        idents = {member.rpartition("/")[2] for member in record.members}  # "replica principal/node id"
        if not idents or self.ident in idents or record.epoch != current:
            return []
        live = {json_object(kv.value).get("ident") for kv in members}
        return [f"in-sync standby {ident!r}" for ident in sorted(idents & live)]

    async def bid_guard(self, epoch: int) -> tuple[list[dict], list[dict]]:
        """Compare ``PREFIX/sync`` as read for this bid (now if it was not), and replace it with
        this node's empty set: a change since the read fails the bid."""
        record = self._bid_sync or await self.read_sync()
        self._bid_sync = None  # the next bid reads it again
        self.sync_at_election = record  # read by on_elected when this bid wins (bid calls it)
        key = b64(self.sync_key)
        fresh = SyncRecord(self.node, epoch, frozenset()).encode()
        return ([{"target": "MOD", "key": key, "mod_revision": str(record.mod_revision), "result": "EQUAL"}],
                [{"request_put": {"key": key, "value": b64(fresh)}}])

    async def adopt_guard(self, epoch: int) -> tuple[list[dict], list[dict]]:
        """:meth:`~fastlock.coordination.etcd.EtcdArbiter.adopt_epoch`'s compares and puts:
        ``PREFIX/sync`` as read now (a change since fails the adoption), written again at
        ``epoch`` with the same members when this primary wrote it at its epoch (a bid prefers
        the in-sync standbys only when the set's epoch is ``PREFIX/epoch``'s)."""
        record = await self.read_sync()
        key = b64(self.sync_key)
        members = record.members if record.node == self.node and record.epoch == self.epoch else frozenset()
        fresh = SyncRecord(self.node, epoch, members).encode()
        return ([{"target": "MOD", "key": key, "mod_revision": str(record.mod_revision), "result": "EQUAL"}],
                [{"request_put": {"key": key, "value": b64(fresh)}}])

    async def publish(self, members: frozenset[str]) -> bool:
        """Write the in-sync set ``members`` (data directory identities) for this primary's
        epoch, only while the primary key is under this node's lease.  True: etcd has it.

        Raises:
            EtcdUnavailable: etcd did not answer (it may or may not have it).
        """
        if not self.holding or not self.lease:
            return False
        record = SyncRecord(self.node, self.epoch, frozenset(members))
        answer = await self.gateway.txn(
            [{"target": "LEASE", "key": b64(self.primary_key), "lease": str(self.lease), "result": "EQUAL"}],
            [{"request_put": {"key": b64(self.sync_key), "value": b64(record.encode())}}])
        if not answer.get("succeeded"):
            log.warning("etcd: in-sync set not written: the primary key is no longer under this node's lease")
            return False
        self.sync = record
        log.info("etcd: in-sync set at epoch %d is now %s", self.epoch, json.dumps(sorted(members)))
        return True

    def member_idents(self) -> set[str]:
        """The standbys an election may promote, as the live member keys name them (as last
        read, at most :data:`STATUS_MEMBERS` keys), but this node's own: ``replica
        principal/identity`` for a key that names its node's replica principal, the data
        directory identity alone for one that names none (a node without a standby token)."""
        idents = set()
        for member in self.members:
            ident, principal = member.get("ident"), member.get("principal")
            if type(ident) is str and ident and ident != self.ident:
                idents.add(f"{principal}/{ident}" if type(principal) is str and principal else ident)
        return idents

    def status(self) -> dict:
        """The arbiter's state for STATUS, with the in-sync set and the live members."""
        s = self.sync
        return {**super().status(), "sync": {"node": s.node, "epoch": s.epoch, "members": sorted(s.members)},
                "members": self.members, "ident": self.ident}
