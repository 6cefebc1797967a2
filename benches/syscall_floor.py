"""The physical floor of a client in the W2 shape: CPU per acquire+release pair with the least
user-space work, split into user and system time, with the system calls per pair.

    python -m benches.syscall_floor [--server fastlock|echo] [--clients 32] [--inflight 1]
                                    [--write join|sendmsg|each] [--loop epoll|uvloop]
                                    [--pairs 32000] [--syscalls] [--table] [--rounds 1]

C connections to a server subprocess (``python -m fastlock serve --fsync never`` or the echo floor
``python -m benches.echo serve``; free port, throwaway data dir, stopped afterwards) run a fixed
number of acquire+release pairs, each connection on locks of its own, with ``--inflight`` K
requests in flight per connection (K = 1: the W2 shape; above 1: pipelined, K locks per
connection).  The client is no lock client: frames are encoded with ``msgpack.packb``, replies
read with a ``msgpack.Unpacker`` per connection, and the next request of a lock is written as
soon as its reply is read (an ACQUIRE of a free lock with ``wait`` 0, then a RELEASE with the
grant's fencing token; the echo server sends each request back).

``--loop epoll``: one ``select.epoll`` loop over non-blocking sockets, one ``recv_into`` (of one
reused buffer) per readable socket per turn and one write per socket per turn for every frame its reads made ready.
``--loop uvloop``: the same callbacks as an ``asyncio.Protocol`` on uvloop (``data_received``
and one ``transport.write`` per read), without futures or tasks: uvloop's own share.
``--write``: how several frames ready on one socket in one turn go out: ``join`` (one ``send`` of
the joined bytes), ``sendmsg`` (one ``sendmsg`` of the frames), ``each`` (one ``send`` per frame).

Prints this process's user and system CPU microseconds per pair, the server's CPU per pair,
pairs/s and loop turns per pair (``epoll`` only).  ``--syscalls`` also counts this process's
system calls during the measured pairs with ``perf stat`` (tracepoints ``raw_syscalls:sys_enter``
and a few ``syscalls:sys_enter_*``; it slows system calls, so its CPU figures are not the
floor's).  ``--table`` runs the standard rows (the W2 shape, pipelined rows, uvloop's rows) on
the chosen server, ``--rounds`` times in turn, and prints each row's median.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import select
import socket
import statistics
import sys
import time
from typing import NamedTuple

import msgpack

from .cpu_per_pair import SyscallCounter, process_cpu_seconds, server_process

OP_HELLO, PROTOCOL_VERSION, OP_ACQUIRE, OP_RELEASE = 1, 2, 2, 3  # fastlock.protocol.ops
TTL_MS = 10_000
RUN_LIMIT = 300.0  # seconds: a run that takes longer is stopped with an error

_packb = msgpack.Packer(use_bin_type=True, autoreset=True).pack


class Shape(NamedTuple):
    """One row: ``loop`` ``epoll`` or ``uvloop``; ``inflight`` requests in flight per connection;
    ``write`` ``join``, ``sendmsg`` or ``each``."""

    loop: str
    inflight: int
    write: str

    def label(self) -> str:
        return f"{self.loop}, {self.inflight} in flight, {self.write}"


class Figures(NamedTuple):
    """One run: microseconds of CPU per pair (this process's ``user`` and ``system``, the
    ``server``'s user + system), ``pairs_per_s``, ``turns_per_pair`` (epoll loop turns; None
    for uvloop) and ``syscalls``: system call name -> calls per pair (empty without
    ``--syscalls``; ``all``: every system call)."""

    user: float
    system: float
    server: float
    pairs_per_s: float
    turns_per_pair: float | None
    syscalls: dict[str, float]


def _cpu_seconds(pid: int) -> float:
    """The user + system CPU seconds of process ``pid`` so far."""
    return sum(process_cpu_seconds(pid))


class _Conn:
    """One connection's locks: K slots, each running ACQUIRE then RELEASE ``left`` times.

    The request id of slot ``s`` is ``n * K + s + 1``: the slot is read back from a reply's id."""

    def __init__(self, sock: socket.socket, index: int, inflight: int, echo: bool) -> None:
        self.sock = sock
        self.fd = sock.fileno()
        self.k = inflight
        self.echo = echo
        self.unpacker = msgpack.Unpacker()
        self.names = [f"floor/{index}/{s}" for s in range(inflight)]
        self.owners = [os.urandom(16) for _ in range(inflight)]
        self.releasing = [False] * inflight
        self.left = [0] * inflight
        self.seq = [0] * inflight
        self.finished = 0

    def _id(self, slot: int) -> int:
        self.seq[slot] += 1
        return self.seq[slot] * self.k + slot + 1

    def _acquire(self, slot: int) -> bytes:
        return _packb([self._id(slot), OP_ACQUIRE, self.names[slot], self.owners[slot], TTL_MS, 0, 0, None])

    def start(self, pairs: int) -> list[bytes]:
        """Every slot's first ACQUIRE of a run of ``pairs`` pairs per slot."""
        self.finished = 0
        self.left = [pairs] * self.k
        self.releasing = [False] * self.k
        return [self._acquire(s) for s in range(self.k)]

    def on_data(self, data: bytes) -> list[bytes]:
        """The frames the replies in ``data`` make ready (each slot's next request)."""
        self.unpacker.feed(data)
        out = []
        k = self.k
        for reply in self.unpacker:
            slot = (reply[0] - 1) % k
            if not self.echo and reply[1] != 0:
                raise RuntimeError(f"the server refused a request: {reply!r}")
            if not self.releasing[slot]:
                token = 1 << 40 if self.echo else reply[2][0]
                self.releasing[slot] = True
                out.append(_packb([self._id(slot), OP_RELEASE, self.names[slot], token, self.owners[slot]]))
            else:
                self.releasing[slot] = False
                self.left[slot] -= 1
                if self.left[slot]:
                    out.append(self._acquire(slot))
                else:
                    self.finished += 1
        return out

    @property
    def done(self) -> bool:
        return self.finished == self.k


