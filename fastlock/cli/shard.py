"""``fastlock shard init|status|addresses|move|split``: the shard map kept in etcd (docs/sharding.md).

``init`` writes the first map (the slots split evenly over the groups given, or a map
file) if none exists; ``status`` prints the map (``--server``: the one a node serves by),
with the ranges a move is moving; ``addresses`` replaces a group's addresses, or adds a
group that owns no slot yet, as the next epoch; ``move --slots A[-B] --to GROUP`` moves
slots to another group (:mod:`fastlock.cli.shardmove`; ``--abort`` undoes a move still
marked); ``split GROUP --to GROUP`` moves the upper half of ``GROUP``'s largest range;
``adopt --slots A[-B] (--from GROUP | --force)`` gives slots their owner gained without an
import their token floor (:mod:`fastlock.cli.shardadopt`).
Every write is an etcd transaction that fails if the map changed since it was read
(:mod:`fastlock.coordination.shardmap`); the nodes that follow the map apply the new
epoch.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from typing import Any

from ..client import Client
from ..client.sharded import read_shard_map
from ..coordination.access import EtcdAccess
from ..coordination.shardmap import MapConflict, load_from_etcd
from ..server.sharded import HOLD_S
from ..sharding import ShardGroup, ShardMap, ShardMapError, even_ranges, load_map_file
from ..sharding.moves import parse_slots, record_floor, split_half
from ..tokens import MAX_EPOCH, format_token
from .args import read_token
from .shardadopt import adopt_slots
from .shardmove import abort_slots, move_slots

#: how many times ``shard adopt`` writes the adopted floor into the map in etcd when the map changed under the write
RECORD_ATTEMPTS = 3

__all__ = ["add_parser"]


def _group_arg(value: str) -> ShardGroup:
    name, eq, addresses = value.partition("=")
    if not eq or not name or not addresses:
        raise argparse.ArgumentTypeError(f"a group is NAME=HOST:PORT[,HOST:PORT...], not {value!r}")
    return ShardGroup(name, tuple(a.strip() for a in addresses.split(",")))


def add_parser(sub: Any) -> argparse.ArgumentParser:
    """Add ``shard`` to ``fastlock``'s subparsers."""
    s = sub.add_parser("shard", help="the shard map kept in etcd (init, status, addresses, move, split, adopt)")
    s.set_defaults(handler=shard_command)
    commands = s.add_subparsers(dest="shard_command", required=True)
    for name, what in (("init", "write the first shard map"), ("status", "print the shard map"),
                       ("addresses", "replace a group's addresses, or add a group (the next epoch)"),
                       ("move", "move slots to another group (run again to resume a move that stopped)"),
                       ("split", "move the upper half of a group's largest slot range to another group"),
                       ("adopt", "give slots their owner gained without a move's import their token floor")):
        p = commands.add_parser(name, help=what)
        p.add_argument("--coordinator", required=name not in ("status", "adopt"),
                       metavar="etcd://HOST:PORT[,HOST:PORT]/PREFIX",
                       help="the etcd and key prefix the groups use; the map is the key PREFIX/shard-map")
        if name in ("status", "adopt"):
            p.add_argument("--server", metavar="HOST:PORT",
                           help="instead of --coordinator: the map a node serves by (SHARD_MAP; a static map "
                                "file's too); its token from FASTLOCK_TOKEN_FILE, as every client's")
        p.add_argument("-o", "--output", choices=("text", "json"), default="text")
        p.add_argument("--coordinator-protocol", choices=("http", "https"), default="http",
                       help="how to reach etcd: https verifies etcd's certificate (docs/etcd.md); default http")
        p.add_argument("--coordinator-cacert", metavar="FILE", help="the CA that signed etcd's certificate (PEM)")
        p.add_argument("--coordinator-cert", metavar="FILE", help="a client certificate for etcd (PEM)")
        p.add_argument("--coordinator-key", metavar="FILE", help="its private key (default: in --coordinator-cert)")
        p.add_argument("--coordinator-user", metavar="NAME", help="the etcd user to log in as")
        p.add_argument("--coordinator-password-file", metavar="FILE",
                       help="the --coordinator-user's password, on the file's first line")
        if name == "init":
            p.add_argument("--group", dest="groups", type=_group_arg, action="append", metavar="NAME=HOST:PORT,...",
                           help="a group and its nodes' addresses, in slot order (the slots are split evenly)")
            p.add_argument("--from-file", metavar="FILE", help="a map file (JSON or TOML) instead of --group")
        if name == "addresses":
            p.add_argument("group", type=_group_arg, metavar="NAME=HOST:PORT,...")
        if name == "move":
            p.add_argument("--slots", required=True, metavar="SLOTS", help="the slots to move: A, or A-B (0..16383)")
            p.add_argument("--abort", action="store_true",
                           help="undo the move of these slots to --to while it is still marked")
        if name == "split":
            p.add_argument("group", metavar="GROUP", help="the group whose largest range is split")
        if name in ("move", "split"):
            p.add_argument("--to", required=True, metavar="GROUP", help="the group that gets the slots")
        if name == "adopt":
            p.add_argument("--slots", required=True, metavar="SLOTS",
                           help="the slots (A, or A-B) whose owner adopts their token floor")
            origin = p.add_mutually_exclusive_group(required=True)
            origin.add_argument("--from", dest="source", metavar="GROUP",
                                help="the group that served the slots before: its primary's last token is the floor")
            origin.add_argument("--force", action="store_true",
                                help="that group is lost: the floor is an epoch above --above-epoch and every "
                                     "epoch the map's nodes that answer have")
            p.add_argument("--above-epoch", type=int, default=0, metavar="N",
                           help="an epoch the floor must be above (the lost group's highest epoch)")
    return s


