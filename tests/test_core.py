"""Unit tests of the lock table: every semantic of fastlock/_core.pyi.

Each test runs against the compiled ``fastlock._core`` and against the reference
model in tests/refmodel.py, so both are pinned to the same behaviour.
"""

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

import refmodel

from fastlock import _core

NAME = "orders/42"
TTL = 1_000


class Impl:
    """A table plus helpers that keep the tests short."""

    def __init__(self, mod, table_cls):
        self.mod = mod
        self.t = table_cls()

    def acq(self, owner, now, *, name=NAME, session=1, request=None, ttl=TTL, wait=-1, delay=0, meta=None):
        return self.t.acquire(name, owner, session, request if request is not None else owner, ttl, wait,
                              delay, meta, now)

    def events(self):
        return [(e.kind, e.name, e.owner) for e in self.t.drain_events()]

    def grant(self, owner, now, **kw):
        """Acquire that must be granted at once; returns the fencing token."""
        assert self.acq(owner, now, **kw) == self.mod.GRANTED
        evs = self.t.drain_events()
        assert len(evs) == 1 and evs[0].kind == self.mod.EV_GRANTED and evs[0].fresh
        return evs[0].token

    def state(self):
        t = self.t
        return (
            sorted((h.name, h.token, h.owner, h.session, h.ttl_ms, h.deadline_ms, h.lock_delay_ms)
                   for h in t.holders()),
            {n: t.waiters(n) for n in ("a", "b", NAME)},
            t.next_deadline(),
            t.last_token,
            t.epoch,
            t.stats(),
        )


@pytest.fixture(params=["core", "model"])
def impl(request):
    if request.param == "core":
        return Impl(_core, _core.LockTable)
    return Impl(refmodel, refmodel.RefLockTable)


# -- grant and queue ----------------------------------------------------------------


def test_constants_match_the_stub():
    assert _core.TOKEN_EPOCH_SHIFT == 40
    assert _core.MAX_EPOCH == (1 << 23) - 1
    assert _core.MAX_LOCK_DELAY_MS == 60_000
    assert {_core.GRANTED, _core.QUEUED, _core.NOT_ACQUIRED} == {0, 1, 2}
    assert len({_core.EV_GRANTED, _core.EV_EXPIRED, _core.EV_WAIT_TIMEOUT, _core.EV_WAIT_CANCELLED}) == 4
    assert issubclass(_core.NotHolder, LookupError)
    for k in ("GRANTED", "QUEUED", "NOT_ACQUIRED", "EV_GRANTED", "EV_EXPIRED", "EV_WAIT_TIMEOUT",
              "EV_WAIT_CANCELLED", "TOKEN_EPOCH_SHIFT", "MAX_EPOCH", "MAX_LOCK_DELAY_MS", "MAX_COUNTER"):
        assert getattr(refmodel, k) == getattr(_core, k), k


def test_grant_free_lock_delivers_full_lease(impl):
    assert impl.acq(b"A", 100, session=7, request="req", ttl=500, delay=20, meta={"m": 1}) == impl.mod.GRANTED
    (ev,) = impl.t.drain_events()
    assert (ev.kind, ev.name, ev.owner, ev.session, ev.request) == (impl.mod.EV_GRANTED, NAME, b"A", 7, "req")
    assert (ev.token, ev.ttl_ms, ev.deadline_ms, ev.meta, ev.fresh, ev.lock_delay_ms) == (1, 500, 600, {"m": 1},
                                                                                          True, 20)
    h = impl.t.holder(NAME, 100)
    assert (h.name, h.token, h.owner, h.session, h.ttl_ms, h.deadline_ms, h.lock_delay_ms, h.meta) == (
        NAME, 1, b"A", 7, 500, 600, 20, {"m": 1})
    assert len(impl.t) == 1
    assert impl.t.check(NAME, 1, 599) and not impl.t.check(NAME, 1, 600) and not impl.t.check(NAME, 2, 100)
    assert impl.t.drain_events() == []


def test_fifo_of_twelve_waiters(impl):
    impl.grant(b"H", 0)
    owners = [b"w%02d" % i for i in range(12)]
    for i, o in enumerate(owners):
        assert impl.acq(o, i, session=100 + i) == impl.mod.QUEUED
    assert impl.t.waiters(NAME) == owners
    assert impl.t.drain_events() == []
    token = impl.t.holder(NAME, 20).token
    holder = b"H"
    granted = []
    for i in range(12):
        impl.t.release(NAME, token, holder, 20 + i)
        (ev,) = impl.t.drain_events()  # exactly one waiter notified per release
        assert ev.kind == impl.mod.EV_GRANTED and ev.fresh
        assert ev.token > token
        granted.append(ev.owner)
        token, holder = ev.token, ev.owner
        assert impl.t.waiters(NAME) == owners[i + 1:]
    assert granted == owners


