"""``fastlock top``: a live terminal view of the primary's locks (rich), refreshed each second.

Each frame asks the primary for ``status`` (counters, sessions, role), ``locks`` ranked by
the server (the ``--rows`` locks with the most waiters, then by name: one page, however many
locks are held) and ``lock`` for those with waiters (their waiters, oldest first), then shows:

- a header: role, epoch, sessions, held locks, waiters, and the grants, releases,
  expiries and wait timeouts per second since the previous frame (with ``--once``, which
  has no previous frame: their totals since the server started);
- the locks with the deepest queues first (then the most handovers), one row each (a
  name or holder as :func:`fastlock.logsafe.text_value` shows it, never wrapped): the
  fencing token, the holder, how long top has seen this holder hold it, the TTL
  left, the waiters, the longest current wait and the handovers top has seen;
- the wait and hold percentiles (p50, p90, p99) of what top sees: **wait** is how long
  each current waiter of those locks has waited so far; **hold** is how long the leases
  that top saw end were held, to the resolution of one frame (so the first frame has
  none); when more locks are held than shown, only the handovers of the locks shown.

Top needs no ``--metrics``: it is built from the admin requests (an admin principal, or
open mode).  The server's own histograms of time-to-acquire and hold time, measured on
every grant, are on the Prometheus endpoint when the server runs with ``--metrics``
(:mod:`fastlock.observe`); top does not read them.  ``--once`` prints one frame and
exits (for scripts and tests; no terminal needed); without a terminal (stdout a pipe or a
file) top prints one plain frame per refresh instead of redrawing the screen; ``-o json``
prints one JSON snapshot (:func:`snapshot`) and exits.  When the server goes away, top
shows "disconnected, retrying" and resumes once it answers again.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import sys
import time
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from ..client import Client, LeaseInfo, LockInfo
from ..client.sharded import ShardedClient, route_if_sharded
from ..errors import NotPrimary, Unavailable
from ..logsafe import display, text_value
from .args import client_tls_options, read_token
from .locks import _common, _holder, _servers, report_unreachable

__all__ = ["add_parser", "snapshot", "TopSampler"]

#: holds whose end top saw, kept for the percentiles (the last this many)
HOLDS_KEPT = 10_000
RATES = ("grants", "releases", "expiries", "wait_timeouts")


def add_parser(sub: Any) -> None:
    """Add ``top`` to ``fastlock``'s subparsers."""
    p = sub.add_parser("top", help="live view of the busiest and most contended locks (refreshes each second)")
    p.set_defaults(handler=top_command)
    p.add_argument("--rows", type=int, default=15, metavar="N", help="locks shown (default 15)")
    p.add_argument("--once", action="store_true", help="print one frame and exit")
    p.add_argument("--interval", type=float, default=1.0, metavar="S", help="seconds between frames (default 1)")
    _common(p)


def percentiles(values: list[float]) -> str:
    """``p50/p90/p99`` of ``values`` in seconds (nearest rank), or "-" when empty."""
    if not values:
        return "-"
    ordered = sorted(values)
    picks = [ordered[min(len(ordered) - 1, int(q * len(ordered)))] for q in (0.5, 0.9, 0.99)]
    return "/".join(f"{v:.2f}s" for v in picks) + f"  (n={len(ordered)})"


