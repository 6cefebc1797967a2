"""Who is the primary, decided by an external consensus store instead of by the pair itself.

:mod:`fastlock.coordination.etcd` holds the etcd arbiter (``fastlock serve
--coordinator etcd://HOST:PORT[,HOST:PORT]/PREFIX``): the primary role is a
key held under an etcd lease, the epoch is a counter in etcd, and the most
caught-up standby takes the key when it is free; :mod:`fastlock.coordination.gateway`
holds its etcd client and the URL parser.  It needs the optional
extra ``fastlock[etcd]`` (httpx, for etcd's v3 JSON gateway).
"""

from .etcd import EtcdArbiter, NodeIdInUse, PrimaryRecord
from .gateway import CoordinatorUrl, EtcdGateway, EtcdUnavailable, parse_coordinator

__all__ = ["CoordinatorUrl", "EtcdArbiter", "EtcdGateway", "EtcdUnavailable", "NodeIdInUse", "PrimaryRecord",
           "parse_coordinator"]
