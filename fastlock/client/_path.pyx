# cython: language_level=3
"""The compiled request path of the asyncio client (see fastlock/client/client.py).

:func:`acquire_request` is every argument check of :meth:`Client.acquire
<fastlock.client.Client.acquire>` in one compiled step: the common shapes (an ASCII name
of at most 512 characters, durations given as ``float`` or ``int`` seconds inside their
ranges, no correlation id, an exclusive lock) are decided in C; any other value of an
argument goes to the Python check of that argument (:mod:`fastlock.protocol.validation`,
:func:`~fastlock.client.acquire.duration_ms`, :func:`~fastlock.client.kinds.kind_args`,
:func:`~fastlock.protocol.priority.check_priority`,
:func:`~fastlock.client.preempt.grace_ms`), in the same order, so a bad argument raises
the same error with the same message.  It draws the owner key and returns the
:class:`~fastlock.client.acquire.AcquireRequest`.

:func:`grant_lease` turns an ACQUIRE reply ``[token, ttl_ms, waited_ms, extra?]`` into
the :class:`~fastlock.client.lease.Lease` (its :class:`~fastlock.client.lease.LeaseState`
made without a Python ``__init__``) and raises the connector's ``max_epoch`` to the
token's epoch.

:func:`acquire_tail` is :func:`~fastlock.client.acquire.acquire_call` with its common
shapes (no priority, no sequencer asked; a server that reads no actor, or an exclusive
lock asked by an asyncio task) decided here.

:func:`send_acquire` and :func:`take_grant` are :meth:`Client.acquire
<fastlock.client.Client.acquire>` before and after the await of its reply: the request checked
and sent on the open connection (a :class:`FirstAttempt`), then the grant turned into the
lease and recorded; :func:`send_release` is :meth:`Client.release
<fastlock.client.Client.release>` up to the await of the reply's future, and
:meth:`FirstAttempt.ride_through` its ride through a failover.  The caller awaits the
connection's future itself: no coroutine of its own per request.

:func:`call` is :func:`fastlock.client.calls.call` (see that module): one request under
one deadline, a compiled coroutine; :class:`AttemptBounds` keeps the attempt bounds of a
connector's idempotent calls on one timer.
"""

import math
import os
from asyncio import get_running_loop

cimport cython
from libc.math cimport ceil
from cpython.float cimport PyFloat_AS_DOUBLE
from cpython.long cimport PyLong_AsLongLongAndOverflow
from cpython.object cimport PyTypeObject
from cpython.ref cimport PyObject
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize

from ..protocol.priority import check_priority
from ..protocol.validation import (
    MAX_CORRELATION_ID_CHARS,
    check_lock_delay_ms,
    check_name,
    check_optional_str,
    check_ttl_ms,
    check_wait_ms,
)
from ..protocol.ops import OP_ACQUIRE, OP_CHECK, OP_CONTENDERS, OP_EXTEND, OP_HOLDER, OP_KEY_GET, OP_KEY_LIST
from ..protocol.ops import OP_LOCK_INFO, OP_LOCKS, OP_NAMES, OP_PING, OP_RELEASE, OP_STATUS
from ..protocol._wire cimport RpcWire
from ..tokens import TOKEN_EPOCH_SHIFT
from ._callers cimport Caller, HeldLeases, current_caller, party
from ._lease_slots cimport LeaseSlots
from .acquire import AcquireRequest, acquire_call, duration_ms
from .connection import RETRYABLE, RideThrough
from .kinds import kind_args
from .lease import Lease, LeaseState, check_lease
from .owner_keys import KEYS_PER_DRAW as _KEYS_PER_DRAW
from .owner_keys import OWNER_KEY_BYTES as _OWNER_KEY_BYTES
from .preempt import grace_ms, send_revoke_request

cdef extern from "Python.h":
    bint PyUnicode_IS_ASCII(object o)


cdef extern from "Python.h":
    PyTypeObject PyBaseObject_Type
    PyTypeObject PyTuple_Type

cdef tuple _NO_ARGS = ()


