"""Rate limits from the client: :meth:`Client.limit <fastlock.client.Client.limit>` and
:class:`RateLimiter` (the server side, its algorithm and its bounds are in
:mod:`fastlock.server.ratelimit`).

Every client naming the same limiter shares it: one GCRA per name on the server, read
on the server's clock only.  A request lost with its connection is sent again to the
current primary: a take whose reply was lost may count twice (stricter, never looser).
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, NamedTuple

from .. import protocol as P
from ..errors import InvalidArgument, LockNotAcquired, WrongArgumentType

if TYPE_CHECKING:  # pragma: no cover
    from .client import Client

__all__ = ["RateDecision", "RateLimiter", "rate_args"]


class RateDecision(NamedTuple):
    """The server's answer to one take from a rate limiter."""

    admitted: bool
    retry_after: float  #: seconds until the same take would be admitted (0.0 when admitted)
    remaining: int  #: how many more takes of cost 1 would be admitted now


def rate_args(rate: object, per: object, burst: object, cost: object) -> tuple[int, int, int, int]:
    """``(rate, period_ms, burst, cost)`` for the wire, checked as the server checks them.

    Raises:
        WrongArgumentType: ``rate``, ``burst`` or ``cost`` not an int, ``per`` not a number.
        InvalidArgument: out of range (see :mod:`fastlock.server.ratelimit`).
    """
    period_ms = P.seconds_to_ms(per, "per")
    for value, what in ((rate, "rate"), (burst, "burst"), (cost, "cost")):
        if type(value) is not int:
            raise WrongArgumentType(f"{what} must be an int, not {type(value).__name__}")
        if value < 1:
            raise InvalidArgument(f"{what} must be at least 1, got {value}")
    if cost > burst:  # type: ignore[operator]
        raise InvalidArgument(f"cost ({cost}) cannot exceed burst ({burst}): it would never be admitted")
    return rate, period_ms, burst, cost  # type: ignore[return-value]


class RateLimiter:
    """The limiter ``name``: ``rate`` takes per ``per`` seconds, ``burst`` at once; made by
    :meth:`Client.rate_limiter <fastlock.client.Client.rate_limiter>`."""

    __slots__ = ("client", "name", "rate", "per", "burst")

    def __init__(self, client: Client, name: str, rate: int, burst: int, per: float = 1.0):
        P.check_name(name)
        rate_args(rate, per, burst, 1)
        self.client = client
        self.name = name
        self.rate = rate
        self.per = per
        self.burst = burst

    async def try_take(self, cost: int = 1) -> RateDecision:
        """Take ``cost`` now if the limiter admits it (one request; never waits)."""
        return await self.client.limit(self.name, self.rate, self.burst, per=self.per, cost=cost)

    async def take(self, cost: int = 1, *, timeout: float | None = None) -> None:
        """Take ``cost``, waiting (the server says how long) while it is not admitted.

        Raises:
            LockNotAcquired: not admitted within ``timeout`` seconds (None: wait as long as needed).
        """
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        while True:
            decision = await self.try_take(cost)
            if decision.admitted:
                return
            if deadline is not None and loop.time() + decision.retry_after > deadline:
                raise LockNotAcquired(f"rate limiter {self.name!r} would admit {cost} only in "
                                      f"{decision.retry_after:.3f} s, past the timeout")
            await asyncio.sleep(decision.retry_after)
