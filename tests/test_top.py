"""``fastlock top --once`` (issue 14) against a real server with held and waited locks:
the most contended lock comes first, with its queue depth and its waiters' waits."""

from __future__ import annotations

import asyncio
import json
import os
import queue
import subprocess
import sys
import threading
import time
import types

import fastlock
from fastlock._testbase import ServerProcess

TIMEOUT = 20.0


def test_top_once_shows_the_most_contended_locks_first(server):
    async def main():
        async with await fastlock.connect(server.address, client_name="holder") as holder, \
                await fastlock.connect(server.address, client_name="waiter") as waiter:
            for name in ("orders/1", "orders/2", "billing"):
                await holder.acquire(name, ttl=60.0, correlation_id=f"job-{name}")
            waiting = [asyncio.create_task(waiter.acquire("billing", ttl=5.0, wait=TIMEOUT)) for _ in range(2)]
            waiting.append(asyncio.create_task(waiter.acquire("orders/2", ttl=5.0, wait=TIMEOUT)))
            async with asyncio.timeout(TIMEOUT):
                while (await holder.status())["waiters"] < 3:
                    await asyncio.sleep(0.02)
            env = {k: v for k, v in os.environ.items() if not k.startswith("FASTLOCK_")}
            env["COLUMNS"] = "160"
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "fastlock", "top", "--once", "--server", server.address, env=env,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
            out, err = await asyncio.wait_for(proc.communicate(), TIMEOUT)
            for task in waiting:
                task.cancel()
            return proc.returncode, out.decode(), err.decode()

    code, out, err = asyncio.run(main())
    assert code == 0, err
    assert "primary" in out and "held 3" in out and "waiters 3" in out
    rows = [line for line in out.splitlines() if line.strip(" │|").startswith(("billing", "orders/"))]
    names = [next(w for w in r.replace("│", " ").split()) for r in rows]
    assert names == ["billing", "orders/2", "orders/1"], out       # deepest queue first
    cells = rows[0].replace("│", " ").split()
    assert cells[2].endswith("holder") and cells[5] == "2", out    # HOLDER ... WAITERS
    assert "wait so far p50/p90/p99:" in out and "(n=3)" in out, out
    assert "hold (ended, seen by top) p50/p90/p99: -" in out, out
    # one frame has no previous one: it shows the totals, never a promise of a next frame
    assert "after the next frame" not in out, out
    assert "totals since the server started: grants 3 " in " ".join(out.split()), out


