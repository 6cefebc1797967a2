"""Shared fixtures: real server processes on free loopback ports, both event loops.

Every async test runs on the stdlib asyncio loop or on uvloop, with a loop
exception handler that fails the test if any callback or task raised unseen.
By default each test runs on one of the two, chosen by a stable hash of its id,
so that both loops drive about half of the suite each and ``make test`` stays
short; with ``FASTLOCK_BOTH_LOOPS=1`` (``make test-both-loops``) every async
test runs twice, once on each loop (the uvloop project's own pattern).  A test
marked ``one_loop`` runs on the asyncio loop only: one whose subject is a server
process (its restart, its WAL, its endpoints), where the test's own loop only
drives a client that the other tests cover on both loops.

A test that uses the ``server``, ``cluster`` or ``server_factory`` fixture is
marked ``integration``; ``make test-quick`` runs the others (no server process
started by a fixture) for the inner loop.

``make test`` runs the suite on pytest-xdist workers with ``--dist loadgroup``: every test
is in a group (:func:`xdist_group_of`), its file's name, or ``heavy`` for :data:`HEAVY_FILES`,
so that a file's tests run on one worker in order and the heavy files one after another on
one worker.
Each worker starts its own session fixtures (etcd members, PostgreSQL servers) on free ports,
in its own temporary directories.
"""

from __future__ import annotations

import asyncio
import os
import time
import zlib

import pytest

from fastlock._testbase import ServerProcess

try:
    import uvloop
except ImportError:  # pragma: no cover
    uvloop = None

#: every async test on both loops (else on one, chosen by a hash of its id)
BOTH_LOOPS = os.environ.get("FASTLOCK_BOTH_LOOPS", "") not in ("", "0")
#: the fixtures that start server processes: a test using one is marked ``integration``
SERVER_FIXTURES = frozenset({"server", "cluster", "server_factory"})


#: the xdist group of the tests that must not run beside one another (see :func:`xdist_group_of`)
HEAVY_GROUP = "heavy"
#: test files whose tests load the machine (a 50k-key listing, 100k waiters, thousands of
#: connections, crash and nemesis runs) or measure a share of it (fair turns, output shares,
#: peak memory): under ``pytest -n N --dist loadgroup`` all of them run on one worker, one
#: after another, so no two of them share the machine
HEAVY_FILES = frozenset({
    "test_bad_input.py",
    "test_bounded_replies.py",
    "test_crash.py",
    "test_fair_turns.py",
    "test_limits.py",
    "test_lock_kinds.py",
    "test_nemesis.py",
    "test_output_shares.py",
    "test_share_bounds.py",
})
#: tests of other files that load the machine as much (``file::name``, without parameters)
HEAVY_TESTS = frozenset({
    "test_sessions.py::test_one_keepalive_per_interval_renews_ten_thousand_leases",
})


def pytest_configure(config):
    config.addinivalue_line("markers", "one_loop: run this async test on the asyncio loop only (see conftest.py)")
    config.addinivalue_line("markers", "integration: the test starts server processes through a fixture")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if SERVER_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.integration)


def xdist_group_of(nodeid: str) -> str:
    """The xdist group of the test ``nodeid`` (``make test``: ``pytest -n 2 --dist loadgroup``):
    :data:`HEAVY_GROUP` for a test of :data:`HEAVY_FILES` or :data:`HEAVY_TESTS`, else its
    file's name, so that the tests of one file run on one worker in their order and a
    module-scoped fixture starts once."""
    path, _, test = nodeid.partition("::")
    name = path.rsplit("/", 1)[-1]
    if name in HEAVY_FILES or f"{name}::{test.split('[', 1)[0]}" in HEAVY_TESTS:
        return HEAVY_GROUP
    return name


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """``--dist loadgroup``: the groups of :func:`xdist_group_of` (pytest-xdist's hook; its own
    loadgroup reads ``xdist_group`` marks, which it cannot attach to a test's id on pytest 9)."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class FileGroups(LoadScopeScheduling):
        """pytest-xdist's scope scheduling (the largest groups handed out first), by group."""

        def _split_scope(self, nodeid: str) -> str:
            return xdist_group_of(nodeid)

    return FileGroups(config, log)


