"""What misbehaving peers cost a server: memory and other clients' latency.

Runs against real ``fastlock serve`` processes (the fastlock installed for the
Python that runs this script), every probe bounded in count and time::

    python -m benches.limits            # all probes
    python -m benches.limits nested     # one of: nested, replica, backlog, snapshot

nested
    30 connections each send 1,024 nested ``array16(65535)`` headers (3 KiB,
    never completed) without a HELLO; server RSS before, with them open, and
    after they are closed.
replica
    a peer sends REPLICATE, then pipelines STATUS requests for 10 s without
    reading anything; server RSS growth and whether it was disconnected.
backlog
    a WAL of 600,000 records built through the WAL API; a peer sends REPLICATE
    from LSN 1 and reads the stream while another client PINGs in a loop; the
    worst PING round trip and the time to stream the backlog.
snapshot
    200,000 held leases; a peer sends REPLICATE with no position (it needs a
    snapshot) while another client PINGs; the worst PING round trip.

Prints one JSON object per probe.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path

import msgpack

from fastlock import protocol as P
from fastlock._testbase import ServerProcess


def _rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return -1


class _Peer:
    def __init__(self, address: str, rcvbuf: int | None = None):
        host, port = address.rsplit(":", 1)
        self.sock = socket.socket()
        if rcvbuf:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        self.sock.settimeout(10)
        self.sock.connect((host, int(port)))
        self.unpacker = msgpack.Unpacker(raw=False)
        self.next_id = 1

    def call(self, op: int, *args):
        rid = self.next_id
        self.next_id += 1
        self.sock.sendall(msgpack.packb([rid, op, *args], use_bin_type=True))
        while True:
            for msg in self.unpacker:
                if msg[0] in (rid, 0):
                    return msg
            data = self.sock.recv(1 << 16)
            if not data:
                return None
            self.unpacker.feed(data)


def probe_nested(root: Path) -> dict:
    with ServerProcess(root / "nested") as srv:
        before = _rss_kib(srv.pid)
        socks = []
        for _ in range(30):
            s = socket.create_connection(("127.0.0.1", srv.port))
            try:
                s.sendall(b"\xdc\xff\xff" * 1024)
            except OSError:
                pass
            socks.append(s)
        deadline = time.monotonic() + 5
        peak = _rss_kib(srv.pid)
        while time.monotonic() < deadline:  # let the server read them all
            peak = max(peak, _rss_kib(srv.pid))
            time.sleep(0.05)
        for s in socks:
            s.close()
        time.sleep(0.5)
        return {"probe": "nested", "rss_before_kib": before, "rss_peak_kib": peak,
                "rss_after_close_kib": _rss_kib(srv.pid)}


def probe_replica(root: Path) -> dict:
    with ServerProcess(root / "replica") as srv:
        before = _rss_kib(srv.pid)
        peer = _Peer(srv.address, rcvbuf=4096)
        peer.call(P.OP_HELLO, P.PROTOCOL_VERSION, "standby:fake", None)
        peer.call(P.OP_REPLICATE, 0, None, 0, "fake@0123456789abcdef")
        request = msgpack.packb([9, P.OP_STATUS]) * 1000
        peer.sock.settimeout(0.2)
        deadline = time.monotonic() + 10
        peak = before
        disconnected = False
        while time.monotonic() < deadline and not disconnected:
            try:
                peer.sock.sendall(request)
            except (BrokenPipeError, ConnectionResetError):
                disconnected = True
            except TimeoutError:
                pass
            peak = max(peak, _rss_kib(srv.pid))
        disconnected = disconnected or any("too far behind" in line for line in srv.lines)
        peer.sock.close()
        return {"probe": "replica", "rss_before_kib": before, "rss_peak_kib": peak,
                "disconnected": disconnected, "seconds": round(10 - max(0.0, deadline - time.monotonic()), 2)}


def _build_log(directory: Path, records: int) -> int:
    from fastlock.wal import WriteAheadLog

    async def write() -> int:
        wal = WriteAheadLog(directory, fsync="never")
        wal.open()
        wal.start()
        owner = os.urandom(16)
        for i in range(records // 2):
            wal.log_grant(f"big/{i % 5000}", i + 1, owner, 60_000, 0, "builder", None)
            wal.log_release(f"big/{i % 5000}", i + 1)
            if i % 10_000 == 0:
                await asyncio.sleep(0)
        await wal.sync()
        last = wal.stats()["last_lsn"]
        await wal.close()
        return last

    return asyncio.run(write())


def probe_backlog(root: Path, records: int = 600_000) -> dict:
    last = _build_log(root / "backlog", records)
    with ServerProcess(root / "backlog", args=["--snapshot-every", "10000000"]) as srv:
        first = _Peer(srv.address, rcvbuf=1 << 20)
        first.call(P.OP_HELLO, P.PROTOCOL_VERSION, "standby:fake", None)
        incarnation = first.call(P.OP_REPLICATE, 0, None, 0, "fake@0123456789abcdef")[2]["incarnation"]
        first.sock.close()
        latencies: list[float] = []
        stop = threading.Event()

        def pinger() -> None:
            p = _Peer(srv.address)
            p.call(P.OP_HELLO, P.PROTOCOL_VERSION, "pinger", None)
            while not stop.is_set():
                t0 = time.perf_counter()
                if p.call(P.OP_PING) is None:
                    break  # the server closed the connection
                latencies.append(time.perf_counter() - t0)
                time.sleep(0.0005)  # leave this process's GIL to the stream reader
            p.sock.close()

        thread = threading.Thread(target=pinger, daemon=True)
        thread.start()
        while len(latencies) < 10:
            time.sleep(0.001)
        mark = len(latencies)
        t0 = time.perf_counter()
        peer = _Peer(srv.address, rcvbuf=1 << 20)
        peer.call(P.OP_HELLO, P.PROTOCOL_VERSION, "standby:fake", None)
        peer.sock.sendall(msgpack.packb([2, P.OP_REPLICATE, 1, incarnation, 0, "fake@0123456789abcdef"]))
        received = 0
        last_data = time.perf_counter()
        peer.sock.settimeout(0.05)
        deadline = time.monotonic() + 120
        # until the server logs "caught up" (older servers sent the whole backlog inside the
        # REPLICATE request: then until only heartbeats have come for 1 s)
        while time.monotonic() < deadline:
            try:
                chunk = peer.sock.recv(1 << 20)
            except TimeoutError:
                if any("caught up" in line for line in srv.lines):
                    break
                if received > 1 << 20 and time.perf_counter() - last_data > 1.0:
                    break
                continue
            if not chunk:
                break
            received += len(chunk)
            if len(chunk) > 4096:  # not just a heartbeat
                last_data = time.perf_counter()
        elapsed = last_data - t0
        stop.set()
        thread.join(10)
        peer.sock.close()
        during = latencies[mark:]
        return {"probe": "backlog", "records": last, "stream_seconds": round(elapsed, 2), "bytes": received,
                "pings": len(during), "ping_worst_ms": round(max(during) * 1000, 1),
                "ping_p50_ms": round(sorted(during)[len(during) // 2] * 1000, 3)}


def probe_snapshot(root: Path, leases: int = 200_000) -> dict:
    from fastlock.wal import WriteAheadLog

    async def write() -> None:
        wal = WriteAheadLog(root / "snapshot", fsync="never")
        wal.open()
        wal.start()
        for i in range(leases):
            wal.log_grant(f"held/{i}", i + 1, os.urandom(16), 3_600_000, 0, "builder", None)
            if i % 10_000 == 0:
                await asyncio.sleep(0)
        await wal.sync()
        await wal.close()

    asyncio.run(write())
    with ServerProcess(root / "snapshot", args=["--snapshot-every", "10000000"]) as srv:
        latencies: list[float] = []
        stop = threading.Event()

        def pinger() -> None:
            p = _Peer(srv.address)
            p.call(P.OP_HELLO, P.PROTOCOL_VERSION, "pinger", None)
            while not stop.is_set():
                t0 = time.perf_counter()
                if p.call(P.OP_PING) is None:
                    break
                latencies.append(time.perf_counter() - t0)
                time.sleep(0.0005)
            p.sock.close()

        thread = threading.Thread(target=pinger, daemon=True)
        thread.start()
        while len(latencies) < 10:
            time.sleep(0.001)
        mark = len(latencies)
        peer = _Peer(srv.address, rcvbuf=1 << 20)
        peer.call(P.OP_HELLO, P.PROTOCOL_VERSION, "standby:fake", None)
        t0 = time.perf_counter()
        peer.call(P.OP_REPLICATE, 0, None, 0, "fake@0123456789abcdef")
        received = 0
        last_data = time.perf_counter()
        peer.sock.settimeout(0.2)
        while time.perf_counter() - last_data < 1.0:  # until only heartbeats come
            try:
                chunk = peer.sock.recv(1 << 20)
            except TimeoutError:
                continue
            received += len(chunk)
            if len(chunk) > 4096:
                last_data = time.perf_counter()
        stop.set()
        thread.join(10)
        peer.sock.close()
        during = latencies[mark:]
        return {"probe": "snapshot", "leases": leases, "bytes": received, "seconds": round(last_data - t0, 2),
                "pings": len(during), "ping_worst_ms": round(max(during) * 1000, 1)}


PROBES = {"nested": probe_nested, "replica": probe_replica, "backlog": probe_backlog, "snapshot": probe_snapshot}


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m benches.limits", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("probes", nargs="*", metavar="PROBE",
                    help=f"probes to run, of {', '.join(PROBES)} (default: all)")
    names = ap.parse_args(argv).probes or list(PROBES)
    unknown = [name for name in names if name not in PROBES]
    if unknown:
        ap.error(f"unknown probe {unknown[0]!r} (choose from {', '.join(PROBES)})")
    with tempfile.TemporaryDirectory(prefix="fastlock-limits-") as tmp:
        for name in names:
            print(json.dumps(PROBES[name](Path(tmp))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