def _send(sock: socket.socket, out: list[bytes], how: str) -> None:
    if how == "each" or len(out) == 1:
        for frame in out:
            if sock.send(frame) != len(frame):
                raise RuntimeError("a short send: the bench's frames must fit the socket buffer")
        return
    data = out if how == "sendmsg" else [b"".join(out)]
    size = sum(map(len, data))
    sent = sock.sendmsg(data) if how == "sendmsg" else sock.send(data[0])
    if sent != size:
        raise RuntimeError("a short send: the bench's frames must fit the socket buffer")


def _connect(port: int, count: int, inflight: int, echo: bool) -> list[_Conn]:
    conns = []
    for i in range(count):
        sock = socket.create_connection(("127.0.0.1", port), 5.0)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn = _Conn(sock, i, inflight, echo)
        if not echo:
            sock.sendall(_packb([0x7FFFFFFF, OP_HELLO, PROTOCOL_VERSION, "syscall_floor", None]))
            while True:
                data = sock.recv(65536)
                if not data:
                    raise ConnectionError("the server closed the connection during HELLO")
                conn.unpacker.feed(data)
                replies = list(conn.unpacker)
                if replies:
                    if replies[0][1] != 0:
                        raise RuntimeError(f"HELLO refused: {replies[0]!r}")
                    break
        sock.setblocking(False)
        conns.append(conn)
    return conns