cdef inline object _tuple_of(type cls, tuple items):
    """``tuple.__new__(cls, items)`` (a NamedTuple's instance, its ``__new__`` skipped), by
    the C slot that call reaches, without the Python-level call."""
    cdef tuple args = (items,)
    return PyTuple_Type.tp_new(cls, <PyObject*>args, NULL)


cdef inline object _bare(type cls):
    """``object.__new__(cls)`` (no ``__init__`` run), by the C slot that call reaches,
    without the Python-level call."""
    return PyBaseObject_Type.tp_new(cls, <PyObject*>_NO_ARGS, NULL)

# the protocol's limits (fastlock.protocol.validation), as C constants
from ..protocol.validation import MAX_LOCK_DELAY_MS as _MAX_LOCK_DELAY_MS
from ..protocol.validation import MAX_NAME_BYTES as _MAX_NAME_BYTES
from ..protocol.validation import MAX_TTL_MS as _MAX_TTL_MS
from ..protocol.validation import MAX_WAIT_MS as _MAX_WAIT_MS
from ..protocol.validation import MIN_TTL_MS as _MIN_TTL_MS

cdef long long MAX_LOCK_DELAY_MS = _MAX_LOCK_DELAY_MS
cdef Py_ssize_t MAX_NAME_BYTES = _MAX_NAME_BYTES
cdef long long MAX_TTL_MS = _MAX_TTL_MS
cdef long long MAX_WAIT_MS = _MAX_WAIT_MS
cdef long long MIN_TTL_MS = _MIN_TTL_MS
cdef type _AcquireRequest = AcquireRequest
cdef type _Lease = Lease
cdef type _LeaseState = LeaseState
cdef object _urandom = os.urandom
cdef Py_ssize_t OWNER_KEY_BYTES = _OWNER_KEY_BYTES
cdef Py_ssize_t KEYS_PER_DRAW = _KEYS_PER_DRAW
cdef bytes _keys = b""  # owner keys drawn from the OS and not handed out yet: the first _keys_left
cdef Py_ssize_t _keys_left = 0


cdef bytes _owner_key():
    """A fresh owner key, as :func:`~fastlock.client.owner_keys.new_owner_key` draws them
    (``OWNER_KEY_BYTES`` bytes of ``os.urandom``, one call per ``KEYS_PER_DRAW`` keys),
    from this module's own buffer (emptied in a child after ``fork()``)."""
    global _keys, _keys_left
    if _keys_left == 0:
        _keys = _urandom(OWNER_KEY_BYTES * KEYS_PER_DRAW)
        _keys_left = KEYS_PER_DRAW
    _keys_left -= 1
    return PyBytes_FromStringAndSize(PyBytes_AS_STRING(_keys) + _keys_left * OWNER_KEY_BYTES, OWNER_KEY_BYTES)


def _drop_keys():
    """In a child after ``fork()``: the parent's undrawn keys are never handed out here."""
    global _keys, _keys_left
    _keys = b""
    _keys_left = 0


if hasattr(os, "register_at_fork"):  # POSIX
    os.register_at_fork(after_in_child=_drop_keys)
cdef object _EPOCH_SHIFT = TOKEN_EPOCH_SHIFT
cdef int EPOCH_SHIFT = TOKEN_EPOCH_SHIFT
cdef tuple _EXCLUSIVE = ()


cdef long long _common_ms(object value, bint allow_zero):
    """``value`` seconds (a ``float``, or an ``int`` that fits in 64 bits) as milliseconds,
    as :func:`~fastlock.client.acquire.duration_ms` gives them (``max(1, ceil(value *
    1000))`` for 0 < value < 1e9, 0 for a zero when ``allow_zero``); -2 for any other
    value (the Python check decides, and raises)."""
    cdef double d
    cdef int overflow = 0
    cdef long long whole
    if type(value) is float:
        d = PyFloat_AS_DOUBLE(value)
    elif type(value) is int:
        whole = PyLong_AsLongLongAndOverflow(value, &overflow)
        if overflow:
            return -2
        d = <double>whole
    else:
        return -2
    if 0.0 < d < 1e9:  # NaN fails
        d = ceil(d * 1000.0)
        return 1 if d < 1.0 else <long long>d
    if allow_zero and d == 0.0:
        return 0
    return -2


