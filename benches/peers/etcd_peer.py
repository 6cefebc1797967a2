"""etcd: lease + the v3 Lock service (``Lock``/``Unlock``), via etcd's JSON gateway.

The client is aiohttp against etcd's gRPC-JSON gateway (``/v3/lease/grant``,
``/v3/lock/lock``, ...) with one keep-alive HTTP connection per client.  The
gateway costs etcd some CPU (JSON <-> protobuf) that a native gRPC client would
not; the Python gRPC etcd clients were not used because the classic ``etcd3``
package does not work with current protobuf.

Two recipes, named in the results:

- ``etcd lease/acquire``: a fresh lease per acquisition (grant TTL, Lock with
  it, release by revoking the lease, which deletes the lock key): 3 round trips
  per pair.
- ``etcd lease/client``: one lease per client, granted when the client starts
  (TTL longer than the run, so no keep-alive is needed inside it) and revoked
  at the end; Lock/Unlock per pair: 2 round trips.

Fencing token: the revision in the Lock response header.  The lock key is
created at a revision after the previous holder's key was deleted, so the
revision strictly increases across grants of one lock.  The waiter blocks in
the server (it watches the key created just before its own): FIFO, no polling.
etcd fsyncs its raft log on every write (no knob in 3.4), so it is
durability-matched with fastlock ``--fsync always``.
"""

from __future__ import annotations

import asyncio
import base64
import os
import shutil
import time

from benches import harness


def _b64(s: str | bytes) -> str:
    return base64.b64encode(s.encode() if isinstance(s, str) else s).decode()


class EtcdSession(harness.Session):
    def __init__(self, http, base: str, per_client_lease: bool) -> None:
        self.http = http
        self.base = base
        self.per_client_lease = per_client_lease
        self.client_lease: str | None = None
        self.held: dict[str, tuple[str, str]] = {}   # name -> (lock key, lease id)
        self.round_trips = 0
        self.wasted = 0

    async def _post(self, path: str, body: dict) -> dict:
        self.round_trips += 1
        async with self.http.post(self.base + path, json=body) as resp:
            data = await resp.json(content_type=None)
            if resp.status != 200 or "error" in data:
                raise RuntimeError(f"etcd {path}: HTTP {resp.status}: {data}")
            return data

    async def _grant(self, ttl: float) -> str:
        return (await self._post("/v3/lease/grant", {"TTL": int(ttl)}))["ID"]

    async def start(self) -> None:
        if self.per_client_lease:
            self.client_lease = await self._grant(600)

    async def acquire(self, name: str) -> int:
        lease = self.client_lease or await self._grant(harness.DEFAULT_TTL)
        r = await self._post("/v3/lock/lock", {"name": _b64(name), "lease": lease})
        self.held[name] = (r["key"], lease)
        return int(r["header"]["revision"])

    async def release(self, name: str) -> None:
        key, lease = self.held.pop(name)
        if self.per_client_lease:
            await self._post("/v3/lock/unlock", {"key": key})
        else:
            await self._post("/v3/lease/revoke", {"ID": lease})

    async def close(self) -> None:
        try:
            if self.client_lease:
                await self._post("/v3/lease/revoke", {"ID": self.client_lease})
        finally:
            await self.http.close()


class EtcdTarget(harness.Target):
    system = "etcd"
    fencing = True
    polling = False

    def __init__(self, *, per_client_lease: bool = False) -> None:
        super().__init__()
        self.per_client_lease = per_client_lease
        self.name = "etcd lease/client" if per_client_lease else "etcd lease/acquire"
        self.notes = ("one lease per client, Lock+Unlock" if per_client_lease
                      else "a lease per acquisition: grant+Lock, release = revoke") + \
            "; JSON gateway over HTTP/1.1 (aiohttp); revision as fencing token; fsync per write"
        self.port: int | None = None

    def describe(self):
        d = super().describe()
        d["lease"] = "per-client" if self.per_client_lease else "per-acquisition"
        return d

    def start(self) -> None:
        d = self.make_tmpdir()
        self.port, peer = harness.free_port(), harness.free_port()
        client_url, peer_url = f"http://127.0.0.1:{self.port}", f"http://127.0.0.1:{peer}"
        argv = [shutil.which("etcd") or "etcd", "--name", "bench", "--data-dir", os.path.join(d, "data"),
                "--listen-client-urls", client_url, "--advertise-client-urls", client_url,
                "--listen-peer-urls", peer_url, "--initial-advertise-peer-urls", peer_url,
                "--initial-cluster", f"bench={peer_url}", "--initial-cluster-state", "new",
                "--logger", "zap", "--log-outputs", "stderr", "--log-level", "warn"]
        srv = harness.ServerProcess("etcd", argv, log_path=os.path.join(d, "etcd.log"), cwd=d,
                                    env=dict(os.environ,
                                             ETCD_UNSUPPORTED_ARCH=os.environ.get("ETCD_UNSUPPORTED_ARCH", "")))
        self.servers.append(srv)
        srv.start(ready_port=self.port)
        harness.run_async(self._wait_leader(), use_uvloop=False)

    async def _wait_leader(self) -> None:
        import aiohttp
        deadline = time.monotonic() + harness.READY_TIMEOUT
        async with aiohttp.ClientSession() as http:
            while True:
                try:
                    async with http.post(f"http://127.0.0.1:{self.port}/v3/kv/put",
                                         json={"key": _b64("bench/ready"), "value": _b64("1")}) as r:
                        if r.status == 200:
                            return
                except aiohttp.ClientError:
                    pass
                if time.monotonic() > deadline:
                    raise TimeoutError("etcd did not accept a write")
                await asyncio.sleep(0.1)

    async def open(self, idx: int) -> harness.Session:
        import aiohttp
        http = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1, force_close=False),
                                     timeout=aiohttp.ClientTimeout(total=harness.DEFAULT_WAIT + 5))
        s = EtcdSession(http, f"http://127.0.0.1:{self.port}", self.per_client_lease)
        await s.start()
        return s
