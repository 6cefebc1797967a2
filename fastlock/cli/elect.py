"""``fastlock elect``: campaign in a leader election, or listen to it, as ``etcdctl elect``.

``fastlock elect NAME PROPOSAL`` campaigns (:class:`fastlock.client.election.Election`):
it waits in the election's queue, prints ``PROPOSAL`` once elected, leads until
SIGINT or SIGTERM, then resigns (the next candidate is elected at once) and exits 0.
If the term is lost (renewals failed until the renew deadline), it says so on stderr
and exits 1: a supervisor restarts it as a new candidate.

``fastlock elect --listen NAME`` prints the leader's proposal each time the leader
changes, starting with the current one (nothing while nobody leads; with ``-o json``
one object per change, ``{"leader": PROPOSAL or null, "token": T or null}``), until
SIGINT or SIGTERM.  While the server is away it says on stderr that it is retrying
(``fastlock elect: disconnected (...); retrying every S s``, or with ``-o json`` the
object ``{"command": "elect", "error": "Disconnected", "message": ...}``), and goes on
once the server answers again.

``fastlock elect NAME PROPOSAL --transfer TO`` campaigns the same way, but when stopped
while leading it hands the leadership to the waiting candidate ``TO`` (its proposal) in
one server step instead of resigning (Kubernetes' coordinated leader election: a
rolling upgrade hands over to a chosen node with no gap); TO is elected at once with a
higher fencing token.  If TO is not waiting, it says so on stderr and resigns.
``fastlock elect --candidates NAME`` prints the waiting candidates' proposals in queue
order (the next leader first), one a line (with ``-o json`` one list), and exits.

The proposal is the candidate id of the term, kept with the grant as its correlation
id (at most 256 characters), so ``fastlock lock NAME`` and ``fastlock locks`` show it
too.  ``--ttl`` (seconds, default 15) is the term's lease TTL: a leader that dies
without resigning is replaced after at most that long; the renew deadline and the
retry period are two thirds and two fifteenths of it (Kubernetes' 15/10/2 s ratio).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal
import sys
from collections.abc import Awaitable
from typing import Any

from ..client import Client
from ..client.election import Election, Leader
from ..errors import FastlockError
from ..logsafe import display
from ..protocol import MAX_CORRELATION_ID_CHARS
from .args import client_tls_options, print_error, read_token, seconds_arg
from .locks import _common, _name_arg, _servers

__all__ = ["add_parser"]


def _proposal_arg(value: str) -> str:
    if not value or len(value) > MAX_CORRELATION_ID_CHARS:
        raise argparse.ArgumentTypeError(f"a proposal is 1..{MAX_CORRELATION_ID_CHARS} characters")
    return value


def add_parser(sub: Any) -> None:
    """Add ``elect`` to ``fastlock``'s subparsers."""
    p = sub.add_parser("elect", help="campaign in a leader election and print the proposal while leading, "
                                     "or --listen to print each new leader")
    p.set_defaults(handler=elect_command)
    p.add_argument("name", type=_name_arg, metavar="NAME")
    p.add_argument("proposal", nargs="?", type=_proposal_arg, metavar="PROPOSAL",
                   help="this candidate's value, printed by listeners while it leads")
    p.add_argument("-l", "--listen", action="store_true", help="print the leader each time it changes")
    p.add_argument("--transfer", type=_proposal_arg, metavar="TO",
                   help="when stopped while leading, hand the leadership to the waiting candidate TO")
    p.add_argument("--candidates", action="store_true",
                   help="print the waiting candidates in queue order and exit")
    p.add_argument("--ttl", type=seconds_arg, default=15.0, metavar="S",
                   help="seconds; the term's lease TTL (default 15)")
    _common(p)


def _emit(args: argparse.Namespace, leader: Leader | None) -> None:
    if args.output == "json":
        print(json.dumps({"leader": leader and leader.candidate_id, "token": leader and leader.fencing_token}),
              flush=True)
    elif leader is not None:
        print(leader.candidate_id if leader.candidate_id is not None else "-", flush=True)


async def _until_stopped(stop: asyncio.Event, work: Awaitable[Any]) -> tuple[bool, Any]:
    """Run ``work`` until it ends or ``stop`` is set (then it is cancelled);
    returns ``(stopped, result)``."""
    task = asyncio.ensure_future(work)
    stopper = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait((task, stopper), return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopper.cancel()
    if task.done():
        return False, task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return True, None


#: while the server is away, ``--listen`` repeats its "retrying" line every this many failed attempts
RETRY_REPORT_EVERY = 10


async def _listen(election: Election, args: argparse.Namespace) -> None:
    def retrying(exc: BaseException, failures: int) -> None:
        if failures == 1 or failures % RETRY_REPORT_EVERY == 0:
            print_error(args, "elect", f"{'still ' if failures > 1 else ''}disconnected ({display(str(exc))}); "
                                       f"retrying every {election.retry_period:g} s", "Disconnected")

    async for leader in election.observe(on_retry=retrying):
        _emit(args, leader)


async def _campaign(election: Election, args: argparse.Namespace, stop: asyncio.Event) -> int:
    stopped, term = await _until_stopped(stop, election.campaign())
    if stopped:
        return 0
    try:
        _emit(args, Leader(election.candidate_id, term.fencing_token))
        stopped, _ = await _until_stopped(stop, term.lost.wait())
        if not stopped and not term.resigned:
            print_error(args, "elect", f"lost the leadership of {display(args.name)} (token {term.fencing_token})",
                        "LeadershipLost")
            return 1
        return 0
    finally:
        if args.transfer is not None and not term.lost.is_set():
            try:
                await term.transfer(args.transfer)
            except FastlockError as exc:
                print_error(args, "elect", f"could not hand {display(args.name)} to {display(args.transfer)} "
                                           f"({display(str(exc))}); resigning", type(exc).__name__)
        await term.resign()


def elect_command(args: argparse.Namespace) -> int:
    if (args.listen or args.candidates) == (args.proposal is not None) or (args.listen and args.candidates):
        print("fastlock elect: give either NAME PROPOSAL (campaign), --listen NAME or --candidates NAME",
              file=sys.stderr)
        return 2
    token = read_token(args)

    async def run() -> int:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        client = Client(_servers(args), token=token, client_name="fastlock-elect",
                        connect_timeout=args.connect_timeout, **client_tls_options(args))
        try:
            await client.ensure_connected()
            election = client.election(args.name, args.proposal or "listener", lease_duration=args.ttl,
                                       renew_deadline=args.ttl * 2 / 3, retry_period=args.ttl * 2 / 15)
            if args.listen:
                await _until_stopped(stop, _listen(election, args))
                return 0
            if args.candidates:
                waiting = await election.candidates()
                if args.output == "json":
                    print(json.dumps(waiting), flush=True)
                else:
                    for candidate in waiting:
                        print(candidate if candidate is not None else "-", flush=True)
                return 0
            return await _campaign(election, args, stop)
        finally:
            await client.close()

    return asyncio.run(run())
