"""Failover time of a group whose primary etcd names (issues 16 and 24).

    python -m benches.etcd_failover [--kills 20] [--ttl 2] [--lock-ttl 1.0] [--promotion-grace G]
                                    [--replication sync] [--sync-standbys K] [--load N] [--json PATH]

One throwaway etcd member (tests/etcdserver.py: the ``etcd`` binary, Debian's
``etcd-server``) and three ``fastlock serve --coordinator`` nodes on 127.0.0.1,
always stopped in ``finally`` blocks; every wait has a deadline.  ``--kills``
times: take a lock of ``--lock-ttl`` on the primary, SIGKILL it, and measure on
this process's monotonic clock

- kill -> another node reports itself an unfenced primary (STATUS, polled every 10 ms);
- kill -> the first grant of a free lock by it (retried through its grace period);

then restart the killed node (it rejoins as a standby) before the next kill.
Each kill's line breaks the time down (ms from the kill, this process's clock):
``deleted`` (the dead primary's key is gone: deleted by a standby under the heartbeat
rule, or freed by etcd with its lease; seen by this bench's own watch of
``PREFIX/primary``), ``taken`` (a node's bid put the key: the same watch),
``promoted`` (a node reports itself an unfenced primary), ``granted`` (the first
free grant by this bench, which knows the new primary from STATUS) and ``client``
(a ``fastlock.connect`` client of the three addresses, connected before the
kill, that asks for a free lock at the kill and rides through the failover).
A standby deletes the key once the dead primary's last heartbeat has stood for
one TTL since it saw it (fastlock/coordination/etcd.py), so ``deleted`` is at most
about the TTL after the kill; without a standby reaching etcd, etcd 3.4 frees an
expired lease's keys at its next expiry check (every 500 ms): the TTL after the
last keepalive plus up to 500 ms.  Everything after ``deleted`` is the bid, the
promotion and the first grant.
With ``--load N`` (issue 24), N clients take locks of a 60 s TTL on the primary
without pause while it is killed; after each failover every grant that was
acknowledged to them is looked up on the new primary (``HOLDER``): a grant whose
lock is not held there by the same token counts as *missing*.  With
``--replication sync`` the nodes replicate synchronously (``--sync-standbys``),
the bench waits for a full in-sync set before each kill, and the expected first
free grant is within the etcd TTL + 0.5 s (no grace: the in-sync standby wins).
Expected: at most the etcd lease TTL (the dead primary's lease runs out, a
standby's next step a quarter TTL later at most takes the key) for the first,
plus the grace period (default: the longest TTL seen) for the second.  The
epoch of each new primary is checked to be above the previous one, and every
token above every earlier token.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from typing import Any

import fastlock
from fastlock._testbase.cluster import Cluster, RawNode, status_of
from fastlock._testbase.servers import ServerProcess
from fastlock.coordination.gateway import EtcdGateway, EtcdUnavailable
from fastlock.errors import FastlockError, Unavailable

from .harness import print_result

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.realpath(__file__))), "tests"))
from etcdserver import EtcdServer, unique_prefix


async def _statuses(nodes: dict[str, ServerProcess]) -> dict[str, dict]:
    out = {}
    for name, srv in nodes.items():
        if srv.alive:
            try:
                out[name] = await asyncio.wait_for(status_of(srv.address), 1.0)
            except (OSError, FastlockError, asyncio.TimeoutError):
                pass
    return out


async def _primary(nodes: dict[str, ServerProcess], deadline_s: float) -> tuple[str, dict]:
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        found = [(n, st) for n, st in (await _statuses(nodes)).items()
                 if st["role"] == "primary" and not st["replication"]["fenced"]]
        if len(found) == 1:
            return found[0]
        await asyncio.sleep(0.01)
    raise TimeoutError(f"no single primary after {deadline_s} s")


async def _grant(address: str, name: str, ttl_ms: int, deadline_s: float) -> int:
    deadline = time.monotonic() + deadline_s
    node = await RawNode.open(address)
    try:
        while True:
            try:
                return (await node.acquire(name, ttl_ms, wait_ms=100))[0]
            except FastlockError:
                if time.monotonic() > deadline:
                    raise
    finally:
        await node.close()


async def _standbys_follow(nodes: dict[str, ServerProcess], primary: str, deadline_s: float) -> None:
    address = nodes[primary].address
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        sts = await _statuses({n: s for n, s in nodes.items() if n != primary})
        if len(sts) == len(nodes) - 1 and all(st["role"] == "standby" and st["replication"]["primary"] == address
                                              and st["replication"]["synced"] for st in sts.values()):
            return
        await asyncio.sleep(0.02)
    raise TimeoutError("the standbys did not follow the primary")


class Load:
    """``workers`` clients taking fresh locks on ``address`` until stopped; every
    acknowledged grant is kept as ``(name, token)``."""

    def __init__(self, address: str, workers: int, round_no: int):
        self.acked: list[tuple[str, int]] = []
        self.errors = 0
        self._stop = asyncio.Event()
        self._tasks = [asyncio.ensure_future(self._worker(address, f"load-{round_no}-{w}")) for w in range(workers)]

    async def _worker(self, address: str, prefix: str) -> None:
        try:
            node = await RawNode.open(address)
        except (OSError, FastlockError):
            return
        try:
            for seq in range(1_000_000):
                if self._stop.is_set():
                    return
                name = f"{prefix}-{seq}"
                try:
                    token = (await asyncio.wait_for(node.acquire(name, 60_000, wait_ms=0), 5.0))[0]
                except (OSError, FastlockError, asyncio.TimeoutError):
                    self.errors += 1
                    return  # the primary died (or refused): this worker is done
                self.acked.append((name, token))
        finally:
            await node.close()

    async def stop(self) -> None:
        self._stop.set()
        await asyncio.wait(self._tasks, timeout=10)


#: seconds a lookup of one acknowledged grant retries a primary that refuses reads while it is
#: fenced (a renewal late on a loaded machine: the fence lifts at the next one)
FENCED_RETRY_S = 10.0


async def _preload(address: str, count: int, ttl_ms: int, workers: int = 16) -> None:
    """Take ``count`` locks with a TTL of ``ttl_ms`` on ``address`` (``workers`` connections at once)."""
    async def worker(w: int) -> None:
        node = await RawNode.open(address)
        try:
            for seq in range(w, count, workers):
                await asyncio.wait_for(node.acquire(f"preload-{seq}", ttl_ms, wait_ms=0), 30.0)
        finally:
            await node.close()

    await asyncio.gather(*(worker(w) for w in range(workers)))


async def _holder(node: RawNode, name: str) -> Any:
    """``HOLDER name`` on ``node``, asked again every 20 ms (for at most :data:`FENCED_RETRY_S`)
    while it answers ``Unavailable``."""
    deadline = time.monotonic() + FENCED_RETRY_S
    while True:
        try:
            return await node.holder(name)
        except Unavailable:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.02)


async def _missing(address: str, acked: list[tuple[str, int]]) -> list[tuple[str, int, Any]]:
    """The acknowledged grants whose lock ``address`` does not hold by the same token."""
    node = await RawNode.open(address)
    try:
        out = []
        for name, token in acked:
            holder = await _holder(node, name)
            if not holder or holder.get("token") != token:
                out.append((name, token, holder and holder.get("token")))
        return out
    finally:
        await node.close()


async def _in_sync(address: str, count: int, deadline_s: float) -> None:
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        st = await status_of(address)
        if len((st["replication"].get("sync") or {}).get("members") or []) >= count:
            return
        await asyncio.sleep(0.02)
    raise TimeoutError(f"fewer than {count} in-sync standbys after {deadline_s} s")


class KeyWatch:
    """This bench's own watch of one etcd key: every change as ``(monotonic s, "PUT"|"DELETE")``."""

    def __init__(self, etcd_address: str, key: str):
        host, _, port = etcd_address.rpartition(":")
        self.events: list[tuple[float, str]] = []
        self.ready = asyncio.Event()
        self._gateway = EtcdGateway([(host, int(port))], timeout_s=2.0)
        self._key = key
        self._task = asyncio.ensure_future(self._run())

    def _on(self, kind: str) -> None:
        self.events.append((time.monotonic(), kind))

    async def _run(self) -> None:
        for _ in range(1000):  # reconnects, bounded
            self.ready.set()
            try:
                await self._gateway.watch(self._key, self._on)
            except EtcdUnavailable:
                await asyncio.sleep(0.05)

    def first(self, kind: str, after: float) -> float | None:
        """The first ``kind`` change at or after ``after`` (monotonic s), or None."""
        return next((t for t, k in self.events if k == kind and t >= after), None)

    async def close(self) -> None:
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        await self._gateway.close()


