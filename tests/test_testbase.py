"""The test base itself: the fault proxy and the history checkers.

The proxy is checked against a loopback echo target (a partition by label
freezes only those connections, a cut closes only those, heal forwards what
was held, a flood into a target that does not read stops being read), the
checkers against small hand-written histories, each with the violation it
must report and a clean variant it must accept.
"""

from __future__ import annotations

import asyncio
import socket
import time

import pytest

from fastlock import protocol as P
from fastlock._testbase import (
    GrantRecord,
    Holding,
    StoreWrite,
    TcpProxy,
    check_grants,
    check_holdings,
    check_store,
    classify_fastlock,
)

E1 = 1 << 40  # the first token of epoch 1


# --------------------------------------------------------------------------- proxy


async def _echo_server():
    async def handle(reader, writer):
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            writer.close()

    return await asyncio.start_server(handle, "127.0.0.1", 0)


def _by_first_byte(first: bytes) -> str:
    return "repl" if first.startswith(b"R") else "other"


async def _open(proxy: TcpProxy, first: bytes):
    reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
    writer.write(first)
    return reader, writer


async def _echoes(reader, writer, data: bytes, timeout: float) -> bool:
    writer.write(data)
    try:
        got = b""
        while len(got) < len(data):
            chunk = await asyncio.wait_for(reader.read(65536), timeout)
            if not chunk:
                return False
            got += chunk
        return True
    except asyncio.TimeoutError:
        return False


async def test_proxy_blackholes_cuts_and_heals_by_label():
    server = await _echo_server()
    port = server.sockets[0].getsockname()[1]
    proxy = TcpProxy(("127.0.0.1", port), classify=_by_first_byte).start()
    try:
        repl = await _open(proxy, b"R")
        other = await _open(proxy, b"O")
        assert await repl[0].readexactly(1) == b"R" and await other[0].readexactly(1) == b"O"
        assert proxy.count("repl") == 1 and proxy.count("other") == 1

        assert proxy.blackhole("repl") == 1
        assert not await _echoes(*repl, b"lost?", 0.3), "a black-holed link forwarded"
        assert await _echoes(*other, b"fine", 2.0), "a link with another label stopped"
        late = await _open(proxy, b"R-late")  # a new connection with the label is held
        assert not await _echoes(*late, b"!", 0.3)

        proxy.heal()  # what waited is delivered, in order
        assert await asyncio.wait_for(repl[0].readexactly(5), 2.0) == b"lost?"
        assert await asyncio.wait_for(late[0].readexactly(7), 2.0) == b"R-late!"

        assert proxy.cut("repl") == 2
        assert await asyncio.wait_for(repl[0].read(), 2.0) == b""  # closed by the proxy
        assert await _echoes(*other, b"still", 2.0)
        again = await _open(proxy, b"R2")  # after a cut, new connections are forwarded
        assert await asyncio.wait_for(again[0].readexactly(2), 2.0) == b"R2"
        for _, w in (repl, other, late, again):
            w.close()
    finally:
        proxy.close()
        server.close()


def test_proxy_does_not_buffer_without_bound():
    """A client floods through the proxy into a target that never reads: the
    proxy stops reading from the client, so the client's sends block after
    the kernel buffers fill, instead of the proxy holding everything."""
    target = socket.create_server(("127.0.0.1", 0))
    proxy = TcpProxy(target.getsockname()).start()
    client = socket.create_connection(("127.0.0.1", proxy.port))
    accepted, _ = target.accept()  # accepted, never read
    try:
        client.setblocking(False)
        chunk = b"x" * 65536
        sent, limit = 0, 256 << 20
        deadline = time.monotonic() + 20
        blocked_since = None
        while sent < limit and time.monotonic() < deadline:
            try:
                sent += client.send(chunk)
                blocked_since = None
            except BlockingIOError:
                # blocked for 0.5 s in a row: the proxy is not reading any more
                blocked_since = blocked_since or time.monotonic()
                if time.monotonic() - blocked_since > 0.5:
                    break
                time.sleep(0.01)
        assert sent < limit, f"the proxy read {sent} bytes that its target never took"
        assert blocked_since is not None
    finally:
        client.close()
        accepted.close()
        proxy.close()
        target.close()


