"""Unit tests of the lock kinds in the lock table: shared (read/write) locks and
counting semaphores, FIFO across kinds, one fencing counter for every grant.

Each test runs against the compiled ``fastlock._core`` and against the reference
model in tests/refmodel.py, so both are pinned to the same behaviour.
"""

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

import refmodel

from fastlock import _core

NAME = "files/report"
TTL = 1_000


class Impl:
    def __init__(self, mod, table_cls):
        self.mod = mod
        self.t = table_cls()

    def acq(self, owner, now, *, shared=False, limit=0, wait=-1, name=NAME, session=1, ttl=TTL, delay=0):
        return self.t.acquire(name, owner, session, owner, ttl, wait, delay, None, now, shared, limit)

    def grants(self):
        """Fresh grants since the last call: [(owner, token, shared, limit)]."""
        return [(e.owner, e.token, e.shared, e.limit) for e in self.t.drain_events()
                if e.kind == self.mod.EV_GRANTED and e.fresh]

    def holders(self, now, name=NAME):
        return sorted(h.owner for h in self.t.holders_of(name, now))

    def release(self, owner, now, name=NAME):
        h = self.t.holder(name, now, owner)
        assert h is not None, owner
        self.t.release(name, h.token, owner, now)


@pytest.fixture(params=["core", "model"])
def impl(request):
    if request.param == "core":
        return Impl(_core, _core.LockTable)
    return Impl(refmodel, refmodel.RefLockTable)


def test_kind_constants_match_the_model():
    assert _core.LIMIT_CONFLICT == refmodel.LIMIT_CONFLICT
    assert len({_core.GRANTED, _core.QUEUED, _core.NOT_ACQUIRED, _core.LIMIT_CONFLICT}) == 4
    assert _core.MAX_LIMIT == refmodel.MAX_LIMIT == (1 << 31) - 1


# -- shared locks ----------------------------------------------------------------------


def test_readers_share_and_each_gets_its_own_increasing_token(impl):
    for i, owner in enumerate((b"r1", b"r2", b"r3")):
        assert impl.acq(owner, i, shared=True) == impl.mod.GRANTED
    grants = impl.grants()
    assert [g[0] for g in grants] == [b"r1", b"r2", b"r3"]
    assert all(g[2] is True and g[3] == 0 for g in grants)
    tokens = [g[1] for g in grants]
    assert tokens == sorted(tokens) and len(set(tokens)) == 3
    assert impl.holders(5) == [b"r1", b"r2", b"r3"]
    for token in tokens:
        assert impl.t.check(NAME, token, 5)
    assert len(impl.t) == 3


def test_a_writer_excludes_readers_and_readers_exclude_a_writer(impl):
    assert impl.acq(b"w", 0) == impl.mod.GRANTED
    assert impl.acq(b"r", 1, shared=True, wait=0) == impl.mod.NOT_ACQUIRED
    impl.release(b"w", 2)
    assert impl.acq(b"r", 3, shared=True, wait=0) == impl.mod.GRANTED
    assert impl.acq(b"w2", 4, wait=0) == impl.mod.NOT_ACQUIRED


def test_a_stream_of_readers_does_not_starve_a_queued_writer(impl):
    assert impl.acq(b"r0", 0, shared=True) == impl.mod.GRANTED
    assert impl.acq(b"w", 1) == impl.mod.QUEUED
    # readers keep arriving: every one queues behind the writer, none joins r0
    for i in range(1, 6):
        assert impl.acq(b"r%d" % i, 1 + i, shared=True) == impl.mod.QUEUED
    assert impl.acq(b"late", 7, shared=True, wait=0) == impl.mod.NOT_ACQUIRED
    assert impl.holders(8) == [b"r0"]
    impl.grants()
    impl.release(b"r0", 10)
    (writer,) = impl.grants()
    assert writer[0] == b"w" and writer[2] is False
    impl.release(b"w", 11)
    # the readers behind the writer are granted together, in FIFO order
    readers = impl.grants()
    assert [g[0] for g in readers] == [b"r%d" % i for i in range(1, 6)]
    assert min(g[1] for g in readers) > writer[1]


def test_consecutive_readers_at_the_head_are_granted_together_up_to_the_next_writer(impl):
    assert impl.acq(b"w1", 0) == impl.mod.GRANTED
    for owner, shared in ((b"r1", True), (b"r2", True), (b"w2", False), (b"r3", True)):
        assert impl.acq(owner, 1, shared=shared) == impl.mod.QUEUED
    impl.grants()
    impl.release(b"w1", 2)
    assert [g[0] for g in impl.grants()] == [b"r1", b"r2"]
    assert impl.t.waiters(NAME) == [b"w2", b"r3"]
    impl.release(b"r1", 3)
    assert impl.grants() == []  # r2 still reads
    impl.release(b"r2", 4)
    assert [g[0] for g in impl.grants()] == [b"w2"]


