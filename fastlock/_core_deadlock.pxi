# Deadlock detection of the lock table (included by fastlock/_core.pyx).

cdef class _DeadlockDetection(_Recovery):
    """Deadlock detection on the wait-for graph of parties ``(session, actor)``: bounded
    searches for its strongly connected components (Tarjan's algorithm), one request failed
    per deadlock (see :meth:`break_deadlocks`)."""
    cdef int64_t _searches       # deadlock searches made (numbers _Node.dl_search)
    cdef int64_t _search_nodes   # nodes the last deadlock search visited
    cdef _Search _dl_search      # a search stopped at its work bound, or None

    cdef Py_ssize_t _find_holders(self, _Search sr, Py_ssize_t budget) except -1:
        """Add to ``sr.holders`` the parties ``(session, actor)`` (session 0 left out)
        holding a lease of a name one of ``sr.pending`` waits for - only a lock leads to a
        party in the wait-for graph, so no other party is in a cycle.  Allocates only per
        name.  Stops after ``budget`` waiters (at least one); returns the waiters looked at."""
        cdef Py_ssize_t done = 0
        cdef Py_ssize_t n = len(sr.pending)
        cdef dict holders = sr.holders
        cdef int64_t search = sr.search
        cdef _Waiter w
        cdef _Lock lock
        cdef _Lease lease
        while sr.j < n:
            if done >= budget and done > 0:
                return done
            w = <_Waiter>sr.pending[sr.j]
            sr.j += 1
            done += 1
            lock = w.lock
            if lock is None or lock.dl_mark == search:  # (gone since the search began)
                continue
            lock.dl_mark = search
            if lock.held:
                if lock.session:
                    holders[(lock.session, lock.actor)] = None
            elif lock.n_leases:
                for lease in lock.leases.values():
                    if lease.session:
                        holders[(lease.session, lease.actor)] = None
        return done

    cdef int _restart_search(self, _Search sr) except -1:
        """Start ``sr``'s graph search again (a new search number) from the party it was
        searching from, its parties keeping only their requests still waiting as theirs."""
        cdef _Party p
        cdef _Waiter w
        cdef dict parties = {}
        current = sr.keys[(sr.start + sr.i) % len(sr.keys)] if sr.keys and sr.i >= 0 else None
        for key, p in sr.parties.items():
            kept = []
            for req in p.requests:
                w = <_Waiter>req if type(req) is _Waiter else <_Waiter>(<_Group>req).members[0]
                if w.lock is not None and w.session == p.session and w.actor == p.actor:
                    kept.append(req)
            if kept:
                p.requests = kept
                p.ordered = False
                parties[key] = p
        self._searches += 1
        sr.search = self._searches
        sr.parties = parties
        sr.keys = list(parties)
        sr.start = 0
        if current is not None and current in parties:
            sr.start = sr.keys.index(current)
        sr.i = -1
        sr.stack = []
        sr.path = []
        sr.todo = []
        sr.positions = []
        sr.counter = 0
        sr.n_comp = 0
        return 0

    cdef Py_ssize_t _make_parties(self, _Search sr, Py_ssize_t budget) except -1:
        """Make the search's parties from ``sr.pending``: each holder party with a request
        waiting at least ``min_wait`` ms on a lock (not a semaphore).  Stops after
        ``budget`` waiters (at least one); returns the waiters looked at."""
        cdef Py_ssize_t done = 0
        cdef Py_ssize_t n = len(sr.pending)
        cdef _Waiter w
        cdef _Party p
        while sr.j < n:
            if done >= budget and done > 0:
                return done
            w = <_Waiter>sr.pending[sr.j]
            sr.j += 1
            done += 1
            if w.lock is None or w.lock.limit or sr.t - w.enqueued_ms < sr.min_wait:
                continue  # (gone since the search began, a semaphore wait, or too young)
            key = (w.session, w.actor)
            if key not in sr.holders:
                continue
            if w.group is None:
                req = w
            elif w is (<_Group>w.group).members[0]:  # a multi-lock once, by its first waiter
                req = w.group
            else:
                continue
            p = <_Party>sr.parties.get(key)
            if p is None:
                p = _Party.__new__(_Party)
                p.session = w.session
                p.actor = w.actor
                p.requests = [req]
                sr.parties[key] = p
            else:
                p.requests.append(req)
        return done

    @property
    def deadlock_backlog(self):
        """True while a deadlock search stopped at its call's ``max_work`` with parties
        left to search from: the next break_deadlocks() call goes on from there."""
        return self._dl_search is not None

    def party_waits(self, session, actor, limit=64):
        """What party ``(session, actor)`` waits for here, for deadlock detection across
        servers (:mod:`fastlock.server.edgechase`): ``(latest, parties)`` where ``latest``
        is the greatest ``enqueued_ms`` of its waiting requests on locks (-1: none; a
        semaphore's wait, which any one holder can end, is left out as in
        :meth:`break_deadlocks`) and ``parties`` the distinct ``(session, actor)`` pairs
        (session 0 left out) that hold a conflicting lease of, or wait ahead of it on, a
        name it waits for: at most ``limit`` (int >= 0) pairs, the holders first."""
        cdef int64_t s = _session(session)
        cdef int64_t a = actor
        cdef Py_ssize_t most = limit
        cdef dict sess = self._sessions.get(s)
        cdef dict out = {}
        cdef int64_t latest = -1
        cdef _Waiter w, ahead
        cdef _Lock lock
        cdef _Lease lease
        if sess is None:
            return (-1, [])
        for w in sess:
            lock = w.lock
            if w.actor != a or lock is None or lock.limit:
                continue
            if w.enqueued_ms > latest:
                latest = w.enqueued_ms
            if lock.held:
                if lock.session and len(out) < most:
                    out[(lock.session, lock.actor)] = None
            elif lock.n_leases and not w.shared:
                for lease in lock.leases.values():
                    if lease.session and len(out) < most:
                        out[(lease.session, lease.actor)] = None
            ahead = w.prev
            while ahead is not None and len(out) < most:
                if ahead.session:
                    out[(ahead.session, ahead.actor)] = None
                ahead = ahead.prev
        out.pop((s, a), None)
        return (latest, list(out))

    def break_deadlocks(self, now, min_wait_ms, max_work=DEADLOCK_WORK):
        """Find and break deadlocks among waiters; returns the cycles broken (a list of
        tuples of ``(session, name)`` steps, as ``Event.cycle``).

        Parties: a request's party is ``(session, actor)`` (acquire()'s ``actor``: a
        client's task or thread; 0 stands for the whole session), and a lease's
        holder is the party of the request it was granted to.  A party that waits
        is blocked: it releases nothing until its wait ends.  The wait-for graph
        has a node per party, per waiting request and per lock (its holders), and
        edges, each O(1) per waiter or holder:

        * party -> each of its requests waiting at least ``min_wait_ms`` (ms since
          the request it answers arrived: PostgreSQL's ``deadlock_timeout``);
        * request -> for each of its waiters (one per name of a multi-lock): the
          request of the waiter just ahead in that queue (FIFO: granted first),
          and the lock if a holder conflicts (any holder for an exclusive waiter,
          the exclusive holder for a shared one);
        * lock -> the party of each holder (session 0, installed holders, is
          unknown and left out).

        Semaphore waiters are left out (a permit waits for ANY holder, so a cycle
        through one is not a deadlock).  A deadlock is a strongly connected
        component (Tarjan's algorithm, iterative) holding at least two parties: a
        party waiting only for itself (two tasks of one session, one holding and
        one waiting) is not one.  In each such component the youngest request of
        one of its parties that lies in the component (latest arrival, then
        greatest name, then owner) is failed: it leaves its queues with
        EV_DEADLOCK (one event per waiter) and its locks are settled.  Its
        ``cycle`` is the shortest path (breadth first, successors in the order
        above; a party's requests ascending, a lock's parties ascending) from
        the failed request back to its party: one ``(session, name)`` step per
        party on it, starting with the failed request's.  Victims are failed in
        ascending age order.  This is repeated while it finds a deadlock, at
        most DEADLOCK_PASSES times per call, and only while the searches so far
        made fewer than ``max_work`` (int >= 0) steps; a later call finds what
        is left.

        Bounded work: a search starts only from the parties that can be in a
        cycle - those with a request waiting at least ``min_wait_ms`` that hold
        a lease of a name somebody waits for (every other party has no edge
        into it) - and a call makes at most ``max_work`` steps (at least one):
        a step is a waiter looked at (every waiter once, to find the names
        waited for and their holders, allocating only per name; then the
        waiters of the holders' sessions, to make the parties) or a node of
        the graph entered or left.  A search that reaches the bound stops and
        the next call goes on with it; if waiters or holders changed meanwhile,
        finding the holders and making the parties go on over what is still
        there (a party that began to hold meanwhile is left to the next
        search), and the graph search starts again from the party it was
        searching from.  Components found before the bound are broken at once
        (:attr:`deadlock_backlog` is True while a search is left unfinished).
        A call whose search fits in ``max_work`` steps is a full search, as
        above; what it breaks does not depend on the bound.

        Raises TypeError / ValueError for a bad argument (state unchanged).
        """
        cdef int64_t t = _ms(now, "now", 0)
        cdef int64_t min_wait = _ms(min_wait_ms, "min_wait_ms", 0)
        cdef int64_t budget = _ms(max_work, "max_work", 0)
        cdef int64_t work = 0
        cdef list broken = []
        cdef list victims
        cdef _Waiter w
        self._advance(t)
        for _ in range(DEADLOCK_PASSES):
            if broken and work >= budget:
                break
            victims = self._deadlock_pass(t, min_wait, budget - work)
            work += self._search_nodes
            if not victims:  # none found, or the search stopped at the bound (None)
                break
            victims.sort(key=_victim_key)
            for req, cycle in victims:
                w = <_Waiter>req if type(req) is _Waiter else <_Waiter>(<_Group>req).members[0]
                if w.lock is None:
                    continue
                self._deadlocks += 1
                broken.append(cycle)
                self._withdraw(w, _EV_DEADLOCK, cycle, None, t, t)
        return broken

    cdef object _deadlock_pass(self, int64_t t, int64_t min_wait, int64_t budget):
        """One search (Tarjan's algorithm, iterative) from each party in turn, or the
        search kept from the last call: [(victim request, cycle)] per deadlocked
        component found.  After ``budget`` steps (at least one; a step is a waiter looked
        at to find the holders or make the parties, or a node entered or left) it stops
        and is kept for the next call (which starts its graph search again from the
        party it was searching from if the graph changed meanwhile, as breaking these
        victims does): it returns the components found so far, or None if none.  Sets
        _search_nodes to the steps this call made."""
        cdef _Search sr = self._dl_search
        cdef list victims = []
        cdef list stack, path, todo, positions, nexts, members
        cdef dict parties
        cdef _Node root, node, nxt, m, parent
        cdef Py_ssize_t pos, top, n, made = 0
        cdef int counter, n_comp, n_parties
        cdef Py_ssize_t steps
        cdef int64_t search
        self._dl_search = None
        self._search_nodes = 0
        if sr is not None and sr.gen != self._graph_gen:
            # The graph changed.  Finding the holders and making the parties go on (over
            # waiters since gone, skipped: at worst a party that began to hold meanwhile is
            # left out, and is found by the next search); the graph search starts again
            # from the party it was searching from, over the parties' requests still waiting.
            if sr.keys is not None:
                self._restart_search(sr)
            else:
                sr.changed = True
            sr.gen = self._graph_gen
        if sr is None:
            self._searches += 1
            sr = _Search.__new__(_Search)
            sr.search = self._searches
            sr.gen = self._graph_gen
            sr.t = t
            sr.min_wait = min_wait
            sr.holders = {}
            sr.marked = False
            sr.changed = False
            sr.pending = [w for sess in self._sessions.values() for w in <dict>sess]
            sr.j = 0
            sr.parties = {}
            sr.keys = None
            sr.i = -1
            sr.stack = []
            sr.path = []
            sr.todo = []
            sr.positions = []
            sr.counter = 0
            sr.n_comp = 0
        if not sr.marked:
            made = self._find_holders(sr, budget)
            if sr.j < len(sr.pending):  # the bound: go on at the next call
                self._search_nodes = made
                self._dl_search = sr
                return None
            sr.marked = True
            if len(sr.holders) < 2:
                return victims
            sr.pending = [w for s in {key[0]: None for key in sr.holders} for w in self._sessions.get(s, ())]
            sr.j = 0
        if sr.keys is None:
            made += self._make_parties(sr, budget - made)
            if sr.j < len(sr.pending):  # the bound: go on making them at the next call
                self._search_nodes = made
                self._dl_search = sr
                return None
            sr.pending = None
            sr.holders = None
            if sr.changed:  # requests made into parties may be gone since
                self._restart_search(sr)
            else:
                sr.keys = list(sr.parties)
                sr.start = 0
        if len(sr.keys) < 2:
            return victims
        search = sr.search
        parties = sr.parties
        stack, path, todo, positions = sr.stack, sr.path, sr.todo, sr.positions
        counter, n_comp = sr.counter, sr.n_comp
        n = len(sr.keys)
        steps = made  # the waiters looked at count as work too
        while True:
            if not path:
                # the next root not reached yet
                while True:
                    sr.i += 1
                    if sr.i >= n:
                        break
                    root = <_Node>parties[sr.keys[(sr.start + sr.i) % n]]
                    if root.dl_search != search:
                        break
                if sr.i >= n:
                    break
                _enter(root, search, counter)
                counter += 1
                steps += 1
                stack.append(root)
                path.append(root)
                todo.append(_successors(root, parties))
                positions.append(0)
            elif steps >= budget and steps > 0:
                # the bound: keep the search for the next call, or restart there after breaking
                sr.counter, sr.n_comp = counter, n_comp
                self._search_nodes = steps
                self._dl_search = sr  # (breaking the victims changes the graph: it starts again there)
                return victims if victims else None
            top = len(path) - 1
            node = <_Node>path[top]
            nexts = <list>todo[top]
            pos = positions[top]
            if pos < len(nexts):
                positions[top] = pos + 1
                nxt = <_Node>nexts[pos]
                if nxt.dl_search != search:
                    _enter(nxt, search, counter)
                    counter += 1
                    steps += 1
                    stack.append(nxt)
                    path.append(nxt)
                    todo.append(_successors(nxt, parties))
                    positions.append(0)
                elif nxt.dl_on_stack and nxt.dl_index < node.dl_low:
                    node.dl_low = nxt.dl_index
                continue
            path.pop()
            todo.pop()
            positions.pop()
            steps += 1
            if top > 0:
                parent = <_Node>path[top - 1]
                if node.dl_low < parent.dl_low:
                    parent.dl_low = node.dl_low
            if node.dl_low != node.dl_index:
                continue
            # node roots a component: pop it off the stack
            if stack[len(stack) - 1] is node:
                stack.pop()
                node.dl_on_stack = False
                continue
            members = []
            n_parties = 0
            while True:
                m = <_Node>stack.pop()
                m.dl_on_stack = False
                members.append(m)
                if type(m) is _Party:
                    n_parties += 1
                if m is node:
                    break
            if n_parties < 2:
                continue
            n_comp += 1
            for m in members:
                m.dl_comp = n_comp
            victims.append(_component_victim(members, parties, n_comp, search))
        self._search_nodes = steps
        return victims


