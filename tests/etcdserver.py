"""A throwaway single-member etcd server for tests.

``EtcdServer`` starts ``etcd`` on 127.0.0.1 with free client and peer ports
and its data directory in a fresh temporary directory, waits (bounded) until
its v3 JSON gateway answers, and offers the faults the coordinator tests
need: :meth:`EtcdServer.pause` / :meth:`EtcdServer.resume` (SIGSTOP /
SIGCONT), :meth:`EtcdServer.kill` (SIGKILL) and :meth:`EtcdServer.restart`
(same ports, same data: keys and leases survive, as after a crash; a secured
member keeps its users, roles and certificates).
:meth:`EtcdServer.stop` ends the process by its PID and removes the
directory.  One server serves a whole test session; each test uses its own
key prefix (:func:`unique_prefix`).

``EtcdServer(secured=True)`` is the same member as a production one should be:
client TLS with certificates the tests make (trustme: a CA, etcd's server
certificate for 127.0.0.1, a client certificate with only a subjectAltName, as
etcd's gateway refuses a client certificate with a Common Name; and a second CA
nobody trusts), ``--client-cert-auth``, and authentication enabled with a root
user, by the etcdctl commands of docs/etcd.md run as written (the block marked
``etcd-rbac: cluster``).  :meth:`EtcdServer.confine` creates a user confined to
one key prefix by that page's ``etcd-rbac: group`` block.

The binary is ``$FASTLOCK_ETCD_BIN``, else ``etcd`` on ``PATH`` (Debian's
``etcd-server`` package); ``etcdctl`` is looked up beside it.  :func:`require_etcd` skips a test when it is
absent, or fails it when ``FASTLOCK_REQUIRE_ETCD=1`` (CI sets it).

Usage::

    with EtcdServer() as etcd:
        url = etcd.url  # "http://127.0.0.1:PORT"
    with EtcdServer(secured=True) as etcd:
        user = etcd.confine("/fastlock-test-abc")  # an EtcdUser allowed PREFIX/ only
        flags = etcd.serve_flags(user)  # --coordinator-protocol https ... for fastlock serve
"""

from __future__ import annotations

import http.client
import os
import secrets
import shutil
import signal
import ssl
import subprocess
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest
from throwaway import ProcessOutput, free_port

from fastlock.coordination.access import EtcdAccess

__all__ = ["EtcdServer", "EtcdUnavailable", "EtcdUser", "find_etcd", "rbac_commands", "require_etcd",
           "unique_prefix"]

#: the page whose etcdctl commands the secured mode runs
RBAC_DOC = Path(__file__).resolve().parent.parent / "docs" / "etcd.md"

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


def rbac_commands(which: str) -> list[str]:
    """The etcdctl command lines of docs/etcd.md's sh block marked ``etcd-rbac: <which>``."""
    lines = RBAC_DOC.read_text().splitlines()
    for i, line in enumerate(lines):
        if f"etcd-rbac: {which}" in line and i + 1 < len(lines) and lines[i + 1].startswith("```"):
            block = []
            for body in lines[i + 2:]:
                if body.startswith("```"):
                    return block
                if body.strip() and not body.lstrip().startswith("#"):
                    block.append(body.strip())
    raise AssertionError(f"{RBAC_DOC} has no sh block marked 'etcd-rbac: {which}'")


@dataclass(frozen=True)
class EtcdUser:
    """An etcd user the tests made: its name and the file holding its password."""

    name: str
    password_file: str


def unique_prefix() -> str:
    """A key prefix no other test of the session uses."""
    return f"/fastlock-test-{uuid.uuid4().hex[:12]}"


