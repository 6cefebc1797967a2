"""What the etcd arbiter reads from etcd, and how far it believes it.

Anyone who can write under the group's prefix in etcd can write anything there, so
every value is read as untrusted:

* :class:`PrimaryRecord` decodes ``PREFIX/primary`` and never raises (a value no
  fastlock node wrote names node ``"?"`` at no address, followed by nobody);
* :func:`read_epoch` reads ``PREFIX/epoch`` and says whether it is *credible*: a
  decimal integer of at most :data:`~fastlock.protocol.MAX_EPOCH` and at most
  :data:`EPOCH_ALLOWANCE` above the highest epoch this node has seen.  Anything
  else (a jump beyond that, a negative number, text, a huge string) is refused: a
  bid acts as if the key held no epoch, derives the next epoch from what the node
  has seen, and rewrites the key in its transaction; a primary rewrites it to its
  own epoch without stepping down (stepping down would free the key and, with the
  primary's lease, its member key: the last traces of its epoch in etcd, which a
  standby that has not synced yet needs).  A credible epoch above a primary's own
  (a node that saw a newer history raised it) makes the primary step down.  A
  legitimate epoch is above what a node has seen only by the elections it missed;
  a refused one never costs the group its ability to elect.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Protocol

from ..protocol import MAX_EPOCH
from .gateway import KeyValue

__all__ = ["EPOCH_ALLOWANCE", "MAX_SYNC_MEMBERS", "MAX_VALUE_BYTES", "ArbiterListener", "EpochReading",
           "MemberKey", "PrimaryRecord", "SyncRecord", "credible_epoch", "json_object", "read_epoch"]

#: the longest value the arbiter accepts from etcd for one of its keys (bytes)
MAX_VALUE_BYTES = 4096
#: how far (in epochs) ``PREFIX/epoch`` may be above the highest epoch a node has seen and
#: still be believed: the elections a node may have missed while it was down or behind
EPOCH_ALLOWANCE = 16
#: the most standbys a ``PREFIX/sync`` record may name (a longer list names none)
MAX_SYNC_MEMBERS = 64


@dataclass(frozen=True)
class PrimaryRecord:
    """The primary as ``PREFIX/primary`` names it."""

    node: str
    address: str
    epoch: int
    lease: int

    @classmethod
    def decode(cls, kv: KeyValue) -> PrimaryRecord:
        """Never raises: a value this module did not write names an unknown node."""
        data = json_object(kv.value)
        node, address, epoch = data.get("node"), data.get("address"), data.get("epoch")
        return cls(node if type(node) is str else "?", address if type(address) is str else "",
                   epoch if type(epoch) is int and 0 <= epoch <= MAX_EPOCH else 0, kv.lease)


@dataclass
class MemberKey:
    """This node's member key: the data directory identity kept in it, the value last
    written under the current lease, and since when (own clock, ms) another live node
    holds it (None: it does not)."""

    ident: str
    written: bytes = b""
    taken_since: int | None = None


@dataclass(frozen=True)
class SyncRecord:
    """The in-sync set as ``PREFIX/sync`` names it (as Patroni's ``/sync`` key).

    Attributes:
        node: the primary that wrote it (its etcd node id).
        epoch: that primary's epoch.
        members: the identities (``replica principal/node id``) of the standbys that
            have every grant and extend that primary acknowledged.
        mod_revision: the key's etcd revision (0: absent); a bid compares it.
    """

    node: str
    epoch: int
    members: frozenset[str]
    mod_revision: int = 0

    @classmethod
    def decode(cls, kv: KeyValue | None) -> SyncRecord:
        """Never raises: an absent key, or a value this module did not write, names no member
        (so no standby skips its promotion grace because of it)."""
        if kv is None:
            return cls("", 0, frozenset())
        data = json_object(kv.value)
        node, epoch, members = data.get("node"), data.get("epoch"), data.get("members")
        if (type(node) is not str or type(epoch) is not int or not 0 < epoch <= MAX_EPOCH
                or type(members) is not list or len(members) > MAX_SYNC_MEMBERS
                or not all(type(m) is str and 0 < len(m) <= 128 for m in members)):
            return cls("?", 0, frozenset(), kv.mod_revision)
        return cls(node, epoch, frozenset(members), kv.mod_revision)

    def encode(self) -> bytes:
        """The JSON value a primary writes (members sorted)."""
        return json.dumps({"node": self.node, "epoch": self.epoch, "members": sorted(self.members)}).encode()


def json_object(value: bytes) -> dict:
    """``value`` as a JSON object; ``{}`` when it is longer than :data:`MAX_VALUE_BYTES`, not JSON,
    or not an object."""
    if len(value) > MAX_VALUE_BYTES:
        return {}
    try:
        data = json.loads(value)
    except ValueError:
        return {}
    return data if type(data) is dict else {}


class ArbiterListener(Protocol):
    """The node as the arbiter sees it: what it asks, and what it tells when its view
    changes (each called on the event loop)."""

    def position(self) -> int:
        """This node's WAL position (its applied or last LSN)."""

    def min_epoch(self) -> int:
        """The highest epoch this node has seen (a new epoch is above it)."""

    def candidate(self) -> bool:
        """May this node bid for the primary key now (a standby)?"""

    def on_elected(self, epoch: int) -> None:
        """This node took the primary key at ``epoch``."""

    def on_fenced(self, fenced: bool) -> None:
        """This primary's lease is past its self-fencing deadline (True), or renewed again (False)."""

    def on_lost(self, why: str) -> None:
        """This node held the primary key and no longer does: step down at once."""

    def on_primary(self, primary: PrimaryRecord | None) -> None:
        """Another node (or none) is the primary now."""

    def on_refused(self, why: str) -> None:
        """Another live node holds this node's id: stop (the arbiter has stopped)."""


@dataclass(frozen=True)
class EpochReading:
    """``PREFIX/epoch`` as read.

    Attributes:
        kv: the key (None: absent); its ``mod_revision`` guards the rewrite.
        stored: the epoch it holds when credible, else 0.
        refused: the value was there but not credible (see :func:`read_epoch`): a bid
            rewrites it, and so does a primary.
    """

    kv: KeyValue | None
    stored: int
    refused: bool


def credible_epoch(epoch: int, seen: int) -> bool:
    """Is ``epoch``, named by etcd, one a node that has seen ``seen`` may believe: in
    ``0..min(MAX_EPOCH, seen + EPOCH_ALLOWANCE)``?"""
    return 0 <= epoch <= min(MAX_EPOCH, seen + EPOCH_ALLOWANCE)


def read_epoch(kv: KeyValue | None, seen: int) -> EpochReading:
    """Judge ``PREFIX/epoch`` (``kv``) against ``seen``, the highest epoch this node has seen:
    credible when it is ASCII decimal digits (no sign) for a :func:`credible_epoch`.
    Never raises."""
    if kv is None:
        return EpochReading(None, 0, False)
    value = kv.value
    if 0 < len(value) <= len(str(MAX_EPOCH)) and value.isascii() and value.isdigit():
        stored = int(value)
        if credible_epoch(stored, seen):
            return EpochReading(kv, stored, False)
    return EpochReading(kv, 0, True)