def test_try_lock_on_held_lock_is_not_acquired_and_leaves_nothing(impl):
    impl.grant(b"A", 0)
    before = impl.state()
    assert impl.acq(b"B", 5, wait=0) == impl.mod.NOT_ACQUIRED
    assert impl.t.drain_events() == []
    assert impl.state() == before
    assert impl.t.waiters(NAME) == []


def test_try_lock_on_free_lock_grants(impl):
    assert impl.acq(b"A", 0, wait=0) == impl.mod.GRANTED


def test_wait_timeout(impl):
    impl.grant(b"A", 0, ttl=10_000)
    assert impl.acq(b"B", 100, wait=50, request="rb") == impl.mod.QUEUED
    assert impl.t.next_deadline() == 150
    impl.t.expire(149)
    assert impl.t.drain_events() == [] and impl.t.waiters(NAME) == [b"B"]
    impl.t.expire(150)  # timed out at now >= wait deadline
    (ev,) = impl.t.drain_events()
    assert (ev.kind, ev.owner, ev.request, ev.token) == (impl.mod.EV_WAIT_TIMEOUT, b"B", "rb", 0)
    assert impl.t.waiters(NAME) == [] and impl.t.stats()["wait_timeouts"] == 1
    assert impl.t.next_deadline() == 10_000


def test_release_hands_off_to_exactly_one_waiter(impl):
    tok = impl.grant(b"A", 0)
    impl.acq(b"B", 1, session=2, ttl=300)
    impl.acq(b"C", 2, session=3)
    impl.t.release(NAME, tok, b"A", 50)
    (ev,) = impl.t.drain_events()
    assert (ev.kind, ev.owner, ev.session, ev.ttl_ms, ev.deadline_ms, ev.token) == (
        impl.mod.EV_GRANTED, b"B", 2, 300, 350, tok + 1)
    assert impl.t.holder(NAME, 50).owner == b"B"
    assert impl.t.waiters(NAME) == [b"C"]
    assert impl.t.stats()["releases"] == 1


def test_release_frees_and_deletes_lock(impl):
    tok = impl.grant(b"A", 0)
    impl.t.release(NAME, tok, b"A", 1)
    assert impl.t.holder(NAME, 1) is None and len(impl.t) == 0
    assert impl.t.stats()["locks"] == 0 and impl.t.next_deadline() == -1
    assert impl.grant(b"B", 2) == tok + 1


def test_expiry_hands_off(impl):
    tok = impl.grant(b"A", 0, ttl=100, session=1, meta="ma")
    impl.acq(b"B", 10, session=2, ttl=100)
    impl.t.expire(99)
    assert impl.t.drain_events() == []
    assert impl.t.holder(NAME, 99).owner == b"A"
    impl.t.expire(100)  # expired at now >= deadline
    exp, gr = impl.t.drain_events()
    assert (exp.kind, exp.owner, exp.token, exp.session, exp.deadline_ms, exp.request, exp.meta) == (
        impl.mod.EV_EXPIRED, b"A", tok, 1, 100, None, "ma")
    assert (gr.kind, gr.owner, gr.token, gr.deadline_ms) == (impl.mod.EV_GRANTED, b"B", tok + 1, 200)
    assert impl.t.stats()["expiries"] == 1


def test_expiry_processed_late_grants_with_ttl_from_now(impl):
    impl.grant(b"A", 0, ttl=100)
    impl.acq(b"B", 10, ttl=100)
    impl.t.expire(150)  # the timer fired late: TTL counts from the grant, made at 150
    _, gr = impl.t.drain_events()
    assert gr.deadline_ms == 250


def test_holder_is_none_after_deadline_even_before_expire(impl):
    impl.grant(b"A", 0, ttl=100)
    assert impl.t.holder(NAME, 99) is not None
    assert impl.t.holder(NAME, 100) is None
    assert impl.t.drain_events() == []  # queries never process deadlines


def test_lock_delay_after_expiry(impl):
    impl.grant(b"A", 0, ttl=100, delay=500)
    impl.acq(b"B", 10)
    impl.t.expire(100)
    assert [e[0] for e in impl.events()] == [impl.mod.EV_EXPIRED]
    assert impl.t.holder(NAME, 100) is None and impl.t.waiters(NAME) == [b"B"]
    assert impl.t.next_deadline() == 600
    assert impl.acq(b"C", 300, wait=0) == impl.mod.NOT_ACQUIRED
    impl.t.expire(599)
    assert impl.t.drain_events() == []
    impl.t.expire(600)
    (gr,) = impl.t.drain_events()
    assert (gr.kind, gr.owner, gr.deadline_ms) == (impl.mod.EV_GRANTED, b"B", 600 + TTL)


