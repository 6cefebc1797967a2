"""The demo's ledger: an SQLite account whose every write is fenced.

One table of rows ``(worker, token, balance_before, amount, balance_after)``
and an account balance, written in one fenced transaction
(:class:`fastlock.fencing.SQLiteFence`) per entry; :func:`check_ledger`
tells whether the history is consistent (see :mod:`fastlock.cli.demo`).
"""

from __future__ import annotations

import sqlite3
from dataclasses import dataclass, field
from typing import Any

from ..fencing import SQLiteFence

#: the lock that guards the ledger
LOCK = "ledger"
#: the fencing table of :class:`~fastlock.fencing.SQLiteFence`
FENCE_TABLE = "fastlock_fence"


def create_ledger(path: str) -> None:
    """Create the ledger database: an account, the ledger rows, the fence table."""
    conn = sqlite3.connect(path, timeout=10)
    try:
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute(
            "CREATE TABLE ledger (seq INTEGER PRIMARY KEY AUTOINCREMENT, worker TEXT NOT NULL,"
            " token INTEGER NOT NULL, balance_before INTEGER NOT NULL, amount INTEGER NOT NULL,"
            " balance_after INTEGER NOT NULL)"
        )
        conn.execute("CREATE TABLE account (id INTEGER PRIMARY KEY, balance INTEGER NOT NULL)")
        conn.execute("INSERT INTO account (id, balance) VALUES (1, 0)")
        conn.commit()
        SQLiteFence(conn, FENCE_TABLE).ensure_schema()
    finally:
        conn.close()


def read_balance(conn: sqlite3.Connection) -> int:
    row = conn.execute("SELECT balance FROM account WHERE id = 1").fetchone()
    conn.commit()  # end the read transaction (legacy sqlite3 mode opens none for SELECT, but be explicit)
    return int(row[0])


def append_entry(fence: SQLiteFence, worker: str, token: int, balance_before: int, amount: int,
                 fenced: bool = True, proof: Any = None) -> None:
    """The fenced read-modify-write: a ledger row and the new balance, in one
    transaction that commits only if ``token`` is not stale.

    ``fenced=False`` (the demo's ``--unfenced``) skips the token check, to show
    what goes wrong without it.  ``proof``: what the fence checks instead of ``token``
    (the lease's signed sequencer, for a fence made with keys).

    :raises StaleFencingToken: a higher token already wrote to the ledger.
    """
    if not fenced:
        with fence.conn:  # a plain transaction, no token check
            fence.conn.execute(
                "INSERT INTO ledger (worker, token, balance_before, amount, balance_after) VALUES (?, ?, ?, ?, ?)",
                (worker, token, balance_before, amount, balance_before + amount),
            )
            fence.conn.execute("UPDATE account SET balance = ? WHERE id = 1", (balance_before + amount,))
        return
    with fence.fenced(LOCK, token if proof is None else proof) as cur:
        cur.execute(
            "INSERT INTO ledger (worker, token, balance_before, amount, balance_after) VALUES (?, ?, ?, ?, ?)",
            (worker, token, balance_before, amount, balance_before + amount),
        )
        cur.execute("UPDATE account SET balance = ? WHERE id = 1", (balance_before + amount,))


@dataclass
class LedgerCheck:
    rows: int = 0
    tokens_non_decreasing: bool = True
    chain_intact: bool = True
    rows_add_up: bool = True
    balance: int = 0
    sum_amounts: int = 0
    balance_matches: bool = True
    fence_matches: bool = True
    problems: list[str] = field(default_factory=list)

    @property
    def consistent(self) -> bool:
        return (self.tokens_non_decreasing and self.chain_intact and self.rows_add_up
                and self.balance_matches and self.fence_matches)


def check_ledger(path: str, fenced: bool = True) -> tuple[LedgerCheck, list[tuple]]:
    """Check the ledger's invariants; returns the result and the rows
    ``(seq, worker, token, balance_before, amount, balance_after)``.

    ``fenced``: also check that the fence table records the last row's token."""
    conn = sqlite3.connect(path, timeout=10)
    try:
        rows = conn.execute(
            "SELECT seq, worker, token, balance_before, amount, balance_after FROM ledger ORDER BY seq"
        ).fetchall()
        balance = int(conn.execute("SELECT balance FROM account WHERE id = 1").fetchone()[0])
        highest = SQLiteFence(conn, FENCE_TABLE).highest(LOCK)
    finally:
        conn.close()
    c = LedgerCheck(rows=len(rows), balance=balance)
    prev_token, prev_after = -1, 0
    for seq, worker, token, before, amount, after in rows:
        if token < prev_token:
            c.tokens_non_decreasing = False
            c.problems.append(f"row {seq} ({worker}) has token {token} after token {prev_token}")
        if before != prev_after:
            c.chain_intact = False
            c.problems.append(f"row {seq} ({worker}) starts from balance {before}, previous row left {prev_after}")
        if after != before + amount:
            c.rows_add_up = False
            c.problems.append(f"row {seq}: {before} + {amount} != {after}")
        prev_token, prev_after = token, after
        c.sum_amounts += amount
    c.balance_matches = balance == prev_after == c.sum_amounts
    if not c.balance_matches:
        c.problems.append(f"account balance {balance}, last row {prev_after}, sum of amounts {c.sum_amounts}")
    c.fence_matches = not fenced or highest == (rows[-1][2] if rows else None)
    if not c.fence_matches:
        c.problems.append(f"fence records token {highest}, last ledger row has {rows[-1][2] if rows else None}")
    return c, rows


# --------------------------------------------------------------------------- worker process