async def run_cli(server, *args: str, columns: int = 200) -> tuple[int, str, str]:
    """``python -m fastlock ARGS --server ADDRESS`` in a ``columns``-wide terminal:
    ``(exit status, stdout, stderr)``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FASTLOCK_")}
    env["COLUMNS"] = str(columns)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "fastlock", *args, "--server", server.address, env=env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), TIMEOUT)
    return proc.returncode, out.decode(), err.decode()


def test_peer_chosen_names_are_shown_escaped_and_never_read_as_markup(server):
    """A lock or client name may hold rich markup, ANSI escapes or a newline: ``top`` and
    ``locks`` show it escaped (one row, no terminal control) instead of crashing on
    ``[/bold]`` or letting it drive the terminal."""
    evil = "x[/bold]y\x1b[2J\nrow"

    async def hold():
        client = await fastlock.connect(server.address, client_name="c\x1b]0;t\x07")
        await client.acquire(evil, ttl=60.0)
        return client

    async def main():
        client = await hold()
        try:
            return [await run_cli(server, "top", "--once"), await run_cli(server, "locks")]
        finally:
            await client.close()

    for code, out, err in asyncio.run(main()):
        assert code == 0, err
        assert "\x1b" not in out and "\x07" not in out
        assert json.dumps(evil) in out
        assert not any(line.lstrip(" │|").startswith("row") for line in out.splitlines())


def test_a_holder_name_is_quoted_once_in_the_locks_table():
    from fastlock.cli.locks import _holder, table

    who = types.SimpleNamespace(principal="app", client="job\\1\x1b[31m")
    row = table(("HOLDER",), [(_holder(who),)])
    assert row.splitlines()[1] == '"app:job\\\\1\\u001b[31m"'


def test_a_name_with_spaces_is_one_quoted_cell_in_every_table_and_raw_in_json(server):
    """A lock name with spaces (or any character beyond printable ASCII) is shown as a JSON
    string in ``top``, ``locks`` and ``lock``, as ``wal dump`` shows it: one row, never
    wrapped at its spaces into what looks like more rows; ``-o json`` keeps it raw."""
    spaced = "nightly report for team alpha and team beta"

    async def run(*args):
        code, out, err = await run_cli(server, *args, columns=60)
        assert code == 0, err
        return out

    async def main():
        async with await fastlock.connect(server.address, client_name="night shift") as client:
            await client.acquire(spaced, ttl=60.0)
            await client.acquire("café", ttl=60.0)
            return (await run("top", "--once"), await run("locks"), await run("lock", spaced),
                    await run("lock", "café"), await run("locks", "-o", "json"))

    top, locks, lock, cafe, listing = asyncio.run(main())
    rows = [line.strip(" │|") for line in top.splitlines()]
    assert sum(r.startswith('"nightly') for r in rows) == 1, top
    assert not any(r.startswith(("team", "for", "alpha", "beta", "shift")) for r in rows), top
    assert sum(r.startswith('"caf\\u00e9"') for r in rows) == 1, top
    assert f'{json.dumps(spaced)}  ' in locks and '"caf\\u00e9"  ' in locks, locks
    assert '"anonymous:night shift"' in locks, locks
    assert lock.splitlines()[1].startswith('"anonymous:night shift"'), lock
    assert cafe.splitlines()[1].startswith('"anonymous:night shift"'), cafe
    assert sorted(h["name"] for h in json.loads(listing)["locks"]) == ["café", spaced]
    assert {h["client"] for h in json.loads(listing)["locks"]} == {"night shift"}


def test_top_once_into_a_pipe_keeps_every_column_of_a_long_name(server):
    """Off a terminal and without COLUMNS, a frame is not cut to 80 columns: a 60-character
    name and every column after it are printed whole."""
    name = "reports/" + "q" * 52

    async def main():
        async with await fastlock.connect(server.address) as client:
            lease = await client.acquire(name, ttl=60.0)
            env = {k: v for k, v in os.environ.items() if not k.startswith("FASTLOCK_") and k != "COLUMNS"}
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "fastlock", "top", "--once", "--server", server.address, env=env,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
            out, err = await asyncio.wait_for(proc.communicate(), TIMEOUT)
            assert proc.returncode == 0, err
            return lease, out.decode()

    lease, out = asyncio.run(main())
    for header in ("LOCK", "TOKEN", "HOLDER", "HELD", "TTL LEFT", "WAITERS", "LONGEST WAIT", "HANDOVERS"):
        assert header in out, out
    row = next(line for line in out.splitlines() if name in line)
    assert str(lease.fencing_token) in row.split(), row


def _top_env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FASTLOCK_")}
    env["COLUMNS"] = "160"
    return env


def test_top_o_json_prints_one_snapshot_and_exits(server):
    async def main():
        async with await fastlock.connect(server.address, client_name="holder") as holder, \
                await fastlock.connect(server.address, client_name="waiter") as waiter:
            await holder.acquire("a", ttl=60.0)
            await holder.acquire("b", ttl=60.0, correlation_id="job-b")
            waiting = asyncio.create_task(waiter.acquire("b", ttl=5.0, wait=TIMEOUT))
            async with asyncio.timeout(TIMEOUT):
                while (await holder.status())["waiters"] < 1:
                    await asyncio.sleep(0.02)
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "fastlock", "top", "-o", "json", "--server", server.address, env=_top_env(),
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
            out, err = await asyncio.wait_for(proc.communicate(), TIMEOUT)
            waiting.cancel()
            return proc.returncode, out.decode(), err.decode()

    code, out, err = asyncio.run(main())
    assert code == 0, err
    (line,) = out.splitlines()
    snap = json.loads(line)
    assert (snap["role"], snap["locks_held"], snap["waiters"]) == ("primary", 2, 1)
    assert set(snap["counters"]) == {"grants", "releases", "expiries", "wait_timeouts"}
    assert [(r["name"], r["waiters"], r["client"]) for r in snap["locks"]] == [("b", 1, "holder"), ("a", 0, "holder")]
    assert snap["locks"][0]["correlation_id"] == "job-b" and snap["locks"][0]["longest_wait"] >= 0
    assert snap["wait"]["n"] == 1


def test_top_without_a_terminal_prints_each_frame_and_rides_out_a_restart(server):
    """stdout a pipe: one plain frame per refresh (no screen control); the server stops:
    "disconnected, retrying"; it comes back on its port: frames again."""
    proc = subprocess.Popen([sys.executable, "-m", "fastlock", "top", "--interval", "0.2", "--server",
                             server.address], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=_top_env())
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(ln) for ln in proc.stdout], daemon=True).start()

    def wait_for(text: str) -> None:
        deadline = time.monotonic() + TIMEOUT
        while True:
            line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
            assert "\x1b" not in line, line
            if text in line:
                return

    restarted = None
    try:
        wait_for("primary  epoch")   # a frame's header...
        wait_for("primary  epoch")   # ...and the next one: printed as it comes, not at exit
        server.stop()
        wait_for("disconnected, retrying")
        restarted = ServerProcess(server.data_dir, port=server.port).start()
        wait_for("primary  epoch")
        assert proc.poll() is None
    finally:
        proc.kill()
        proc.wait(TIMEOUT)
        if restarted is not None:
            restarted.stop()
