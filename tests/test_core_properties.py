"""Property tests: the compiled LockTable and the reference model agree on every
random sequence of operations, and the invariants in README.md "Semantics" hold.

A hypothesis RuleBasedStateMachine applies each random operation to both
tables and, after every step, compares return values, exception types, the
drained events (every field), holder(), waiters(), next_deadline(), counters,
stats() and check(); then checks mutual exclusion, strictly increasing fencing
tokens, FIFO hand-off and "only the holder releases" on the observed history.
"""

import copy
import os
import sys

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

sys.path.insert(0, os.path.dirname(__file__))

import refmodel  # noqa: E402
from fastlock import _core  # noqa: E402

NAMES = ["a", "b", "c"]
OWNERS = [b"o1", b"o2", b"o3", b"o4", b"o5"]
SESSIONS = [1, 2, 3]
TTLS = st.sampled_from([1, 5, 20, 100, 1_000])
WAITS = st.sampled_from([-1, 0, 1, 10, 50, 500])
DELAYS = st.sampled_from([0, 0, 0, 10, 200, refmodel.MAX_LOCK_DELAY_MS])
STEPS = st.sampled_from([0, 1, 3, 10, 50, 200])
JUMPS = st.sampled_from([0, 1, 5, 100, 1_000, 70_000])

names = st.sampled_from(NAMES)
owners = st.sampled_from(OWNERS)
sessions = st.sampled_from(SESSIONS)


def _event(e):
    return (e.kind, e.name, e.token, e.owner, e.session, e.request, e.ttl_ms, e.deadline_ms, e.meta, e.fresh,
            e.lock_delay_ms, e.waited_ms)


def _holder(h):
    if h is None:
        return None
    return (h.name, h.token, h.owner, h.session, h.ttl_ms, h.deadline_ms, h.lock_delay_ms, h.meta)


def _call(obj, method, *args):
    try:
        value = getattr(obj, method)(*args)
    except Exception as exc:  # compared by type name: NotHolder exists in both modules
        return ("raised", type(exc).__name__)
    if isinstance(value, list):
        value = [_event(v) if hasattr(v, "fresh") else v for v in value]
    elif hasattr(value, "lock_delay_ms"):
        value = _holder(value)
    return ("ok", value)


