"""An election candidate process: ``python -m fastlock.election``.

One candidate of a leader election (:class:`fastlock.client.election.Election`)
that prints one JSON line per event - ``ready``, ``elected``, ``act`` (every
``--act-every`` seconds while it leads), ``health``, ``lost`` - with its
candidate id, a monotonic time in seconds and the term's fencing token.  The
tests and ``benches/election_failover.py`` read these lines to check that no
two leaders act at once.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import sys
import time
from typing import Any

from ..client import connect

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    """``python -m fastlock.election``: one candidate printing JSON lines
    (``elected``, ``act``, ``health``, ``lost``) until killed."""
    parser = argparse.ArgumentParser(prog="python -m fastlock.election", description=main.__doc__,
                                     allow_abbrev=False)
    parser.add_argument("--server", action="append", required=True, metavar="HOST:PORT")
    parser.add_argument("--name", default="leader")
    parser.add_argument("--id", required=True, dest="candidate_id")
    parser.add_argument("--lease-duration", type=float, default=15.0)
    parser.add_argument("--renew-deadline", type=float, default=10.0)
    parser.add_argument("--retry-period", type=float, default=2.0)
    parser.add_argument("--act-every", type=float, default=0.05, help="seconds between 'act' lines while leading")
    parser.add_argument("--terms", type=int, default=0, help="stop after this many terms (0: never)")
    parser.add_argument("--hold", type=float, default=0.0, help="resign after leading this long (0: never)")
    args = parser.parse_args(argv)

    def emit(kind: str, t: float | None = None, **fields: Any) -> None:
        t = time.monotonic() if t is None else t
        sys.stdout.write(json.dumps({"event": kind, "id": args.candidate_id, "t": t, **fields}) + "\n")
        sys.stdout.flush()

    def emit_health(token: int, state: str) -> None:
        emit("health", state=state, token=token)

    async def run() -> None:
        async with connect(*args.server, client_name=args.candidate_id) as client:
            election = client.election(args.name, args.candidate_id, lease_duration=args.lease_duration,
                                       renew_deadline=args.renew_deadline, retry_period=args.retry_period)
            emit("ready")
            terms = 0
            while not args.terms or terms < args.terms:
                async with election.leadership() as term:
                    terms += 1
                    emit("elected", token=term.fencing_token)
                    term.health.add_listener(functools.partial(emit_health, term.fencing_token))
                    until = None if not args.hold else time.monotonic() + args.hold
                    while True:
                        now = time.monotonic()  # taken before the check: an act is stamped no later than its check
                        if not term.is_leader() or (until is not None and now >= until):
                            break
                        emit("act", t=now, token=term.fencing_token)
                        await asyncio.sleep(args.act_every)
                    if term.lost.is_set() and not term.resigned:
                        emit("lost", token=term.fencing_token)

    try:
        asyncio.run(run())
    except KeyboardInterrupt:
        return 130
    return 0

