"""Invariant 9's bounds: everything a peer can make the server hold is limited.

Each test drives a real ``fastlock serve`` process over loopback with raw
sockets (a peer that misbehaves does not use the client library) and checks
both sides of the limit: the peer gets a clear error or a logged close, and the
server keeps serving everyone else with its memory bounded.
"""

from __future__ import annotations

import errno
import os
import re
import socket
import stat
import subprocess
import time

import msgpack
import pytest
from conftest import STALL_S
from hypothesis import given, settings
from hypothesis import strategies as st
from rawwire import RawWire

from fastlock import protocol as P
from fastlock._testbase import CredentialsDir, ServerProcess, raw_hello
from fastlock.errors import LimitExceeded, ProtocolError, Unavailable

# ---------------------------------------------------------------------------------------------
# raw peers


class Raw:
    """A hand-driven peer on a blocking socket: raw msgpack frames, no client library."""

    def __init__(self, address: str, *, hello: bool = True, name: str = "raw", rcvbuf: int | None = None,
                 timeout: float = 10.0, credential: str | None = None):
        host, port = address.rsplit(":", 1)
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        if rcvbuf is not None:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        self.sock.settimeout(timeout)
        self.sock.connect((host, int(port)))
        self.unpacker = msgpack.Unpacker(raw=False)
        self.next_id = 1
        if hello:
            reply = raw_hello(self.call, name, credential)
            assert reply[1] == 0, reply

    def send(self, op: int, *args) -> int:
        rid = self.next_id
        self.next_id += 1
        self.sock.sendall(msgpack.packb([rid, op, *args], use_bin_type=True))
        return rid

    def recv(self):
        """The next frame, or None at EOF."""
        while True:
            for msg in self.unpacker:
                return msg
            try:
                data = self.sock.recv(1 << 16)
            except ConnectionResetError:
                return None
            if not data:
                return None
            self.unpacker.feed(data)

    def call(self, op: int, *args):
        rid = self.send(op, *args)
        while True:
            msg = self.recv()
            if msg is None or msg[0] in (rid, 0):
                return msg

    def closed_by_server(self) -> bool:
        """Read until EOF (True) or the socket timeout (False)."""
        try:
            while self.sock.recv(1 << 16):
                pass
        except ConnectionResetError:
            pass
        except TimeoutError:
            return False
        return True

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> Raw:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def fake_replica(address: str, *, rcvbuf: int = 4096, from_lsn: int = 0, incarnation=None,
                 name: str = "fake@0123456789abcdef", credential=None) -> tuple[Raw, dict]:
    """A peer that attaches as a standby: ``credential`` is a replica principal's token."""
    raw = Raw(address, hello=False, rcvbuf=rcvbuf)
    hello = raw_hello(raw.call, f"standby:{name}", credential)
    assert hello[1] == 0, hello
    reply = raw.call(P.OP_REPLICATE, from_lsn, incarnation, 0, name)
    assert reply is not None and reply[1] == 0, reply
    return raw, reply[2]


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError("no VmRSS")


def error_of(reply) -> tuple[int, str]:
    assert reply is not None and reply[1] != 0, reply
    return reply[1], reply[2]


def acquire_args(name: str, ttl_ms: int = 60_000, wait_ms: int = 0) -> tuple:
    return (name, os.urandom(16), ttl_ms, wait_ms, 0, None)


# ---------------------------------------------------------------------------------------------
# 1. bounded decoding


NESTED_HEADERS = b"\xdc\xff\xff" * 1024  # 1,024 nested array16(65535) headers: 3 KiB, never completed


@pytest.mark.parametrize("after_hello", [False, True], ids=["before-hello", "after-hello"])
def test_nested_header_frames_keep_server_memory_bounded(server, after_hello):
    """Each of these frames used to cost ~68 MiB (the Unpacker preallocated every
    declared array); now the declared lengths and the nesting are refused."""
    before = rss_kib(server.pid)
    peers = []
    try:
        for _ in range(30):
            raw = Raw(server.address, hello=after_hello)
            raw.sock.sendall(NESTED_HEADERS)
            # one level deeper than requests need, with short arrays: refused by the depth bound
            raw.sock.sendall(b"\x91" * 64)
            peers.append(raw)
        for raw in peers:
            reply = raw.recv()
            assert reply is not None and reply[0] == 0 and reply[1] == ProtocolError.code, reply
            assert "max_array_len" in reply[2] or "deeper" in reply[2] or "elements" in reply[2], reply
            assert raw.closed_by_server()
        grown_mib = (rss_kib(server.pid) - before) / 1024
        print(f"\n30 nested-header connections: server RSS {before} KiB -> {rss_kib(server.pid)} KiB")
        assert grown_mib < 20, f"30 nested-header connections grew the server by {grown_mib:.1f} MiB"
        with Raw(server.address) as ok:
            assert ok.call(P.OP_ACQUIRE, *acquire_args("still-serving"))[1] == 0
    finally:
        for raw in peers:
            raw.close()


def test_deep_nesting_with_short_arrays_is_refused_as_it_arrives(server):
    """fixarray(15) headers one byte at a time, never completing a frame: the frame
    walker refuses the fourth level before msgpack builds it."""
    raw = Raw(server.address)
    try:
        raw.sock.sendall(b"\x92\x01")  # [1, ... : a request id, then nesting
        for _ in range(8):
            try:
                raw.sock.sendall(b"\x9f")
            except (BrokenPipeError, ConnectionResetError):
                break
            time.sleep(0.01)  # separate reads: the frame is incomplete after each
        reply = raw.recv()
        assert reply is not None and reply[1] == ProtocolError.code and "deeper" in reply[2], reply
    finally:
        raw.close()


