"""``fastlock shard move|split``: moving slots to another shard group (docs/sharding.md, "Moving slots").

:func:`move_slots` drives a move of slots ``first..last`` to group ``to`` in steps, each of
which may be run again (a move killed part way is finished by running the command again, or
undone with ``--abort`` while the slots are still marked):

1. *mark*: the map in etcd gets the range marked ``moving_to`` (epoch + 1, an etcd transaction
   comparing the map's revision).  The source's nodes follow the map and freeze the slots
   (:mod:`fastlock.server.sharded`: requests for them are held, their waiters taken out).
2. *ship*: once both primaries serve the marked map, the frozen state is paged out of the
   source (``SLOT_EXPORT``) and into the destination (``SLOT_IMPORT``,
   :mod:`fastlock.server.slotmove`), as an admin principal (the token in ``FASTLOCK_TOKEN_FILE``).
3. *flip*: the map gives the range to ``to`` (epoch + 1) with the token floor the ship carried
   (the highest of its pages' ``floor``: the source's high-water mark) recorded on the range, so
   that every node of ``to`` stays above it whatever its log holds; in a transaction comparing the revision of
   the map the state was shipped under (a map changed since: read again and shipped again under
   it, at most :data:`FLIP_ATTEMPTS` ships).  The source drops the slots' leases and
   answers its held requests with ``WrongShard``; the destination lets the moved waiters back in
   their old order.

After the mark the command tells both primaries with ``SHARD_MAP_NOTICE``
(:mod:`fastlock.server.mapnotice`) to read the map in etcd at once rather than wait for their
watch; the flip each takes from its watch.

:class:`MoveReport` says what was done; ``freeze_ms`` is the time from the mark to the flip
(milliseconds), the pause a client of those slots sees.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

import msgpack

from ..client import Client
from ..client.calls import call
from ..client.sharded import read_shard_map
from ..coordination.shardmap import EtcdShardMap, MapConflict
from ..errors import ConnectionLost, FastlockError, InvalidArgument
from ..protocol.ops import OP_SHARD_MAP_NOTICE, OP_SLOT_EXPORT, OP_SLOT_IMPORT
from ..sharding import ShardMap, ShardMapError
from ..sharding.moves import abort_move, finish_move, mark_moving, move_state

__all__ = ["MoveReport", "move_slots", "abort_slots", "SEEN_TIMEOUT_S"]

#: seconds to wait for a primary to serve the new map before giving up (the move can be run again)
SEEN_TIMEOUT_S = 30.0
#: seconds between the first two looks at a primary's map (a quarter longer after each look, up to SEEN_POLL_S)
SEEN_FIRST_POLL_S = 0.002
#: the most seconds between two looks at a primary's map
SEEN_POLL_S = 0.05
#: seconds one SLOT_EXPORT / SLOT_IMPORT may take
REQUEST_TIMEOUT_S = 30.0
#: seconds a group's primary has to answer SHARD_MAP_NOTICE (riding through a failover meanwhile: a
#: group's lease TTL, ``--coordinator-ttl``, is 2 s by default); none answering in time fails the step
NOTICE_TIMEOUT_S = 5.0
#: the most ships a move makes when the map changes between its ship and its flip (each flip compares
#: the map read before its ship)
FLIP_ATTEMPTS = 4


@dataclass
class MoveReport:
    """What one run of a move did: the slots, the groups, the steps run (``"mark"``, ``"ship"``,
    ``"flip"``; none if the move was done already), leases, queues, lock-delays and keys shipped, the
    map epoch at the end and ``freeze_ms`` (ms from the mark to the flip; None when this run did
    not mark, or did not flip)."""

    first: int
    last: int
    source: str | None
    to: str
    steps: list[str] = field(default_factory=list)
    leases: int = 0
    queues: int = 0
    delays: int = 0
    epoch: int = 0
    keys: int = 0
    #: moved leases the destination attached to their client sessions there
    sessions: int = 0
    #: principal -> [leases and waiting acquires held, lease quota] on the destination, for each
    #: principal the import put over its lease quota there (its acquires are refused until it holds less)
    over_quota: dict[str, list[int]] = field(default_factory=dict)
    freeze_ms: float | None = None
    #: the token floor this run shipped (the highest of its pages' ``floor``: a fencing token) and the
    #: flip recorded on the range; None when this run shipped nothing
    floor: int | None = None
    #: when each step of this run's freeze ended, ms after the mark's transaction was sent:
    #: ``mark_txn``, ``source_serves_mark``, ``dest_serves_mark``, ``shipped``, ``flip_txn``,
    #: ``source_serves_flip``, ``dest_serves_flip`` (empty when this run did not mark)
    phases_ms: dict[str, float] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)

    def phases_line(self) -> str:
        """The freeze's steps as one line: ``step +ms`` each, in order."""
        return ", ".join(f"{step} +{ms:.1f}" for step, ms in sorted(self.phases_ms.items(), key=lambda x: x[1]))


