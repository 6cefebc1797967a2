"""``fastlock status --all``: every node of the pair or group in one table.

As ``etcdctl endpoint status --cluster -w table`` lists every member of an etcd
cluster from one endpoint, this asks the node named by ``--server`` for its
status and learns the other nodes from it:

* in an etcd group, from the member keys the node read in etcd (``coordinator.members``:
  node id and address of each live node) and the primary etcd names; the CLI never
  talks to etcd itself;
* in a pair, from the standby's primary address (``replication.primary``), or, asked
  at the primary, from its replication peers (a standby's address is not known to the
  primary: its row shows ``?``).

Then it asks each node for its status (one request each, at most :data:`MAX_NODES`) and
prints one row per node: address, node id, role, epoch, lag (records and milliseconds,
as the primary measures them for its standbys) and the in-sync flag (in a group with
``--replication sync``: a member of ``PREFIX/sync``; in a sync pair: the standby's
primary says it is in sync).  A node that does not answer shows its error as its role.
Addresses read from etcd are untrusted: the admin token is proved to them, never sent.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import Any, NamedTuple

from ..units import format_address, parse_address

__all__ = ["MAX_NODES", "NodeRow", "format_table", "group_rows"]

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
    if st0.get("role") == "standby" and (st0.get("replication") or {}).get("primary"):
        names.setdefault(st0["replication"]["primary"], "?")
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
    rows, seen = [], set()
    for address, st in statuses.items():
        node = names.get(address, "?")
        if not isinstance(st, dict):
            rows.append(NodeRow(address, node, f"unreachable: {st}"[:60], None, None, None, None))
            continue
        node = str((st.get("coordinator") or {}).get("node") or st.get("name") or node)
        own = st.get("replication") or {}
        role = st.get("role", "?") + (" fenced" if own.get("fenced") and st.get("role") == "primary" else "")
        if st.get("role") == "primary":
            rows.append(NodeRow(address, node, role, st.get("epoch"), 0, 0, None))
            continue
        ident = own.get("ident")
        peer = peers.get(ident) if ident else None
        seen.add(ident)
        in_sync = (ident in members) if members is not None else (own.get("sync") or {}).get("in_sync")
        rows.append(NodeRow(address, node, role, st.get("epoch"),
                            peer["lag_records"] if peer else own.get("lag_records"),
                            peer["lag_ms"] if peer else None, in_sync))
    for ident, peer in peers.items():
        if ident not in seen:  # a standby the primary streams to, not reached by address
            rows.append(NodeRow("?", ident, "standby", None, peer.get("lag_records"), peer.get("lag_ms"),
                                (ident in members) if members is not None else None))
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


def group_status_command(args: argparse.Namespace, ask: Callable[[tuple[str, int]], dict]) -> int:
    """Print the table (``-o json``: a JSON list of rows); 0 when every node answered, else 1."""
    rows = group_rows(format_address(args.server),
                      lambda address: ask(parse_address(address, default_port=None)))
    if args.output == "json":
        print(json.dumps([row._asdict() for row in rows], indent=2))
    else:
        print(format_table(rows))
    return 0 if all(not row.role.startswith("unreachable") for row in rows) else 1