def test_a_cancelled_head_writer_lets_the_readers_behind_it_join(impl):
    assert impl.acq(b"r0", 0, shared=True) == impl.mod.GRANTED
    assert impl.acq(b"w", 1) == impl.mod.QUEUED
    assert impl.acq(b"r1", 2, shared=True) == impl.mod.QUEUED
    impl.grants()
    assert impl.t.cancel(NAME, b"w", 3)
    assert [g[0] for g in impl.grants()] == [b"r1"]
    assert impl.holders(4) == [b"r0", b"r1"]


def test_shared_lease_expiry_extend_and_release_are_per_holder(impl):
    impl.acq(b"r1", 0, shared=True, ttl=100)
    impl.acq(b"r2", 0, shared=True, ttl=100)
    t1, t2 = [g[1] for g in impl.grants()]
    assert impl.t.extend(NAME, t2, b"r2", 500, 50) == 550
    with pytest.raises(impl.mod.NotHolder):
        impl.t.extend(NAME, t1, b"r2", 500, 50)  # r1's token with r2's owner key
    impl.t.expire(100)
    expired = [(e.owner, e.shared) for e in impl.t.drain_events() if e.kind == impl.mod.EV_EXPIRED]
    assert expired == [(b"r1", True)]
    assert impl.holders(100) == [b"r2"]
    assert not impl.t.check(NAME, t1, 100) and impl.t.check(NAME, t2, 100)
    with pytest.raises(impl.mod.NotHolder):
        impl.t.release(NAME, t1, b"r1", 101)
    impl.t.release(NAME, t2, b"r2", 101)
    assert impl.t.holders() == [] and impl.t.stats()["locks"] == 0


def test_a_retry_re_delivers_a_shared_lease(impl):
    impl.acq(b"r1", 0, shared=True)
    (first,) = impl.grants()
    assert impl.acq(b"r1", 5, shared=True) == impl.mod.GRANTED
    (ev,) = impl.t.drain_events()
    assert (ev.kind, ev.token, ev.fresh, ev.shared) == (impl.mod.EV_GRANTED, first[1], False, True)


def test_lock_delay_of_an_expired_reader_blocks_every_kind(impl):
    impl.acq(b"r1", 0, shared=True, ttl=100, delay=50)
    impl.t.expire(100)
    impl.t.drain_events()
    assert impl.acq(b"r2", 120, shared=True, wait=0) == impl.mod.NOT_ACQUIRED
    assert impl.acq(b"w", 120) == impl.mod.QUEUED
    impl.t.expire(150)
    assert [g[0] for g in impl.grants()] == [b"w"]


def test_install_holder_of_shared_leases(impl):
    impl.t.install_holder(NAME, 7, b"a", 100, 0, None, 0, True, 0)
    impl.t.install_holder(NAME, 8, b"b", 100, 0, None, 0, True, 0)
    assert impl.holders(1) == [b"a", b"b"]
    assert impl.t.counter == 8
    assert impl.acq(b"r", 2, shared=True, wait=0) == impl.mod.GRANTED
    assert impl.t.remove_holder(NAME, 7, 3)
    impl.t.install_holder(NAME, 20, b"x", 100, 0, None, 4)  # an exclusive one replaces them all
    assert impl.holders(5) == [b"x"]


def test_install_holder_grants_what_is_due_before_it_installs(impl):
    """install_holder() first expires what is due at ``now`` and grants the waiters that
    frees, with fresh tokens; an install record replayed after them carries a higher
    token, since a log never issues one token twice. Regression of a TestCoreVsModel
    sequence whose install reused the token that phase had just granted to a waiter."""
    impl.t.install_holder(NAME, 5, b"o1", 100, 0, None, 0, False, 2)
    impl.t.install_holder(NAME, 6, b"o2", 100, 0, None, 0, False, 2)
    assert impl.acq(b"o3", 10, limit=2) == impl.mod.QUEUED
    impl.t.drain_events()
    assert impl.t.counter == 6
    impl.t.install_holder(NAME, 8, b"o5", 1_000, 0, "installed", 100, False, 2)
    assert impl.grants() == [(b"o3", 7, False, 2)]
    got = {h.owner: (h.token, h.shared, h.limit, h.deadline_ms) for h in impl.t.holders_of(NAME, 100)}
    assert got == {b"o3": (7, False, 2, 100 + TTL), b"o5": (8, False, 2, 1_100)}
    assert impl.t.counter == 8


# -- semaphores ------------------------------------------------------------------------


