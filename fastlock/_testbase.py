"""Test support shipped with the package: real server processes and a history checker.

Used by fastlock's own tests, benches and demo, and usable by applications
that want to test their locking code against a real server::

    with ServerProcess(tmp_path / "data") as srv:
        async with fastlock.connect(srv.address) as client:
            ...

Servers that need principals (a standby, operator commands) get a
:class:`CredentialsDir`: ``ServerProcess(dir, args=creds.server_args("node-1"))``.

Servers are started as ``python -m fastlock serve --listen 127.0.0.1:0`` so
the kernel picks a free port; the port is read from the server's "listening on"
log line.  Crash tests use :meth:`ServerProcess.kill` (SIGKILL) and
:meth:`ServerProcess.pause` (SIGSTOP) on the real process.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Sequence

_LISTENING = re.compile(r"listening on ([0-9.]+):(\d+)")


class ServerProcess:
    """A ``fastlock serve`` subprocess on 127.0.0.1.

    Args:
        data_dir: the server's ``--data-dir``.
        fsync: ``always`` | ``interval`` | ``never``.
        port: 0 for a free port (default), or a fixed one (e.g. to restart a
            killed server on the port its clients know).
        args: extra command-line arguments.
    """

    def __init__(self, data_dir: str | os.PathLike, *, fsync: str = "always", port: int = 0,
                 args: Sequence[str] = (), log_level: str = "INFO", env: dict | None = None):
        self.data_dir = Path(data_dir)
        self.fsync = fsync
        self.port = port
        self.args = list(args)
        self.log_level = log_level
        self.env = env
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

    def start(self, timeout: float = 20.0) -> "ServerProcess":
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
        self.port = int(m.group(2))
        return self

    def _read(self, proc: subprocess.Popen) -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            with self._cond:
                self.lines.append(line.rstrip("\n"))
                self._cond.notify_all()
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
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGCONT)

    def _join(self) -> None:
        if self._reader is not None:
            self._reader.join(5)

    def __enter__(self) -> "ServerProcess":
        if self.proc is None:
            self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


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
        from .auth import generate

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


class HistoryChecker:
    """Records lock holdings as seen by clients and checks the safety properties.

    Call :meth:`held` when a client starts acting as the holder and
    :meth:`released` when it stops (use a single monotonic clock, e.g.
    ``time.monotonic()``, from one process).  :meth:`check` raises
    AssertionError on two overlapping holders of one lock or on a fencing token
    that does not increase, and returns the number of holdings checked.
    """

    def __init__(self) -> None:
        self._open: dict[tuple[str, int], float] = {}
        self._done: dict[str, list[tuple[float, float, int]]] = {}

    def held(self, name: str, token: int, at: float) -> None:
        key = (name, token)
        if key in self._open:
            raise AssertionError(f"token {token} of {name!r} handed out twice")
        self._open[key] = at

    def released(self, name: str, token: int, at: float) -> None:
        start = self._open.pop((name, token))
        self._done.setdefault(name, []).append((start, at, token))

    def check(self) -> int:
        if self._open:
            raise AssertionError(f"holdings never closed: {sorted(self._open)[:5]}")
        n = 0
        for name, spans in self._done.items():
            spans.sort()
            for (s1, e1, t1), (s2, e2, t2) in zip(spans, spans[1:]):
                if s2 < e1:
                    raise AssertionError(f"{name!r}: holders overlap: token {t1} [{s1}, {e1}] and {t2} [{s2}, {e2}]")
                if t2 <= t1:
                    raise AssertionError(f"{name!r}: fencing token went from {t1} to {t2}")
            n += len(spans)
        return n
