"""The writer's side of the fencing contract: fenced writes to SQLite and PostgreSQL.

A lease can end without its holder knowing: a long GC pause, a frozen VM, a
stalled network.  When the holder wakes up it may still write, believing it
holds the lock.  Fencing tokens close that gap (Martin Kleppmann, "How to do
distributed locking", 2016; Chubby's *sequencers*, Burrows, OSDI 2006): every
grant carries a token larger than any before it, the writer sends its token
with each write, and **the storage refuses a write whose token is lower than
the highest token it has already accepted for that resource**.  The lock
server cannot enforce this; the storage must.  This module is that check for
two common stores.

Semantics
---------
A write with token ``t`` for resource ``r`` is applied if and only if ``t`` is
*at least* the highest token recorded for ``r`` (``t >= highest``); it then
records ``t`` as the highest.  Equal tokens are accepted because one lease may
write many times while it holds the lock.  A lower token raises
:class:`~fastlock.errors.StaleFencingToken` and nothing of that write is
applied.

Shared locks and semaphore permits
----------------------------------
Every lease of every kind - exclusive, shared (``client.lock(name,
shared=True)``) or a semaphore permit - takes its token from the same
counter, so an exclusive holder's token exceeds every token granted before it,
and a shared holder's exceeds every exclusive one granted before it.  The same
check therefore serves both kinds, with this meaning:

* **a write by a shared holder** (or a permit holder) passes ``fenced()`` exactly
  when no lease granted after it has written to the resource - in particular no
  later exclusive holder - so a stale reader cannot overwrite a writer's work.
  Two shared holders that both write are ordered too: once the later one has
  written, the earlier one is refused.  That refusal is safe but may be
  unnecessary (the earlier reader may still hold its lease; re-acquire and
  retry), because a lock service cannot order concurrent readers;
* **a read guarded by a shared lock** is checked the same way: do the read
  inside ``fenced(resource, lease.fencing_token)``, and it is accepted only if no
  later lease (a writer that took over after this lease ended) has written,
  so the read cannot mix a stale lease with newer data.  Recording the reader's
  token also refuses, from then on, any write by an exclusive holder whose lease
  ended before the reader's began.  Where the store cannot run this check,
  ``await client.check(name, token)`` asks the server whether the lease is still
  held (Chubby's sequencer check; it can be stale by one round trip).

The check, the recording of the token and the caller's own statements run in
**one transaction**: they commit together or not at all, so a rejected write
leaves no trace and an accepted one cannot be overtaken between check and
write.  Tokens are integers in ``[0, 2**63 - 1]`` (fastlock's tokens are
``(epoch << 40) | counter``, below ``2**63``), stored as SQLite ``INTEGER`` and
PostgreSQL ``BIGINT``.

The token record lives in a small table (``fastlock_fence`` by default)::

    resource TEXT PRIMARY KEY, token INTEGER/BIGINT NOT NULL

Signed sequencers
-----------------
A fence made with ``keys`` (the group's verify keys, :mod:`fastlock.sequencer`)
takes **only signed sequencers**: ``lease.sequencer`` (a client connected with
``sequencers=True``), the lease itself, the text or bytes of a sequencer, or a
:class:`~fastlock.sequencer.Sequencer`.  Before the high-water mark is touched the
sequencer is verified: signed by one of ``keys``, for this very resource, and not
expired more than ``skew`` seconds ago; a bare integer is refused.  So a client
that invents token ``2**62`` cannot lift the mark (the attack a bare token allows)::

    fence = SQLiteFence(conn, keys=keys_from_text(open("group.pub").read()))
    with fence.fenced("orders/42", lease.sequencer) as cur:
        ...

The errors are :class:`~fastlock.sequencer.SequencerRejected`'s subclasses (a
``ValueError``), raised before anything is written.

and is updated with one conditional upsert::

    INSERT INTO fastlock_fence (resource, token) VALUES (:r, :t)
    ON CONFLICT (resource) DO UPDATE SET token = excluded.token
    WHERE fastlock_fence.token <= excluded.token

which changes one row when the token is accepted and none when it is stale.

Example (SQLite)::

    import sqlite3
    from fastlock.fencing import SQLiteFence
    from fastlock.errors import StaleFencingToken

    conn = sqlite3.connect("app.db")
    fence = SQLiteFence(conn)
    fence.ensure_schema()
    async with client.lock("orders/42", ttl=10.0) as lease:
        try:
            with fence.fenced("orders/42", lease.fencing_token) as cur:
                cur.execute("UPDATE orders SET state = ? WHERE id = ?", ("paid", 42))
        except StaleFencingToken:
            ...   # someone with a newer lease already wrote: our lease is gone

Example (PostgreSQL, psycopg 3, ``pip install fastlock[postgres]``)::

    fence = PostgresFence(pg_conn)
    fence.ensure_schema()
    with fence.fenced("orders/42", lease.fencing_token) as cur:
        cur.execute("UPDATE orders SET state = %s WHERE id = %s", ("paid", 42))

psycopg is imported only when a PostgreSQL helper is created, so ``fastlock``
and this module import without it.
"""

