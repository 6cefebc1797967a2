"""Server bugs and background failures are errors, not silence: a handler that raises
answers InternalServerError and the server keeps serving; a background task that fails
(an automatic promotion) is logged as an error and counted in ``status``."""

from __future__ import annotations

import asyncio
import gc
import logging

import pytest
from fakehost import FakeHost

import fastlock
from fastlock import protocol as P
from fastlock.errors import InternalServerError, ProtocolError, error_from_wire
from fastlock.replication import ReplicationSource, StandbyFollower
from fastlock.roles import Role
from fastlock.server import LockServer, ServerConfig
from fastlock.server.failover import FailoverPolicy


def test_internal_server_error_has_its_own_wire_code():
    assert InternalServerError.code not in (0, ProtocolError.code)
    assert type(error_from_wire(InternalServerError.code, "boom")) is InternalServerError


@pytest.fixture
async def in_process_server(tmp_path, loop_errors):
    server = LockServer(ServerConfig(port=0, data_dir=str(tmp_path / "data"), fsync="never"))
    await server.start()
    yield server
    await server.close()


async def test_a_handler_bug_answers_internal_server_error_and_the_server_keeps_serving(in_process_server, caplog):
    server = in_process_server
    holder, fewest, most = server.handlers.by_op[P.OP_HOLDER]

    def buggy(conn, req_id, msg):
        raise KeyError("a bug in the handler")

    server.handlers.by_op[P.OP_HOLDER] = (buggy, fewest, most)
    client = await fastlock.connect(f"{server.address[0]}:{server.address[1]}", client_name="t")
    try:
        with caplog.at_level(logging.ERROR, logger="fastlock.server"):
            with pytest.raises(InternalServerError):
                await client.holder("x")
        [record] = [r for r in caplog.records if "internal error handling holder" in r.getMessage()]
        assert record.exc_info is not None and record.exc_info[0] is KeyError  # logged with its traceback
        # the same connection keeps working, and nothing was changed
        await client.ping()
        server.handlers.by_op[P.OP_HOLDER] = (holder, fewest, most)
        assert await client.holder("x") is None
        lease = await client.acquire("x", ttl=5)
        assert (await client.holder("x"))["token"] == lease.fencing_token
    finally:
        await client.close()


async def test_a_failed_background_task_is_logged_and_in_status(in_process_server, caplog):
    server = in_process_server
    assert server.failover.tasks is server.tasks  # promotions run in the server's task set
    assert server.status()["tasks"] == {"running": 0, "failed": 0, "last_error": None}

    async def fails():
        raise OSError("disk gone")

    with caplog.at_level(logging.ERROR, logger="fastlock.server"):
        await asyncio.wait([server.tasks.spawn(fails(), "test task")])
    assert server.status()["tasks"] == {"running": 0, "failed": 1, "last_error": "test task: OSError: disk gone"}
    assert any(r.levelno == logging.ERROR and "test task failed" in r.getMessage() and r.exc_info
               for r in caplog.records)


async def test_a_failed_automatic_promotion_is_an_error_in_the_log_and_in_the_task_status(tmp_path, caplog):
    host = FakeHost(str(tmp_path), Role.STANDBY, primary_address="127.0.0.1:9")
    follower = StandbyFollower(host, ("127.0.0.1", 9), 1000, name="east@id-1")
    follower.synced = True
    follower.start = lambda: None  # no sockets
    policy = FailoverPolicy(host, ReplicationSource(host), follower, promotion_grace_ms=500, clock=host.clock)
    host.wal.fail_durability = OSError("disk gone")
    unseen: list[dict] = []
    asyncio.get_running_loop().set_exception_handler(lambda _loop, context: unseen.append(context))
    with caplog.at_level(logging.ERROR, logger="fastlock.server"):
        task = policy.on_primary_silent()
        await asyncio.wait([task])  # waits without retrieving the exception: the task set must
    del task
    gc.collect()
    assert unseen == []  # no "Task exception was never retrieved"
    assert host.roles.role is Role.STANDBY
    status = policy.tasks.status()
    assert status["failed"] == 1 and status["last_error"] == "automatic promotion: OSError: disk gone"
    assert any(r.levelno == logging.ERROR and "automatic promotion failed" in r.getMessage()
               for r in caplog.records)
    assert policy.on_primary_silent() is None  # no retry before another failover window



def test_a_storage_error_travels_as_unavailable_and_other_codeless_errors_as_internal():
    import msgpack

    from fastlock.errors import FastlockError, Unavailable, WalFatal
    from fastlock.server.handlers import _error_reply

    req_id, code, message, _ = msgpack.unpackb(_error_reply(7, WalFatal("disk full")))
    assert req_id == 7 and isinstance(error_from_wire(code, message), Unavailable)
    assert "disk full" in message
    _, code, message, _ = msgpack.unpackb(_error_reply(8, FastlockError("odd")))
    assert isinstance(error_from_wire(code, message), InternalServerError)
