"""Real ``fastlock serve`` subprocesses for tests and benches.

:class:`ServerProcess` starts ``python -m fastlock serve --listen 127.0.0.1:PORT``
(PORT 0 lets the kernel pick a free port; the port is read from the server's
"listening on" log line), keeps its log lines (stderr) for
:meth:`~ServerProcess.wait_for_log`, and can crash (:meth:`~ServerProcess.kill`,
SIGKILL), freeze (:meth:`~ServerProcess.pause`, SIGSTOP), resume and stop the
real process by its PID::

    with ServerProcess(tmp_path / "data") as srv:
        async with fastlock.connect(srv.address) as client:
            ...

Servers that need principals (a standby, operator commands) get a
:class:`CredentialsDir`: ``ServerProcess(dir, args=creds.server_args("node-1"))``.

A server restarted on the same port with the same data dir (what crash and
failover procedures do) is a new ``ServerProcess(data_dir, port=old.port, ...)``.
:func:`node_status` asks exactly one node for its status (no redirect), as
``fastlock status --server`` does.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

_LISTENING = re.compile(r"listening on ([0-9.]+):(\d+)")


class ServerProcess:
    """A ``fastlock serve`` subprocess on 127.0.0.1.

    Args:
        data_dir: the server's ``--data-dir``.
        fsync: ``always`` | ``interval`` | ``never``.
        port: 0 for a free port (default), or a fixed one (e.g. to restart a
            killed server on the port its clients know).
        args: extra command-line arguments.
        log_level: the server's ``--log-level``.
        env: variables added to this process's environment for the server.
        log_path: if given, every log line is also appended to this file
            (kept after the process ends, for a post-mortem).
    """

    def __init__(self, data_dir: str | os.PathLike, *, fsync: str = "always", port: int = 0,
                 args: Sequence[str] = (), log_level: str = "INFO", env: dict | None = None,
                 log_path: str | os.PathLike | None = None):
        self.data_dir = Path(data_dir)
        self.fsync = fsync
        self.port = port
        self.args = list(args)
        self.log_level = log_level
        self.env = env
        self.log_path = Path(log_path) if log_path is not None else None
        self.proc: subprocess.Popen | None = None
        self.lines: list[str] = []
        self._cond = threading.Condition()
        self._reader: threading.Thread | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        return [
            sys.executable, "-m", "fastlock", "serve",
            "--listen", f"127.0.0.1:{self.port}",
            "--data-dir", str(self.data_dir.resolve()),
            "--fsync", self.fsync,
            "--log-level", self.log_level,
            *self.args,
        ]

    def start(self, timeout: float = 20.0) -> ServerProcess:
        """Start the process and wait (at most ``timeout`` s) until it listens.

        Raises RuntimeError with the server's output if it exits or times out.
        """
        env = dict(os.environ)
        if self.env:
            env.update(self.env)
        with self._cond:
            self.lines = []
        self.data_dir.parent.mkdir(parents=True, exist_ok=True)
        # cwd outside any source tree, so `-m fastlock` imports the installed package
        self.proc = subprocess.Popen(
            self.command(), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            env=env, text=True, errors="replace", cwd=str(self.data_dir.parent),
        )
        self._reader = threading.Thread(target=self._read, args=(self.proc,), daemon=True)
        self._reader.start()
        line = self.wait_for_log(_LISTENING, timeout)
        m = _LISTENING.search(line)
        assert m is not None  # wait_for_log returned the line that matched
        self.port = int(m.group(2))
        return self

    def _read(self, proc: subprocess.Popen) -> None:
        assert proc.stderr is not None
        sink = open(self.log_path, "a", buffering=1) if self.log_path is not None else None
        try:
            for line in proc.stderr:
                if sink is not None:
                    sink.write(line)
                with self._cond:
                    self.lines.append(line.rstrip("\n"))
                    self._cond.notify_all()
        finally:
            if sink is not None:
                sink.close()
            with self._cond:
                self._cond.notify_all()

    def wait_for_log(self, pattern: str | re.Pattern, timeout: float = 10.0, start: int = 0) -> str:
        """Wait until a log line from index ``start`` on matches; return it."""
        rx = re.compile(pattern) if isinstance(pattern, str) else pattern
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                for line in self.lines[start:]:
                    if rx.search(line):
                        return line
                if self.proc is not None and self.proc.poll() is not None and not self._reader_alive():
                    raise RuntimeError(
                        f"server exited with {self.proc.returncode} before logging {rx.pattern!r}:\n"
                        + "\n".join(self.lines[-40:])
                    )
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RuntimeError(f"timed out waiting for {rx.pattern!r}:\n" + "\n".join(self.lines[-40:]))
                self._cond.wait(min(left, 0.2))

    def _reader_alive(self) -> bool:
        return self._reader is not None and self._reader.is_alive()

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    @property
    def alive(self) -> bool:
        """True while the process runs (a paused process is alive)."""
        return self.proc is not None and self.proc.poll() is None

    def status(self, timeout: float = 2.0, token: str | None = None) -> dict:
        """This node's ``status`` (see :func:`node_status`)."""
        return node_status(self.address, timeout, token)

    def stop(self, timeout: float = 10.0) -> int | None:
        """SIGTERM and wait; SIGKILL if it does not exit within ``timeout`` s."""
        proc = self.proc
        if proc is None:
            return None
        if proc.poll() is None:
            try:
                os.kill(proc.pid, signal.SIGCONT)  # a paused process cannot handle SIGTERM
                proc.send_signal(signal.SIGTERM)
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout)
            except ProcessLookupError:
                pass
        self._join()
        return proc.returncode

    def kill(self) -> None:
        """SIGKILL: a crash, with no chance to flush anything."""
        proc = self.proc
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(10)
        self._join()

    def pause(self) -> None:
        """SIGSTOP: the process freezes (a long GC pause, a VM stall)."""
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT: a paused process runs again."""
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGCONT)

    def _join(self) -> None:
        if self._reader is not None:
            self._reader.join(5)

    def __enter__(self) -> ServerProcess:
        if self.proc is None:
            self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


class WitnessProcess(ServerProcess):
    """A ``fastlock witness`` subprocess on 127.0.0.1 (:mod:`fastlock.replication.witness`):
    ``data_dir`` its ``--data``, ``credentials`` the pair's credentials file; started,
    killed, paused and stopped like a :class:`ServerProcess`."""

    def __init__(self, data_dir: str | os.PathLike, credentials: str, *, port: int = 0, log_level: str = "INFO",
                 args: Sequence[str] = ()):
        super().__init__(data_dir, port=port, args=["--credentials", credentials, *args], log_level=log_level)

    def command(self) -> list[str]:
        return [sys.executable, "-m", "fastlock", "witness", "--listen", f"127.0.0.1:{self.port}",
                "--data", str(self.data_dir.resolve()), "--log-level", self.log_level, *self.args]


class CredentialsDir:
    """A credentials directory for tests (made with :func:`fastlock.auth.generate`).

    Principals: ``app`` (client, every name), ``admin``, replicas ``node-1`` ..
    ``node-<replicas>``, and the anonymous client with every name (so code that
    connects without a token keeps working).  :attr:`file` is the credentials
    file for ``--credentials``; :meth:`token_file` and :meth:`token` give a
    principal's token.  ``cert_identities`` maps principals to mutual-TLS
    certificate CNs.
    """

    def __init__(self, directory: str | os.PathLike, *, replicas: int = 8, anonymous: bool = True,
                 cert_identities: dict | None = None):
        from fastlock.auth import generate

        self.directory = Path(directory)
        self.paths = generate(self.directory, clients=[("app", "")],
                              replicas=[f"node-{i}" for i in range(1, replicas + 1)], admins=["admin"],
                              anonymous_prefix="" if anonymous else None, cert_identities=cert_identities)
        self.file = str(self.directory / "credentials.toml")
        self._next_replica = 1
        self.replicas = replicas

    def token_file(self, principal: str) -> str:
        return self.paths[principal]

    def server_args(self, replica: str) -> list[str]:
        """``fastlock serve`` arguments: this credentials file, and ``replica``'s token to follow with."""
        return ["--credentials", self.file, "--standby-token-file", self.token_file(replica)]

    def token(self, principal: str) -> str:
        return Path(self.paths[principal]).read_text().strip()

    def next_replica(self) -> str:
        """A replica principal not handed out yet."""
        if self._next_replica > self.replicas:
            raise RuntimeError("no replica principal left: make CredentialsDir with more replicas")
        name = f"node-{self._next_replica}"
        self._next_replica += 1
        return name


