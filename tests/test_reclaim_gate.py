"""The reclaim window's order rules (fastlock.server.reclaim), the queue mirror's input checks
(fastlock.replication.queues) and the watch history's bounds (fastlock.server.watchlog), in-process.

The end-to-end behaviours (real processes, kill -9) are in test_watch_resume.py.
"""

from __future__ import annotations

import gc

import msgpack
import pytest

from fastlock.errors import Compacted, LimitExceeded, LockNotAcquired, ProtocolError, WatchDiverged
from fastlock.replication.queues import MAX_SHIPPED, QueueMirror
from fastlock.server.reclaim import ReclaimGate
from fastlock.server.watchlog import WatchLog, revision


class Conn:
    def __init__(self, name: str):
        self.name = name
        self.closed = False
        self.sent: list = []

    def send(self, data: bytes) -> None:
        self.sent.append(msgpack.unpackb(data))


class Loop:
    def __init__(self):
        self.timers: list = []

    def call_later(self, delay, fn, *args):
        self.timers.append((delay, fn, args))
        return self

    def cancel(self):
        pass

    def time(self):
        return 0.0


def make_gate(queues, limit=100, held=(), priorities=None):
    entered: list[tuple[str, str]] = []

    def enter(conn, req_id, msg, name, owner, priority):
        entered.append((name, conn.name))
        if priorities is not None:
            priorities.append(priority)

    gate = ReclaimGate(enter, lambda: None, window=5.0, limit=limit)
    loop = Loop()
    gate.arm(queues, lambda name, owner: (name, owner) in held, loop)
    return gate, entered, loop


def park(gate, conn, name="q", owner=None, wait_ms=10_000):
    gate.park(conn, 1, ["acq", name], name, owner if owner is not None else conn.name.encode(), wait_ms)


def test_returning_waiters_enter_in_their_old_order_whatever_the_order_they_come_back():
    gate, entered, loop = make_gate({"q": [b"a", b"b", b"c"]})
    assert loop.timers and loop.timers[0][0] == 5.0
    a, b, c, new = Conn("a"), Conn("b"), Conn("c"), Conn("new")
    park(gate, c)
    park(gate, new)
    park(gate, b)
    assert entered == []  # "a" is not back: nobody overtakes it
    park(gate, a)
    assert entered == [("q", "a"), ("q", "b"), ("q", "c"), ("q", "new")]
    assert not gate.holds("q") and gate.parked == 0


def test_a_parked_prioritized_acquire_enters_with_its_priority():
    priorities: list[int] = []
    gate, entered, _ = make_gate({"q": [b"a"]}, priorities=priorities)
    a, urgent = Conn("a"), Conn("urgent")
    gate.park(urgent, 1, ["acq", "q"], "q", b"urgent", 10_000, 7)
    park(gate, a)
    assert entered == [("q", "a"), ("q", "urgent")] and priorities == [0, 7]


def test_an_absent_waiter_is_skipped_when_the_window_ends():
    gate, entered, _ = make_gate({"q": [b"a", b"b", b"c"]})
    new, c, b = Conn("new"), Conn("c"), Conn("b")
    park(gate, new)
    park(gate, c)
    park(gate, b)
    assert entered == []
    gate.close()
    assert entered == [("q", "b"), ("q", "c"), ("q", "new")]


def test_try_lock_is_refused_while_waiters_reclaim_and_a_cancel_withdraws():
    gate, entered, _ = make_gate({"q": [b"a", b"b"]})
    with pytest.raises(LockNotAcquired):
        park(gate, Conn("x"), wait_ms=0)
    b = Conn("b")
    park(gate, b)
    assert gate.cancel("q", b"a")  # the expected head withdraws: "b" goes in
    assert entered == [("q", "b")]
    assert not gate.cancel("q", b"zzz")


def test_a_cancel_of_a_parked_acquire_fails_it_and_a_closed_connection_is_dropped():
    gate, entered, _ = make_gate({"q": [b"a", b"b", b"c"]})
    b, c = Conn("b"), Conn("c")
    park(gate, b)
    park(gate, c)
    assert gate.cancel("q", b"b")
    assert b.sent and b.sent[0][1] != 0  # an error reply: Cancelled
    c.closed = True
    park(gate, Conn("a"))
    assert entered == [("q", "a")]  # "b" withdrawn, "c" gone with its connection


def test_a_retry_replaces_its_earlier_parked_acquire_and_parking_is_bounded():
    gate, entered, _ = make_gate({"q": [b"a", b"b"]}, limit=2)
    first, again = Conn("b"), Conn("b")
    park(gate, first)
    park(gate, again)
    assert first.sent and gate.parked == 1
    park(gate, Conn("n1"))
    with pytest.raises(LimitExceeded):
        park(gate, Conn("n2"))
    park(gate, Conn("a"))
    assert entered == [("q", "a"), ("q", "b"), ("q", "n1")]


def test_waiters_that_already_hold_the_lock_are_not_expected():
    gate, entered, _ = make_gate({"q": [b"a", b"b"]}, held={("q", b"a")})
    park(gate, Conn("b"))
    assert entered == [("q", "b")]


@pytest.mark.parametrize("payload", [None, [], [True], ["x", []], [True, [["q"]]], [True, [[1, []]]],
                                     [True, [["q", ["not bytes"]]]], [False, [["q", [b"o"] * (MAX_SHIPPED + 1)]]]])
