"""Prometheus metrics (``fastlock serve --metrics HOST:PORT``), through prometheus_client.

The exporter's HTTP server runs on prometheus_client's own thread.  It never
touches the lock table: the event loop copies :meth:`LockServer.status` into a
plain dict once per ``refresh_s`` seconds (default 1.0), and a scrape reads that
copy - so a scrape can never race with the loop, and costs the loop nothing.

Metric names follow Prometheus conventions (``_total`` counters, base units:
seconds, bytes)::

    fastlock_up, fastlock_role{role}, fastlock_epoch, fastlock_fenced
    fastlock_locks_held, fastlock_waiters, fastlock_sessions
    fastlock_grants_total, fastlock_releases_total, fastlock_expiries_total,
    fastlock_wait_timeouts_total, fastlock_cancels_total
    fastlock_wal_records_total, fastlock_wal_bytes_total, fastlock_wal_fsyncs_total
    fastlock_replication_lag_records, fastlock_replication_lag_seconds
    fastlock_promotion_grace_remaining_seconds
    fastlock_client_sessions, fastlock_client_session_leases   client sessions open, leases attached
    fastlock_session_keepalives_total, fastlock_session_renewals_total   keep-alives received, leases renewed
    fastlock_sync_degraded, fastlock_sync_held, fastlock_sync_degradations_total   (--replication sync)
    fastlock_sync_members                members of an etcd group's in-sync set (PREFIX/sync)
    fastlock_sync_acks_rejected_total    SYNC_ACKs of an LSN their replication connection never carried
    fastlock_shard_unadopted_slots       slots a sharded node's group owns without their token floor (not served)
    fastlock_build_info{version, python, implementation}
    fastlock_request_seconds{op}         histogram: time to handle a request on the loop
    fastlock_time_to_acquire_seconds     histogram: request arrival to grant decision
    fastlock_hold_seconds                histogram: grant to release, expiry or revocation
    fastlock_wal_fsync_seconds           histogram: one data fsync (writer thread)
    fastlock_lock_contention{lock}       the TOP_CONTENDED most contended locks (see below)
    fastlock_principal_usage{principal, resource}, fastlock_principal_quota{principal, resource}
                                         leases, waiters, watches, keys, connections per principal
    process_* and python_*               prometheus_client's default collectors

The histograms (:mod:`fastlock.observe`) have power-of-two buckets from 1 µs to about
16 s and are counted on the loop as the events happen - one list increment each, and
nothing at all without ``--metrics``: the observers are installed only then.  The
queue time is in ``time_to_acquire``; the fsync before an acquire's reply is in
``wal_fsync``.  Contention: an acquire that queued or was refused because the lock was
held counts one for its lock; each refresh halves every lock's score, adds the new
counts and keeps the top entries, and a scrape shows the :data:`TOP_CONTENDED` highest
- so the ``lock`` label has at most that many values at any time, whatever the number
of locks (bounded cardinality; lock names are escaped by prometheus_client).

Exposure: the endpoint has no authentication of its own, so it binds only a loopback
address unless the operator says otherwise (``--metrics-allow-remote``: e.g. behind a
reverse proxy that authenticates the scraper over TLS, or on a network where every host
may read the counters); and lock names, which belong to the principals that chose them,
appear only with ``--metrics-lock-names`` - without it ``fastlock_lock_contention`` is not
exported and no label carries a lock name.  The other labels are fastlock's own (roles,
ops, versions).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import platform
from collections.abc import Iterator
from typing import TYPE_CHECKING

from .auth import is_loopback
from .observe import TOP_CONTENDED, Observer
from .roles import Role

if TYPE_CHECKING:  # pragma: no cover
    from .server import LockServer

log = logging.getLogger(__name__)

_COUNTERS = {
    "grants": "Leases granted (fresh grants, not idempotent re-deliveries)",
    "releases": "Leases released by their holder",
    "expiries": "Leases that reached their TTL",
    "wait_timeouts": "Waiting acquires whose wait ran out",
    "cancels": "Waiting acquires cancelled or dropped with their connection",
}
_GAUGES = {
    "locks_held": "Locks with a current holder",
    "waiters": "Acquires waiting in FIFO queues",
    "sessions": "Client connections",
    "epoch": "Fencing epoch (the high bits of every token; rises on promotion)",
}
ROLES = tuple(role.value for role in Role)  # declared once, in fastlock.roles


#: the resources counted per principal (fastlock.server.admission.PrincipalUsage)
PRINCIPAL_RESOURCES = ("leases", "waiters", "watches", "keys", "key_bytes", "connections")


def _principal_families(rows: list[dict]) -> Iterator:
    """``fastlock_principal_usage`` and ``fastlock_principal_quota`` by principal and resource
    (principal names are the credentials' few, plus ``anonymous``: bounded labels)."""
    from prometheus_client.core import GaugeMetricFamily

    usage = GaugeMetricFamily("fastlock_principal_usage", "What a principal holds now",
                              labels=["principal", "resource"])
    quota = GaugeMetricFamily("fastlock_principal_quota", "A principal's quota (0: none beyond the global limit)",
                              labels=["principal", "resource"])
    for row in rows:
        for resource in PRINCIPAL_RESOURCES:
            usage.add_metric([row["principal"], resource], row[resource])
            quota.add_metric([row["principal"], resource], row[f"{resource}_quota"])
    yield usage
    yield quota


@dataclasses.dataclass(frozen=True)
class Published:
    """What one refresh gives scrapes: the server's ``status`` and copies of the histograms
    (``(metric name, help, label names, [(label values, histogram)])``) taken after it, so a
    scrape never pairs new histogram counts with an older status (an fsync histogram counting
    more than ``fastlock_wal_fsyncs_total``)."""

    status: dict
    histograms: list


class _Collector:
    """A prometheus_client collector over the last status snapshot; ``lock_names``: export
    ``fastlock_lock_contention`` with its ``lock`` label (off: not exported)."""

    def __init__(self, lock_names: bool = False) -> None:
        #: the status and the histograms of one refresh, replaced whole (a scrape reads one of them)
        self.published = Published({}, [])
        self.observer: Observer | None = None
        self.lock_names = lock_names

    def collect(self) -> Iterator:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

        published = self.published
        st = published.status
        yield GaugeMetricFamily("fastlock_up", "1 while the server's loop refreshes these metrics",
                                value=1 if st else 0)
        if not st:
            return
        role = GaugeMetricFamily("fastlock_role", "The node's role (1 for the current one)", labels=["role"])
        for r in ROLES:
            role.add_metric([r], 1 if st.get("role") == r else 0)
        yield role
        for key, doc in _GAUGES.items():
            yield GaugeMetricFamily(f"fastlock_{key}", doc, value=st.get(key, 0))
        for key, doc in _COUNTERS.items():
            yield CounterMetricFamily(f"fastlock_{key}", doc, value=st.get(key, 0))
        repl = st.get("replication") or {}
        yield GaugeMetricFamily("fastlock_fenced", "1 while a primary holds grants for lack of standby contact",
                                value=1 if repl.get("fenced") else 0)
        sync = repl.get("sync") or {}
        yield GaugeMetricFamily("fastlock_sync_degraded", "1 while synchronous replication is degraded to async",
                                value=1 if sync.get("state") == "degraded" else 0)
        yield GaugeMetricFamily("fastlock_sync_held", "1 while a primary holds grants for its synchronous standby",
                                value=1 if sync.get("state") == "held" else 0)
        yield CounterMetricFamily("fastlock_sync_degradations", "Times synchronous replication degraded to async",
                                  value=sync.get("degradations", 0))
        yield CounterMetricFamily("fastlock_sync_acks_rejected",
                                  "SYNC_ACKs not counted: an LSN their replication connection never carried",
                                  value=sync.get("acks_rejected", 0))
        yield GaugeMetricFamily("fastlock_sync_members", "Standbys in an etcd group's in-sync set (PREFIX/sync)",
                                value=len(sync.get("members") or []))
        shard = st.get("shard")
        if isinstance(shard, dict):  # a sharded node (fastlock.server.sharded)
            yield GaugeMetricFamily("fastlock_shard_unadopted_slots",
                                    "Slots this node's shard group owns without their token floor: their names are "
                                    "answered Unavailable until `fastlock shard adopt`",
                                    value=shard.get("unadopted", 0))
        wal = st.get("wal") or {}
        yield CounterMetricFamily("fastlock_wal_records", "WAL records logged since start", value=wal.get("records", 0))
        yield CounterMetricFamily("fastlock_wal_bytes", "WAL bytes written since start", value=wal.get("bytes", 0))
        yield CounterMetricFamily("fastlock_wal_fsyncs", "WAL fsyncs since start", value=wal.get("fsyncs", 0))
        sessions = st.get("client_sessions") or {}
        yield GaugeMetricFamily("fastlock_client_sessions", "Client sessions open (fastlock sessions)",
                                value=sessions.get("open", 0))
        yield GaugeMetricFamily("fastlock_client_session_leases", "Leases attached to client sessions",
                                value=sessions.get("leases", 0))
        yield CounterMetricFamily("fastlock_session_keepalives", "Session keep-alives received since start",
                                  value=sessions.get("keepalives", 0))
        yield CounterMetricFamily("fastlock_session_renewals", "Leases renewed by session keep-alives since start",
                                  value=sessions.get("renewals", 0))
        if "lag_records" in repl:  # a standby's own view
            lag_records, lag_ms = repl.get("lag_records", 0), 0
        else:  # a primary: its (single) standby's lag
            standbys = repl.get("standbys") or []
            lag_records = max((s["lag_records"] for s in standbys), default=0)
            lag_ms = max((s["lag_ms"] for s in standbys), default=0)
        yield GaugeMetricFamily("fastlock_replication_lag_records", "Records not yet applied by the standby",
                                value=lag_records)
        yield GaugeMetricFamily("fastlock_replication_lag_seconds",
                                "Age of the oldest batch the standby has not acknowledged", value=lag_ms / 1000.0)
        yield GaugeMetricFamily("fastlock_promotion_grace_remaining_seconds",
                                "Time left in the post-promotion grace period (no new grants)",
                                value=st.get("grace_remaining_ms", 0) / 1000.0)
        yield from _principal_families(st.get("principals") or [])
        observer = self.observer
        if observer is None:
            return
        build = GaugeMetricFamily("fastlock_build_info", "fastlock's version (value 1)",
                                  labels=["version", "python", "implementation"])
        build.add_metric([str(st.get("version", "")), platform.python_version(), platform.python_implementation()], 1)
        yield build
        for name, doc, labels, hists in published.histograms:
            family = HistogramMetricFamily(name, doc, labels=labels)
            for label_values, hist in hists:
                family.add_metric(label_values, hist.buckets(), hist.sum)
            yield family
        if not self.lock_names:
            return
        contention = GaugeMetricFamily("fastlock_lock_contention",
                                       f"Recent contended acquires of the {TOP_CONTENDED} most contended locks "
                                       f"(decayed: halved each second)", labels=["lock"])
        for lock, score in observer.top_contended():
            contention.add_metric([lock], score)
        yield contention


class MetricsExporter:
    """Serve Prometheus metrics for ``server`` on ``host:port``.

    ``refresh_s`` (seconds): how often the loop copies its status for scrapes.
    From ``server.config``: ``metrics_allow_remote`` lets ``host`` be a
    non-loopback address (``--metrics-allow-remote``; loopback as
    :func:`fastlock.auth.is_loopback` decides for protected mode), and
    ``metrics_lock_names`` exports the contention gauge labelled with lock
    names (``--metrics-lock-names``).

    Raises PermissionError (so the server does not start) for a non-loopback
    ``host`` without ``metrics_allow_remote``, ImportError with an install hint
    if prometheus_client is missing, OSError if the address cannot be bound.
    """

    def __init__(self, server: LockServer, host: str, port: int, refresh_s: float = 1.0):
        lock_names = server.config.metrics_lock_names
        if not server.config.metrics_allow_remote and not is_loopback(host):
            raise PermissionError(f"refusing to serve metrics on {host}: the endpoint has no authentication. "
                                  f"Use a loopback address, or pass --metrics-allow-remote")
        try:
            from prometheus_client import (
                CollectorRegistry,
                GCCollector,
                PlatformCollector,
                ProcessCollector,
                start_http_server,
            )
        except ImportError:
            raise ImportError("--metrics needs prometheus_client: pip install 'fastlock[metrics]'") from None
        self.server = server
        self.refresh_s = refresh_s
        self.collector = _Collector(lock_names)
        registry = CollectorRegistry(auto_describe=False)
        registry.register(self.collector)
        for default in (ProcessCollector, PlatformCollector, GCCollector):
            default(registry=registry)
        self.observer = Observer(server)
        self.collector.observer = self.observer
        self._httpd, self._thread = start_http_server(port, addr=host, registry=registry)
        self.address = self._httpd.server_address[:2]
        self._timer: asyncio.TimerHandle | None = None
        self._refresh()
        log.info("metrics on http://%s:%d/metrics (lock names %s)", self.address[0], self.address[1],
                 "exported" if lock_names else "not exported")

    def _refresh(self) -> None:
        self.observer.refresh()  # takes the fsync durations first: the status read next counts them all
        snapshot = self.server.status()
        snapshot["principals"] = [dataclasses.asdict(u) for u in self.server.quotas.report()]
        self.collector.published = Published(snapshot, self.observer.frozen_histograms())
        self._timer = asyncio.get_running_loop().call_later(self.refresh_s, self._refresh)

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._httpd.shutdown()
        self._httpd.server_close()
