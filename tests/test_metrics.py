"""`fastlock serve --metrics`: Prometheus text exposition of the server's counters."""

from __future__ import annotations

import asyncio
import re
import urllib.request

import pytest

import fastlock

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
