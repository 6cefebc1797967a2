"""What one client's attached leases cost every other client's session requests.

    python -m benches.session_opens [--leases 90000] [--opens 64]

What runs
---------
One ``fastlock serve`` process (open mode, ``--fsync never``) on 127.0.0.1.  A first
connection opens a session and attaches ``--leases`` leases to it (pipelined ACQUIREs
and SESSION_ATTACHes of 60).  A second connection then sends ``--opens``
``SESSION_OPEN`` requests (resuming its own session) in one write, then one PING, and
the bench prints the time the opens took (ms, and per open) and the PING's round trip.
A SESSION_OPEN looks at the sessions to drop the ones not heard from past their
deadline; each look must cost the same whatever leases the sessions hold (target: well
under 1 ms per open with 90,000 leases attached elsewhere).  Every loop is bounded in
count, and the server is stopped by PID.
"""

from __future__ import annotations

import argparse
import os
import socket
import tempfile
import time

import msgpack

from fastlock import protocol as P
from fastlock._testbase import ServerProcess

#: leases taken and attached per pipelined write
CHUNK = 3000
#: seconds: the longest a reply may take to arrive
REPLY_TIMEOUT = 120.0


class _Raw:
    """A blocking protocol connection whose requests go out in one write."""

    def __init__(self, address: str):
        host, port = address.rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)), timeout=REPLY_TIMEOUT)
        self.unpacker = msgpack.Unpacker()
        self.next_id = 1
        self.send([(P.OP_HELLO, P.PROTOCOL_VERSION, "bench", None)])

    def send(self, requests: list[tuple]) -> dict[int, list]:
        first = self.next_id
        out = b"".join(msgpack.packb([first + i, op, *args]) for i, (op, *args) in enumerate(requests))
        self.next_id += len(requests)
        self.sock.sendall(out)
        replies: dict[int, list] = {}
        while len(replies) < len(requests):
            chunk = self.sock.recv(1 << 20)
            if not chunk:
                raise ConnectionError("the server closed the connection")
            self.unpacker.feed(chunk)
            replies.update((r[0], r) for r in self.unpacker if r[0] != 0)
        return replies

    def close(self) -> None:
        self.sock.close()


def _attach(raw: _Raw, key: bytes, leases: int) -> None:
    for base in range(0, leases, CHUNK):
        n = min(CHUNK, leases - base)
        owners = [os.urandom(16) for _ in range(n)]
        first = raw.next_id
        acquired = raw.send([(P.OP_ACQUIRE, f"bench/{base + i}", owners[i], 600_000, 0, 0, None) for i in range(n)])
        items = [[f"bench/{base + i}", acquired[first + i][2][0], owners[i]] for i in range(n)]
        raw.send([(P.OP_SESSION_ATTACH, key, items[i:i + 60], []) for i in range(0, n, 60)])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benches.session_opens", description=__doc__.split("\n\n")[0])
    parser.add_argument("--leases", type=int, default=90_000, help="leases attached to one session (default 90000)")
    parser.add_argument("--opens", type=int, default=64, help="SESSION_OPENs sent together (default 64)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="fastlock-bench-") as tmp:
        server = ServerProcess(os.path.join(tmp, "data"), fsync="never")
        server.start()
        try:
            holder = _Raw(server.address)
            key = os.urandom(16)
            holder.send([(P.OP_SESSION_OPEN, key, 600_000)])
            _attach(holder, key, args.leases)
            other = _Raw(server.address)
            own = os.urandom(16)
            other.send([(P.OP_SESSION_OPEN, own, 10_000)])
            started = time.perf_counter()
            other.send([(P.OP_SESSION_OPEN, own, 10_000)] * args.opens)
            opens_ms = (time.perf_counter() - started) * 1000
            started = time.perf_counter()
            other.send([(P.OP_PING,)])
            ping_ms = (time.perf_counter() - started) * 1000
            print(f"{args.leases} leases attached to one session: {args.opens} SESSION_OPEN of another client "
                  f"in {opens_ms:.1f} ms ({opens_ms / args.opens:.3f} ms each); PING after them {ping_ms:.2f} ms")
            other.close()
            holder.close()
        finally:
            server.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
