"""Who is the primary, decided by an external consensus store instead of by the pair itself.

:mod:`fastlock.coordination.etcd` holds the etcd arbiter (``fastlock serve
--coordinator etcd://HOST:PORT[,HOST:PORT]/PREFIX``): the primary role is a
key held under an etcd lease, the epoch is a counter in etcd, and the most
caught-up standby takes the key when it is free; :mod:`fastlock.coordination.gateway`
holds its etcd client and the URL parser, :mod:`fastlock.coordination.access`
the TLS files and etcd user it reaches etcd with, and :mod:`fastlock.coordination.records`
what it reads there and how far it believes it.  It needs the optional
extra ``fastlock[etcd]`` (httpx, for etcd's v3 JSON gateway).
"""

from .access import EtcdAccess
from .etcd import EtcdArbiter, NodeIdInUse
from .gateway import CoordinatorUrl, EtcdGateway, EtcdRefused, EtcdUnavailable, parse_coordinator
from .records import EPOCH_ALLOWANCE, PrimaryRecord

__all__ = ["EPOCH_ALLOWANCE", "CoordinatorUrl", "EtcdAccess", "EtcdArbiter", "EtcdGateway", "EtcdRefused",
           "EtcdUnavailable", "NodeIdInUse", "PrimaryRecord", "parse_coordinator"]
