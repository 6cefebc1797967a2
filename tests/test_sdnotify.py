"""fastlock.sdnotify against a real AF_UNIX datagram socket standing in for systemd's."""

from __future__ import annotations

import os
import socket

import pytest

from fastlock import sdnotify


@pytest.fixture
def notify_socket(tmp_path, monkeypatch):
    path = str(tmp_path / "notify.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.settimeout(5)
    monkeypatch.setenv("NOTIFY_SOCKET", path)
    yield sock
    sock.close()


def received(sock: socket.socket) -> list[str]:
    return sock.recv(4096).decode().split("\n")


def test_ready_status_stopping(notify_socket):
    assert sdnotify.ready("listening on 127.0.0.1:7420\n(primary)")
    assert received(notify_socket) == ["READY=1", f"MAINPID={os.getpid()}",
                                       "STATUS=listening on 127.0.0.1:7420 (primary)"]
    assert sdnotify.status("x" * 500)
    assert received(notify_socket) == ["STATUS=" + "x" * 200]
    assert sdnotify.stopping()
    assert received(notify_socket) == ["STOPPING=1"]


def test_abstract_socket(monkeypatch):
    name = f"fastlock-test-{os.getpid()}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(b"\0" + name.encode())
        sock.settimeout(5)
        monkeypatch.setenv("NOTIFY_SOCKET", "@" + name)
        assert sdnotify.stopping()
        assert received(sock) == ["STOPPING=1"]


def test_no_socket_is_a_no_op(monkeypatch):
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert sdnotify.ready() is False


def test_unreachable_socket_is_logged_not_raised(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "nobody-listens.sock"))
    assert sdnotify.ready() is False
    assert "could not notify" in caplog.text
    monkeypatch.setenv("NOTIFY_SOCKET", "relative/path")
    assert sdnotify.ready() is False


def test_assignments_cannot_smuggle_lines(notify_socket):
    with pytest.raises(ValueError):
        sdnotify.notify("READY=1\nSTOPPING=1")
    with pytest.raises(ValueError):
        sdnotify.notify("READY")


def test_server_notifies_ready_once_listening_and_stopping_on_sigterm(notify_socket, tmp_path):
    """A real ``fastlock serve`` under a stand-in for systemd's notify socket (Type=notify)."""
    from fastlock._testbase import ServerProcess

    srv = ServerProcess(tmp_path / "data", env={"NOTIFY_SOCKET": notify_socket.getsockname()})
    srv.start()
    try:
        ready = received(notify_socket)
        assert ready == ["READY=1", f"MAINPID={srv.pid}", f"STATUS=primary on {srv.address}"]
    finally:
        srv.stop()
    assert received(notify_socket) == ["STOPPING=1", "STATUS=primary: shutting down"]