def test_lock_delay_without_waiters_blocks_new_acquires(impl):
    impl.grant(b"A", 0, ttl=100, delay=500)
    impl.t.expire(200)
    impl.t.drain_events()
    assert impl.t.stats()["locks"] == 1  # kept while the lock-delay runs
    assert impl.acq(b"B", 300, wait=0) == impl.mod.NOT_ACQUIRED
    assert impl.acq(b"C", 599, wait=0) == impl.mod.NOT_ACQUIRED
    assert impl.acq(b"D", 600, wait=0) == impl.mod.GRANTED


def test_lock_delay_entry_goes_away(impl):
    impl.grant(b"A", 0, ttl=100, delay=500)
    impl.t.expire(700)
    assert impl.t.stats()["locks"] == 0 and impl.t.next_deadline() == -1


def test_lock_delay_not_applied_on_release(impl):
    tok = impl.grant(b"A", 0, ttl=100, delay=60_000)
    impl.acq(b"B", 1)
    impl.t.release(NAME, tok, b"A", 50)
    (gr,) = impl.t.drain_events()
    assert gr.owner == b"B" and gr.kind == impl.mod.EV_GRANTED


def test_lock_delay_range(impl):
    assert impl.acq(b"A", 0, delay=60_000) == impl.mod.GRANTED
    before = impl.state()
    with pytest.raises(ValueError):
        impl.acq(b"B", 0, name="a", delay=60_001)
    with pytest.raises(ValueError):
        impl.acq(b"B", 0, name="a", delay=-1)
    assert impl.state() == before


def test_waiter_timing_out_during_lock_delay_is_never_granted(impl):
    impl.grant(b"A", 0, ttl=100, delay=500)
    impl.acq(b"B", 10, wait=300)  # times out at 310, before the delay ends at 600
    impl.acq(b"C", 20)
    impl.t.expire(10_000)  # one late jump: same outcome as firing on time
    kinds = [(e.kind, e.owner) for e in impl.t.drain_events()]
    assert kinds == [(impl.mod.EV_EXPIRED, b"A"), (impl.mod.EV_WAIT_TIMEOUT, b"B"), (impl.mod.EV_GRANTED, b"C")]


def test_release_with_wrong_token_or_owner_changes_nothing(impl):
    tok = impl.grant(b"A", 0)
    impl.acq(b"B", 1)
    before = impl.state()
    for token, owner in ((tok + 1, b"A"), (tok, b"B"), (tok - 1, b"A"), (0, b"A")):
        with pytest.raises(impl.mod.NotHolder):
            impl.t.release(NAME, token, owner, 2)
        with pytest.raises(impl.mod.NotHolder):
            impl.t.extend(NAME, token, owner, 5_000, 2)
    with pytest.raises(impl.mod.NotHolder):
        impl.t.release("a", tok, b"A", 2)
    assert impl.state() == before and impl.t.drain_events() == []


def test_release_with_old_token_after_handoff_raises(impl):
    tok = impl.grant(b"A", 0)
    impl.acq(b"A2", 1)
    impl.t.release(NAME, tok, b"A", 2)
    impl.t.drain_events()
    before = impl.state()
    with pytest.raises(impl.mod.NotHolder):
        impl.t.release(NAME, tok, b"A", 3)  # a second release of the same lease
    assert impl.state() == before


def test_release_after_expiry_raises(impl):
    tok = impl.grant(b"A", 0, ttl=100)
    with pytest.raises(impl.mod.NotHolder):
        impl.t.release(NAME, tok, b"A", 100)
    assert impl.t.stats()["releases"] == 0 and impl.t.stats()["expiries"] == 1


def test_extend_moves_deadline(impl):
    tok = impl.grant(b"A", 0, ttl=100)
    assert impl.t.extend(NAME, tok, b"A", 1_000, 90) == 1_090
    h = impl.t.holder(NAME, 500)
    assert (h.ttl_ms, h.deadline_ms, h.token) == (1_000, 1_090, tok)
    assert impl.t.next_deadline() == 1_090
    assert impl.t.extend(NAME, tok, b"A", 10, 100) == 110  # may shorten
    impl.t.expire(110)
    assert impl.t.drain_events()[0].kind == impl.mod.EV_EXPIRED


def test_extend_never_revives_expired_lease(impl):
    tok = impl.grant(b"A", 0, ttl=100)
    with pytest.raises(impl.mod.NotHolder):
        impl.t.extend(NAME, tok, b"A", 1_000, 100)
    assert impl.t.holder(NAME, 100) is None
    with pytest.raises(impl.mod.NotHolder):
        impl.t.extend(NAME, tok, b"A", 1_000, 101)


def test_idempotent_acquire_by_holder_redelivers(impl):
    tok = impl.grant(b"A", 0, ttl=100, session=1, meta="m1")
    assert impl.acq(b"A", 40, session=9, request="retry", ttl=5, meta="m2") == impl.mod.GRANTED
    (ev,) = impl.t.drain_events()
    assert (ev.kind, ev.token, ev.fresh, ev.session, ev.request, ev.ttl_ms, ev.deadline_ms, ev.meta) == (
        impl.mod.EV_GRANTED, tok, False, 9, "retry", 100, 100, "m1")
    assert impl.t.last_token == tok and impl.t.stats()["grants"] == 1
    assert impl.t.holder(NAME, 40).deadline_ms == 100


