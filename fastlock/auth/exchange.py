"""The HELLO handshake on an open connection: :func:`say_hello`, used by every
party that speaks to a fastlock server (the client, the ``fastlock`` commands,
a standby's link, the test base)."""

from __future__ import annotations

from typing import Any

from .. import protocol as P
from ..protocol.rpc import RpcConnection
from .handshake import ClientHandshake, endpoint

__all__ = ["say_hello"]


async def say_hello(conn: RpcConnection, client_name: str | None, handshake: ClientHandshake,
                    epoch_hint: int | None = None) -> dict[str, Any]:
    """Say HELLO on ``conn`` as ``handshake`` says (one round trip without a secret,
    two with one) and return the server's hello info once the server proved itself.

    Nothing but HELLO is sent before that; the caller bounds the wait.  The
    handshake binds the endpoint the connection reached (``handshake.dialed``, from
    the transport's peer address unless already set), so a server reached through
    a relay refuses it.  ``conn.handshaking`` is set meanwhile, so its liveness
    watchdog sends no PING (the server closes a connection whose first requests
    are not HELLO).

    Raises:
        ServerNotProven: the server did not prove itself (see
            :class:`~fastlock.auth.handshake.ClientHandshake`).
        FastlockError: the server's refusal (AuthError for a wrong proof).
        ConnectionLost: the connection ended.
    """
    if handshake.dialed is None and conn.transport is not None:
        # the endpoint the socket reached, as this side sees it: the proofs bind it
        handshake.dialed = endpoint(conn.transport.get_extra_info("peername"))
    extra = () if epoch_hint is None else (epoch_hint,)
    conn.handshaking = True
    try:
        reply = await conn.request(P.OP_HELLO, P.PROTOCOL_VERSION, client_name, handshake.first(), *extra)
        if handshake.needs_challenge:
            reply = await conn.request(P.OP_HELLO, P.PROTOCOL_VERSION, client_name, handshake.answer(reply), *extra)
        return handshake.welcome(reply)
    finally:
        conn.handshaking = False
