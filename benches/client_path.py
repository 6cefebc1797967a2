"""The client's own CPU per acquire+release pair, with no socket and no server.

    python -m benches.client_path [--pairs 20000] [--rounds 5] [--tag NAME] [--profile]

A :class:`fastlock.Client` is given a connection whose transport is an
in-process fake server: each request frame written to it is answered (a grant
for ACQUIRE, ``None`` for anything else) by a ``call_soon`` of the
connection's ``data_received``, as a socket read would be delivered.  What is
measured is therefore the client's Python path - argument checks, owner keys,
request encoding, the reply's decoding and dispatch, the lease, the asyncio
future and task hops - without the system calls and the server, which
dominate and blur :mod:`benches.cpu_per_pair` on a shared machine.  Prints the
process CPU microseconds per pair (min and median of the rounds).  Two
installs are compared by running this module with each one's python,
alternately (from a directory outside the source tree, so that the installed
package is imported).

``--profile`` runs the pairs under ``cProfile`` instead and prints the client's
Python-level calls per pair (a count that does not depend on the machine's load):
the calls of functions of fastlock and asyncio, and the calls of built-in functions
made from them; the fake server's and this bench's own are left out, and so is
compiled code (a Cython function calling another is no Python-level call).  Then the
most frequent of those functions, with their calls per pair.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import pstats
import statistics
import sys
import time
from typing import Any

import msgpack

from .harness import run_async


class _FakeServer:
    """A transport that answers every request frame in the next loop turn."""

    def __init__(self, proto: Any, loop: asyncio.AbstractEventLoop, acquire_op: int):
        self.proto = proto
        self.loop = loop
        self.acquire_op = acquire_op
        self.token = 1 << 40
        self.unpacker = msgpack.Unpacker(raw=False)

    def write(self, data: bytes) -> None:
        self.unpacker.feed(data)
        for req in self.unpacker:
            if req[1] == self.acquire_op:
                self.token += 1
                reply = msgpack.packb([req[0], 0, [self.token, req[4], 0]])
            else:
                reply = msgpack.packb([req[0], 0, None])
            self.loop.call_soon(self.proto.data_received, reply)

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return default

    def is_closing(self) -> bool:
        return False

    def close(self) -> None:
        pass

    def abort(self) -> None:
        pass


def _ours(filename: str) -> bool:
    """A function of the client's path: fastlock's or asyncio's, not the bench's nor msgpack's."""
    return ("/fastlock/" in filename or "/asyncio/" in filename) and "/benches/" not in filename


def client_calls(stats: pstats.Stats) -> dict[str, int]:
    """Python-level calls of the client's path in ``stats``, by function (see the module docstring)."""
    counts: dict[str, int] = {}
    for (filename, line, name), (_, calls, _, _, callers) in stats.stats.items():  # type: ignore[attr-defined]
        if filename == "~":
            calls = sum(c[1] if isinstance(c, tuple) else c for (f, _, _), c in callers.items() if _ours(f))
            label = name
        elif _ours(filename):
            label = f"{name} ({filename.rsplit('/', 1)[-1]}:{line})"
        else:
            continue
        if calls:
            counts[label] = counts.get(label, 0) + calls
    return counts


async def _measure(pairs: int, rounds: int, profile: bool = False) -> list[float]:
    from fastlock import protocol as P
    from fastlock.client import Client
    from fastlock.client.connection import ClientConnection

    loop = asyncio.get_running_loop()
    client = Client(["127.0.0.1:1"])
    proto = ClientConnection(("127.0.0.1", 1), lambda *_: None, 5.0)
    proto.connection_made(_FakeServer(proto, loop, P.OP_ACQUIRE))  # type: ignore[arg-type]
    client.connector.proto = proto
    for _ in range(2000):  # warm-up
        await client.release(await client.acquire("k", ttl=10))
    if profile:
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(pairs):
            await client.release(await client.acquire("k", ttl=10))
        profiler.disable()
        proto.close()
        counts = client_calls(pstats.Stats(profiler))
        print(f"client Python-level calls per pair: {sum(counts.values()) / pairs:.1f}")
        for label, calls in sorted(counts.items(), key=lambda kv: -kv[1])[:20]:
            print(f"  {calls / pairs:6.2f}  {label}")
        return []
    per_pair = []
    for _ in range(rounds):
        t0 = time.process_time()
        for _ in range(pairs):
            await client.release(await client.acquire("k", ttl=10))
        per_pair.append((time.process_time() - t0) / pairs * 1e6)
    proto.close()
    return per_pair


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benches.client_path", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    for flag, default in (("--pairs", 20000), ("--rounds", 5)):
        ap.add_argument(flag, type=int, default=default)
    ap.add_argument("--tag", default="fastlock")
    ap.add_argument("--profile", action="store_true", help="count the client's Python-level calls per pair")
    args = ap.parse_args(argv)
    per_pair = run_async(_measure(args.pairs, args.rounds, args.profile))  # on uvloop when it is installed
    if args.profile:
        return 0
    print(f"{args.tag}: client CPU {min(per_pair):6.2f} us/pair (min), {statistics.median(per_pair):6.2f} (median) "
          f"of {args.rounds} rounds of {args.pairs}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