cdef inline bint _common_name(object name):
    """A lock name that needs no encoding to be checked: ASCII, 1..512 characters, no NUL."""
    return (type(name) is str and PyUnicode_IS_ASCII(name) and 0 < len(<str>name) <= MAX_NAME_BYTES
            and "\x00" not in <str>name)


cpdef acquire_request(name, ttl, wait, lock_delay, correlation_id, shared, limit, priority, preempt):
    """The checked :class:`~fastlock.client.acquire.AcquireRequest` of one acquire, with a
    fresh owner key (see the module docstring).  Arguments as :meth:`Client.acquire
    <fastlock.client.Client.acquire>` takes them: ``ttl``, ``wait`` (None: forever),
    ``lock_delay`` and ``preempt`` (None: none) in seconds.

    :raises WrongArgumentType: an argument of a wrong type (as the Python checks raise it).
    :raises InvalidArgument: an argument out of its range (as the Python checks raise it).
    """
    cdef long long ttl_ms, wait_ms, delay_ms
    if not _common_name(name):
        check_name(name)
    ttl_ms = _common_ms(ttl, False)
    if not MIN_TTL_MS <= ttl_ms <= MAX_TTL_MS:
        ttl_ms = check_ttl_ms(duration_ms(ttl, "ttl"))
    if wait is None:
        wait_ms = -1
    else:
        wait_ms = _common_ms(wait, True)
        if not 0 <= wait_ms <= MAX_WAIT_MS:
            wait_ms = check_wait_ms(duration_ms(wait, "wait", allow_zero=True))
    delay_ms = _common_ms(lock_delay, True)
    if not 0 <= delay_ms <= MAX_LOCK_DELAY_MS:
        delay_ms = check_lock_delay_ms(duration_ms(lock_delay, "lock_delay", allow_zero=True))
    if correlation_id is not None:
        check_optional_str(correlation_id, "correlation_id", MAX_CORRELATION_ID_CHARS)
    if shared is False and type(limit) is int and limit == 0:
        kind = _EXCLUSIVE
    else:
        kind = kind_args(shared, limit)
    if priority:
        check_priority(priority)
    grace = None if preempt is None else grace_ms(preempt)
    return _tuple_of(_AcquireRequest, (name, _owner_key(), ttl_ms, wait_ms, delay_ms, correlation_id, kind,
                                        priority, grace))


@cython.boundscheck(True)  # the reply is the server's: an index out of range raises, as in Python
@cython.wraparound(True)
def grant_lease(name, owner, reply, double sent, connector):
    """The :class:`~fastlock.client.lease.Lease` an ACQUIRE reply ``[token, ttl_ms,
    waited_ms, extra]`` (the last two optional) grants for ``name`` and ``owner``, its
    request sent at ``sent`` (``loop.time()``, seconds): ``ttl`` the granted TTL in
    seconds, ``expires_at`` ``sent + waited + ttl`` (the grant happened no earlier: see
    :meth:`Client.acquire <fastlock.client.Client.acquire>`), the signed sequencer of
    ``extra`` (a dict) if it holds one.  Raises ``connector.max_epoch`` to the token's epoch.

    :raises TypeError, IndexError: a reply of another shape.
    """
    cdef double expires_at, granted_ttl
    return _grant_lease(name, owner, reply, sent, connector, &expires_at, &granted_ttl)


