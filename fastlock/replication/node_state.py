"""What a node remembers about the cluster beyond its WAL: small JSON files in the data directory.

``node-state.json`` (:class:`NodeState`: highest epoch seen, longest TTL, the
primary it follows, a pending promotion grace), ``pairing.json`` (the one
standby a primary is paired with: :func:`read_pairing`, :func:`write_pairing`,
:func:`remove_pairing`), ``deposed.json`` (a primary that stepped down:
:func:`write_deposed`, :func:`read_deposed`) and ``node-id`` (the node's
permanent identity: :func:`node_id`).  Every file is written atomically and
fsynced (:func:`fastlock.wal.write_atomically`); a file this module cannot
read as what it writes raises :class:`~fastlock.errors.NodeFileDamaged`.
"""

from __future__ import annotations

import json
import os
from typing import Any, NamedTuple

from ..errors import NodeFileDamaged
from ..wal import DIR_MODE, fsync_dir, write_atomically

PAIRING_FILE = "pairing.json"
NODE_ID_FILE = "node-id"


DEPOSED_FILE = "deposed.json"
STATE_FILE = "node-state.json"


def load_json(directory: str, name: str, fields: dict[str, tuple[type, ...]]) -> dict | None:
    """The JSON object in ``<directory>/<name>``, or None if the file does not exist.

    ``fields`` maps each key to the types its value may have (a missing key is
    fine: it has its default).

    Raises:
        NodeFileDamaged: unreadable JSON, not an object, or a field of another type.
    """
    path = os.path.join(directory, name)
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        return None
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise NodeFileDamaged(f"{path} is damaged ({exc}): restore it or repair it by hand") from None
    if type(data) is not dict:
        raise NodeFileDamaged(f"{path} is damaged (not a JSON object): restore it or repair it by hand")
    for key, types in fields.items():
        if key in data and type(data[key]) not in types:
            raise NodeFileDamaged(f"{path} is damaged ({key!r} is {type(data[key]).__name__}, not "
                                  f"{' or '.join(t.__name__ for t in types)}): restore it or repair it by hand")
    return data


