"""The primary's self-fencing (ReplicationSource) driven through a fake host: no sockets,
no real timers, a clock the test moves.  See fastlock/replication/__init__.py "No split brain" for the rule:
the primary may grant, extend and release only while
``now < echoed_send_time + failover_window - margin``."""

from __future__ import annotations

import os

import pytest
from fakehost import FakeConnection, FakeHost

from fastlock._core import EV_GRANTED, GRANTED, NOT_ACQUIRED, QUEUED
from fastlock.errors import ProtocolError, Unavailable
from fastlock.replication import PAIRING_FILE, ReplicationSource
from fastlock.replication import source as source_module
from fastlock.roles import Action, Role

WINDOW = 1000  # the standby's failover window (ms); the margin defaults to a quarter
DEADLINE = WINDOW - WINDOW // 4


@pytest.fixture
def host(tmp_path, monkeypatch):
    h = FakeHost(str(tmp_path))
    monkeypatch.setattr(source_module, "monotonic_ms", h.clock)
    return h


def attach(source: ReplicationSource, session: int = 7, name: str = "east@id-1") -> FakeConnection:
    conn = FakeConnection(session)
    source.attach(conn, 2, 0, None, WINDOW, name)
    return conn


def echo_last_heartbeat(source: ReplicationSource, conn: FakeConnection) -> int:
    sent_ms = conn.pushes("hb")[-1][0]
    source.on_ack(conn, sent_ms, 0)
    return sent_ms


def paired(host: FakeHost) -> tuple[ReplicationSource, FakeConnection]:
    source = ReplicationSource(host)
    conn = attach(source)
    echo_last_heartbeat(source, conn)
    return source, conn


def test_a_standby_pairs_only_when_it_echoes_a_heartbeat(host):
    source = ReplicationSource(host)
    conn = attach(source)
    reply = conn.messages()[0]
    assert reply[:2] == [2, 0] and reply[2]["mode"] == "snapshot"
    assert [m[1] for m in conn.messages()[1:]] == ["snap", "hb"]
    assert source.paired_id is None and not os.path.exists(os.path.join(host.data_dir, PAIRING_FILE))
    echo_last_heartbeat(source, conn)
    assert source.paired_id == "east@id-1"
    assert os.path.exists(os.path.join(host.data_dir, PAIRING_FILE))
    assert not host.roles.fenced and host.roles.may(Action.RELEASE)


def test_the_primary_fences_itself_a_margin_before_the_standby_may_promote(host):
    source, _ = paired(host)
    start = host.clock()
    host.clock.advance(DEADLINE - 1)
    source.fence_if_due(host.clock())
    assert not host.roles.fenced
    host.clock.advance(1)
    source.fence_if_due(host.clock())
    assert host.roles.fenced and source.fenced
    for action in (Action.ACQUIRE, Action.EXTEND, Action.RELEASE, Action.READ):
        with pytest.raises(Unavailable):
            host.roles.admit(action)
    host.roles.admit(Action.CANCEL_WAITER)  # withdrawing a queued waiter stays possible
    # the table holds every grant: a free lock is not handed out
    assert host.table.acquire("free", b"o" * 16, 1, 1, 1000, 0, 0, None, host.clock()) == NOT_ACQUIRED
    assert host.clock() - start == DEADLINE


def test_the_fence_timer_fences_on_time_without_any_request(host):
    source, _ = paired(host)
    host.clock.advance(DEADLINE + 1)
    assert host.loop.run_due() >= 1
    assert host.roles.fenced


def test_a_fresh_echo_unfences_and_hands_the_lock_to_its_waiter(host):
    source, conn = paired(host)
    now = host.clock()
    t = host.table
    assert t.acquire("k", b"a" * 16, 1, 1, 300, 0, 0, None, now) == GRANTED
    assert t.acquire("k", b"b" * 16, 2, 1, 5000, -1, 0, None, now) == QUEUED
    t.drain_events()
    host.clock.advance(DEADLINE)
    source.fence_if_due(host.clock())
    t.expire(host.clock())  # the holder's lease runs out while fenced: nobody gets the lock
    assert not any(ev.kind == EV_GRANTED for ev in t.drain_events())
    source._heartbeat()  # the link is back: a new heartbeat, echoed
    echo_last_heartbeat(source, conn)
    assert not host.roles.fenced
    granted = [ev for ev in host.events if ev.kind == EV_GRANTED]
    assert [(ev.name, ev.owner) for ev in granted] == [("k", b"b" * 16)]