def _request_key(req):
    """A waiting request's age key: (arrival ms, name, owner); a multi-lock's
    greatest name."""
    cdef _Waiter w
    if type(req) is _Waiter:
        w = <_Waiter>req
        return (w.enqueued_ms, w.lock.name, w.owner)
    w = <_Waiter>(<_Group>req).members[0]
    return (w.enqueued_ms, max([(<_Waiter>m).lock.name for m in (<_Group>req).members]), w.owner)


def _victim_key(victim):
    return _request_key(victim[0])


cdef inline object _request_of(_Waiter w):
    return w if w.group is None else w.group


cdef inline void _enter(_Node node, int64_t search, int index):
    node.dl_search = search
    node.dl_index = node.dl_low = index
    node.dl_comp = 0
    node.dl_on_stack = True


cdef inline bint _in_comp(_Node node, int cid, int64_t search):
    return node.dl_search == search and node.dl_comp == cid


cdef list _waiter_successors(_Waiter w, list out):
    """Append what ``w`` waits for: the request just ahead of it, its lock if a holder conflicts."""
    cdef _Lock lock = w.lock
    if w.prev is not None:
        out.append(_request_of(w.prev))
    if lock.held or (not w.shared and lock.n_leases):
        out.append(lock)
    return out


cdef list _successors(_Node node, dict parties):
    """The wait-for graph's edges out of ``node`` (see LockTable.break_deadlocks); a
    lock's edges go to the holders' parties that wait (no other can be in a cycle)."""
    cdef list out
    cdef list keys
    cdef _Lock lock
    cdef _Lease lease
    cdef _Waiter m
    cdef _Party party
    if type(node) is _Party:
        party = <_Party>node
        if not party.ordered:  # (sorted when the search first reaches the party)
            if len(party.requests) > 1:
                party.requests.sort(key=_request_key)
            party.ordered = True
        return party.requests
    if type(node) is _Waiter:
        return _waiter_successors(<_Waiter>node, [])
    if type(node) is _Group:
        out = []
        for m in (<_Group>node).members:
            _waiter_successors(m, out)
        return out
    lock = <_Lock>node
    out = []
    if lock.held:
        p = parties.get((lock.session, lock.actor))
        if p is not None:
            out.append(p)
    elif lock.n_leases:
        keys = []
        for lease in lock.leases.values():
            key = (lease.session, lease.actor)
            if key in parties:
                keys.append(key)
        if len(keys) > 1:
            keys = sorted(set(keys))
        for key in keys:
            out.append(parties[key])
    return out


