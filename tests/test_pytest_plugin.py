"""The pytest plugin (fastlock.testing), used as a user would: a test file of their own,
run by pytester in a fresh pytest session that loads the plugin from its ``pytest11``
entry point (nothing in that session's conftest names it)."""

from __future__ import annotations

import pytest

pytest_plugins = ["pytester"]

USER_TESTS = '''
import asyncio
import time

import fastlock
from fastlock.sync import SyncClient


def test_sync_client_takes_a_lock(fastlock_sync_client, fastlock_history):
    with fastlock_sync_client.lock("jobs/nightly", ttl=5) as lease:
        fastlock_history.held(lease.name, lease.fencing_token, time.monotonic())
        assert fastlock_sync_client.holder("jobs/nightly")["token"] == lease.fencing_token
        fastlock_history.released(lease.name, lease.fencing_token, time.monotonic())
    assert fastlock_sync_client.holder("jobs/nightly") is None


async def test_async_client_on_the_same_server(fastlock_client, fastlock_server):
    async with fastlock_client.lock("a", ttl=5) as lease:
        with SyncClient(fastlock_server.address) as other:
            assert not other.check("a", lease.fencing_token + 1)
            assert other.check("a", lease.fencing_token)


def test_inprocess_server(fastlock_inprocess_server):
    with SyncClient(fastlock_inprocess_server.address) as c:
        with c.lock("x", ttl=5) as lease:
            assert lease.fencing_token > 0


def test_crash_a_subprocess_server(fastlock_server):
    fastlock_server.kill()
    assert not fastlock_server.alive


async def test_pair_survives_promotion(fastlock_pair):
    client = await fastlock.connect(*fastlock_pair.addresses, client_name="user")
    try:
        first = await client.acquire("k", ttl=1)  # the new primary waits out old TTLs
        fastlock_pair.primary.kill()
        fastlock_pair.promote()
        second = await client.acquire("other", ttl=5, wait=10)
        assert second.fencing_token > first.fencing_token
        assert second.epoch > first.epoch
    finally:
        await client.close()


def test_history_catches_overlap(fastlock_history):
    fastlock_history.held("k", 1, 1.0)
    fastlock_history.held("k", 2, 1.5)   # the first holder has not released: an overlap
    fastlock_history.released("k", 1, 2.0)
    fastlock_history.released("k", 2, 3.0)
'''


def test_plugin_fixtures_in_a_user_test_session(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_user=USER_TESTS)
    pytester.makeini("[pytest]\nasyncio_mode = auto\nasyncio_default_fixture_loop_scope = function\n")
    # a subprocess: the plugin must come from the installed entry point, not from this session
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-q", "--durations=5", timeout=120)
    result.assert_outcomes(passed=6, errors=1)
    # the one error is the history check failing test_history_catches_overlap at teardown
    result.stdout.fnmatch_lines(["*ERROR at teardown of test_history_catches_overlap*"])
    result.stdout.re_match_lines([r".*AssertionError.*k"])


def test_plugin_can_be_disabled(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_user="def test_x(fastlock_server):\n    pass\n")
    result = pytester.runpytest_subprocess("-p", "no:fastlock", "-p", "no:cacheprovider", timeout=60)
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*fixture 'fastlock_server' not found*"])