def test_frame_bytes_are_counted_across_pieces(server_factory):
    """A frame sent in pieces is bounded as a whole (msgpack's buffer limit alone
    only bounds what is not yet decoded).  (The frame bound holds a value of --max-value-bytes,
    so that is lowered too.)"""
    srv = server_factory("frames", args=["--max-frame-bytes", "16384", "--max-value-bytes", "8192"])
    raw = Raw(srv.address)
    try:
        raw.sock.sendall(b"\x9f\x01\x02")  # a 15-element request that never ends...
        sent = 0
        try:
            for _ in range(12):  # ... of 4 KiB strings, one per read
                raw.sock.sendall(b"\xda\x0f\xa0" + b"x" * 4000)
                sent += 1
                time.sleep(0.01)
        except (BrokenPipeError, ConnectionResetError):
            pass
        reply = raw.recv()
        assert reply is not None and reply[1] == ProtocolError.code and "16384" in reply[2], reply
    finally:
        raw.close()


# ---------------------------------------------------------------------------------------------
# 2. connections


def _open_idle(address: str, n: int) -> list[socket.socket]:
    host, port = address.rsplit(":", 1)
    socks = []
    for _ in range(n):
        s = socket.create_connection((host, int(port)), timeout=10)
        socks.append(s)
    return socks


def _all_closed_by_server(socks: list[socket.socket], timeout: float) -> int:
    """How many of ``socks`` see EOF (or a reset) within ``timeout`` seconds in all."""
    import selectors

    sel = selectors.DefaultSelector()
    for s in socks:
        s.setblocking(False)
        sel.register(s, selectors.EVENT_READ)
    closed = 0
    deadline = time.monotonic() + timeout
    while closed < len(socks) and time.monotonic() < deadline:
        for key, _ in sel.select(timeout=max(0.0, deadline - time.monotonic())):
            try:
                data = key.fileobj.recv(4096)
            except ConnectionResetError:
                data = b""
            if not data:
                sel.unregister(key.fileobj)
                closed += 1
    sel.close()
    return closed


def test_five_thousand_connections_without_hello_are_closed_at_the_deadline(server_factory):
    srv = server_factory("idle", args=["--hello-timeout", "1", "--max-connections-per-address", "10000",
                                       "--max-connections", "6000"])
    t0 = time.monotonic()
    socks = _open_idle(srv.address, 5000)
    try:
        opened_s = time.monotonic() - t0
        closed = _all_closed_by_server(socks, timeout=opened_s + 15)
        assert closed == 5000, f"only {closed} of 5000 handshake-less connections were closed"
        srv.wait_for_log(r"did not complete HELLO within 1000 ms", timeout=5)
        # the closes are logged, but not one line each (a flood cannot flood the log)
        assert sum("did not complete HELLO" in line for line in srv.lines) <= 3
        with Raw(srv.address) as ok:
            status = ok.call(P.OP_STATUS)[2]
            assert status["sessions"] == 1
            assert status["limits"]["connections_without_hello"] == 0
            assert status["limits"]["max_connections"] == 6000
    finally:
        for s in socks:
            s.close()


def test_the_open_files_limit_is_raised_at_start(server_factory):
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard <= 256:
        pytest.skip("needs a finite hard open-files limit above 256")
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))  # the server inherits it
    try:
        srv = server_factory("nofile")
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    srv.wait_for_log(rf"open-files limit raised from 256 to {hard}", timeout=5)
    with open(f"/proc/{srv.pid}/limits") as f:
        line = next(line for line in f if line.startswith("Max open files"))
    assert line.split()[3:5] == [str(hard), str(hard)], line
    srv.wait_for_log(rf"connection limits: {min(10_000, hard - 64 - 16)} in all", timeout=5)


def test_a_client_gets_in_at_the_connection_limit_and_the_standby_keeps_replicating(server_factory, tmp_path):
    """At --max-connections, the oldest connection without HELLO makes room for a
    new one (a handshake reserve); the standby's connection, past HELLO, stays."""
    creds = CredentialsDir(tmp_path / "credentials", replicas=2)
    primary = server_factory("primary", args=["--max-connections", "40", "--hello-timeout", "60",
                                              "--max-connections-per-address", "1000", *creds.server_args("node-1")])
    standby = server_factory("standby", args=["--standby-of", primary.address, *creds.server_args("node-2")])
    primary.wait_for_log(r"standby .* attached", timeout=10)
    socks = _open_idle(primary.address, 60)  # more than the limit, none of them says HELLO
    try:
        primary.wait_for_log(r"connection limit 40 reached: closing", timeout=5)
        with Raw(primary.address) as client:  # a legitimate client still gets in
            reply = client.call(P.OP_ACQUIRE, *acquire_args("at-the-limit"))
            assert reply[1] == 0, reply
            token = reply[2][0]
        deadline = time.monotonic() + 10
        while True:  # the grant reached the standby: it still replicates
            with Raw(standby.address) as s:
                repl = s.call(P.OP_STATUS)[2]["replication"]
            if repl["connected"] and repl["applied_lsn"] >= 1 and repl["primary_last_lsn"] <= repl["applied_lsn"]:
                break
            assert time.monotonic() < deadline, f"standby stopped replicating: {repl}"
            time.sleep(0.05)
        with Raw(standby.address) as s:  # a standby redirects: ask it whether it has the lease
            assert s.call(P.OP_STATUS)[2]["last_token"] == token
    finally:
        for s in socks:
            s.close()