def test_idempotent_acquire_by_waiter_keeps_place_and_cancels_old_request(impl):
    impl.grant(b"H", 0)
    impl.acq(b"B", 1, session=1, request="rb1", wait=100)
    impl.acq(b"C", 2, session=1)
    assert impl.acq(b"B", 50, session=2, request="rb2", wait=500) == impl.mod.QUEUED
    (ev,) = impl.t.drain_events()
    assert (ev.kind, ev.owner, ev.session, ev.request) == (impl.mod.EV_WAIT_CANCELLED, b"B", 1, "rb1")
    assert impl.t.waiters(NAME) == [b"B", b"C"]
    assert impl.t.session_waiters(1) == 1 and impl.t.session_waiters(2) == 1
    impl.t.expire(200)  # the old 100 ms wait no longer applies
    assert impl.t.drain_events() == []
    impl.t.release(NAME, 1, b"H", 300)
    (gr,) = impl.t.drain_events()
    assert (gr.owner, gr.session, gr.request) == (b"B", 2, "rb2")
    assert impl.t.stats()["cancels"] == 1


def test_idempotent_retry_with_wait_zero_leaves_the_queue(impl):
    impl.grant(b"H", 0)
    impl.acq(b"B", 1, request="rb1")
    assert impl.acq(b"B", 2, wait=0, request="rb2") == impl.mod.NOT_ACQUIRED
    assert impl.events() == [(impl.mod.EV_WAIT_CANCELLED, NAME, b"B")]
    assert impl.t.waiters(NAME) == []


def test_not_reentrant_same_session_other_owner_queues(impl):
    impl.grant(b"A", 0, session=5)
    assert impl.acq(b"A-second-task", 1, session=5) == impl.mod.QUEUED
    assert impl.t.waiters(NAME) == [b"A-second-task"]


def test_cancel(impl):
    impl.grant(b"H", 0)
    impl.acq(b"B", 1, request="rb", session=3)
    impl.acq(b"C", 2)
    assert impl.t.cancel(NAME, b"B", 3) is True
    (ev,) = impl.t.drain_events()
    assert (ev.kind, ev.owner, ev.request, ev.session) == (impl.mod.EV_WAIT_CANCELLED, b"B", "rb", 3)
    assert impl.t.waiters(NAME) == [b"C"]
    assert impl.t.cancel(NAME, b"B", 4) is False
    assert impl.t.cancel(NAME, b"H", 4) is False  # the holder is not a waiter
    assert impl.t.cancel("nope", b"C", 4) is False
    assert impl.t.session_waiters(3) == 0
    assert impl.t.stats()["cancels"] == 1


def test_cancel_last_waiter_of_blocked_lock_deletes_it(impl):
    impl.t.hold_grants_until(1_000)
    impl.acq(b"B", 0)
    assert impl.t.next_deadline() == 1_000
    assert impl.t.cancel(NAME, b"B", 1)
    impl.t.drain_events()
    assert impl.t.stats()["locks"] == 0 and impl.t.next_deadline() == -1


def test_drop_session(impl):
    impl.grant(b"H", 0, session=1)
    impl.grant(b"H", 0, session=1, name="a")
    impl.acq(b"x1", 1, session=2, wait=100)
    impl.acq(b"y1", 1, session=3)
    impl.acq(b"x2", 1, session=2, name="a")
    impl.acq(b"x3", 1, session=2, name="b")  # free: granted to session 2
    impl.t.drain_events()
    assert impl.t.session_waiters(2) == 2
    assert impl.t.drop_session(2, 2) == 2
    assert impl.t.drain_events() == []
    assert impl.t.waiters(NAME) == [b"y1"] and impl.t.waiters("a") == []
    assert impl.t.holder("b", 2).owner == b"x3"  # holders stay
    assert impl.t.session_waiters(2) == 0
    assert impl.t.next_deadline() == TTL  # the dropped waiter's timeout is gone
    assert impl.t.drop_session(2, 3) == 0
    assert impl.t.drop_session(1, 3) == 0


def test_next_deadline_is_the_earliest(impl):
    assert impl.t.next_deadline() == -1
    impl.grant(b"A", 0, ttl=500)
    impl.grant(b"B", 0, ttl=300, name="a")
    impl.acq(b"C", 10, wait=100)
    assert impl.t.next_deadline() == 110
    impl.t.cancel(NAME, b"C", 20)
    assert impl.t.next_deadline() == 300


