"""Background tasks the server starts and does not await (promotions, their replies).

asyncio keeps only a weak reference to a task: one nobody holds may be
collected before it ends, and one that fails is reported only as "Task
exception was never retrieved" when it is.  :class:`BackgroundTasks` holds
every such task until it ends, logs a failure as an error (with its traceback
unless it is a :class:`~fastlock.errors.FastlockError`, a refusal the code
raised on purpose), and counts it for ``status`` (``tasks``: running, failed,
last_error).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any

from ..errors import FastlockError

log = logging.getLogger(__name__)


class BackgroundTasks:
    """The set of running background tasks, and the failures of those that ended."""

    def __init__(self) -> None:
        self._running: set[asyncio.Task] = set()
        self.failed = 0
        #: ``"<what>: <ExceptionType>: <message>"`` of the latest failure, or None
        self.last_error: str | None = None

    def spawn(self, coro: Coroutine[Any, Any, Any], what: str) -> asyncio.Task:
        """Run ``coro`` as a task named ``what`` (for logs and status), kept until it ends."""
        task = asyncio.ensure_future(coro)
        self._running.add(task)
        task.add_done_callback(lambda t: self._ended(t, what))
        return task

    def _ended(self, task: asyncio.Task, what: str) -> None:
        self._running.discard(task)
        if task.cancelled():
            return
        exc = task.exception()
        if exc is None:
            return
        self.failed += 1
        self.last_error = f"{what}: {exc.__class__.__name__}: {exc}"
        if isinstance(exc, FastlockError):
            log.error("%s failed: %s", what, exc)
        else:
            log.error("%s failed", what, exc_info=exc)

    def cancel_all(self) -> None:
        """Cancel every running task (at shutdown)."""
        for task in list(self._running):
            task.cancel()

    def status(self) -> dict:
        """``{"running", "failed", "last_error"}``."""
        return {"running": len(self._running), "failed": self.failed, "last_error": self.last_error}
