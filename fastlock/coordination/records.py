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

__all__ = ["EPOCH_ALLOWANCE", "MAX_VALUE_BYTES", "ArbiterListener", "EpochReading", "PrimaryRecord",
           "credible_epoch", "json_object", "read_epoch"]

#: the longest value the arbiter accepts from etcd for one of its keys (bytes)
MAX_VALUE_BYTES = 4096
#: how far (in epochs) ``PREFIX/epoch`` may be above the highest epoch a node has seen and
#: still be believed: the elections a node may have missed while it was down or behind
EPOCH_ALLOWANCE = 16


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