def test_same_deadline_processed_in_scheduling_order(impl):
    impl.grant(b"A", 0, ttl=100, name="a")
    impl.grant(b"B", 0, ttl=100, name="b")
    impl.grant(b"C", 50, ttl=50, name=NAME)
    impl.t.expire(100)
    assert [e.owner for e in impl.t.drain_events()] == [b"A", b"B", b"C"]


def test_tokens_strictly_increase_across_release_and_expiry(impl):
    seen = []
    now = 0
    for i in range(30):
        tok = impl.grant(b"o%d" % i, now, ttl=10, name="ab"[i % 2])
        seen.append(tok)
        if i % 3:
            impl.t.release("ab"[i % 2], tok, b"o%d" % i, now)
        else:
            now += 10
            impl.t.expire(now)
            impl.t.drain_events()
    assert seen == sorted(set(seen)) and impl.t.last_token == seen[-1] == 30


def test_epoch_in_high_bits(impl):
    impl.grant(b"A", 0, name="a")
    impl.t.set_epoch(3)
    tok = impl.grant(b"B", 0)
    assert tok == (3 << 40) | 2 and tok >> impl.mod.TOKEN_EPOCH_SHIFT == 3
    assert impl.t.epoch == 3 and impl.t.counter == 2 and impl.t.last_token == tok
    impl.t.set_epoch(3)  # same epoch is fine
    with pytest.raises(ValueError):
        impl.t.set_epoch(2)
    with pytest.raises(ValueError):
        impl.t.set_epoch(impl.mod.MAX_EPOCH + 1)
    with pytest.raises(TypeError):
        impl.t.set_epoch(4.0)
    assert impl.t.epoch == 3
    impl.t.set_epoch(impl.mod.MAX_EPOCH)
    assert impl.grant(b"C", 0, name="b") == (impl.mod.MAX_EPOCH << 40) | 3 < 2**63


def test_advance_counter_never_lowers(impl):
    impl.t.advance_counter(1_000)
    assert impl.t.counter == 1_000
    impl.t.advance_counter(10)
    assert impl.t.counter == 1_000
    assert impl.grant(b"A", 0) == 1_001
    with pytest.raises(ValueError):
        impl.t.advance_counter(-1)
    with pytest.raises(TypeError):
        impl.t.advance_counter(True)
    with pytest.raises(OverflowError):
        impl.t.advance_counter(1 << 40)
    assert impl.t.counter == 1_001


def test_counter_overflow_refused_not_wrapped(impl):
    impl.t.advance_counter(impl.mod.MAX_COUNTER - 1)
    tok = impl.grant(b"A", 0)
    assert tok == impl.mod.MAX_COUNTER
    impl.t.release(NAME, tok, b"A", 1)
    before = impl.state()
    with pytest.raises(OverflowError):
        impl.acq(b"B", 2)
    assert impl.state() == before and impl.t.drain_events() == []
    assert impl.t.last_token == impl.mod.MAX_COUNTER
    impl.t.set_epoch(1)  # a new epoch does not reset the counter either
    with pytest.raises(OverflowError):
        impl.acq(b"B", 2)


def test_counter_exhausted_on_handoff_release_still_takes_effect(impl):
    impl.t.advance_counter(impl.mod.MAX_COUNTER - 1)
    tok = impl.grant(b"A", 0)
    impl.acq(b"B", 1)
    with pytest.raises(OverflowError):
        impl.t.release(NAME, tok, b"A", 2)  # no token left for B
    assert impl.t.holder(NAME, 2) is None and impl.t.waiters(NAME) == [b"B"]
    assert impl.t.drain_events() == [] and impl.t.last_token == impl.mod.MAX_COUNTER


def test_install_holder_and_remove_holder(impl):
    tok = (2 << 40) | 77
    impl.acq(b"W", 0, name="a")  # an unrelated lease
    impl.t.drain_events()
    impl.t.install_holder(NAME, tok, b"R", 5_000, 100, "meta", 10)
    assert impl.t.drain_events() == []
    h = impl.t.holder(NAME, 10)
    assert (h.token, h.owner, h.session, h.ttl_ms, h.deadline_ms, h.lock_delay_ms, h.meta) == (
        tok, b"R", 0, 5_000, 5_010, 100, "meta")
    assert impl.t.epoch == 2 and impl.t.counter == 77
    assert impl.grant(b"X", 20, name="b") == (2 << 40) | 78
    # replaces any current holder
    impl.t.install_holder(NAME, tok + 10, b"R2", 1_000, 0, None, 30)
    assert impl.t.holder(NAME, 30).token == tok + 10 and len(impl.t) == 3
    assert impl.t.counter == 87
    # never queues; waiters stay queued behind it
    impl.acq(b"Q", 40)
    assert impl.t.remove_holder(NAME, tok, 50) is False
    assert impl.t.remove_holder(NAME, tok + 10, 50) is True
    (gr,) = impl.t.drain_events()
    assert (gr.owner, gr.token) == (b"Q", (2 << 40) | 88)
    assert impl.t.remove_holder("nope", 1, 50) is False


