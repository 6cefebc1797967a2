"""The role state machine (fastlock.roles): every legal move allowed, every illegal one
refused loudly and changing nothing, and what each role and fence admits."""

from __future__ import annotations

import itertools
import logging

import pytest

from fastlock import _core
from fastlock import protocol as P
from fastlock.errors import InvalidArgument, NotPrimary, Unavailable, WrongArgumentType
from fastlock.roles import ADMITTED, HOLD_FOREVER_MS, TRANSITIONS, Action, IllegalTransition, NodeRole, Role
from fastlock.server.failover import check_step_down_epoch

NOW = 1_000_000


class Table:
    """Records the grant hold the role pushes."""

    def __init__(self):
        self.holds: list[int] = []

    def hold_grants_until(self, until_ms: int) -> None:
        self.holds.append(until_ms)


def node_in(role: Role, *, fenced: bool = False) -> tuple[NodeRole, Table]:
    """A NodeRole brought to ``role`` by legal moves only."""
    table = Table()
    path = {
        Role.PRIMARY: (Role.PRIMARY, []),
        Role.STANDBY: (Role.STANDBY, []),
        Role.PROMOTING: (Role.STANDBY, [Role.PROMOTING]),
        Role.DEPOSED: (Role.PRIMARY, [Role.DEPOSED]),
    }[role]
    node = NodeRole(path[0], hold_grants_until=table.hold_grants_until, now_ms=lambda: NOW,
                    primary_address="10.0.0.1:7420" if path[0] is Role.STANDBY else None)
    for step in path[1]:
        node.transition(step, "test")
    if fenced:
        node.set_fenced(True)
    return node, table


@pytest.mark.parametrize("frm, to", sorted(TRANSITIONS, key=lambda m: (m[0].value, m[1].value)))
def test_every_legal_move_is_allowed_logged_and_sets_the_hold(frm, to, caplog):
    node, table = node_in(frm)
    with caplog.at_level(logging.WARNING, logger="fastlock.roles"):
        node.transition(to, "because")
    assert node.role is to
    assert f"{frm.value} -> {to.value} (because)" in caplog.text
    assert table.holds[-1] == node.grants_held_until()


def test_on_admitted_hears_the_admitted_actions_at_the_start_and_on_every_change():
    """``on_admitted`` (the server keeps what it hears as the slot its compiled request path
    tests, ``BatchEnd.admitted``) gets ``admitted`` at the start and after each change of the
    role, the fence and the sync hold - never a set older than the roles'."""
    table = Table()
    heard = []
    node = NodeRole(Role.PRIMARY, hold_grants_until=table.hold_grants_until, now_ms=lambda: NOW,
                    on_admitted=heard.append)
    assert heard == [ADMITTED[(Role.PRIMARY, False)]]
    node.set_fenced(True)
    assert heard[-1] == node.admitted == ADMITTED[(Role.PRIMARY, True)]
    node.set_fenced(False)
    node.set_sync_held(True)
    assert heard[-1] == node.admitted
    assert Action.ACQUIRE not in heard[-1] and Action.RELEASE in heard[-1]
    node.set_sync_held(False)
    node.transition(Role.DEPOSED, "test")
    assert heard[-1] == node.admitted == frozenset()
    assert len(heard) == 6  # the start and five changes


ILLEGAL = [(f, t) for f, t in itertools.product(Role, Role) if (f, t) not in TRANSITIONS]


@pytest.mark.parametrize("frm, to", ILLEGAL)
def test_every_illegal_move_is_refused_and_changes_nothing(frm, to):
    node, table = node_in(frm)
    holds = list(table.holds)
    with pytest.raises(IllegalTransition, match=f"{frm.value} -> {to.value}"):
        node.transition(to, "bug")
    assert node.role is frm and table.holds == holds


def test_the_table_has_the_moves_the_failover_policy_needs():
    assert set(TRANSITIONS) == {(Role.STANDBY, Role.PROMOTING), (Role.PROMOTING, Role.PRIMARY),
                                (Role.PROMOTING, Role.STANDBY), (Role.PRIMARY, Role.DEPOSED),
                                (Role.DEPOSED, Role.STANDBY)}
    assert len(ILLEGAL) == 16 - 5  # including every "same role again"


def test_a_node_starts_only_as_primary_or_standby():
    for role in (Role.PROMOTING, Role.DEPOSED):
        with pytest.raises(IllegalTransition):
            NodeRole(role, hold_grants_until=lambda _: None, now_ms=lambda: NOW)


@pytest.mark.parametrize("role", [Role.STANDBY, Role.PROMOTING, Role.DEPOSED])
def test_only_a_primary_can_be_fenced(role):
    node, _ = node_in(role)
    with pytest.raises(IllegalTransition):
        node.set_fenced(True)
    assert not node.fenced
    node.set_fenced(False)  # unfencing a node that is not fenced is a no-op


def test_leaving_primary_clears_the_fence():
    node, _ = node_in(Role.PRIMARY, fenced=True)
    node.transition(Role.DEPOSED, "test")
    assert not node.fenced and node.role is Role.DEPOSED


def test_a_sync_held_primary_refuses_acquires_holds_grants_and_keeps_extends_and_releases():
    node, table = node_in(Role.PRIMARY)
    node.set_sync_held(True)
    assert node.sync_held and table.holds[-1] >= NOW + HOLD_FOREVER_MS and not node.may_grant(NOW)
    with pytest.raises(Unavailable, match="synchronous standby"):
        node.admit(Action.ACQUIRE)
    for action in (Action.EXTEND, Action.RELEASE, Action.READ, Action.SERVE_STANDBY, Action.CANCEL_WAITER):
        node.admit(action)
    node.set_sync_held(False)
    node.admit(Action.ACQUIRE)
    assert table.holds[-1] == node.grants_held_until() == 0 and node.may_grant(NOW)
    node.set_sync_held(True)
    node.transition(Role.DEPOSED, "test")
    assert not node.sync_held


