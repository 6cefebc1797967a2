"""Property tests: the compiled LockTable and the reference model agree on every
random sequence of operations, and the invariants in docs/semantics.md hold.

A hypothesis RuleBasedStateMachine applies each random operation to both
tables and, after every step, compares return values, exception types, the
drained events (every field), holder(), waiters(), next_deadline(), counters,
stats() and check(); then checks mutual exclusion, strictly increasing fencing
tokens, FIFO hand-off and "only the holder releases" on the observed history.

Requests mix every kind: exclusive, shared (read) and semaphore permits (limits
2 and 3, so that LIMIT_CONFLICT is exercised too); the history check knows that
shared leases coexist, exclusive ones exclude everything, and permits never
exceed their limit.
"""

import copy
import os
import sys

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

sys.path.insert(0, os.path.dirname(__file__))

import refmodel

from fastlock import _core

NAMES = ["a", "b", "c"]
OWNERS = [b"o1", b"o2", b"o3", b"o4", b"o5"]
SESSIONS = [1, 2, 3]
TTLS = st.sampled_from([1, 5, 20, 100, 1_000])
WAITS = st.sampled_from([-1, 0, 1, 10, 50, 500])
DELAYS = st.sampled_from([0, 0, 0, 10, 200, refmodel.MAX_LOCK_DELAY_MS])
STEPS = st.sampled_from([0, 1, 3, 10, 50, 200])
JUMPS = st.sampled_from([0, 1, 5, 100, 1_000, 70_000])

# (shared, limit) of a request: exclusive, shared, or a permit of a 2- or 3-semaphore
KINDS = st.sampled_from([(False, 0), (False, 0), (True, 0), (True, 0), (False, 2), (False, 3)])

names = st.sampled_from(NAMES)
owners = st.sampled_from(OWNERS)
sessions = st.sampled_from(SESSIONS)
#: who waits within a session (deadlock detection's parties): 0 is the whole session
actors = st.sampled_from([0, 0, 1, 2])
#: a request's priority (0, the default, most often; MAX_PRIORITY the highest)
priorities = st.sampled_from([0, 0, 0, 1, 5, refmodel.MAX_PRIORITY])


def _event(e):
    return (e.kind, e.name, e.token, e.owner, e.session, e.request, e.ttl_ms, e.deadline_ms, e.meta, e.fresh,
            e.lock_delay_ms, e.waited_ms, e.shared, e.limit, e.cycle)


def _holder(h):
    if h is None:
        return None
    return (h.name, h.token, h.owner, h.session, h.ttl_ms, h.deadline_ms, h.lock_delay_ms, h.meta, h.shared,
            h.limit)