def test_connections_past_hello_are_not_evicted_a_new_client_is_refused_at_hello(server_factory):
    """Clients past HELLO fill --max-connections: a new connection gets in (the slots
    reserved for replicas and admins), but its HELLO as a client is refused, naming the
    flag, and the server closes it; the established connections keep working."""
    srv = server_factory("full", args=["--max-connections", "4"])
    peers = [Raw(srv.address) for _ in range(4)]
    try:
        extra = Raw(srv.address, hello=False, timeout=5)
        _limit_error(extra.call(P.OP_HELLO, P.PROTOCOL_VERSION, "extra", None), "--max-connections", 4)
        assert extra.closed_by_server()
        extra.close()
        srv.wait_for_log(r"refusing HELLO from .*--max-connections", timeout=5)
        for raw in peers:  # every established connection still works
            assert raw.call(P.OP_PING)[1] == 0
    finally:
        for raw in peers:
            raw.close()


def test_connections_per_address_are_capped(server_factory):
    srv = server_factory("peraddr", args=["--max-connections-per-address", "3"])
    peers = [Raw(srv.address) for _ in range(3)]
    try:
        for _ in range(50):
            extra = Raw(srv.address, hello=False, timeout=5)
            assert extra.closed_by_server()
            extra.close()
        srv.wait_for_log(r"already 3 connections from this address", timeout=5)
        assert sum("refusing connection" in line for line in srv.lines) == 1  # at most one line per 10 s
        peers[0].close()
        deadline = time.monotonic() + 5
        while True:  # once one closes, a new one is admitted
            again = Raw(srv.address, hello=False, timeout=5)
            reply = again.call(P.OP_HELLO, P.PROTOCOL_VERSION, "again", None)
            again.close()
            if reply is not None and reply[1] == 0:
                break
            assert time.monotonic() < deadline, "the per-address count never went down"
            time.sleep(0.05)
    finally:
        for raw in peers:
            raw.close()


def test_idle_timeout_spares_waiters_and_watchers(server_factory):
    srv = server_factory("idletimeout", args=["--idle-timeout", "0.5"])
    holder = Raw(srv.address, name="holder")
    waiter = Raw(srv.address, name="waiter")
    watcher = Raw(srv.address, name="watcher")
    idle = Raw(srv.address, name="idle", timeout=5)
    try:
        assert holder.call(P.OP_ACQUIRE, *acquire_args("idle/lock"))[1] == 0
        waiter.send(P.OP_ACQUIRE, *acquire_args("idle/lock", wait_ms=-1))
        assert watcher.call(P.OP_WATCH, "idle/lock")[1] == 0
        assert idle.closed_by_server()  # nothing pending: closed after ~0.5 s
        srv.wait_for_log(r"idle for 500 ms or more", timeout=5)
        # the holder sent nothing either and held no waiter: closed too (its lease stays)
        assert holder.closed_by_server()
        assert watcher.call(P.OP_PING)[1] == 0
        assert waiter.call(P.OP_PING)[1] == 0  # still connected while it waits
        with Raw(srv.address) as other:
            info = other.call(P.OP_HOLDER, "idle/lock")[2]
            assert info is not None  # ownership goes by lease, not by connection
            assert other.call(P.OP_STATUS)[2]["waiters"] == 1  # the waiter's acquire is still queued
    finally:
        for raw in (holder, waiter, watcher, idle):
            raw.close()


# ---------------------------------------------------------------------------------------------
# 3. output caps, replicas included


def test_a_replica_that_never_reads_is_disconnected_and_memory_stays_bounded(server_factory, tmp_path):
    creds = CredentialsDir(tmp_path / "credentials", replicas=2)
    srv = server_factory("noread", args=["--max-replica-output-bytes", str(1 << 20), *creds.server_args("node-1")])
    before = rss_kib(srv.pid)
    raw, info = fake_replica(srv.address, credential=creds.token("node-2"))
    try:
        assert info["mode"] == "snapshot"
        request = msgpack.packb([9, P.OP_STATUS]) * 1000
        deadline = time.monotonic() + 20
        raw.sock.settimeout(0.2)
        disconnected = False
        while time.monotonic() < deadline and not disconnected:
            try:
                raw.sock.sendall(request)
            except (BrokenPipeError, ConnectionResetError):
                disconnected = True
            except TimeoutError:
                pass
            disconnected = disconnected or any("too far behind" in line for line in srv.lines)
        srv.wait_for_log(r"standby on .* is too far behind \(\d+ bytes unsent, limit \d+\)", timeout=5)
        grown_mib = (rss_kib(srv.pid) - before) / 1024
        print(f"\nnever-reading replica: server RSS {before} KiB -> {rss_kib(srv.pid)} KiB")
        assert grown_mib < 40, f"a never-reading replica grew the server by {grown_mib:.0f} MiB"
        with Raw(srv.address, credential=creds.token("admin")) as ok:  # the admin sees the standbys
            assert ok.call(P.OP_ACQUIRE, *acquire_args("after-fake-replica"))[1] == 0
            assert ok.call(P.OP_STATUS)[2]["replication"]["standbys"] == []
    finally:
        raw.close()


