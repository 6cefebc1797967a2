"""History checkers: the safety properties of a recorded run, as Jepsen-style checks.

Two ways to record a history, for two kinds of run:

:class:`HistoryChecker`
    In one process, while the run goes on: call :meth:`~HistoryChecker.held`
    when a client starts acting as a lock's holder and
    :meth:`~HistoryChecker.released` when it stops; :meth:`~HistoryChecker.check`
    raises ``AssertionError`` on two overlapping holders or a token that does
    not grow.

:func:`check_store`, :func:`check_grants`, :func:`check_holdings`
    After the run, on records gathered from many processes (e.g. worker
    processes writing to a fenced SQLite store and to event logs).  Each
    returns a list of violations (readable sentences; empty when the history
    is safe), so that a bench can count them and a test can assert none.

Times are seconds on one monotonic clock shared by every recording process
(``time.monotonic()`` is the system-wide ``CLOCK_MONOTONIC`` on Linux, so the
processes of one machine agree on it).  The checks are in the spirit of etcd's
robustness tests, which check the recorded history of a fault-injection run
against a model instead of trusting the system's own view.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from ..tokens import counter_of, epoch_of


class HistoryChecker:
    """Records lock holdings as seen by clients and checks the safety properties.

    Call :meth:`held` when a client starts acting as the holder and
    :meth:`released` when it stops (use a single monotonic clock, e.g.
    ``time.monotonic()``, from one process).  A holding is exclusive (the
    default), shared (``shared=True``: a reader) or a semaphore permit
    (``limit=N``).  :meth:`check` raises AssertionError when

    * an exclusive holding overlaps any other holding of the lock (readers share,
      writers exclude);
    * more than N permits of a semaphore overlap at one instant;
    * a token is handed out twice, or a later holding's token is not greater than
      an earlier one's (``a`` ended before ``b`` began) - for every pair of
      exclusive holdings, of a writer and a reader, and of two permits;

    and returns the number of holdings checked.
    """

    def __init__(self) -> None:
        self._open: dict[tuple[str, int], tuple[float, bool, int]] = {}
        self._done: dict[str, list[tuple[float, float, int, bool, int]]] = {}
        self._tokens: set[tuple[str, int]] = set()

    def held(self, name: str, token: int, at: float, shared: bool = False, limit: int = 0) -> None:
        key = (name, token)
        if key in self._open or key in self._tokens:
            raise AssertionError(f"token {token} of {name!r} handed out twice")
        self._open[key] = (at, shared, limit)
        self._tokens.add(key)

    def released(self, name: str, token: int, at: float) -> None:
        start, shared, limit = self._open.pop((name, token))
        self._done.setdefault(name, []).append((start, at, token, shared, limit))

    def check(self) -> int:
        if self._open:
            raise AssertionError(f"holdings never closed: {sorted(self._open)[:5]}")
        n = 0
        for name, spans in self._done.items():
            spans.sort()
            for i, (s1, e1, t1, sh1, l1) in enumerate(spans):
                for s2, e2, t2, sh2, l2 in spans[i + 1:]:
                    if s2 >= e1:  # b began after a ended: a's token must be the smaller
                        if t2 <= t1 and (not (sh1 or l1) or not (sh2 or l2) or (l1 and l2)):
                            raise AssertionError(f"{name!r}: fencing token went from {t1} to {t2}")
                        continue
                    if not (sh1 or l1) or not (sh2 or l2):
                        raise AssertionError(f"{name!r}: holders overlap: token {t1} [{s1}, {e1}] and "
                                             f"{t2} [{s2}, {e2}] (an exclusive holder among them)")
                if l1:  # permits holding at s1 (the instant this one began)
                    at_start = sum(1 for s, e, _t, _sh, lim in spans if lim and s <= s1 < e)
                    if at_start > l1:
                        raise AssertionError(f"{name!r}: {at_start} permits held at once, limit {l1}")
            n += len(spans)
        return n


def token_str(token: int) -> str:
    """``epoch:counter`` - how tokens read in violation messages."""
    return f"{epoch_of(token)}:{counter_of(token)}"


@dataclass(frozen=True)
class StoreWrite:
    """One write the fenced store ACCEPTED.

    Attributes:
        seq: the store's commit order (e.g. an AUTOINCREMENT key).
        lock: the resource (lock name) the write was fenced on.
        token: the fencing token it carried.
        holding: who wrote: one holding of the lock by one client (e.g.
            ``"worker-3#17"``); two holdings never share a token.
        at: when the write happened, read inside the store's transaction.
    """

    seq: int
    lock: str
    token: int
    holding: str
    at: float


def check_store(writes: Iterable[StoreWrite]) -> list[str]:
    """The safety of a fenced store's accepted writes.

    A *critical section* is the span of one holding's accepted writes on one
    lock (from its first to its last).  Violations:

    * a token lower than an earlier accepted token of the same lock, in commit
      order (the fence must refuse it: the token went backwards);
    * one token accepted from two holdings (a token handed out twice);
    * two critical sections of one lock that overlap, in commit order or in
      time (two holders acted at once and the store accepted both).
    """
    out: list[str] = []
    by_lock: dict[str, list[StoreWrite]] = {}
    for w in writes:
        by_lock.setdefault(w.lock, []).append(w)
    for lock, ws in by_lock.items():
        ws.sort(key=lambda w: w.seq)
        highest: StoreWrite | None = None
        owner_of: dict[int, str] = {}
        spans: dict[str, list] = {}  # holding -> [first seq, last seq, first at, last at, token]
        for w in ws:
            if highest is not None and w.token < highest.token:
                out.append(f"{lock!r}: token {token_str(w.token)} by {w.holding} accepted at seq {w.seq} after "
                           f"token {token_str(highest.token)} by {highest.holding} (seq {highest.seq})")
            if highest is None or w.token >= highest.token:
                highest = w
            other = owner_of.setdefault(w.token, w.holding)
            if other != w.holding:
                out.append(f"{lock!r}: token {token_str(w.token)} accepted from two holdings, {other} and "
                           f"{w.holding}")
            span = spans.get(w.holding)
            if span is None:
                spans[w.holding] = [w.seq, w.seq, w.at, w.at, w.token]
            else:
                span[1], span[3] = w.seq, max(span[3], w.at)
        ordered = sorted(spans.items(), key=lambda kv: kv[1][0])
        last_seq: tuple[str, list] | None = None  # the section reaching furthest in commit order so far
        last_at: tuple[str, list] | None = None  # ... and in time
        for h, b in ordered:
            if last_seq is not None and b[0] < last_seq[1][1]:
                h1, a = last_seq
                out.append(f"{lock!r}: critical sections interleave in commit order: {h1} (token "
                           f"{token_str(a[4])}, seq {a[0]}..{a[1]}) and {h} (token {token_str(b[4])}, "
                           f"seq {b[0]}..{b[1]})")
            elif last_at is not None and b[2] < last_at[1][3]:
                h1, a = last_at
                out.append(f"{lock!r}: critical sections overlap in time: {h1} (token {token_str(a[4])}) "
                           f"until {a[3]:.3f} and {h} (token {token_str(b[4])}) from {b[2]:.3f}")
            if last_seq is None or b[1] > last_seq[1][1]:
                last_seq = (h, b)
            if last_at is None or b[3] > last_at[1][3]:
                last_at = (h, b)
    return out


@dataclass(frozen=True)
class GrantRecord:
    """One grant as its client saw it.

    Attributes:
        lock: the lock name.
        token: the fencing token granted.
        holding: which holding this grant started (unique per grant).
        sent: when the acquire was sent (the grant happened after).
        received: when the grant arrived (the grant happened before).
    """

    lock: str
    token: int
    holding: str
    sent: float
    received: float


def check_grants(grants: Iterable[GrantRecord]) -> list[str]:
    """Tokens never go backwards and are never handed out twice.

    Violations, per lock: one token granted to two holdings; and a grant whose
    acquire was sent after an earlier grant had been received (so the server
    granted it later in real time) but which carries a lower token.
    """
    out: list[str] = []
    by_lock: dict[str, list[GrantRecord]] = {}
    for g in grants:
        by_lock.setdefault(g.lock, []).append(g)
    for lock, gs in by_lock.items():
        seen: dict[int, str] = {}
        for g in gs:
            other = seen.setdefault(g.token, g.holding)
            if other != g.holding:
                out.append(f"{lock!r}: token {token_str(g.token)} granted twice, to {other} and {g.holding}")
        # sweep in send order, keeping the highest token received before each send
        received = sorted(gs, key=lambda g: g.received)
        i, best = 0, None
        for g in sorted(gs, key=lambda g: g.sent):
            while i < len(received) and received[i].received < g.sent:
                if best is None or received[i].token > best.token:
                    best = received[i]
                i += 1
            if best is not None and g.token < best.token:
                out.append(f"{lock!r}: token went backwards: {g.holding} sent its acquire at {g.sent:.3f}, after "
                           f"{best.holding} had received token {token_str(best.token)} at {best.received:.3f}, "
                           f"and was granted the lower token {token_str(g.token)}")
    return out


@dataclass(frozen=True)
class Holding:
    """A client's belief that it held a lock: from the grant's arrival to when
    it stopped acting as the holder (released, or noticed the lease lost)."""

    lock: str
    token: int
    holding: str
    start: float
    end: float


def check_holdings(holdings: Iterable[Holding]) -> list[str]:
    """Two clients that believed they held one lock at the same time.

    This is the client's view, stricter than :func:`check_store`: it also
    catches a holder that goes on acting after its lease is gone (a renewal
    that failed without setting ``lease.lost``).  It holds only when the new
    primary's promotion grace covers every TTL (the default grace): with a
    shorter grace the new primary may grant a lock whose unreplicated lease a
    holder still believes in, and only the fence protects the store.
    """
    out: list[str] = []
    by_lock: dict[str, list[Holding]] = {}
    for h in holdings:
        by_lock.setdefault(h.lock, []).append(h)
    for lock, hs in by_lock.items():
        hs.sort(key=lambda h: h.start)
        latest: Holding | None = None  # the holding with the latest end so far
        for h in hs:
            if latest is not None and h.start < latest.end:
                out.append(f"{lock!r}: {latest.holding} (token {token_str(latest.token)}) believed it held until "
                           f"{latest.end:.3f}, {h.holding} (token {token_str(h.token)}) from {h.start:.3f}")
            if latest is None or h.end > latest.end:
                latest = h
    return out
