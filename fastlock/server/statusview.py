"""What STATUS tells each kind of principal.

:meth:`~fastlock.server.lockserver.LockServer.status` is the operator's view; a
client principal (an application, ``anonymous``) gets :func:`client_status` of
it: no path on the server, no free-text error, nothing that names other
principals, their sessions, the standby or the etcd coordinator.
"""

from __future__ import annotations

import os
from typing import Any

#: what a client principal sees of a node's replication: whether it may grant, and on a standby
#: whether it follows its primary (whose address HELLO already gives, to redirect) and how far
#: behind it is (log positions, as the top-level WAL counters) - not who the standby is, its
#: pairing, its failover window or its refusals
CLIENT_REPLICATION_FIELDS = frozenset({"fenced", "serving_alone", "primary", "connected", "synced", "applied_lsn",
                                       "primary_last_lsn", "lag_records"})
#: the sections of STATUS a client sees, each without the fields named here (and without any
#: nested section): a task's last error is free text that may quote paths and addresses; the
#: unread replies of all clients together tell of other principals' traffic
CLIENT_SECTIONS = {"wal": frozenset(), "tasks": frozenset({"last_error"}), "limits": frozenset({"unread_output_bytes"}),
                   "tls": frozenset(), "watch_history": frozenset(), "client_sessions": frozenset(),
                   "key_watch_history": frozenset(), "shard": frozenset()}  # shard: the group, map epoch, slots


def is_plain(value: Any) -> bool:
    """True for None, int, float, str and bool: a value that names no nested structure."""
    return value is None or type(value) in (int, float, str, bool)


def client_status(status: dict) -> dict:
    """What a client principal (an application or ``anonymous``) sees of :meth:`LockServer.status`.

    Admins and replicas see all of it.  A client sees the top-level counters and settings (role,
    epoch, version, fsync, table counters) and the sections of :data:`CLIENT_SECTIONS` with their
    plain values only: no path on the server (the WAL's active segment is given by its file name
alone, without the data directory),
    no free-text error, no list or map that could name other principals, their sessions or their
    standbys, nothing of the etcd coordinator (its URL, prefix and node ids), and of replication
    only :data:`CLIENT_REPLICATION_FIELDS` (not who the standby is, its pairing or its failover
    window).  A section added to STATUS later stays hidden from clients until it is listed here.
    Returns a new dict; ``status`` is not changed.
    """
    view = {key: value for key, value in status.items() if is_plain(value)}
    for section, hidden in CLIENT_SECTIONS.items():
        fields = status.get(section)
        if isinstance(fields, dict):
            view[section] = {key: value for key, value in fields.items() if key not in hidden and is_plain(value)}
    if isinstance(view.get("wal", {}).get("active_segment"), str):
        view["wal"]["active_segment"] = os.path.basename(view["wal"]["active_segment"])  # its name, not its path
    replication = status.get("replication")
    if isinstance(replication, dict):
        view["replication"] = {key: value for key, value in replication.items()
                               if key in CLIENT_REPLICATION_FIELDS and is_plain(value)}
    return view