def test_a_standby_that_falls_behind_is_disconnected_and_resyncs(server_factory, tmp_path):
    creds = CredentialsDir(tmp_path / "credentials", replicas=2)
    primary = server_factory("primary", args=["--max-replica-output-bytes", str(256 << 10),
                                              *creds.server_args("node-1")])
    standby = server_factory("standby", args=["--standby-of", primary.address, *creds.server_args("node-2")])
    primary.wait_for_log(r"standby .* attached", timeout=10)
    standby.pause()  # it stops reading; the kernel buffers fill, then the primary's buffer
    try:
        with Raw(primary.address) as client:
            name = "behind/" + "n" * 400
            deadline = time.monotonic() + 30
            i = 0
            while not any("too far behind" in line for line in primary.lines):
                assert time.monotonic() < deadline, "the primary never dropped the stalled standby"
                ids = [client.send(P.OP_ACQUIRE, *acquire_args(f"{name}/{i + k}", ttl_ms=600_000))
                       for k in range(200)]
                for _ in ids:
                    assert client.recv()[1] == 0
                i += 200
            last = client.call(P.OP_STATUS)[2]["wal"]["last_lsn"]
            print(f"\nstandby dropped after {i} acquires: "
                  + next(line for line in primary.lines if "too far behind" in line))
    finally:
        standby.resume()
    deadline = time.monotonic() + 20
    while True:  # it reconnects and catches up with everything it missed
        with Raw(standby.address) as s:
            repl = s.call(P.OP_STATUS)[2]["replication"]
        if repl["connected"] and repl["applied_lsn"] >= last:
            break
        assert time.monotonic() < deadline, f"the standby did not resync: {repl}, primary at LSN {last}"
        time.sleep(0.1)


# ---------------------------------------------------------------------------------------------
# 4. REPLICATE from LSN 1 on a large log does not block the loop


