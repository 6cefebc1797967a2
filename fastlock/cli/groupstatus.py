"""``fastlock status --all``: every node of the pair or group in one table.

As ``etcdctl endpoint status --cluster -w table`` lists every member of an etcd
cluster from one endpoint, this asks the node named by ``--server`` for its
status and learns the other nodes from it:

* in an etcd group, from the member keys the node read in etcd (``coordinator.members``:
  node id and address of each live node) and the primary etcd names; the CLI never
  talks to etcd itself;
* in a pair, from the standby's primary address (``replication.primary``), or, asked
  at the primary, from the addresses its standbys announce (``replication.standbys``,
  and ``paired_standby_address`` from its ``pairing.json`` while the standby is away).

Then it asks each node for its status (one request each, at most :data:`MAX_NODES`) and
prints one row per node: address, node (its etcd node id in a group; in a pair its
``--name``, else its data directory's node id), role, epoch, lag (records and milliseconds,
as the primary measures them for its standbys) and the in-sync flag (in a group with
``--replication sync``: a member of ``PREFIX/sync``; in a sync pair: the primary's
``replication.sync.state`` is ``in_sync`` for its paired standby, or, with no primary
answering, the standby's own view).  A node that does not answer shows its error as its role.
Addresses read from etcd are untrusted: the admin token is proved to them, never sent.

A node of a sharded deployment (its status names its ``shard`` group) serves the shard map
(``SHARD_MAP``): the table then has a section per group of the map (:func:`sharded_rows`),
each learned as above from the first of the group's map addresses that answers.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import Any, NamedTuple

from ..protocol import OP_STATUS
from ..protocol.ops import OP_SHARD_MAP
from ..sharding import ShardMap
from ..units import format_address, parse_address

__all__ = ["MAX_NODES", "NodeRow", "format_table", "group_rows", "sharded_rows"]

#: the most nodes asked (a group's member keys beyond are left out)
MAX_NODES = 64
COLUMNS = ("ADDRESS", "NODE", "ROLE", "EPOCH", "LAG RECORDS", "LAG MS", "IN SYNC")


class NodeRow(NamedTuple):
    """One node of the table (None: not known, shown as ``-``)."""

    address: str
    node: str
    role: str
    epoch: int | None
    lag_records: int | None
    lag_ms: int | None
    in_sync: bool | None


def _ident(name: Any) -> str:
    """``[label@]principal/node`` -> ``principal/node`` (how a primary names a standby)."""
    return str(name).rpartition("@")[2]


def _peer_node(name: Any) -> str:
    """How a primary names a standby (``[label@]principal/node``) -> the standby's NODE cell:
    its label (its ``--name``) when it has one, else its node id."""
    label, at, ident = str(name).rpartition("@")
    return label if at and label else ident.rpartition("/")[2]


def _own_node(st: dict, fallback: str) -> str:
    """A node's NODE cell from its own STATUS: its etcd node id in a group, else its ``--name``,
    else its data directory's node id (``replication.node_name`` / ``node_id``)."""
    own = st.get("replication") or {}
    return str((st.get("coordinator") or {}).get("node") or own.get("node_name") or own.get("node_id") or fallback)