class TopSampler:
    """What top remembers between frames: when it first saw each (lock, token), the
    handovers per lock, the holds that ended and the previous counters."""

    def __init__(self) -> None:
        self.first_seen: dict[str, tuple[int, float]] = {}
        self.handovers: collections.Counter[str] = collections.Counter()
        self.holds: collections.deque[float] = collections.deque(maxlen=HOLDS_KEPT)
        self.previous: tuple[float, dict[str, Any]] | None = None

    def observe(self, now: float, leases: list[LeaseInfo], complete: bool = True) -> None:
        """Record one frame's held leases (exclusive holders by name; the first holder of a
        shared lock).  ``complete``: ``leases`` are all the held ones; else (a page of
        them) a lock missing from it may still be held, so it is forgotten, not counted
        as a hold that ended."""
        current: dict[str, int] = {}
        for lease in leases:
            current.setdefault(lease.name, lease.fencing_token)
        for name, (token, since) in list(self.first_seen.items()):
            if current.get(name) != token:
                del self.first_seen[name]
                if name in current or complete:
                    self.holds.append(now - since)
                if name in current:
                    self.handovers[name] += 1
        for name, token in current.items():
            self.first_seen.setdefault(name, (token, now))

    def rates(self, now: float, status: dict[str, Any]) -> dict[str, float] | None:
        """Per-second rates of the counters since the previous frame (None on the first)."""
        previous, self.previous = self.previous, (now, status)
        if previous is None or now <= previous[0]:
            return None
        dt = now - previous[0]
        return {k: (status.get(k, 0) - previous[1].get(k, 0)) / dt for k in RATES}


def _ranked(sampler: TopSampler, leases: list[LeaseInfo], rows: int) -> list[LeaseInfo]:
    """The ``rows`` locks to show: deepest queue first, then the most handovers, then by name
    (one lease per lock: the first holder of a shared lock)."""
    by_name: dict[str, LeaseInfo] = {}
    for lease in leases:
        by_name.setdefault(lease.name, lease)
    return sorted(by_name.values(), key=lambda h: (-h.waiters, -sampler.handovers[h.name], h.name))[:rows]


#: the width of a frame written off a terminal without COLUMNS (rich would assume 80 and cut columns)
PLAIN_WIDTH = 400


def console() -> Console:
    """The terminal's width on a terminal; off one (a pipe, a file) ``COLUMNS`` if set, else
    :data:`PLAIN_WIDTH`, so that no column of a frame is cut."""
    if sys.stdout.isatty():
        return Console()
    return Console(force_terminal=False, width=None if os.environ.get("COLUMNS") else PLAIN_WIDTH)


def render(sampler: TopSampler, now: float, status: dict[str, Any], leases: list[LeaseInfo],
           infos: dict[str, LockInfo], rows: int, once: bool = False) -> Group:
    """One frame (see the module docstring); ``once``: the only frame (totals, not rates)."""
    rates = sampler.rates(now, status)
    head = Text()
    head.append(f"fastlock {status.get('version', '')}  {status.get('role', '?')}  epoch {status.get('epoch', 0)}",
                style="bold")
    head.append(f"   sessions {status.get('sessions', 0)}  held {status.get('locks_held', 0)}  "
                f"waiters {status.get('waiters', 0)}\n")
    for group, st in sorted(status.get("groups", {}).items()):
        head.append(f"  group {text_value(group)}: {st.get('role', '?')}  epoch {st.get('epoch', 0)}  sessions "
                    f"{st.get('sessions', 0)}  held {st.get('locks_held', 0)}  waiters {st.get('waiters', 0)}  "
                    + "  ".join(f"{k.replace('_', ' ')} {st.get(k, 0)}" for k in RATES) + "\n")
    for group, error in sorted(status.get("unreachable", {}).items()):
        head.append(f"  group {text_value(group)}: unreachable ({text_value(error)})\n", style="bold red")
    if rates is None and once:
        head.append("totals since the server started: "
                    + "  ".join(f"{k.replace('_', ' ')} {status.get(k, 0)}" for k in RATES)
                    + " (per-second rates need a second frame: run top without --once)")
    elif rates is None:
        head.append("rates: after the next frame")
    else:
        head.append("per second: " + "  ".join(f"{k.replace('_', ' ')} {v:.1f}" for k, v in rates.items()))
    ranked = _ranked(sampler, leases, rows)
    table = Table(expand=False, header_style="bold")
    for col in ("LOCK", "TOKEN", "HOLDER", "HELD", "TTL LEFT", "WAITERS", "LONGEST WAIT", "HANDOVERS"):
        table.add_column(col, justify="left" if col in ("LOCK", "HOLDER") else "right", no_wrap=True)
    waits: list[float] = []
    for h in ranked:
        info = infos.get(h.name)
        lock_waits = [w.waiting for w in info.waiters] if info is not None else []
        waits.extend(lock_waits)
        seen = sampler.first_seen.get(h.name)
        table.add_row(Text(text_value(h.name)), str(h.fencing_token), Text(text_value(_holder(h))),
                      f"{now - seen[1]:.1f}s" if seen is not None and seen[0] == h.fencing_token else "-",
                      f"{h.remaining:.1f}s", str(h.waiters),
                      f"{max(lock_waits):.1f}s" if lock_waits else "-", str(sampler.handovers[h.name]))
    foot = Text(f"wait so far p50/p90/p99: {percentiles(waits)}\n"
                f"hold (ended, seen by top) p50/p90/p99: {percentiles(list(sampler.holds))}")
    return Group(head, table, foot)


