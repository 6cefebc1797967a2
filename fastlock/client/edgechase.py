"""Deadlock detection across shards for incremental acquires (edge chasing), on the
client's side: :class:`EdgeChaser`, used by :class:`~fastlock.client.sharded.ShardedClient`.

A task that holds ``a`` (group 1) and waits for ``b`` (group 2), while another holds ``b``
and waits for ``a``, is a cycle that neither server sees whole.  The servers' side and the
rule are :mod:`fastlock.server.edgechase`; in short:

* a routing client has a random secret and sends it (``WAIT_IDENTITY``) on each group
  connection before its first acquire there: its **wait id** (a hash of the secret) and
  the actor it sends with each acquire (its task or thread) name one party on every group;
* an acquire that waits (``wait`` not 0) runs a **probe** every ``deadlock_timeout``
  seconds (default 1 s, as the servers' ``--deadlock-timeout``): it asks every group what
  the party waits for (``WAITS_FOR``: when its wait began, and the parties with a wait id
  that hold, or wait ahead of it for, a name it waits for), then the same of each party
  found that is **older** (its wait began earlier), hop by hop, at most
  :data:`MAX_PROBE_DEPTH` hops and :data:`MAX_PROBE_PARTIES` parties;
* if the probe comes back to the party through older parties only, the party is the
  **youngest** of a cycle and its own acquire is the victim: it is withdrawn and raises
  :class:`~fastlock.errors.DeadlockDetected` (the leases it holds are unchanged: release
  some, then retry).  Every party of a cycle waits, so each probes; only the youngest
  finds such a path, and the youngest of every cycle finds one - detectors agree because
  the times they compare are the servers' (each party's from the one server where it waits).

A probe only reads.  Which groups take part: every group of the map (their clients are
opened as needed).  Parties without a wait id (plain clients of one group) are not followed:
a cycle through one of them across groups is not found (one within a group is, by that
group's server).  A semaphore's wait is not followed (any one holder can end it).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar

from ..errors import DeadlockDetected, FastlockError
from ..protocol.ops import OP_WAIT_IDENTITY, OP_WAITS_FOR
from .acquire import actor_id

if TYPE_CHECKING:  # pragma: no cover
    from .client import Client
    from .sharded import ShardedClient

log = logging.getLogger(__name__)

__all__ = ["EdgeChaser", "Party", "MAX_PROBE_DEPTH", "MAX_PROBE_PARTIES", "DEADLOCK_TIMEOUT"]

_T = TypeVar("_T")

#: the most hops one probe travels (a server refuses more: fastlock.server.edgechase)
MAX_PROBE_DEPTH = 16
#: the most parties one probe asks about
MAX_PROBE_PARTIES = 64
#: seconds an acquire waits before its first probe, and between two probes
DEADLOCK_TIMEOUT = 1.0


class Party(NamedTuple):
    """A waiter across groups: a routing client's ``wait_id`` (16 bytes) and ``actor`` (int)."""

    wait_id: bytes
    actor: int


class Waits(NamedTuple):
    """What the groups said of one party: ``since_ms`` (when its latest wait began, the
    wall clock of the server where it waits, ms; None: it waits nowhere) and ``waits_for``."""

    since_ms: int | None
    waits_for: tuple[Party, ...]