@cython.boundscheck(True)
@cython.wraparound(True)
cdef object _grant_lease(name, owner, reply, double sent, connector, double* expires_at, double* ttl):
    """:func:`grant_lease`, also giving the lease's ``expires_at`` and ``ttl`` (seconds)."""
    token = reply[0]
    cdef double granted_ttl = reply[1] / 1000.0
    cdef Py_ssize_t n = len(reply)
    cdef double waited = reply[2] / 1000.0 if n > 2 else 0.0
    cdef int overflow = 0
    cdef long long whole = -1
    if type(token) is int:
        whole = PyLong_AsLongLongAndOverflow(token, &overflow)
    if whole >= 0 and not overflow:
        epoch = whole >> EPOCH_SHIFT  # a token of 64 bits: its epoch in C
    else:
        epoch = token >> _EPOCH_SHIFT  # (a token that is no int raises here, as in Python)
    if epoch > connector.max_epoch:
        connector.max_epoch = epoch
    expires_at[0] = sent + waited + granted_ttl
    ttl[0] = granted_ttl
    sequencer = None
    if n > 3:
        extra = reply[3]
        if type(extra) is dict:  # a signed sequencer (fastlock.sequencer)
            sequencer = (<dict>extra).get("sequencer")
    # LeaseState.__init__'s fields, set here: its C slots' tp_new makes each None
    cdef LeaseSlots state = (<PyTypeObject*>_LeaseState).tp_new(_LeaseState, <PyObject*>_NO_ARGS, NULL)
    state.expires_at = expires_at[0]
    state.sequencer = sequencer
    lease = _bare(_Lease)  # Lease.__init__'s fields, set here
    cdef dict fields = lease.__dict__
    fields["name"] = name
    fields["fencing_token"] = token
    fields["ttl"] = granted_ttl
    fields["owner"] = owner
    fields["state"] = state
    return lease


cdef object _acquire_call = acquire_call


def acquire_tail(connector, tuple kind, priority, who):
    """:func:`~fastlock.client.acquire.acquire_call` ``(connector, kind, priority, who)``:
    the op and trailing arguments of an acquire (``who``: the caller's
    :func:`~fastlock.client.acquire.current_caller`).

    :raises InvalidArgument: sequencers asked for, and the server holds no sequencer key."""
    return _acquire_tail(connector, kind, priority, who)


cdef tuple _acquire_tail(connector, tuple kind, priority, who):
    """:func:`acquire_tail`, by a C call."""
    if not priority and not connector.sequencers:
        info = connector.server_info
        if not (<dict>info).get("actors") if type(info) is dict else not info.get("actors"):
            return (OP_ACQUIRE, kind)
        if type(who) is Caller and not kind:
            return (OP_ACQUIRE, (False, 0, party(<Caller>who, id(connector)).actor))
    return tuple(_acquire_call(connector, kind, priority, who))


cdef object _open_proto(connector):
    """The connector's connection if it is open, else None (an
    :class:`~fastlock.protocol.rpc.RpcConnection`'s fields read in C)."""
    proto = connector.proto
    if proto is None:
        return None
    if isinstance(proto, RpcWire):
        return None if (<RpcWire>proto).closed else proto
    return None if proto.closed else proto


cdef inline object _loop_of(proto):
    """``proto.loop`` (read in C from an :class:`~fastlock.protocol.rpc.RpcConnection`)."""
    return (<RpcWire>proto).loop if isinstance(proto, RpcWire) else proto.loop


cdef object _RPC_REQUEST = RpcWire.request
cdef type _direct_type = None  # the last connection class seen whose request is RpcWire's own


cdef inline object _send(proto, op, tuple args):
    """``proto.request(op, *args)``: by a C call on an :class:`~fastlock.protocol.rpc.RpcConnection`
    whose class does not override ``request``, else by that method."""
    global _direct_type
    cdef type kind = type(proto)
    if kind is _direct_type:
        return (<RpcWire>proto).send(op, args)
    if isinstance(proto, RpcWire) and kind.request is _RPC_REQUEST:
        _direct_type = kind
        return (<RpcWire>proto).send(op, args)
    return proto.request(op, *args)


#: operations that may be sent again while an earlier attempt's outcome is unknown: a
#: second RELEASE finds the lease gone (taken as released, see ``RideThrough.send``),
#: a second EXTEND renews again, the rest only read
IDEMPOTENT_OPS = frozenset({OP_RELEASE, OP_EXTEND, OP_CHECK, OP_STATUS, OP_PING, OP_HOLDER, OP_LOCKS, OP_LOCK_INFO,
                            OP_KEY_GET, OP_KEY_LIST, OP_CONTENDERS})


