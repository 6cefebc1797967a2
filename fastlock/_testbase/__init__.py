"""Test support shipped with the package, for fastlock's own tests and benches and for yours.

Five parts, each a module that can be read alone:

:mod:`fastlock._testbase.servers`
    :class:`ServerProcess`: a real ``fastlock serve`` subprocess on 127.0.0.1
    (free or fixed port, its log lines, kill/pause/resume/stop by PID), and
    :func:`node_status` (one node's status, no redirect), :func:`power_cut`
    (what an OS crash leaves of the WAL's active segment), and
    :class:`CredentialsDir` (principals and their tokens, for servers that
    need a standby or operator commands).
:mod:`fastlock._testbase.history`
    :class:`HistoryChecker` (holdings recorded in one process) and the
    after-the-run checkers :func:`check_store` (a fenced store's accepted
    writes), :func:`check_grants` (tokens never reused, never backwards) and
    :func:`check_holdings` (two clients that believed they held one lock).
:mod:`fastlock._testbase.proxy`
    :class:`TcpProxy`: a fault-injecting TCP proxy that can black-hole, cut
    and heal a link, per connection label (:func:`classify_fastlock` tells a
    standby's replication connection from a client's).  A server reached through
    it must be told so (``--reachable-as``: the handshake binds the endpoint a
    client dialed); :func:`free_port` picks the proxy's port before the server starts.
:mod:`fastlock._testbase.handshake`
    :func:`raw_hello` / :func:`raw_hello_async`: the HELLO handshake (the token
    proved, never sent) for a test that speaks the protocol on a raw socket.
:mod:`fastlock._testbase.cluster`
    :class:`Cluster` (primaries, standbys and proxies for one test, stopped
    together), :class:`RawNode` (a protocol connection to exactly one node, no
    redirects) and the bounded waits :func:`run`, :func:`poll`, :func:`status_of`.

Example: a primary, and a standby whose replication link can be cut::

    port = free_port()
    primary = ServerProcess(tmp / "a", args=["--reachable-as", f"127.0.0.1:{port}"]).start()
    with TcpProxy(primary.address, classify=classify_fastlock, port=port) as link:
        standby = ServerProcess(tmp / "b", args=["--standby-of", link.address,
                                                 "--failover-after", "1"]).start()
        link.blackhole("replication")   # the standby promotes after 1 s
        ...
        link.heal()

``benches/nemesis/`` drives them against a primary and a standby
under a cycle of crashes, pauses, partitions and manual promotions.
"""

from fastlock._testbase.cluster import Cluster, RawNode, poll, run, status_of
from fastlock._testbase.handshake import handshake_for, raw_hello, raw_hello_async
from fastlock._testbase.history import (
    GrantRecord,
    HistoryChecker,
    Holding,
    StoreWrite,
    check_grants,
    check_holdings,
    check_store,
)
from fastlock._testbase.proxy import TcpProxy, classify_fastlock, free_port
from fastlock._testbase.servers import CredentialsDir, ServerProcess, node_status, power_cut

__all__ = [
    "Cluster",
    "CredentialsDir",
    "GrantRecord",
    "HistoryChecker",
    "Holding",
    "RawNode",
    "ServerProcess",
    "StoreWrite",
    "TcpProxy",
    "check_grants",
    "check_holdings",
    "check_store",
    "classify_fastlock",
    "free_port",
    "handshake_for",
    "node_status",
    "poll",
    "power_cut",
    "raw_hello",
    "raw_hello_async",
    "run",
    "status_of",
]
