"""Nothing but HELLO goes to a server before the handshake completes, however late it answers.

A client's liveness watchdog pings a silent server after a third of its
``request_timeout``; a server that takes longer than that to answer the HELLO
(a stalled or frozen server) must still see nothing but HELLO until the
handshake ends, or it closes the connection ("the first request must be
HELLO").  The server here is a real process behind the fault proxy, which
holds (black-holes) the client's connection for longer than the ping interval.
"""

from __future__ import annotations

import asyncio
import time

import msgpack
import pytest

import fastlock
from fastlock import protocol as P
from fastlock._testbase import CredentialsDir, ServerProcess, TcpProxy, free_port
from fastlock._testbase.cluster import run
from fastlock.errors import ConnectionLost

#: the client's liveness timeout (seconds): a ping would go out after a third of it
REQUEST_TIMEOUT = 1.5


def _frames(data: bytes) -> list:
    """Every msgpack frame in ``data``, in order."""
    unpacker = msgpack.Unpacker(raw=False)
    unpacker.feed(data)
    return list(unpacker)


@pytest.fixture
def server_and_proxy(tmp_path):
    creds = CredentialsDir(tmp_path / "creds")
    port = free_port()  # the proxy's: the server is told it is reachable there
    server = ServerProcess(tmp_path / "s", args=[*creds.server_args("node-1"),
                                                 "--reachable-as", f"127.0.0.1:{port}"]).start()
    proxy = TcpProxy(server.address, record_bytes=1 << 20, port=port).start()
    try:
        yield creds, proxy
    finally:
        proxy.close()
        server.stop()


def test_a_server_answering_the_hello_late_sees_nothing_but_hello_before_the_handshake_ends(server_and_proxy):
    creds, proxy = server_and_proxy
    proxy.blackhole()  # the server is frozen for the client: its HELLO waits, unanswered

    async def main():
        loop = asyncio.get_running_loop()
        connecting = asyncio.ensure_future(fastlock.connect(proxy.address, token=creds.token("app"),
                                                            connect_timeout=10.0,
                                                            request_timeout=REQUEST_TIMEOUT).__aenter__())
        # hold the server silent past the client's ping interval (a third of request_timeout),
        # well short of the full timeout that drops the connection
        held_until = loop.time() + REQUEST_TIMEOUT * 2 / 3
        while loop.time() < held_until and not connecting.done():
            await asyncio.wait([connecting], timeout=held_until - loop.time())
        assert not connecting.done(), connecting
        proxy.heal()
        client = await asyncio.wait_for(connecting, 10)
        try:
            lease = await client.acquire("race/1", ttl=5.0, wait=0)
            await client.release(lease)
        finally:
            await client.close()

    run(main())
    ops = [frame[1] for frame in _frames(proxy.recorded()[0])]
    # the token handshake is two HELLOs; a PING among them would have closed the connection
    assert ops[:2] == [P.OP_HELLO, P.OP_HELLO], ops
    assert P.OP_ACQUIRE in ops[2:], ops


def test_a_server_that_never_answers_the_hello_is_dropped_after_the_liveness_timeout(server_and_proxy):
    creds, proxy = server_and_proxy
    proxy.blackhole()

    async def main():
        started = time.monotonic()
        with pytest.raises(ConnectionLost) as info:
            async with fastlock.connect(proxy.address, token=creds.token("app"), connect_timeout=30.0,
                                        request_timeout=REQUEST_TIMEOUT):
                pass
        return time.monotonic() - started, str(info.value)

    waited, message = run(main())
    # the liveness timeout ended the wait, not the 30 s connect timeout: the message names it
    assert f"no handshake reply within {REQUEST_TIMEOUT:g} s" in message, (message, waited)
    assert "first request must be HELLO" not in message