def test_only_a_primary_is_sync_held():
    node, table = node_in(Role.STANDBY)
    node.set_sync_held(True)  # a no-op: a standby grants nothing anyway
    assert not node.sync_held


# -- what each role and fence admits ------------------------------------------------------------

COMBINATIONS = [(r, False) for r in Role] + [(Role.PRIMARY, True)]


def test_the_admission_table_covers_every_reachable_combination():
    assert set(ADMITTED) == set(COMBINATIONS)


@pytest.mark.parametrize("role, fenced", COMBINATIONS)
@pytest.mark.parametrize("action", list(Action))
def test_admit_answers_with_the_error_the_client_needs(role, fenced, action):
    node, _ = node_in(role, fenced=fenced)
    expected = {
        (Role.PRIMARY, False): "ok",
        (Role.PRIMARY, True): "ok" if action in (Action.CANCEL_WAITER, Action.SERVE_STANDBY) else "unavailable",
        (Role.STANDBY, False): "redirect",
        (Role.PROMOTING, False): "unknown primary",
        (Role.DEPOSED, False): "unknown primary",
    }[(role, fenced)]
    assert node.may(action) is (expected == "ok")
    if expected == "ok":
        node.admit(action)
    elif expected == "unavailable":
        with pytest.raises(Unavailable, match="fenced"):
            node.admit(action)
    else:
        with pytest.raises(NotPrimary) as info:
            node.admit(action)
        assert info.value.primary == ("10.0.0.1:7420" if expected == "redirect" else None)
        assert role.value in str(info.value)


@pytest.mark.parametrize("role, fenced", COMBINATIONS)
@pytest.mark.parametrize("grace_left_ms", [0, 500])
def test_may_grant_and_the_table_hold_for_each_combination(role, fenced, grace_left_ms):
    table = Table()
    start = Role.STANDBY if role in (Role.STANDBY, Role.PROMOTING) else Role.PROMOTING
    if start is Role.PROMOTING:  # reach PRIMARY the way a promotion does, with a grace period
        node = NodeRole(Role.STANDBY, hold_grants_until=table.hold_grants_until, now_ms=lambda: NOW)
        node.transition(Role.PROMOTING, "test")
        node.transition(Role.PRIMARY, "test", grace_until_ms=NOW + grace_left_ms)
        if role is Role.DEPOSED:
            node.transition(Role.DEPOSED, "test")
    else:
        node, table = node_in(role)
    if fenced:
        node.set_fenced(True)
    serving = node.role is Role.PRIMARY and not fenced
    assert node.may_grant(NOW) is (serving and grace_left_ms == 0)
    assert node.may_grant(NOW + grace_left_ms) is serving
    assert node.expires_leases is (node.role is Role.PRIMARY)
    if serving:
        assert table.holds[-1] == NOW + grace_left_ms
        assert node.grace_remaining_ms(NOW) == grace_left_ms
    else:
        assert table.holds[-1] == NOW + HOLD_FOREVER_MS


def test_unfencing_falls_back_to_the_grace_period():
    table = Table()
    node = NodeRole(Role.STANDBY, hold_grants_until=table.hold_grants_until, now_ms=lambda: NOW)
    node.transition(Role.PROMOTING, "test")
    node.transition(Role.PRIMARY, "test", grace_until_ms=NOW + 700)
    node.set_fenced(True)
    assert table.holds[-1] == NOW + HOLD_FOREVER_MS
    node.set_fenced(False)
    assert table.holds[-1] == NOW + 700


# -- epochs a peer announces ---------------------------------------------------------------------

def test_max_epoch_agrees_with_the_core():
    assert P.MAX_EPOCH == _core.MAX_EPOCH
    assert (P.MAX_EPOCH << 40 | _core.MAX_COUNTER) < 2**63


@pytest.mark.parametrize("own, epoch, error", [
    (0, 1, None),
    (6, 7, None),
    (0, 0, InvalidArgument),          # not newer
    (3, 2, InvalidArgument),          # older
    (0, 5, InvalidArgument),          # own + 5: a guess, not the next epoch
    (0, 2**63 - 1, InvalidArgument),  # beyond the encodable range
    (P.MAX_EPOCH, P.MAX_EPOCH + 1, InvalidArgument),
    (0, -1, InvalidArgument),
    (0, "1", WrongArgumentType),
    (0, True, WrongArgumentType),
    (0, 1.0, WrongArgumentType),
])
def test_a_step_down_epoch_must_be_exactly_the_next_one(own, epoch, error):
    if error is None:
        assert check_step_down_epoch(epoch, own) == epoch
    else:
        with pytest.raises(error):
            check_step_down_epoch(epoch, own)


# -- the op table, declared once --------------------------------------------------------------------

def test_every_op_has_a_declared_arity_and_a_server_handler(tmp_path):
    from fastlock.server import LockServer, ServerConfig

    assert set(P.OP_ARITY) == set(P.OP_NAMES)
    assert all(0 <= fewest <= most for fewest, most in P.OP_ARITY.values())
    server = LockServer(ServerConfig(data_dir=str(tmp_path)))
    assert {op: (fewest, most) for op, (_, fewest, most) in server.handlers.by_op.items()} == P.OP_ARITY
    assert P.REPLICATION_PUSH_KINDS == {P.PUSH_SNAPSHOT, P.PUSH_RECORDS, P.PUSH_RECORD, P.PUSH_HEARTBEAT, P.PUSH_SYNC}
