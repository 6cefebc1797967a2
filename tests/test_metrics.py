"""`fastlock serve --metrics`: Prometheus text exposition of the server's counters."""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
import urllib.request

import pytest
from conftest import wait_until

import fastlock

#: the subject is the server process: the test loop only drives a client (see conftest.py)
pytestmark = pytest.mark.one_loop

pytest.importorskip("prometheus_client")


def _scrape(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url, timeout=5) as resp:
        text = resp.read().decode()
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    return values


async def test_metrics_endpoint_reports_grants_holders_and_role(server_factory, loop_errors):
    srv = server_factory("metrics-data", args=["--metrics", "127.0.0.1:0"])
    line = srv.wait_for_log(r"metrics on http://")
    url = re.search(r"(http://\S+/metrics)", line).group(1)
    async with fastlock.connect(srv.address) as client:
        held = await client.acquire("m1", ttl=30.0)
        for _ in range(3):
            lease = await client.acquire("m2", ttl=30.0)
            await client.release(lease)
        deadline = asyncio.get_running_loop().time() + 10
        while True:  # the exporter refreshes its snapshot once a second
            values = await asyncio.to_thread(_scrape, url)
            if values.get("fastlock_grants_total") == 4:
                break
            assert asyncio.get_running_loop().time() < deadline, values
            await asyncio.sleep(0.2)
        assert values["fastlock_up"] == 1
        assert values["fastlock_locks_held"] == 1
        assert values["fastlock_releases_total"] == 3
        assert values['fastlock_role{role="primary"}'] == 1
        assert values['fastlock_role{role="standby"}'] == 0
        assert values["fastlock_fenced"] == 0
        assert values["fastlock_wal_fsyncs_total"] >= 1
        await client.release(held)


async def test_histograms_contention_build_info_and_sessions(server_factory, loop_errors):
    srv = server_factory("hist-data", args=["--metrics", "127.0.0.1:0", "--metrics-lock-names"])
    line = srv.wait_for_log(r"metrics on http://")
    url = re.search(r"(http://\S+/metrics)", line).group(1)
    async with fastlock.connect(srv.address) as a, fastlock.connect(srv.address) as b:
        for _ in range(5):  # "hot" is contended five times: b queues behind a
            lease = await a.acquire("hot", ttl=30.0)
            queued = asyncio.ensure_future(b.acquire("hot", ttl=30.0, wait=10.0))
            holder = await a.lock_info("hot")
            while holder.waiter_count == 0:
                holder = await a.lock_info("hot")
            await a.release(lease)
            await b.release(await queued)
        st = await a.status()
        deadline = asyncio.get_running_loop().time() + 10
        while True:  # the exporter refreshes once a second
            values = await asyncio.to_thread(_scrape, url)
            if values.get("fastlock_hold_seconds_count") == 10 and values.get("fastlock_wal_fsync_seconds_count"):
                break
            assert asyncio.get_running_loop().time() < deadline, values
            await asyncio.sleep(0.2)
    assert values['fastlock_request_seconds_count{op="acquire"}'] == 10
    assert values['fastlock_request_seconds_count{op="release"}'] == 10
    assert values["fastlock_time_to_acquire_seconds_count"] == 10
    assert values['fastlock_time_to_acquire_seconds_bucket{le="+Inf"}'] == 10
    assert values["fastlock_wal_fsync_seconds_count"] <= values["fastlock_wal_fsyncs_total"]
    assert values['fastlock_lock_contention{lock="hot"}'] > 0
    assert values["fastlock_sessions"] == st["sessions"] == 2
    assert any(k.startswith("fastlock_build_info{") for k in values)
    assert "process_cpu_seconds_total" in values and any(k.startswith("python_info") for k in values)


def _scrape_text(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as resp:
        return resp.read().decode()


async def _has_waiter(client, name: str) -> bool:
    return (await client.lock_info(name)).waiter_count > 0


async def test_lock_names_are_not_in_labels_by_default(server_factory, loop_errors):
    """Finding: the unauthenticated /metrics showed other principals' lock names.  Without
    --metrics-lock-names no series names a lock, contended or not."""
    secret = "payroll/acme-merger"
    srv = server_factory("names-data", args=["--metrics", "127.0.0.1:0"])
    url = re.search(r"(http://\S+/metrics)", srv.wait_for_log(r"metrics on http://")).group(1)
    async with fastlock.connect(srv.address) as a, fastlock.connect(srv.address) as b:
        for _ in range(3):  # contended: b queues behind a
            lease = await a.acquire(secret, ttl=30.0)
            queued = asyncio.ensure_future(b.acquire(secret, ttl=30.0, wait=10.0))
            await wait_until(lambda: _has_waiter(a, secret), 10, "b queued")
            await a.release(lease)
            await b.release(await queued)
        deadline = asyncio.get_running_loop().time() + 10
        while True:  # the exporter refreshes once a second: wait until it has seen every hold
            text = await asyncio.to_thread(_scrape_text, url)
            if "fastlock_hold_seconds_count 6.0" in text:
                break
            assert asyncio.get_running_loop().time() < deadline, text[-2000:]
            await asyncio.sleep(0.2)
    assert "payroll" not in text and "acme" not in text
    assert "fastlock_lock_contention" not in text
    assert 'fastlock_request_seconds_count{op="acquire"} 6.0' in text  # the op labels stay


@pytest.mark.parametrize("address", ["0.0.0.0:0", "[::]:0"])
def test_metrics_off_loopback_needs_an_explicit_flag(tmp_path, address):
    """The endpoint has no authentication: a non-loopback --metrics address is refused at start
    (exit 1, a message naming --metrics-allow-remote), before the client port listens."""
    data = tmp_path / "data"
    res = subprocess.run([sys.executable, "-m", "fastlock", "serve", "--listen", "127.0.0.1:0",
                          "--data-dir", str(data), "--metrics", address],
                         capture_output=True, text=True, timeout=30, cwd=str(tmp_path))
    assert res.returncode == 1, res.stderr
    assert "--metrics-allow-remote" in res.stderr and "listening on" not in res.stderr
