"""Unread replies are bounded per principal (issue 23, fair shares), against real server processes.

Finding: anonymous connections each pipelining 400 KEY_LIST requests and never reading
took the server's RSS from 90 to 839 MiB with 50 connections, none closed by the
per-connection output cap (32 MiB), and delayed other principals' PINGs.  The
connections of one principal together may leave only its share of unread replies
(``--max-output-bytes-per-principal``; by default a quarter of
``--max-output-bytes-total``, the anonymous principal's a sixteenth: 16 MiB); past it
the connections with the most are closed.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest
from conftest import STALL_S, wait_until
from test_bounded_replies import RSS_BOUND, pipelined, reset_peak_rss, vm_kib

import fastlock
from fastlock._testbase import CredentialsDir
from fastlock._testbase.cluster import RawNode
from fastlock.protocol.ops import OP_KEY_PUT
from fastlock.server.config import ServerConfig, check_limits
from fastlock.server.shares import output_share

#: keys listed (values of 1,000 bytes: a KEY_LIST page of 64 KiB holds about 60 of them)
KEYS = 600
#: KEY_LIST requests each flooding connection pipelines (about 25 MiB of replies, under the
#: 32 MiB per-connection cap, over the anonymous principal's 16 MiB share)
EACH = 400

#: the flood, in its own process: ``argv[2]`` connections to ``argv[1]`` (anonymous) each send
#: HELLO and ``argv[3]`` KEY_LIST requests in one write and never read; prints "sent", then
#: holds them open until a line arrives on stdin (at most 300 s)
FLOODER = r"""
import select, socket, sys, time
import msgpack
from fastlock import protocol as P
from fastlock.protocol.ops import OP_KEY_LIST
address, count, each = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
host, _, port = address.rpartition(":")
payload = msgpack.packb([1, P.OP_HELLO, P.PROTOCOL_VERSION, "flood", None]) + b"".join(
    msgpack.packb([i + 2, OP_KEY_LIST, "k/", 10_000]) for i in range(each))
socks = []
for _ in range(count):
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect((host, int(port)))
    s.settimeout(10)
    s.sendall(payload)
    socks.append(s)
print("sent", flush=True)
select.select([sys.stdin], [], [], 300)
for s in socks:
    s.close()
"""

#: another principal's client, in its own process: PINGs until a line arrives on stdin (at most
#: 300 s); prints "ready" after its first 3 and at the end "<pings> <worst round trip in s>"
PINGER = r"""
import asyncio, sys, time
import fastlock

async def main():
    client = await fastlock.connect(sys.argv[1], client_name="pinger", token=sys.argv[2])
    stop = asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    rtts, deadline = [], time.monotonic() + 300
    while not stop.done() and len(rtts) < 1_000_000 and time.monotonic() < deadline:
        t0 = time.perf_counter()
        await client.ping()
        rtts.append(time.perf_counter() - t0)
        if len(rtts) == 3:
            print("ready", flush=True)
    await client.close()
    print(len(rtts), max(rtts), flush=True)