class EtcdServer:
    """One throwaway etcd member.

    :param start_timeout: seconds to wait for the server to answer before
        giving up with ``RuntimeError`` (the log tail is in the message).
    :param secured: client TLS and authentication (see the module docstring).
    :raises EtcdUnavailable: no etcd binary (secured: no etcdctl either).

    Attributes after :meth:`start`: ``port`` (clients), ``peer_port``,
    ``url`` (``http://127.0.0.1:PORT``), ``address`` (``127.0.0.1:PORT``), ``pid``.
    """

    def __init__(self, start_timeout: float = 30.0, *, secured: bool = False) -> None:
        self.binary = find_etcd()
        if secured and not (shutil.which("etcdctl", path=os.path.dirname(self.binary)) or shutil.which("etcdctl")):
            raise EtcdUnavailable("the secured etcd needs etcdctl (Debian/Ubuntu: apt-get install -y etcd-client)")
        self.start_timeout = start_timeout
        self.secured = secured
        self.port = 0
        self.peer_port = 0
        self.base: str | None = None
        self.proc: subprocess.Popen | None = None
        self.paused = False
        self._output = ProcessOutput()
        self.certs: dict[str, str] = {}  # secured: ca, server, server_key, client, client_key, other_ca, other...
        self.root_password = ""

    @property
    def url(self) -> str:
        return f"{'https' if self.secured else 'http'}://127.0.0.1:{self.port}"

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    def log_tail(self, n: int = 30) -> str:
        return self._output.tail(n)

    def healthy(self, timeout: float = 1.0) -> bool:
        """Does the gateway answer a range request (secured: a status request, which needs no
        user) now?"""
        if self.secured:
            context = ssl.create_default_context(cafile=self.certs["ca"])
            context.load_cert_chain(self.certs["client"], self.certs["client_key"])
            conn: http.client.HTTPConnection = http.client.HTTPSConnection("127.0.0.1", self.port, timeout=timeout,
                                                                           context=context)
            path, body = "/v3/maintenance/status", b"{}"
        else:
            conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
            path, body = "/v3/kv/range", b'{"key":"AA=="}'
        try:
            conn.request("POST", path, body=body)
            return conn.getresponse().status == 200
        except OSError:
            return False
        finally:
            conn.close()

    # -- the secured mode
    def _make_certs(self) -> None:
        import trustme

        assert self.base is not None
        d = Path(self.base) / "certs"
        d.mkdir()
        ca, other = trustme.CA(), trustme.CA()
        files = {"ca": d / "ca.pem", "other_ca": d / "other-ca.pem"}
        ca.cert_pem.write_to_path(str(files["ca"]))
        other.cert_pem.write_to_path(str(files["other_ca"]))
        for stem, issuer, names, cn in (("server", ca, ("127.0.0.1", "localhost"), "etcd"),
                                        ("client", ca, ("fastlock-node.test",), None),
                                        ("client_cn", ca, ("fastlock-node.test",), "fastlock-node"),
                                        ("other", other, ("fastlock-node.test",), None)):
            leaf = issuer.issue_cert(*names, common_name=cn)
            files[stem], files[stem + "_key"] = d / f"{stem}.pem", d / f"{stem}-key.pem"
            leaf.cert_chain_pems[0].write_to_path(str(files[stem]))
            leaf.private_key_pem.write_to_path(str(files[stem + "_key"]))
        self.certs = {k: str(v) for k, v in files.items()}

    def etcdctl(self, line: str, *, root: bool = True, cwd: str | None = None) -> str:
        """Run one ``etcdctl ...`` line of the docs through ``sh`` with the endpoint, TLS files
        and (``root``) the root user in etcdctl's environment variables; its output.

        :raises RuntimeError: etcdctl failed (its output is in the message).
        """
        assert line.startswith("etcdctl "), line
        env = {**os.environ, "ETCDCTL_API": "3", "ETCDCTL_ENDPOINTS": self.url, "ETCDCTL_DIAL_TIMEOUT": "5s",
               "ETCDCTL_COMMAND_TIMEOUT": "10s",
               "PATH": os.path.dirname(self.binary) + os.pathsep + os.environ.get("PATH", "")}
        if self.secured:
            env.update(ETCDCTL_CACERT=self.certs["ca"], ETCDCTL_CERT=self.certs["client"],
                       ETCDCTL_KEY=self.certs["client_key"])
        if root:
            env["ETCDCTL_USER"] = f"root:{self.root_password}"
        done = subprocess.run(["sh", "-c", line], capture_output=True, text=True, timeout=30, env=env,
                              cwd=cwd or self.base)
        if done.returncode != 0:
            raise RuntimeError(f"{line!r} failed ({done.returncode}): {done.stdout}{done.stderr}")
        return done.stdout

    def _enable_auth(self) -> None:
        """Run docs/etcd.md's ``etcd-rbac: cluster`` block: a root user, then authentication on."""
        assert self.base is not None
        self.root_password = secrets.token_urlsafe(16)
        Path(self.base, "root.password").write_text(self.root_password + "\n")
        for line in rbac_commands("cluster"):
            self.etcdctl(line, root="auth enable" in line)

    def confine(self, prefix: str, *, grant: bool = True) -> EtcdUser:
        """A new etcd user allowed ``prefix/`` only, made by docs/etcd.md's ``etcd-rbac: group``
        block with the docs' example names replaced (``grant=False``: the same user, but the
        line granting it the role is skipped: it may touch no key)."""
        assert self.secured and self.base is not None
        name = "fl-" + uuid.uuid4().hex[:10]
        password_file = Path(self.base, f"{name}.password")
        password_file.write_text(secrets.token_urlsafe(16) + "\n")
        for line in rbac_commands("group"):
            if not grant and "grant-role" in line:
                continue
            line = line.replace("/fastlock/prod/", prefix.rstrip("/") + "/").replace("fastlock-prod", name)
            self.etcdctl(line)
        return EtcdUser(name, str(password_file))

    def access(self, user: EtcdUser | None = None, **changes: str | None) -> EtcdAccess:
        """The :class:`EtcdAccess` of a node of the secured server (as ``user``)."""
        settings: dict = {"protocol": "https", "cacert": self.certs["ca"], "cert": self.certs["client"],
                          "key": self.certs["client_key"]}
        if user is not None:
            settings.update(user=user.name, password_file=user.password_file)
        settings.update(changes)
        return EtcdAccess(**settings)

    def serve_flags(self, user: EtcdUser | None = None) -> list[str]:
        """``fastlock serve`` flags reaching this server (secured: over TLS, as ``user``)."""
        if not self.secured:
            return []
        access = self.access(user)
        flags = ["--coordinator-protocol", "https", "--coordinator-cacert", str(access.cacert),
                 "--coordinator-cert", str(access.cert), "--coordinator-key", str(access.key)]
        if user is not None:
            flags += ["--coordinator-user", user.name, "--coordinator-password-file", user.password_file]
        return flags

    # -- lifecycle
    def start(self) -> EtcdServer:
        """Start on free ports in a new data directory; returns self once it answers.

        :raises RuntimeError: it did not answer within ``start_timeout``.
        """
        self.base = tempfile.mkdtemp(prefix="fastlock-etcd-")
        try:
            if self.secured:
                self._make_certs()
            for _ in range(3):  # a free port can be taken between probe and bind: retry on new ones
                self.port, self.peer_port = free_port(), free_port()
                if self._launch():
                    if self.secured:
                        self._enable_auth()
                    return self
            raise RuntimeError(f"etcd did not start:\n{self.log_tail()}")
        except BaseException:
            self.stop()
            raise

    def _launch(self) -> bool:
        assert self.base is not None
        peer = f"http://127.0.0.1:{self.peer_port}"
        tls = ["--cert-file", self.certs["server"], "--key-file", self.certs["server_key"], "--client-cert-auth",
               "--trusted-ca-file", self.certs["ca"]] if self.secured else []
        self.proc = subprocess.Popen(
            [self.binary, "--name", "t", "--data-dir", os.path.join(self.base, "data"), *tls,
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

    def restart(self, down_s: float = 0.0) -> None:
        """Kill and start again on the same ports with the same data (keys and leases survive),
        ``down_s`` seconds after the kill (as a slow restart).

        :raises RuntimeError: it did not come back within ``start_timeout``.
        """
        self.kill()
        time.sleep(down_s)
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