def test_the_queue_mirror_refuses_malformed_pushes_and_changes_nothing(payload):
    mirror = QueueMirror()
    mirror.apply([True, [["kept", [b"o"]]]])
    with pytest.raises(ProtocolError):
        mirror.apply(payload)
    assert mirror.queues == {"kept": [b"o"]}


def test_the_queue_mirror_applies_changes_and_hands_them_over_once():
    mirror = QueueMirror()
    got = []
    mirror.on_promoted = got.append
    mirror.apply([True, [["a", [b"1", b"2"]], ["b", [b"3"]]]])
    mirror.apply([False, [["a", []], ["c", [b"4"]]]])
    assert mirror.queues == {"b": [b"3"], "c": [b"4"]}
    mirror.promoted()
    assert got == [{"b": [b"3"], "c": [b"4"]}] and mirror.queues == {}


def test_the_watch_history_is_bounded_and_says_what_it_lost():
    log = WatchLog(limit=3)
    log.start(revision(1, 10))
    for lsn in range(11, 16):
        log.record(revision(1, lsn), "n", "granted", lsn, None, published=True)
    assert len(log.changes) == 3 and len(log.by_name["n"]) == 3
    current = revision(1, 15)
    with pytest.raises(Compacted) as info:
        log.since("n", revision(1, 11), current)
    assert info.value.oldest == revision(1, 12)
    assert [c.token for c in log.since("n", revision(1, 12), current)] == [13, 14, 15]
    with pytest.raises(WatchDiverged):
        log.since("n", revision(1, 16), current)


def test_the_watch_history_keeps_its_changes_out_of_the_cyclic_collector():
    """A kept change of ints, strs and a meta of strs and None cannot be part of a reference
    cycle: the history takes it (and its meta) out of the collector's view as it records it,
    so that no collection scans the up to ``limit`` changes it keeps; one whose meta holds a
    container stays in view.  The changes read back the same."""
    log = WatchLog(limit=10)
    log.start(revision(1, 10))
    meta = ("app:worker", "corr-1")
    odd = ("app:worker", ["a container"])
    log.record(revision(1, 11), "n", "granted", 11, meta, published=True)
    log.record(revision(1, 12), "n", "released", 11, None, published=True)
    log.record(revision(1, 13), "n", "granted", 12, odd, published=True)
    assert [gc.is_tracked(c) for c in log.changes] == [False, False, True]
    assert not gc.is_tracked(meta) and gc.is_tracked(odd)
    gc.collect()
    changes = log.since("n", revision(1, 10), revision(1, 13))
    assert [(c.what, c.token) for c in changes] == [("granted", 11), ("released", 11), ("granted", 12)]


def test_a_promoted_node_refuses_revisions_past_its_promotion_point():
    log = WatchLog()
    log.applied(1, 100)  # followed epoch 1 up to LSN 100
    log.record(revision(2, 7), "n", "granted", 1, None, published=True)
    current = revision(2, 7)
    assert [c.token for c in log.since("n", revision(1, 100), current)] == [1]
    with pytest.raises(WatchDiverged, match="lost changes"):
        log.since("n", revision(1, 101), current)
    with pytest.raises(WatchDiverged, match="ahead of this node's history"):
        log.since("n", revision(2, 8), current)


def test_pending_changes_are_not_replayed_until_published():
    log = WatchLog()
    log.start(revision(1, 1))
    log.record(revision(1, 2), "n", "granted", 5, None)
    assert log.since("n", revision(1, 1), revision(1, 2)) == []
    assert log.progress(revision(1, 2)) == revision(1, 1)
    assert [c[3] for c in log.publish(revision(1, 2))] == [5]  # (revision, name, what, token, meta)
    assert [c.token for c in log.since("n", revision(1, 1), revision(1, 2))] == [5]


class Table:
    def __init__(self):
        self.queues: dict[str, list[bytes]] = {}

    def waiters(self, name):
        return list(self.queues.get(name, []))


class Replica:
    def __init__(self):
        self.conn = Conn("standby")
        self.conn.flush = lambda: None


class Host:
    def __init__(self):
        self.table = Table()
        self.source = type("Source", (), {"replicas": {}})()


def test_the_shipper_sends_changed_queues_and_the_whole_map_to_a_new_standby():
    from fastlock.replication.queues import QueueShipper

    host = Host()
    shipper = QueueShipper(host)
    host.table.queues["a"] = [b"1", b"2"]
    shipper.touched("a")
    shipper.batch_end()  # no standby: nothing sent, the change is remembered
    first = Replica()
    host.source.replicas[7] = first
    shipper.batch_end()
    assert [m[2] for m in first.conn.sent] == [[True, [["a", [b"1", b"2"]]]]]
    host.table.queues["a"] = [b"2"]
    shipper.granted("a")
    shipper.granted("unrelated")  # no waiters shipped for it: not even looked at
    shipper.batch_end()
    assert first.conn.sent[-1][2] == [False, [["a", [b"2"]]]]
    shipper.batch_end()  # nothing changed: nothing sent
    assert len(first.conn.sent) == 2
    second = Replica()
    host.source.replicas[8] = second
    del host.table.queues["a"]
    shipper.sessions_dropped()
    shipper.batch_end()
    assert first.conn.sent[-1][2] == [False, [["a", []]]]
    assert second.conn.sent[-1][2] == [True, []]
