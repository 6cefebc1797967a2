"""The floor: a do-nothing msgpack echo server and client on asyncio/uvloop.

The server decodes each msgpack frame and sends the same object back; it keeps
no state and does no I/O besides the socket.  The client has the shape of a real
lock client (request ids, a dict of pending futures, so many tasks can share a
connection) and sends a request of about the size of a fastlock acquire.
Everything a lock server adds on top of that is what ``benches.load`` reports
as a ratio to this floor.

    python -m benches.echo serve [--listen 127.0.0.1:0] [--no-uvloop]
    python -m benches.echo bench [--duration 3] [--pipeline 64]   # standalone floor figures
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
import time

import msgpack

from benches import harness

log = logging.getLogger("benches.echo")

MAX_BUFFER = 1 << 20  # bytes buffered per connection before it is dropped


# --------------------------------------------------------------------------- #
# server
# --------------------------------------------------------------------------- #

class EchoServerProtocol(asyncio.Protocol):
    """Decode msgpack objects, send each straight back (one write per read)."""

    def connection_made(self, transport) -> None:
        self.transport = transport
        self.unpacker = msgpack.Unpacker(max_buffer_size=MAX_BUFFER)
        self.packer = msgpack.Packer()
        sock = transport.get_extra_info("socket")
        if sock is not None:
            import socket
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        self.unpacker.feed(data)
        pack = self.packer.pack
        out = [pack(obj) for obj in self.unpacker]
        if out:
            self.transport.write(b"".join(out))


async def serve(host: str, port: int) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(EchoServerProtocol, host, port, reuse_address=True)
    bound = server.sockets[0].getsockname()
    log.info("listening on %s:%d", bound[0], bound[1])
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with server:
        await stop.wait()
    log.info("stopped")


# --------------------------------------------------------------------------- #
# client
# --------------------------------------------------------------------------- #

class EchoClientProtocol(asyncio.Protocol):
    """Pipelining request/response client: ``await request(obj)`` -> reply."""

    def __init__(self) -> None:
        self.unpacker = msgpack.Unpacker(max_buffer_size=MAX_BUFFER)
        self.pending: dict[int, asyncio.Future] = {}
        self.next_id = 0
        self.transport = None
        self.lost: Exception | None = None

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.unpacker.feed(data)
        pending = self.pending
        for reply in self.unpacker:
            fut = pending.pop(reply[0], None)
            if fut is not None and not fut.done():
                fut.set_result(reply)

    def connection_lost(self, exc) -> None:
        self.lost = exc or ConnectionResetError("echo server closed the connection")
        for fut in self.pending.values():
            if not fut.done():
                fut.set_exception(self.lost)
        self.pending.clear()

    def request(self, op: int, *args) -> asyncio.Future:
        if self.lost is not None:
            raise self.lost
        self.next_id += 1
        rid = self.next_id
        fut = asyncio.get_running_loop().create_future()
        self.pending[rid] = fut
        self.transport.write(msgpack.packb([rid, op, *args]))
        return fut


async def open_client(host: str, port: int) -> EchoClientProtocol:
    loop = asyncio.get_running_loop()
    _, proto = await loop.create_connection(EchoClientProtocol, host, port)
    sock = proto.transport.get_extra_info("socket")
    if sock is not None:
        import socket
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return proto


class EchoSession(harness.Session):
    """acquire = one echo of an acquire-sized request; release = one echo of a release-sized one."""

    def __init__(self, proto: EchoClientProtocol, idx: int, handoff_chain: bool = False) -> None:
        self.proto = proto
        self.handoff_chain = handoff_chain
        self.acquire_id = os.urandom(16)
        self.round_trips = 0
        self.wasted = 0
        self.token = 0

    async def acquire(self, name: str) -> int | None:
        self.round_trips += 1
        # shaped like a lock acquire: [id, op, name, owner key, ttl_ms, wait_ms, lock_delay_ms, tag]
        await self.proto.request(1, name, self.acquire_id, 10_000, 5_000, 0, None)
        return None

    async def release(self, name: str) -> None:
        if self.handoff_chain:
            return  # see EchoTarget: the release is not on a hand-off's critical path
        self.round_trips += 1
        # shaped like a release: [id, op, name, fencing token, owner key]
        await self.proto.request(2, name, (1 << 40) + self.round_trips, self.acquire_id)

    async def close(self) -> None:
        if self.proto.transport is not None:
            self.proto.transport.close()


class EchoTarget(harness.Target):
    """The floor row: the echo server as a subprocess, one connection per client."""

    name = "echo floor"
    system = "echo"
    is_floor = True
    notes = "msgpack echo; no lock semantics"

    def __init__(self, *, use_uvloop: bool = True) -> None:
        super().__init__()
        self.use_uvloop = use_uvloop
        self.handoff_chain = False
        self.port: int | None = None

    def start(self) -> None:
        d = self.make_tmpdir()
        argv = [sys.executable, "-m", "benches.echo", "serve", "--listen", "127.0.0.1:0",
                "--uvloop" if self.use_uvloop else "--no-uvloop"]
        srv = harness.ServerProcess("echo", argv, log_path=os.path.join(d, "echo.log"), cwd=_repo_root())
        self.servers.append(srv)
        self.port = srv.start(ready_regex=r"listening on 127\.0\.0\.1:(\d+)")

    async def open(self, idx: int) -> harness.Session:
        return EchoSession(await open_client(harness.LOOPBACK, self.port), idx, self.handoff_chain)

    def handoff_floor(self, hold: float, duration: float, warmup: float, *, use_uvloop: bool = True) -> dict:
        """The W3 floor: ONE client that holds ``hold`` s, then does one echo round trip.

        A FIFO lock hand-off costs, on its critical path, the hold plus one
        round trip's worth of messages (release to the server, grant to the
        next waiter) and the wake-up of an idle process: exactly this loop, with
        a server that does nothing.  Its rate is what no lock server on this
        machine can beat; the row is reported as W3 of the echo floor.
        """
        self.handoff_chain = True
        try:
            wl = harness.Workload("W3", 1, True, hold, duration, warmup)
            return harness.run_workload(self, wl, use_uvloop=use_uvloop)
        finally:
            self.handoff_chain = False


def _repo_root() -> str:
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# --------------------------------------------------------------------------- #
# standalone floor figures: sequential round trip and pipelined rate
# --------------------------------------------------------------------------- #

async def _pipelined(port: int, duration: float, window: int) -> float:
    """Requests/s with ``window`` requests in flight on one connection."""
    proto = await open_client(harness.LOOPBACK, port)
    done = 0
    end = time.perf_counter() + duration

    async def worker() -> None:
        nonlocal done
        for _ in range(harness.MAX_OPS):
            if time.perf_counter() >= end:
                return
            await proto.request(1, "bench/lock-000", b"0123456789abcdef", 10_000, 5_000, 0, None)
            done += 1

    t0 = time.perf_counter()
    await asyncio.wait_for(asyncio.gather(*(worker() for _ in range(window))), duration + harness.RUN_GRACE)
    rate = done / (time.perf_counter() - t0)
    proto.transport.close()
    return rate


def _bench(args) -> int:
    target = EchoTarget(use_uvloop=args.uvloop)
    with harness.running(target):
        wl = harness.standard_workloads(args.duration, args.warmup)["W1"]
        row = harness.run_workload(target, wl, use_uvloop=args.uvloop)
        print(f"sequential round trip: p50={row['acquire_us']['p50']:.1f} us "
              f"p99={row['acquire_us']['p99']:.1f} us ({row['pairs_per_s'] * 2:,.0f} req/s)")
        rate = harness.run_async(_pipelined(target.port, args.duration, args.pipeline), use_uvloop=args.uvloop)
        print(f"pipelined ({args.pipeline} in flight, 1 connection): {rate:,.0f} req/s")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benches.echo", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve", help="run the echo server")
    s.add_argument("--listen", default="127.0.0.1:0", help="host:port (default 127.0.0.1:0 = any free port)")
    b = sub.add_parser("bench", help="print the floor figures (starts its own server)")
    b.add_argument("--duration", type=float, default=3.0)
    b.add_argument("--warmup", type=float, default=0.5)
    b.add_argument("--pipeline", type=int, default=64, help="requests in flight for the pipelined figure")
    for p in (s, b):
        g = p.add_mutually_exclusive_group()
        g.add_argument("--uvloop", dest="uvloop", action="store_true", default=True)
        g.add_argument("--no-uvloop", dest="uvloop", action="store_false")
    args = ap.parse_args(argv)
    if args.cmd == "serve":
        logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s echo %(message)s")
        host, _, port = args.listen.rpartition(":")
        if host not in ("127.0.0.1", "localhost"):
            ap.error("the echo server listens on loopback only")
        harness.run_async(serve(host, int(port)), use_uvloop=args.uvloop)
        return 0
    return _bench(args)


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # servers were stopped by the finally blocks on the way out
        print("interrupted", file=sys.stderr)
        sys.exit(130)