from __future__ import annotations

import re
import sqlite3
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import asynccontextmanager, contextmanager
from typing import TYPE_CHECKING, Any

from . import sequencer as seq
from .errors import InvalidArgument, StaleFencingToken, WrongArgumentType

if TYPE_CHECKING:  # pragma: no cover
    import psycopg

__all__ = [
    "MAX_TOKEN",
    "DEFAULT_TABLE",
    "StaleFencingToken",
    "SQLiteFence",
    "PostgresFence",
    "AsyncPostgresFence",
    "fenced_execute",
    "validate_token",
]

#: Largest token accepted: a signed 64-bit integer (SQLite INTEGER, PostgreSQL BIGINT).
MAX_TOKEN = (1 << 63) - 1

#: Default name of the table that records the highest token per resource.
DEFAULT_TABLE = "fastlock_fence"

_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,62}$")


def validate_token(token: Any) -> int:
    """Return ``token`` as an ``int`` after checking it is a valid fencing token.

    :param token: an ``int`` in ``[0, MAX_TOKEN]``, or an object with a
        ``fencing_token`` attribute holding one (such as a
        :class:`fastlock.Lease`).
    :raises WrongArgumentType: (a ``TypeError``) ``token`` is not an ``int``
        (``bool`` and ``float`` are refused).
    :raises InvalidArgument: (a ``ValueError``) ``token`` is negative or
        larger than ``MAX_TOKEN``.
    """
    if not isinstance(token, int) and hasattr(token, "fencing_token"):
        token = token.fencing_token
    if isinstance(token, bool) or not isinstance(token, int):
        raise WrongArgumentType(f"fencing token must be an int, not {type(token).__name__}")
    if token < 0 or token > MAX_TOKEN:
        raise InvalidArgument(f"fencing token must be in [0, 2**63 - 1], got {token}")
    return int(token)


class _Keys:
    """A fence's sequencer keys (None: bare tokens) and clock skew allowance (seconds)."""

    __slots__ = ("keys", "skew", "modes")

    def __init__(self, keys: Any, skew: float | None, modes: Any = seq.WRITE_MODES):
        if keys is None:
            self.keys = None
        elif isinstance(keys, seq.VerifyKey):
            self.keys = {keys.key_id: keys}
        else:
            self.keys = {k.key_id: k for k in keys}
            if not self.keys or not all(isinstance(k, seq.VerifyKey) for k in self.keys.values()):
                raise WrongArgumentType("keys must be fastlock.sequencer.VerifyKey objects (at least one)")
        self.skew = seq.check_skew(skew)
        self.modes = seq.check_modes(modes)

    def token(self, resource: str, token: Any) -> int:
        """The token to record for ``resource``: ``token`` checked as a bare token, or
        (with keys) the token of a verified sequencer for ``resource``."""
        if self.keys is None:
            return validate_token(token)
        if isinstance(token, seq.Sequencer):
            token = token.blob
        elif not isinstance(token, (str, bytes, bytearray, memoryview)):
            token = getattr(token, "sequencer", None)  # a Lease or SyncLease
            if token is None:
                raise seq.MalformedSequencer(f"this fence of {resource!r} takes signed sequencers only, not a bare "
                                             "token (connect with sequencers=True and pass lease.sequencer)")
        return seq.verify(token, self.keys, name=resource, skew=self.skew, modes=self.modes).token


