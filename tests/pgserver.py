"""A throwaway PostgreSQL server for tests.

``PostgresServer`` runs ``initdb`` into a fresh temporary directory, starts
``postgres`` on 127.0.0.1 with a free port and its unix socket inside that
directory, waits (bounded) until the server logs that it accepts connections,
and on ``stop()`` shuts it down with ``pg_ctl stop -m immediate`` (falling back
to SIGKILL of its process group) and removes the directory.

Binaries are looked up in ``$FASTLOCK_PG_BIN``, then on ``PATH``, then in
``/usr/lib/postgresql/<version>/bin`` (Debian/Ubuntu's ``postgresql`` package),
``/usr/pgsql-<version>/bin`` (RHEL) and ``/usr/local/pgsql/bin``.

PostgreSQL refuses to run as root.  As root, the server runs as the
``postgres`` system user that the distribution package creates, else as
``nobody``; the temporary directory is chowned to that user.

Usage::

    with PostgresServer() as pg:
        conn = psycopg.connect(pg.dsn)
"""

from __future__ import annotations

import glob
import os
import pwd
import re
import shutil
import signal
import subprocess
import tempfile
import threading
import time

from throwaway import ProcessOutput, free_port

__all__ = ["PostgresServer", "PostgresUnavailable", "find_pg_bin"]

_READY = "database system is ready to accept connections"


class PostgresUnavailable(RuntimeError):
    """No PostgreSQL server binaries were found (the tests skip, with this reason)."""


def _version_key(path: str) -> tuple:
    return tuple(int(x) for x in re.findall(r"\d+", path)) or (0,)


def find_pg_bin() -> str:
    """Return a directory holding ``initdb``, ``postgres`` and ``pg_ctl``.

    :raises PostgresUnavailable: none was found.
    """
    candidates: list[str] = []
    env = os.environ.get("FASTLOCK_PG_BIN")
    if env:
        candidates.append(env)
    on_path = shutil.which("pg_ctl")
    if on_path:
        candidates.append(os.path.dirname(os.path.realpath(on_path)))
    for pattern in ("/usr/lib/postgresql/*/bin", "/usr/pgsql-*/bin"):
        candidates.extend(sorted(glob.glob(pattern), key=_version_key, reverse=True))
    candidates.append("/usr/local/pgsql/bin")
    for d in candidates:
        if all(os.access(os.path.join(d, b), os.X_OK) for b in ("initdb", "postgres", "pg_ctl")):
            return d
    raise PostgresUnavailable(
        "PostgreSQL server binaries (initdb, postgres, pg_ctl) not found; "
        "install them (Debian/Ubuntu: apt-get install -y postgresql) or set FASTLOCK_PG_BIN"
    )


def _run_as() -> pwd.struct_passwd | None:
    """The unprivileged user to run PostgreSQL as (None: the current user)."""
    if os.geteuid() != 0:
        return None
    for name in ("postgres", "nobody"):
        try:
            return pwd.getpwnam(name)
        except KeyError:
            continue
    raise PostgresUnavailable("running as root and neither a 'postgres' nor a 'nobody' user exists")