def _build_log(directory, records: int) -> int:
    """Write ``records`` WAL records through the WAL API (fsync never); return the last LSN."""
    import asyncio

    from fastlock.wal import WriteAheadLog

    async def write() -> int:
        wal = WriteAheadLog(directory, fsync="never")
        wal.open()
        wal.start()
        owner = os.urandom(16)
        token = 1
        for i in range(records // 2):
            name = f"big/{i % 5000}"
            wal.log_grant(name, token, owner, 60_000, 0, "builder", None)
            wal.log_release(name, token)
            token += 1
            if i % 10_000 == 0:
                await asyncio.sleep(0)
        await wal.sync()
        last = wal.stats()["last_lsn"]
        await wal.close()
        return last

    return asyncio.run(write())


def test_replicate_from_lsn_1_on_a_large_log_keeps_other_clients_served(server_factory, tmp_path):
    """The backlog is read off the event loop in chunks: while a standby streams
    600,000 records from LSN 1 (2.3-2.6 s of blocked loop before), another
    client's PINGs keep being answered within 50 ms."""
    import threading

    data = tmp_path / "big"
    last = _build_log(data, 600_000)
    creds = CredentialsDir(tmp_path / "credentials", replicas=2)
    srv = server_factory("big", args=["--snapshot-every", "10000000", *creds.server_args("node-1")])
    assert srv.data_dir.resolve() == data.resolve()
    # learn the incarnation (a snapshot attach), then ask for the whole log from LSN 1
    first, info = fake_replica(srv.address, rcvbuf=1 << 20, credential=creds.token("node-2"))
    first.close()
    latencies: list[float] = []
    stop = threading.Event()

    def ping_forever() -> None:
        with Raw(srv.address, name="pinger") as pinger:
            while not stop.is_set():
                t0 = time.perf_counter()
                assert pinger.call(P.OP_PING)[1] == 0
                latencies.append(time.perf_counter() - t0)

    thread = threading.Thread(target=ping_forever, daemon=True)
    thread.start()
    raw = None
    try:
        deadline = time.monotonic() + 10
        while len(latencies) < 10:
            assert time.monotonic() < deadline and thread.is_alive()
            time.sleep(0.001)
        during = len(latencies)
        mark = len(srv.lines)
        raw, info = fake_replica(srv.address, from_lsn=1, incarnation=info["incarnation"], rcvbuf=1 << 20,
                                 credential=creds.token("node-2"))
        assert info["mode"] == "stream"
        raw.sock.settimeout(0.05)
        received = 0
        deadline = time.monotonic() + 60
        while not any("caught up" in line for line in srv.lines[mark:]):
            assert time.monotonic() < deadline, "the standby never caught up"
            try:
                received += len(raw.sock.recv(1 << 20))  # the standby reads what arrives
            except TimeoutError:
                pass
        stop.set()
        thread.join(10)
        line = srv.wait_for_log(r"caught up: (\d+) records from LSN 1", timeout=1, start=mark)
        assert int(re.search(r"caught up: (\d+) records", line).group(1)) >= last - 1
        worst = max(latencies[during:])
        print(f"\n{line}\n{len(latencies) - during} pings meanwhile, worst {worst * 1000:.1f} ms, "
              f"{received} bytes streamed")
        assert len(latencies) - during > 10 and received > 10 << 20
        # served throughout (the worst PING itself: python -m benches.limits backlog)
        assert worst < STALL_S, f"a PING waited {worst * 1000:.1f} ms while the backlog streamed"
    finally:
        stop.set()
        if raw is not None:
            raw.close()


# ---------------------------------------------------------------------------------------------
# 5. global caps and per-principal quotas


def _limit_error(reply, flag: str, value: int) -> None:
    code, message = error_of(reply)
    assert code == LimitExceeded.code, reply
    assert flag in message and str(value) in message, message


def test_max_waiters_is_global(server_factory):
    srv = server_factory("waiters", args=["--max-waiters", "3"])
    holder, a, b = Raw(srv.address), Raw(srv.address), Raw(srv.address)
    try:
        assert holder.call(P.OP_ACQUIRE, *acquire_args("w"))[1] == 0
        a.send(P.OP_ACQUIRE, *acquire_args("w", wait_ms=-1))
        a.send(P.OP_ACQUIRE, *acquire_args("w", wait_ms=-1))
        b.send(P.OP_ACQUIRE, *acquire_args("w", wait_ms=-1))
        assert b.call(P.OP_PING)[1] == 0
        _limit_error(b.call(P.OP_ACQUIRE, *acquire_args("w", wait_ms=-1)), "--max-waiters", 3)
        assert b.call(P.OP_ACQUIRE, *acquire_args("free-one", wait_ms=0))[1] == 0  # a try without waiting
        a.close()  # its two waiters go: room again
        deadline = time.monotonic() + 5
        while b.call(P.OP_STATUS)[2]["waiters"] != 1:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        b.send(P.OP_ACQUIRE, *acquire_args("w", wait_ms=-1))
        assert b.call(P.OP_STATUS)[2]["waiters"] == 2
    finally:
        for raw in (holder, a, b):
            raw.close()


def test_max_leases_is_global_and_counts_releases(server_factory):
    srv = server_factory("leases", args=["--max-leases", "3"])
    a, b = Raw(srv.address), Raw(srv.address)
    try:
        args = [acquire_args(f"l/{i}") for i in range(3)]
        replies = [a.call(P.OP_ACQUIRE, *x) for x in args]
        assert all(r[1] == 0 for r in replies)
        _limit_error(b.call(P.OP_ACQUIRE, *acquire_args("l/3")), "--max-leases", 3)
        # waiting on a held lock adds no lease: allowed
        b.send(P.OP_ACQUIRE, *acquire_args("l/0", wait_ms=-1))
        assert b.call(P.OP_STATUS)[2]["waiters"] == 1
        name, owner = args[1][0], args[1][1]
        assert a.call(P.OP_RELEASE, name, replies[1][2][0], owner)[1] == 0
        assert b.call(P.OP_ACQUIRE, *acquire_args("l/3"))[1] == 0
    finally:
        a.close()
        b.close()


def test_max_watches_global_and_per_connection(server_factory):
    srv = server_factory("watches", args=["--max-watches", "3", "--max-watches-per-connection", "2"])
    a, b = Raw(srv.address), Raw(srv.address)
    try:
        assert a.call(P.OP_WATCH, "x/1")[1] == 0
        assert a.call(P.OP_WATCH, "x/2")[1] == 0
        assert a.call(P.OP_WATCH, "x/2")[1] == 0  # the same watch again costs nothing
        _limit_error(a.call(P.OP_WATCH, "x/3"), "--max-watches-per-connection", 2)
        assert b.call(P.OP_WATCH, "x/3")[1] == 0
        _limit_error(b.call(P.OP_WATCH, "x/4"), "--max-watches", 3)
        assert a.call(P.OP_UNWATCH, "x/1")[2] is True
        assert b.call(P.OP_WATCH, "x/4")[1] == 0
    finally:
        a.close()
        b.close()


def test_per_principal_quotas(server_factory):
    """Every connection here is the principal "anonymous" (no authentication):
    the quotas add up over all its connections, and free up as leases end,
    waits end and connections go.  A waiting acquire counts against the waiter
    quota and reserves its lease under the lease quota, so a waiter granted
    later never takes the principal past it."""
    srv = server_factory("quotas", args=["--max-leases-per-principal", "4", "--max-waiters-per-principal", "2",
                                         "--max-watches-per-principal", "2"])
    a, b, c = Raw(srv.address), Raw(srv.address), Raw(srv.address)
    try:
        args1, args2 = acquire_args("q/1"), acquire_args("q/2")
        r1, r2 = a.call(P.OP_ACQUIRE, *args1), a.call(P.OP_ACQUIRE, *args2)
        assert r1[1] == 0 and r2[1] == 0
        # waiters: two across two connections, the third refused
        first_wait = b.send(P.OP_ACQUIRE, *acquire_args("q/1", wait_ms=-1))
        timed = c.send(P.OP_ACQUIRE, *acquire_args("q/2", wait_ms=300))
        _limit_error(b.call(P.OP_ACQUIRE, *acquire_args("q/3", wait_ms=-1)), "--max-waiters-per-principal", 2)
        # two leases held and two reserved by the waiters: a fifth lease is refused
        refused = b.call(P.OP_ACQUIRE, *acquire_args("q/3"))
        _limit_error(refused, "--max-leases-per-principal", 4)
        assert "'anonymous'" in refused[2]
        reply = c.recv()
        assert reply[0] == timed and reply[1] != 0  # its wait ran out: its place is free again
        args3 = acquire_args("q/3")
        assert b.call(P.OP_ACQUIRE, *args3)[1] == 0
        assert b.call(P.OP_STATUS)[2]["waiters"] == 1
        # a release hands q/1 to b's waiter: one lease ended, the reserved one began
        assert a.call(P.OP_RELEASE, "q/1", r1[2][0], args1[1])[1] == 0
        granted = b.recv()
        assert granted[0] == first_wait and granted[1] == 0, granted
        usage = {u["principal"]: u for u in c.call(P.OP_STATUS)[2]["principals"]}["anonymous"]
        assert (usage["leases"], usage["waiters"], usage["leases_quota"]) == (3, 0, 4), usage
        assert c.call(P.OP_ACQUIRE, *acquire_args("q/4"))[1] == 0
        _limit_error(c.call(P.OP_ACQUIRE, *acquire_args("q/5")), "--max-leases-per-principal", 4)
        assert a.call(P.OP_RELEASE, "q/2", r2[2][0], args2[1])[1] == 0
        assert c.call(P.OP_ACQUIRE, *acquire_args("q/5"))[1] == 0
        # watches: two across connections, then refused; a closed connection's watch goes
        assert a.call(P.OP_WATCH, "q/w1")[1] == 0
        assert c.call(P.OP_WATCH, "q/w2")[1] == 0
        _limit_error(b.call(P.OP_WATCH, "q/w3"), "--max-watches-per-principal", 2)
        a.close()
        deadline = time.monotonic() + 5
        while b.call(P.OP_WATCH, "q/w3")[1] != 0:
            assert time.monotonic() < deadline, "a closed connection's watch still counts"
            time.sleep(0.02)
    finally:
        for raw in (a, b, c):
            raw.close()


# ---------------------------------------------------------------------------------------------
# 6. hygiene


def _modes(directory) -> dict[str, int]:
    """The permission bits of every file in ``directory`` (one renamed away between the listing and
    its stat, a snapshot's temporary file, is left out: its renamed self is checked)."""
    modes = {}
    for p in directory.iterdir():
        try:
            modes[p.name] = stat.S_IMODE(p.stat().st_mode)
        except FileNotFoundError:
            continue
    return modes


def test_data_directories_are_private(server_factory, tmp_path):
    """0700 directories, 0600 files: the WAL and snapshots hold owner keys."""
    creds = CredentialsDir(tmp_path / "credentials", replicas=2)
    primary = server_factory("primary", args=["--snapshot-every", "2", *creds.server_args("node-1")])
    standby = server_factory("standby", args=["--standby-of", primary.address, "--failover-after", "5",
                                              *creds.server_args("node-2")])
    primary.wait_for_log(r"paired with standby", timeout=10)
    with Raw(primary.address) as client:
        for i in range(3):
            assert client.call(P.OP_ACQUIRE, *acquire_args(f"private/{i}"))[1] == 0
    deadline = time.monotonic() + 10
    while not any(n.startswith("snap-") and n.endswith(".snap") for n in os.listdir(primary.data_dir)):
        assert time.monotonic() < deadline, "no snapshot written"
        time.sleep(0.02)
    for srv in (primary, standby):
        assert stat.S_IMODE(srv.data_dir.stat().st_mode) == 0o700
        modes = _modes(srv.data_dir)
        assert "LOCK" in modes and any(n.startswith("wal-") for n in modes), modes
        assert all(m == 0o600 for m in modes.values()), {n: oct(m) for n, m in modes.items()}
    assert {"pairing.json"} <= set(_modes(primary.data_dir))
    assert {"node-id", "node-state.json"} <= set(_modes(standby.data_dir))


def test_an_existing_loose_data_directory_is_tightened_at_start(server_factory, tmp_path):
    data = tmp_path / "loose"
    srv = server_factory("loose")
    srv.stop()
    data.chmod(0o755)
    for p in data.iterdir():
        p.chmod(0o644)
    (data / "operator-notes.txt").write_text("x")
    (data / "operator-notes.txt").chmod(0o666)
    srv.start()
    srv.wait_for_log(r"data directory .* was mode 755: tightened to 700", timeout=5)
    srv.wait_for_log(r"tightened \d+ files to mode 600", timeout=5)
    assert stat.S_IMODE(data.stat().st_mode) == 0o700
    assert all(m == 0o600 for m in _modes(data).values()), _modes(data)


FORGED = "2026-01-01 00:00:00,000 WARNING fastlock.server: PROMOTED to primary (operator command)"


def test_names_cannot_forge_log_lines(server_factory):
    """A newline in a client name or a lock name is escaped in every log line."""
    srv = server_factory("inject", log_level="DEBUG")
    with Raw(srv.address, name=f"evil\n{FORGED}") as raw:
        reply = raw.call(P.OP_ACQUIRE, f"lock\n{FORGED}", os.urandom(16), 50, 0, 0, None)
        assert reply[1] == 0, reply
        srv.wait_for_log(r"lease expired: 'lock\\n2026", timeout=5)
    srv.wait_for_log(r"hello from .*'evil\\n2026", timeout=5)
    forged = [line for line in srv.lines if line.startswith("2026-01-01") or line.lstrip().startswith("PROMOTED")]
    assert not forged, forged
    assert not any("PROMOTED" in line and "'" not in line for line in srv.lines)


def _mount_tmpfs(path, size: str) -> bool:
    path.mkdir()
    if os.geteuid() != 0:
        return False
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                          capture_output=True).returncode == 0