def test_install_holder_lower_token_keeps_counter(impl):
    impl.t.advance_counter(500)
    impl.t.install_holder(NAME, 3, b"R", 100, 0, None, 0)
    assert impl.t.counter == 500 and impl.t.epoch == 0


def test_install_holder_rejects_bad_tokens(impl):
    for bad, exc in ((0, ValueError), (1 << 40, ValueError), (-1, ValueError), (1 << 63, ValueError),
                     ("1", TypeError), (True, TypeError)):
        with pytest.raises(exc):
            impl.t.install_holder(NAME, bad, b"R", 100, 0, None, 0)
    assert impl.t.stats()["locks"] == 0


def test_installed_lease_expires_with_its_lock_delay(impl):
    impl.t.install_holder(NAME, 5, b"R", 100, 200, None, 0)
    impl.acq(b"B", 1)
    impl.t.expire(100)
    assert impl.events() == [(impl.mod.EV_EXPIRED, NAME, b"R")]
    impl.t.expire(300)
    assert impl.events() == [(impl.mod.EV_GRANTED, NAME, b"B")]


def test_hold_grants_until(impl):
    impl.t.hold_grants_until(1_000)
    assert impl.acq(b"A", 0, wait=0) == impl.mod.NOT_ACQUIRED
    assert impl.t.stats()["locks"] == 0  # nothing left behind by the try
    assert impl.acq(b"B", 10) == impl.mod.QUEUED
    assert impl.acq(b"C", 20) == impl.mod.QUEUED
    assert impl.acq(b"D", 30, name="a") == impl.mod.QUEUED
    assert impl.t.next_deadline() == 1_000
    impl.t.expire(999)
    assert impl.t.drain_events() == []
    impl.t.expire(1_000)
    evs = impl.t.drain_events()
    assert [(e.kind, e.owner) for e in evs] == [(impl.mod.EV_GRANTED, b"B"), (impl.mod.EV_GRANTED, b"D")]
    assert evs[0].deadline_ms == 1_000 + TTL
    assert impl.t.waiters(NAME) == [b"C"]
    assert impl.acq(b"E", 1_000, name="b", wait=0) == impl.mod.GRANTED


def test_hold_grants_until_blocks_handoff_and_can_be_shortened(impl):
    tok = impl.grant(b"A", 0)
    impl.acq(b"B", 1)
    impl.t.hold_grants_until(5_000)
    impl.t.release(NAME, tok, b"A", 10)
    assert impl.t.drain_events() == [] and impl.t.holder(NAME, 10) is None
    assert impl.t.next_deadline() == 5_000
    impl.t.hold_grants_until(100)  # the operator shortens the grace period
    assert impl.t.next_deadline() == 100
    impl.t.expire(100)
    assert impl.events() == [(impl.mod.EV_GRANTED, NAME, b"B")]


def test_hold_and_lock_delay_take_the_later_end(impl):
    impl.grant(b"A", 0, ttl=100, delay=1_000)
    impl.acq(b"B", 1)
    impl.t.hold_grants_until(500)
    impl.t.expire(100)
    impl.t.drain_events()
    assert impl.t.next_deadline() == 1_100
    impl.t.hold_grants_until(2_000)
    assert impl.t.next_deadline() == 2_000
    impl.t.expire(1_999)
    assert impl.t.drain_events() == []
    impl.t.expire(2_000)
    assert impl.events() == [(impl.mod.EV_GRANTED, NAME, b"B")]


def test_stats_counters(impl):
    tok = impl.grant(b"A", 0, ttl=100)
    impl.acq(b"B", 1, wait=10)
    impl.acq(b"C", 1)
    impl.acq(b"D", 1)
    impl.t.expire(20)  # B times out
    impl.t.cancel(NAME, b"D", 21)
    s = impl.t.stats()
    assert {k: s[k] for k in ("locks_held", "waiters", "grants", "releases", "expiries", "wait_timeouts",
                              "cancels")} == dict(locks_held=1, waiters=1, grants=1, releases=0, expiries=0,
                                                  wait_timeouts=1, cancels=1)
    impl.t.release(NAME, tok, b"A", 30)  # hands off to C
    impl.t.expire(30 + TTL)
    s = impl.t.stats()
    assert (s["grants"], s["releases"], s["expiries"], s["locks_held"], s["waiters"], s["locks"]) == (
        2, 1, 1, 0, 0, 0)


def test_no_memory_growth_over_many_names(impl):
    for i in range(2_000):
        name = f"n{i}"
        tok = impl.grant(b"o", i, name=name, ttl=100_000)
        if i % 2:
            impl.t.release(name, tok, b"o", i)
    impl.t.expire(200_000)
    impl.t.drain_events()
    s = impl.t.stats()
    assert s["locks"] == 0 and s["deadlines"] == 0 and len(impl.t) == 0