def _run_epoll(conns: list[_Conn], pairs: int, how: str) -> int:
    """``pairs`` pairs per slot of every connection; returns the loop's turns."""
    by_fd = {c.fd: c for c in conns}
    ep = select.epoll()
    try:
        for c in conns:
            ep.register(c.fd, select.EPOLLIN)
            _send(c.sock, c.start(pairs), how)
        active = len(conns)
        turns = 0
        buf = bytearray(65536)
        view = memoryview(buf)
        deadline = time.monotonic() + RUN_LIMIT
        while active:
            turns += 1
            for fd, _ in ep.poll(5.0):
                c = by_fd[fd]
                size = c.sock.recv_into(buf)
                if not size:
                    raise ConnectionError("the server closed a connection")
                out = c.on_data(view[:size])
                if out:
                    _send(c.sock, out, how)
                elif c.done:
                    active -= 1
            if turns & 1023 == 0 and time.monotonic() > deadline:
                raise TimeoutError(f"the run took longer than {RUN_LIMIT} s")
        return turns
    finally:
        ep.close()


class _FloorProtocol(asyncio.Protocol):
    """A :class:`_Conn` as an asyncio protocol: one ``transport.write`` per read."""

    def __init__(self, conn: _Conn, how: str) -> None:
        self.conn = conn
        self.how = how
        self.transport: asyncio.Transport | None = None
        self.finished: asyncio.Future[None] | None = None

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        try:
            out = self.conn.on_data(data)
        except Exception as exc:  # noqa: BLE001 - handed to the awaiting run
            if not self.finished.done():
                self.finished.set_exception(exc)
            return
        if out:
            if self.how == "each":
                for frame in out:
                    self.transport.write(frame)
            else:
                self.transport.write(out[0] if len(out) == 1 else b"".join(out))
        elif self.conn.done and not self.finished.done():
            self.finished.set_result(None)

    def connection_lost(self, exc) -> None:
        if self.finished is not None and not self.finished.done():
            self.finished.set_exception(exc or ConnectionError("the server closed a connection"))


async def _uvloop_protocols(conns: list[_Conn], how: str) -> list[_FloorProtocol]:
    loop = asyncio.get_running_loop()
    protos = []
    for c in conns:
        _, proto = await loop.create_connection(lambda c=c: _FloorProtocol(c, how), sock=c.sock)
        protos.append(proto)
    return protos


async def _run_uvloop(protos: list[_FloorProtocol], pairs: int) -> None:
    loop = asyncio.get_running_loop()
    for p in protos:
        p.finished = loop.create_future()
        out = p.conn.start(pairs)
        p.transport.write(b"".join(out))
    await asyncio.wait_for(asyncio.gather(*(p.finished for p in protos)), RUN_LIMIT)