def group_rows(first: str, ask: Callable[[str], dict]) -> list[NodeRow]:
    """The table's rows, learned from the node at ``first`` (``host:port``).

    ``ask(address)`` returns that node's STATUS or raises (its error becomes the row's role).

    Raises:
        whatever ``ask(first)`` raises: the node asked first must answer.
    """
    statuses: dict[str, dict | Exception] = {first: ask(first)}
    names: dict[str, str] = {}
    st0 = statuses[first]
    assert isinstance(st0, dict)
    coordinator = st0.get("coordinator") or {}
    for m in coordinator.get("members") or []:
        if isinstance(m, dict) and type(m.get("address")) is str and m["address"]:
            names[m["address"]] = str(m.get("node", "?"))
    if isinstance(coordinator.get("primary"), dict) and coordinator["primary"].get("address"):
        names.setdefault(coordinator["primary"]["address"], str(coordinator["primary"].get("node", "?")))
    repl0 = st0.get("replication") or {}
    if st0.get("role") == "standby" and repl0.get("primary"):
        names.setdefault(repl0["primary"], "?")
    if st0.get("role") == "primary":  # a pair: its standbys announce where they serve clients
        for p in repl0.get("standbys") or []:
            if isinstance(p, dict) and type(p.get("address")) is str and p["address"]:
                names.setdefault(p["address"], _peer_node(p.get("name")))
        if type(repl0.get("paired_standby_address")) is str and repl0["paired_standby_address"]:
            names.setdefault(repl0["paired_standby_address"], _peer_node(repl0.get("paired_standby")))
    for address in list(names)[:MAX_NODES]:
        if address not in statuses:
            try:
                statuses[address] = ask(address)
            except Exception as exc:  # noqa: BLE001 - shown in the table
                statuses[address] = exc
    answered = {a: s for a, s in statuses.items() if isinstance(s, dict)}
    primaries = sorted((s for s in answered.values() if s.get("role") == "primary"
                        and not (s.get("replication") or {}).get("fenced")), key=lambda s: s.get("epoch", 0))
    primary = primaries[-1] if primaries else None
    repl = (primary or {}).get("replication") or {}
    peers = {_ident(p.get("name")): p for p in repl.get("standbys") or [] if isinstance(p, dict)}
    sync = repl.get("sync") or {}
    members = set(sync.get("members") or []) if "members" in sync else None

    def pair_in_sync(ident: str | None) -> bool | None:
        """A pair's in-sync flag of the standby ``ident`` as its sync primary says it (None: not a sync pair)."""
        if sync.get("mode") != "sync" or not ident:
            return None
        return sync.get("state") == "in_sync" and _ident(repl.get("paired_standby")) == ident

    rows, seen = [], set()
    for address, st in statuses.items():
        node = names.get(address, "?")
        if not isinstance(st, dict):
            rows.append(NodeRow(address, node, f"unreachable: {st}"[:60], None, None, None, None))
            continue
        node = _own_node(st, node)
        own = st.get("replication") or {}
        role = st.get("role", "?") + (" fenced" if own.get("fenced") and st.get("role") == "primary" else "")
        if st.get("role") == "primary":
            rows.append(NodeRow(address, node, role, st.get("epoch"), 0, 0, None))
            continue
        ident = own.get("ident")
        peer = peers.get(ident) if ident else None
        seen.add(ident)
        in_sync: bool | None
        if members is not None:
            in_sync = ident in members
        else:
            in_sync = pair_in_sync(ident) if primary is not None else None
            if in_sync is None:
                in_sync = (own.get("sync") or {}).get("in_sync")
        rows.append(NodeRow(address, node, role, st.get("epoch"),
                            peer["lag_records"] if peer else own.get("lag_records"),
                            peer["lag_ms"] if peer else None, in_sync))
    for ident, peer in peers.items():
        if ident not in seen:  # a standby the primary streams to, not reached by address
            rows.append(NodeRow(str(peer.get("address") or "?"), _peer_node(peer.get("name")), "standby", None,
                                peer.get("lag_records"), peer.get("lag_ms"),
                                (ident in members) if members is not None else pair_in_sync(ident)))
    return rows


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def format_table(rows: list[NodeRow]) -> str:
    """The rows as an ``etcdctl -w table`` style table (one header, one line per node)."""
    cells = [list(COLUMNS)] + [[_cell(v) for v in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(COLUMNS))]
    rule = "+" + "+".join("-" * (w + 2) for w in widths) + "+"
    lines = [rule]
    for i, r in enumerate(cells):
        lines.append("| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |")
        if i == 0:
            lines.append(rule)
    lines.append(rule)
    return "\n".join(lines)


def sharded_rows(shard_map: ShardMap, ask: Callable[[str], dict]) -> dict[str, list[NodeRow]]:
    """Each group's rows (:func:`group_rows`, learned from the first of the group's map
    addresses that answers), by group name; a group none of whose addresses answers has a
    row per address with its error as the role."""
    groups: dict[str, list[NodeRow]] = {}
    for group in shard_map.groups:
        down: list[NodeRow] = []
        for address in group.addresses[:MAX_NODES]:
            try:
                groups[group.name] = group_rows(address, ask)
                break
            except Exception as exc:  # noqa: BLE001 - shown in the table
                down.append(NodeRow(address, "?", f"unreachable: {exc}"[:60], None, None, None, None))
        else:
            groups[group.name] = down
    return groups


def group_status_command(args: argparse.Namespace, request: Callable[[tuple[str, int], int], Any]) -> int:
    """Print the table (``-o json``: a JSON list of rows; for a sharded deployment an object,
    ``{"epoch": the map's, "groups": {group name: its rows}}`` and a section per group);
    0 when every node answered, else 1.  ``request(server, op)`` sends one request to a node."""
    def ask(address: str) -> dict:
        return request(parse_address(address, default_port=None), OP_STATUS)

    first = format_address(args.server)
    st = ask(first)
    if isinstance(st.get("shard"), dict):
        reply = request(args.server, OP_SHARD_MAP)
        shard_map = ShardMap.from_wire(reply.get("map") if isinstance(reply, dict) else None)
        groups = sharded_rows(shard_map, lambda address: st if address == first else ask(address))
        if args.output == "json":
            print(json.dumps({"epoch": shard_map.epoch,
                              "groups": {g: [row._asdict() for row in rows] for g, rows in groups.items()}}, indent=2))
        else:
            print("\n\n".join(f"shard group {g} (map epoch {shard_map.epoch}, {shard_map.slot_count(g)} slots)\n"
                                f"{format_table(rows)}" for g, rows in groups.items()))
        rows = [row for group_rows_ in groups.values() for row in group_rows_]
    else:
        rows = group_rows(first, lambda address: st if address == first else ask(address))
        if args.output == "json":
            print(json.dumps([row._asdict() for row in rows], indent=2))
        else:
            print(format_table(rows))
    return 0 if all(not row.role.startswith("unreachable") for row in rows) else 1