async def _notice(client: Client, epoch: int) -> bool:
    """Tell ``client``'s primary that etcd holds shard map ``epoch`` (SHARD_MAP_NOTICE,
    :mod:`fastlock.server.mapnotice`: it reads the map from etcd at once, not waiting for its
    watch); whether it serves that epoch or newer once it answered.  A node that cannot take
    the notice (an older version, a map not kept in etcd, etcd not answering it) answers an
    error: False, and the caller looks at its map until its watch brings the epoch.

    :raises ShardMapError: no node of the group answered within :data:`NOTICE_TIMEOUT_S` seconds
        (the group is down: the move stops there, and can be run again)."""
    try:
        answer = await call(client.connector, OP_SHARD_MAP_NOTICE, (epoch,), NOTICE_TIMEOUT_S)
    except ConnectionLost as exc:
        raise ShardMapError(f"{client.connector.addresses} did not answer within "
                            f"{NOTICE_TIMEOUT_S:g} s ({exc}): is that group down? (run the move again once it "
                            f"serves)") from None
    except FastlockError:
        return False
    return type(answer) is dict and type(answer.get("epoch")) is int and answer["epoch"] >= epoch


async def _serves(client: Client, epoch: int, notice: bool = False) -> None:
    """Wait until ``client``'s primary serves a map of ``epoch`` or newer (first telling it of
    that epoch, when ``notice``: :func:`_notice`).

    :raises ShardMapError: not within :data:`SEEN_TIMEOUT_S` seconds."""
    deadline = time.monotonic() + SEEN_TIMEOUT_S
    if notice and await _notice(client, epoch):
        return
    pause = SEEN_FIRST_POLL_S  # a node sees the map through etcd's watch within milliseconds, mostly
    while True:
        found = await read_shard_map(client)
        if found is not None and found[1].epoch >= epoch:
            return
        if time.monotonic() > deadline:
            raise ShardMapError(f"{client.connector.addresses} did not serve shard map epoch {epoch} "
                                f"within {SEEN_TIMEOUT_S:g} s (run the move again to resume)")
        await asyncio.sleep(pause)
        pause = min(pause * 1.25, SEEN_POLL_S)


async def _ship(source: Client, dest: Client, first: int, last: int, report: MoveReport) -> None:
    """Page the state out of ``source`` and into ``dest``: the export of the next page is asked
    while the destination imports this one (exports only read the frozen state; the imports run
    one at a time, in the pages' order)."""
    page = await call(source.connector, OP_SLOT_EXPORT, (first, last, None), REQUEST_TIMEOUT_S)
    while True:
        importing = call(dest.connector, OP_SLOT_IMPORT, (first, last, msgpack.packb(page)), REQUEST_TIMEOUT_S)
        if page["more"]:
            exporting = call(source.connector, OP_SLOT_EXPORT, (first, last, page["after"]), REQUEST_TIMEOUT_S)
            done, following = await asyncio.gather(importing, exporting)
        else:
            done, following = await importing, None
        report.leases += done["leases"]
        report.queues += done["queues"]
        report.delays += done["delays"]
        report.keys += done.get("keys", 0)
        report.sessions += done.get("sessions", 0)
        report.over_quota.update(done.get("over_quota", {}))
        floor = page.get("floor")
        if type(floor) is int and (report.floor is None or floor > report.floor):
            report.floor = floor
        if following is None:
            return
        page = following