def _check_grants_after_restart(again, granted: dict[str, int]) -> None:
    """Every acknowledged grant (name -> token) is held on the restarted server ``again``."""
    with Raw(again.address) as raw:
        for name, token in granted.items():
            assert raw.call(P.OP_CHECK, name, token)[2] is True, f"acknowledged grant {name[:12]} lost"


def test_disk_full_gives_waiting_clients_an_error_and_a_non_zero_exit(server_factory, tmp_path):
    """ENOSPC on the WAL: the client hears why (not a bare EOF), the process exits
    with status 3 (so systemd's Restart=on-failure restarts it), and every
    acknowledged grant is there after a restart."""
    import shutil

    mnt = tmp_path / "small"
    if not _mount_tmpfs(mnt, "256k"):
        pytest.skip("needs root to mount a small tmpfs")
    try:
        srv = server_factory("small/data")
        granted = {}
        closing = None
        holder, waiter = Raw(srv.address), Raw(srv.address)
        assert holder.call(P.OP_ACQUIRE, *acquire_args("full/held"))[1] == 0
        waiter.send(P.OP_ACQUIRE, *acquire_args("full/held", wait_ms=-1))  # queued: a waiting client
        assert waiter.call(P.OP_STATUS)[2]["waiters"] == 1
        with Raw(srv.address) as raw:
            for i in range(2000):
                name = f"full/{i:04d}/" + "x" * 400
                reply = raw.call(P.OP_ACQUIRE, name, os.urandom(16), 600_000, 0, 0, None)
                if reply is None:
                    break
                if reply[0] == 0:
                    closing = reply
                    break
                assert reply[1] == 0, reply
                granted[name] = reply[2][0]
            else:
                pytest.fail("2000 grants of 400-byte names fitted in 256 KiB")
            if closing is None:
                closing = raw.recv()
        assert closing is not None, "the client saw a bare EOF"
        assert closing[0] == 0 and closing[1] == Unavailable.code and "write-ahead log failed" in closing[2], closing
        told = waiter.recv()
        assert told is not None and told[0] == 0 and "write-ahead log failed" in told[2], told
        waiter.close()
        holder.close()
        assert srv.proc.wait(10) == 3
        print(f"\n{len(granted)} grants acknowledged before the disk was full; client got {closing}")
        print("\n".join(srv.lines[-8:]))
        assert granted
        shutil.copytree(srv.data_dir, tmp_path / "copy")
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)
    _check_grants_after_restart(server_factory("copy"), granted)