def test_a_semaphore_of_three_never_has_four_holders(impl):
    for i in range(6):
        status = impl.acq(b"p%d" % i, i, limit=3)
        assert status == (impl.mod.GRANTED if i < 3 else impl.mod.QUEUED)
    grants = impl.grants()
    assert [g[0] for g in grants] == [b"p0", b"p1", b"p2"]
    assert all(g[3] == 3 and g[2] is False for g in grants)
    for now in range(10, 16):
        impl.release(impl.holders(now)[0], now)
        assert len(impl.holders(now)) <= 3
        grants += impl.grants()
    # FIFO hand-off, each permit with its own strictly increasing token
    assert [g[0] for g in grants] == [b"p%d" % i for i in range(6)]
    tokens = [g[1] for g in grants]
    assert tokens == sorted(tokens) and len(set(tokens)) == 6


def test_a_conflicting_limit_is_refused_and_changes_nothing(impl):
    assert impl.acq(b"p1", 0, limit=2) == impl.mod.GRANTED
    impl.grants()
    before = (impl.t.stats(), impl.t.waiters(NAME), impl.holders(1))
    assert impl.acq(b"x", 1, limit=3) == impl.mod.LIMIT_CONFLICT
    assert impl.acq(b"x", 1) == impl.mod.LIMIT_CONFLICT  # a lock on a semaphore's name
    assert impl.acq(b"x", 1, shared=True) == impl.mod.LIMIT_CONFLICT
    assert impl.t.drain_events() == []
    assert (impl.t.stats(), impl.t.waiters(NAME), impl.holders(1)) == before
    # and the other way round: a semaphore on a held lock's name
    assert impl.acq(b"w", 2, name="other") == impl.mod.GRANTED
    assert impl.acq(b"p", 2, name="other", limit=2) == impl.mod.LIMIT_CONFLICT


def test_the_limit_is_forgotten_when_the_name_has_no_holders_or_waiters(impl):
    impl.acq(b"p1", 0, limit=2)
    impl.release(b"p1", 1)
    assert impl.acq(b"p2", 2, limit=5) == impl.mod.GRANTED
    assert impl.grants()[-1][3] == 5


def test_the_limit_is_remembered_while_only_waiters_remain(impl):
    impl.acq(b"w", 0)
    assert impl.acq(b"p", 1, limit=2) == impl.mod.LIMIT_CONFLICT
    impl.acq(b"w2", 1)  # queued behind w
    impl.release(b"w", 2)
    assert impl.acq(b"p", 3, limit=2, wait=0) == impl.mod.LIMIT_CONFLICT


@pytest.mark.parametrize("shared, limit, exc", [
    (1, 0, TypeError),
    (None, 0, TypeError),
    (False, -1, ValueError),
    (False, 1 << 31, ValueError),
    (True, 2, ValueError),
    (False, 2.0, TypeError),
])
def test_bad_kind_arguments_are_refused(impl, shared, limit, exc):
    with pytest.raises(exc):
        impl.acq(b"x", 0, shared=shared, limit=limit)
    assert impl.t.stats()["locks"] == 0 and impl.t.drain_events() == []


def test_every_kind_draws_from_one_fencing_counter(impl):
    impl.acq(b"w", 0, name="a")
    impl.acq(b"r", 1, name="b", shared=True)
    impl.acq(b"p", 2, name="c", limit=2)
    tokens = [g[1] for g in impl.grants()]
    assert tokens == [1, 2, 3] and impl.t.last_token == 3


# -- lock-delay, for the WAL and snapshots ---------------------------------------------


def test_a_running_lock_delay_is_listed_and_can_be_replayed(impl):
    impl.acq(b"a", 0, ttl=100, delay=500)
    impl.t.expire(100)
    impl.t.drain_events()
    assert impl.t.lock_delays() == [(NAME, 600)]
    # a fresh table (a restart or a promoted standby) replays it
    other = type(impl.t)()
    assert other.install_lock_delay(NAME, 600, 150) is True
    assert other.lock_delays() == [(NAME, 600)]
    assert other.acquire(NAME, b"b", 1, None, TTL, 0, 0, None, 599) == impl.mod.NOT_ACQUIRED
    assert other.acquire(NAME, b"b", 1, None, TTL, -1, 0, None, 599) == impl.mod.QUEUED
    other.expire(600)
    assert [(e.kind, e.owner) for e in other.drain_events()] == [(impl.mod.EV_GRANTED, b"b")]
    assert other.lock_delays() == []


def test_install_lock_delay_ignores_a_past_delay_and_an_exclusive_holder(impl):
    assert impl.t.install_lock_delay(NAME, 10, 10) is False
    assert impl.t.stats()["locks"] == 0
    impl.acq(b"a", 20)
    assert impl.t.install_lock_delay(NAME, 500, 30) is False
    assert impl.t.lock_delays() == []
    with pytest.raises(ValueError):
        impl.t.install_lock_delay(NAME, -1, 30)


# -- deadlock detection ----------------------------------------------------------------


def _deadlocks(impl):
    return [(e.owner, e.session, e.name, e.cycle) for e in impl.t.drain_events() if e.kind == impl.mod.EV_DEADLOCK]