Sample = tuple[float, dict[str, Any], list[LeaseInfo], dict[str, LockInfo]]


#: the status fields a sharded deployment's totals add up over its groups
SUMMED = ("sessions", "locks_held", "waiters", *RATES)


async def whole_status(client: Client) -> dict[str, Any]:
    """The primary's ``status``; for a sharded deployment (:class:`ShardedClient`) every group's
    (:meth:`ShardedClient.over_groups`), added up: the :data:`SUMMED` fields are the totals,
    ``groups`` (group name -> its status) and ``unreachable`` (group name -> the error) name
    each group, ``role`` says how many of the groups asked answered, ``epoch`` is the shard map's."""
    if not isinstance(client, ShardedClient):
        return await client.status()
    found = await client.over_groups(lambda c: c.status())
    first = next(iter(found.answers.values()))
    totals = {k: sum(st.get(k, 0) for st in found.answers.values()) for k in SUMMED}
    asked = len(found.answers) + len(found.reasons())
    return {"version": first.get("version", ""), "role": f"{len(found.answers)} of {asked} shard groups",
            "epoch": client.shard_map.epoch, **totals, "groups": found.answers, "unreachable": found.reasons()}


async def sample(client: Client, sampler: TopSampler, rows: int) -> Sample:
    """Ask the primary once (every group of a sharded deployment: :func:`whole_status`):
    ``(now, status, leases, infos of the most contended)``."""
    status = await whole_status(client)
    listing = await client.locks("", most=rows, order="contended")  # ranked by the server: one page
    now = time.monotonic()
    sampler.observe(now, listing.locks, complete=not listing.truncated)
    contended = [h for h in listing.locks if h.waiters]
    infos = {h.name: await client.lock_info(h.name) for h in contended}
    return now, status, listing.locks, infos


async def frame(client: Client, sampler: TopSampler, rows: int, once: bool = False) -> Group:
    """Sample the primary once and render a frame (``once``: see :func:`render`)."""
    now, status, leases, infos = await sample(client, sampler, rows)
    return render(sampler, now, status, leases, infos, rows, once)


def _percentile_fields(values: list[float]) -> dict[str, Any]:
    if not values:
        return {"n": 0, "p50": None, "p90": None, "p99": None}
    ordered = sorted(values)
    pick = {f"p{round(q * 100)}": ordered[min(len(ordered) - 1, int(q * len(ordered)))] for q in (0.5, 0.9, 0.99)}
    return {"n": len(ordered), **pick}