async def move_slots(stored: EtcdShardMap, first: int, last: int, to: str, *,
                     progress: Any = None) -> MoveReport:
    """Move slots ``first..last`` to group ``to`` (see the module docstring); ``progress(text)``
    is told each step.

    :raises ShardMapError: the move cannot be made from the map in etcd (or a primary did not
        follow it in time).  :raises MapConflict: the map changed under the move (run it again).
    """
    def tell(text: str) -> None:
        if progress is not None:
            progress(text)

    shard_map, revision = await stored.read_existing()
    state = move_state(shard_map, first, last, to)
    report = MoveReport(first, last, state.source, to, epoch=shard_map.epoch)
    if state.step == "done":
        tell(f"slots {first}..{last} are owned by {to} already (epoch {shard_map.epoch})")
        return report
    marked_at = None
    mark_sent: float | None = None

    def step(name: str) -> None:
        if mark_sent is not None:
            report.phases_ms[name] = round((time.monotonic() - mark_sent) * 1000.0, 1)

    async def one(client: Client, side: str, epoch: int, what: str) -> None:
        await _serves(client, epoch, notice=True)
        step(f"{side}_serves_{what}")

    async def both_serve(epoch: int, what: str) -> None:
        await asyncio.gather(one(source, "source", epoch, what), one(dest, "dest", epoch, what))

    assert state.source is not None
    source = Client(list(shard_map.group(state.source).addresses), client_name="fastlock-shard-move")
    dest = Client(list(shard_map.group(to).addresses), client_name="fastlock-shard-move")
    try:
        if state.step == "start":
            # both primaries reached (connected, handshaken) before the mark: not inside the freeze
            await asyncio.gather(_serves(source, shard_map.epoch), _serves(dest, shard_map.epoch))
            new = mark_moving(shard_map, first, last, to)
            mark_sent = time.monotonic()
            revision = await stored.replace(revision, shard_map, new)
            marked_at = time.monotonic()
            step("mark_txn")
            shard_map = new
            report.steps.append("mark")
            tell(f"epoch {new.epoch}: slots {first}..{last} of {state.source} marked moving to {to}")
        # the flip compares the map's revision read (or written by the mark) before the ship: a map
        # changed since (an abort and a new mark of the slots among the changes) is read again and the
        # state shipped again under it, so the flip never gives the slots without the state shipped
        # under the mark it ends
        flipped = None
        for _attempt in range(FLIP_ATTEMPTS):
            if not revision:
                shard_map, revision = await stored.read_existing()
                now = move_state(shard_map, first, last, to)
                if now.step == "done":
                    flipped = shard_map
                    break
                if now.step != "moving":
                    raise ShardMapError(f"slots {first}..{last} are no longer marked moving to {to} (epoch "
                                        f"{shard_map.epoch}: the move was aborted meanwhile)")
            await both_serve(shard_map.epoch, "mark")
            report.leases = report.queues = report.delays = report.keys = report.sessions = 0
            report.floor = None
            report.over_quota.clear()
            try:
                await _ship(source, dest, first, last, report)
            except InvalidArgument as exc:
                if "hold" in str(exc) and "keys" in str(exc):  # SlotsHoldKeys: the move cannot be made
                    await abort_slots(stored, first, last, to)
                    report.steps.append("abort")
                    raise ShardMapError(f"{exc} (the mark is cleared: the slots are served by {state.source} "
                                        f"again)") from None
                raise
            step("shipped")
            report.steps.append("ship")
            tell(f"shipped {report.leases} leases ({report.sessions} attached to their sessions), {report.queues} "
                 f"waiter queues, {report.delays} lock-delays, {report.keys} keys")
            for principal, (held, quota) in sorted(report.over_quota.items()):
                tell(f"principal {principal} now holds {held} leases and waiting acquires in {to}, over its quota "
                     f"of {quota} there: its leases are kept, its acquires there refused until it holds fewer")
            try:
                flipped = finish_move(shard_map, first, last, to, report.floor)
                await stored.replace(revision, shard_map, flipped)
                break
            except MapConflict:
                flipped = None
                revision = 0
                tell(f"the map changed since epoch {shard_map.epoch}: shipping again under the map now")
        if flipped is None:
            raise ShardMapError(f"the shard map changed during each of {FLIP_ATTEMPTS} ships of slots {first}..{last}: "
                                f"run the move again")
        if marked_at is not None:
            report.freeze_ms = (time.monotonic() - marked_at) * 1000.0
        step("flip_txn")
        report.steps.append("flip")
        report.epoch = flipped.epoch
        tell(f"epoch {flipped.epoch}: slots {first}..{last} owned by {to}"
             + (f", token floor {report.floor}" if report.floor is not None else ""))
        # each primary takes the flip from its own watch (not told: moved waiters lost their place
        # when the flip was told, tests/test_shard_move.py); the destination serves the slots, the
        # source has dropped them and redirects
        await _serves(dest, flipped.epoch)
        step("dest_serves_flip")
        await _serves(source, flipped.epoch)
        step("source_serves_flip")
        if report.phases_ms:
            tell(f"the freeze's steps (ms after the mark was sent): {report.phases_line()}")
    finally:
        await asyncio.gather(source.close(), dest.close(), return_exceptions=True)
    return report


async def abort_slots(stored: EtcdShardMap, first: int, last: int, to: str) -> ShardMap:
    """Undo a move of ``first..last`` to ``to`` still marked (epoch + 1): the source serves them
    again.  The destination's primary, taking that map, sends back the keys it imported and
    drops the leases it imported (:meth:`fastlock.server.sharded.ShardGate.offer`).
    :raises ShardMapError: not marked so."""
    return await stored.rewrite(lambda read: abort_move(read, first, last, to))
