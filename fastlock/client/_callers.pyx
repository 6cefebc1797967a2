# cython: language_level=3, annotation_typing=False
"""Who calls the client, compiled: the :class:`Caller` tree of asyncio tasks, the actor ids
the server's deadlock detection tells waits apart by, and :class:`HeldLeases`, the self-wait
check's table of the last lease granted per name.

This is Python code compiled as it is (Cython; no behaviour of its own; :class:`Caller` and
:class:`HeldLeases` are C classes, a table entry read by index in C): the grant and the
release of every lease go through :meth:`HeldLeases.remember` and :meth:`HeldLeases.forget`,
and every acquire asks :func:`current_caller` and :func:`party`.  The names are
:mod:`fastlock.client.acquire`'s (which imports them from here, and documents the slow
paths they serve).
"""

import asyncio
import itertools

from cpython.contextvars cimport get_value
from cpython.object cimport PyTypeObject
from cpython.ref cimport PyObject
from cpython.weakref cimport PyWeakref_GetObject
import threading
import types
import weakref
from contextvars import ContextVar
from typing import NamedTuple

from ..errors import AlreadyHeld
from ..logsafe import quote
from .lease import Lease


cdef class Caller:
    """An asyncio task's identity as a caller of the client, for the self-wait check and
    the deadlock detector's ``actor``: a node of the tree of structured concurrency.

    A task's node is made the first time it acquires (or asks who it is), in its own
    context, with ``parent`` the node its context carried: the node of the task in whose
    context it was created (``asyncio.wait_for`` on Python 3.10/3.11, ``gather``,
    ``TaskGroup``, ``create_task``, ``ensure_future`` all copy the creating task's
    context), skipping ancestors whose task has ended.  A task *acts for* its ancestors:
    its waits are theirs.  See :func:`acts_for` and :func:`actor_id`.

    Attributes:
        task (weakref.ref[asyncio.Task]): the task this node stands for.
        parent (Caller | None): the nearest live ancestor's node, or None.
        held (dict[int, int] | None): per client (the ``id`` of its connector), the
            leases granted with this node as their party and not yet forgotten.
        actor (int): this process's number for the node (1, 2, ...; never reused).
    """

    def __init__(self, task, Caller parent):
        self.task = weakref.ref(task)
        while parent is not None and _ended(parent):
            parent = parent.parent
        self.parent = parent
        self.held = None
        self.actor = next(_NEXT_ACTOR)

    def __repr__(self):
        parent = None if self.parent is None else self.parent.actor
        return f"<Caller actor={self.actor} held={self.held} parent={parent}>"


cpdef Caller party(Caller who, object key):
    """The node whose party a wait by ``who`` through the client ``key`` is: the nearest
    of ``who`` and its live ancestors that holds a lease through that client (their
    leases are what the wait keeps from being released), else ``who`` itself."""
    cdef Caller node = who
    cdef dict held
    cdef int i
    for i in range(MAX_ANCESTRY):
        if node is None:
            break
        held = node.held
        if held and held.get(key) and (node is who or not _ended(node)):
            return node
        node = node.parent
    return who


cdef bint _ended(Caller node):
    task = node.task()
    return task is None or task.done()


#: who acquires: the blocking client sets its calling thread (its tasks inherit the
#: context); otherwise the :class:`Caller` node of the current asyncio task, made on first use
CALLER = ContextVar("fastlock_caller", default=None)
cdef object _current_task = asyncio.current_task
# asyncio's running task of each loop, where current_task is Python code that reads it (3.11):
# read here with one C lookup instead of a call of that function; None where it is compiled
_tasks_of_loops = getattr(asyncio.tasks, "_current_tasks", None)
cdef dict _running_tasks = (_tasks_of_loops if type(_tasks_of_loops) is dict
                            and type(_current_task) is types.FunctionType else None)

#: the longest chain of ancestors :func:`acts_for` and :func:`actor_id` walk
MAX_ANCESTRY = 256