def snapshot(sampler: TopSampler, now: float, status: dict[str, Any], leases: list[LeaseInfo],
             infos: dict[str, LockInfo], rows: int) -> dict[str, Any]:
    """One frame as JSON (``fastlock top -o json``): ``role``, ``epoch``, ``sessions``,
    ``locks_held``, ``waiters``, ``counters`` (the server's totals of ``grants``,
    ``releases``, ``expiries``, ``wait_timeouts``), ``locks`` (the rows of the table,
    most contended first: ``name``, ``token``, ``principal``, ``client``,
    ``correlation_id``, ``remaining`` and ``longest_wait`` in seconds or null,
    ``waiters``) and ``wait`` (``n``, ``p50``, ``p90``, ``p99`` in seconds of the
    current waits of those locks).  For a sharded deployment the counts are the totals of
    every group, with ``groups`` (group name -> its ``role``, ``epoch``, ``sessions``,
    ``locks_held``, ``waiters``, ``counters``) and ``unreachable`` (group name -> the error)."""
    waits: list[float] = []
    listed = []
    for h in _ranked(sampler, leases, rows):
        info = infos.get(h.name)
        lock_waits = [w.waiting for w in info.waiters] if info is not None else []
        waits.extend(lock_waits)
        listed.append({"name": h.name, "token": h.fencing_token, "principal": h.principal, "client": h.client,
                       "correlation_id": h.correlation_id, "remaining": h.remaining, "waiters": h.waiters,
                       "longest_wait": max(lock_waits) if lock_waits else None})
    shown = {**{k: status.get(k) for k in ("role", "epoch", "sessions", "locks_held", "waiters")},
             "counters": {k: status.get(k, 0) for k in RATES}, "locks": listed, "wait": _percentile_fields(waits)}
    if "groups" in status:
        shown["groups"] = {group: {**{k: st.get(k) for k in ("role", "epoch", "sessions", "locks_held", "waiters")},
                                   "counters": {k: st.get(k, 0) for k in RATES}}
                           for group, st in status["groups"].items()}
        shown["unreachable"] = status["unreachable"]
    return shown


#: what a lost server looks like to top's requests: it shows "disconnected, retrying" and goes on
_DISCONNECTED = (ConnectionError, OSError, TimeoutError, Unavailable, NotPrimary)


def _disconnected(exc: BaseException, since: float) -> Text:
    return Text(f"disconnected, retrying every frame ({type(exc).__name__}: {display(str(exc))}; "
                f"for {time.monotonic() - since:.0f} s)", style="bold red")


def top_command(args: argparse.Namespace) -> int:
    """Show the top view: a live screen on a terminal; one plain frame per refresh when
    stdout is not a terminal; one frame with ``--once``; one JSON object (:func:`snapshot`)
    with ``-o json``.  A server that goes away is shown as "disconnected, retrying" until
    it answers again."""
    if args.rows < 1 or not 0.1 <= args.interval <= 60:
        raise ValueError("--rows must be at least 1 and --interval 0.1..60 seconds")
    token = read_token(args)

    def make_client(addresses: Any) -> Client:
        return Client(addresses, token=token, client_name="fastlock-top", connect_timeout=args.connect_timeout,
                      **client_tls_options(args))

    async def run() -> int:
        client = make_client(_servers(args))
        sampler = TopSampler()
        down_since: float | None = None

        async def next_frame() -> Any:
            nonlocal down_since
            try:
                shown = await frame(client, sampler, args.rows)
            except _DISCONNECTED as exc:
                down_since = down_since or time.monotonic()
                return _disconnected(exc, down_since)
            down_since = None
            return shown

        try:
            # a sharded deployment: the counters and the locks of every group
            client = await route_if_sharded(client, make_client)
            if args.output == "json":
                taken = await sample(client, sampler, args.rows)
                print(json.dumps(snapshot(sampler, *taken, args.rows)))
                return report_unreachable(taken[1].get("unreachable", {}), "its counters and locks are not shown")
            if args.once:
                now, status, leases, infos = await sample(client, sampler, args.rows)
                console().print(render(sampler, now, status, leases, infos, args.rows, once=True))
                return report_unreachable(status.get("unreachable", {}), "its counters and locks are not shown")
            if not sys.stdout.isatty():  # a pipe or a file: one plain frame per refresh, no screen control
                plain = console()
                while True:
                    plain.print(await next_frame())
                    plain.print()
                    sys.stdout.flush()
                    await asyncio.sleep(args.interval)
            with Live(await frame(client, sampler, args.rows), auto_refresh=False, screen=False) as live:
                while True:
                    await asyncio.sleep(args.interval)
                    live.update(await next_frame(), refresh=True)
        finally:
            await client.close()

    return asyncio.run(run())