def _print(shard_map: ShardMap, output: str) -> None:
    if output == "json":
        print(json.dumps(shard_map.to_wire()))
        return
    print(f"epoch {shard_map.epoch}")
    for g in shard_map.groups:
        print(f"group {g.name}: {shard_map.slot_count(g.name)} slots, {', '.join(g.addresses)}")
    for r in shard_map.ranges:
        moving = f" (moving to {r.moving_to})" if r.moving_to is not None else ""
        floor = f", token floor {format_token(r.floor)} since epoch {r.floor_epoch}" if r.floor is not None else ""
        print(f"slots {r.first}..{r.last}: {r.group}{moving}{floor}")


async def _served_map(server: str) -> ShardMap:
    """The map the node at ``server`` serves by.  :raises ShardMapError: it is not sharded."""
    client = Client([server], client_name="fastlock-shard")
    try:
        await client.ensure_connected()
        found = await read_shard_map(client)
    finally:
        await client.close()
    if found is None:
        raise ShardMapError(f"{server} is not sharded: it serves every name")
    return found[1]


async def _adopt(args: argparse.Namespace, shard_map: ShardMap, stored: Any = None) -> int:
    """``fastlock shard adopt`` by ``shard_map`` (etcd's, or the one ``--server`` serves by); with
    the map in etcd (``stored``), the floor adopted is then recorded on the slots in the map."""
    first, last = parse_slots(args.slots)
    if not 0 <= args.above_epoch < MAX_EPOCH:
        raise ShardMapError(f"--above-epoch is 0..{MAX_EPOCH - 1}")
    adopted = await adopt_slots(shard_map, first, last, source=args.source, force=args.force,
                                above_epoch=args.above_epoch, token=read_token(args),
                                progress=None if args.output == "json" else print)
    recorded = None if stored is None else await _record_floor(stored, first, last, adopted.owner, adopted.floor)
    if args.output == "json":
        print(json.dumps({**adopted._asdict(), "map_epoch": recorded}))
    else:
        print(f"done: slots {first}..{last} of {adopted.owner} adopted the token floor {adopted.floor} "
              f"({adopted.source}; {adopted.adopted} were unadopted); its epoch is {adopted.epoch}"
              + (f"; the shard map records the floor (epoch {recorded})" if recorded is not None else ""))
    return 0


async def _record_floor(stored: Any, first: int, last: int, owner: str, floor: int) -> int | None:
    """Record ``floor`` on slots ``first..last`` of ``owner`` in the map in etcd
    (:func:`~fastlock.sharding.moves.record_floor`; read again and retried when the map changed
    meanwhile): the epoch written, or None when the map had that floor already.  Every node of
    the group then stays above it, on an empty data directory too.

    :raises ShardMapError: the slots changed owner meanwhile.  :raises MapConflict: the map changed
        under each of :data:`RECORD_ATTEMPTS` writes (run the command again)."""
    for attempt in range(RECORD_ATTEMPTS):
        shard_map, revision = await stored.read_existing()
        new = record_floor(shard_map, first, last, owner, floor)
        if new is None:
            return None
        try:
            await stored.replace(revision, shard_map, new)
        except MapConflict:
            if attempt + 1 == RECORD_ATTEMPTS:
                raise
            continue
        return new.epoch
    return None