@pytest.mark.parametrize("writer", ["inline", "thread"])
def test_a_batch_the_full_disk_refused_is_not_recovered(server_factory, tmp_path, writer):
    """ENOSPC part-way through a batch of several grants: the segment is cut back to where
    the batch began, so after a restart with room none of its grants is held (nobody was
    told of them, and each would hold its lock for its TTL); every acknowledged one is."""
    import shutil

    mnt = tmp_path / "small"
    if not _mount_tmpfs(mnt, "256k"):
        pytest.skip("needs root to mount a small tmpfs")
    try:
        srv = server_factory("small/data", args=["--wal-writer", writer])
        granted: dict[str, int] = {}
        refused: list[str] = []
        with Raw(srv.address) as raw:
            for burst in range(400):  # 8 grants per read: one batch of 8 records
                sent = {}
                for i in range(8):
                    sent[raw.next_id + i] = f"burst/{burst:03d}/{i}/" + "x" * 300
                raw.sock.sendall(b"".join(
                    msgpack.packb([rid, P.OP_ACQUIRE, name, os.urandom(16), 600_000, 0, 0, None], use_bin_type=True)
                    for rid, name in sent.items()))
                raw.next_id += len(sent)
                replies = {}
                while len(replies) < len(sent):
                    msg = raw.recv()
                    if msg is None or msg[0] == 0:  # the server stopped (its notice has request id 0)
                        break
                    replies[msg[0]] = msg
                for rid, name in sent.items():
                    if rid in replies and replies[rid][1] == 0:
                        granted[name] = replies[rid][2][0]
                    else:
                        refused.append(name)
                if refused:
                    break
            else:
                pytest.fail("400 batches of 300-byte names fitted in 256 KiB")
        assert srv.proc.wait(10) == 3
        shutil.copytree(srv.data_dir, tmp_path / "copy")
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)
    again = server_factory("copy")
    _check_grants_after_restart(again, granted)
    with Raw(again.address) as raw:
        held = [name[:16] for name in refused if raw.call(P.OP_HOLDER, name)[2] is not None]
    assert not held, f"grants nobody was told of came back: {held}"


@pytest.mark.parametrize("lock_file", [True, False])
def test_a_start_on_a_full_disk_names_the_file_and_the_operation(tmp_path, lock_file):
    """A data directory on a full file system: the start fails (exit 1) with one line
    naming the file that could not be written (the new WAL segment, or ``LOCK`` when even
    the pid does not fit), the operation and the errno's text -- no traceback."""
    mnt = tmp_path / "small"
    if not _mount_tmpfs(mnt, "64k"):
        pytest.skip("needs root to mount a small tmpfs")
    try:
        data = mnt / "data"
        data.mkdir(mode=0o700)
        if lock_file:  # a previous run's pid: rewriting it reuses its page
            (data / "LOCK").write_text("1\n")
            (data / "LOCK").chmod(0o600)
        with open(mnt / "filler", "wb", buffering=0) as f, pytest.raises(OSError):
            while True:
                f.write(b"\0" * 4096)
        srv = ServerProcess(data)
        try:
            with pytest.raises(RuntimeError, match="exited"):
                srv.start(timeout=20)
            assert srv.proc.returncode == 1
        finally:
            srv.stop()
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)
    line = next(line for line in srv.lines if "cannot start" in line)
    told = (f"WAL pwrite failed on {data / 'wal-00000000000000000001.log'}" if lock_file
            else f"WAL write of the pid failed on {data / 'LOCK'}")
    assert f"[Errno 28] {told}: {os.strerror(errno.ENOSPC)}" in line, line
    assert not any("Traceback" in line for line in srv.lines)


