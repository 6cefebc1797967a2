"""Rate limits per name, shared by every client: the RATE_LIMIT operation.

Each limiter is a GCRA (the generic cell rate algorithm of ATM networks; the
algorithm of redis-cell and of the "leaky bucket as a meter"): one number per name,
the *theoretical arrival time* ``tat`` on the server's monotonic clock.  With
``emission`` = ``period / rate`` (the spacing of requests at the steady rate) and
``burst`` the most taken at once, a request of ``cost`` is admitted when
``max(tat, now) + cost * emission - now <= burst * emission``, and then ``tat``
moves to that sum; otherwise nothing changes and the reply says how long until it
would be admitted.  Over any span of ``d`` seconds a limiter admits at most
``burst + rate * d / period``.  Only the server's clock is read; a client's clock
never counts.

**Across a failover and a restart.**  The limiters are not logged or replicated: none
needs to be.  A node starts each limiter *drained* at the moment from which it is the
only node serving (``serving_since``), as if ``burst`` had just been taken then; the
bucket refills from that moment at the rate.  After a promotion that moment is when
the old primary had stopped admitting for sure (``NodeRole.alone_since``): the time it
confirmed its step-down, or its own fence, ``F`` after this node last heard it (it
stops by ``F - margin`` on its clock; see ``docs/failover-safety.md``); after a start
or a forced promotion (unknown), the first request served.  The old primary's limiter
had at most ``burst`` outstanding at its last admission (the GCRA bound), so a limiter
drained at the moment it stopped is never fuller than the true one: admissions on the
two nodes together never exceed one limiter's bound over any span (``burst + rate *
d / period``), and a failover whose outage lasts ``burst * emission`` or longer costs
only the outage (the bucket is full again when the new primary serves).  The price is
that a limiter's configuration is not kept either: every request carries it.

**Bounds.**  At most :data:`MAX_LIMITERS` limiters on the server and
:data:`MAX_LIMITERS_PER_PRINCIPAL` per principal; a limiter whose bucket is full again
(``tat <= now``) is the same as none and is dropped when room is needed.  A request
for a new limiter beyond a bound is refused with ``LimitExceeded``.  A request whose
rate, period or burst disagrees with the name's live limiter is refused with
``LimitConflict`` (a limiter is shared: its clients must agree on it).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

from .. import protocol as P
from ..errors import InvalidArgument, LimitConflict, LimitExceeded, WrongArgumentType
from ..roles import Action
from ..units import monotonic_ms

__all__ = ["RateLimits", "RateLimiter", "RateLimitHandler", "RateDecision", "check_rate_args", "MAX_LIMITERS",
           "MAX_LIMITERS_PER_PRINCIPAL", "MAX_RATE", "MAX_BURST", "MAX_PERIOD_MS"]

#: most limiters on one server
MAX_LIMITERS = 100_000
#: most limiters one principal's requests may have created and keep live
MAX_LIMITERS_PER_PRINCIPAL = 10_000
#: ms: the least time between two passes over the limiters to drop the full ones (each pass
#: is at most MAX_LIMITERS steps; a request at a bound in between is refused)
SWEEP_EVERY_MS = 100
#: the largest rate (requests per period) and burst
MAX_RATE = 1_000_000
MAX_BURST = 1_000_000
#: the longest period: one day, in milliseconds
MAX_PERIOD_MS = 86_400_000


class RateDecision(NamedTuple):
    """The answer to one RATE_LIMIT request."""

    admitted: bool
    retry_after_ms: int  #: 0 when admitted; else milliseconds until the same request would be
    remaining: int  #: how many more of cost 1 would be admitted now


class RateLimiter:
    """One name's limiter: its configuration, its ``tat`` (ms, server monotonic) and the
    principal whose request made it."""

    __slots__ = ("rate", "period_ms", "burst", "emission_ms", "tat", "principal")

    def __init__(self, rate: int, period_ms: int, burst: int, tat: float, principal: str):
        self.rate = rate
        self.period_ms = period_ms
        self.burst = burst
        self.emission_ms = period_ms / rate
        self.tat = tat
        self.principal = principal


def _int_arg(value: object, what: str, most: int) -> int:
    if type(value) is not int:
        raise WrongArgumentType(f"{what} must be an int, not {type(value).__name__}")
    if not 1 <= value <= most:
        raise InvalidArgument(f"{what} must be in 1 .. {most}, got {value}")
    return value


def check_rate_args(rate: object, period_ms: object, burst: object, cost: object) -> tuple[int, int, int, int]:
    """RATE_LIMIT's numbers: ``rate`` requests per ``period_ms`` milliseconds, ``burst``,
    ``cost`` (at most ``burst``).

    Raises:
        WrongArgumentType: not ints.
        InvalidArgument: out of range.
    """
    checked = (_int_arg(rate, "rate", MAX_RATE), _int_arg(period_ms, "period_ms", MAX_PERIOD_MS),
               _int_arg(burst, "burst", MAX_BURST), _int_arg(cost, "cost", MAX_BURST))
    if checked[3] > checked[2]:
        raise InvalidArgument(f"cost ({checked[3]}) cannot exceed burst ({checked[2]}): it would never be admitted")
    return checked


class RateLimits:
    """Every live limiter of the server (sans-IO: every method takes ``now``, monotonic ms)."""

    __slots__ = ("by_name", "per_principal", "serving_since", "epoch", "_swept_at")

    def __init__(self, now: int, epoch: int = 0) -> None:
        self.by_name: dict[str, RateLimiter] = {}
        self.per_principal: dict[str, int] = {}
        #: when this node began to serve (ms): a limiter made before ``serving_since +
        #: burst * emission`` starts drained at ``serving_since``
        self.serving_since = now
        self.epoch = epoch
        self._swept_at = now - SWEEP_EVERY_MS  # when the full limiters were last dropped

    def serving(self, epoch: int, now: int, alone_since: tuple[int, int] | None = None) -> None:
        """The node serves under fencing epoch ``epoch``: a new epoch (a promotion) drops
        every limiter and starts them again drained from the time no other node serves:
        ``alone_since`` (``(epoch, monotonic ms)``, :attr:`fastlock.roles.NodeRole.alone_since`)
        if it is this epoch's, else ``now``."""
        if epoch != self.epoch:
            self.by_name.clear()
            self.per_principal.clear()
            since = alone_since[1] if alone_since is not None and alone_since[0] == epoch else now
            self.serving_since = min(since, now)
            self.epoch = epoch

    def __len__(self) -> int:
        return len(self.by_name)

    def take(self, name: str, rate: int, period_ms: int, burst: int, cost: int, principal: str,
             now: int) -> RateDecision:
        """Take ``cost`` from ``name``'s limiter (made on first use), or say when it could.

        Raises:
            LimitConflict: the live limiter of ``name`` has another rate, period or burst.
            LimitExceeded: a new limiter past :data:`MAX_LIMITERS` or the principal's
                :data:`MAX_LIMITERS_PER_PRINCIPAL`.
        """
        limiter = self.by_name.get(name)
        if limiter is not None and limiter.tat <= now:  # full again: the same as none
            self._drop(name, limiter)
            limiter = None
        if limiter is None:
            self._make_room(principal, now)
            emission = period_ms / rate
            # drained at serving_since, refilling from then: never more than one bound across a failover
            tat = max(float(now), self.serving_since + burst * emission)
            limiter = RateLimiter(rate, period_ms, burst, tat, principal)
            self.by_name[name] = limiter
            self.per_principal[principal] = self.per_principal.get(principal, 0) + 1
        elif (limiter.rate, limiter.period_ms, limiter.burst) != (rate, period_ms, burst):
            raise LimitConflict(f"{name!r} is limited to {limiter.rate} per {limiter.period_ms} ms, burst "
                                f"{limiter.burst}, not {rate} per {period_ms} ms, burst {burst}: every client of "
                                "a limiter must agree on it")
        emission = limiter.emission_ms
        limit = burst * emission
        start = max(limiter.tat, float(now))
        new_tat = start + cost * emission
        if new_tat - now <= limit + 1e-9:
            limiter.tat = new_tat
            return RateDecision(True, 0, int((limit - (new_tat - now)) / emission + 1e-9))
        retry_ms = max(1, math.ceil(new_tat - limit - now))
        return RateDecision(False, retry_ms, int(max(0.0, limit - (start - now)) / emission + 1e-9))

    def _drop(self, name: str, limiter: RateLimiter) -> None:
        del self.by_name[name]
        n = self.per_principal.get(limiter.principal, 0) - 1
        if n > 0:
            self.per_principal[limiter.principal] = n
        else:
            self.per_principal.pop(limiter.principal, None)

    def _make_room(self, principal: str, now: int) -> None:
        if len(self.by_name) < MAX_LIMITERS and self.per_principal.get(principal, 0) < MAX_LIMITERS_PER_PRINCIPAL:
            return
        if now - self._swept_at >= SWEEP_EVERY_MS:  # one pass over the table at most this often
            self._swept_at = now
            for name, limiter in list(self.by_name.items()):  # drop the full ones
                if limiter.tat <= now:
                    self._drop(name, limiter)
        if len(self.by_name) >= MAX_LIMITERS:
            raise LimitExceeded(f"the server already has {MAX_LIMITERS} live rate limiters")
        if self.per_principal.get(principal, 0) >= MAX_LIMITERS_PER_PRINCIPAL:
            raise LimitExceeded(f"principal {principal!r} already has {MAX_LIMITERS_PER_PRINCIPAL} live rate limiters")


class RateLimitHandler:
    """The RATE_LIMIT operation: ``name, rate, period_ms, burst, cost`` -> ``[admitted,
    retry_after_ms, remaining]`` (see :class:`RateDecision`).  Needs the ``acquire``
    permission on ``name``; refused as an acquire is by a node that may not grant."""

    __slots__ = ("limits", "roles", "table")

    def __init__(self, roles: Any, table: Any) -> None:
        self.roles = roles
        self.table = table
        self.limits = RateLimits(monotonic_ms(), table.epoch)

    def op_rate_limit(self, conn: Any, req_id: int, msg: list) -> None:
        name = P.check_name(msg[2])
        rate, period_ms, burst, cost = check_rate_args(msg[3], msg[4], msg[5], msg[6])
        self.roles.admit(Action.ACQUIRE)
        now = monotonic_ms()
        limits = self.limits
        limits.serving(self.table.epoch, now, self.roles.alone_since)
        decision = limits.take(name, rate, period_ms, burst, cost, conn.principal, now)
        conn.send(P.encode_ok(req_id, list(decision)))
