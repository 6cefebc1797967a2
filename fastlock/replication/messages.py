"""The replication stream's payloads as typed values, shared by both ends.

The primary pushes (see :mod:`fastlock.replication` for the whole exchange)::

    [0, "snap", [lsn, epoch, counter, holders, incarnation]]     a snapshot
    [0, "repl", [first_lsn, last_lsn, frames]]                   WAL batch bytes
    [0, "rec",  [lsn, record]]                                   one record (older primaries)
    [0, "hb",   [primary_ms, last_lsn, epoch, longest_ttl_ms, paired_id, paired_window_ms]]

A snapshot holder is :class:`SnapshotHolder`'s 9 fields in order (an older
primary sends the first 8); owner keys travel only as their hashes.  Times
are milliseconds.  Also here: the heartbeat rate and a standby's identity,
which both ends must compute alike.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import msgpack

from .. import protocol as P
from ..errors import FastlockError, InvalidArgument, ProtocolError
from ..units import format_address, parse_address
from ..wal import Grant


def heartbeat_interval_ms(failover_after_ms: int) -> int:
    """Heartbeats 8 per failover window, between 10 ms and 500 ms."""
    if failover_after_ms <= 0:
        return 500
    return max(10, min(500, failover_after_ms // 8))


#: the longest ``host:port`` a standby may announce (a DNS name plus a port)
MAX_ADDRESS_CHARS = 262
_WILDCARD_HOSTS = ("", "0.0.0.0", "::")


def standby_address(announced: Any, peer_ip: str) -> str | None:
    """Where a standby serves clients, from the address it announced in REPLICATE
    (``host:port``; a wildcard host - it listens on every interface - is replaced by
    ``peer_ip``, the address its connection came from); None when it announced none.

    Raises:
        InvalidArgument: not a string of at most :data:`MAX_ADDRESS_CHARS` that parses
            as ``host:port`` with a port in 1..65535 (nothing changes).
    """
    if announced is None:
        return None
    if type(announced) is not str or len(announced) > MAX_ADDRESS_CHARS:
        raise InvalidArgument(f"a standby's address must be a host:port string of at most {MAX_ADDRESS_CHARS} "
                              f"characters")
    try:
        host, port = parse_address(announced, default_port=None)
    except FastlockError as exc:
        raise InvalidArgument(f"a standby's address: {exc}") from None
    if host in _WILDCARD_HOSTS:
        host = peer_ip
    return format_address((host, port))


def standby_identity(name: str) -> str:
    """A standby names itself ``[display@]node-id``; only the node id identifies it."""
    return name.rpartition("@")[2]


class SnapshotHolder(NamedTuple):
    """One lease of a snapshot push.  ``remaining_ms``: its deadline minus the
    primary's monotonic time when the snapshot was taken (0..``ttl_ms``)."""

    name: str
    token: int
    owner_hash: bytes
    ttl_ms: int
    lock_delay_ms: int
    client: str | None
    correlation_id: str | None
    wall_ms: int  # always 0 on the wire (kept for the layout shared with WAL holders)
    remaining_ms: int
    shared: bool = False  # a shared lease (on the wire only when set: 11 items)
    limit: int = 0  # a semaphore permit's limit (on the wire only when set: 11 items)

    @classmethod
    def decode(cls, h: Any) -> SnapshotHolder:
        """A holder as received; one without ``remaining_ms`` (8 items, an older
        primary) has its full ``ttl_ms`` left; one without ``shared`` and ``limit``
        (8 or 9 items) is an exclusive lease.

        Raises:
            ProtocolError: not a list of 8, 9 or 11 items, ``remaining_ms`` not an int
                in ``0..ttl_ms``, ``shared`` not a bool or ``limit`` not a valid limit.
            WrongArgumentType, InvalidArgument: ``ttl_ms`` not a valid TTL.
        """
        if type(h) is not list or len(h) not in (8, 9, 11):
            raise ProtocolError("snapshot holder must be a list of 8, 9 or 11 items")
        ttl_ms = P.check_recorded_ttl_ms(h[3])
        remaining_ms = h[8] if len(h) >= 9 else ttl_ms
        if type(remaining_ms) is not int or not 0 <= remaining_ms <= ttl_ms:
            raise ProtocolError(f"snapshot holder remaining_ms must be an int in 0..{ttl_ms}, not {remaining_ms!r}")
        shared, limit = (h[9], h[10]) if len(h) == 11 else (False, 0)
        if type(shared) is not bool or type(limit) is not int or not 0 <= limit <= P.MAX_LIMIT or (shared and limit):
            raise ProtocolError(f"snapshot holder shared/limit must be a bool and an int in 0..{P.MAX_LIMIT}, "
                                f"not both set")
        return cls(h[0], h[1], h[2], ttl_ms, h[4], h[5], h[6], 0, remaining_ms, shared, limit)

    def grant(self) -> Grant:
        """The lease as the GRANT record that installs it."""
        return Grant(self.name, self.token, self.owner_hash, self.ttl_ms, self.lock_delay_ms, self.client,
                     self.correlation_id, 0, self.shared, self.limit)


def encode_snapshot(lsn: int, epoch: int, counter: int, holders: Sequence[Any], incarnation: str, now: int,
                    keys: list | None = None) -> bytes:
    """The snapshot push ``[0, "snap", [lsn, epoch, counter, holders, incarnation(, keys)]]``
    (``keys``: :meth:`fastlock.wal.keyspace.KeySpace.to_list`, sent only when there are some),
    encoded a holder at a time (so that, on a worker thread, it lets the event
    loop run between holders); ``holders``: :class:`~fastlock._core.Holder`,
    whose ``meta`` is a :class:`~fastlock.wal.LeaseMeta` (or None); ``now``: the
    primary's monotonic ms when the snapshot was taken.
    """
    packer = msgpack.Packer(use_bin_type=True)
    pack = packer.pack
    parts = [packer.pack_array_header(3), pack(0), pack(P.PUSH_SNAPSHOT), packer.pack_array_header(6 if keys else 5),
             pack(lsn), pack(epoch), pack(counter), packer.pack_array_header(len(holders))]
    append = parts.append
    for h in holders:
        client, corr = h.meta if h.meta else (None, None)
        item = [h.name, h.token, h.owner, h.ttl_ms, h.lock_delay_ms, client, corr, 0,
                min(h.ttl_ms, max(0, h.deadline_ms - now))]
        if h.shared or h.limit:
            item += (h.shared, h.limit)
        append(pack(item))
    append(pack(incarnation))
    if keys:
        append(pack(keys))
    return b"".join(parts)


class Heartbeat(NamedTuple):
    """A primary's heartbeat (ms on the primary's monotonic clock)."""

    primary_ms: int
    last_lsn: int
    epoch: int
    max_ttl_ms: int  # the longest TTL the primary has granted
    paired_id: str | None  # the standby it is paired with
    paired_window_ms: int  # that standby's failover window

    @classmethod
    def decode(cls, payload: Any) -> Heartbeat:
        """:raises ProtocolError: not a list of 6 items."""
        if type(payload) is not list or len(payload) != 6:
            raise ProtocolError("a heartbeat is a list of 6 items")
        return cls(*payload)
