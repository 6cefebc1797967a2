"""A pair node's side of the witness (``serve --witness ADDR``): see :mod:`fastlock.replication.witness`.

:class:`WitnessLink` asks the witness for the lease of an epoch over one
connection (re-made when it drops), proving this node's replica token
(:mod:`fastlock.auth.handshake`: no secret on the wire) and checking that the
server proves it holds the same credentials file, answers as a witness, is
not this node itself, and is the node that proved itself at that address
before; a node run with ``--tls-cert`` speaks TLS to the witness (see
:mod:`fastlock.replication.witness`).  Each answer comes back as a :class:`WitnessAnswer` (never an
exception for what the witness or the network does).

:class:`PrimaryWitnessLease` runs on every node: while the node is the
primary it renews the lease of its epoch at the heartbeat interval and hands
each grant to the replication source, whose fence then stays open until
``sent + lease_ms - margin`` (the same margin as the standby fence) even when
the standby is silent.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from typing import TYPE_CHECKING, Any, NamedTuple

from .. import protocol as P
from ..auth import ClientHandshake, say_hello, secret_of, token_principal
from ..errors import FastlockError, Unavailable
from ..protocol import rpc
from ..roles import Role
from ..units import monotonic_ms
from .messages import heartbeat_interval_ms
from .syncrep import SyncGate
from .witness import MAX_LEASE_MS, MIN_LEASE_MS, OP_WITNESS_LEASE, WITNESS_SERVER

if TYPE_CHECKING:  # pragma: no cover
    from .host import ReplicationHost
    from .source import ReplicationSource

log = logging.getLogger("fastlock.replication")

#: bound of one connect, handshake or lease request to the witness (seconds)
WITNESS_TIMEOUT_S = 1.0


class WitnessAnswer(NamedTuple):
    """One answer of the witness: ``granted`` the lease for ``asked`` epoch or not, its vote
    (``epoch``, ``holder``) and lease time left (``remaining_ms``, ms, witness clock),
    ``sent_ms`` (this node's monotonic ms when the request left), or ``error`` (why there
    is no answer: unreachable, not proven...; the other fields are then 0/None); the
    holders' word on their standby (``out_of_sync``, ``previous_out_of_sync``) and the
    longest TTL they reported (``max_ttl_ms``, ``previous_max_ttl_ms``, ms)."""

    asked: int
    granted: bool
    epoch: int
    holder: str | None
    remaining_ms: int
    sent_ms: int
    error: str | None
    out_of_sync: bool = False
    previous_out_of_sync: bool = False
    max_ttl_ms: int = 0
    previous_max_ttl_ms: int = 0


class WitnessVerdict(NamedTuple):
    """What a promotion learns from the witness's vote about the old primary: whether it
    said its standby was out of sync, and the longest lease TTL it reported (ms)."""

    out_of_sync: bool
    max_ttl_ms: int


def _ttl_of(reply: dict, key: str) -> int:
    value = reply.get(key)
    return value if type(value) is int and 0 <= value <= P.MAX_RECORDED_TTL_MS else 0


class WitnessLink:
    """This node's connection to the witness.

    Args:
        address: ``(host, port)`` of the witness.
        token: this node's replica token (``--standby-token-file``).
        node: this node's id (the witness records ``<principal>/<node>`` as a lease's holder).
        tls: the client TLS context that verifies the witness (and carries this node's
            certificate), as the standby's link to its primary has; None: plain TCP.
    """

    def __init__(self, address: tuple[str, int], token: str, node: str, tls: ssl.SSLContext | None = None):
        self.address = address
        self.tls = tls
        self.secret = secret_of(token)
        self.principal = token_principal(token)
        self.node = node
        self.proven: str | None = None  # the witness's node id, once it proved itself
        self.last: WitnessAnswer | None = None
        #: the last probe's failure (None: it answered, or no probe yet)
        self.probed: str | None = None
        self._conn: rpc.RpcConnection | None = None
        self._lock = asyncio.Lock()

    @property
    def where(self) -> str:
        return f"{self.address[0]}:{self.address[1]}"

    async def _connect(self) -> rpc.RpcConnection:
        conn = await rpc.open_connection(*self.address, timeout=WITNESS_TIMEOUT_S, ssl=self.tls)
        try:
            handshake = ClientHandshake(self.secret, role="replica", own_node=self.node, expect_node=self.proven)
            hello = await asyncio.wait_for(say_hello(conn, f"witness-of:{self.node}", handshake), WITNESS_TIMEOUT_S)
            if hello.get("server") != WITNESS_SERVER:
                raise FastlockError(f"{self.where} is not a fastlock witness (it answers as {hello.get('server')!r})")
        except BaseException:
            conn.close()
            raise
        self.proven = handshake.server_node
        return conn

    async def lease(self, epoch: int, lease_ms: int, out_of_sync: bool = False,
                    max_ttl_ms: int = 0) -> WitnessAnswer:
        """Ask for (or renew) the lease of ``epoch`` for ``lease_ms`` (ms, clamped to the
        witness's bounds), saying whether this node's standby may lack grants it acknowledged
        (``out_of_sync``) and the longest lease TTL it has granted (``max_ttl_ms``, ms).
        Never raises for what the witness or the network does."""
        lease_ms = max(MIN_LEASE_MS, min(MAX_LEASE_MS, lease_ms))
        async with self._lock:
            sent = monotonic_ms()
            try:
                if self._conn is None or self._conn.closed:
                    self._conn = None
                    self._conn = await self._connect()
                    sent = monotonic_ms()  # the lease counts from the request, not the connect
                reply: Any = await asyncio.wait_for(self._conn.request(OP_WITNESS_LEASE, epoch, lease_ms, out_of_sync,
                                                                       max_ttl_ms),
                                                    WITNESS_TIMEOUT_S)
                if (not isinstance(reply, dict) or type(reply.get("granted")) is not bool
                        or type(reply.get("epoch")) is not int or type(reply.get("remaining_ms")) is not int):
                    raise FastlockError(f"malformed witness answer {type(reply).__name__}")
                answer = WitnessAnswer(epoch, reply["granted"], reply["epoch"],
                                       reply.get("holder") if isinstance(reply.get("holder"), str) else None,
                                       max(0, reply["remaining_ms"]), sent, None,
                                       reply.get("out_of_sync") is True, reply.get("previous_out_of_sync") is True,
                                       _ttl_of(reply, "max_ttl_ms"), _ttl_of(reply, "previous_max_ttl_ms"))
            except (OSError, asyncio.TimeoutError, FastlockError) as exc:
                if self._conn is not None:
                    self._conn.close()
                    self._conn = None
                answer = WitnessAnswer(epoch, False, 0, None, 0, sent, f"{type(exc).__name__}: {exc}")
        self.last = answer
        return answer

    async def vote(self, epoch: int, window_ms: int, *, required: bool) -> WitnessVerdict:
        """A promotion's vote: take the witness's lease for ``epoch`` (see
        :mod:`fastlock.replication.witness`) for ``window_ms`` (ms).  The witness grants it
        only once the old primary's lease has expired, so it is asked again after the time it
        says is left, for at most two windows and a second.  ``required`` False (the old
        primary confirmed stepping down, or the promotion is forced): one try, and a refusal
        is only logged.

        Returns whether the old primary told the witness its standby was out of sync (then an
        unconfirmed promotion keeps its grace period) and the longest TTL it reported (the
        promotion's grace is at least that long); a refusal not required: nothing learned.

        Raises:
            Unavailable: required, and the witness did not grant it (refused, or unreachable).
        """
        deadline = monotonic_ms() + 2 * window_ms + 1000
        while True:
            answer = await self.lease(epoch, window_ms)
            if answer.granted:
                log.warning("witness %s granted this node the lease of epoch %d%s", self.where, epoch,
                            " (the old primary said its standby was out of sync)" if answer.previous_out_of_sync
                            else "")
                return WitnessVerdict(answer.previous_out_of_sync, answer.previous_max_ttl_ms)
            why = answer.error or (f"its vote is epoch {answer.epoch} ({answer.holder}), "
                                   f"{answer.remaining_ms} ms of its lease left")
            if not required:
                log.warning("witness %s did not grant the lease of epoch %d (%s): promoting anyway (the old "
                            "primary confirmed stepping down, or forced)", self.where, epoch, why)
                return WitnessVerdict(False, 0)
            left = deadline - monotonic_ms()
            if answer.epoch > epoch or left <= 0:
                raise Unavailable(f"the witness {self.where} did not grant the lease of epoch {epoch} ({why}): "
                                  f"the primary may still be granting; no promotion")
            wait_ms = answer.remaining_ms + 20 if answer.error is None else 200
            await asyncio.sleep(min(wait_ms, left) / 1000.0)

    async def probe(self) -> str | None:
        """Ask the witness for its status (a standby's check that a promotion could be
        granted); returns None when it answered, else why not (also in :meth:`status`)."""
        async with self._lock:
            try:
                if self._conn is None or self._conn.closed:
                    self._conn = None
                    self._conn = await self._connect()
                reply = await asyncio.wait_for(self._conn.request(P.OP_STATUS), WITNESS_TIMEOUT_S)
                if not isinstance(reply, dict):
                    raise FastlockError(f"malformed witness status {type(reply).__name__}")
                self.probed = None
            except (OSError, asyncio.TimeoutError, FastlockError) as exc:
                if self._conn is not None:
                    self._conn.close()
                    self._conn = None
                self.probed = f"{type(exc).__name__}: {exc}"
        return self.probed

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def status(self) -> dict:
        """The witness as this node last saw it."""
        last = self.last
        out: dict[str, Any] = {"address": self.where, "tls": self.tls is not None, "node": self.proven,
                               "reachable": self.probed is None,
                               "error": self.probed,
                               # a promotion (but for a forced or confirmed one) needs the witness's vote
                               "automatic_promotion": "possible" if self.probed is None
                               else "impossible while the witness does not answer"}
        if last is not None:
            out.update(asked_epoch=last.asked, granted=last.granted, epoch=last.epoch, holder=last.holder,
                       answer_age_ms=monotonic_ms() - last.sent_ms)
        return out


class PrimaryWitnessLease:
    """While this node is the primary: renew the witness lease of its epoch (see the module
    docstring).  ``own_window_ms``: this node's ``--failover-after`` (the lease length while
    no standby with a window is paired; 0 and none paired: no lease is asked for)."""

    def __init__(self, host: ReplicationHost, source: ReplicationSource, link: WitnessLink, own_window_ms: int):
        self.host = host
        self.source = source
        self.link = link
        self.own_window_ms = own_window_ms
        self._task: asyncio.Task | None = None
        self._said: str | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.ensure_future(self._run())

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None
        self.link.close()

    def _say(self, level: int, text: str) -> None:
        if text != self._said:
            self._said = text
            log.log(level, "%s", text)

    async def _run(self) -> None:
        while True:
            window = self.source.lease_window_ms(self.own_window_ms)
            if self.host.roles.role is Role.STANDBY:
                error = await self.link.probe()  # a promotion needs the witness: say whether it answers
                if error is not None:
                    self._say(logging.WARNING, f"witness {self.link.where} unreachable ({error}): this standby "
                                               f"cannot be promoted automatically until it answers")
                else:
                    self._say(logging.INFO, f"witness {self.link.where} answers: an automatic promotion may "
                                            f"take its lease")
                await asyncio.sleep(1.0)
                continue
            if self.host.roles.role is Role.PRIMARY and window > 0:
                epoch = self.host.table.epoch
                sync = self.source.sync
                out_of_sync = isinstance(sync, SyncGate) and sync.degraded
                max_ttl_ms = self.host.max_ttl_ms
                answer = await self.link.lease(epoch, window, out_of_sync, max_ttl_ms)
                self.link.probed = answer.error
                if answer.granted and self.host.table.epoch == epoch:
                    self.source.witness_granted(answer.sent_ms, window, max_ttl_ms)
                    if answer.out_of_sync and isinstance(sync, SyncGate):
                        sync.on_witness_out_of_sync()
                    self._say(logging.INFO, f"witness {self.link.where}: holding its lease for epoch {epoch}")
                elif answer.error is not None:
                    self._say(logging.WARNING, f"witness {self.link.where} unreachable ({answer.error}): granting "
                                               f"only while the standby is heard")
                else:
                    self._say(logging.WARNING, f"witness {self.link.where} refused the lease of epoch {epoch} (its "
                                               f"vote: epoch {answer.epoch}, {answer.holder}): granting only while "
                                               f"the standby is heard")
            await asyncio.sleep(heartbeat_interval_ms(window or 1000) / 1000.0)
