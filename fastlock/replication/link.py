"""The standby's connection to its primary: connect, prove each other, follow.

:class:`PrimaryLink` connects (over TLS when configured) and says HELLO: the
standby proves its replica token without sending it, and the primary proves
it holds the same credential, bound to this exchange, to the standby's node
id as the client and to its own node id as the server
(:mod:`fastlock.auth.handshake`).  Nothing the primary says - its epoch, its
snapshot, its records - is believed before its proof checks out; a node that
names this standby's own node id is refused (a relayed handshake), and so is,
at the same address, a node other than the one that proved itself there
before (a relay to another node holding the credentials).  The link
then refuses a primary at a lower
epoch than this node's (and asks it to step down), asks for the stream with
``REPLICATE``, and hands every push to its
:class:`~fastlock.replication.follower.StandbyFollower`; after each read it
acknowledges with ``REPL_ACK``.  A lost connection is retried with backoff.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import ssl
from typing import TYPE_CHECKING, Any

from .. import protocol as P
from ..auth import ClientHandshake, ServerNotProven, say_hello, secret_of, token_principal
from ..errors import AuthError, FastlockError, NotPrimary, PermissionDenied, ProtocolError, Unavailable
from ..logsafe import quote
from ..protocol import rpc

if TYPE_CHECKING:  # pragma: no cover
    from .follower import StandbyFollower

log = logging.getLogger("fastlock.replication")

#: seconds after the link starts (is pointed at a primary) during which a node that refuses
#: to be followed (not the primary yet: etcd named it and it is still promoting) is asked
#: again every :data:`FRESH_RETRY_S` seconds, not at the doubling backoff: the first
#: synchronous grant of a new group primary waits for a standby to attach
FRESH_TARGET_S = 3.0
FRESH_RETRY_S = 0.025


class PrimaryLink:
    """One standby's connection to its primary, re-made whenever it drops.

    Args:
        follower: what applies the stream and keeps the standby's position.
        primary: ``(host, port)`` of the primary.
        tls: client TLS context (verifies the primary, carries this node's
            certificate), or None for plain TCP; a new one is used from the next
            connection on.
        token: this standby's replica token, or None (mutual TLS identifies it).
        name: ``[label@]node-id`` this standby announces.
        stream_limits: what the primary's stream may hold.
    """

    def __init__(self, follower: StandbyFollower, primary: tuple[str, int], tls: ssl.SSLContext | None,
                 token: str | None, name: str | None, stream_limits: P.DecodeLimits):
        self.follower = follower
        self.primary = primary
        self.tls = tls
        #: what this standby proves (from its replica token; None: mutual TLS identifies it)
        self.secret = secret_of(token) if token else None
        #: the replica principal this standby authenticates as (from its token, or the
        #: primary's HELLO answer over mutual TLS)
        self.principal = token_principal(token) if token else None
        self.name = name
        #: this node's id (the part of ``name`` after "@"): a server naming it is this node itself
        self.own_node = name.rpartition("@")[2] if name else None
        #: (address, node id) of the primary that last proved itself: a reconnect to that address
        #: expects that node (a relay to another node holding the credentials is refused)
        self.proven: tuple[tuple[str, int], str] | None = None
        self.stream_limits = stream_limits
        self._not_primary_yet = False  # the last HELLO was refused as NotPrimary (not a credential refusal)
        self.connected = False
        self._rpc: rpc.RpcConnection | None = None
        self._task: asyncio.Task | None = None
        self._stopping = False
        self._ack_id = 0  # the request id every REPL_ACK on the connection carries (acks get no reply)
        self.ack_due = False  # a push arrived since the last acknowledgement
        self._said: dict[str, str] = {}  # problems that do not fix themselves, logged once: kind -> message
        #: ``host:port`` where this node serves clients, announced in REPLICATE so that the primary,
        #: restarted or resumed after a failover, can find this node (None: not announced)
        self.advertise: str | None = None
        self._announce = True  # False once a primary refused REPLICATE's fifth argument (an older one)
        #: the witness this node asks before promoting (``--witness`` as ``host:port``), announced in
        #: REPLICATE's sixth argument: the primary counts its witness lease only for such a standby
        self.witness: str | None = None

    @property
    def address(self) -> str:
        return f"{self.primary[0]}:{self.primary[1]}"

    @property
    def is_open(self) -> bool:
        """Is a connection to the primary open (maybe still in its handshake)?"""
        return self._rpc is not None and not self._rpc.closed

    @property
    def stopping(self) -> bool:
        """Was :meth:`stop` called (and :meth:`start` not since)?"""
        return self._stopping

    @property
    def stopped(self) -> bool:
        """Is this link not following (never started, or stopped)?"""
        return self._task is None or self._task.done() or self._stopping

    def start(self) -> None:
        self._stopping = False
        self._task = asyncio.ensure_future(self._run())

    def stop(self) -> None:
        self._stopping = True
        if self._rpc is not None:
            self._rpc.close()
        if self._task is not None:
            self._task.cancel()

    async def request(self, timeout_s: float, op: int, *args: Any) -> Any:
        """Send a request on the current connection and wait for its answer.

        :raises ConnectionError: not connected.
        :raises asyncio.TimeoutError, FastlockError: as the request.
        """
        link = self._rpc
        if link is None or link.closed:
            raise ConnectionError("not connected to the primary")
        return await asyncio.wait_for(link.request(op, *args), timeout_s)

    def _on_read_end(self) -> None:
        """One acknowledgement per read, however many batches it held."""
        link = self._rpc
        follower = self.follower
        if self.ack_due and follower.last_hb_primary_ms and link is not None and not link.closed:
            self.ack_due = False
            link.write_raw(P.encode_request(self._ack_id, P.OP_REPL_ACK, follower.last_hb_primary_ms,
                                            follower.applied_lsn))

    def send_sync_ack(self, lsn: int) -> None:
        """Tell the primary this standby has records up to ``lsn`` at its sync ack point."""
        link = self._rpc
        if link is not None and not link.closed:
            link.write_raw(P.encode_request(self._ack_id, P.OP_SYNC_ACK, lsn))

    def _say_once(self, kind: str, message: str) -> bool:
        """True the first time ``message`` is reported for ``kind`` (until a connection succeeds)."""
        if self._said.get(kind) == message:
            return False
        self._said[kind] = message
        return True

    async def _run(self) -> None:
        follower = self.follower
        backoff = 0.05
        loop = asyncio.get_running_loop()
        fresh_until = loop.time() + FRESH_TARGET_S  # at most FRESH_TARGET_S / FRESH_RETRY_S quick retries

        def refused_pause() -> float:
            return min(backoff, FRESH_RETRY_S) if loop.time() < fresh_until else backoff

        while not self._stopping:
            lost = loop.create_future()

            def on_close(_conn: rpc.RpcConnection, error: Exception, lost: asyncio.Future = lost) -> None:
                if not lost.done():
                    lost.set_result(error)

            tls = self.tls
            address = self.primary
            try:
                _, link = await asyncio.wait_for(loop.create_connection(
                    functools.partial(rpc.RpcConnection, address, max_frame=None, limits=self.stream_limits,
                                      on_push=follower.on_push,
                                      on_read_end=self._on_read_end, on_close=on_close),
                    *address, ssl=tls, server_hostname=address[0] if tls else None,
                    ssl_handshake_timeout=5.0 if tls else None), 5.0)
            except (OSError, asyncio.TimeoutError) as exc:
                if isinstance(exc, ssl.SSLError) and self._say_once("tls", str(exc)):
                    # a certificate problem does not fix itself: say it once, not every retry
                    log.error("TLS handshake with primary %s failed: %s", self.address, exc)
                log.debug("cannot reach primary %s: %s", self.address, exc)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 1.0)
                continue
            self._rpc = link
            self._ack_id = link.next_id()
            host = follower.host
            try:
                hello = await self._hello(link)
                if hello is None:
                    link.close()
                    await asyncio.sleep(refused_pause() if self._not_primary_yet else backoff)
                    backoff = min(backoff * 2, 5.0)
                    continue
                if self.principal is None and type(hello.get("principal")) is str:
                    self.principal = hello["principal"]  # authenticated by our certificate
                their_epoch = P.check_epoch(hello.get("epoch", 0), "primary's epoch")
                follower.primary_epoch = max(follower.primary_epoch, their_epoch)
                host.node_state.raise_epoch(follower.primary_epoch)
                if their_epoch < host.table.epoch:
                    # this node was promoted since it last followed that node: never follow
                    # a lower epoch, and ask it to step down (it may still think it is primary)
                    follower.refused = (f"{self.address} is at epoch {their_epoch}, below this "
                                    f"node's epoch {host.table.epoch}: it is a deposed primary")
                    log.critical("refusing to follow: %s; this node's data is the newer: make it the primary "
                                 "with `fastlock promote --force --server <this node>` (with --failover-after "
                                 "it promotes itself once that node has stepped down; a restart without "
                                 "--standby-of follows the same node, named in node-state.json), or point it "
                                 "at the current primary", follower.refused)
                    deposed = hello.get("role") == "deposed"
                    if hello.get("role") == "primary":
                        try:
                            answer = await asyncio.wait_for(link.request(P.OP_STEP_DOWN, host.table.epoch,
                                                                         hello.get("clock_ms")), 5.0)
                            deposed = type(answer) is dict and answer.get("role") == "deposed"
                        except (ConnectionError, asyncio.TimeoutError, FastlockError) as exc:
                            log.error("%s did not step down for epoch %d: %s", self.address,
                                      host.table.epoch, exc)
                    link.close()
                    if deposed and follower.failover_after_ms > 0 and follower.on_primary_silent is not None:
                        # A pair's node at a higher epoch than the node it is told to follow was promoted
                        # (restarted with its original --standby-of): that node grants nothing (deposed,
                        # durably), so this one is the pair's primary again, as after a silent primary.
                        log.warning("%s is deposed at epoch %d, below this node's epoch %d: promoting this "
                                    "node again (--failover-after); the deposed node rejoins it as its standby",
                                    self.address, their_epoch, host.table.epoch)
                        follower.on_primary_silent()
                    return
                follower.sync.reset()  # not in sync with this connection until its primary says so
                args = [follower.applied_lsn + 1 if follower.synced else 0, follower.incarnation,
                        follower.failover_after_ms, self.name]
                announced = self._announce and (self.advertise is not None or self.witness is not None)
                if announced:
                    args.append(self.advertise)
                    if self.witness is not None:
                        args.append(self.witness)
                try:
                    info = await asyncio.wait_for(link.request(P.OP_REPLICATE, *args), 5.0)
                except ProtocolError:
                    if announced:
                        self._announce = False  # a primary without the announced address: retry without
                    raise
                self.connected = True
                self._said.clear()
                backoff = 0.05
                log.info("replicating from %s (%s)", self.address, quote(info.get("mode")))
                await lost
            except (ConnectionError, asyncio.TimeoutError, FastlockError) as exc:
                if isinstance(exc, (AuthError, PermissionDenied)):
                    # credentials do not fix themselves: say it once, not on every retry
                    if self._say_once("credentials", str(exc)):
                        log.error("primary %s refused this standby's credentials: %s (retrying)",
                                  self.address, quote(str(exc)))
                elif not isinstance(exc, (NotPrimary, Unavailable)) or self._say_once("refused", str(exc)):
                    # (a refusal is said once: a promoting node is asked again every FRESH_RETRY_S)
                    log.warning("replication from %s failed: %s", self.address, quote(str(exc)))
                link.close()
                await asyncio.sleep(refused_pause() if isinstance(exc, (NotPrimary, Unavailable)) else backoff)
                backoff = min(backoff * 2, 1.0)
            finally:
                self.connected = False
                self._rpc = None
            if not self._stopping:
                log.warning("lost the replication connection to %s", self.address)

    async def _hello(self, link: rpc.RpcConnection) -> dict | None:
        """The primary's hello info once it proved itself (None: it did not; logged, and
        ``follower.refused`` says why until a primary does)."""
        follower = self.follower
        proven = self.proven
        self._not_primary_yet = False
        handshake = ClientHandshake(self.secret, role="replica" if self.secret is not None else None,
                                    own_node=self.own_node,
                                    expect_node=proven[1] if proven is not None and proven[0] == self.primary else None)
        try:
            hello = await asyncio.wait_for(
                say_hello(link, f"standby:{self.name or os.getpid()}", handshake, follower.host.table.epoch), 5.0)
            if self.own_node is not None and hello.get("node") == self.own_node:
                raise ServerNotProven(f"the server is this node itself (node id {self.own_node})")
            if handshake.expect_node is not None and hello.get("node") != handshake.expect_node:
                raise ServerNotProven(f"the server is node {hello.get('node')}, not the expected node "
                                      f"{handshake.expect_node}")
        except NotPrimary as exc:  # a standby or a deposed node authenticates no replica
            self._not_primary_yet = True  # (it may be about to promote: asked again soon, see FRESH_TARGET_S)
            follower.refused = f"{self.address} is not a primary: {exc}"
            if self._say_once("not primary", str(exc)):
                log.error("not following %s: %s (retrying)", self.address, quote(str(exc)))
            return None
        except AuthError as exc:
            # a refused proof and a missing one look alike from here (as in SCRAM): either the
            # server does not hold this standby's credential, or this standby's is not the server's
            why = str(exc) if isinstance(exc, ServerNotProven) else f"it refused this standby's proof ({exc})"
            message = f"{self.address} could not prove that it holds this standby's credential: {why}"
            if follower.refused != message:
                log.critical("not following %s: it could not prove that it holds this standby's credential "
                             "(replica principal %s), an impostor or a different credentials file: %s",
                             self.address, self.principal, quote(why))
            follower.refused = message
            return None
        if follower.refused is not None and "could not prove" in follower.refused:
            follower.refused = None
        node = hello.get("node")
        if type(node) is str and node:
            self.proven = (self.primary, node)
        return hello