cdef str _step_name(object req, object nxt):
    """The name of ``req``'s waiter whose edge leads to ``nxt`` (the first in request order)."""
    cdef _Waiter m
    if type(req) is _Waiter:
        return (<_Waiter>req).lock.name
    for m in (<_Group>req).members:
        if nxt in _waiter_successors(m, []):
            return m.lock.name
    raise AssertionError("no edge")  # pragma: no cover


cdef list _bfs_path(_Node start, _Party home, dict parties, int cid, int64_t search, dict dead):
    """Breadth first from ``start`` inside component ``cid``: to the first party that is not
    ``home`` when ``dead`` is a dict (``home`` is not crossed; what proves unable to reach
    another party is marked dead for ``home``), else to ``home``.  The path
    [start, ..., end], or None."""
    cdef dict parent = {start: None}
    cdef list queue = [start]
    cdef list path
    cdef Py_ssize_t i = 0
    cdef _Node node, nxt
    end = None
    while end is None and i < len(queue):
        node = <_Node>queue[i]
        i += 1
        for nxt in _successors(node, parties):
            if nxt in parent or not _in_comp(nxt, cid, search):
                continue
            if dead is not None and (nxt is home or dead.get(nxt) is home):
                continue
            parent[nxt] = node
            if nxt is home or (dead is not None and type(nxt) is _Party):
                end = nxt
                break
            queue.append(nxt)
    if end is None:
        for node in queue:
            dead[node] = home
        return None
    path = []
    while end is not None:
        path.append(end)
        end = parent[end]
    path.reverse()
    return path