asyncio.run(main())
"""


async def read_line(proc: subprocess.Popen, timeout: float) -> str:
    return await asyncio.wait_for(asyncio.get_running_loop().run_in_executor(None, proc.stdout.readline), timeout)


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait(10)
    proc.stdout.close()
    proc.stdin.close()


async def anonymous_connections(admin: RawNode) -> bool:
    """Only one anonymous connection is left (the reader's), as the admin's connection reads it."""
    status = await asyncio.wait_for(admin.status(), 10)
    return sum(row["connections"] for row in status["principals"] if row["principal"] == "anonymous") == 1


#: seconds the flooding connections may take to be closed, all of them (a bound for a loaded machine)
CLOSE_ALL_S = 240.0

#: the limit the flood passes: (extra server flags, what the closing's log line says)
BY_SHARE = ([], "its principal's connections leave")
BY_TOTAL = (["--max-output-bytes-per-principal", "0", "--max-output-bytes-total", str(8 << 20)], "all clients leave")


@pytest.mark.one_loop
@pytest.mark.parametrize("connections, limit", [(50, BY_SHARE), (150, BY_SHARE), (50, BY_TOTAL)],
                         ids=["50-share", "150-share", "50-total"])
async def test_unread_replies_are_bounded_by_the_principals_share_and_the_total(server_factory, tmp_path,
                                                                               connections, limit):
    """With the default share (the anonymous principal's: 16 MiB), or with no share and a
    total of 8 MiB, every flooding connection is closed once it passes the limit."""
    creds = CredentialsDir(tmp_path / "creds")
    flags, logged = limit
    srv = server_factory("out", fsync="never", args=["--credentials", creds.file, *flags])
    value = b"v" * 1000
    await asyncio.wait_for(pipelined(srv.address, [[OP_KEY_PUT, f"k/{i:05d}", value, None, 0, None, 0]
                                                   for i in range(KEYS)]), 60)
    # anonymous too, and reads; connected before the flood starts (the flood is about reading), as is
    # the admin's connection that counts the anonymous connections left
    reader = await fastlock.connect(srv.address, client_name="reader")
    admin = await RawNode.open(srv.address, name="usage", token=creds.token("admin"))
    pinger = subprocess.Popen([sys.executable, "-c", PINGER, srv.address, creds.token("app")],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    flooder = subprocess.Popen([sys.executable, "-c", FLOODER, srv.address, str(connections), str(EACH)],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert (await read_line(pinger, 30)).strip() == "ready"
        base = vm_kib(srv.pid, "VmRSS")
        reset_peak_rss(srv.pid)
        assert (await read_line(flooder, 60)).strip() == "sent"
        # a client of the same principal that reads its replies lists every key, page by page, meanwhile
        for _ in range(3):
            listed, after = [], None
            for _ in range(KEYS):  # bounded: a page holds one key at least
                part = await reader.list_prefix("k/", limit=10_000, after=after)
                listed += [kv.key for kv in part]
                if not part.more:
                    break
                after = part.cursor
            assert listed == [f"k/{i:05d}" for i in range(KEYS)]
        # every flooding connection leaves more than the share unread: each is closed in turn
        # (the reader is the one anonymous connection left).  Before its replies count as unread,
        # each connection fills its kernel send buffer (megabytes on loopback): 150 connections
        # are thousands of KEY_LIST pages to build first, 10 s on a quiet machine, 40 s and more on
        # two loaded cores - hence the generous bound (memory and the other principal's PINGs are
        # checked below whatever the time)
        await wait_until(lambda: anonymous_connections(admin), CLOSE_ALL_S, "every flooding connection closed")
        growth = (vm_kib(srv.pid, "VmHWM") - base) << 10
        assert growth < RSS_BOUND, f"RSS grew {growth >> 20} MiB"
        pinger.stdin.write("stop\n")
        pinger.stdin.flush()
        pings, worst = (await read_line(pinger, 30)).split()
        assert float(worst) < STALL_S, f"worst PING {float(worst) * 1000:.1f} ms over {pings} pings"
        assert any(logged in line and "'anonymous'" in line for line in srv.lines)
    finally:
        await reader.close()
        await admin.close()
        stop(flooder)
        stop(pinger)


def test_the_share_defaults_and_their_checks():
    app, anonymous = output_share(ServerConfig(), False), output_share(ServerConfig(), False)
    assert (app.limit_for("app"), anonymous.limit_for("anonymous")) == (64 << 20, 16 << 20)
    assert output_share(ServerConfig(), True).limit_for("anonymous") == 256 << 20
    assert output_share(ServerConfig(max_output_bytes_per_principal=0), False).limit_for("app") == 0
    assert output_share(ServerConfig(max_output_bytes_per_principal=8 << 20), True).limit_for("anonymous") == 8 << 20
    for bad in (dict(max_output_bytes_total=0), dict(max_output_bytes_per_principal=-1)):
        with pytest.raises(ValueError):
            check_limits(ServerConfig(**bad))


@pytest.mark.one_loop
async def test_an_admin_sees_the_unread_replies_counted_and_a_client_does_not(server_factory, tmp_path):
    creds = CredentialsDir(tmp_path / "creds")
    srv = server_factory("status", fsync="never", args=["--credentials", creds.file])
    seen = {}
    for principal in ("admin", "app"):
        node = await RawNode.open(srv.address, name="status", token=creds.token(principal))
        try:
            seen[principal] = (await asyncio.wait_for(node.status(), 10))["limits"]
        finally:
            await node.close()
    assert seen["admin"]["unread_output_bytes"] == 0
    assert seen["admin"]["max_output_bytes_total"] == 256 << 20
    assert "unread_output_bytes" not in seen["app"] and seen["app"]["max_output_bytes_total"] == 256 << 20