class CoreVsModel(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.core = _core.LockTable()
        self.model = refmodel.RefLockTable()
        self.now = 0
        self.request_id = 0
        self.max_token = 0  # highest token ever issued or installed
        self.tokens_seen = [0]
        self.fresh_tokens = []  # every fresh grant, in order
        # history of leases per name for mutual exclusion: (token, deadline, ended)
        self.lease = {}  # name -> [token, deadline_ms] of the lease the history says is current

    # -- driving both tables ---------------------------------------------------------

    def both(self, method, *args):
        """Apply one operation to both tables; they must answer alike."""
        queues_before = {n: self.model.waiters(n) for n in NAMES}
        # Every call first processes what is due at now; a probe copy of the model tells
        # which of the call's events come from that phase and who holds what after it.
        probe = copy.deepcopy(self.model)
        if method not in ("hold_grants_until", "set_epoch", "advance_counter"):
            probe.expire(self.now)
        due = len(probe.drain_events())
        holders_due = {n: probe.holder(n, self.now) for n in NAMES}
        a = _call(self.core, method, *args)
        b = _call(self.model, method, *args)
        assert a == b, (method, args, a, b)
        ev_a = [_event(e) for e in self.core.drain_events()]
        ev_b = [_event(e) for e in self.model.drain_events()]
        assert ev_a == ev_b, (method, args, ev_a, ev_b)
        self.check_history(method, args, a, ev_a[:due], ev_a[due:], queues_before, holders_due)
        return a

    def check_history(self, method, args, result, due_events, own_events, queues_before, holders_due):
        granted = {}
        self.follow(due_events, granted)
        if method == "release" and result[0] == "ok":
            # only the holder can release: (token, owner) was the unexpired holder
            name, token, owner, _ = args
            h = holders_due[name]
            assert h is not None and (h.token, h.owner) == (token, owner)
            del self.lease[name]
        if method == "remove_holder" and result == ("ok", True):
            assert holders_due[args[0]].token == args[1]
            del self.lease[args[0]]
        self.follow(own_events, granted)
        if method == "install_holder" and result[0] == "ok":
            name, token = args[0], args[1]
            self.lease[name] = [token, self.now + args[3]]
            self.max_token = max(self.max_token, token)
        if method == "extend" and result[0] == "ok":
            self.lease[args[0]][1] = result[1]
        self.check_fifo(granted, queues_before)

    def follow(self, events, granted):
        """Replay events on the lease history: mutual exclusion and increasing tokens."""
        for kind, name, token, owner, _s, _r, _ttl, deadline, _m, fresh, _d, _w in events:
            if kind == refmodel.EV_EXPIRED:
                cur = self.lease.pop(name)
                assert cur == [token, deadline]
                assert deadline <= self.now
            elif kind == refmodel.EV_GRANTED and fresh:
                # mutual exclusion: the previous lease on this name has ended
                assert name not in self.lease, (name, self.lease[name], token)
                self.lease[name] = [token, deadline]
                # tokens strictly increase, globally and so per lock
                assert token > self.max_token
                self.max_token = token
                self.fresh_tokens.append(token)
                granted.setdefault(name, []).append(owner)
            elif kind == refmodel.EV_GRANTED:
                assert self.lease[name][0] == token

    def check_fifo(self, granted, queues_before):
        for name, owners_granted in granted.items():
            before = queues_before[name]
            from_queue = [o for o in owners_granted if o in before]
            # FIFO: grants from the queue come in queue order ...
            assert from_queue == sorted(from_queue, key=before.index)
            # ... and nobody still waiting was overtaken
            still = [o for o in self.model.waiters(name) if o in before]
            for o in from_queue:
                for s in still:
                    assert before.index(o) < before.index(s), (name, before, o, s)

    # -- rules -------------------------------------------------------------------------
    # (hypothesis picks rules uniformly: the common operations get several rules)

    @rule(name=names, owner=owners, session=sessions, ttl=TTLS, wait=WAITS, delay=DELAYS,
          meta=st.sampled_from([None, 1, "m"]))
    def acquire(self, name, owner, session, ttl, wait, delay, meta):
        self.request_id += 1
        self.both("acquire", name, owner, session, self.request_id, ttl, wait, delay, meta, self.now)

    @rule(name=names, owner=owners, session=sessions, ttl=TTLS, wait=st.sampled_from([-1, 100, 1_000]))
    def acquire_and_wait(self, name, owner, session, ttl, wait):
        self.request_id += 1
        self.both("acquire", name, owner, session, self.request_id, ttl, wait, 0, None, self.now)

    @precondition(lambda self: self.model.holders())
    @rule(data=st.data())
    def release_by_holder(self, data):
        h = data.draw(st.sampled_from(sorted(self.model.holders(), key=lambda h: h.name)))
        self.both("release", h.name, h.token, h.owner, self.now)

    @rule(name=names, which=st.sampled_from(["right", "old", "next", "wrong_owner"]), owner=owners)
    def release(self, name, which, owner):
        token, owner = self._token_owner(name, which, owner)
        self.both("release", name, token, owner, self.now)

    @rule(name=names, which=st.sampled_from(["right", "right", "right", "old", "wrong_owner"]), owner=owners,
          ttl=TTLS)
    def extend(self, name, which, owner, ttl):
        token, owner = self._token_owner(name, which, owner)
        self.both("extend", name, token, owner, ttl, self.now)

    def _token_owner(self, name, which, owner):
        h = self.model.holder(name, self.now)
        if which == "right" and h is not None:
            return h.token, h.owner
        if which == "wrong_owner" and h is not None:
            return h.token, owner
        if which == "next":
            return self.model.last_token + 1, owner
        return self.tokens_seen[len(self.tokens_seen) // 2], owner

    @precondition(lambda self: any(lock.waiters for lock in self.model.locks.values()))
    @rule(data=st.data())
    def cancel_waiter(self, data):
        queued = sorted((n, w.owner) for n, lock in self.model.locks.items() for w in lock.waiters)
        name, owner = data.draw(st.sampled_from(queued))
        self.both("cancel", name, owner, self.now)

    @rule(name=names, owner=owners)
    def cancel(self, name, owner):
        self.both("cancel", name, owner, self.now)

    @rule(session=sessions)
    def drop_session(self, session):
        self.both("drop_session", session, self.now)

    @rule(dt=STEPS)
    def tick(self, dt):
        """Time passes; the next operation processes what fell due."""
        self.now += dt

    @rule(dt=JUMPS)
    def expire(self, dt):
        self.now += dt
        self.both("expire", self.now)

    @precondition(lambda self: self.model.next_deadline() > self.now)
    @rule(offset=st.sampled_from([-1, 0, 0, 1]))
    def to_next_deadline(self, offset):
        """Land exactly on (or next to) the earliest deadline: boundary cases."""
        self.now = max(self.now, self.model.next_deadline() + offset)
        self.both("expire", self.now)

    @rule(name=names, owner=owners, ttl=TTLS, delay=DELAYS, bump=st.sampled_from([1, 2, 50]),
          new_epoch=st.booleans(), lower=st.booleans())
    def install_holder(self, name, owner, ttl, delay, bump, new_epoch, lower):
        if lower and self.tokens_seen[-1] & refmodel.MAX_COUNTER:
            token = self.tokens_seen[-1]  # replay of an older record
        else:
            epoch = self.model.epoch + (1 if new_epoch else 0)
            token = (epoch << 40) | (self.model.counter + bump)
        self.both("install_holder", name, token, owner, ttl, delay, "installed", self.now)

    @rule(name=names, right=st.booleans())
    def remove_holder(self, name, right):
        h = self.model.holder(name, self.now)
        token = h.token if (right and h is not None) else self.model.last_token + 1
        self.both("remove_holder", name, token, self.now)

    @rule(delta=st.sampled_from([-50, 0, 30, 300, 2_000]))
    def hold_grants_until(self, delta):
        self.both("hold_grants_until", max(0, self.now + delta))

    @rule(which=st.sampled_from(["set_epoch", "advance_counter"]), delta=st.sampled_from([-1, 0, 0, 1, 2]))
    def fencing(self, which, delta):
        current = self.model.epoch if which == "set_epoch" else self.model.counter
        self.both(which, current + delta)

    @rule(bad=st.sampled_from([
        ("acquire", "a", b"o1", 1, None, 0, -1, 0, None),            # ttl 0
        ("acquire", "a", b"o1", 1, None, 10, -1, 60_001, None),      # lock-delay too long
        ("acquire", "a", "o1", 1, None, 10, -1, 0, None),            # owner not bytes
        ("acquire", "a", b"o1", 1, None, 10, 1.5, 0, None),          # float wait
        ("acquire", "a", b"o1", 1, None, True, 0, 0, None),          # bool ttl
        ("release", "a", -1, b"o1"),
        ("extend", "a", 1, b"o1", 0),
        ("cancel", 3, b"o1"),
    ]))
    def bad_arguments(self, bad):
        method, *args = bad
        result = self.both(method, *args, self.now)
        assert result[0] == "raised" and result[1] in ("TypeError", "ValueError")

    # -- invariants after every step ------------------------------------------------------

    @invariant()
    def same_observable_state(self):
        c, m, now = self.core, self.model, self.now
        for name in NAMES:
            assert _holder(c.holder(name, now)) == _holder(m.holder(name, now)), name
            assert c.waiters(name) == m.waiters(name), name
            h = m.holder(name, now)
            if h is not None:
                assert c.check(name, h.token, now) and m.check(name, h.token, now)
                assert not c.check(name, h.token + 1, now)
        for s in SESSIONS:
            assert c.session_waiters(s) == m.session_waiters(s)
        assert c.next_deadline() == m.next_deadline()
        assert (c.last_token, c.epoch, c.counter) == (m.last_token, m.epoch, m.counter)
        assert c.stats() == m.stats()
        assert len(c) == len(m)
        assert sorted(map(_holder, c.holders())) == sorted(map(_holder, m.holders()))
        token = c.last_token
        if token != self.tokens_seen[-1]:
            self.tokens_seen.append(token)

    @invariant()
    def at_most_one_unexpired_holder_per_lock(self):
        # the table has one holder slot per name; the history must agree with it
        for name in NAMES:
            h = self.model.holder(name, self.now)
            if h is not None:
                assert self.lease.get(name) == [h.token, h.deadline_ms]

    @invariant()
    def fresh_tokens_strictly_increase(self):
        assert all(a < b for a, b in zip(self.fresh_tokens, self.fresh_tokens[1:]))

    @invariant()
    def unheld_lock_with_waiters_is_blocked(self):
        # a free lock never keeps a waiter waiting unless lock-delay or the grant hold says so
        for name in NAMES:
            if self.model.waiters(name) and self.model.holder(name, self.now) is None:
                lock = self.model.locks[name]
                if lock.holder is None:
                    assert lock.block is not None
                    assert self.now < max(lock.delay_until, self.model.hold_until) or \
                        lock.block.deadline <= self.now


CoreVsModel.TestCase.settings = settings(
    max_examples=int(os.environ.get("FASTLOCK_PROPERTY_EXAMPLES", "200")),
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestCoreVsModel = CoreVsModel.TestCase