def _validate_resource(resource: Any) -> str:
    if not isinstance(resource, str):
        raise WrongArgumentType(f"resource must be a str, not {type(resource).__name__}")
    if not resource:
        raise InvalidArgument("resource must be a non-empty string")
    return resource


def _split_table(table: Any) -> tuple[str, ...]:
    """Check a table name (optionally ``schema.table``) and return its parts."""
    if not isinstance(table, str):
        raise WrongArgumentType(f"table must be a str, not {type(table).__name__}")
    parts = tuple(table.split("."))
    if len(parts) > 2 or not all(_IDENT.match(p) for p in parts):
        raise InvalidArgument(
            f"table must be an SQL identifier (letters, digits, '_'; optionally schema.table), got {table!r}"
        )
    return parts


def _stale(resource: str, token: int, highest: int | None) -> StaleFencingToken:
    return StaleFencingToken(
        f"stale fencing token {token} for {resource!r}: a write with token {highest} was already accepted",
        token=token,
        highest=highest,
    )


# --------------------------------------------------------------------------- SQLite


class SQLiteFence:
    """Fenced writes to an SQLite database (stdlib :mod:`sqlite3`).

    :param conn: an open :class:`sqlite3.Connection`.  The fence issues its
        own ``BEGIN IMMEDIATE``/``COMMIT`` when the connection is not inside a
        transaction; connect with a busy ``timeout`` (seconds) suited to your
        contention, as concurrent writers wait for SQLite's write lock.
    :param table: name of the token table (an SQL identifier), default
        ``"fastlock_fence"``.
    :param keys: the group's verify keys (:class:`fastlock.sequencer.VerifyKey`, an
        iterable or one): the fence then takes signed sequencers only (see the module
        docstring).  None (default): bare tokens.
    :param skew: seconds a sequencer stays accepted after its lease's expiry (clock
        skew allowance); None: expiry not checked.
    :param modes: with ``keys``, the lease modes whose sequencers pass (default
        :data:`fastlock.sequencer.WRITE_MODES`, exclusive only: a shared lease or a semaphore
        permit has several holders at once, :class:`~fastlock.sequencer.WrongSequencerMode`
        otherwise); None: any mode.
    :raises TypeError, ValueError: ``table`` is not a plain identifier.

    SQLite runs one write transaction at a time per database, so taking the
    write lock first (``BEGIN IMMEDIATE``) makes check-and-write atomic with
    respect to every other writer, in this process or another.
    """

    def __init__(self, conn: sqlite3.Connection, table: str = DEFAULT_TABLE, *, keys: Any = None,
                 skew: float | None = seq.DEFAULT_SKEW, modes: Any = seq.WRITE_MODES) -> None:
        if not isinstance(conn, sqlite3.Connection):
            raise WrongArgumentType(f"conn must be a sqlite3.Connection, not {type(conn).__name__}")
        parts = _split_table(table)
        if len(parts) != 1:
            raise InvalidArgument(f"SQLite fence table must be a plain identifier, got {table!r}")
        name = parts[0]
        self.conn = conn
        self.table = name
        self._keys = _Keys(keys, skew, modes)
        q = f'"{name}"'
        self._ddl = f"CREATE TABLE IF NOT EXISTS {q} (resource TEXT PRIMARY KEY, token INTEGER NOT NULL)"
        self._upsert = (
            f"INSERT INTO {q} (resource, token) VALUES (?, ?) "
            f"ON CONFLICT (resource) DO UPDATE SET token = excluded.token "
            f"WHERE {q}.token <= excluded.token"
        )
        self._select = f"SELECT token FROM {q} WHERE resource = ?"

    @contextmanager
    def _transaction(self) -> Iterator[sqlite3.Cursor]:
        """BEGIN IMMEDIATE ... COMMIT, or a SAVEPOINT inside the caller's transaction."""
        conn = self.conn
        cur = conn.cursor()
        try:
            if conn.in_transaction:
                # The caller owns the transaction (and its COMMIT): nest in a savepoint
                # so that a rejected write leaves the caller's earlier work intact.
                cur.execute("SAVEPOINT fastlock_fence")
                try:
                    yield cur
                except BaseException:
                    cur.execute("ROLLBACK TO SAVEPOINT fastlock_fence")
                    cur.execute("RELEASE SAVEPOINT fastlock_fence")
                    raise
                cur.execute("RELEASE SAVEPOINT fastlock_fence")
            else:
                cur.execute("BEGIN IMMEDIATE")
                try:
                    yield cur
                except BaseException:
                    if conn.in_transaction:
                        conn.rollback()
                    raise
                conn.commit()
        finally:
            cur.close()

    def ensure_schema(self) -> None:
        """Create the token table if it does not exist (idempotent, safe to call often)."""
        with self._transaction() as cur:
            cur.execute(self._ddl)

    def highest(self, resource: str) -> int | None:
        """Return the highest token accepted for ``resource``, or None if none was.

        :raises TypeError, ValueError: ``resource`` is not a non-empty ``str``.
        """
        resource = _validate_resource(resource)
        row = self.conn.execute(self._select, (resource,)).fetchone()
        return None if row is None else int(row[0])

    @contextmanager
    def fenced(self, resource: str, token: int) -> Iterator[sqlite3.Cursor]:
        """Run the caller's statements only if ``token`` is not stale for ``resource``.

        ::

            with fence.fenced("ledger", lease.fencing_token) as cur:
                cur.execute("INSERT INTO ledger (amount) VALUES (?)", (10,))

        Opens ``BEGIN IMMEDIATE`` (or a savepoint when the connection is
        already in a transaction, whose ``COMMIT`` then stays the caller's),
        records ``token`` for ``resource`` if it is at least the highest one
        recorded, yields a cursor for the caller's statements, and commits.
        If the block raises, everything, the token record included, is rolled
        back and the exception propagates.

        :param resource: the name of what is protected, usually the lock name.
        :param token: the lease's fencing token (``int``, or the ``Lease``); with
            ``keys``, its signed sequencer (``lease.sequencer``, or the lease).
        :raises SequencerRejected: (with ``keys``) forged, altered, for another
            resource, signed by an unknown key, expired, or a bare token; nothing
            is written.
        :raises StaleFencingToken: ``token`` is lower than the highest token
            recorded for ``resource``; ``.token`` and ``.highest`` say which.
            The block does not run and nothing is written.
        :raises TypeError, ValueError: bad ``resource`` or ``token``.
        :raises sqlite3.OperationalError: e.g. ``database is locked`` after the
            connection's busy timeout, or a missing table (call
            :meth:`ensure_schema`).
        """
        resource = _validate_resource(resource)
        token = self._keys.token(resource, token)
        with self._transaction() as cur:
            cur.execute(self._upsert, (resource, token))
            if cur.rowcount != 1:
                row = cur.execute(self._select, (resource,)).fetchone()
                raise _stale(resource, token, None if row is None else int(row[0]))
            yield cur

    def execute(self, resource: str, token: int, sql: str, params: Sequence[Any] | dict[str, Any] = ()) -> int:
        """One fenced statement: ``sql`` with ``params`` runs only if ``token`` is
        not stale for ``resource``.  Returns the statement's ``rowcount``.

        :raises StaleFencingToken: as :meth:`fenced`; ``sql`` does not run.
        """
        with self.fenced(resource, token) as cur:
            cur.execute(sql, params)
            return cur.rowcount


