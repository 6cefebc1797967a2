"""ZooKeeper: kazoo's ``Lock`` recipe (ephemeral sequential node + watch on the predecessor).

kazoo is a threaded client, so this peer runs each simulated client in its own
OS thread with its own ``KazooClient`` (one TCP session each; kazoo adds a
connection thread per client).  The harness measures it exactly like the
asyncio peers, but the Python client pays for the GIL and thread switches:
read the client CPU column.

Fencing token: the sequence number of the lock's sequential node, which the
parent node's counter makes strictly increasing per lock.  FIFO by sequence
number, each waiter woken only by its predecessor's deletion: no polling.  An
acquire costs several ZooKeeper requests (create, get_children, and an exists
watch when it has to wait); a release is one delete.  ZooKeeper fsyncs its
transaction log before acknowledging a write (``forceSync=yes``, default).
"""

from __future__ import annotations

import os
import time

from benches import harness
from benches.peers.install import ZOOKEEPER_JAR, _java

LOG4J = """log4j.rootLogger=WARN, CONSOLE
log4j.appender.CONSOLE=org.apache.log4j.ConsoleAppender
log4j.appender.CONSOLE.layout=org.apache.log4j.PatternLayout
log4j.appender.CONSOLE.layout.ConversionPattern=%d{ISO8601} %-5p %c{1}: %m%n
"""


class KazooSession(harness.SyncSession):
    def __init__(self, port: int, idx: int) -> None:
        from kazoo.client import KazooClient
        self.zk = KazooClient(hosts=f"127.0.0.1:{port}", timeout=10.0)
        self.zk.start(timeout=15)
        self.idx = idx
        self.locks: dict[str, object] = {}
        self.round_trips = 0
        self.wasted = 0

    def acquire(self, name: str) -> int:
        lock = self.locks.get(name)
        if lock is None:
            lock = self.locks[name] = self.zk.Lock(f"/bench/{name}", identifier=f"client-{self.idx}")
        self.round_trips += 1
        if not lock.acquire(timeout=harness.DEFAULT_WAIT):
            raise TimeoutError(f"kazoo Lock {name!r} not acquired in {harness.DEFAULT_WAIT} s")
        return int(lock.node[-10:])

    def release(self, name: str) -> None:
        self.round_trips += 1
        self.locks[name].release()

    def close(self) -> None:
        try:
            self.zk.stop()
        finally:
            self.zk.close()


class ZookeeperTarget(harness.Target):
    name = "zookeeper kazoo Lock"
    system = "zookeeper"
    fencing = True
    polling = False
    threaded = True
    notes = "kazoo Lock (threads, one KazooClient per client); node sequence number as fencing token; fsync per write"

    def __init__(self) -> None:
        super().__init__()
        self.port: int | None = None

    def start(self) -> None:
        java = _java()
        if java is None or not os.path.exists(ZOOKEEPER_JAR):
            raise RuntimeError("ZooKeeper needs java and the Debian package zookeeper")
        d = self.make_tmpdir()
        conf = os.path.join(d, "conf")
        os.makedirs(conf)
        os.makedirs(os.path.join(d, "data"))
        self.port = harness.free_port()
        cfg = os.path.join(conf, "zoo.cfg")
        with open(cfg, "w") as f:
            f.write(f"tickTime=2000\ndataDir={d}/data\nclientPort={self.port}\nclientPortAddress=127.0.0.1\n"
                    "maxClientCnxns=0\nadmin.enableServer=false\n4lw.commands.whitelist=ruok,srvr,mntr\n"
                    "autopurge.purgeInterval=0\n")
        with open(os.path.join(conf, "log4j.properties"), "w") as f:
            f.write(LOG4J)
        argv = [java, "-Xms256m", "-Xmx512m", "-Dzookeeper.admin.enableServer=false",
                f"-Dlog4j.configuration=file:{conf}/log4j.properties",
                "-cp", f"{conf}:{ZOOKEEPER_JAR}", "org.apache.zookeeper.server.quorum.QuorumPeerMain", cfg]
        srv = harness.ServerProcess("zookeeper", argv, log_path=os.path.join(d, "zookeeper.log"), cwd=d)
        self.servers.append(srv)
        srv.start(ready_port=self.port, timeout=60)
        self._wait_serving()

    def _wait_serving(self) -> None:
        import socket
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                with socket.create_connection((harness.LOOPBACK, self.port), timeout=2) as s:
                    s.sendall(b"ruok")
                    if s.recv(16) == b"imok":
                        return
            except OSError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"zookeeper not serving: {self.servers[-1].tail()}")

    def open_sync(self, idx: int) -> harness.SyncSession:
        return KazooSession(self.port, idx)
