"""A throwaway single-member etcd server for tests.

``EtcdServer`` starts ``etcd`` on 127.0.0.1 with free client and peer ports
and its data directory in a fresh temporary directory, waits (bounded) until
its v3 JSON gateway answers, and offers the faults the coordinator tests
need: :meth:`EtcdServer.pause` / :meth:`EtcdServer.resume` (SIGSTOP /
SIGCONT), :meth:`EtcdServer.kill` (SIGKILL) and :meth:`EtcdServer.restart`
(same ports, same data: keys and leases survive, as after a crash).
:meth:`EtcdServer.stop` ends the process by its PID and removes the
directory.  One server serves a whole test session; each test uses its own
key prefix (:func:`unique_prefix`).

The binary is ``$FASTLOCK_ETCD_BIN``, else ``etcd`` on ``PATH`` (Debian's
``etcd-server`` package).  :func:`require_etcd` skips a test when it is
absent, or fails it when ``FASTLOCK_REQUIRE_ETCD=1`` (CI sets it).

Usage::

    with EtcdServer() as etcd:
        url = etcd.url  # "http://127.0.0.1:PORT"
"""

from __future__ import annotations

import http.client
import os
import shutil
import signal
import subprocess
import tempfile
import time
import uuid

import pytest
from throwaway import ProcessOutput, free_port

__all__ = ["EtcdServer", "EtcdUnavailable", "find_etcd", "require_etcd", "unique_prefix"]

REQUIRE_ETCD = os.environ.get("FASTLOCK_REQUIRE_ETCD") == "1"


class EtcdUnavailable(RuntimeError):
    """No etcd binary was found (the tests skip, with this reason)."""


def find_etcd() -> str:
    """The path of the etcd binary.

    :raises EtcdUnavailable: none was found.
    """
    path = os.environ.get("FASTLOCK_ETCD_BIN") or shutil.which("etcd")
    if not path or not os.access(path, os.X_OK):
        raise EtcdUnavailable("the etcd binary was not found; install it (Debian/Ubuntu: apt-get install -y "
                              "etcd-server) or set FASTLOCK_ETCD_BIN")
    return path


def require_etcd(reason: str) -> None:
    """Skip the calling test for ``reason``, or fail it with ``FASTLOCK_REQUIRE_ETCD=1``."""
    if REQUIRE_ETCD:
        pytest.fail(f"FASTLOCK_REQUIRE_ETCD=1 but {reason}")
    pytest.skip(reason)


def unique_prefix() -> str:
    """A key prefix no other test of the session uses."""
    return f"/fastlock-test-{uuid.uuid4().hex[:12]}"


class EtcdServer:
    """One throwaway etcd member.

    :param start_timeout: seconds to wait for the server to answer before
        giving up with ``RuntimeError`` (the log tail is in the message).

    Attributes after :meth:`start`: ``port`` (clients), ``peer_port``,
    ``url`` (``http://127.0.0.1:PORT``), ``address`` (``127.0.0.1:PORT``), ``pid``.
    """

    def __init__(self, start_timeout: float = 30.0) -> None:
        self.binary = find_etcd()
        self.start_timeout = start_timeout
        self.port = 0
        self.peer_port = 0
        self.base: str | None = None
        self.proc: subprocess.Popen | None = None
        self.paused = False
        self._output = ProcessOutput()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    def log_tail(self, n: int = 30) -> str:
        return self._output.tail(n)

    def healthy(self, timeout: float = 1.0) -> bool:
        """Does the gateway answer a range request now?"""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            conn.request("POST", "/v3/kv/range", body=b'{"key":"AA=="}')
            return conn.getresponse().status == 200
        except OSError:
            return False
        finally:
            conn.close()

    # -- lifecycle
    def start(self) -> EtcdServer:
        """Start on free ports in a new data directory; returns self once it answers.

        :raises RuntimeError: it did not answer within ``start_timeout``.
        """
        self.base = tempfile.mkdtemp(prefix="fastlock-etcd-")
        try:
            for _ in range(3):  # a free port can be taken between probe and bind: retry on new ones
                self.port, self.peer_port = free_port(), free_port()
                if self._launch():
                    return self
            raise RuntimeError(f"etcd did not start:\n{self.log_tail()}")
        except BaseException:
            self.stop()
            raise

    def _launch(self) -> bool:
        assert self.base is not None
        peer = f"http://127.0.0.1:{self.peer_port}"
        self.proc = subprocess.Popen(
            [self.binary, "--name", "t", "--data-dir", os.path.join(self.base, "data"),
             "--listen-client-urls", self.url, "--advertise-client-urls", self.url,
             "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
             "--initial-cluster", f"t={peer}", "--initial-cluster-state", "new",
             "--heartbeat-interval", "50", "--election-timeout", "500",
             "--logger", "zap", "--log-outputs", "stderr", "--log-level", "warn"],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self._output.follow(self.proc.stdout)
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.proc = None
                return False
            if self.healthy(0.5):
                return True
            time.sleep(0.05)
        raise RuntimeError(f"etcd not ready after {self.start_timeout}s:\n{self.log_tail()}")

    def _signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, sig)

    def pause(self) -> None:
        """SIGSTOP: the process holds its sockets and answers nothing."""
        self._signal(signal.SIGSTOP)
        self.paused = True

    def resume(self) -> None:
        """SIGCONT after :meth:`pause`."""
        self._signal(signal.SIGCONT)
        self.paused = False

    def kill(self) -> None:
        """SIGKILL, keeping the data directory (:meth:`restart` brings it back)."""
        proc, self.proc = self.proc, None
        if proc is not None:
            if self.paused:
                os.kill(proc.pid, signal.SIGCONT)
                self.paused = False
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)

    def restart(self) -> None:
        """Kill and start again on the same ports with the same data (keys and leases survive).

        :raises RuntimeError: it did not come back within ``start_timeout``.
        """
        self.kill()
        if not self._launch():
            raise RuntimeError(f"etcd did not restart on port {self.port}:\n{self.log_tail()}")

    def stop(self) -> None:
        """Kill the process and remove its files; safe to call more than once."""
        self.kill()
        if self.base is not None:
            shutil.rmtree(self.base, ignore_errors=True)
            self.base = None

    def __enter__(self) -> EtcdServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