def test_only_an_echo_of_a_heartbeat_sent_since_the_last_contact_unfences(host):
    source, conn = paired(host)
    old = conn.pushes("hb")[-1][0]
    host.clock.advance(DEADLINE)
    source.fence_if_due(host.clock())
    for echoed in (old, old - 5, host.clock() + 10):  # replayed, older, from the future
        source.on_ack(conn, echoed, 0)
        assert host.roles.fenced, echoed
    with pytest.raises(ProtocolError):
        source.on_ack(conn, "soon", 0)
    assert host.roles.fenced


def test_a_late_replicate_does_not_restore_contact(host):
    source, conn = paired(host)
    host.clock.advance(DEADLINE)
    source.fence_if_due(host.clock())
    again = attach(source, session=8)  # the same standby, reconnecting (maybe promoted since)
    assert host.roles.fenced
    echo_last_heartbeat(source, again)  # only a fresh echo counts
    assert not host.roles.fenced


def test_restarted_while_paired_it_starts_fenced(host, tmp_path, monkeypatch):
    paired(host)
    restarted = FakeHost(str(tmp_path), clock=host.clock)
    source = ReplicationSource(restarted)
    source.load_pairing()
    assert restarted.roles.fenced and source.paired_id == "east@id-1"


def test_serve_alone_unpairs_and_unfences(host):
    source, _ = paired(host)
    host.clock.advance(DEADLINE)
    source.fence_if_due(host.clock())
    info = source.serve_alone()
    assert info == {"serving_alone": True, "unpaired": "east@id-1"}
    assert not host.roles.fenced and not os.path.exists(os.path.join(host.data_dir, PAIRING_FILE))
    host.clock.advance(10 * WINDOW)
    source.fence_if_due(host.clock())
    assert not host.roles.fenced


def test_the_fencing_flag_follows_the_pairing_serve_alone_and_the_arbiter(host, tmp_path):
    """``fencing`` is an attribute the request path reads: every change of what it depends on sets it."""
    source = ReplicationSource(host)
    conn = attach(source)
    assert source.fencing is False  # attached, not yet paired (no echo)
    echo_last_heartbeat(source, conn)
    assert source.fencing is True  # paired with a failover window
    restarted = ReplicationSource(FakeHost(str(tmp_path), clock=host.clock))
    assert restarted.fencing is False
    restarted.load_pairing()
    assert restarted.fencing is True  # the pairing restored from disk
    restarted.stand_down()
    assert restarted.fencing is False
    source.serve_alone()
    assert source.fencing is False
    alone = ReplicationSource(FakeHost(str(tmp_path / "arbiter"), clock=host.clock))
    alone.coordinate(lambda now: None)
    assert alone.fencing is True  # an arbiter fences this primary


def test_a_deposed_node_is_never_fenced(host):
    source, _ = paired(host)
    host.roles.transition(Role.DEPOSED, "test")
    host.clock.advance(DEADLINE + 1)
    source.fence_if_due(host.clock())
    host.loop.run_due()
    assert not host.roles.fenced and host.roles.role is Role.DEPOSED


# -- the interface is the only way in -------------------------------------------------------------

def _host_members() -> set[str]:
    from fastlock.replication.host import ReplicationHost

    return {name for name in vars(ReplicationHost) if not name.startswith("_")} | set(
        ReplicationHost.__annotations__)


@pytest.mark.parametrize("module",
                         ["replication.source", "replication.follower", "replication.link", "server.failover"])
def test_replication_and_failover_see_the_server_only_through_the_host_interface(module):
    """Every ``host.X`` / ``self.host.X`` they use is a member of ReplicationHost, and
    neither imports the server module."""
    import ast
    import importlib
    import inspect

    source = inspect.getsource(importlib.import_module(f"fastlock.{module}"))
    tree = ast.parse(source)
    members = _host_members()
    used = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            base = node.value
            if (isinstance(base, ast.Name) and base.id == "host") or (
                    isinstance(base, ast.Attribute) and base.attr == "host"
                    and isinstance(base.value, ast.Name) and base.value.id == "self"):
                used.add(node.attr)
        if isinstance(node, ast.ImportFrom):
            assert node.module not in ("server", "fastlock.server", "lockserver"), f"{module} imports the server"
    assert used, "the scan found no use of the host at all"
    assert used <= members, f"{module} reaches past ReplicationHost: {sorted(used - members)}"


