"""A named fake of :class:`fastlock.replication.host.ReplicationHost`, with no sockets and
a clock the test moves, for unit tests of replication and failover.

``FakeHost`` holds a real ``LockTable``, a real ``NodeRole`` and a real ``NodeState``
(in a temporary directory); the WAL, the loop's timers and the connections are
recorded fakes, so a test sees every heartbeat sent and every timer armed.
"""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

from fastlock import protocol as P
from fastlock._core import LockTable
from fastlock.replication import NodeState
from fastlock.roles import NodeRole, Role
from fastlock.server.preemption import RevokeDeadlines
from fastlock.wal import HolderRecord
from fastlock.wal.keyspace import KeySpace


class Clock:
    """Monotonic milliseconds that move only when the test says so."""

    def __init__(self, start_ms: int = 1_000_000):
        self.ms = start_ms

    def __call__(self) -> int:
        return self.ms

    def advance(self, ms: int) -> int:
        self.ms += ms
        return self.ms


class FakeTimer:
    def __init__(self, loop: FakeLoop, at_ms: int, callback: Callable[[], Any]):
        self.loop, self.at_ms, self.callback, self.cancelled = loop, at_ms, callback, False

    def cancel(self) -> None:
        self.cancelled = True


class FakeLoop:
    """``call_later``/``call_soon`` recorded; :meth:`run_due` runs the timers whose time has come."""

    def __init__(self, clock: Clock):
        self.clock = clock
        self.timers: list[FakeTimer] = []

    def call_later(self, delay_s: float, callback: Callable[[], Any]) -> FakeTimer:
        timer = FakeTimer(self, self.clock() + round(delay_s * 1000), callback)
        self.timers.append(timer)
        return timer

    def call_soon(self, callback: Callable[[], Any]) -> FakeTimer:
        return self.call_later(0, callback)

    def create_future(self):
        import asyncio

        return asyncio.get_running_loop().create_future()

    def run_due(self) -> int:
        ran = 0
        for timer in sorted(self.timers, key=lambda t: t.at_ms):
            if not timer.cancelled and timer.at_ms <= self.clock():
                self.timers.remove(timer)
                timer.callback()
                ran += 1
        return ran


class FakeWal:
    """The parts of the WAL replication uses: position, listeners, records logged."""

    def __init__(self):
        self.last_lsn = 0
        self.records: list[tuple] = []
        self.listeners: list[Callable] = []
        self.fail_durability: BaseException | None = None  # raised by when_durable when set

    def stats(self) -> dict:
        return {"last_lsn": self.last_lsn}

    def add_listener(self, listener: Callable) -> None:
        self.listeners.append(listener)

    def read_from(self, lsn: int):
        return iter(())

    def _log(self, *record) -> None:
        self.last_lsn += 1
        self.records.append(record)

    def log_grant(self, *args) -> None:
        self._log("grant", *args)

    def log_release(self, *args) -> None:
        self._log("release", *args)

    def log_expire(self, *args) -> None:
        self._log("expire", *args)

    def log_extend(self, *args) -> None:
        self._log("extend", *args)

    def log_epoch(self, *args) -> None:
        self._log("epoch", *args)

    def log_lock_delay(self, *args) -> None:
        self._log("lock_delay", *args)

    def log_lock_delays(self, delays, now_ms) -> None:
        for name, until_ms in delays:
            if until_ms > now_ms:
                self._log("lock_delay", name, until_ms - now_ms)
    def log_key_put(self, *args) -> None:
        self._log("key_put", *args)

    def log_key_delete(self, *args) -> None:
        self._log("key_delete", *args)

    def log_revoke_request(self, *args) -> None:
        self._log("revoke_request", *args)

    def when_durable(self, callback: Callable[[], Any]) -> None:
        if self.fail_durability is not None:
            raise self.fail_durability
        callback()


class FakeConnection:
    """A server-side connection whose output the test reads back as decoded messages."""

    def __init__(self, session: int, peer: str = "127.0.0.1:1"):
        self.session = session
        self.peer = peer
        self.closed = False
        self.aborted = False
        self.sent: list[bytes] = []
        self.out_cap = 64 << 20

    def abort(self) -> None:
        self.closed = self.aborted = True

    def send(self, data: bytes) -> None:
        self.sent.append(data)

    def flush(self) -> None:
        pass

    def messages(self) -> list:
        dec = P.FrameDecoder(limits=P.REPLY_LIMITS)
        return [m for data in self.sent for m in dec.feed(data)]

    def pushes(self, kind: str) -> list:
        return [m[2] for m in self.messages() if m[0] == 0 and m[1] == kind]


class FakeHost:
    """Implements ``ReplicationHost``: a real table, role and node state; fake WAL, loop, clock."""

    def __init__(self, data_dir: str, role: Role = Role.PRIMARY, *, clock: Clock | None = None,
                 primary_address: str | None = None):
        self.clock = clock or Clock()
        self.table = LockTable()
        self.wal = FakeWal()
        self.node_state = NodeState(data_dir)
        self.data_dir = data_dir
        self.loop = FakeLoop(self.clock)
        self.max_ttl_ms = 0
        self.keys = SimpleNamespace(space=KeySpace())  # the key store as replication sees it
        self.revoke_deadlines = RevokeDeadlines(lambda: self.loop, lambda deadline: None)
        self.roles = NodeRole(role, hold_grants_until=self.table.hold_grants_until, now_ms=self.clock,
                              primary_address=primary_address)
        self.batches = 0
        self.events: list = []  # every table event drained at a batch end
        self.closed_clients: list[str] = []

    def snapshot_state(self) -> tuple[int, int, list[HolderRecord], list]:
        t = self.table
        return (t.epoch, t.counter, [HolderRecord(h.name, h.token, h.owner, h.ttl_ms, h.lock_delay_ms,
                                                  None, None, 0) for h in t.holders()], self.keys.space.to_list())

    def after_batch(self) -> None:
        self.batches += 1
        self.events.extend(self.table.drain_events())

    def close_client_connections(self, why: str, *, waiting_only: bool = False) -> None:
        self.closed_clients.append((why, waiting_only))
