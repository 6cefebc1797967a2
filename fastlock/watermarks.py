"""Fence anything with signed sequencers: a high-water-mark store interface, two stores
(in memory, a file) and :class:`SequencerFence`, which verifies a sequencer and then
advances the mark.

The SQLite and PostgreSQL fences (:mod:`fastlock.fencing`) keep the mark in the same
transaction as the write.  Other stores need the same two steps, in this order:

1. **verify** the sequencer (:func:`fastlock.sequencer.verify`: signature, key id,
   resource name, expiry), which needs no store at all;
2. **advance** the mark only if the sequencer's token is at least the highest accepted
   for the resource, *atomically with the write* where the store allows it.

:class:`HighWaterMarks` is step 2's interface; :class:`MemoryHighWaterMarks` (one
process) and :class:`FileHighWaterMarks` (processes of one host, an ``fcntl`` lock and an
atomic rename) implement it.  For a store with conditional writes, the mark lives beside
the data and the write carries the condition.  Redis, for example, with one script that
checks and writes together (``EVAL``; the key ``fence:{resource}`` holds the mark)::

    local highest = tonumber(redis.call('GET', KEYS[1]) or '-1')
    if tonumber(ARGV[1]) < highest then return redis.error_reply('stale') end
    redis.call('SET', KEYS[1], ARGV[1])
    redis.call('SET', KEYS[2], ARGV[2])   -- the fenced write
    return 'OK'

called after ``verify`` as ``EVAL script 2 fence:orders/42 orders/42 <token> <value>``.
An object store does the same with a conditional put (``If-Match`` on the ETag of an
object that records the token).
"""

from __future__ import annotations

import abc
import asyncio
import json
import os
import threading
from collections.abc import Iterable
from typing import Any

from . import sequencer as seq
from .errors import StaleFencingToken, WrongArgumentType

__all__ = ["HighWaterMarks", "MemoryHighWaterMarks", "FileHighWaterMarks", "SequencerFence"]


def _stale(resource: str, token: int, highest: int | None) -> StaleFencingToken:
    return StaleFencingToken(
        f"stale fencing token {token} for {resource!r}: a write with token {highest} was already accepted",
        token=token, highest=highest)


class HighWaterMarks(abc.ABC):
    """The highest token accepted per resource (the writer's side of fencing)."""

    @abc.abstractmethod
    def advance(self, resource: str, token: int) -> None:
        """Record ``token`` for ``resource`` if it is at least the highest recorded (equal
        tokens pass: one lease writes many times), atomically with respect to every other
        caller of this store.

        :raises StaleFencingToken: ``token`` is lower; nothing changed."""

    @abc.abstractmethod
    def highest(self, resource: str) -> int | None:
        """The highest token accepted for ``resource``, or None."""


class MemoryHighWaterMarks(HighWaterMarks):
    """Marks in a dict, for one process (threads included: a lock guards it).

    :param max_resources: most resources remembered (default 1,000,000); beyond it
        :meth:`advance` raises ``OverflowError`` rather than forget a mark (forgetting
        would let a stale holder in again)."""

    def __init__(self, max_resources: int = 1_000_000) -> None:
        self._marks: dict[str, int] = {}
        self._lock = threading.Lock()
        self.max_resources = max_resources

    def advance(self, resource: str, token: int) -> None:
        with self._lock:
            highest = self._marks.get(resource)
            if highest is not None and token < highest:
                raise _stale(resource, token, highest)
            if highest is None and len(self._marks) >= self.max_resources:
                raise OverflowError(f"more than {self.max_resources} fenced resources")
            self._marks[resource] = token

    def highest(self, resource: str) -> int | None:
        with self._lock:
            return self._marks.get(resource)