cdef class AttemptBound:
    """One first attempt's bound (:class:`AttemptBounds`).

    Attributes:
        started (float): ``loop.time()`` when the request went out.
        due (float): ``loop.time()`` by which the server must have sent something since ``started``.
        op (int): the request's op, for the reason given.
    """

    cdef readonly double started
    cdef readonly double due
    cdef readonly object op

    def __repr__(self):
        return f"<AttemptBound op={self.op} started={self.started:.3f} due={self.due:.3f}>"


cdef class AttemptBounds:
    """The attempt bounds of one connector's calls, on one timer.

    :meth:`begin` records a bound and :meth:`end` drops it when the reply comes.  The
    timer is armed for the earliest bound outstanding; when it fires, each bound that
    is due and still outstanding is checked as a timer of its own would check it
    (:meth:`Connector.reset_if_silent_since
    <fastlock.client.connection.Connector.reset_if_silent_since>`: the connection is
    reset unless the server sent something since the request went out), then the timer
    is armed for the earliest bound left.

    Attributes:
        connector (Connector): whose calls these are.
        outstanding (dict[int, AttemptBound]): key -> the bound of an attempt whose
            reply has not come, in the order they began.
    """

    cdef readonly object connector
    cdef readonly dict outstanding
    cdef object _loop
    cdef object _timer
    cdef double _timer_due
    cdef long long _last_key

    def __init__(self, connector, loop):
        self.connector = connector
        self.outstanding = {}
        self._loop = loop
        self._timer = None
        self._timer_due = math.inf
        self._last_key = 0

    cpdef long long begin(self, double started, double attempt, object op):
        """Record the bound of an attempt sent at ``started`` (``loop.time()``) that must
        hear from the server within ``attempt`` seconds; return its key."""
        cdef AttemptBound bound = AttemptBound.__new__(AttemptBound)
        bound.started = started
        bound.due = started + attempt
        bound.op = op
        self._last_key += 1
        self.outstanding[self._last_key] = bound
        if bound.due < self._timer_due:
            self._arm(bound.due)
        return self._last_key

    cpdef void end(self, long long key):
        """The reply of the attempt ``key`` came (or it failed): drop its bound."""
        self.outstanding.pop(key, None)

    cdef void _arm(self, double due):
        if self._timer is not None:
            self._timer.cancel()
        self._timer_due = due
        self._timer = self._loop.call_at(due, self._fire)

    def _fire(self):
        self._timer = None
        self._timer_due = math.inf
        cdef double now = self._loop.time()
        cdef dict outstanding = self.outstanding
        cdef AttemptBound bound
        due = [(key, bound) for key, bound in outstanding.items() if bound.due <= now]
        for key, bound in due:
            del outstanding[key]
        for key, bound in due:
            self.connector.reset_if_silent_since(bound.started, f"{OP_NAMES.get(bound.op, bound.op)} got no reply in time")
        if outstanding:
            self._arm(min([(<AttemptBound>b).due for b in outstanding.values()]))


def attempt_bounds(connector, loop):
    """The connector's :class:`AttemptBounds` (made on first use, on ``loop``)."""
    bounds = connector.attempt_bounds
    if bounds is None:
        bounds = connector.attempt_bounds = AttemptBounds(connector, loop)
    return bounds


async def call(connector, op, tuple args, double op_timeout):
    """Send ``op`` with ``args`` and return its reply's value, riding through a failover
    within ``op_timeout`` seconds (see :mod:`fastlock.client.calls`).

    :raises ConnectionLost: no primary answered before the deadline.
    :raises FastlockError: any other error the server replied with.
    """
    cdef bint bounded = op in IDEMPOTENT_OPS
    cdef double attempt = op_timeout / 2.0
    cdef double started
    cdef long long key = 0
    cdef AttemptBounds bounds = None
    proto = _open_proto(connector)
    if proto is not None:
        loop = _loop_of(proto)
        started = loop.time()
        if bounded:
            bounds = connector.attempt_bounds
            if bounds is None:
                bounds = attempt_bounds(connector, loop)
            key = bounds.begin(started, attempt, op)
        try:
            return await _send(proto, op, args)
        except RETRYABLE as exc:
            failed = exc
            if connector.closed:
                raise
        finally:
            if bounds is not None:
                bounds.end(key)
        return await RideThrough(connector, started + op_timeout).send(op, args, proto, failed,
                                                                        attempt_timeout=attempt if bounded else None)
    return await RideThrough(connector, get_running_loop().time() + op_timeout).send(
        op, args, attempt_timeout=attempt if bounded else None)


