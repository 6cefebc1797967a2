"""Celery: a task that runs at most once at a time per key, with its fencing token.

Where celery-once and celery-singleton take a Redis lock (no fencing), this
takes a fastlock lease: it renews while the task runs, and the task gets the
lease's fencing token to pass to what it writes (so a task that lost its lease
- a long GC pause, a partition - cannot overwrite a newer run's work)::

    from celery import Celery
    from fastlock.contrib.celery import exclusive_task

    app = Celery("reports")
    app.conf.fastlock = {"SERVERS": ["10.0.0.5:7420", "10.0.0.6:7420"], "CLIENT_NAME": "reports"}

    @app.task
    @exclusive_task(key="report:{account_id}", ttl=60, when_held="retry", retry_countdown=30)
    def build_report(account_id, *, fencing_token):
        store.write(account_id, ..., fencing_token=fencing_token)

The decorator goes *under* ``@app.task``.  The task's callers do not pass
``fencing_token``: the decorator does.

Policies when another run holds the key (``when_held``):

``"skip"`` (default)
    do not run; the task returns ``None`` (logged at INFO).
``"retry"``
    ``task.retry(countdown=retry_countdown, max_retries=max_retries)`` with
    :class:`~fastlock.errors.LockNotAcquired` as the cause: Celery schedules
    the task again; after ``max_retries`` it fails with that error.
``"wait"``
    wait in the lock's FIFO queue for up to ``wait`` seconds, then run; if the
    wait runs out the task fails with :class:`~fastlock.errors.LockNotAcquired`.

The client is one :class:`~fastlock.sync.SyncClient` per worker process
(made again in each child of Celery's prefork pool), built from
``app.conf.fastlock`` (keys as :func:`fastlock.contrib.clients.client_from_options`),
or pass ``client=`` (a ``SyncClient`` or a zero-argument callable returning one).
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable
from typing import Any, Literal, TypeVar

from celery import current_app, current_task

from fastlock.contrib.clients import ProcessClient, client_from_options
from fastlock.errors import InvalidArgument, LockNotAcquired
from fastlock.sync import SyncClient

__all__ = ["exclusive_task", "close_client", "WhenHeld"]

log = logging.getLogger(__name__)

WhenHeld = Literal["skip", "retry", "wait"]
F = TypeVar("F", bound=Callable[..., Any])



def _client_from_app() -> SyncClient:
    # the running task's app (current_app is per thread, a task knows its own)
    app = current_task.app if current_task else current_app
    return client_from_options(dict(app.conf.get("fastlock") or {}))


_default_client = ProcessClient(_client_from_app)


def exclusive_task(key: str | Callable[..., str] | None = None, *, ttl: float = 60.0,
                   when_held: WhenHeld = "skip", wait: float | None = 30.0, retry_countdown: float = 10.0,
                   max_retries: int | None = 5, token_arg: str = "fencing_token",
                   client: SyncClient | Callable[[], SyncClient] | None = None) -> Callable[[F], F]:
    """Decorate a Celery task function so that one run at a time holds its key's lease.

    Args:
        key: the lock name: a ``str.format`` template over the task's arguments
            by parameter name (``"report:{account_id}"``), a callable taking the
            task's arguments and returning the name, or ``None`` for the task's
            name (one run at a time of the whole task).
        ttl: seconds; the lease's TTL.  The lease is renewed (about every
            ``ttl/3``) while the task runs, so ``ttl`` bounds only how long a
            crashed worker keeps others out.
        when_held: ``"skip"``, ``"retry"`` or ``"wait"`` (see the module doc).
        wait: seconds to wait with ``when_held="wait"`` (``None``: forever).
        retry_countdown: seconds until the retry, with ``when_held="retry"``.
        max_retries: retries before the task fails, with ``when_held="retry"``
            (``None``: Celery's task default).
        token_arg: the keyword argument that receives the fencing token (int);
            the function must accept it (a ``**kwargs`` parameter does; a
            caller's own value for it is replaced by the lease's).
        client: a :class:`SyncClient`, or a callable returning one; default:
            one per worker process from ``app.conf.fastlock``.

    Raises (when decorating):
        InvalidArgument: an unknown ``when_held``, or a function without a
            ``token_arg`` parameter.
    """
    if when_held not in ("skip", "retry", "wait"):
        raise InvalidArgument(f"when_held must be 'skip', 'retry' or 'wait', not {when_held!r}")

    def decorate(fn: F) -> F:
        sig = inspect.signature(fn)
        takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in sig.parameters.values())
        if token_arg not in sig.parameters and not takes_any:
            raise InvalidArgument(f"{fn.__qualname__} must accept the keyword argument {token_arg!r}")
        # what callers (and Celery's argument check) see: the signature without the token
        outer = sig.replace(parameters=[p for p in sig.parameters.values() if p.name != token_arg])

        def lock_name(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
            if key is None:
                task = current_task
                return f"celery/{task.name if task else fn.__module__ + '.' + fn.__qualname__}"
            if callable(key):
                return key(*args, **kwargs)
            bound = outer.bind(*args, **kwargs)
            bound.apply_defaults()
            return key.format(**bound.arguments)

        def get_client() -> SyncClient:
            if client is None:
                return _default_client.get()
            if isinstance(client, SyncClient):
                return client
            return client()

        @functools.wraps(fn)
        def run(*args: Any, **kwargs: Any) -> Any:
            name = lock_name(args, kwargs)
            sync = get_client()
            try:
                ctx = sync.lock(name, ttl=ttl, wait=wait if when_held == "wait" else 0)
                lease = ctx.__enter__()
            except LockNotAcquired as exc:
                if when_held == "skip":
                    log.info("task %s skipped: %s is held by another run", fn.__qualname__, name)
                    return None
                if when_held == "retry":
                    task = current_task
                    if task is None or task.request.called_directly:
                        raise  # called as a plain function: nothing to retry
                    raise task.retry(exc=exc, countdown=retry_countdown, max_retries=max_retries) from exc
                raise
            try:
                return fn(*args, **{**kwargs, token_arg: lease.fencing_token})
            finally:
                ctx.__exit__(None, None, None)

        run.__signature__ = outer  # type: ignore[attr-defined]
        return run  # type: ignore[return-value]

    return decorate


def close_client() -> None:
    """Close this process's default client (made from ``app.conf.fastlock``); the next
    task makes a new one (e.g. after changing the settings, or from ``worker_process_shutdown``)."""
    _default_client.reset()
