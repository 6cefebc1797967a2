"""fastlock.contrib.celery against a real server, with Celery's eager mode (tasks run in the
caller's process through Celery's own apply(): argument checks, retries, results), and under
a real ``celery worker --pool=prefork`` (a client per child of the pool)."""

from __future__ import annotations

import threading

import pytest

celery = pytest.importorskip("celery")

from fastlock.contrib.celery import close_client, exclusive_task  # noqa: E402
from fastlock.errors import InvalidArgument, LockNotAcquired  # noqa: E402
from fastlock.sync import SyncClient  # noqa: E402


@pytest.fixture
def app(server):
    app = celery.Celery("fastlock-test", broker="memory://", backend="cache+memory://", set_as_current=True)
    app.conf.task_always_eager = True
    app.conf.task_eager_propagates = True
    app.conf.fastlock = {"SERVERS": [server.address], "CLIENT_NAME": "celery-test"}
    yield app
    close_client()


@pytest.fixture
def other(server):
    with SyncClient(server.address, client_name="other") as c:
        yield c


def test_task_runs_with_its_fencing_token_and_holds_the_key(app, other):
    seen = {}

    @app.task
    @exclusive_task(key="report:{account_id}", ttl=5)
    def build_report(account_id, *, fencing_token):
        seen["holder"] = other.holder(f"report:{account_id}")
        return fencing_token

    token = build_report.delay(account_id=7).get()
    assert seen["holder"]["token"] == token
    assert other.holder("report:7") is None  # released after the run
    assert build_report.delay(7).get() > token  # positional too; every run a newer token


def test_skip_when_held(app, other):
    runs = []

    @app.task
    @exclusive_task(key=lambda n: f"job:{n}", when_held="skip")
    def job(n, *, fencing_token):
        runs.append(fencing_token)
        return "ran"

    with other.lock("job:1", ttl=5):
        assert job.delay(1).get() is None
        assert job.delay(2).get() == "ran"  # another key is free
    assert len(runs) == 1


def test_retry_when_held_then_fails_with_lock_not_acquired(app, other):
    calls = []

    @app.task(bind=True)
    @exclusive_task(key="retrying", when_held="retry", retry_countdown=0, max_retries=2)
    def job(self, *, fencing_token):
        calls.append(fencing_token)

    app.conf.task_eager_propagates = False  # eager retries re-run in apply(): read the final result
    with other.lock("retrying", ttl=5):
        result = job.apply()
        assert result.failed()
        assert isinstance(result.result, LockNotAcquired)
    assert calls == []
    assert job.apply().successful() and len(calls) == 1


def test_wait_when_held(app, other):
    @app.task
    @exclusive_task(key="waiting", when_held="wait", wait=10)
    def job(*, fencing_token):
        return fencing_token

    held = other.lock("waiting", ttl=5).acquire()
    result = {}
    t = threading.Thread(target=lambda: result.update(token=job.delay().get()))
    t.start()
    other.release(held)
    t.join(15)
    assert result["token"] > held.fencing_token


def test_wait_runs_out(app, other):
    @app.task
    @exclusive_task(key="short", when_held="wait", wait=0.2)
    def job(*, fencing_token):
        return fencing_token

    with other.lock("short", ttl=5):
        with pytest.raises(LockNotAcquired):
            job.delay().get()


def test_default_key_is_the_task_name(app, other):
    @app.task(name="reports.nightly")
    @exclusive_task()
    def nightly(*, fencing_token):
        return other.holder("celery/reports.nightly")["token"] == fencing_token

    assert nightly.delay().get() is True


def test_bad_declarations_are_refused():
    with pytest.raises(InvalidArgument):
        exclusive_task(when_held="sometimes")  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match="fencing_token"):
        exclusive_task()(lambda: None)


def test_a_task_with_var_keywords_gets_the_token_there(app, other):
    """``**kwargs`` accepts the token argument: the declaration is not refused, and the token
    arrives in it (a caller's own ``fencing_token`` never overrides the lease's)."""

    @app.task(bind=True)
    @exclusive_task(key="acct:{account_id}")
    def sync_account(self, account_id, **options):
        return options

    got = sync_account.delay(4, mode="full").get()
    assert got["mode"] == "full" and got["fencing_token"] > 0
    forged = sync_account.delay(4, fencing_token=1).get()["fencing_token"]
    assert forged > got["fencing_token"]