def node_status(address: str, timeout: float = 2.0, token: str | None = None) -> dict:
    """Ask exactly the node at ``address`` (``"host:port"``) for its status.

    One HELLO + STATUS exchange on a fresh connection, no redirect (a standby
    reports itself), as ``fastlock status --server`` (the same code).
    ``timeout`` (seconds) bounds the wait for the reply; on loopback the
    connect itself is answered by the kernel at once, even for a frozen node.
    ``token``: the credential to present (default: the token in the file named
    by ``FASTLOCK_TOKEN_FILE``, else none); an admin sees replication details.

    Raises:
        OSError: the connection was refused or dropped.
        TimeoutError: no connection or no reply within ``timeout``.
        FastlockError: the node refused the request.
    """
    from fastlock.cli.admin import admin_request
    from fastlock.protocol import OP_STATUS
    from fastlock.units import parse_address

    if token is None and os.environ.get("FASTLOCK_TOKEN_FILE"):
        token = Path(os.environ["FASTLOCK_TOKEN_FILE"]).read_text().strip()
    return admin_request(parse_address(address, default_port=None), token, OP_STATUS, reply_timeout=timeout)


def power_cut(segment: str | os.PathLike, durable_offset: int) -> int:
    """Leave ``segment`` as an OS crash or a power cut may after a ``SIGKILL``: every
    byte after ``durable_offset`` (the last synced offset of the active segment, the
    status' ``wal.durable_offset``) lost.  The file keeps its size and those bytes
    read as zeros, as in a preallocated segment whose zero-filled blocks were synced
    and whose records written over them were not.

    :param segment: the segment's path.
    :param durable_offset: bytes known synced (int).
    :returns: the number of non-zero bytes lost (int).
    :raises OSError: the file cannot be read or written.
    """
    with open(segment, "r+b") as f:
        f.seek(durable_offset)
        lost = f.read()
        f.seek(durable_offset)
        f.write(bytes(len(lost)))
    return len(lost) - lost.count(0)