def test_a_two_session_deadlock_fails_the_youngest_waiter(impl):
    impl.acq(b"s1-a", 0, name="a", session=1)
    impl.acq(b"s2-b", 0, name="b", session=2)
    assert impl.acq(b"s1-b", 10, name="b", session=1) == impl.mod.QUEUED
    assert impl.acq(b"s2-a", 20, name="a", session=2) == impl.mod.QUEUED
    impl.t.drain_events()
    assert impl.t.break_deadlocks(25, 100) == []  # not old enough yet
    assert impl.t.break_deadlocks(120, 100) == [((2, "a"), (1, "b"))]
    assert _deadlocks(impl) == [(b"s2-a", 2, "a", ((2, "a"), (1, "b")))]
    assert impl.t.waiters("a") == [] and impl.t.waiters("b") == [b"s1-b"]
    assert impl.t.break_deadlocks(200, 100) == []
    assert impl.t.stats()["deadlocks"] == 1


def test_a_three_session_cycle_is_broken_once(impl):
    for s, (held, _wanted) in enumerate((("a", "b"), ("b", "c"), ("c", "a")), start=1):
        impl.acq(b"h%d" % s, 0, name=held, session=s)
    for s, (_held, wanted) in enumerate((("a", "b"), ("b", "c"), ("c", "a")), start=1):
        assert impl.acq(b"w%d" % s, s, name=wanted, session=s) == impl.mod.QUEUED
    impl.t.drain_events()
    (cycle,) = impl.t.break_deadlocks(500, 0)
    assert cycle == ((3, "a"), (1, "b"), (2, "c"))
    assert [d[0] for d in _deadlocks(impl)] == [b"w3"]


def test_a_writer_waiting_on_its_own_sessions_read_lock_with_a_reader_behind_a_writer(impl):
    # s1 reads x and waits to write y; s2 writes y and waits to read x behind a queued writer of s1
    impl.acq(b"r1", 0, name="x", session=1, shared=True)
    impl.acq(b"w2", 0, name="y", session=2)
    assert impl.acq(b"w1x", 1, name="x", session=3) == impl.mod.QUEUED      # a writer queued on x (s3)
    assert impl.acq(b"r2", 2, name="x", session=2, shared=True) == impl.mod.QUEUED  # behind it
    assert impl.acq(b"w1y", 3, name="y", session=1) == impl.mod.QUEUED
    impl.t.drain_events()
    # s2 waits for s3's writer (ahead of it), which waits for s1 (reader of x); s1 waits for s2
    # (holds y): s3 holds nothing, so the deadlocked parties are s1 and s2
    (cycle,) = impl.t.break_deadlocks(10, 0)
    assert cycle == ((1, "y"), (2, "x"))
    assert _deadlocks(impl)[0][0] == b"w1y"  # the youngest


def test_readers_sharing_with_each_other_are_no_deadlock(impl):
    impl.acq(b"r1", 0, name="x", session=1, shared=True)
    impl.acq(b"r2", 0, name="y", session=2, shared=True)
    assert impl.acq(b"r1y", 1, name="y", session=1, shared=True) == impl.mod.GRANTED
    assert impl.acq(b"r2x", 1, name="x", session=2, shared=True) == impl.mod.GRANTED
    assert impl.t.break_deadlocks(10, 0) == []


def test_semaphore_waits_are_not_deadlock_edges(impl):
    impl.acq(b"p1", 0, name="s", session=1, limit=1)
    impl.acq(b"x2", 0, name="x", session=2)
    assert impl.acq(b"p2", 1, name="s", session=2, limit=1) == impl.mod.QUEUED
    assert impl.acq(b"x1", 1, name="x", session=1) == impl.mod.QUEUED
    assert impl.t.break_deadlocks(10, 0) == []


def test_a_session_waiting_for_its_own_lock_is_no_deadlock(impl):
    # two tasks of one client contending for one lock: the holder is not waiting
    impl.acq(b"first", 0, session=4)
    assert impl.acq(b"second", 1, session=4) == impl.mod.QUEUED
    impl.t.drain_events()
    assert impl.t.break_deadlocks(2, 0) == []
    assert impl.t.waiters(NAME) == [b"second"]


def test_two_waiters_of_one_session_behind_another_sessions_holder_are_no_deadlock(impl):
    impl.acq(b"holder", 0, session=1)
    assert impl.acq(b"task1", 1, session=2) == impl.mod.QUEUED
    assert impl.acq(b"task2", 2, session=2) == impl.mod.QUEUED
    impl.t.drain_events()
    assert impl.t.break_deadlocks(10, 0) == []
    assert impl.t.waiters(NAME) == [b"task1", b"task2"]


def _acq_as(impl, owner, now, name, session, actor, *, shared=False):
    return impl.t.acquire(name, owner, session, owner, TTL, -1, 0, None, now, shared, 0, actor)