PREFORK_TASKS = '''
import os, time
from celery import Celery
from fastlock.contrib.celery import _default_client, exclusive_task

HERE = os.path.dirname(os.path.abspath(__file__))
app = Celery("prefork_tasks", broker="filesystem://", backend="file://" + os.path.join(HERE, "results"))
app.conf.broker_transport_options = {"data_folder_in": os.path.join(HERE, "queue"),
                                     "data_folder_out": os.path.join(HERE, "queue"), "store_processed": False,
                                     "control_folder": os.path.join(HERE, "control")}
app.conf.worker_prefetch_multiplier = 1
app.conf.fastlock = {"SERVERS": [os.environ["FASTLOCK_TEST_SERVER"]], "CLIENT_NAME": "prefork"}
# the worker's parent process uses the client before the pool forks its children
PARENT_CLIENT = _default_client.get()
PARENT_CLIENT.ping()


@app.task
@exclusive_task(key="prefork:{n}", ttl=30)
def job(n, *, fencing_token):
    client = _default_client.get()
    # both tasks hold their lease at once (two children of the pool serve them): each one says
    # when it saw the other holding, and keeps its own lease until the other said so too
    deadline = time.monotonic() + 60
    other = 1 - n
    while client.holder(f"prefork:{other}") is None and client.get(f"seen/{other}") is None:
        assert time.monotonic() < deadline, "the other task never ran"
        time.sleep(0.05)
    client.put(f"seen/{n}", b"")
    while client.get(f"seen/{other}") is None:
        assert time.monotonic() < deadline, "the other task never saw this one"
        time.sleep(0.05)
    return {"pid": os.getpid(), "token": fencing_token, "holder": client.holder(f"prefork:{n}")["token"],
            "client_pid": _default_client._pid, "client": id(client), "parent_client": id(PARENT_CLIENT)}
'''


def test_a_prefork_worker_gives_each_child_its_own_client(server, tmp_path):
    """The recipe under a real ``celery worker --pool=prefork`` (filesystem broker, file
    results): a client the parent made before the fork is not used by the children; each
    child makes its own, and two children hold their leases at once."""
    import os
    import signal
    import subprocess
    import sys

    (tmp_path / "prefork_tasks.py").write_text(PREFORK_TASKS)
    for folder in ("queue", "results", "control"):
        (tmp_path / folder).mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("FASTLOCK_")}
    env["FASTLOCK_TEST_SERVER"] = server.address
    worker = subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "prefork_tasks", "worker", "--pool=prefork", "--concurrency=2",
         "-O", "fair",  # a task goes to an idle child only
         "--without-heartbeat", "--without-gossip", "--without-mingle", "--loglevel=INFO"],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    sender = celery.Celery("sender", broker="filesystem://", backend=f"file://{tmp_path / 'results'}")
    sender.conf.broker_transport_options = {"data_folder_in": str(tmp_path / "queue"),
                                            "data_folder_out": str(tmp_path / "queue"), "store_processed": False,
                                            "control_folder": str(tmp_path / "control")}
    runs, failure = [], None
    try:
        results = [sender.send_task("prefork_tasks.job", args=[n]) for n in (0, 1)]
        try:
            runs = [r.get(timeout=120) for r in results]
        except Exception as exc:  # noqa: BLE001 - reported below with the worker's output
            failure = exc
    finally:
        worker.send_signal(signal.SIGTERM)  # warm shutdown of the worker and its pool
        try:
            output, _ = worker.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(worker.pid, signal.SIGKILL)
            output, _ = worker.communicate(timeout=30)
    assert failure is None, f"{failure!r}\n{output}"
    assert len({run["pid"] for run in runs}) == 2, (runs, output)
    for run in runs:
        assert run["pid"] != worker.pid, (runs, output)  # a child of the pool ran it
        assert run["client_pid"] == run["pid"] and run["client"] != run["parent_client"], (runs, output)
        assert run["holder"] == run["token"], (runs, output)
    assert runs[0]["token"] != runs[1]["token"]
