"""Sharding: the lock namespace split over several groups (docs/sharding.md).

:mod:`.slots` hashes a name to one of 16384 slots (Redis Cluster's rule, hash tags
included); :mod:`.shardmap` says which group owns which slot range; :mod:`.scope`
says where each protocol op carries its names, and the server checks them against
the map (:mod:`fastlock.server.sharded`); :mod:`.router` routes a client's calls to
the owning group's primary.
"""

from .shardmap import ShardGroup, ShardMap, ShardMapError, SlotRange, even_ranges, load_map_file, write_map_file
from .slots import SLOTS, hash_tag, slot_of

__all__ = ["SLOTS", "slot_of", "hash_tag", "ShardMap", "ShardGroup", "SlotRange", "ShardMapError",
           "even_ranges", "load_map_file", "write_map_file"]