def _cross(impl, holds_a, holds_b, waits_b, waits_a):
    """Parties ``(session, actor)``: one holds a, one holds b (at 0); then one waits for b
    (at 1) and one for a (at 2)."""
    _acq_as(impl, b"a1", 0, "a", *holds_a)
    _acq_as(impl, b"b2", 0, "b", *holds_b)
    assert _acq_as(impl, b"b1", 1, "b", *waits_b) == impl.mod.QUEUED
    assert _acq_as(impl, b"a2", 2, "a", *waits_a) == impl.mod.QUEUED
    impl.t.drain_events()


def test_a_holder_whose_session_waits_in_another_actor_is_not_blocked(impl):
    # task 11 of s1 holds a; task 12 of s1 waits for b, held by s2, which waits for a:
    # task 11 can still release a, so nothing is deadlocked
    _cross(impl, (1, 11), (2, 0), (1, 12), (2, 0))
    assert impl.t.break_deadlocks(10, 0) == []
    assert impl.t.waiters("a") == [b"a2"] and impl.t.waiters("b") == [b"b1"]


def test_without_actors_a_session_that_waits_is_blocked_as_a_whole(impl):
    # the same requests with actor 0: the session is one party, as PostgreSQL's backend
    _cross(impl, (1, 0), (2, 0), (1, 0), (2, 0))
    assert impl.t.break_deadlocks(10, 0) == [((2, "a"), (1, "b"))]
    assert [d[0] for d in _deadlocks(impl)] == [b"a2"]


def test_two_actors_of_one_session_can_deadlock_each_other(impl):
    _cross(impl, (5, 1), (5, 2), (5, 1), (5, 2))
    assert impl.t.break_deadlocks(10, 0) == [((5, "a"), (5, "b"))]
    assert [d[0] for d in _deadlocks(impl)] == [b"a2"]


def test_two_readers_waiting_to_write_the_lock_they_read_deadlock(impl):
    _acq_as(impl, b"r1", 0, "x", 1, 0, shared=True)
    _acq_as(impl, b"r2", 0, "x", 2, 0, shared=True)
    assert _acq_as(impl, b"w1", 1, "x", 1, 0) == impl.mod.QUEUED
    assert _acq_as(impl, b"w2", 2, "x", 2, 0) == impl.mod.QUEUED
    impl.t.drain_events()
    assert impl.t.break_deadlocks(10, 0) == [((2, "x"), (1, "x"))]
    assert [d[0] for d in _deadlocks(impl)] == [b"w2"]
    assert impl.t.waiters("x") == [b"w1"]  # still waits for r2, which can now go on


def _upgrade_deadlock(impl, k):
    """k sessions read x, then each waits to write it: k - 1 victims are needed."""
    for s in range(1, k + 1):
        _acq_as(impl, b"r%d" % s, 0, "x", s, 0, shared=True)
    for s in range(1, k + 1):
        assert _acq_as(impl, b"w%d" % s, s, "x", s, 0) == impl.mod.QUEUED
    impl.t.drain_events()


def test_one_call_searches_again_while_it_finds_deadlocks_up_to_its_passes(impl):
    _upgrade_deadlock(impl, 6)
    assert len(impl.t.break_deadlocks(10, 0)) == impl.mod.DEADLOCK_PASSES == 4
    assert len(impl.t.break_deadlocks(10, 0)) == 1
    assert impl.t.waiters("x") == [b"w1"]


def test_one_call_searches_again_only_within_its_work_budget(impl):
    """The model: ``max_work`` only stops further searches of a call (its searches are whole).
    The core also stops a search at the bound: the tests below."""
    if impl.mod is _core:
        pytest.skip("the core's bound stops a search too (test_a_search_stops_at_its_work_bound_...)")
    _upgrade_deadlock(impl, 4)
    assert [c[0] for c in impl.t.break_deadlocks(10, 0, 1)] == [(4, "x")]  # the first search only
    assert [c[0] for c in impl.t.break_deadlocks(10, 0, 1)] == [(3, "x")]
    assert len(impl.t.break_deadlocks(10, 0, 1000)) == 1
    with pytest.raises(ValueError):
        impl.t.break_deadlocks(10, 0, -1)


def test_a_victim_waiting_only_for_its_own_party_is_passed_over(impl):
    # s1 holds a and b; its youngest request waits for a (its own), an older one for c,
    # held by s2, which waits for b: the request on c is failed, not the one on a
    _acq_as(impl, b"a1", 0, "a", 1, 0)
    _acq_as(impl, b"b1", 0, "b", 1, 0)
    _acq_as(impl, b"c2", 0, "c", 2, 0)
    _acq_as(impl, b"wc", 1, "c", 1, 0)
    _acq_as(impl, b"wb", 2, "b", 2, 0)
    _acq_as(impl, b"wa", 3, "a", 1, 0)
    impl.t.drain_events()
    assert impl.t.break_deadlocks(10, 0) == [((2, "b"), (1, "c"))]
    assert [d[0] for d in _deadlocks(impl)] == [b"wb"]
    assert impl.t.waiters("a") == [b"wa"]