class FileHighWaterMarks(HighWaterMarks):
    """Marks in one JSON file (``{resource: token}``), shared by the processes of one host:
    each :meth:`advance` takes an exclusive ``fcntl.flock`` on ``path + ".lock"``, reads the
    file, and replaces it with ``os.replace`` after an ``fsync`` (a crash leaves the old
    file or the new one, never a torn one).

    :param path: the file (made on the first accepted token, mode 0600).
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)

    def _read(self) -> dict[str, int]:
        try:
            with open(self.path, encoding="utf-8") as f:
                data = json.load(f)
        except FileNotFoundError:
            return {}
        if not isinstance(data, dict):
            raise ValueError(f"{self.path}: not a high-water-mark file")
        return data

    def advance(self, resource: str, token: int) -> None:
        import fcntl
        fd = os.open(self.path + ".lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            marks = self._read()
            highest = marks.get(resource)
            if highest is not None and token < highest:
                raise _stale(resource, token, highest)
            if highest == token:
                return
            marks[resource] = token
            tmp = f"{self.path}.{os.getpid()}.tmp"
            out = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(out, "w", encoding="utf-8") as f:
                json.dump(marks, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        finally:
            os.close(fd)  # releases the flock

    def highest(self, resource: str) -> int | None:
        value = self._read().get(resource)
        return None if value is None else int(value)


class SequencerFence:
    """Verify a sequencer, then advance its resource's high-water mark.

    :param keys: the group's verify keys (:class:`fastlock.sequencer.VerifyKey`; several
        during a key rotation).
    :param marks: the store (default: a :class:`MemoryHighWaterMarks`).
    :param skew: seconds a sequencer stays accepted after its lease's expiry (default
        :data:`fastlock.sequencer.DEFAULT_SKEW`); None: expiry not checked.
    :param modes: the lease modes whose sequencers pass (default
        :data:`fastlock.sequencer.WRITE_MODES`, exclusive only: a shared lease or a semaphore
        permit has several holders at once); None: any mode.
    :raises MalformedSequencer: an unknown mode in ``modes``.

    Example (a file store shared by the workers of one host)::

        fence = SequencerFence(keys_from_text(open("group.pub").read()),
                               FileHighWaterMarks("/var/lib/app/fence.json"))
        fence.check("reports/daily", lease.sequencer)   # raises if forged or stale
        write_the_report()
    """

    def __init__(self, keys: Iterable[seq.VerifyKey] | seq.VerifyKey, marks: HighWaterMarks | None = None, *,
                 skew: float | None = seq.DEFAULT_SKEW, modes: Iterable[str] | None = seq.WRITE_MODES) -> None:
        table = {keys.key_id: keys} if isinstance(keys, seq.VerifyKey) else {k.key_id: k for k in keys}
        if not table or not all(isinstance(k, seq.VerifyKey) for k in table.values()):
            raise WrongArgumentType("keys must be fastlock.sequencer.VerifyKey objects (at least one)")
        self.keys = table
        self.marks = marks if marks is not None else MemoryHighWaterMarks()
        self.skew = seq.check_skew(skew)
        self.modes = seq.check_modes(modes)

    def verify(self, resource: str, sequencer: Any) -> seq.Sequencer:
        """Step 1 alone: the verified :class:`~fastlock.sequencer.Sequencer` for ``resource``.

        :raises SequencerRejected: forged, altered, another resource's, an unknown key's,
            expired, of a mode the fence does not take (:class:`WrongSequencerMode`), or
            not a sequencer."""
        if isinstance(sequencer, seq.Sequencer):
            sequencer = sequencer.blob
        elif not isinstance(sequencer, (str, bytes, bytearray, memoryview)):
            sequencer = getattr(sequencer, "sequencer", None)  # a Lease
            if sequencer is None:
                raise seq.MalformedSequencer(f"{resource!r} is fenced by signed sequencers only, not a bare token")
        return seq.verify(sequencer, self.keys, name=resource, skew=self.skew, modes=self.modes)

    def check(self, resource: str, sequencer: Any) -> seq.Sequencer:
        """Verify ``sequencer`` for ``resource`` and advance the mark to its token.

        :raises SequencerRejected: as :meth:`verify`; the mark is not touched.
        :raises StaleFencingToken: a later holder's token was already accepted."""
        verified = self.verify(resource, sequencer)
        self.marks.advance(resource, verified.token)
        return verified

    async def check_async(self, resource: str, sequencer: Any) -> seq.Sequencer:
        """:meth:`check` from a coroutine: a store that blocks (the file store) runs in a thread."""
        verified = self.verify(resource, sequencer)
        if isinstance(self.marks, MemoryHighWaterMarks):
            self.marks.advance(resource, verified.token)
        else:
            await asyncio.to_thread(self.marks.advance, resource, verified.token)
        return verified
