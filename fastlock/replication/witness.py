"""The witness: a third opinion for a pair, holding no locks (``fastlock witness``).

A pair alone cannot tell a dead standby from a partition, so a primary whose
standby goes silent fences itself.  A witness (as Pacemaker's quorum device or
MongoDB's arbiter) breaks the tie: it hands out one *lease* per epoch, and

* the primary keeps granting while it hears its standby OR holds an unexpired
  witness lease for its own epoch (:class:`~fastlock.replication.witnesslink.PrimaryWitnessLease`);
* the standby promotes only after the primary's silence AND after the witness
  granted it the lease for the new epoch, which the witness gives only once
  the lease of the epoch below has expired on the witness's monotonic clock.

The rule of :meth:`Witness.lease` (the whole state is :class:`WitnessVote`)::

    epoch <  voted epoch                    refused (superseded)
    epoch == voted epoch, same holder       granted: expires lease_ms from now
    epoch == voted epoch, another holder    refused (one holder per epoch, ever)
    epoch >  voted epoch (or none voted)    granted only once the current lease expired;
                                            the vote (epoch, holder, lease_ms) is written
                                            and fsynced before the reply

Synchronous replication: a degraded primary whose standby cannot hear that it
is no longer in sync (dead, or cut off) tells the witness instead
(``out_of_sync``, kept with the vote); the node voted in at the next epoch
learns it (``previous_out_of_sync``) and takes the promotion grace period.

The longest TTL: the holder reports the longest lease TTL it has granted (``max_ttl_ms``,
kept with the vote, the highest reported at that epoch); the node voted in at the next
epoch learns it (``previous_max_ttl_ms``) and keeps a promotion grace at least that long.
A primary whose standby is silent may so acknowledge a lease up to the TTL the witness
confirmed (:mod:`fastlock.replication.ttlbound`).

A witness restarted with a vote holds that vote's lease for a whole
``lease_ms`` from its start (it cannot know how much of it was left).  The
safety argument is in ``docs/failover-safety.md`` ("A pair with a witness").

Authentication: a node proves its replica token with the HELLO handshake of
:mod:`fastlock.auth.handshake` (no secret on the wire; the proof names the
witness's node id, both nonces and the dialed endpoint, so it cannot be
replayed, reflected or relayed; ``--reachable-as`` names further endpoints a node may
have dialed, as ``serve``'s), and the witness proves it holds the same
credentials file.  Only replica principals are accepted; the holder of a
lease is ``<replica principal>/<node id>`` from the proved handshake.

TLS (``fastlock witness --tls-cert ...``, the flags of ``fastlock serve``): the witness
listens through :class:`~fastlock.tls.ServerTLS` (its handshakes bounded in time and
count before a connection counts here), and a node run with ``--tls-cert`` reaches it
over TLS, as it reaches its primary (its certificate as the client certificate,
``--tls-ca`` verifying the witness's).  Over TLS the dialed endpoint is not checked
(the certificate binds the witness), as ``serve``'s.

Limits: at most :data:`MAX_CONNECTIONS` connections, :data:`MAX_CONNECTIONS_PER_ADDRESS`
from one address, HELLO done within :data:`HELLO_TIMEOUT_S` of the connect.  A node that
proved itself is never crowded out by connections that did not: when a limit is reached,
a new connection closes the oldest connection still in its handshake (from its own
address when that address is at its limit, else from the address with the most such
connections; a fair share per address, as invariant 12) and is refused only when every
connection it could replace has proved itself.  A connection idle for
:data:`IDLE_TIMEOUT_S` is closed, frames within the server's request limits,
and ``lease_ms`` within :data:`MIN_LEASE_MS`..:data:`MAX_LEASE_MS`.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from typing import Any, NamedTuple

from .. import protocol as P
from .._version import __version__
from ..auth import Credentials
from ..auth.handshake import ClientFirst, PendingProof, ServerHandshake, endpoint
from ..errors import AuthError, FastlockError, InvalidArgument, ProtocolError
from ..logsafe import quote
from ..tls import ServerTLS
from ..units import monotonic_ms
from ..wal import write_atomically
from .node_state import load_json, node_id

log = logging.getLogger("fastlock.witness")

#: the witness's own op: ``[req_id, OP_WITNESS_LEASE, epoch, lease_ms[, out_of_sync[, max_ttl_ms]]]``
#: -> :meth:`Witness.lease`'s dict
OP_WITNESS_LEASE = 120
#: what the witness's HELLO answer says it is (a node refuses any other server as its witness)
WITNESS_SERVER = "fastlock-witness"
#: where the vote is kept, in the witness's data directory
VOTE_FILE = "witness.json"
MIN_LEASE_MS = 100
MAX_LEASE_MS = 600_000
MAX_CONNECTIONS = 64
MAX_CONNECTIONS_PER_ADDRESS = 16
HELLO_TIMEOUT_S = 2.0
IDLE_TIMEOUT_S = 60.0
READ_BYTES = 64 << 10


class WitnessVote(NamedTuple):
    """What the witness keeps (``witness.json``): the highest epoch it granted a lease
    for, to whom (``principal/node``; None: nobody yet), the longest lease it gave at that
    epoch (ms), whether that holder last said its standby may lack acknowledged grants
    (``out_of_sync``), and what the holder of the epoch below last said when this vote
    was taken (``previous_out_of_sync``); the longest lease TTL the holder reported granting at
    that epoch (``max_ttl_ms``, ms) and the one the holder of the epoch below had reported
    (``previous_max_ttl_ms``)."""

    epoch: int
    holder: str | None
    lease_ms: int
    out_of_sync: bool = False
    previous_out_of_sync: bool = False
    max_ttl_ms: int = 0
    previous_max_ttl_ms: int = 0


def read_vote(directory: str) -> WitnessVote:
    """The vote in ``<directory>/witness.json`` (none yet: epoch 0, no holder).

    Raises:
        NodeFileDamaged: the file is not what :func:`write_vote` writes.
    """
    data = load_json(directory, VOTE_FILE, {"epoch": (int,), "holder": (str, type(None)), "lease_ms": (int,),
                                            "out_of_sync": (bool,), "previous_out_of_sync": (bool,),
                                            "max_ttl_ms": (int,), "previous_max_ttl_ms": (int,)})
    if data is None:
        return WitnessVote(0, None, 0)
    return WitnessVote(int(data.get("epoch", 0)), data.get("holder"), int(data.get("lease_ms", 0)),
                       bool(data.get("out_of_sync", False)), bool(data.get("previous_out_of_sync", False)),
                       int(data.get("max_ttl_ms", 0)), int(data.get("previous_max_ttl_ms", 0)))


def write_vote(directory: str, vote: WitnessVote) -> None:
    """Write the vote atomically and fsync it (before anyone hears of it)."""
    write_atomically(directory, VOTE_FILE, json.dumps(vote._asdict()).encode())


class Witness:
    """The witness's state and rule (sans-IO) plus its TCP listener (:meth:`start`).

    Args:
        data_dir: where the vote (``witness.json``) and the witness's ``node-id`` live.
        credentials: the pair's credentials file (its replica principals prove themselves).
        clock: the monotonic clock in milliseconds (tests pass their own).
        reachable_as: endpoints (``IP:PORT``, as :func:`~fastlock.auth.handshake.endpoint`
            writes them) a node's handshake may name as the one it dialed besides the one
            its connection arrived at (NAT, port mapping, a TCP proxy), or ``("any",)``: the
            check is off.  As ``fastlock serve --reachable-as``.
    """

    def __init__(self, data_dir: str, credentials: Credentials, *, clock: Callable[[], int] = monotonic_ms,
                 reachable_as: tuple[str, ...] = ()):
        self.data_dir = data_dir
        self.reachable_as = reachable_as
        self.credentials = credentials
        self.clock = clock
        self.vote = read_vote(data_dir)
        self.node = node_id(data_dir)
        self.verifier = ServerHandshake(self.node)
        # a vote from before a restart: its holder may hold it for a whole lease from now
        self.expires_ms = clock() + self.vote.lease_ms if self.vote.holder is not None else 0
        self.listen: str | None = None
        self._server: asyncio.AbstractServer | None = None
        self._tls: ServerTLS | None = None
        self._connections = 0
        self._per_address: dict[str | None, int] = {}
        #: address -> its connections still in their handshake, oldest first
        self._unproved: dict[str | None, dict[_Session, None]] = {}

    # -- the rule ---------------------------------------------------------------------------
    def lease(self, holder: str, epoch: Any, lease_ms: Any, out_of_sync: Any = False, max_ttl_ms: Any = 0) -> dict:
        """Grant or refuse ``holder`` the lease for ``epoch`` for ``lease_ms`` (see the module
        docstring).  ``out_of_sync``: the holder's word that its standby may lack grants it
        acknowledged (a degraded synchronous primary), kept with the vote (fsynced) when it
        changes; a granted answer means it is recorded.  ``max_ttl_ms``: the longest lease
        TTL the holder has granted (ms), kept likewise (the highest reported at the epoch).

        Returns ``{"granted", "epoch", "holder", "remaining_ms", "out_of_sync",
        "previous_out_of_sync", "max_ttl_ms", "previous_max_ttl_ms"}``: the vote after the
        request, how long its lease has left on this clock (ms), its holder's last word and
        longest TTL, and the last word and longest TTL of the epoch below's holder when this
        vote was taken (a node promoted with it takes the grace period if True, and a grace
        at least that long).

        Raises:
            InvalidArgument: ``epoch`` not an int in 0..MAX_EPOCH, ``lease_ms`` out of
                :data:`MIN_LEASE_MS`..:data:`MAX_LEASE_MS`, ``out_of_sync`` not a bool, or
                ``max_ttl_ms`` not an int in 0..the longest recorded TTL (nothing changes).
        """
        P.check_epoch(epoch, "witness epoch")
        if type(lease_ms) is not int or not MIN_LEASE_MS <= lease_ms <= MAX_LEASE_MS:
            raise InvalidArgument(f"lease_ms must be an int in {MIN_LEASE_MS}..{MAX_LEASE_MS}")
        if type(out_of_sync) is not bool:
            raise InvalidArgument("out_of_sync must be a bool")
        if type(max_ttl_ms) is not int or not 0 <= max_ttl_ms <= P.MAX_RECORDED_TTL_MS:
            raise InvalidArgument(f"max_ttl_ms must be an int in 0..{P.MAX_RECORDED_TTL_MS}")
        now = self.clock()
        vote = self.vote
        granted = False
        if epoch == vote.epoch and holder == vote.holder:
            if lease_ms > vote.lease_ms or out_of_sync != vote.out_of_sync or max_ttl_ms > vote.max_ttl_ms:
                self._write(vote._replace(lease_ms=max(lease_ms, vote.lease_ms), out_of_sync=out_of_sync,
                                          max_ttl_ms=max(max_ttl_ms, vote.max_ttl_ms)))
            self.expires_ms = max(self.expires_ms, now + lease_ms)
            granted = True
        elif (epoch > vote.epoch or vote.holder is None) and (vote.holder is None or now >= self.expires_ms):
            # the longest TTL any holder below reported: a node voted in but never heard from
            # since (it died promoting) does not hide it from the next one
            self._write(WitnessVote(epoch, holder, lease_ms, out_of_sync, vote.out_of_sync, max_ttl_ms,
                                    max(vote.max_ttl_ms, vote.previous_max_ttl_ms)))
            log.warning("voted for %s at epoch %d (the lease of epoch %d, %s, %s%s)", quote(holder), epoch,
                        vote.epoch, quote(vote.holder), "had expired" if vote.holder else "was never held",
                        "; its holder said its standby was out of sync" if vote.out_of_sync else "")
            self.expires_ms = now + lease_ms
            granted = True
        return {"granted": granted, "epoch": self.vote.epoch, "holder": self.vote.holder,
                "remaining_ms": max(0, self.expires_ms - now), "out_of_sync": self.vote.out_of_sync,
                "previous_out_of_sync": self.vote.previous_out_of_sync, "max_ttl_ms": self.vote.max_ttl_ms,
                "previous_max_ttl_ms": self.vote.previous_max_ttl_ms}

    def _write(self, vote: WitnessVote) -> None:
        write_vote(self.data_dir, vote)
        self.vote = vote

    def status(self) -> dict:
        """The vote and its lease's time left (ms)."""
        return {"server": WITNESS_SERVER, "node": self.node, "epoch": self.vote.epoch, "holder": self.vote.holder,
                "lease_ms": self.vote.lease_ms, "remaining_ms": max(0, self.expires_ms - self.clock()),
                "tls": self._tls is not None}

    # -- the listener -----------------------------------------------------------------------
    async def start(self, host: str, port: int, tls: ServerTLS | None = None) -> str:
        """Listen on ``host:port`` (0: a free port), over TLS when ``tls`` is given;
        returns the ``host:port`` listened on.

        Raises:
            OSError: the address cannot be bound.
        """
        if tls is not None:
            self._tls = tls
            where = await tls.listen(host, port, self._stream_protocol)
        else:
            self._server = await asyncio.start_server(self._serve, host, port)
            where = self._server.sockets[0].getsockname()
        self.listen = f"{where[0]}:{where[1]}"
        return self.listen

    def _stream_protocol(self) -> asyncio.Protocol:
        """A connection whose TLS handshake succeeded, served as a plain one (as ``start_server``)."""
        return asyncio.StreamReaderProtocol(asyncio.StreamReader(), self._serve)

    def reload_tls(self) -> bool:
        """Reload the TLS files (SIGHUP): new connections use them; False without TLS or on an error."""
        return self._tls is not None and self._tls.reload()

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
        if self._tls is not None:
            self._tls.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")
        host = peer[0] if isinstance(peer, tuple) else None
        if not self._make_room(host):
            log.debug("witness connection from %s refused: every connection it could replace proved itself", peer)
            writer.close()
            return
        self._connections += 1
        self._per_address[host] = self._per_address.get(host, 0) + 1
        session = _Session(self, writer, host)
        self._unproved.setdefault(host, {})[session] = None
        decoder = P.FrameDecoder(limits=P.REQUEST_LIMITS)
        hello_by = asyncio.get_running_loop().time() + HELLO_TIMEOUT_S  # one deadline, however bytes trickle in
        try:
            while not writer.is_closing():
                if session.holder is not None:
                    timeout = IDLE_TIMEOUT_S
                else:
                    timeout = max(0.0, hello_by - asyncio.get_running_loop().time())
                data = await asyncio.wait_for(reader.read(READ_BYTES), timeout)
                if not data:
                    break
                for msg in decoder.feed(data):
                    session.handle(msg)
                if session.holder is not None:
                    self._proved(session)
                await writer.drain()
        except (asyncio.TimeoutError, OSError, ProtocolError, AuthError) as exc:
            log.debug("witness connection from %s closed: %s", session.peer, exc)
        finally:
            self._drop(session)
            writer.close()

    def _make_room(self, host: str | None) -> bool:
        """Room for a new connection from ``host``: True if under both limits, or once the
        oldest connection still in its handshake that it may replace is closed (its own
        address's at that address's limit, else the one of the address with the most)."""
        if self._per_address.get(host, 0) >= MAX_CONNECTIONS_PER_ADDRESS:
            victims = self._unproved.get(host)
        elif self._connections >= MAX_CONNECTIONS:
            victims = max(self._unproved.values(), key=len, default=None)
        else:
            return True
        if not victims:
            return False
        victim = next(iter(victims))
        log.debug("witness connection from %s closed in its handshake to make room", victim.peer)
        self._drop(victim)
        victim.writer.close()
        return True

    def _proved(self, session: _Session) -> None:
        """``session`` proved itself: it no longer counts as one a newcomer may replace."""
        mine = self._unproved.get(session.host)
        if mine is not None:
            mine.pop(session, None)
            if not mine:
                del self._unproved[session.host]

    def _drop(self, session: _Session) -> None:
        """Stop counting ``session`` (once; its connection is closing)."""
        if session.counted:
            session.counted = False
            self._proved(session)
            self._connections -= 1
            left = self._per_address.pop(session.host, 1) - 1
            if left:
                self._per_address[session.host] = left