def test_classify_fastlock_tells_a_standby_from_a_client():
    standby_hello = P.packb([1, P.OP_HELLO, P.PROTOCOL_VERSION, "standby:b@node-1", None, 3])
    client_hello = P.packb([1, P.OP_HELLO, P.PROTOCOL_VERSION, "billing", None])
    assert classify_fastlock(standby_hello) == "replication"
    assert classify_fastlock(client_hello) == "client"
    assert classify_fastlock(b"\xc1garbage") == "client"
    assert classify_fastlock(standby_hello[:3]) == "client"  # undecidable start: not a standby


# --------------------------------------------------------------------------- checkers


def test_check_store_accepts_serial_sections_and_reports_each_violation():
    ok = [StoreWrite(1, "a", 5, "w1#1", 1.0), StoreWrite(2, "a", 5, "w1#1", 1.1),
          StoreWrite(3, "a", 7, "w2#1", 1.2), StoreWrite(4, "b", 1, "w3#1", 1.15)]
    assert check_store(ok) == []

    backwards = ok + [StoreWrite(5, "a", 6, "w3#2", 1.3)]
    assert any("accepted at seq 5 after token 0:7" in v for v in check_store(backwards))

    twice = ok + [StoreWrite(5, "a", 7, "w4#1", 1.3)]
    assert any("accepted from two holdings" in v for v in check_store(twice))

    interleaved = [StoreWrite(1, "a", 5, "w1#1", 1.0), StoreWrite(2, "a", 6, "w2#1", 1.1),
                   StoreWrite(3, "a", 6, "w2#1", 1.2), StoreWrite(4, "a", 7, "w3#1", 1.25),
                   StoreWrite(5, "a", 7, "w3#1", 1.3)]
    assert check_store(interleaved) == []
    interleaved[2] = StoreWrite(3, "a", 6, "w1#1", 1.2)  # w1 writes again after w2 began (same token as w2)
    assert any("interleave" in v or "two holdings" in v for v in check_store(interleaved))

    in_time = [StoreWrite(1, "a", 5, "w1#1", 1.0), StoreWrite(2, "a", 5, "w1#1", 2.0),
               StoreWrite(3, "a", 6, "w2#1", 1.5)]
    assert any("overlap in time" in v for v in check_store(in_time))


def test_check_grants_reports_reused_and_backward_tokens():
    ok = [GrantRecord("a", 5, "w1#1", 0.0, 0.1), GrantRecord("a", 6, "w2#1", 0.05, 0.3),
          GrantRecord("a", E1 + 1, "w1#2", 0.4, 2.0)]
    assert check_grants(ok) == []
    # concurrent acquires may be granted in any order: sent before the other was received
    assert check_grants([GrantRecord("a", 6, "w1", 0.0, 0.1), GrantRecord("a", 5, "w2", 0.05, 0.2)]) == []

    reused = ok + [GrantRecord("a", 6, "w3#1", 3.0, 3.1)]
    assert any("granted twice" in v for v in check_grants(reused))

    backwards = ok + [GrantRecord("a", 7, "w3#1", 2.5, 2.6)]  # epoch 0 after an epoch-1 grant
    [v] = check_grants(backwards)
    assert "went backwards" in v and "1:1" in v and "0:7" in v


def test_check_holdings_reports_two_believed_holders():
    ok = [Holding("a", 5, "w1#1", 0.0, 1.0), Holding("a", 6, "w2#1", 1.0, 2.0), Holding("b", 1, "w3", 0.5, 1.5)]
    assert check_holdings(ok) == []
    long_first = [Holding("a", 5, "w1#1", 0.0, 5.0), Holding("a", 6, "w2#1", 1.0, 2.0),
                  Holding("a", 7, "w3#1", 3.0, 4.0)]
    assert len(check_holdings(long_first)) == 2


if __name__ == "__main__":  # pragma: no cover
    pytest.main([__file__, "-q"])