def fenced_execute(
    conn: sqlite3.Connection,
    resource: str,
    token: int,
    sql: str,
    params: Sequence[Any] | dict[str, Any] = (),
    *,
    table: str = DEFAULT_TABLE,
    keys: Any = None,
    skew: float | None = seq.DEFAULT_SKEW,
    modes: Any = seq.WRITE_MODES,
) -> int:
    """One-shot fenced write to SQLite: create the token table if needed, then
    run ``sql`` with ``params`` in the same transaction as the token check.

    :param conn: an open :class:`sqlite3.Connection`.
    :param resource: the protected resource (usually the lock name).
    :param token: the lease's fencing token.
    :param sql: the caller's statement (``?`` or ``:name`` placeholders).
    :param params: its parameters.
    :param table: the token table, default ``"fastlock_fence"``.
    :param keys, skew, modes: signed sequencers only, as :class:`SQLiteFence`.
    :returns: the statement's ``rowcount``.
    :raises StaleFencingToken: ``token`` is lower than the highest recorded
        for ``resource``; nothing was written.
    :raises TypeError, ValueError: bad arguments.

    Example::

        fenced_execute(conn, "ledger", lease.fencing_token,
                       "INSERT INTO ledger (amount) VALUES (?)", (10,))
    """
    fence = SQLiteFence(conn, table, keys=keys, skew=skew, modes=modes)
    fence.ensure_schema()
    return fence.execute(resource, token, sql, params)


