"""The client's side of priorities and cooperative preemption
(the server's is :mod:`fastlock.server.preemption`): a revoke request pushed to a
holder becomes its lease's :class:`~fastlock.client.lease.RevokeRequest`; an acquire
that may preempt sends its revoke request right behind it."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from ..errors import InvalidArgument, WrongArgumentType
from ..protocol.ops import OP_REQUEST_REVOKE
from ..protocol.priority import MAX_REVOKE_GRACE_MS, MIN_REVOKE_GRACE_MS
from .lease import RevokeRequest

if TYPE_CHECKING:  # pragma: no cover
    from ..protocol.rpc import RpcConnection
    from .acquire import HeldLeases

__all__ = ["deliver_revoke_request", "send_revoke_request", "grace_ms"]


def grace_ms(preempt: Any) -> int:
    """``preempt`` (seconds, a number) as the milliseconds a revoke request gives the holder.

    :raises WrongArgumentType: not a number.  :raises InvalidArgument: outside
        MIN..MAX_REVOKE_GRACE_MS."""
    if isinstance(preempt, bool) or not isinstance(preempt, (int, float)):
        raise WrongArgumentType(f"preempt must be a number of seconds, not {type(preempt).__name__}")
    ms = round(preempt * 1000)
    if not MIN_REVOKE_GRACE_MS <= ms <= MAX_REVOKE_GRACE_MS:
        raise InvalidArgument(f"preempt must be {MIN_REVOKE_GRACE_MS / 1000}..{MAX_REVOKE_GRACE_MS / 1000} s, "
                              f"got {preempt!r}")
    return ms


def send_revoke_request(proto: RpcConnection, name: str, owner: bytes, grace: int) -> None:
    """Send REQUEST_REVOKE for the acquire of ``owner`` just sent on ``proto`` (the server
    reads it after the acquire, so the request is already queued).  Its answer is not
    awaited: an acquire granted at once, or one whose priority is not above the holder's,
    is refused harmlessly."""
    fut = proto.request(OP_REQUEST_REVOKE, name, owner, grace)
    fut.add_done_callback(_consume)


def _consume(fut: asyncio.Future[Any]) -> None:
    if not fut.cancelled():
        fut.exception()


def deliver_revoke_request(held: HeldLeases, payload: list[Any]) -> None:
    """A PUSH_REVOKE_REQUESTED ``[name, token, principal, client, grace_ms]``: hand it to
    the held lease it names (ignored if this client no longer holds it)."""
    name, token, principal, client, grace = payload
    entry = held.by_name.get(name) if type(name) is str else None
    if entry is None or entry.lease.fencing_token != token or type(grace) is not int or grace < 0:
        return
    seconds = grace / 1000.0
    entry.lease.state.on_revoke_request(RevokeRequest(
        principal if type(principal) is str else None, client if type(client) is str else None, seconds,
        asyncio.get_running_loop().time() + seconds))
