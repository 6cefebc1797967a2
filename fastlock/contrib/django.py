"""Django: a client from settings, a ``lock()`` context manager, a management-command lock.

Settings (``settings.FASTLOCK``, every key optional; as
:func:`fastlock.contrib.clients.client_from_options`)::

    FASTLOCK = {
        "SERVERS": ["10.0.0.5:7420", "10.0.0.6:7420"],
        "CLIENT_NAME": "shop-web",
        "TOKEN_FILE": "/run/secrets/fastlock-token",
    }

In code, as django-pglocks' ``advisory_lock`` or django-redis'
``cache.lock()``, but with a fencing token::

    from fastlock.contrib.django import lock

    with lock(f"order:{order.pk}", ttl=30, wait=5) as lease:
        order.refresh_from_db()
        ...  # write with lease.fencing_token

A management command that must not run twice at once (a cron job on several
hosts)::

    from fastlock.contrib.django import LockedCommand

    class Command(LockedCommand):
        lock_ttl = 300
        def handle(self, *args, **options):
            ...  # self.lease.fencing_token

It gets ``--lock-wait SECONDS`` (default 0: exit with a ``CommandError`` at
once if another run holds the lock; 0 to 86400, checked by the parser).

One :class:`~fastlock.sync.SyncClient` per process (made on first use,
made again in a forked child, closed and remade when ``FASTLOCK`` changes,
e.g. under ``override_settings``).
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Iterator
from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.core.signals import setting_changed

from fastlock.contrib.clients import ProcessClient, client_from_options
from fastlock.errors import FastlockError, LockNotAcquired
from fastlock.protocol import MAX_WAIT_MS
from fastlock.sync import SyncClient, SyncLease
from fastlock.units import check_seconds

__all__ = ["LockedCommand", "get_client", "lock", "lock_wait_arg"]

_client = ProcessClient(lambda: client_from_options(dict(getattr(settings, "FASTLOCK", None) or {})))


def get_client() -> SyncClient:
    """This process's :class:`SyncClient`, built from ``settings.FASTLOCK`` on first use.

    Raises:
        InvalidArgument: an unknown key in ``FASTLOCK``.
        ConnectionLost: no server accepted the connection (as :class:`SyncClient`).
    """
    return _client.get()


def _on_setting_changed(*, setting: str, **_: Any) -> None:
    if setting == "FASTLOCK":
        _client.reset()


setting_changed.connect(_on_setting_changed, dispatch_uid="fastlock.contrib.django")


@contextlib.contextmanager
def lock(name: str, *, ttl: float = 60.0, wait: float | None = 0.0) -> Iterator[SyncLease]:
    """Hold lock ``name`` (renewed while the block runs) and yield its :class:`SyncLease`.

    Args:
        name: the lock name.
        ttl: seconds; the lease's TTL (it is renewed about every ``ttl/3``).
        wait: seconds to wait in the lock's FIFO queue (``0``: try once,
            ``None``: forever).

    Raises:
        LockNotAcquired: another holder kept it for the whole ``wait``.
        ConnectionLost, NotPrimary...: as :meth:`SyncClient.lock`.

    The block is not interrupted if the lease is lost: check ``lease.lost``
    or pass ``lease.fencing_token`` to the writes.
    """
    with get_client().lock(name, ttl=ttl, wait=wait) as lease:
        yield lease


def lock_wait_arg(text: str) -> float:
    """The argparse type of ``--lock-wait``: seconds, 0 (try once) to the protocol's longest
    wait (24 h).  A bad value is the parser's error: a usage error from ``manage.py``, a
    :class:`CommandError` from ``call_command``; nothing is locked.

    Raises:
        argparse.ArgumentTypeError: not a number, NaN, infinite, negative or too long.
    """
    try:
        number = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--lock-wait expects a number of seconds, got {text!r}") from None
    try:
        return check_seconds(number, "--lock-wait", allow_zero=True, maximum=MAX_WAIT_MS / 1000)
    except FastlockError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


class LockedCommand(BaseCommand):
    """A management command whose ``handle()`` runs under a lock, one run at a time.

    Class attributes:
        lock_name (str | None): the lock; default ``"django/command/<module>"``
            (the command's module, so one lock per command).
        lock_ttl (float): seconds; the lease's TTL (renewed while ``handle`` runs).
        lock_wait (float): default of ``--lock-wait``, seconds (0: fail at once).

    ``self.lease`` is the :class:`SyncLease` while ``handle`` runs.  A held lock
    raises :class:`CommandError` ("already running"), so ``manage.py`` exits 1.
    """

    lock_name: str | None = None
    lock_ttl: float = 60.0
    lock_wait: float = 0.0
    lease: SyncLease | None = None

    def create_parser(self, prog_name: str, subcommand: str, **kwargs: Any) -> CommandParser:
        parser = super().create_parser(prog_name, subcommand, **kwargs)
        parser.add_argument("--lock-wait", type=lock_wait_arg, default=self.lock_wait, metavar="SECONDS",
                            help="seconds to wait for another run of this command to finish (default: "
                                 f"{self.lock_wait})")
        return parser

    def get_lock_name(self) -> str:
        return self.lock_name or f"django/command/{type(self).__module__}"

    def execute(self, *args: Any, **options: Any) -> Any:
        name = self.get_lock_name()
        wait = options.pop("lock_wait", self.lock_wait)
        try:
            ctx = lock(name, ttl=self.lock_ttl, wait=wait)
            self.lease = ctx.__enter__()
        except LockNotAcquired as exc:
            raise CommandError(f"already running: lock {name!r} is held ({exc})") from exc
        try:
            return super().execute(*args, **options)
        finally:
            self.lease = None
            ctx.__exit__(None, None, None)