cpdef current_caller(loop=None):
    """The thread (blocking client) or the :class:`Caller` node of the asyncio task that
    calls now (made, and set in the task's context, on first use); None outside a task.
    ``loop``: the running loop, if the caller has it (CPython finds it with a
    ``getpid()`` call otherwise)."""
    who = get_value(CALLER)
    if who is not None and type(who) is not Caller:
        return who
    if loop is not None and _running_tasks is not None:
        task = _running_tasks.get(loop)
    else:
        task = _current_task(loop)
    if task is None:
        return None
    if who is not None and <object>PyWeakref_GetObject((<Caller>who).task) is task:
        return who
    node = Caller(task, who)
    CALLER.set(node)
    return node


def new_caller():
    """Make the calling asyncio task a caller of its own, acting for no ancestor (from
    now on, and for the tasks it creates afterwards): its waits for a lock an ancestor
    holds queue as another task's would, and the deadlock detector does not count them
    as its ancestors' waits.  For a long-lived task spawned by a lock holder that serves
    on its own (a connection handler, a worker).  No effect outside a task."""
    task = asyncio.current_task()
    if task is not None:
        CALLER.set(Caller(task, None))


def acts_for(who, holder):
    """True if ``who`` (a :func:`current_caller`) is ``holder`` or a task created in
    ``holder``'s context, directly or through other tasks: a wait by ``who`` for a
    lease ``holder`` holds is a wait for itself."""
    if who is holder:
        return True
    if type(who) is not Caller:
        return False
    node = who.parent
    for _ in range(MAX_ANCESTRY):
        if node is None:
            return False
        if node is holder:
            return not _ended(node)
        node = node.parent
    return False


_ACTORS = weakref.WeakKeyDictionary()
_ACTORS_LOCK = threading.Lock()
_NEXT_ACTOR = itertools.count(1)


def actor_id(connector=None, who=None):
    """This process's number (1, 2, ...; never reused) for the party that waits when the
    caller waits: the ``actor`` by which the server's deadlock detection tells the waits
    of one connection apart; 0 outside a task.

    A blocking client's thread is its own party.  An asyncio task's party is
    :func:`party` for the client ``connector`` (the nearest of itself and its live
    ancestors that holds a lease through it, else itself): a child's wait blocks the
    parent that awaits it, so a parent holding ``a`` whose child waits for ``b``, held
    by a task waiting for ``a``, is a cycle the server sees.  ``who``: the
    :func:`current_caller`, if the caller has it."""
    if who is None:
        who = current_caller()
    if who is None:
        return 0
    if type(who) is Caller:
        return party(who, id(connector)).actor
    with _ACTORS_LOCK:
        n = _ACTORS.get(who)
        if n is None:
            n = _ACTORS[who] = next(_NEXT_ACTOR)
    return n


#: the smallest size at which :class:`HeldLeases` sweeps out ended leases
SWEEP_MIN = 1024


#: An entry of :attr:`HeldLeases.by_name`: the last lease granted of a name, to whom:
#: ``lease``; ``caller``, the task or thread it went to (see :func:`current_caller`);
#: ``exclusive``, neither a shared lease nor a semaphore permit; ``party``, the caller node
#: its hold is counted against (see :func:`party`), None: a thread
HeldLease = NamedTuple("HeldLease", [("lease", Lease), ("caller", object), ("exclusive", bool),
                                     ("party", object)])
HeldLease.__module__ = "fastlock.client.acquire"
HeldLease.__doc__ = "An entry of :attr:`HeldLeases.by_name`: the last lease granted of a name, to whom."
cdef type _HeldLease = HeldLease

cdef extern from "Python.h":
    PyTypeObject PyTuple_Type


cdef inline object _tuple_of(type cls, tuple items):
    """``tuple.__new__(cls, items)`` (a NamedTuple's instance, its ``__new__`` skipped), by
    the C slot that call reaches, without the Python-level call."""
    cdef tuple args = (items,)
    return PyTuple_Type.tp_new(cls, <PyObject*>args, NULL)