# --------------------------------------------------------------------------- PostgreSQL


def _pg_sql(table: str) -> dict[str, Any]:
    """Compose the fence statements for ``table`` with psycopg's ``sql`` module."""
    try:
        from psycopg import sql
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(
            "the PostgreSQL fence needs psycopg 3: pip install 'fastlock[postgres]'"
        ) from exc
    ident = sql.Identifier(*_split_table(table))
    return {
        "ddl": sql.SQL(
            "CREATE TABLE IF NOT EXISTS {} (resource TEXT PRIMARY KEY, "
            "token BIGINT NOT NULL CHECK (token >= 0))"
        ).format(ident),
        # ON CONFLICT DO UPDATE locks the conflicting row even when the WHERE is
        # false, and under READ COMMITTED it re-checks the newest committed
        # version after waiting for a concurrent writer: writers of one
        # resource are serialised in the order they take that row lock.
        "upsert": sql.SQL(
            "INSERT INTO {t} AS f (resource, token) VALUES (%s, %s) "
            "ON CONFLICT (resource) DO UPDATE SET token = excluded.token "
            "WHERE f.token <= excluded.token"
        ).format(t=ident),
        "select": sql.SQL("SELECT token FROM {} WHERE resource = %s").format(ident),
    }


def _is_duplicate_ddl(exc: BaseException) -> bool:
    # Two sessions running CREATE TABLE IF NOT EXISTS at once can both pass the
    # existence check; the loser fails on the catalog's unique index.
    return getattr(exc, "sqlstate", None) in ("23505", "42P07", "42710")


class PostgresFence:
    """Fenced writes to PostgreSQL with a psycopg 3 :class:`psycopg.Connection`.

    :param conn: an open ``psycopg.Connection``.  Transactions are opened with
        ``conn.transaction()``: a real transaction when none is in progress
        (committed on success), a savepoint inside one the caller opened (whose
        commit stays the caller's, and only then is the write durable).
    :param table: the token table, an identifier or ``schema.table``; default
        ``"fastlock_fence"``.
    :param keys, skew, modes: signed sequencers only, as :class:`SQLiteFence`.
    :raises ImportError: psycopg 3 is not installed.
    :raises TypeError, ValueError: bad ``table``.

    Concurrency: correct under the default READ COMMITTED isolation, where the
    upsert's row lock serialises writers of one resource and the loser of a
    race re-checks against the winner's committed token.  Under REPEATABLE
    READ or SERIALIZABLE, a race instead fails with
    ``psycopg.errors.SerializationFailure``: retry the whole transaction.
    """

    def __init__(self, conn: psycopg.Connection, table: str = DEFAULT_TABLE, *, keys: Any = None,
                 skew: float | None = seq.DEFAULT_SKEW, modes: Any = seq.WRITE_MODES) -> None:
        self._sql = _pg_sql(table)
        self.conn = conn
        self.table = table
        self._keys = _Keys(keys, skew, modes)

    def ensure_schema(self) -> None:
        """Create the token table if it does not exist (idempotent, safe under
        concurrent callers)."""
        for attempt in range(3):
            try:
                with self.conn.transaction(), self.conn.cursor() as cur:
                    cur.execute(self._sql["ddl"])
                return
            except Exception as exc:
                if not _is_duplicate_ddl(exc) or attempt == 2:
                    raise

    def highest(self, resource: str) -> int | None:
        """Return the highest token accepted for ``resource``, or None."""
        resource = _validate_resource(resource)
        with self.conn.transaction(), self.conn.cursor() as cur:
            cur.execute(self._sql["select"], (resource,))
            row = cur.fetchone()
        return None if row is None else int(row[0])

    @contextmanager
    def fenced(self, resource: str, token: int) -> Iterator[psycopg.Cursor]:
        """Run the caller's statements only if ``token`` is not stale for ``resource``.

        ::

            with fence.fenced("ledger", lease.fencing_token) as cur:
                cur.execute("INSERT INTO ledger (amount) VALUES (%s)", (10,))

        :raises StaleFencingToken: ``token`` is lower than the highest token
            recorded for ``resource``; the block does not run and nothing is
            written (the transaction or savepoint is rolled back).
        :raises SequencerRejected: with ``keys``, as :meth:`SQLiteFence.fenced`.
        :raises TypeError, ValueError: bad ``resource`` or ``token``.
        :raises psycopg.Error: database errors, including
            ``SerializationFailure`` under REPEATABLE READ/SERIALIZABLE.
        """
        resource = _validate_resource(resource)
        token = self._keys.token(resource, token)
        with self.conn.transaction(), self.conn.cursor() as cur:
            cur.execute(self._sql["upsert"], (resource, token))
            if cur.rowcount != 1:
                cur.execute(self._sql["select"], (resource,))
                row = cur.fetchone()
                raise _stale(resource, token, None if row is None else int(row[0]))
            yield cur

    def execute(self, resource: str, token: int, sql: Any, params: Sequence[Any] | dict[str, Any] = ()) -> int:
        """One fenced statement; returns its ``rowcount``.

        :raises StaleFencingToken: as :meth:`fenced`; ``sql`` does not run.
        """
        with self.fenced(resource, token) as cur:
            cur.execute(sql, params)
            return cur.rowcount