async def _tell_still_marked(stored: Any, first: int, last: int, to: str, command: str) -> None:
    """After a failed ``shard move|split``: if the map in etcd still marks ``first..last`` moving
    to ``to``, say so on stderr, with what that means for clients and the two ways out (the
    error itself names only the step that failed)."""
    try:
        found = await stored.read()
    except Exception:  # noqa: BLE001 - the move's own error is the one to report; this is a hint
        return
    if found is None:
        return
    shard_map = found[0]
    if any(shard_map.moving_to_of_slot(slot) != to for slot in range(first, last + 1)):
        return
    source = shard_map.owner_of_slot(first).name
    rerun = "the same command" if command == "move" else f"`fastlock shard move --slots {first}-{last} --to {to}`"
    print(f"fastlock shard: slots {first}..{last} are still marked moving from {source} to {to} (map epoch "
          f"{shard_map.epoch}): {source} holds every request for their names (each at most {HOLD_S:g} s, then "
          f"SlotMoving) and grants none of them until the move ends. Run {rerun} again to resume it, or "
          f"`fastlock shard move --slots {first}-{last} --to {to} --abort` to let {source} serve them again.",
          file=sys.stderr)


async def _run(args: argparse.Namespace) -> int:
    if args.shard_command in ("status", "adopt") and (args.server is None) == (args.coordinator is None):
        raise ShardMapError("give either --coordinator or --server")
    if args.shard_command == "status" and args.server is not None:
        _print(await _served_map(args.server), args.output)
        return 0
    if args.shard_command == "adopt" and args.server is not None:  # a static map file's deployment too
        return await _adopt(args, await _served_map(args.server))
    access = EtcdAccess(args.coordinator_protocol, args.coordinator_cacert, args.coordinator_cert,
                        args.coordinator_key, args.coordinator_user, args.coordinator_password_file)
    access.check()
    stored = await load_from_etcd(args.coordinator, access)
    try:
        if args.shard_command == "init":
            if bool(args.groups) == bool(args.from_file):
                raise ShardMapError("give either --group (one or more) or --from-file")
            if args.from_file:
                shard_map = load_map_file(args.from_file)
            else:
                shard_map = ShardMap(1, tuple(args.groups), even_ranges([g.name for g in args.groups]))
            await stored.create(shard_map)
            _print(shard_map, args.output)
            return 0
        found = await stored.read()
        if found is None:
            raise ShardMapError(f"no shard map in etcd at {stored.key}: `fastlock shard init` writes one")
        shard_map, revision = found
        if args.shard_command in ("move", "split"):
            if args.shard_command == "split":
                first, last = split_half(shard_map, args.group)
            else:
                first, last = parse_slots(args.slots)
            if args.shard_command == "move" and args.abort:
                _print(await abort_slots(stored, first, last, args.to), args.output)
                return 0
            try:
                report = await move_slots(stored, first, last, args.to,
                                          progress=None if args.output == "json" else print)
            except Exception:
                await _tell_still_marked(stored, first, last, args.to, args.shard_command)
                raise
            if args.output == "json":
                print(json.dumps(report.as_dict()))
            elif report.freeze_ms is not None:
                print(f"done: slots {first}..{last} moved from {report.source} to {args.to}; "
                      f"frozen {report.freeze_ms:.0f} ms")
            return 0
        if args.shard_command == "adopt":
            return await _adopt(args, shard_map, stored)
        if args.shard_command == "addresses":
            new = shard_map.with_addresses(args.group.name, args.group.addresses)
            await stored.replace(revision, shard_map, new)
            shard_map = new
        _print(shard_map, args.output)
        return 0
    finally:
        await stored.gateway.close()


def shard_command(args: argparse.Namespace) -> int:
    """``fastlock shard ...``; errors reach :func:`fastlock.cli.main`, which prints them."""
    return asyncio.run(_run(args))