class _Session:
    """One connection to the witness: HELLO first, then leases and status."""

    def __init__(self, witness: Witness, writer: asyncio.StreamWriter, host: str | None = None):
        self.witness = witness
        self.writer = writer
        self.host = host  # the peer's address, as the witness counts its connections
        self.counted = True  # counted in the witness's connection limits until dropped
        self.peer = writer.get_extra_info("peername")
        self.pending: PendingProof | None = None
        self.holder: str | None = None  # principal/node, once proved

    def send(self, data: bytes) -> None:
        self.writer.write(data)

    def handle(self, msg: Any) -> None:
        if type(msg) is not list or len(msg) < 2 or type(msg[0]) is not int or msg[0] < 1 or type(msg[1]) is not int:
            raise ProtocolError("a request is [req_id, op, arg...]")
        req_id, op, args = msg[0], msg[1], msg[2:]
        try:
            if op == P.OP_HELLO:
                self.hello(req_id, args)
                return
            if self.holder is None:
                raise ProtocolError("the first request must be HELLO")
            if op == OP_WITNESS_LEASE and len(args) in (2, 3, 4):
                self.send(P.encode_ok(req_id, self.witness.lease(self.holder, *args)))
            elif op == P.OP_PING and not args:
                self.send(P.encode_ok(req_id, None))
            elif op == P.OP_STATUS and not args:
                self.send(P.encode_ok(req_id, self.witness.status()))
            else:
                raise ProtocolError(f"the witness answers HELLO, STATUS and WITNESS_LEASE only (op {op})")
        except FastlockError as exc:
            self.send(P.encode_error(req_id, exc.code, str(exc)))
            if isinstance(exc, (ProtocolError, AuthError)):
                raise

    def hello(self, req_id: int, args: list) -> None:
        if self.holder is not None or len(args) not in (3, 4):
            raise ProtocolError("HELLO once: version, client_name, credential[, epoch]")
        version, credential = args[0], args[2]
        if version != P.PROTOCOL_VERSION:
            raise ProtocolError(f"protocol version {version!r} not supported (the witness speaks "
                                f"{P.PROTOCOL_VERSION})")
        if type(credential) is not dict:
            raise AuthError("the witness takes replica principals only, proved with their token")
        witness = self.witness
        if "proof" not in credential:
            if self.pending is not None:
                raise ProtocolError("one handshake per connection")
            first = ClientFirst.parse(credential)
            here = endpoint(self.writer.get_extra_info("sockname"))
            allowed = witness.reachable_as
            over_tls = self.writer.get_extra_info("ssl_object") is not None  # the certificate binds the witness
            if first.dialed is not None and first.dialed != here and first.dialed not in allowed \
                    and "any" not in allowed and not over_tls:
                raise AuthError(f"authentication failed: the node dialed {first.dialed} but reached the witness "
                                f"at {here} (a relay in between, or address translation: witness --reachable-as)")
            found = witness.credentials.lookup(first.principal)
            if found is not None and (found.kind != "replica" or found.keys is None):
                found = None  # answered like an unknown principal: its proof fails
            self.pending, reply = witness.verifier.challenge(first, found.keys if found is not None else None, found)
            self.send(P.encode_ok(req_id, reply))
            return
        pending, self.pending = self.pending, None
        if pending is None:
            raise ProtocolError("a proof without a challenge")
        server_proof = witness.verifier.verify(pending, credential)
        first = pending.first
        if server_proof is None or pending.principal is None or first.role != "replica" or not first.client_node:
            log.warning("refused a node at %s: wrong proof, not a replica principal, or no node id", self.peer)
            raise AuthError("authentication failed: wrong proof, or not a replica principal with a node id")
        pinned = pending.principal.node_id
        if pinned is not None and first.client_node != pinned:
            raise AuthError(f"authentication failed: replica principal {pending.principal.name!r} may only act "
                            f"as node {pinned!r}")
        self.holder = f"{pending.principal.name}/{first.client_node}"
        self.send(P.encode_ok(req_id, {"server": WITNESS_SERVER, "version": __version__,
                                       "protocol": P.PROTOCOL_VERSION, "node": witness.node,
                                       "principal": pending.principal.name, "server_proof": server_proof}))