def test_independent_deadlocks_are_broken_in_one_call_oldest_victim_first(impl):
    for base, (x, y) in ((10, ("a", "b")), (20, ("c", "d"))):
        _acq_as(impl, b"h%d" % base, 0, x, base, 0)
        _acq_as(impl, b"h%d" % (base + 1), 0, y, base + 1, 0)
        _acq_as(impl, b"w%d" % base, base, y, base, 0)
        _acq_as(impl, b"w%d" % (base + 1), base + 1, x, base + 1, 0)
    impl.t.drain_events()
    assert impl.t.break_deadlocks(50, 0) == [((11, "a"), (10, "b")), ((21, "c"), (20, "d"))]
    assert impl.t.stats()["deadlocks"] == 2


def test_a_multi_lock_request_is_failed_whole_with_the_name_it_waits_on(impl):
    _acq_as(impl, b"a1", 0, "a", 1, 0)
    _acq_as(impl, b"c2", 0, "c", 2, 0)
    assert impl.t.acquire_many([("b", False), ("c", False)], b"m1", 1, b"m1", TTL, -1, 0, None, 1) == \
        impl.mod.QUEUED
    _acq_as(impl, b"a2", 2, "a", 2, 0)
    impl.t.drain_events()
    # the multi-lock of s1 (arrived at 1) is older than s2's wait on a (arrived at 2)
    assert impl.t.break_deadlocks(10, 0) == [((2, "a"), (1, "c"))]
    assert impl.t.waiters("b") == [b"m1"]


def test_actor_is_checked(impl):
    for bad, exc in ((-1, ValueError), (True, TypeError), ("1", TypeError), (1 << 63, ValueError)):
        with pytest.raises(exc):
            impl.t.acquire(NAME, b"o", 1, None, TTL, -1, 0, None, 0, False, 0, bad)
        with pytest.raises(exc):
            impl.t.acquire_many([(NAME, False)], b"o", 1, None, TTL, -1, 0, None, 0, bad)
    assert impl.t.stats()["locks"] == 0


def test_breaking_a_deadlock_hands_the_lock_on(impl):
    impl.acq(b"a1", 0, name="a", session=1)
    impl.acq(b"b2", 0, name="b", session=2)
    impl.acq(b"b1", 1, name="b", session=1)
    impl.acq(b"a2", 2, name="a", session=2)
    impl.acq(b"a3", 3, name="a", session=3)  # behind a2: granted once a1 is released
    impl.t.drain_events()
    impl.t.break_deadlocks(5, 0)
    assert impl.t.waiters("a") == [b"a3"]
    impl.release(b"a1", 6, name="a")
    assert [g[0] for g in impl.grants()] == [b"a3"]


def test_dropping_a_session_never_grants_to_that_session(impl):
    # s7 queues a writer and then a reader behind it on a read-held lock; its connection
    # goes: removing the writer must not hand the lock to s7's own reader
    impl.acq(b"r0", 0, session=1, shared=True)
    assert impl.acq(b"w7", 1, session=7) == impl.mod.QUEUED
    assert impl.acq(b"r7", 2, session=7, shared=True) == impl.mod.QUEUED
    assert impl.acq(b"r8", 3, session=8, shared=True) == impl.mod.QUEUED
    impl.t.drain_events()
    assert impl.t.drop_session(7, 4) == 2
    assert [g[0] for g in impl.grants()] == [b"r8"]
    assert impl.holders(5) == [b"r0", b"r8"] and impl.t.session_waiters(7) == 0


# -- atomic multi-lock -----------------------------------------------------------------


def _many(impl, owner, now, items, *, session=1, wait=-1, ttl=TTL):
    return impl.t.acquire_many(items, owner, session, owner, ttl, wait, 0, None, now)


def test_a_free_set_is_granted_at_once_with_a_token_per_name(impl):
    assert _many(impl, b"m", 0, [("a", False), ("b", True), ("c", False)]) == impl.mod.GRANTED
    grants = impl.grants()
    assert [(g[0], g[2]) for g in grants] == [(b"m", False), (b"m", True), (b"m", False)]
    assert [g[1] for g in grants] == [1, 2, 3]
    assert [h.token for h in impl.t.holders_of("b", 1)] == [2]