class AsyncPostgresFence:
    """:class:`PostgresFence` for a psycopg 3 :class:`psycopg.AsyncConnection`.

    Same semantics, arguments and errors; the methods are coroutines and
    :meth:`fenced` is an async context manager::

        fence = AsyncPostgresFence(aconn)
        await fence.ensure_schema()
        async with fence.fenced("ledger", lease.fencing_token) as cur:
            await cur.execute("INSERT INTO ledger (amount) VALUES (%s)", (10,))
    """

    def __init__(self, conn: psycopg.AsyncConnection, table: str = DEFAULT_TABLE, *, keys: Any = None,
                 skew: float | None = seq.DEFAULT_SKEW, modes: Any = seq.WRITE_MODES) -> None:
        self._sql = _pg_sql(table)
        self.conn = conn
        self.table = table
        self._keys = _Keys(keys, skew, modes)

    async def ensure_schema(self) -> None:
        """Create the token table if it does not exist (idempotent)."""
        for attempt in range(3):
            try:
                async with self.conn.transaction(), self.conn.cursor() as cur:
                    await cur.execute(self._sql["ddl"])
                return
            except Exception as exc:
                if not _is_duplicate_ddl(exc) or attempt == 2:
                    raise

    async def highest(self, resource: str) -> int | None:
        """Return the highest token accepted for ``resource``, or None."""
        resource = _validate_resource(resource)
        async with self.conn.transaction(), self.conn.cursor() as cur:
            await cur.execute(self._sql["select"], (resource,))
            row = await cur.fetchone()
        return None if row is None else int(row[0])

    @asynccontextmanager
    async def fenced(self, resource: str, token: int) -> AsyncIterator[psycopg.AsyncCursor]:
        """Async :meth:`PostgresFence.fenced`.

        :raises StaleFencingToken: ``token`` is stale; nothing is written.
        """
        resource = _validate_resource(resource)
        token = self._keys.token(resource, token)
        async with self.conn.transaction(), self.conn.cursor() as cur:
            await cur.execute(self._sql["upsert"], (resource, token))
            if cur.rowcount != 1:
                await cur.execute(self._sql["select"], (resource,))
                row = await cur.fetchone()
                raise _stale(resource, token, None if row is None else int(row[0]))
            yield cur

    async def execute(self, resource: str, token: int, sql: Any, params: Sequence[Any] | dict[str, Any] = ()) -> int:
        """One fenced statement; returns its ``rowcount``."""
        async with self.fenced(resource, token) as cur:
            await cur.execute(sql, params)
            return cur.rowcount