class EdgeChaser:
    """One :class:`~fastlock.client.sharded.ShardedClient`'s wait identity and probes.

    ``deadlock_timeout`` (seconds, None: no detection across groups) is read at each
    waiting acquire."""

    def __init__(self, sharded: ShardedClient, deadlock_timeout: float | None = DEADLOCK_TIMEOUT):
        self.sharded = sharded
        self.deadlock_timeout = deadlock_timeout
        self._secret = secrets.token_bytes(32)
        #: this client's wait id, once a group answered WAIT_IDENTITY (None before)
        self.wait_id: bytes | None = None
        #: id(group client) -> the connection WAIT_IDENTITY was sent on
        self._sent_on: dict[int, Any] = {}
        #: deadlocks this client broke by failing its own acquire, and probes it made (figures for tests)
        self.victims = 0
        self.probes = 0

    async def identify(self, client: Client) -> None:
        """Send WAIT_IDENTITY on ``client``'s connection unless sent on it already (not
        awaited: the next request on the connection follows it)."""
        proto = await client.ensure_connected()
        if self._sent_on.get(id(client)) is proto:
            return
        self._sent_on[id(client)] = proto
        proto.request(OP_WAIT_IDENTITY, self._secret).add_done_callback(self._identified)

    def _identified(self, fut: asyncio.Future[Any]) -> None:
        if fut.cancelled():
            return
        exc = fut.exception()
        if exc is not None:
            log.debug("WAIT_IDENTITY refused: %s", exc)
        elif type(fut.result()) is bytes:
            self.wait_id = fut.result()

    async def acquire(self, name: str, wait: Any, call: Callable[[], Awaitable[_T]]) -> _T:
        """``await call()`` (the routed acquire of ``name`` with ``wait`` seconds) with a
        probe every ``deadlock_timeout`` seconds while it waits.  :raises DeadlockDetected:
        this acquire was the youngest wait of a cycle across groups (withdrawn; nothing
        else changed)."""
        sharded = self.sharded
        timeout = self.deadlock_timeout
        if timeout is None or wait == 0 or len(sharded.shard_map.groups) < 2 or type(name) is not str:
            return await call()
        client = sharded.client_for(name)
        try:
            await self.identify(client)
        except FastlockError as exc:  # the group cannot be reached now: the acquire rides through on its own
            log.debug("WAIT_IDENTITY not sent: %s", exc)
        actor = actor_id(client.connector)
        task = asyncio.current_task()
        assert task is not None
        found: list[tuple[Party, ...]] = []
        detector = asyncio.get_running_loop().create_task(self._detect(actor, timeout, task, found))
        try:
            return await call()
        except asyncio.CancelledError:
            cancelling = getattr(task, "cancelling", None)  # (Python 3.11+: another cancel counts too)
            if not found or (cancelling is not None and cancelling() > 1):
                raise
            uncancel = getattr(task, "uncancel", None)
            if uncancel is not None:
                uncancel()
            self.victims += 1
            steps = " -> ".join(f"party {p.wait_id.hex()[:8]}/{p.actor} waits for" for p in found[0])
            raise DeadlockDetected(f"{name!r}: deadlock across shard groups detected ({steps} the first); "
                                   f"this acquire was chosen to break it") from None
        finally:
            detector.cancel()

    async def _detect(self, actor: int, timeout: float, task: asyncio.Task[Any],
                      found: list[tuple[Party, ...]]) -> None:
        """Probe every ``timeout`` seconds; on a cycle whose youngest wait is this one, cancel ``task``."""
        while True:
            await asyncio.sleep(timeout)
            if self.wait_id is None:
                continue
            try:
                cycle = await self.probe(Party(self.wait_id, actor))
            except FastlockError as exc:  # a group down, a probe budget spent: try at the next tick
                log.debug("deadlock probe across groups failed: %s", exc)
                continue
            if cycle is not None:
                found.append(cycle)
                task.cancel()
                return

    async def probe(self, me: Party) -> tuple[Party, ...] | None:
        """The cycle through ``me`` on which every other party is older than ``me`` (its
        parties from ``me`` on), or None (see the module)."""
        self.probes += 1
        every = list(self.sharded.group_clients().values())
        sent = await asyncio.gather(*(self.identify(client) for client in every), return_exceptions=True)
        # a group that cannot be reached is left out (a cycle through it is found once it answers)
        clients = [client for client, result in zip(every, sent) if not isinstance(result, BaseException)]
        known: dict[Party, Waits] = {}
        parent: dict[Party, Party] = {}
        frontier = [me]
        mine: tuple[int, bytes, int] | None = None
        for hops in range(MAX_PROBE_DEPTH):
            if not frontier:
                return None
            answers = await asyncio.gather(*(self._ask(client, party, hops) for party in frontier
                                             for client in clients))
            n = len(clients)
            next_frontier: list[Party] = []
            for i, party in enumerate(frontier):
                waits = _merge(answers[i * n:(i + 1) * n])
                known[party] = waits
                if waits.since_ms is None:
                    continue
                if party == me:
                    mine = (waits.since_ms, me.wait_id, me.actor)
                elif mine is None or (waits.since_ms, party.wait_id, party.actor) >= mine:
                    continue  # younger than me: a cycle through it is another party's to break
                for nxt in waits.waits_for:
                    if nxt == me:
                        path = [party]
                        while path[-1] != me:
                            path.append(parent[path[-1]])
                        return tuple(reversed(path))
                    if nxt not in known and nxt not in parent and len(known) + len(next_frontier) < MAX_PROBE_PARTIES:
                        parent[nxt] = party
                        next_frontier.append(nxt)
            if mine is None:
                return None  # this party waits nowhere (granted meanwhile)
            frontier = next_frontier
        return None

    async def _ask(self, client: Client, party: Party, hops: int) -> Waits:
        proto = await client.ensure_connected()
        reply = await proto.request(OP_WAITS_FOR, party.wait_id, party.actor, hops)
        return _waits(reply)


def _waits(reply: Any) -> Waits:
    """A WAITS_FOR reply as :class:`Waits` (a malformed one: waits for nothing)."""
    if type(reply) is not dict:
        return Waits(None, ())
    since = reply.get("since_ms")
    rows = reply.get("for")
    if type(since) is not int or type(rows) is not list:
        return Waits(None, ())
    parties = tuple(Party(row[0], row[1]) for row in rows[:MAX_PROBE_PARTIES]
                    if type(row) is list and len(row) == 2 and type(row[0]) is bytes and type(row[1]) is int)
    return Waits(since, parties)


def _merge(answers: list[Waits]) -> Waits:
    """One party's waits over every group: the latest start, every party waited for."""
    starts = [w.since_ms for w in answers if w.since_ms is not None]
    if not starts:
        return Waits(None, ())
    parties = {p: None for w in answers for p in w.waits_for}
    return Waits(max(starts), tuple(parties))