def test_the_server_and_the_fake_both_implement_the_host_interface(tmp_path):
    from fastlock.server import LockServer, ServerConfig

    server = LockServer(ServerConfig(data_dir=str(tmp_path / "server")))
    fake = FakeHost(str(tmp_path / "fake"))
    for member in _host_members():
        # a property (loop) is looked up on the class: a server that is not started has no loop yet
        assert hasattr(LockServer, member) or hasattr(server, member), f"LockServer lacks {member}"
        assert hasattr(fake, member), f"FakeHost lacks {member}"


def test_fenced_a_whole_window_it_sends_waiting_clients_away(host):
    source, _ = paired(host)
    host.clock.advance(DEADLINE)
    source.fence_if_due(host.clock())
    host.clock.advance(WINDOW - DEADLINE - 1)
    host.loop.run_due()
    assert host.closed_clients == []  # the standby cannot have promoted yet
    host.clock.advance(2)
    host.loop.run_due()
    assert [waiting_only for _, waiting_only in host.closed_clients] == [True]


def test_a_fence_lifted_in_time_sends_nobody_away(host):
    source, conn = paired(host)
    host.clock.advance(DEADLINE)
    source.fence_if_due(host.clock())
    source._heartbeat()
    echo_last_heartbeat(source, conn)
    host.clock.advance(WINDOW - DEADLINE + 10)  # past the first contact's window, not the new fence
    host.loop.run_due()
    assert not host.roles.fenced and host.closed_clients == []


# -- the standby's side: epochs from the primary are bounded -------------------------------------

@pytest.mark.parametrize("kind, payload", [
    ("hb", [1, 0, 2**63 - 1, 0, None, 0]),
    ("hb", [1, 0, -1, 0, None, 0]),
    ("snap", [5, 2**23, 0, [], "inc"]),
])
def test_a_standby_refuses_an_epoch_beyond_the_encodable_range(tmp_path, kind, payload):
    from fastlock.errors import InvalidArgument
    from fastlock.replication import StandbyFollower

    host = FakeHost(str(tmp_path), Role.STANDBY, primary_address="127.0.0.1:9")
    follower = StandbyFollower(host, ("127.0.0.1", 9), name="east@id-1")
    with pytest.raises(InvalidArgument, match="out of range"):
        follower.on_push(kind, payload)
    assert host.node_state.max_epoch_seen == 0 and host.table.epoch == 0
    assert follower.primary_epoch == 0 and not follower.synced


GOOD_HOLDER = ["a", (1 << 40) | 1, b"o" * 16, 5000, 0, "c", None, 0]


@pytest.mark.parametrize("holder, error", [
    (GOOD_HOLDER + [5001], "remaining_ms"),    # more left than the TTL
    (GOOD_HOLDER + [-1], "remaining_ms"),
    (GOOD_HOLDER + [1.5], "remaining_ms"),
    (GOOD_HOLDER + [0, 0], "8, 9 or 11 items"),
    (GOOD_HOLDER[:7], "8, 9 or 11 items"),
    ("a", "8, 9 or 11 items"),
    (GOOD_HOLDER + [0, 1, 0], "shared/limit"),   # shared must be a bool
    (GOOD_HOLDER + [0, True, 3], "shared/limit"),  # a permit cannot also be shared
    (GOOD_HOLDER + [0, False, -1], "shared/limit"),
])
def test_a_standby_refuses_a_malformed_snapshot_holder(tmp_path, holder, error):
    """A snapshot holder with a bad ``remaining_ms`` or shape changes nothing."""
    from fastlock.errors import ProtocolError
    from fastlock.replication import StandbyFollower

    host = FakeHost(str(tmp_path), Role.STANDBY, primary_address="127.0.0.1:9")
    follower = StandbyFollower(host, ("127.0.0.1", 9), name="east@id-1")
    with pytest.raises(ProtocolError, match=error):
        follower.on_push("snap", [5, 1, 1, [holder], "inc"])
    assert len(host.table) == 0 and follower.lease_deadlines == {} and not follower.synced