class NodeState:
    """What a node must remember about the cluster beyond its WAL, in
    ``<data dir>/node-state.json`` (written atomically and fsynced, only when a
    value changes - rarely):

    ``max_epoch_seen``
        the highest epoch this node has heard of (its primary's, a deposing
        HELLO's): a promotion starts above it, so a node whose WAL never
        received a newer primary's epoch still never reuses it;
    ``max_ttl_ms``
        the longest lease TTL granted in the cluster as far as this node knows:
        the default promotion grace, which must survive a restart;
    ``standby_of``
        set while the node is a standby: started without ``--standby-of`` it
        would otherwise come up as a second primary at the old epoch, so it
        refuses until it is promoted (or the file is deleted);
    ``grace_ms``
        the promotion grace (ms) of a primary whose grace has not yet run out:
        a restart during it cannot know how long it was down, so it holds new
        grants for the whole grace again (as recovered leases get a fresh full
        TTL); 0 once the grace has ended.
    """

    def __init__(self, directory: str):
        """Raises NodeFileDamaged: the file exists but is not what this class writes."""
        self.directory = directory
        self._data = load_json(directory, STATE_FILE, {
            "max_epoch_seen": (int,), "max_ttl_ms": (int,), "grace_ms": (int,), "standby_of": (str, type(None)),
            "group": (str, type(None)),
        }) or {}

    @property
    def max_epoch_seen(self) -> int:
        return int(self._data.get("max_epoch_seen", 0))

    @property
    def max_ttl_ms(self) -> int:
        return int(self._data.get("max_ttl_ms", 0))

    @property
    def standby_of(self) -> str | None:
        return self._data.get("standby_of")

    @property
    def grace_ms(self) -> int:
        return int(self._data.get("grace_ms", 0))

    def promoted(self, grace_ms: int) -> None:
        """Record a promotion: no longer a standby, ``grace_ms`` of grace pending."""
        self._set(standby_of=None, grace_ms=grace_ms)

    def grace_ended(self) -> None:
        if self.grace_ms:
            self._set(grace_ms=0)

    def raise_epoch(self, epoch: int) -> None:
        if epoch > self.max_epoch_seen:
            self._set(max_epoch_seen=epoch)

    def raise_ttl(self, ttl_ms: int) -> None:
        # Stored rounded up to whole seconds: a client stepping its TTL up by 1 ms at a
        # time then costs at most one fsynced write per second of TTL, not one per
        # acquire; the grace it feeds may only be up to 1 s longer (the safe side).
        if ttl_ms > self.max_ttl_ms:
            self._set(max_ttl_ms=-(-ttl_ms // 1000) * 1000)

    @property
    def group(self) -> str | None:
        """The etcd key prefix of the group this data directory belongs to (None: none)."""
        return self._data.get("group")

    def set_group(self, prefix: str) -> None:
        if prefix != self.group:
            self._set(group=prefix)

    def set_standby_of(self, address: str | None) -> None:
        if address != self.standby_of:
            self._set(standby_of=address)

    def _set(self, **changes: Any) -> None:
        data = dict(self._data, **changes)
        os.makedirs(self.directory, mode=DIR_MODE, exist_ok=True)
        write_atomically(self.directory, STATE_FILE, json.dumps(data, sort_keys=True).encode())
        self._data = data


def write_deposed(directory: str, epoch: int, why: str) -> None:
    """Remember (durably) that this node stepped down for ``epoch``."""
    write_atomically(directory, DEPOSED_FILE, json.dumps({"epoch": epoch, "why": why}).encode())


def read_deposed(directory: str) -> dict | None:
    """Raises NodeFileDamaged: the file exists but is not what :func:`write_deposed` writes."""
    return load_json(directory, DEPOSED_FILE, {"epoch": (int,), "why": (str,)})


def node_id(directory: str) -> str:
    """This node's permanent identity, kept in ``<data dir>/node-id`` (made on first use).

    A primary pairs with exactly one standby and knows it by this id.
    """
    path = os.path.join(directory, NODE_ID_FILE)
    try:
        with open(path, encoding="ascii") as f:
            value = f.read().strip()
        if value:
            return value
    except FileNotFoundError:
        pass
    os.makedirs(directory, mode=DIR_MODE, exist_ok=True)
    value = os.urandom(8).hex()
    write_atomically(directory, NODE_ID_FILE, value.encode() + b"\n")
    return value


class Pairing(NamedTuple):
    """The standby a primary is paired with (``pairing.json``)."""

    standby: str  # "[label@]principal/node-id"
    failover_after_ms: int  # its failover window (0: it never promotes by itself)
    #: ``host:port`` where it serves clients, as it announced it (None: not announced): where this
    #: node looks for the new primary when it finds itself fenced (see fastlock.server.failover)
    address: str | None = None
    #: the witness it asks before it promotes (``host:port`` as it names it; None: none)
    witness: str | None = None


def read_pairing(directory: str) -> Pairing | None:
    """The pairing in ``<directory>/pairing.json``, or None if there is none.

    Raises:
        NodeFileDamaged: the file is not what :func:`write_pairing` writes.
    """
    data = load_json(directory, PAIRING_FILE, {"standby": (str,), "failover_after_ms": (int,),
                                                "address": (str, type(None)), "witness": (str, type(None))})
    if data is None:
        return None
    if "standby" not in data or "failover_after_ms" not in data:
        raise NodeFileDamaged(f"{os.path.join(directory, PAIRING_FILE)} is damaged (it must name "
                              f"'standby' and 'failover_after_ms'): restore it or repair it by hand")
    return Pairing(data["standby"], int(data["failover_after_ms"]), data.get("address"), data.get("witness"))


def write_pairing(directory: str, pairing: Pairing) -> None:
    """Persist the pairing (atomically, fsynced)."""
    write_atomically(directory, PAIRING_FILE, json.dumps(pairing._asdict()).encode())


def remove_pairing(directory: str) -> None:
    """Forget the pairing (durably); nothing to do if there is none."""
    try:
        os.unlink(os.path.join(directory, PAIRING_FILE))
        fsync_dir(directory)
    except FileNotFoundError:
        pass