def measure(echo: bool, shape: Shape, clients: int, pairs: int, count_syscalls: bool = False) -> Figures:
    """One run of ``pairs`` pairs (in all) in ``shape`` over ``clients`` connections (see the
    module docstring).

    :raises RuntimeError: the server refused a request, or a send was short.
    :raises TimeoutError: the run took longer than ``RUN_LIMIT`` seconds.
    """
    per = max(1, pairs // (clients * shape.inflight))
    n = per * clients * shape.inflight
    with server_process(echo) as (srv_pid, port):
        conns = _connect(port, clients, shape.inflight, echo)
        loop = None
        try:
            if shape.loop == "uvloop":
                import uvloop

                loop = uvloop.new_event_loop()
                protos = loop.run_until_complete(_uvloop_protocols(conns, shape.write))
                loop.run_until_complete(_run_uvloop(protos, 20))  # warm-up
            else:
                _run_epoll(conns, 20, shape.write)  # warm-up
            counter = SyscallCounter() if count_syscalls else None
            if counter is not None:
                counter.start()
            s0 = _cpu_seconds(srv_pid)
            r0 = resource.getrusage(resource.RUSAGE_SELF)
            t0 = time.perf_counter()
            if loop is not None:
                loop.run_until_complete(_run_uvloop(protos, per))
                turns = None
            else:
                turns = _run_epoll(conns, per, shape.write)
            t1 = time.perf_counter()
            if counter is not None:
                counter.stop()
            r1 = resource.getrusage(resource.RUSAGE_SELF)
            s1 = _cpu_seconds(srv_pid)
            calls: dict[str, float] = {}
            if counter is not None:
                counter.close()
                calls = {name: c / n for name, c in counter.counts().items()}
        finally:
            if loop is not None:
                for p in protos:
                    p.transport.close()
                loop.run_until_complete(asyncio.sleep(0))
                loop.close()
            for c in conns:
                c.sock.close()
    return Figures(1e6 * (r1.ru_utime - r0.ru_utime) / n, 1e6 * (r1.ru_stime - r0.ru_stime) / n,
                   1e6 * (s1 - s0) / n, n / (t1 - t0), None if turns is None else turns / n, calls)


TABLE = (
    Shape("epoll", 1, "join"),
    Shape("epoll", 4, "each"),
    Shape("epoll", 4, "join"),
    Shape("epoll", 4, "sendmsg"),
    Shape("epoll", 16, "join"),
    Shape("uvloop", 1, "join"),
    Shape("uvloop", 4, "each"),
    Shape("uvloop", 4, "join"),
    Shape("uvloop", 16, "join"),
)


def _line(label: str, f: Figures) -> str:
    turns = "" if f.turns_per_pair is None else f"  {f.turns_per_pair:.2f} turns/pair"
    calls = "".join(f"  {name} {c:.2f}" for name, c in sorted(f.syscalls.items()) if c >= 0.005)
    return (f"{label}: client user {f.user:5.1f} + system {f.system:5.1f} = {f.user + f.system:5.1f} us/pair"
            f"  server {f.server:5.1f} us/pair  {f.pairs_per_s:7.0f} pairs/s{turns}"
            + (f"\n    system calls per pair:{calls}" if calls else ""))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benches.syscall_floor", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--server", choices=("fastlock", "echo"), default="fastlock")
    ap.add_argument("--clients", type=int, default=32, help="connections (default 32)")
    ap.add_argument("--inflight", type=int, default=1, help="requests in flight per connection (default 1)")
    ap.add_argument("--write", choices=("join", "sendmsg", "each"), default="join")
    ap.add_argument("--loop", choices=("epoll", "uvloop"), default="epoll")
    ap.add_argument("--pairs", type=int, default=32000)
    ap.add_argument("--syscalls", action="store_true", help="count system calls per pair with perf stat")
    ap.add_argument("--table", action="store_true", help="run the standard rows")
    ap.add_argument("--rounds", type=int, default=1, help="--table: rounds of all rows, medians printed")
    args = ap.parse_args(argv)
    if args.clients < 1 or args.inflight < 1 or args.pairs < 1 or args.rounds < 1:
        ap.error("--clients, --inflight, --pairs and --rounds must be at least 1")
    echo = args.server == "echo"
    if not args.table:
        shape = Shape(args.loop, args.inflight, args.write)
        print(_line(shape.label(), measure(echo, shape, args.clients, args.pairs, args.syscalls)))
        return 0
    runs: dict[Shape, list[Figures]] = {s: [] for s in TABLE}
    for r in range(args.rounds):
        for shape in TABLE:
            f = measure(echo, shape, args.clients, args.pairs, args.syscalls)
            runs[shape].append(f)
            print(f"round {r + 1}: {_line(shape.label(), f)}", flush=True)
    print(f"medians of {args.rounds} round(s), {args.server} server, {args.clients} connections, "
          f"load average {os.getloadavg()[0]:.1f}:")
    for shape, fs in runs.items():
        med = Figures(*(statistics.median(getattr(f, field) for f in fs) for field in ("user", "system", "server",
                                                                                          "pairs_per_s")),
                      None if fs[0].turns_per_pair is None else statistics.median(f.turns_per_pair for f in fs),
                      {k: statistics.median(f.syscalls.get(k, 0.0) for f in fs) for k in fs[0].syscalls})
        print(_line(shape.label(), med))
    return 0


if __name__ == "__main__":
    sys.exit(main())