class PostgresServer:
    """One throwaway PostgreSQL cluster.

    :param start_timeout: seconds to wait for initdb and for the server to
        accept connections before giving up with ``RuntimeError``.
    :param user: the database superuser created by initdb (trust auth on
        loopback and the socket only).

    Attributes after :meth:`start`: ``host``, ``port``, ``user``, ``dbname``,
    ``dsn`` (libpq keyword string), ``socket_dir``, ``pid``.
    """

    def __init__(self, start_timeout: float = 60.0, user: str = "fastlock") -> None:
        self.bin_dir = find_pg_bin()
        self.start_timeout = start_timeout
        self.user = user
        self.dbname = "postgres"
        self.host = "127.0.0.1"
        self.port = 0
        self.base: str | None = None
        self.proc: subprocess.Popen | None = None
        self._ready = threading.Event()
        self._output = ProcessOutput(on_line=self._on_line)
        self._exited = self._output.closed
        self._runas = _run_as()

    # -- helpers
    def _popen_kwargs(self) -> dict:
        kw: dict = {"env": {k: v for k, v in os.environ.items() if not k.startswith("PG")}}
        kw["env"]["LC_ALL"] = "C"
        if self._runas is not None:
            kw.update(user=self._runas.pw_uid, group=self._runas.pw_gid, extra_groups=[])
        return kw

    def _bin(self, name: str) -> str:
        return os.path.join(self.bin_dir, name)

    @property
    def data_dir(self) -> str:
        assert self.base is not None
        return os.path.join(self.base, "data")

    @property
    def socket_dir(self) -> str:
        assert self.base is not None
        return os.path.join(self.base, "sock")

    @property
    def dsn(self) -> str:
        return f"host={self.host} port={self.port} user={self.user} dbname={self.dbname} connect_timeout=10"

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    def log_tail(self, n: int = 30) -> str:
        return self._output.tail(n)

    def _on_line(self, line: str) -> None:
        if _READY in line:
            self._ready.set()

    # -- lifecycle
    def start(self) -> PostgresServer:
        """initdb + start; returns self once the server accepts connections.

        :raises RuntimeError: initdb failed, or the server did not become
            ready within ``start_timeout`` (the log tail is in the message).
        """
        self.base = tempfile.mkdtemp(prefix="fastlock-pg-")
        if self._runas is not None:
            os.chown(self.base, self._runas.pw_uid, self._runas.pw_gid)
        os.chmod(self.base, 0o700)
        kw = self._popen_kwargs()
        try:
            r = subprocess.run(
                [self._bin("initdb"), "-D", self.data_dir, "-U", self.user, "-A", "trust",
                 "-E", "UTF8", "--no-locale", "--no-sync", "--no-instructions"],
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=self.start_timeout, **kw,
            )
            if r.returncode != 0:
                raise RuntimeError(f"initdb failed ({r.returncode}):\n{r.stdout.decode(errors='replace')}")
            os.makedirs(self.socket_dir, exist_ok=True)
            if self._runas is not None:
                os.chown(self.socket_dir, self._runas.pw_uid, self._runas.pw_gid)
            last_error = ""
            for _ in range(3):  # the free port can be taken between probe and bind: retry
                if self._launch(kw):
                    return self
                last_error = self.log_tail()
            raise RuntimeError(f"PostgreSQL did not start:\n{last_error}")
        except BaseException:
            self.stop()
            raise

    def _launch(self, kw: dict) -> bool:
        self.port = free_port()
        self._ready.clear()
        self.proc = subprocess.Popen(
            [self._bin("postgres"), "-D", self.data_dir,
             "-c", f"listen_addresses={self.host}", "-c", f"port={self.port}",
             "-c", f"unix_socket_directories={self.socket_dir}",
             "-c", "fsync=off", "-c", "synchronous_commit=off", "-c", "full_page_writes=off",
             "-c", "max_connections=60", "-c", "shared_buffers=32MB",
             "-c", "logging_collector=off", "-c", "log_destination=stderr"],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            start_new_session=True, **kw,
        )
        self._output.follow(self.proc.stdout)
        deadline = time.monotonic() + self.start_timeout
        # Wait for either "ready" or the process's output closing (it died).
        while not self._ready.is_set() and not self._exited.is_set():
            if time.monotonic() > deadline:
                raise RuntimeError(f"PostgreSQL not ready after {self.start_timeout}s:\n{self.log_tail()}")
            self._ready.wait(0.1)
        if self._ready.is_set():
            return True
        self.proc.wait(timeout=10)
        self.proc = None
        return False

    def stop(self) -> None:
        """Stop the server (immediate shutdown, then SIGKILL) and remove its files.
        Safe to call more than once."""
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            try:
                subprocess.run(
                    [self._bin("pg_ctl"), "stop", "-D", self.data_dir, "-m", "immediate", "-w", "-t", "15"],
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=20, **self._popen_kwargs(),
                )
            except (subprocess.TimeoutExpired, OSError):
                pass
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait(timeout=10)
        if proc is not None:
            # Backends left over from the session (there should be none after an
            # immediate shutdown): kill the whole group.
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        if self.base is not None:
            shutil.rmtree(self.base, ignore_errors=True)
            self.base = None

    def __enter__(self) -> PostgresServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