def _call(obj, method, *args):
    try:
        value = getattr(obj, method)(*args)
    except Exception as exc:  # noqa: BLE001 - any error is an outcome, compared by type name (both modules)
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
        # the leases the history says are current: name -> {token: [deadline_ms, shared, limit]}
        self.lease = {}
        self.many = {}  # request id -> the names of an acquire_many() request

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
        holders_due = {n: probe.holders_of(n, self.now) for n in NAMES}
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
        if method in ("release", "release_to") and result[0] == "ok":
            # only a holder can release: (token, owner) was an unexpired holder
            name, token, owner = args[:3]
            assert (token, owner) in [(h.token, h.owner) for h in holders_due[name]]
            del self.lease[name][token]
        if method == "remove_holder" and result == ("ok", True):
            assert args[1] in [h.token for h in holders_due[args[0]]]
            del self.lease[args[0]][args[1]]
        self.follow(own_events, granted)
        if method == "install_holder" and result[0] == "ok":
            name, token, owner = args[0], args[1], args[2]
            shared, limit = args[7], args[8]
            current = self.lease.setdefault(name, {})
            for h in holders_due[name]:  # what the install replaces
                if not (shared or limit) or not (h.shared or h.limit) or h.owner == owner or h.limit != limit:
                    current.pop(h.token, None)
            current[token] = [self.now + args[3], shared, limit]
            self.max_token = max(self.max_token, token)
        if method == "extend" and result[0] == "ok":
            self.lease[args[0]][args[1]][0] = result[1]
        left = {(e[1], e[3]) for e in due_events + own_events
                if e[0] in (refmodel.EV_WAIT_TIMEOUT, refmodel.EV_WAIT_CANCELLED, refmodel.EV_DEADLOCK)}
        if method == "release_to" and result[0] == "ok":
            # the chosen waiter is granted first, then queue order goes on
            name, chosen = args[0], args[3]
            assert granted.get(name, [chosen])[0] == chosen or self.model.waiters(name)[:1] == [chosen]
            queues_before[name] = [chosen] + [o for o in queues_before[name] if o != chosen]
        self.check_fifo(granted, queues_before, left)
        self.check_all_or_nothing(due_events + own_events)

    def check_all_or_nothing(self, events):
        """A multi-lock request is granted every name in one step, or none."""
        names = {}
        for e in events:
            if e[0] == refmodel.EV_GRANTED and e[5] in self.many:
                names.setdefault((e[5], e[9]), []).append(e[1])
        for (request, _fresh), got in names.items():
            assert sorted(got) == sorted(self.many[request]), (request, got, self.many[request])

    def follow(self, events, granted):
        """Replay events on the lease history: mutual exclusion and increasing tokens."""
        for kind, name, token, owner, _s, _r, _ttl, deadline, _m, fresh, _d, _w, shared, limit, cycle in events:
            current = self.lease.setdefault(name, {})
            if kind == refmodel.EV_EXPIRED:
                cur = current.pop(token)
                assert cur == [deadline, shared, limit]
                assert deadline <= self.now
            elif kind == refmodel.EV_GRANTED and fresh:
                others = list(current.values())
                if not (shared or limit):
                    # an exclusive lease: every earlier lease on this name has ended
                    assert not others, (name, current, token)
                elif limit:
                    # a permit: fewer than `limit` permits, and nothing else, are held
                    assert all(o[2] == limit for o in others) and len(others) < limit, (name, current)
                else:
                    # a shared lease: only shared leases are held
                    assert all(o[1] for o in others), (name, current)
                current[token] = [deadline, shared, limit]
                # tokens strictly increase, globally and so per lock
                assert token > self.max_token
                self.max_token = token
                self.fresh_tokens.append(token)
                granted.setdefault(name, []).append(owner)
            elif kind == refmodel.EV_GRANTED:
                assert token in current
            elif kind == refmodel.EV_DEADLOCK:
                # the failed waiter's own step comes first (a multi-lock request fails on every
                # name with the cycle through one of them), and every step is a real session
                assert cycle[0][0] == _s and all(s in SESSIONS for s, _ in cycle)
                assert cycle[0][1] == name or cycle[0][1] in self.many[_r]

    def check_fifo(self, granted, queues_before, left):
        for name, owners_granted in granted.items():
            before = queues_before[name]
            from_queue = [o for o in owners_granted if o in before]
            # FIFO: grants from the queue come in queue order ...
            assert from_queue == sorted(from_queue, key=before.index)
            # ... and nobody still waiting was overtaken (an owner whose request left the
            # queue during the call and who queued again is a new waiter)
            still = [o for o in self.model.waiters(name) if o in before and (name, o) not in left]
            for o in from_queue:
                for s in still:
                    assert before.index(o) < before.index(s), (name, before, o, s)

    # -- rules -------------------------------------------------------------------------
    # (hypothesis picks rules uniformly: the common operations get several rules)

    @rule(name=names, owner=owners, session=sessions, ttl=TTLS, wait=WAITS, delay=DELAYS,
          meta=st.sampled_from([None, 1, "m"]), kind=KINDS, actor=actors, priority=priorities)
    def acquire(self, name, owner, session, ttl, wait, delay, meta, kind, actor, priority):
        self.request_id += 1
        self.both("acquire", name, owner, session, self.request_id, ttl, wait, delay, meta, self.now, *kind,
                  actor, priority)

    @rule(name=names, owner=owners, session=sessions, ttl=TTLS, wait=st.sampled_from([-1, 100, 1_000]),
          kind=KINDS)
    def acquire_and_wait(self, name, owner, session, ttl, wait, kind):
        self.request_id += 1
        self.both("acquire", name, owner, session, self.request_id, ttl, wait, 0, None, self.now, *kind)

    @rule(items=st.lists(st.tuples(names, st.booleans()), min_size=1, max_size=3,
                         unique_by=lambda item: item[0]),
          owner=owners, session=sessions, ttl=TTLS, wait=WAITS, delay=DELAYS, actor=actors)
    def acquire_many(self, items, owner, session, ttl, wait, delay, actor):
        self.request_id += 1
        self.many[self.request_id] = [name for name, _ in items]
        self.both("acquire_many", items, owner, session, self.request_id, ttl, wait, delay, None, self.now,
                  actor)

    @rule(name=names, owner=owners, session=sessions, ttl=TTLS, wait=st.sampled_from([-1, 0, 100]))
    def acquire_exclusive_positional(self, name, owner, session, ttl, wait):
        """The server's call shape: nine positional arguments, an exclusive lock."""
        self.request_id += 1
        self.both("acquire", name, owner, session, self.request_id, ttl, wait, 0, None, self.now)

    @precondition(lambda self: self.model.holders())
    @rule(data=st.data())
    def release_by_holder(self, data):
        h = data.draw(st.sampled_from(sorted(self.model.holders(), key=lambda h: h.name)))
        self.both("release", h.name, h.token, h.owner, self.now)

    @rule(name=names, which=st.sampled_from(["right", "right", "old", "wrong_owner"]), owner=owners,
          to=owners)
    def release_to(self, name, which, owner, to):
        """A directed hand-off: the holder releases to a chosen waiter (or a bad one)."""
        token, owner = self._token_owner(name, which, owner)
        waiting = self.model.waiters(name)
        pick = to if to not in waiting or len(waiting) < 2 else waiting[-1]
        self.both("release_to", name, token, owner, pick, self.now)

    @rule(name=names, which=st.sampled_from(["right", "old", "next", "wrong_owner"]), owner=owners)
    def release(self, name, which, owner):
        token, owner = self._token_owner(name, which, owner)
        self.both("release", name, token, owner, self.now)

    @rule(name=names, which=st.sampled_from(["right", "right", "right", "old", "wrong_owner"]), owner=owners,
          ttl=TTLS, session=st.one_of(st.none(), sessions))
    def extend(self, name, which, owner, ttl, session):
        token, owner = self._token_owner(name, which, owner)
        self.both("extend", name, token, owner, ttl, self.now, *([] if session is None else [session]))

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
          new_epoch=st.booleans(), lower=st.booleans(), kind=KINDS)
    def install_holder(self, name, owner, ttl, delay, bump, new_epoch, lower, kind):
        # install_holder() first processes what is due at now, and the grants of that phase
        # take fresh tokens; a real log's install record never repeats a token issued before
        # it, so the token is chosen from the table as it stands after that phase
        after = copy.deepcopy(self.model)
        after.expire(self.now)
        held = {h.token for h in after.holders()}
        last = self.tokens_seen[-1]
        if lower and last & refmodel.MAX_COUNTER and (kind == (False, 0) or last not in held):
            token = self.tokens_seen[-1]  # replay of an older record
        else:
            epoch = after.epoch + (1 if new_epoch else 0)
            token = (epoch << 40) | (after.counter + bump)
        self.both("install_holder", name, token, owner, ttl, delay, "installed", self.now, *kind)

    @rule(name=names, right=st.booleans())
    def remove_holder(self, name, right):
        h = self.model.holder(name, self.now)
        token = h.token if (right and h is not None) else self.model.last_token + 1
        self.both("remove_holder", name, token, self.now)

    @rule(who=st.permutations(OWNERS), where=st.permutations(NAMES), s=st.permutations(SESSIONS),
          shared=st.booleans(), acts=st.lists(actors, min_size=4, max_size=4))
    def cross_wait(self, who, where, s, shared, acts):
        """Two sessions each take one name and then wait for the other's: a likely deadlock
        (unless the actors say the holder is not the waiter)."""
        for owner, name, session, kind, actor in (
                (who[0], where[0], s[0], False, acts[0]), (who[1], where[1], s[1], shared, acts[1]),
                (who[2], where[1], s[0], False, acts[2]), (who[3], where[0], s[1], False, acts[3])):
            self.request_id += 1
            self.both("acquire", name, owner, session, self.request_id, 1_000, -1, 0, None, self.now, kind, 0,
                      actor)

    @rule(min_wait=st.sampled_from([0, 0, 10, 100]))
    def break_deadlocks(self, min_wait):
        result = self.both("break_deadlocks", self.now, min_wait)
        # after breaking, no cycle is left
        assert len(result[1]) >= refmodel.DEADLOCK_PASSES or not self.model.has_deadlock(self.now, min_wait)
        assert result[0] == "ok"

    @rule(name=names, delta=st.sampled_from([-10, 0, 1, 40, 500]))
    def install_lock_delay(self, name, delta):
        self.both("install_lock_delay", name, max(0, self.now + delta), self.now)

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
        ("release_to", "a", 1, b"o1", "o2"),                         # to_owner not bytes
    ]))
    def bad_arguments(self, bad):
        method, *args = bad
        result = self.both(method, *args, self.now)
        assert result[0] == "raised" and result[1] in ("TypeError", "ValueError")

    @rule(bad=st.sampled_from([
        [],                              # no names
        [("a", False), ("a", True)],     # a name twice
        [("a", 1)],                      # shared not a bool
        [("", False)],                   # empty name
        ["a"],                           # not a pair
        "a",                             # not a list
    ]))
    def bad_many(self, bad):
        result = self.both("acquire_many", bad, b"o1", 1, None, 10, -1, 0, None, self.now)
        assert result[0] == "raised" and result[1] in ("TypeError", "ValueError")

    @rule(bad=st.sampled_from([
        (1, 0),          # shared not a bool
        (False, -1),     # negative limit
        (True, 2),       # shared and a limit
        (False, 1 << 31),
        (False, 2.0),
    ]))
    def bad_kind(self, bad):
        result = self.both("acquire", "a", b"o1", 1, None, 10, -1, 0, None, self.now, *bad)
        assert result[0] == "raised" and result[1] in ("TypeError", "ValueError")

    @rule(bad=st.sampled_from([-1, refmodel.MAX_PRIORITY + 1, 1.0, True, "1"]))
    def bad_priority(self, bad):
        result = self.both("acquire", "a", b"o1", 1, None, 10, -1, 0, None, self.now, False, 0, 0, bad)
        assert result[0] == "raised" and result[1] in ("TypeError", "ValueError")

    # -- invariants after every step ------------------------------------------------------

    @invariant()
    def same_observable_state(self):
        c, m, now = self.core, self.model, self.now
        for name in NAMES:
            assert _holder(c.holder(name, now)) == _holder(m.holder(name, now)), name
            assert [_holder(h) for h in c.holders_of(name, now)] == [_holder(h) for h in m.holders_of(name, now)]
            for owner in OWNERS[:3]:
                assert _holder(c.holder(name, now, owner)) == _holder(m.holder(name, now, owner))
            assert c.waiters(name) == m.waiters(name), name
            assert c.waiter_priorities(name) == m.waiter_priorities(name), name
            assert c.holder_priority(name) == m.holder_priority(name), name
            for h in m.holders_of(name, now):
                assert c.check(name, h.token, now) and m.check(name, h.token, now)
                assert not c.check(name, self.model.last_token + 1, now)
        for s in SESSIONS:
            assert c.session_waiters(s) == m.session_waiters(s)
        assert c.next_deadline() == m.next_deadline()
        assert (c.last_token, c.epoch, c.counter) == (m.last_token, m.epoch, m.counter)
        assert c.stats() == m.stats()
        assert len(c) == len(m)
        assert sorted(map(_holder, c.holders())) == sorted(map(_holder, m.holders()))
        assert sorted(c.lock_delays()) == sorted(m.lock_delays())
        token = c.last_token
        if token != self.tokens_seen[-1]:
            self.tokens_seen.append(token)

    @invariant()
    def waited_names_agree(self):
        # the names with waiters (a slot move takes their waiters out), all or those without a lease
        c, m = self.core, self.model
        for select in (None, lambda name: name != "b"):
            for unheld in (False, True):
                assert c.waited_names(select, unheld) == m.waited_names(select, unheld), (unheld,)
        assert c.waited_names() == [n for n in NAMES if m.waiters(n)]
        assert c.waited_names(None, True) == [n for n in NAMES if m.waiters(n) and m.locks[n].holder is None
                                              and not m.locks[n].shared]

    @invariant()
    def holders_agree_with_the_history(self):
        # every unexpired holder the table reports is a lease the history says is current
        for name in NAMES:
            for h in self.model.holders_of(name, self.now):
                assert self.lease[name][h.token] == [h.deadline_ms, h.shared, h.limit]

    @invariant()
    def queue_by_priority(self):
        # highest priority first (a waiter a directed hand-off put first while grants are
        # held takes the head's priority)
        for name in NAMES:
            prios = [p for _, p in self.model.waiter_priorities(name)]
            assert prios == sorted(prios, reverse=True), (name, prios)

    @invariant()
    def fresh_tokens_strictly_increase(self):
        assert all(a < b for a, b in zip(self.fresh_tokens, self.fresh_tokens[1:]))

    @invariant()
    def unheld_lock_with_waiters_is_blocked(self):
        # a free lock never keeps a waiter waiting unless lock-delay or the grant hold says so
        for name in NAMES:
            if self.model.waiters(name) and self.model.holder(name, self.now) is None:
                lock = self.model.locks[name]
                if lock.holder is None and not lock.shared and lock.waiters[0].group is None:
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
