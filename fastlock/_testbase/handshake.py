"""The HELLO handshake for tests that speak the protocol by hand (raw sockets).

:func:`raw_hello` and :func:`raw_hello_async` drive a
:class:`~fastlock.auth.ClientHandshake` through a test's own ``call(op,
*args)``, which returns the reply *frame* ``[id, status, value, ...]``: one
round trip without a token, two with one (the token is proved, never sent).
The final frame is returned as it came, after the server's proof was checked
(:class:`~fastlock.auth.ServerNotProven` otherwise); an error frame is
returned as it came, so a test can assert on the refusal.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from fastlock import protocol as P
from fastlock.auth import ClientHandshake, Credentials, Principal, derive_keys, secret_of
from fastlock.auth.handshake import ClientFirst, ServerHandshake

__all__ = ["handshake_for", "key_lines", "prove_in_memory", "raw_hello", "raw_hello_async"]


def handshake_for(token: str | None, *, role: str | None = None, own_node: str | None = None,
                  expect_node: str | None = None, nonce: bytes | None = None) -> ClientHandshake:
    """A client handshake proving ``token`` (None: no credential)."""
    return ClientHandshake(secret_of(token) if token else None, role=role, own_node=own_node,
                           expect_node=expect_node, nonce=nonce)


def raw_hello(call: Callable[..., Any], client_name: str | None, token: str | None, *,
              epoch: int | None = None, **handshake: Any) -> Any:
    """The handshake through a blocking ``call``; returns the final reply frame."""
    hs = handshake_for(token, **handshake)
    extra = () if epoch is None else (epoch,)
    frame = call(P.OP_HELLO, P.PROTOCOL_VERSION, client_name, hs.first(), *extra)
    if hs.needs_challenge and frame is not None and frame[1] == 0:
        frame = call(P.OP_HELLO, P.PROTOCOL_VERSION, client_name, hs.answer(frame[2]), *extra)
    if frame is not None and frame[1] == 0:
        hs.welcome(frame[2])
    return frame


async def raw_hello_async(call: Callable[..., Awaitable[Any]], client_name: str | None, token: str | None, *,
                          epoch: int | None = None, **handshake: Any) -> Any:
    """:func:`raw_hello` through an async ``call``."""
    hs = handshake_for(token, **handshake)
    extra = () if epoch is None else (epoch,)
    frame = await call(P.OP_HELLO, P.PROTOCOL_VERSION, client_name, hs.first(), *extra)
    if hs.needs_challenge and frame is not None and frame[1] == 0:
        frame = await call(P.OP_HELLO, P.PROTOCOL_VERSION, client_name, hs.answer(frame[2]), *extra)
    if frame is not None and frame[1] == 0:
        hs.welcome(frame[2])
    return frame


def key_lines(token: str) -> list[str]:
    """The ``stored_key`` and ``server_key`` lines of a credentials file entry for ``token``
    (for a test that writes a credentials file by hand)."""
    keys = derive_keys(token)
    return [f'stored_key = "{keys.stored_key.hex()}"', f'server_key = "{keys.server_key.hex()}"']


def prove_in_memory(credentials: Credentials, token: str, *, node: str = "test-node",
                    role: str | None = None) -> Principal | None:
    """The principal ``token`` proves to a server holding ``credentials`` (the whole
    handshake in memory, both proofs checked), or None if the server refuses it."""
    server = ServerHandshake(node)
    client = handshake_for(token, role=role)
    first = ClientFirst.parse(client.first() or {})
    found = credentials.lookup(first.principal)
    pending, challenge = server.challenge(first, found.keys if found is not None else None, found)
    server_proof = server.verify(pending, client.answer(challenge))
    if server_proof is None:
        return None
    client.welcome({"server_proof": server_proof})
    return pending.principal