def test_a_waiting_set_holds_none_of_its_names(impl):
    impl.acq(b"x", 0, name="b")
    assert _many(impl, b"m", 1, [("a", False), ("b", False)]) == impl.mod.QUEUED
    impl.grants()
    assert impl.holders(2, name="a") == []  # "a" is free but not taken
    assert impl.t.waiters("a") == [b"m"] and impl.t.waiters("b") == [b"m"]
    impl.release(b"x", 3, name="b")
    assert sorted(g[0] for g in impl.grants()) == [b"m", b"m"]
    assert impl.holders(4, name="a") == [b"m"] and impl.holders(4, name="b") == [b"m"]


def test_a_set_is_never_granted_partially_and_later_waiters_stay_behind_it(impl):
    impl.acq(b"x", 0, name="b")
    assert _many(impl, b"m", 1, [("a", False), ("b", False)]) == impl.mod.QUEUED
    # a later single waiter on "a" queues behind the set even though "a" is free
    assert impl.acq(b"late", 2, name="a", wait=0) == impl.mod.NOT_ACQUIRED
    assert impl.acq(b"late", 2, name="a") == impl.mod.QUEUED
    impl.grants()
    impl.release(b"x", 3, name="b")
    assert [(g[0]) for g in impl.grants()] == [b"m", b"m"]
    assert impl.t.waiters("a") == [b"late"]


def test_two_overlapping_sets_in_opposite_order_do_not_deadlock(impl):
    impl.acq(b"x", 0, name="a", session=9)
    impl.grants()
    assert _many(impl, b"m1", 1, [("a", False), ("b", False)], session=1) == impl.mod.QUEUED
    assert _many(impl, b"m2", 2, [("b", False), ("a", False)], session=2) == impl.mod.QUEUED
    assert impl.t.break_deadlocks(3, 0) == []
    impl.release(b"x", 4, name="a")
    assert [g[0] for g in impl.grants()] == [b"m1", b"m1"]
    impl.release(b"m1", 5, name="a")
    assert impl.grants() == []  # m2 needs "b" too
    impl.release(b"m1", 6, name="b")
    assert [g[0] for g in impl.grants()] == [b"m2", b"m2"]


def test_a_timeout_or_a_cancel_withdraws_the_whole_set(impl):
    impl.acq(b"x", 0, name="b")
    assert _many(impl, b"m", 1, [("a", False), ("b", False)], wait=100) == impl.mod.QUEUED
    impl.t.drain_events()
    impl.t.expire(101)
    assert [(e.kind, e.name) for e in impl.t.drain_events()] == [
        (impl.mod.EV_WAIT_TIMEOUT, "a"), (impl.mod.EV_WAIT_TIMEOUT, "b")]
    assert impl.t.waiters("a") == [] and impl.t.waiters("b") == []
    assert _many(impl, b"n", 200, [("a", False), ("b", False)]) == impl.mod.QUEUED
    assert impl.t.cancel("b", b"n", 201)
    assert [(e.kind, e.name) for e in impl.t.drain_events()] == [
        (impl.mod.EV_WAIT_CANCELLED, "a"), (impl.mod.EV_WAIT_CANCELLED, "b")]
    assert impl.t.session_waiters(1) == 0 and impl.t.stats()["deadlines"] == 1  # x's lease only


def test_a_retry_keeps_the_sets_place_and_a_granted_set_is_re_delivered(impl):
    impl.acq(b"x", 0, name="a")
    items = [("a", False), ("b", True)]
    assert _many(impl, b"m", 1, items) == impl.mod.QUEUED
    impl.t.drain_events()
    assert _many(impl, b"m", 2, items, session=2) == impl.mod.QUEUED
    assert [e.kind for e in impl.t.drain_events()] == [impl.mod.EV_WAIT_CANCELLED] * 2
    assert impl.t.session_waiters(2) == 2 and impl.t.session_waiters(1) == 0
    impl.release(b"x", 3, name="a")
    tokens = [g[1] for g in impl.grants()]
    assert _many(impl, b"m", 4, items) == impl.mod.GRANTED
    evs = impl.t.drain_events()
    assert [(e.token, e.fresh) for e in evs] == [(tokens[0], False), (tokens[1], False)]


def test_an_owner_key_names_one_request(impl):
    impl.acq(b"m", 0, name="a")
    with pytest.raises(ValueError):
        _many(impl, b"m", 1, [("a", False), ("b", False)])  # holds "a" only
    impl.acq(b"x", 0, name="c")
    assert _many(impl, b"n", 1, [("c", False), ("d", False)]) == impl.mod.QUEUED
    with pytest.raises(ValueError):
        impl.acq(b"n", 2, name="c")  # a single acquire with a multi-lock's owner key
    with pytest.raises(ValueError):
        _many(impl, b"n", 2, [("c", False), ("e", False)])  # another set


def test_a_semaphore_name_cannot_be_in_a_set(impl):
    impl.acq(b"p", 0, name="s", limit=2)
    assert _many(impl, b"m", 1, [("a", False), ("s", False)]) == impl.mod.LIMIT_CONFLICT
    assert impl.t.waiters("a") == [] and impl.holders(1, name="a") == []