cdef object _send_revoke_request = send_revoke_request
cdef object _check_lease = check_lease


@cython.freelist(16)
cdef class FirstAttempt:
    """The first attempt of one request of :meth:`Client.acquire <fastlock.client.Client.acquire>`
    or :meth:`Client.release <fastlock.client.Client.release>`, made by :func:`send_acquire` or
    :func:`send_release`.

    Attributes:
        fut (asyncio.Future | None): the future of its reply; None: no connection was open,
            nothing was sent (the caller rides through).
        proto (ClientConnection | None): the connection it went on.
        loop (asyncio.AbstractEventLoop): the running loop.
        started (float): ``loop.time()`` when the call began, seconds.
        sent (float): ``loop.time()`` when the request went out, seconds (``started`` until then).
        request (AcquireRequest | None): an acquire's checked request.
        who: an acquire's :func:`~fastlock.client.acquire.current_caller`.
        connector (Connector): the client's connector.
        op (int): the request's op; ``args`` (tuple): its arguments (a release's).
        op_timeout (float): a release's deadline from ``started``, seconds.
    """

    cdef public object fut
    cdef public object proto
    cdef public object loop
    cdef public double started
    cdef public double sent
    cdef public object request
    cdef public object who
    cdef public object connector
    cdef public object op
    cdef public tuple args
    cdef public double op_timeout
    cdef AttemptBounds _bounds
    cdef long long _key

    cpdef end(self):
        """The attempt has its answer (or failed): drop its attempt bound, if it has one."""
        if self._bounds is not None:
            self._bounds.end(self._key)
            self._bounds = None

    async def ride_through(self, failed=None):
        """Send the request again until a primary answers, within ``op_timeout`` seconds of
        ``started`` (:meth:`RideThrough.send <fastlock.client.connection.RideThrough.send>`,
        each attempt bounded by half of it); ``failed``: the error the first attempt ended
        with (None: it was never sent).  Returns the reply's value.

        :raises ConnectionLost: no primary answered before the deadline.
        :raises FastlockError: any other error the server replied with.
        """
        cdef double attempt = self.op_timeout / 2.0
        if failed is None:
            return await RideThrough(self.connector, self.loop.time() + self.op_timeout).send(
                self.op, self.args, attempt_timeout=attempt)
        return await RideThrough(self.connector, self.started + self.op_timeout).send(
            self.op, self.args, self.proto, failed, attempt_timeout=attempt)


def send_acquire(client, name, ttl, wait, lock_delay, correlation_id, shared, limit, priority, preempt,
                 owner=None, queue_behind_self=False):
    """:meth:`Client.acquire <fastlock.client.Client.acquire>` up to the await of its reply: the
    self-wait check (:meth:`HeldLeases.refuse_self_wait
    <fastlock.client.acquire.HeldLeases.refuse_self_wait>` of the client's entry for ``name``,
    unless ``wait`` is 0 or ``queue_behind_self``), every
    argument checked (:func:`acquire_request`), the owner key drawn (``owner``, bytes: that key
    instead), the caller found
    (:func:`~fastlock.client.acquire.current_caller`), and the ACQUIRE (and a preempt's
    revoke request) sent if the client's connection is open.  Returns the
    :class:`FirstAttempt` (``fut`` None: nothing sent).

    :raises AlreadyHeld: the caller would wait for a lease it holds (nothing sent).
    :raises WrongArgumentType, InvalidArgument: a bad argument (nothing sent).
    """
    cdef HeldLeases held = client._held
    if wait != 0 and not queue_behind_self and type(name) is str:  # (the table's names are str)
        entry = held.by_name.get(name)
        if entry is not None:
            held.refuse_self_wait(entry, not shared and not limit)
    request = acquire_request(name, ttl, wait, lock_delay, correlation_id, shared, limit, priority, preempt)
    if owner is not None:
        request = request._replace(owner=owner)
    cdef tuple fields = <tuple>request  # an AcquireRequest (a tuple): read by index, in C
    cdef FirstAttempt attempt = FirstAttempt.__new__(FirstAttempt)
    attempt.request = request
    connector = attempt.connector = client._connector
    cdef tuple args
    proto = _open_proto(connector)
    if proto is not None:
        loop = attempt.loop = _loop_of(proto)
        attempt.started = attempt.sent = loop.time()
        who = attempt.who = current_caller(loop)
        op, tail = _acquire_tail(connector, fields[6], priority, who)
        owner = fields[1]
        wait_ms = fields[3]
        attempt.proto = proto
        attempt.op = op
        args = (name, owner, fields[2], wait_ms, fields[4], correlation_id)
        if tail:
            args += tail if type(tail) is tuple else tuple(tail)
        attempt.fut = _send(proto, op, args)
        grace = fields[8]
        if grace is not None and wait_ms != 0:
            _send_revoke_request(proto, name, owner, grace)
    else:
        loop = attempt.loop = get_running_loop()
        attempt.started = attempt.sent = loop.time()
        attempt.who = current_caller(loop)
    return attempt


