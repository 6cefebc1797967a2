"""Lone shard servers for tests and benches: :class:`ShardSet`.

``ShardSet.start(directory, n)`` picks ``n`` free loopback ports, writes a static shard
map (:mod:`fastlock.sharding`: groups ``g0..g{n-1}``, the slots split evenly, epoch 1 unless
given) to ``directory/shard-map.json`` and starts one ``fastlock serve`` per group with
``--shard-map`` and ``--shard-group``; :meth:`ShardSet.stop` stops them by PID.
:func:`names_owned_by` finds names whose slots a group owns.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from fastlock._testbase.proxy import free_port
from fastlock._testbase.servers import ServerProcess
from fastlock.sharding import ShardGroup, ShardMap, even_ranges, write_map_file


def names_owned_by(shard_map: ShardMap, group: str, count: int, prefix: str = "n") -> list[str]:
    """``count`` names ``{prefix}{i}`` (i = 0, 1, ...) whose slots ``group`` owns (at most 1,000,000 tried)."""
    found: list[str] = []
    for i in range(1_000_000):
        if len(found) == count:
            break
        name = f"{prefix}{i}"
        if shard_map.owner(name).name == group:
            found.append(name)
    if len(found) < count:
        raise ValueError(f"group {group} owns too few slots to find {count} names")
    return found


@dataclass
class ShardSet:
    """Lone shard servers (one per group, no standbys) and the map they serve by."""

    shard_map: ShardMap
    map_path: Path
    servers: dict[str, ServerProcess]

    @classmethod
    def start(cls, directory: str | os.PathLike[str], n: int, *, epoch: int = 1, fsync: str = "never",
              args: Sequence[str] = ()) -> ShardSet:
        """Start ``n`` shard servers under ``directory`` (each in ``directory/g{k}``)."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        ports = [free_port() for _ in range(n)]
        groups = tuple(ShardGroup(f"g{k}", (f"127.0.0.1:{ports[k]}",)) for k in range(n))
        shard_map = ShardMap(epoch, groups, even_ranges([g.name for g in groups]))
        map_path = directory / "shard-map.json"
        write_map_file(map_path, shard_map)
        shards = cls(shard_map, map_path, {})
        try:
            for k, group in enumerate(groups):
                server = ServerProcess(directory / group.name, fsync=fsync, port=ports[k],
                                       args=["--shard-map", str(map_path), "--shard-group", group.name, *args])
                shards.servers[group.name] = server
                server.start()
        except BaseException:
            shards.stop()
            raise
        return shards

    def address(self, group: str) -> str:
        """The address of group ``group``'s server."""
        return self.servers[group].address

    def stop(self) -> None:
        """Stop every server (by PID)."""
        for server in self.servers.values():
            if server.proc is not None:
                server.stop()

    def __enter__(self) -> ShardSet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