BAD_ACQUIRES = [
    (dict(name=b"x"), TypeError),
    (dict(name=None), TypeError),
    (dict(name=""), ValueError),
    (dict(owner="A"), TypeError),
    (dict(owner=None), TypeError),
    (dict(session=-1), ValueError),
    (dict(session=1.0), TypeError),
    (dict(ttl_ms=0), ValueError),
    (dict(ttl_ms=-5), ValueError),
    (dict(ttl_ms=1.5), TypeError),
    (dict(ttl_ms=True), TypeError),
    (dict(ttl_ms=float("nan")), TypeError),
    (dict(ttl_ms=2**53), ValueError),
    (dict(ttl_ms=2**70), ValueError),
    (dict(wait_ms=-2), ValueError),
    (dict(wait_ms=False), TypeError),
    (dict(wait_ms=None), TypeError),
    (dict(lock_delay_ms=60_001), ValueError),
    (dict(lock_delay_ms=1.0), TypeError),
    (dict(now=-1), ValueError),
    (dict(now=1.0), TypeError),
    (dict(now=True), TypeError),
]


@pytest.mark.parametrize("bad,exc", BAD_ACQUIRES,
                         ids=[f"{list(b)[0]}={list(b.values())[0]!r}" for b, _ in BAD_ACQUIRES])
def test_bad_acquire_arguments_rejected_state_unchanged(impl, bad, exc):
    tok = impl.grant(b"H", 0, ttl=100)
    impl.acq(b"W", 1, wait=10)
    before = impl.state()
    args = dict(name=NAME, owner=b"A", session=1, request=None, ttl_ms=TTL, wait_ms=-1, lock_delay_ms=0,
                meta=None, now=500)  # now=500 would expire things if it got that far
    args.update(bad)
    with pytest.raises(exc):
        impl.t.acquire(**args)
    assert impl.state() == before and impl.t.drain_events() == []
    assert impl.t.holder(NAME, 1).token == tok


def test_bad_arguments_of_other_methods(impl):
    tok = impl.grant(b"H", 0, ttl=100)
    impl.acq(b"W", 1, wait=10)
    before = impl.state()
    cases = [
        (lambda: impl.t.release(NAME, "1", b"H", 500), TypeError),
        (lambda: impl.t.release(NAME, tok, "H", 500), TypeError),
        (lambda: impl.t.release(1, tok, b"H", 500), TypeError),
        (lambda: impl.t.release(NAME, -tok, b"H", 500), ValueError),
        (lambda: impl.t.release(NAME, tok, b"H", 500.0), TypeError),
        (lambda: impl.t.extend(NAME, tok, b"H", 0, 500), ValueError),
        (lambda: impl.t.extend(NAME, tok, b"H", True, 500), TypeError),
        (lambda: impl.t.extend(NAME, tok, b"H", 10.0, 500), TypeError),
        (lambda: impl.t.cancel(NAME, "W", 500), TypeError),
        (lambda: impl.t.cancel(NAME, b"W", -1), ValueError),
        (lambda: impl.t.drop_session("1", 500), TypeError),
        (lambda: impl.t.drop_session(1, None), TypeError),
        (lambda: impl.t.expire(1.5), TypeError),
        (lambda: impl.t.expire(-1), ValueError),
        (lambda: impl.t.install_holder(NAME, 5, b"R", 0, 0, None, 500), ValueError),
        (lambda: impl.t.install_holder(NAME, 5, b"R", 10, 60_001, None, 500), ValueError),
        (lambda: impl.t.install_holder(NAME, 5, "R", 10, 0, None, 500), TypeError),
        (lambda: impl.t.remove_holder(NAME, None, 500), TypeError),
        (lambda: impl.t.hold_grants_until(1.0), TypeError),
        (lambda: impl.t.hold_grants_until(-1), ValueError),
        (lambda: impl.t.holder(None, 5), TypeError),
        (lambda: impl.t.check(NAME, 1.0, 5), TypeError),
        (lambda: impl.t.waiters(b"x"), TypeError),
        (lambda: impl.t.session_waiters(None), TypeError),
    ]
    for fn, exc in cases:
        with pytest.raises(exc):
            fn()
        assert impl.state() == before and impl.t.drain_events() == []


def test_event_and_holder_are_read_only_snapshots():
    t = _core.LockTable()
    t.acquire(NAME, b"A", 1, None, 100, 0, 0, None, 0)
    (ev,) = t.drain_events()
    with pytest.raises(AttributeError):
        ev.token = 5
    h = t.holder(NAME, 0)
    t.extend(NAME, ev.token, b"A", 500, 10)
    assert h.deadline_ms == 100  # a snapshot: later calls do not change it
    with pytest.raises(AttributeError):
        h.token = 5
    assert "GRANTED" in repr(ev) and "Holder" in repr(h)