cdef tuple _component_victim(list members, dict parties, int cid, int64_t search):
    """The victim request of a deadlocked component and the cycle naming it: the
    youngest request of a party of the component, in it, that reaches another party
    without crossing its own; the cycle runs from it to the nearest such party and
    from there back by a shortest path (so every party on it is distinct)."""
    cdef list candidates = []
    cdef list out_path, back, steps
    cdef dict dead = {}
    cdef Py_ssize_t i
    cdef _Waiter w
    cdef _Party home
    for m in members:
        if type(m) is _Party:
            for req in (<_Party>m).requests:
                if _in_comp(<_Node>req, cid, search):
                    candidates.append(req)
    candidates.sort(key=_request_key, reverse=True)
    for victim in candidates:
        w = <_Waiter>victim if type(victim) is _Waiter else <_Waiter>(<_Group>victim).members[0]
        home = <_Party>parties[(w.session, w.actor)]
        out_path = _bfs_path(victim, home, parties, cid, search, dead)
        if out_path is not None:
            break
    else:
        raise AssertionError("a component of two parties has a cycle through both")  # pragma: no cover
    back = _bfs_path(out_path[len(out_path) - 1], home, parties, cid, search, None)
    steps = [(home.session, _step_name(victim, out_path[1]))]
    for i in range(len(back) - 1):
        if type(back[i]) is _Party:
            steps.append(((<_Party>back[i]).session, _step_name(back[i + 1], back[i + 2])))
    return (victim, tuple(steps))
