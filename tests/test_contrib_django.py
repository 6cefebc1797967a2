"""fastlock.contrib.django with Django's own machinery: settings.configure, override_settings
(the FASTLOCK setting changes per test: a new client), call_command on a LockedCommand."""

from __future__ import annotations

import io

import pytest

django = pytest.importorskip("django")

from django.conf import settings  # noqa: E402

if not settings.configured:
    settings.configure(INSTALLED_APPS=[], DATABASES={}, USE_TZ=True)
    django.setup()

from django.core.management import CommandError, call_command  # noqa: E402
from django.test import override_settings  # noqa: E402

from fastlock.contrib.django import LockedCommand, get_client, lock  # noqa: E402
from fastlock.errors import InvalidArgument, LockNotAcquired  # noqa: E402
from fastlock.sync import SyncClient  # noqa: E402


class Nightly(LockedCommand):
    help = "a cron job that must not run twice at once"
    lock_name = "cron/nightly"
    lock_ttl = 5
    observer: SyncClient  # another client, to ask the server who holds the lock

    def add_arguments(self, parser):
        parser.add_argument("--batch", type=int, default=1)

    def handle(self, *args, **options):
        holder = self.observer.holder(self.get_lock_name())
        self.stdout.write(f"batch {options['batch']} token {self.lease.fencing_token} holder {holder['token']}")


@pytest.fixture
def other_client(server):
    with SyncClient(server.address, client_name="other") as c:
        Nightly.observer = c
        yield c


@pytest.fixture
def fastlock_settings(server, other_client):
    with override_settings(FASTLOCK={"SERVERS": [server.address], "CLIENT_NAME": "django-test"}):
        yield server
    # leaving override_settings closed the settings' client (setting_changed)


def test_client_from_settings_and_lock(fastlock_settings, other_client):
    client = get_client()
    assert get_client() is client
    with lock("order:1", ttl=5) as lease:
        assert other_client.holder("order:1")["token"] == lease.fencing_token
        with pytest.raises(LockNotAcquired):
            with lock("order:1", wait=0.1):
                pass
    assert other_client.holder("order:1") is None


def test_changed_settings_make_a_new_client(fastlock_settings, server_factory):
    first = get_client()
    second_server = server_factory("second")
    with override_settings(FASTLOCK={"SERVERS": [second_server.address]}):
        assert get_client() is not first
        with lock("k", ttl=5) as lease:
            with SyncClient(second_server.address) as c:
                assert c.holder("k")["token"] == lease.fencing_token


def test_unknown_setting_is_refused(server):
    with override_settings(FASTLOCK={"SERVER": [server.address]}):  # a typo
        with pytest.raises(InvalidArgument, match="SERVER"):
            get_client()


def test_locked_command_runs_under_its_lock(fastlock_settings, other_client):
    out = io.StringIO()
    call_command(Nightly(), batch=3, stdout=out)
    batch, _, token, _, holder = out.getvalue().split()[1:6]
    assert batch == "3" and token == holder
    assert other_client.holder("cron/nightly") is None


def test_locked_command_refuses_a_second_run(fastlock_settings, other_client):
    with other_client.lock("cron/nightly", ttl=5):
        with pytest.raises(CommandError, match="already running"):
            call_command(Nightly(), stdout=io.StringIO())
        with pytest.raises(CommandError, match="already running"):
            call_command(Nightly(), lock_wait=0.1, stdout=io.StringIO())


def test_locked_command_waits_with_lock_wait(fastlock_settings, other_client):
    held = other_client.lock("cron/nightly", ttl=0.5).acquire()
    other_client.close()  # stops renewing: the lease runs out after its TTL, as a crashed run's would
    reopened = SyncClient(fastlock_settings.address)
    try:
        Nightly.observer = reopened
        out = io.StringIO()
        call_command(Nightly(), lock_wait=10, stdout=out)
        assert int(out.getvalue().split()[3]) > held.fencing_token
    finally:
        reopened.close()


def test_default_lock_name_is_per_command():
    assert Nightly().get_lock_name() == "cron/nightly"
    assert type("Command", (LockedCommand,), {"__module__": "shop.management.commands.sync"})().get_lock_name() \
        == "django/command/shop.management.commands.sync"


@pytest.mark.parametrize("bad", ["-1", "inf", "nan", "1e9", "soon"])
def test_a_bad_lock_wait_is_a_usage_error(fastlock_settings, bad):
    """``--lock-wait`` is checked by the parser (a CommandError from call_command, a usage
    error from manage.py), not raised from the client as a traceback; nothing is locked."""
    with pytest.raises(CommandError, match="wait|seconds"):
        call_command(Nightly(), "--lock-wait", bad, stdout=io.StringIO())
