"""``fastlock serve --shards N``: N shard processes under one parent (fastlock.cli.shards)."""

from __future__ import annotations

import json
import os
import re

import pytest

import fastlock
from fastlock._testbase.servers import ServerProcess
from fastlock._testbase.shards import names_owned_by
from fastlock.client.sharded import ShardedClient
from fastlock.sharding import load_map_file


def _shard_pids(server: ServerProcess) -> dict[str, int]:
    return {m.group(1): int(m.group(2)) for line in list(server.lines)
            for m in [re.search(r"(shard-\d+) \(pid (\d+)\)", line)] if m}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


async def test_shards_serve_their_slots_and_stop_together(tmp_path):
    parent = ServerProcess(tmp_path / "data", fsync="never", args=["--shards", "2"])
    parent.start()
    try:
        shard_map = load_map_file(tmp_path / "data" / "shard-map.json")
        assert [g.name for g in shard_map.groups] == ["shard-0", "shard-1"]
        for group in shard_map.groups:  # every shard listens (the first did before start() returned)
            parent.wait_for_log(f"listening on {re.escape(group.addresses[0])}", timeout=20)
        pids = _shard_pids(parent)
        assert set(pids) == {"shard-0", "shard-1"} and all(_alive(p) for p in pids.values())
        status = json.loads((tmp_path / "data" / "shards.json").read_text())
        assert status["parent"] == parent.pid
        assert {row["group"]: row["pid"] for row in status["shards"]} == pids
        assert [row["address"] for row in status["shards"]] == [g.addresses[0] for g in shard_map.groups]
        assert {p.name for p in (tmp_path / "data").iterdir() if p.is_dir()} == {"shard-0", "shard-1"}
        async with fastlock.connect(shard_map.groups[1].addresses[0]) as client:
            assert isinstance(client, ShardedClient)
            names = names_owned_by(shard_map, "shard-0", 2) + names_owned_by(shard_map, "shard-1", 2)
            leases = [await client.acquire(n, ttl=10) for n in names]
            for group in ("shard-0", "shard-1"):
                status = await client.group_clients()[group].status()
                assert status["shard"] == {"group": group, "epoch": 1, "slots": shard_map.slot_count(group),
                                           "moving": 0, "held": 0, "unadopted": 0, "below_floor": 0,
                                           "imported_held": 0}
                assert status["locks_held"] == 2
            for lease in leases:
                await client.release(lease)
    finally:
        assert parent.stop() == 0
    assert not any(_alive(p) for p in pids.values())
    assert not (tmp_path / "data" / "shards.json").exists()


def test_another_shard_count_on_the_same_data_is_refused(tmp_path):
    first = ServerProcess(tmp_path / "data", fsync="never", args=["--shards", "2"])
    first.start()
    first.stop()
    again = ServerProcess(tmp_path / "data", fsync="never", args=["--shards", "3"])
    with pytest.raises(RuntimeError, match="moving slots is not done"):
        again.start(timeout=20)
    again.stop()


def test_a_restart_on_free_ports_writes_a_map_of_a_higher_epoch(tmp_path):
    # with --listen HOST:0 a restart picks other ports: the map it writes differs from the one
    # clients may hold, so its epoch must rise (a client keeps only a map of a higher epoch)
    first = ServerProcess(tmp_path / "data", fsync="never", args=["--shards", "2"])
    first.start()
    assert first.stop() == 0
    before = load_map_file(tmp_path / "data" / "shard-map.json")
    again = ServerProcess(tmp_path / "data", fsync="never", args=["--shards", "2"])
    again.start()
    try:
        after = load_map_file(tmp_path / "data" / "shard-map.json")
        assert after.ranges == before.ranges
        if after.groups != before.groups:
            assert after.epoch > before.epoch
        else:
            assert after.epoch == before.epoch
    finally:
        assert again.stop() == 0


def test_a_shard_killed_stops_the_set_and_the_parent_exits_as_a_shell_reports_it(tmp_path):
    import signal

    parent = ServerProcess(tmp_path / "data", fsync="never", args=["--shards", "2"])
    parent.start()
    try:
        shard_map = load_map_file(tmp_path / "data" / "shard-map.json")
        for group in shard_map.groups:
            parent.wait_for_log(f"listening on {re.escape(group.addresses[0])}", timeout=20)
        pids = _shard_pids(parent)
        os.kill(pids["shard-1"], signal.SIGKILL)
        status = parent.proc.wait(timeout=60)
    finally:
        parent.stop()
    assert status == 128 + signal.SIGKILL  # as a shell reports a process a signal ended (not 256 - 9)
    assert not _alive(pids["shard-0"])
    assert not (tmp_path / "data" / "shards.json").exists()


def test_shards_stop_when_their_parent_is_killed(tmp_path):
    """A parent killed with -9 cannot forward a signal: each shard sees it gone and stops itself."""
    import signal
    import time

    parent = ServerProcess(tmp_path / "data", fsync="never", args=["--shards", "2"])
    parent.start()
    try:
        shard_map = load_map_file(tmp_path / "data" / "shard-map.json")
        for group in shard_map.groups:
            parent.wait_for_log(f"listening on {re.escape(group.addresses[0])}", timeout=20)
        pids = _shard_pids(parent)
        parent.kill()
        deadline = time.monotonic() + 60
        while any(_alive(p) for p in pids.values()) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = [p for p in pids.values() if _alive(p)]
        for pid in left:
            os.kill(pid, signal.SIGKILL)
        assert not left, "shards outlived their killed parent"
    finally:
        parent.stop()