@pytest.mark.parametrize("items, exc", [
    ([], ValueError),
    ([("a", False)] * 2, ValueError),
    ([("a", 0)], TypeError),
    ([("a",)], TypeError),
    ("a", TypeError),
    ([("a", False)] * 65, ValueError),
])
def test_bad_sets_are_refused(impl, items, exc):
    with pytest.raises(exc):
        _many(impl, b"m", 0, items)
    assert impl.t.stats()["locks"] == 0


# -- the core's bounded deadlock search (the model searches whole) ---------------------------


def _break_until_found(t, now, max_work, calls=200):
    """Call break_deadlocks() until it breaks something (at most ``calls`` times): (cycles, calls made)."""
    for n in range(1, calls + 1):
        cycles = t.break_deadlocks(now, 0, max_work)
        if cycles:
            return cycles, n
        assert t.deadlock_backlog, "a search that found nothing and left nothing to do"
    raise AssertionError(f"no deadlock broken in {calls} calls")


def test_a_search_stops_at_its_work_bound_and_goes_on_at_the_next_call():
    impl = Impl(_core, _core.LockTable)
    _upgrade_deadlock(impl, 4)
    cycles, calls = _break_until_found(impl.t, 10, 1)  # one node per call
    assert calls > 1 and [c[0] for c in cycles] == [(4, "x")]  # the same victim as a whole search
    found = [c[0] for _ in range(100) for c in impl.t.break_deadlocks(10, 0, 1)]
    assert found == [(3, "x"), (2, "x")] and not impl.t.deadlock_backlog
    assert impl.t.waiters("x") == [b"w1"]
    assert impl.t.break_deadlocks(10, 0, 1) == [] and not impl.t.deadlock_backlog


def test_a_stopped_search_starts_again_when_waiters_change():
    impl = Impl(_core, _core.LockTable)
    _upgrade_deadlock(impl, 3)
    assert impl.t.break_deadlocks(10, 0, 2) == [] and impl.t.deadlock_backlog
    # a new waiter elsewhere changes the graph: the stopped search is not trusted, a new one runs
    assert _acq_as(impl, b"other", 11, "y", 9, 0) == impl.mod.GRANTED
    assert _acq_as(impl, b"w9", 11, "y", 8, 0) == impl.mod.QUEUED
    impl.t.drain_events()
    cycles, _ = _break_until_found(impl.t, 12, 2)
    assert [c[0] for c in cycles] == [(3, "x")]


def test_a_long_wait_chain_is_searched_a_bounded_slice_per_call():
    """2,000 parties in a chain (each holds one name and waits for the next one's), closed
    into a cycle: every call enters at most its bound of nodes, and the cycle is broken."""
    t = _core.LockTable()
    n = 2000
    for i in range(n):
        t.acquire(f"c{i}", b"h%d" % i, 1, 0, 60_000, 0, 0, None, 0, False, 0, i + 1)
    for i in range(n):
        assert t.acquire(f"c{(i + 1) % n}", b"w%d" % i, 1, 0, 60_000, -1, 0, None, 1, False, 0,
                         i + 1) == _core.QUEUED
    t.drain_events()
    cycles, calls = _break_until_found(t, 100, 500, calls=100)
    assert calls >= (3 * n) // 500  # a party, its request and a lock per step of the chain
    assert len(cycles) == 1 and len(cycles[0]) == n
    assert t.stats()["deadlocks"] == 1 and t.break_deadlocks(100, 0) == []


def test_a_deadlock_is_broken_while_waiters_change_between_every_call():
    """A search spread over many calls (2,000 other waiters, 100 steps per call) is not thrown
    away when waiters come and go between its calls: the deadlock is still broken."""
    impl = Impl(_core, _core.LockTable)
    t = impl.t
    for i in range(20):
        t.acquire(f"busy{i}", b"h%d" % i, 100 + i, 0, 60_000, 0, 0, None, 0)
    for k in range(2000):
        assert t.acquire(f"busy{k % 20}", b"q%d" % k, 200 + k, 0, 60_000, -1, 0, None, 0) == _core.QUEUED
    _cross(impl, (1, 0), (2, 0), (1, 0), (2, 0))
    t.drain_events()
    broken = []
    for call in range(200):
        # churn: one more waiter and one fewer, between every two calls
        assert t.acquire("busy0", b"churn%d" % call, 5000 + call, 0, 60_000, -1, 0, None, 10) == _core.QUEUED
        t.cancel("busy1", b"q%d" % (1 + 20 * call), 10)
        broken = t.break_deadlocks(10, 0, 100)
        if broken:
            break
    assert broken == [((2, "a"), (1, "b"))] and call > 5
    assert [e.owner for e in t.drain_events() if e.kind == _core.EV_DEADLOCK] == [b"a2"]