cdef _unhold(node, key):
    cdef dict held
    if node is not None:
        held = (<Caller>node).held
        if held:
            n = held.get(key, 0) - 1
            if n > 0:
                held[key] = n
            else:
                held.pop(key, None)


cdef class HeldLeases:
    """The last lease a client was granted per lock name, and the caller (an asyncio
    task's :class:`Caller` node, or a blocking client's thread) it went to: the self-wait check of :meth:`Client.acquire
    <fastlock.client.Client.acquire>`.  An entry goes on release; entries of leases that
    ended otherwise (expired, lost) are swept out whenever the table has doubled since
    the last sweep, so it holds at most about twice the live leases."""

    # (by_name: lock name -> its entry, a HeldLease, read directly by Client.acquire in one
    # lookup; _key: the client, for party(), the id of its connector; declared in _callers.pxd)
    def __init__(self, connector=None):
        self.by_name = {}
        self._sweep_at = SWEEP_MIN
        self._key = id(self if connector is None else connector)

    cpdef remember(self, lease, exclusive, loop=None, who=None):
        """Record ``lease`` as the caller's grant of its name (``exclusive``: not a
        shared lease nor a semaphore permit; ``loop``: the running loop, if known;
        ``who``: the :func:`current_caller`, if the caller has it)."""
        self.remember_named(lease, lease.name, exclusive, loop, who)

    cdef remember_named(self, lease, name, exclusive, loop, who):
        """:meth:`remember`, with ``name`` the lease's name (read by the caller)."""
        cdef dict by_name = self.by_name
        cdef dict held
        cdef Caller node_of
        if who is None:
            who = current_caller(loop)
        key = self._key
        node = None
        if type(who) is Caller:
            node_of = party(<Caller>who, key)
            node = node_of
            held = node_of.held
            if held is None:
                held = node_of.held = {}
            held[key] = held.get(key, 0) + 1
        old_entry = by_name.get(name)
        by_name[name] = _tuple_of(_HeldLease, (lease, who, exclusive, node))
        if old_entry is not None:
            _unhold((<tuple>old_entry)[3], key)
        if len(by_name) >= self._sweep_at:
            for name, entry in list(by_name.items()):
                if entry.lease.lost.is_set() or entry.lease.time_left() <= 0:
                    del by_name[name]
                    _unhold(entry.party, key)
            self._sweep_at = max(SWEEP_MIN, 2 * len(by_name))

    cpdef forget(self, lease):
        """Drop ``lease`` if it is the entry of its name (any copy of it)."""
        self.forget_named(lease, lease.name, lease.state)

    cdef forget_named(self, lease, name, state):
        """:meth:`forget`, with ``name`` and ``state`` the lease's (read by the caller)."""
        cdef dict by_name = self.by_name
        entry = by_name.get(name)
        if entry is not None and ((<tuple>entry)[0] is lease or (<tuple>entry)[0].state is state):
            del by_name[name]
            _unhold((<tuple>entry)[3], self._key)

    def refuse_self_wait(self, entry, exclusive):
        """Raise :class:`AlreadyHeld` if ``entry`` (from :attr:`by_name`) belongs to the
        caller, is still live (not lost, its TTL not passed by the client's estimate)
        and either it or the request (``exclusive``) is exclusive: a shared lease or a
        permit asked by a holder of a shared lease or a permit can be granted beside it.
        A dead entry is dropped."""
        lease = entry.lease
        if not (entry.exclusive or exclusive):
            return
        if lease.lost.is_set() or lease.time_left() <= 0:
            self.forget(lease)
            return
        if not acts_for(current_caller(), entry.caller):
            return  # an unrelated task or thread of this client: waiting for it is no deadlock
        raise AlreadyHeld(f"this client already holds {quote(lease.name)} (fencing token {lease.fencing_token}); "
                          "a second acquire would wait for itself (pass queue_behind_self=True to queue anyway)",
                          lease.fencing_token)
