"""Ask the other node of a pair what it is now: how a fenced old primary finds the new one.

A primary restarted (or resumed after a pause) while paired with a standby
that fails over by itself starts fenced: the standby may have been promoted
meanwhile.  :func:`ask_peer` asks the node at the standby's address - the
address the standby announced when it attached, kept in ``pairing.json`` -
with the handshake a standby uses with its primary: this node's replica
credential, the standby's node id expected (a node that cannot prove it holds
this node's credential, or is another node, is refused), so an impostor at
that address learns nothing and is never followed.  A primary answers its
role and epoch; a standby answers ``NotPrimary`` naming its primary.  What to
do with the answer is the failover policy's decision
(:meth:`fastlock.server.failover.FailoverPolicy.check_peer`).
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, NamedTuple

from .. import protocol as P
from ..auth import ClientHandshake, say_hello
from ..errors import FastlockError, NotPrimary
from ..protocol import rpc
from ..units import parse_address

if TYPE_CHECKING:  # pragma: no cover
    from .link import PrimaryLink


class PeerAnswer(NamedTuple):
    """What the node at the paired standby's address said.

    ``role`` is ``"primary"`` or ``"promoting"`` (it authenticated this node as a
    replica), ``"standby"`` (it answered ``NotPrimary`` naming ``follows``), or
    None when it could not be asked (``error`` says why).
    ``epoch`` is its epoch (0 when unknown).
    """

    address: str
    role: str | None
    epoch: int
    follows: str | None
    error: str | None


async def ask_peer(link: PrimaryLink, address: str, expect_node: str | None, own_epoch: int,
                   timeout_s: float = 2.0) -> PeerAnswer:
    """Ask the node at ``address`` (``host:port``) for its role and epoch, as ``link``'s
    standby would (its TLS context, replica credential and node id).

    ``expect_node``: the node id that must answer (the paired standby's), or None.
    ``timeout_s`` bounds the connect and the handshake (seconds).  Never raises for
    what the peer does: a refusal, a timeout or a malformed answer comes back as
    ``PeerAnswer(role=None, error=...)``.
    """
    try:
        host, port = parse_address(address, default_port=None)
    except FastlockError as exc:
        return PeerAnswer(address, None, 0, None, f"not an address: {exc}")
    conn: rpc.RpcConnection | None = None
    try:
        conn = await rpc.open_connection(host, port, timeout=timeout_s, ssl=link.tls)
        handshake = ClientHandshake(link.secret, role="replica" if link.secret is not None else None,
                                    own_node=link.own_node, expect_node=expect_node)
        hello = await asyncio.wait_for(say_hello(conn, f"rejoin:{link.name}", handshake, own_epoch), timeout_s)
    except NotPrimary as exc:
        return PeerAnswer(address, "standby", 0, exc.primary, None)
    except (OSError, asyncio.TimeoutError, FastlockError) as exc:
        return PeerAnswer(address, None, 0, None, f"{type(exc).__name__}: {exc}")
    finally:
        if conn is not None:
            conn.close()
    epoch = hello.get("epoch")
    if type(epoch) is not int or not 0 <= epoch <= P.MAX_EPOCH or hello.get("role") not in ("primary", "promoting"):
        return PeerAnswer(address, None, 0, None, f"an unexpected answer: role {hello.get('role')!r}, "
                                                  f"epoch {epoch!r}")
    return PeerAnswer(address, hello["role"], epoch, None, None)
