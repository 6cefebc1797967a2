"""The failover policy (fastlock.server.failover) against a fake host: promotion ends PRIMARY or
back in STANDBY - never stuck in PROMOTING - and stepping down needs exactly the next epoch."""

from __future__ import annotations

import os

import pytest
from fakehost import FakeHost

from fastlock import protocol as P
from fastlock.errors import InvalidArgument, NotPrimary, Unavailable
from fastlock.replication import DEPOSED_FILE, ReplicationSource, StandbyFollower
from fastlock.roles import Role
from fastlock.server.failover import FailoverPolicy
from fastlock.units import monotonic_ms


@pytest.fixture
def standby(tmp_path):
    """``standby(failover_after_ms=, grace_ms=)`` -> (host, follower, policy, restarts), on the host's clock."""
    def make(*, failover_after_ms: int = 0, grace_ms: int = 500):
        host = FakeHost(str(tmp_path), Role.STANDBY, primary_address="127.0.0.1:9")
        return _standby(host, failover_after_ms, grace_ms)

    return make


def _standby(host: FakeHost, failover_after_ms: int, grace_ms: int):
    follower = StandbyFollower(host, ("127.0.0.1", 9), failover_after_ms, name="east@id-1")
    follower.synced = True
    restarts: list[bool] = []
    follower.start = lambda: restarts.append(True)  # no sockets: record that it would follow again
    policy = FailoverPolicy(host, ReplicationSource(host), follower, promotion_grace_ms=grace_ms, clock=host.clock)
    return host, follower, policy, restarts


async def test_an_automatic_promotion_raises_the_epoch_keeps_leases_and_holds_grants(standby):
    host, follower, policy, _ = standby(failover_after_ms=1000)
    host.table.install_holder("held", 7, b"o" * 16, 5000, 0, None, 0)
    info = await policy.promote("primary silent", automatic=True)
    assert info == {"epoch": 1, "grace_ms": 500, "leases": 1, "primary_confirmed": False}
    assert host.roles.role is Role.PRIMARY and host.table.epoch == 1
    assert ("epoch", 1) in host.wal.records and host.node_state.max_epoch_seen == 1
    assert not host.roles.may_grant(host.clock()) and host.roles.may_grant(host.clock() + 500)
    assert host.node_state.standby_of is None


async def test_a_promotion_marks_when_no_other_node_serves(standby):
    host, follower, policy, _ = standby(failover_after_ms=1000)
    follower.pair_confirmed = True
    follower.last_heard_ms = heard = host.clock() - 1500  # silent for longer than the window
    await policy.promote("primary silent", automatic=True)
    # the old primary stopped by its own fence, F after this node last heard it
    assert host.roles.alone_since == (1, heard + 1000)


async def test_a_forced_promotion_does_not_know_when_the_old_primary_stopped(standby):
    host, follower, policy, _ = standby(failover_after_ms=0)
    await policy.promote("operator", force=True)
    assert host.roles.role is Role.PRIMARY and host.roles.alone_since is None


async def test_a_refused_manual_promotion_returns_to_standby_and_keeps_following(standby):
    host, follower, policy, restarts = standby()  # no failover window, primary not reachable
    with pytest.raises(Unavailable, match="did not confirm"):
        await policy.promote("operator command")
    assert host.roles.role is Role.STANDBY and host.table.epoch == 0
    assert restarts == [True]  # never stopped for good: it follows its primary again


async def test_a_promotion_that_fails_after_the_epoch_reached_the_log_stays_standby_and_stops(standby):
    host, follower, policy, restarts = standby(failover_after_ms=1000)
    host.wal.fail_durability = OSError("disk gone")
    with pytest.raises(OSError):
        await policy.promote("primary silent", automatic=True)
    assert host.roles.role is Role.STANDBY
    assert restarts == []  # its epoch is above the old primary's now: it must not follow it


async def test_a_promotion_beyond_the_last_epoch_is_refused_before_anything_changes(standby):
    host, follower, policy, restarts = standby()
    host.node_state.raise_epoch(P.MAX_EPOCH)
    with pytest.raises(Unavailable, match="exceed"):
        await policy.promote("operator command", force=True)
    assert host.roles.role is Role.STANDBY and host.table.epoch == 0 and restarts == []


async def test_only_a_standby_promotes(standby):
    host, follower, policy, _ = standby(failover_after_ms=1000)
    await policy.promote("first", automatic=True)
    with pytest.raises(InvalidArgument):
        policy.check_promotable(force=False)
    with pytest.raises(NotPrimary):
        await policy.promote("second", automatic=True)
    assert host.roles.role is Role.PRIMARY and host.table.epoch == 1


def test_step_down_needs_the_next_epoch_and_a_fresh_echo_of_this_nodes_clock(tmp_path):
    host = FakeHost(str(tmp_path))
    policy = FailoverPolicy(host, ReplicationSource(host), None)
    now = monotonic_ms()
    for epoch, seen in ((0, now), (2, now), (2**63 - 1, now), (1, now - P.STEP_DOWN_FRESH_MS - 100),
                        (1, now + 10_000), (1, "now")):
        with pytest.raises(InvalidArgument):
            policy.on_step_down_request(epoch, seen, "test")
        assert host.roles.role is Role.PRIMARY and not os.path.exists(os.path.join(host.data_dir, DEPOSED_FILE))
    assert policy.on_step_down_request(1, now, "standby:b") == {"role": "deposed", "epoch": 0}
    assert host.roles.role is Role.DEPOSED and os.path.exists(os.path.join(host.data_dir, DEPOSED_FILE))
    assert host.closed_clients == [("this node stepped down", False)]
    assert host.node_state.max_epoch_seen == 1
    # asked again: confirmed, nothing more changes
    assert policy.on_step_down_request(1, 0, "standby:b") == {"role": "deposed", "epoch": 0}
    assert len(host.closed_clients) == 1