def test_waited_ms_dates_each_grant_from_its_request(impl):
    """EV_GRANTED.waited_ms = grant time - arrival of the request answered: 0 at once,
    the queueing time for a queued grant (reset by a retry with the same owner),
    and <= 0 for a re-delivered lease (the client's no-dead-lease check uses it)."""
    t, mod = impl.t, impl.mod
    assert impl.acq(b"a", 100) == mod.GRANTED
    (ev,) = t.drain_events()
    assert ev.waited_ms == 0
    token_a = ev.token
    assert impl.acq(b"b", 150) == mod.QUEUED
    assert impl.acq(b"b", 400, session=2) == mod.QUEUED  # a retry: its wait counts from 400
    t.drain_events()
    t.release(NAME, token_a, b"a", 1000)
    (ev,) = t.drain_events()
    assert ev.owner == b"b" and ev.fresh and ev.waited_ms == 1000 - 400
    t.extend(NAME, ev.token, b"b", 500, 1200)  # now granted-or-extended at 1200, deadline 1700
    assert impl.acq(b"b", 1300) == mod.GRANTED  # re-delivered: 100 ms before this request
    (ev,) = t.drain_events()
    assert not ev.fresh and ev.waited_ms == 1200 - 1300 and ev.deadline_ms == 1700


def test_waiter_info_lists_the_queue_in_order_with_arrival_and_wait_deadline(impl):
    impl.grant(b"H", 0)
    assert impl.acq(b"w1", 5, session=11, wait=-1, meta="m1") == impl.mod.QUEUED
    assert impl.acq(b"w2", 7, session=12, wait=100, meta="m2") == impl.mod.QUEUED
    assert impl.t.waiter_info(NAME) == [(b"w1", 11, "m1", 5, -1, False), (b"w2", 12, "m2", 7, 107, False)]
    assert impl.t.waiter_info("other") == []
    impl.t.cancel(NAME, b"w1", 8)
    assert [w[0] for w in impl.t.waiter_info(NAME)] == [b"w2"]
    impl.t.expire(107)  # w2's wait ran out
    assert impl.t.waiter_info(NAME) == []


def test_held_page_lists_one_page_by_name_or_by_waiters(impl):
    for i, name in enumerate(("b/2", "a/1", "b/1", "b/3", "c")):
        impl.grant(bytes([i + 1]), 0, name=name)
    impl.acq(b"w1", 0, name="b/3")
    impl.acq(b"w2", 0, name="b/3")
    impl.acq(b"w3", 0, name="b/2")
    impl.acq(b"r1", 0, name="shared", ttl=50)  # a lease that is expired at 100
    t = impl.t
    assert t.held_page("", None, 2, False, 100) == ([("a/1", 0), ("b/1", 0)], 5)
    assert t.held_page("", "b/1", 2, False, 100) == ([("b/2", 1), ("b/3", 2)], 3)
    assert t.held_page("b/", None, 10, False, 100) == ([("b/1", 0), ("b/2", 1), ("b/3", 2)], 3)
    assert t.held_page("", None, 3, True, 100) == ([("b/3", 2), ("b/2", 1), ("a/1", 0)], 5)
    assert t.held_page("", "c", 3, False, 100) == ([], 0)
    assert t.held_page("", None, 10, False, 10)[1] == 6  # "shared" still held at 10


def test_waited_names_lists_every_name_with_a_waiter_whatever_its_state(impl):
    # what a slot move's freeze takes out: waiters behind a holder, behind shared holders, on a free
    # name in the promotion grace, and an acquire_many() member waiting for its other name
    t = impl.t
    impl.grant(b"H", 0, name="held")
    impl.acq(b"w1", 0, name="held")
    t.acquire("shared", b"s1", 1, 1, TTL, -1, 0, None, 0, True)  # a shared holder
    t.acquire("shared", b"x1", 2, 2, TTL, -1, 0, None, 0)  # an exclusive request behind a shared holder
    t.acquire_many([("held", False), ("free-many", False)], b"m1", 3, 3, TTL, -1, 0, None, 0)
    t.hold_grants_until(500)
    impl.acq(b"g1", 1, name="graced")  # a free name: it waits for the grace's end
    impl.events()
    assert t.waited_names() == ["free-many", "graced", "held", "shared"]
    assert t.waited_names(None, True) == ["free-many", "graced"]
    assert t.waited_names(lambda name: name.startswith("g"), True) == ["graced"]
    assert t.waited_names(lambda name: name.startswith("h")) == ["held"]
    with pytest.raises(TypeError):
        t.waited_names(7)
    t.cancel("free-many", b"m1", 2)  # the whole acquire_many() request leaves both queues
    assert t.waited_names() == ["graced", "held", "shared"]
    t.expire(500)  # the grace ends: "graced" is granted
    assert t.waited_names() == ["held", "shared"]