async def _waiting_client(addresses: list[str], name: str, ttl_s: float, started: asyncio.Event) -> float:
    """Connect before the kill; at ``started`` (the kill) ask for the free lock ``name``
    and ride the failover through; the monotonic time (s) of the grant."""
    async with fastlock.connect(*addresses, client_name="etcd-failover-waiter", failover_timeout=30) as client:
        await started.wait()
        lease = await client.acquire(name, ttl=ttl_s, wait=30)
        granted = time.monotonic()
        await client.release(lease)
        return granted


def _ms(t: float | None, since: float) -> float | None:
    return None if t is None else round((t - since) * 1000)


def _summary(values: list[float | None]) -> dict[str, float] | None:
    seen = [v for v in values if v is not None]
    return {"median": statistics.median(seen), "max": max(seen), "count": len(seen)} if seen else None


async def run(args: argparse.Namespace, log) -> dict[str, Any]:
    root = tempfile.mkdtemp(prefix="fastlock-etcd-bench-")
    etcd = EtcdServer().start()
    cluster = Cluster(root)
    watch: KeyWatch | None = None
    try:
        prefix = unique_prefix()
        url = f"etcd://{etcd.address}{prefix}"
        extra = ["--promotion-grace", str(args.promotion_grace)] if args.promotion_grace is not None else []
        if args.replication == "sync":
            extra += ["--replication", "sync", "--sync-standbys", str(args.sync_standbys)]
        nodes = {}
        for name in ("a", "b", "c"):
            nodes[name] = cluster._start(ServerProcess(
                os.path.join(root, name), args=["--name", name, *cluster.auth_args(name), "--coordinator", url,
                                                "--node-id", name, "--coordinator-ttl", str(args.ttl), *extra],
                log_level=args.log_level,
                log_path=os.path.join(args.logs, f"{name}.log") if args.logs else None))
        ttl_ms = round(args.lock_ttl * 1000)
        watch = KeyWatch(etcd.address, f"{prefix}/primary")
        await watch.ready.wait()
        to_primary, to_grant = [], []
        breakdown: dict[str, list[float | None]] = {"deleted": [], "taken": [], "promoted": [], "granted": [],
                                                    "client": []}
        last_token = last_epoch = 0
        acked = missing = graceless = 0
        if args.preload:
            name, _ = await _primary(nodes, 30)
            await _standbys_follow(nodes, name, 30)
            await _preload(nodes[name].address, args.preload, 3_600_000)
            log(f"{args.preload} locks taken on {name} (TTL 1 h)")
        for i in range(args.kills):
            name, st = await _primary(nodes, 30)
            await _standbys_follow(nodes, name, 30)
            if args.replication == "sync":
                await _in_sync(nodes[name].address, args.sync_standbys, 30)
            token = await _grant(nodes[name].address, f"held-{i}", ttl_ms, 30)
            assert token > last_token and st["epoch"] >= last_epoch, (token, last_token, st["epoch"], last_epoch)
            last_token, last_epoch = token, st["epoch"]
            load = Load(nodes[name].address, args.load, i) if args.load else None
            kill_now = asyncio.Event()
            waiter = asyncio.ensure_future(_waiting_client([s.address for s in nodes.values()], f"waiting-{i}",
                                                           args.lock_ttl, kill_now))
            await asyncio.sleep(0.3)  # the load runs before and through the kill; the waiter connects
            nodes[name].kill()
            killed = time.monotonic()
            killed_wall = time.time()
            kill_now.set()
            rest = {n: s for n, s in nodes.items() if n != name}
            new, st2 = await _primary(rest, 30)
            t_role = time.monotonic() - killed
            token2 = await _grant(nodes[new].address, f"free-{i}", ttl_ms, 30)
            t_grant = time.monotonic() - killed
            graceless += st2.get("grace_remaining_ms", 1) == 0
            try:
                client_at: float | None = await asyncio.wait_for(waiter, 40)
            except Exception as exc:  # noqa: BLE001 - reported, the bench goes on
                log(f"  the waiting client failed: {type(exc).__name__}: {exc}")
                client_at = None
            deleted = watch.first("DELETE", killed)
            parts = {"deleted": _ms(deleted, killed),
                     "taken": _ms(watch.first("PUT", deleted if deleted is not None else killed), killed),
                     "promoted": round(t_role * 1000), "granted": round(t_grant * 1000),
                     "client": _ms(client_at, killed)}
            for key, value in parts.items():
                breakdown[key].append(value)
            if load is not None:
                await load.stop()
                lost = await _missing(nodes[new].address, load.acked)
                acked += len(load.acked)
                missing += len(lost)
                if lost:
                    log(f"  MISSING on {new}: {lost[:5]}")
                last_token = max([last_token] + [t for _, t in load.acked])
            assert st2["epoch"] > last_epoch and token2 > last_token, (st2["epoch"], last_epoch, token2, last_token)
            last_token, last_epoch = token2, st2["epoch"]
            to_primary.append(t_role * 1000)
            to_grant.append(t_grant * 1000)
            log(f"kill {i + 1}: {name} -> {new} primary after {t_role * 1000:.0f} ms, first free grant after "
                f"{t_grant * 1000:.0f} ms (epoch {st2['epoch']}, grace {st2.get('grace_remaining_ms')} ms"
                + (f", {len(load.acked)} acknowledged grants checked)" if load is not None else ")"))
            killed_at = time.strftime("%H:%M:%S", time.gmtime(killed_wall)) + f".{int(killed_wall % 1 * 1000):03d}"
            log("  ms after the kill: " + ", ".join(f"{k} {v}" for k, v in parts.items())
                + f" (killed at {killed_at} UTC)")
            nodes[name] = cluster.restart(nodes[name])
        return {
            "kills": args.kills, "etcd_ttl_s": args.ttl, "lock_ttl_s": args.lock_ttl,
            "promotion_grace_s": args.promotion_grace, "replication": args.replication,
            "sync_standbys": args.sync_standbys if args.replication == "sync" else None, "load_clients": args.load,
            "acknowledged_grants_checked": acked, "acknowledged_grants_missing": missing,
            "promotions_without_grace": graceless,
            "kill_to_primary_ms": {"median": statistics.median(to_primary), "max": max(to_primary)},
            "kill_to_first_grant_ms": {"median": statistics.median(to_grant), "max": max(to_grant)},
            "breakdown_ms": {key: _summary(values) for key, values in breakdown.items()},
            "after_deleted_ms": {
                key: _summary([None if v is None or d is None else v - d
                               for v, d in zip(breakdown[key], breakdown["deleted"])])
                for key in ("taken", "promoted", "granted", "client")},
        }
    except BaseException:
        for name, srv in (locals().get("nodes") or {}).items():  # what each node said, for the post-mortem
            log(f"--- node {name} ({srv.address}), last 80 log lines:\n" + "\n".join(srv.lines[-80:]))
        raise
    finally:
        if watch is not None:
            await watch.close()
        cluster.stop_all()
        etcd.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benches.etcd_failover", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kills", type=int, default=20)
    ap.add_argument("--ttl", type=int, default=2, help="etcd lease TTL, whole seconds (default 2)")
    ap.add_argument("--lock-ttl", type=float, default=1.0, help="TTL of the locks taken, seconds (default 1)")
    ap.add_argument("--promotion-grace", type=float, default=None,
                    help="the nodes' --promotion-grace (default: theirs, the longest TTL seen)")
    ap.add_argument("--replication", choices=("async", "sync"), default="async",
                    help="the nodes' --replication (default async)")
    ap.add_argument("--sync-standbys", type=int, default=1, help="with --replication sync, the nodes' --sync-standbys")
    ap.add_argument("--load", type=int, default=0, metavar="N",
                    help="N clients taking locks through each kill; their acknowledged grants are checked")
    ap.add_argument("--json", metavar="PATH")
    ap.add_argument("--preload", type=int, default=0, metavar="N",
                    help="N locks (TTL 1 h) taken before the first kill: a table of more than 10,000 leases "
                         "reaches a re-following standby as a snapshot streamed after its attach")
    ap.add_argument("--logs", metavar="DIR", help="append each node's log to DIR/<node>.log (kept after the run)")
    ap.add_argument("--log-level", default="INFO", help="the nodes' --log-level (default INFO)")
    args = ap.parse_args(argv)
    result = asyncio.run(run(args, lambda msg: print(msg, flush=True)))
    print_result(result, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