def pytest_asyncio_loop_factories(config, item):
    """The loops an async test runs on (pytest-asyncio >= 1.5 hook): the asyncio loop for a
    ``one_loop`` test; both with ``FASTLOCK_BOTH_LOOPS=1``; else one of the two, by a
    stable hash (CRC-32) of the test's id without its parameters."""
    if uvloop is None or item.get_closest_marker("one_loop") is not None:
        return {"asyncio": asyncio.new_event_loop}
    if BOTH_LOOPS:
        return {"asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}
    base = item.nodeid.split("[", 1)[0]
    if zlib.crc32(base.encode()) & 1:
        return {"uvloop": uvloop.new_event_loop}
    return {"asyncio": asyncio.new_event_loop}


@pytest.fixture
async def loop_errors():
    """Install a loop exception handler that fails the test on any unseen error."""
    errors: list[dict] = []
    loop = asyncio.get_running_loop()
    loop.set_exception_handler(lambda _loop, context: errors.append(context))
    yield errors
    # let callbacks scheduled by the test's last steps run before judging
    await asyncio.sleep(0)
    if errors:
        msgs = [str(c.get("exception") or c.get("message")) for c in errors]
        pytest.fail("unhandled errors reported to the event loop: " + "; ".join(msgs))


@pytest.fixture
async def connect(server, loop_errors):
    """Factory: ``client = await connect(name)``; every client is closed after the test."""
    import fastlock

    clients = []

    async def make(client_name: str = "test", address: str | None = None, **kwargs):
        c = await fastlock.connect(address or server.address, client_name=client_name, **kwargs)
        clients.append(c)
        return c

    yield make
    for c in clients:
        await c.close()


@pytest.fixture
async def client(connect):
    return await connect("test-client")


@pytest.fixture
def server(tmp_path):
    """A real `fastlock serve` process on 127.0.0.1 with a free port; always stopped."""
    srv = ServerProcess(tmp_path / "data")
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture
def cluster(tmp_path):
    """Primaries, standbys and TCP proxies for replication tests; all stopped after the test."""
    from fastlock._testbase.cluster import Cluster

    c = Cluster(tmp_path)
    try:
        yield c
    finally:
        c.stop_all()


@pytest.fixture
def server_factory(tmp_path):
    """Start more servers (e.g. with other flags); every one is stopped after the test."""
    started: list[ServerProcess] = []

    def make(name: str = "data", **kwargs) -> ServerProcess:
        srv = ServerProcess(tmp_path / name, **kwargs)
        started.append(srv)
        return srv.start()

    yield make
    for srv in started:
        srv.stop()


#: seconds: a generous bound on another client's request while a flood, a stream or a listing
#: runs - past it the server stalled.  Tests assert only this; the latency under load is a
#: measurement (benches/: benches.limits, benches.admin_listing), never a test's assertion,
#: since CI runs on two loaded cores.
STALL_S = 5.0


async def wait_until(predicate, timeout: float = 5.0, what: str = "condition"):
    """Await ``predicate()`` (sync or async) until true; fail after ``timeout`` s.

    For conditions only observable by asking the server (e.g. "the waiter is
    queued"), with a bounded deadline - never a fixed sleep.
    """
    deadline = time.monotonic() + timeout
    delay = 0.001
    while True:
        value = predicate()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        await asyncio.sleep(delay)
        delay = min(delay * 2, 0.02)


def _etcd_member(secured: bool):
    """Start a throwaway etcd member (tests/etcdserver.py), plain or secured; yield it, stop it."""
    import etcdserver

    try:
        server = etcdserver.EtcdServer(secured=secured)
    except etcdserver.EtcdUnavailable as exc:
        etcdserver.require_etcd(str(exc))
    server.start()
    try:
        yield server
    finally:
        server.stop()


def _answering(server):
    """``server``, resumed or restarted if a test paused or killed it."""
    if server.paused:
        server.resume()
    if server.proc is None:
        server.restart()
    return server


@pytest.fixture(scope="session")
def etcd_server():
    """One throwaway etcd member for the whole session (tests/etcdserver.py); each test
    uses its own key prefix.  Skips without the etcd binary unless FASTLOCK_REQUIRE_ETCD=1."""
    yield from _etcd_member(secured=False)


@pytest.fixture
def etcd(etcd_server):
    """The session's etcd member, running and answering (a test may have paused or killed it)."""
    return _answering(etcd_server)


@pytest.fixture
def groups_of(etcd, tmp_path, monkeypatch):
    """``await groups_of(sizes, **options)``: shard groups g0 and g1 of etcd-arbitrated nodes
    (``test_shard_move_tokens.EtcdGroups``: ``sizes`` nodes each, options as its constructor's),
    stopped after the test."""
    from test_shard_move_tokens import EtcdGroups

    made: list[EtcdGroups] = []

    async def make(sizes: tuple[int, int], **options) -> EtcdGroups:
        groups = EtcdGroups(etcd, tmp_path, monkeypatch, sizes, **options)
        made.append(groups)
        await groups.start()
        return groups

    try:
        yield make
    finally:
        for groups in made:
            groups.stop()


@pytest.fixture
async def groups(etcd, tmp_path, monkeypatch):
    """Two shard groups g0 and g1, one server each, following the map in etcd, with credentials
    (``test_shard_move.Groups``), stopped after the test."""
    from test_shard_move import Groups

    g = Groups(etcd, tmp_path, monkeypatch)
    try:
        await g.start()
        yield g
    finally:
        g.stop()


@pytest.fixture(scope="session")
def secure_etcd_server():
    """One throwaway etcd member with client TLS (``--client-cert-auth``) and authentication
    enabled (tests/etcdserver.py's secured mode), for the whole session."""
    pytest.importorskip("trustme")
    yield from _etcd_member(secured=True)


@pytest.fixture
def secure_etcd(secure_etcd_server):
    """The session's secured etcd member, running and answering."""
    return _answering(secure_etcd_server)