@pytest.mark.parametrize("writer", ["inline", "thread"])
def test_no_room_to_preallocate_stops_preallocation_not_the_log(server_factory, tmp_path, writer):
    """The first 1 MiB preallocation step of the WAL fits, the next does not: the
    writer (on the loop or its thread) gives back what that step took, preallocation
    stops (one WARNING), and grants go on in the space left; every acknowledged grant
    survives a restart."""
    import shutil

    mnt = tmp_path / "small"
    if not _mount_tmpfs(mnt, "1600k"):
        pytest.skip("needs root to mount a small tmpfs")
    try:
        srv = server_factory("small/data", args=["--wal-writer", writer])
        granted = {}
        after_warning = 0
        with Raw(srv.address) as raw:
            for i in range(5000):
                name = f"fill/{i:04d}/" + "x" * 400
                reply = raw.call(P.OP_ACQUIRE, name, os.urandom(16), 600_000, 0, 0, None)
                assert reply is not None and reply[1] == 0, reply
                granted[name] = reply[2][0]
                if any("WAL preallocation stopped" in line for line in srv.lines):
                    after_warning += 1
                    if after_warning >= 200:
                        break
            else:
                pytest.fail("5000 grants and preallocation never ran out of room")
        assert sum("WAL preallocation stopped" in line for line in srv.lines) == 1
        srv.stop()
        shutil.copytree(srv.data_dir, tmp_path / "copy")
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)
    _check_grants_after_restart(server_factory("copy"), granted)


# ---------------------------------------------------------------------------------------------
# the frame walker, sans-IO

_scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), st.floats(allow_nan=False),
                     st.text(max_size=300), st.binary(max_size=300))
_values = st.recursive(_scalars, lambda inner: st.one_of(st.lists(inner, max_size=6),
                                                         st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                       max_leaves=30)
_LIMITS = P.REQUEST_LIMITS._replace(max_depth=6, max_items=10_000, max_frame_bytes=1 << 20)


@settings(max_examples=120, deadline=None)
@given(st.lists(st.lists(_values, min_size=1, max_size=4), min_size=1, max_size=5), st.data())
def test_frame_decoder_decodes_any_split_as_msgpack_does(messages, data):
    """Walking partial frames never changes what is decoded, wherever the pieces split."""
    stream = b"".join(msgpack.packb(m, use_bin_type=True) for m in messages)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(stream)), max_size=8)))
    for shape_all in (False, True):
        dec = P.FrameDecoder(limits=_LIMITS, shape_all=shape_all)
        out = []
        for a, b in zip([0, *cuts], [*cuts, len(stream)]):
            out += dec.feed(stream[a:b])
        assert out == messages


@settings(max_examples=100, deadline=None)
@given(st.integers(4, 40), st.integers(1, 7), st.sampled_from([b"\x91", b"\x9f", b"\x81\xa1k", b"\xdc\x00\x01"]))
def test_frame_decoder_refuses_deep_partial_frames_in_any_pieces(depth, piece, header):
    stream = header * depth
    dec = P.FrameDecoder()
    with pytest.raises(ProtocolError, match="deeper than 3"):
        for i in range(0, len(stream), piece):
            dec.feed(stream[i:i + piece])


def test_a_whole_frame_in_one_piece_is_bounded_too():
    dec = P.FrameDecoder(max_frame=1024)
    assert dec.feed(msgpack.packb([1, P.OP_PING, "x" * 900])) == [[1, P.OP_PING, "x" * 900]]
    with pytest.raises(ProtocolError, match="maximum frame size"):
        P.FrameDecoder(max_frame=1024).feed(msgpack.packb([1, P.OP_PING, "x" * 2000]))


def test_fed_counts_every_byte_whether_a_read_is_decoded_whole_or_streamed():
    """``FrameDecoder.fed`` (a connection's "has anything arrived") counts frames decoded
    in one call as well as streamed ones."""
    dec = P.FrameDecoder()
    one = msgpack.packb([1, 0, "granted"])
    assert dec.feed(one) == [[1, 0, "granted"]] and dec.fed == len(one)
    two = msgpack.packb([2, 0, None]) * 2
    assert dec.feed(two) == [[2, 0, None]] * 2 and dec.fed == len(one) + len(two)
    assert dec.feed(one[:3]) == [] and dec.feed(one[3:]) == [[1, 0, "granted"]]
    assert dec.fed == 2 * len(one) + len(two)


def test_a_lease_released_in_its_grants_batch_is_not_counted_again(server_factory):
    """A release read in the same batch as its lease's grant (before the grant's event is
    processed) uncounts it, and the grant event does not count it again: with
    --max-leases-per-principal 2, acquire-and-release rounds pipelined that way never reach
    the quota (before, each round left one lease counted and the third acquire was refused)."""
    server = server_factory(fsync="never", args=["--max-leases-per-principal", "2",
                                                 "--anonymous-quota-divisor", "1"])
    owner = b"0123456789abcdef"
    with RawWire(server.port) as wire:
        wire.hello("batch")
        for i in range(4):
            wire.send([10 + i, P.OP_ACQUIRE, f"p{i}", owner, 10_000, 0, 0, None])
            first = wire.reply()
            assert first[1] == 0, first
            token = first[2][0]
            # p's release, then q's acquire and the release of q's lease (the next token), in one write
            wire.send([20 + i, P.OP_RELEASE, f"p{i}", token, owner],
                      [30 + i, P.OP_ACQUIRE, f"q{i}", owner, 10_000, 0, 0, None],
                      [40 + i, P.OP_RELEASE, f"q{i}", token + 1, owner])
            replies = {r[0]: r for r in (wire.reply(), wire.reply(), wire.reply())}
            assert all(r[1] == 0 for r in replies.values()), replies
            assert replies[30 + i][2][0] == token + 1