def take_grant(client, FirstAttempt attempt, reply, bint exclusive, double late_fraction):
    """:meth:`Client.acquire <fastlock.client.Client.acquire>` after its reply: the lease the
    ACQUIRE reply grants (:func:`grant_lease`, from ``attempt.sent``), recorded in the client's
    self-wait table (``exclusive``: neither a shared lease nor a permit) and returned; None
    (nothing recorded) when less than ``late_fraction`` of its TTL is left by the client's
    estimate (the caller verifies the late grant).

    :raises TypeError, IndexError: a reply of another shape.
    """
    cdef tuple request = <tuple>attempt.request  # an AcquireRequest (a tuple)
    cdef double expires_at, ttl
    lease = _grant_lease(request[0], request[1], reply, attempt.sent, attempt.connector, &expires_at, &ttl)
    if expires_at - attempt.loop.time() < ttl * late_fraction:
        return None
    (<HeldLeases?>client._held).remember_named(lease, request[0], exclusive, attempt.loop, attempt.who)
    return lease


def send_release(client, lease, double op_timeout):
    """:meth:`Client.release <fastlock.client.Client.release>` up to the await of its reply:
    ``lease`` checked, its renewal stopped, its entry of the self-wait table dropped, and the
    RELEASE sent if the client's connection is open (under an attempt bound of half of
    ``op_timeout`` seconds, as :func:`call` sends it).  Returns the :class:`FirstAttempt`
    (``fut`` None: nothing sent; the caller rides through with
    :meth:`FirstAttempt.ride_through`, and calls :meth:`FirstAttempt.end` once the reply came).

    :raises WrongArgumentType: ``lease`` is no :class:`~fastlock.client.lease.Lease`.
    """
    if type(lease) is not _Lease:
        _check_lease(lease)
    renewers = client.renewers
    if renewers.by_state:
        renewers.stop(lease)
    fields = lease.__dict__
    (<HeldLeases?>client._held).forget_named(lease, fields["name"], fields["state"])
    cdef FirstAttempt attempt = FirstAttempt.__new__(FirstAttempt)
    args = attempt.args = (fields["name"], fields["fencing_token"], fields["owner"])
    attempt.op = OP_RELEASE
    attempt.op_timeout = op_timeout
    connector = attempt.connector = client._connector
    cdef AttemptBounds bounds
    proto = _open_proto(connector)
    if proto is not None:
        loop = attempt.loop = _loop_of(proto)
        attempt.started = attempt.sent = loop.time()
        bounds = connector.attempt_bounds
        if bounds is None:
            bounds = attempt_bounds(connector, loop)
        attempt._key = bounds.begin(attempt.started, op_timeout / 2.0, OP_RELEASE)
        attempt._bounds = bounds
        attempt.proto = proto
        attempt.fut = _send(proto, OP_RELEASE, args)
    else:
        attempt.loop = get_running_loop()
    return attempt