def test_a_standby_keeps_the_remaining_time_of_a_snapshot_holder(tmp_path):
    """The kept deadline is the snapshot's arrival plus the holder's ``remaining_ms``;
    an 8-item holder (an older primary) has its full TTL left."""
    from fastlock.replication import StandbyFollower
    from fastlock.units import monotonic_ms

    host = FakeHost(str(tmp_path), Role.STANDBY, primary_address="127.0.0.1:9")
    follower = StandbyFollower(host, ("127.0.0.1", 9), name="east@id-1")
    token_b = (1 << 40) | 2
    arrived = monotonic_ms()
    follower.on_push("snap", [5, 1, 2, [GOOD_HOLDER + [1200], ["b", token_b, b"p" * 16, 7000, 0, None, None, 0]],
                               "inc"])
    done = monotonic_ms()
    a = follower.lease_deadline("a", GOOD_HOLDER[1])
    b = follower.lease_deadline("b", token_b)
    assert arrived + 1200 <= a <= done + 1200
    assert arrived + 7000 <= b <= done + 7000
    assert follower.lease_deadline("a", token_b) is None  # another token: not this lease


def test_a_standby_applies_single_records_by_the_log_rules_and_refuses_a_malformed_one(tmp_path):
    """A ``rec`` push (one record, as older primaries send) goes through the same apply as
    recovery: a grant installs and is logged, a release for another token does nothing,
    and a record of the wrong shape is a protocol error that changes nothing."""
    from fastlock.replication import StandbyFollower
    from fastlock.wal import GRANT, RELEASE

    host = FakeHost(str(tmp_path), Role.STANDBY, primary_address="127.0.0.1:9")
    follower = StandbyFollower(host, ("127.0.0.1", 9), name="east@id-1")
    token = (1 << 40) | 5
    follower.on_push("rec", [1, [GRANT, "a", token, b"o" * 16, 5000, 0, "app:c", "r1", 0]])
    assert host.table.holder("a", 0).token == token and host.table.holder("a", 0).meta == ("app:c", "r1")
    follower.on_push("rec", [2, [RELEASE, "a", token + 1, 0]])  # not the holder's token
    assert host.table.holder("a", 0) is not None and follower.applied_lsn == 2
    with pytest.raises(ProtocolError, match="LSN 3"):
        follower.on_push("rec", [3, [RELEASE, "a", token]])  # a field missing
    assert host.table.holder("a", 0) is not None and follower.applied_lsn == 2
    assert [r[0] for r in host.wal.records] == ["grant"]
    assert follower.lease_deadline("a", token) is not None and follower.max_ttl_ms == 5000


def test_a_standby_authenticated_by_its_certificate_reconnects_without_a_token():
    """Over mutual TLS a standby has no token: the primary names its principal in the
    HELLO answer.  On the next connection there is still no token to prove, so the link
    says HELLO once with no credential (TLS has verified both ends) instead of failing
    on the missing token; a server naming this standby's own node is still refused."""
    import asyncio
    from types import SimpleNamespace

    from fastlock import protocol as P
    from fastlock.replication.link import PrimaryLink

    class OneHello:
        transport = None  # no socket: the handshake binds no endpoint

        def __init__(self, node: str):
            self.sent: list = []
            self.node = node

        def request(self, *args):
            self.sent.append(args)
            fut = asyncio.get_running_loop().create_future()
            fut.set_result({"server": "fastlock", "role": "primary", "node": self.node, "principal": "east"})
            return fut

    follower = SimpleNamespace(host=SimpleNamespace(table=SimpleNamespace(epoch=3)), refused=None)
    link = PrimaryLink(follower, ("127.0.0.1", 1), None, None, "east@id-1", P.REPLY_LIMITS)
    link.principal = "east"  # as the first connection's HELLO answer set it
    conn = OneHello("id-2")
    hello = asyncio.run(link._hello(conn))
    assert hello is not None and hello["node"] == "id-2"
    assert [args[:4] for args in conn.sent] == [(P.OP_HELLO, P.PROTOCOL_VERSION, "standby:east@id-1", None)]
    assert link.proven == (("127.0.0.1", 1), "id-2")
    assert asyncio.run(link._hello(OneHello("id-1"))) is None  # this node itself
    assert "this node itself" in follower.refused
    assert asyncio.run(link._hello(OneHello("id-3"))) is None  # not the node that proved itself here
    assert "not the expected node" in follower.refused
