"""The server's own CPU per acquire+release pair, with no socket and no client process.

    python -m benches.server_path [--pairs 20000] [--rounds 5] [--tag NAME] [--sharded]

An in-process :class:`fastlock.server.LockServer` (``--fsync never``, a throwaway data
dir, its port unused) is given one session whose transport keeps what is written to
it.  Each pair is two reads handed to the session's ``data_received`` as a socket
read would be: an ACQUIRE of a free lock (granted and answered at the batch end),
then a RELEASE with the token from the reply.  What is measured is therefore the
server's Python and compiled request path - decoding, dispatch, checks, the lock
table, the WAL append (never synced), the batch end, the reply - without the system
calls, which dominate and blur :mod:`benches.cpu_per_pair` on a shared machine.
Prints the process CPU microseconds per pair (min and median of the rounds; each
pair also decodes its two replies, the same cost for every build compared).  Two
installs are compared by running this module with each one's python, alternately.
``--sharded``: the server serves by a shard map whose one group it is (every name its
own), so each request also passes the shard check (:mod:`fastlock.server.sharded`).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from typing import Any

import msgpack

from .harness import run_async
from .null_transport import NullTransport


class _KeptTransport(NullTransport):
    """A transport that keeps the last bytes written to it."""

    def __init__(self) -> None:
        self.last = b""
        self.writes = 0

    def write(self, data: bytes) -> None:
        self.last = data
        self.writes += 1


async def _measure(pairs: int, rounds: int, sharded: bool = False) -> list[float]:
    from fastlock import protocol as P
    from fastlock.server import LockServer, ServerConfig
    from fastlock.sharding import ShardGroup, ShardMap, even_ranges

    shard_map = ShardMap(1, (ShardGroup("a", ("127.0.0.1:1",)),), even_ranges(["a"])) if sharded else None
    with tempfile.TemporaryDirectory() as data:
        server = LockServer(ServerConfig(port=0, data_dir=data, fsync="never", shard_map=shard_map,
                                         shard_group="a" if sharded else None))
        await server.start()
        try:
            session = server.limits.new_session()
            transport = _KeptTransport()
            session.connection_made(transport)  # type: ignore[arg-type]
            session.data_received(msgpack.packb([1, P.OP_HELLO, P.PROTOCOL_VERSION, "bench", None]))
            await asyncio.sleep(0)
            packb = msgpack.packb
            unpackb = msgpack.unpackb
            owner = b"0123456789abcdef"
            req_id = 1

            async def reply_to(request: bytes) -> Any:
                # the reply is written at the batch end: in this read, or in a later loop turn
                writes = transport.writes
                session.data_received(request)
                for turn in range(11_000):  # bounded: a grant is delivered within a few turns ...
                    if transport.writes != writes:
                        return unpackb(transport.last)
                    # ... or, when its batch went to the writer thread (a segment rotation), once
                    # the thread is done: then wait in 1 ms steps, 10 s at most
                    await asyncio.sleep(0 if turn < 1000 else 0.001)
                raise RuntimeError("no reply")

            async def pair() -> None:
                nonlocal req_id
                req_id += 2
                granted = await reply_to(packb([req_id, P.OP_ACQUIRE, "k", owner, 10_000, 0, 0, None]))
                released = await reply_to(packb([req_id + 1, P.OP_RELEASE, "k", granted[2][0], owner]))
                if released[1] != 0:
                    raise RuntimeError(f"release refused: {released}")

            for _ in range(2000):  # warm-up
                await pair()
            per_pair = []
            for _ in range(rounds):
                t0 = time.process_time()
                for _ in range(pairs):
                    await pair()
                per_pair.append((time.process_time() - t0) / pairs * 1e6)
            session.close()
        finally:
            await server.close()
    return per_pair


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benches.server_path", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    for flag, default in (("--pairs", 20000), ("--rounds", 5)):
        ap.add_argument(flag, type=int, default=default)
    ap.add_argument("--tag", default="fastlock")
    ap.add_argument("--sharded", action="store_true", help="serve by a one-group shard map (the shard check's cost)")
    args = ap.parse_args(argv)
    per_pair = run_async(_measure(args.pairs, args.rounds, args.sharded))  # on uvloop when it is installed
    print(f"{args.tag}: server CPU {min(per_pair):6.2f} us/pair (min), {statistics.median(per_pair):6.2f} (median) "
          f"of {args.rounds} rounds of {args.pairs}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
