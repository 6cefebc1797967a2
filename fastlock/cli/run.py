"""``fastlock run``: run a command while holding a lock (as ``etcdctl lock`` and ``consul lock``).

::

    fastlock run NAME [--ttl S] [--wait S] [--limit N | --shared] [--priority N] [--server HOST:PORT ...]
        -- CMD [ARG ...]
    fastlock run NAME --once-per WINDOW [--ttl S] [--server HOST:PORT ...] -- CMD [ARG ...]

With ``--limit N``, ``NAME`` is a counting semaphore and up to N commands run at
once, each with its own permit (as ``consul lock -n N``); with ``--shared``, a
shared (read) lock that any number of commands hold together while no
exclusive holder does.  With ``--priority N`` (0..99) the command's acquire waits
ahead of every waiter of a lower priority, FIFO within its own (Apache Helix's priority
lock; see ``docs/recipes/priority.md``); above 0 it needs the ACL right ``prioritize``.

Acquires ``NAME`` (waiting in the lock's FIFO queue at most ``--wait``
seconds, finding the primary included: a failover under way is waited out
within it, or within 15 s without ``--wait``; the lock itself is waited for
forever by default), starts ``CMD`` with the lease's fencing token in
its environment, renews the lease in the background (about every ttl/3, with
jitter) while ``CMD`` runs, and releases it when ``CMD`` exits.

With ``--once-per WINDOW`` (seconds, or with a unit: ``500ms``, ``90s``, ``15m``, ``1h``;
at most 1 hour, at least ``--ttl``), the command runs at most once per window across every
machine that runs the same line (ShedLock's ``lockAtLeastFor``): the lock is tried once
(no waiting), and when the command ends early the lock stays taken until WINDOW after its
grant, by the server's clock (see :mod:`fastlock.client.window`); a run still going is
renewed with WINDOW as its TTL, so one that dies keeps NAME for up to a window after its
last renewal.  A run refused because the window is taken exits with
``--conflict-exit-code`` (73; 0 suits cron).

Environment given to the command:
    ``FASTLOCK_FENCING_TOKEN``  the lease's fencing token (decimal); pass it to every
                                write the lock protects (see :mod:`fastlock.fencing`)
    ``FASTLOCK_LOCK_NAME``      the lock's name
    ``FASTLOCK_SERVER``         the server address(es) used, comma-separated
    ``FASTLOCK_SEQUENCER``      with ``--sequencer``: the lease's signed sequencer (base64url
                                text, :mod:`fastlock.sequencer`), for fences that check
                                signatures; its expiry is the grant's
    ``FASTLOCK_SEQUENCER_FILE`` with ``--sequencer``: a file (in a directory of its own, mode
                                0700, removed at the end) holding the current sequencer:
                                rewritten (an atomic rename) within
                                :data:`SEQUENCER_FILE_POLL` s of each renewal, which re-signs
                                it with the renewed expiry.  A command that runs longer than
                                the TTL reads it before each fenced write

``FASTLOCK_TOKEN_FILE`` and ``FASTLOCK_AUTH_SECRET`` are removed from the
command's environment unless ``--pass-credentials`` is given: the command gets
the fencing token of its lease, not the power to act as this client.

Bounded execution: the command is stopped before the server could grant NAME to
another holder.  From the send time of the last renewal the server confirmed, the
lock cannot be re-granted before ``sent + ttl * (1 - drift) - 2 ms`` (drift: 1e-3); the
command's process group gets SIGKILL ``--margin`` seconds before that moment and
SIGTERM ``--grace`` seconds before the SIGKILL (both at once when a renewal is
refused: the lock may be free already).  Every renewal moves both.  A thread of
its own sends them.  ``fastlock run`` itself stopped (SIGSTOP, a stalled VM) sends
nothing; then exit status 76 says so (see ``docs/bounded-execution.md``).

Exit status:
    the command's own     when it exits normally (128 + N if it was killed by signal N)
    75 (EX_TEMPFAIL)      the lease could not be kept while the command ran (renewals failed):
                          the command was stopped (SIGTERM, then SIGKILL) and was seen dead
                          before the server's earliest re-grant of NAME.  Reported even if the
                          command exited on its own meanwhile.
    76 (EX_PROTOCOL)      as 75, but the command could not be shown dead before the earliest
                          re-grant: a renewal was refused (an operator revoked the lease, or it
                          had expired), or ``fastlock run`` was stalled past the moment; part of
                          the command's work may have overlapped the next holder's
    73                    not acquired within ``--wait`` (``--conflict-exit-code`` changes it,
                          as flock(1)'s ``-E``); the command was not started
    69 (EX_UNAVAILABLE)   no server could be reached (or the connection was lost while waiting)
    77 (EX_NOPERM)        the server refused this client's credentials, or its principal may not
                          lock NAME; the command was not started
    127 / 126             the command was not found / could not be executed (as a shell)
    128 + N               ``fastlock run`` got signal N before the command started
    2                     bad arguments (an empty or too long NAME, ``--ttl`` not > 0, ...),
                          reported before anything is sent; a TLS file that cannot be loaded;
                          NAME held or awaited under another ``--limit`` (LimitConflict)

Signals: SIGINT, SIGTERM and SIGHUP received by ``fastlock run`` are forwarded
to the command, which runs in its own process group (so a terminal's Ctrl-C
reaches it once, through us; and the SIGTERM/SIGKILL of a lost lease reaches
its children too); ``fastlock run`` then waits for it, releases the lock and
exits with its status.  If ``fastlock run`` itself is SIGKILLed the command
keeps running without renewal; the lease expires after its TTL.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
from collections.abc import Sequence
from typing import Any

from ..auth import read_token_file
from ..client import FAILOVER_TIMEOUT, connect, resolve_credential
from ..client.bounded import ProcessGuard, WorkBound, check_margin, stop_at
from ..errors import (
    AuthError,
    ConnectionLost,
    FastlockError,
    InvalidArgument,
    LeaseLost,
    LimitConflict,
    LockNotAcquired,
    PermissionDenied,
    WrongArgumentType,
)
from ..protocol import MAX_CLIENT_NAME_CHARS, MAX_LIMIT, check_name, check_optional_str
from ..protocol.priority import MAX_PRIORITY, check_priority
from ..units import DEFAULT_PORT
from .args import (
    add_client_tls_arguments,
    client_tls_options,
    exit_code_arg,
    seconds_arg,
    servers_from_env,
    ttl_arg,
    wait_arg,
)

log = logging.getLogger(__name__)

EXIT_LOST = 75  # EX_TEMPFAIL
EXIT_OVERRAN = 76  # EX_PROTOCOL
EXIT_NOT_ACQUIRED = 73
EXIT_UNAVAILABLE = 69  # EX_UNAVAILABLE
EXIT_NOT_FOUND = 127
EXIT_NOT_EXECUTABLE = 126
EXIT_USAGE = 2
EXIT_NOPERM = 77  # EX_NOPERM

FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
#: seconds between two looks at the lease's sequencer for FASTLOCK_SEQUENCER_FILE (at most;
#: a tenth of the TTL when that is shorter)
SEQUENCER_FILE_POLL = 0.5

#: removed from the command's environment unless --pass-credentials
CREDENTIAL_VARIABLES = ("FASTLOCK_TOKEN_FILE", "FASTLOCK_AUTH_SECRET")

__all__ = ["main", "add_parser", "build_parser", "run_from_args", "EXIT_LOST", "EXIT_OVERRAN", "EXIT_NOT_ACQUIRED",
           "EXIT_UNAVAILABLE"]


def _limit_arg(value: str) -> int:
    """argparse type: a semaphore limit, 1..2**31-1."""
    try:
        limit = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--limit must be an integer, not {value!r}") from None
    if not 1 <= limit <= MAX_LIMIT:
        raise argparse.ArgumentTypeError(f"--limit must be 1..{MAX_LIMIT}, not {limit}")
    return limit


def _priority_arg(value: str) -> int:
    """argparse type: an acquire priority, 0..MAX_PRIORITY."""
    try:
        return check_priority(int(value))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--priority must be an integer, not {value!r}") from None
    except FastlockError as exc:
        raise argparse.ArgumentTypeError(f"--priority: {exc}") from None


def _add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("name", metavar="NAME", help="the lock to hold while the command runs (1-512 bytes of UTF-8)")
    p.add_argument("--ttl", type=ttl_arg, default=10.0, metavar="S",
                   help="lease TTL in seconds, > 0 and at most 3600 (1 hour), renewed about every ttl/3 (default 10)")
    p.add_argument("--wait", type=wait_arg, default=None, metavar="S",
                   help="give up if not acquired within S seconds, finding the primary during a failover "
                        "included; at most 86400 (default: wait forever, after finding the primary within 15 s; "
                        "0: try once)")
    kind = p.add_mutually_exclusive_group()
    kind.add_argument("--limit", type=_limit_arg, default=0, metavar="N",
                      help="NAME is a semaphore: at most N holders at once (as consul lock -n); "
                           "every holder must give the same N")
    kind.add_argument("--shared", action="store_true",
                      help="take NAME as a shared (read) lock: held together with other shared holders")
    p.add_argument("--priority", type=_priority_arg, default=0, metavar="N",
                   help=f"wait ahead of every waiter of a lower priority (0..{MAX_PRIORITY}, default 0; FIFO "
                        "within a priority); above 0 needs the ACL right 'prioritize' on NAME")
    p.add_argument("--server", action="append", metavar="HOST:PORT",
                   help="server address; repeat for a primary and standbys "
                        "(default: $FASTLOCK_SERVER or 127.0.0.1:7420)")
    p.add_argument("--token-file", metavar="FILE",
                   help="this client's token file (default: env FASTLOCK_TOKEN_FILE)")
    p.add_argument("--auth-secret-file", metavar="FILE",
                   help="legacy: file holding the server's shared secret (or env FASTLOCK_AUTH_SECRET)")
    p.add_argument("--sequencer", action="store_true",
                   help="ask for a signed sequencer and give it to the command as FASTLOCK_SEQUENCER")
    p.add_argument("--pass-credentials", action="store_true",
                   help="leave FASTLOCK_TOKEN_FILE and FASTLOCK_AUTH_SECRET in the command's environment "
                        "(by default they are removed, so the command cannot act as this client)")
    p.add_argument("--client-name", metavar="NAME",
                   help="client name shown by the server (default fastlock-run@HOST:PID)")
    p.add_argument("--grace", type=seconds_arg, default=None, metavar="S",
                   help="seconds between SIGTERM and SIGKILL when the command is stopped (default: a quarter "
                        "of --ttl, at most 10)")
    p.add_argument("--margin", type=seconds_arg, default=None, metavar="S",
                   help="send SIGKILL this many seconds before the server's earliest possible re-grant of NAME "
                        "(default: a tenth of --ttl); --margin + --grace must be under two thirds of --ttl")
    p.add_argument("--once-per", type=window_arg, default=None, metavar="WINDOW",
                   help="run at most once per WINDOW across every client (e.g. 15m; at most 1h, at least --ttl): "
                        "the lock is tried once and stays taken for the window even after an early end")
    p.add_argument("--conflict-exit-code", type=exit_code_arg, default=EXIT_NOT_ACQUIRED, metavar="N",
                   help=f"exit status when not acquired within --wait (default {EXIT_NOT_ACQUIRED})")
    p.add_argument("--log-level", default="INFO", type=str.upper, choices=("DEBUG", "INFO", "WARNING", "ERROR"),
                   help="the least severe messages shown (any case; default INFO: what it waits for, who holds it)")
    add_client_tls_arguments(p)


_DESCRIPTION = "run a command while holding a lock (exit codes: see `pydoc fastlock.cli.run`)"
_USAGE = ("fastlock run NAME [--ttl S] [--wait S | --once-per WINDOW] [--limit N | --shared] [--server HOST:PORT ...] "
          "[options] "
          "-- CMD [ARG ...]")


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``run`` subcommand to ``fastlock``'s argparse subparsers.

    Every argument after ``run`` is collected verbatim into ``args.args``
    (the command's own options must not be parsed by ``fastlock``); its
    handler calls :func:`main` with them, which parses them (and ``-h``)."""
    p = subparsers.add_parser("run", help=_DESCRIPTION, add_help=False, prefix_chars="\0")
    p.add_argument("args", nargs=argparse.REMAINDER)
    p.set_defaults(handler=lambda args: main(args.args))
    return p


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``fastlock run``'s own options (everything before ``--``)."""
    p = argparse.ArgumentParser(prog="fastlock run", usage=_USAGE, description=_DESCRIPTION,
                                epilog="The command and its arguments follow `--`.", allow_abbrev=False)
    _add_arguments(p)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """``fastlock run`` with ``argv`` (the arguments after ``run``); returns the exit status.

    Everything after the first ``--`` is the command, passed on untouched.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if "--" in argv:
        i = argv.index("--")
        argv, command = argv[:i], argv[i + 1:]
    else:
        command = []
    args = parser.parse_args(argv)
    if not command:
        parser.error("a command is needed after --")  # exits 2
    try:
        check_name(args.name)
        check_optional_str(args.client_name, "client name", MAX_CLIENT_NAME_CHARS)
        stop_times(args)
        check_once_per(args)
    except FastlockError as exc:
        parser.error(str(exc))  # exits 2
    return run_from_args(args, command)


def stop_times(args: argparse.Namespace) -> tuple[WorkBound, float]:
    """The command's stop bound (``--margin``) and ``--grace``, defaults filled in (seconds).

    Raises:
        InvalidArgument: ``--margin + --grace`` not under two thirds of ``--ttl`` (the
            command would be sent SIGTERM between two renewals that succeed).
    """
    ttl = args.ttl
    grace = min(10.0, ttl / 4.0) if getattr(args, "grace", None) is None else args.grace
    margin = ttl / 10.0 if getattr(args, "margin", None) is None else args.margin
    if margin + grace >= ttl * 2.0 / 3.0:
        raise InvalidArgument(f"--margin ({margin:g} s) + --grace ({grace:g} s) must be under two thirds of --ttl "
                              f"({ttl:g} s): renewals go out about every third of it")
    return check_margin(margin), grace


#: the units ``--once-per`` accepts, in seconds
_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}


def window_arg(value: str) -> float:
    """argparse type: a window in seconds, a number with an optional unit (ms, s, m, h), > 0, at most 1 hour."""
    text = value.strip().lower()
    scale = 1.0
    for unit in ("ms", "s", "m", "h"):
        if text.endswith(unit):
            text, scale = text[:-len(unit)], _UNITS[unit]
            break
    try:
        return ttl_arg(repr(float(text) * scale))
    except (ValueError, argparse.ArgumentTypeError):
        raise argparse.ArgumentTypeError(f"--once-per is a window of at most 1h (e.g. 15m, 90s, 500ms), "
                                         f"got {value!r}") from None


def check_once_per(args: argparse.Namespace) -> None:
    """Raise InvalidArgument when ``--once-per`` is combined with what it excludes."""
    window = getattr(args, "once_per", None)
    if window is None:
        return
    if args.wait is not None or args.limit or args.shared or getattr(args, "priority", 0):
        raise InvalidArgument("--once-per tries the lock once: it takes no --wait, --limit, --shared or --priority")
    if window < args.ttl:
        raise InvalidArgument(f"--once-per ({window:g} s) must be at least --ttl ({args.ttl:g} s)")


def run_from_args(args: argparse.Namespace, command: list[str]) -> int:
    """Run ``command`` with parsed options (see :func:`build_parser`); returns the exit status."""
    if not logging.getLogger().handlers:
        logging.basicConfig(level=getattr(logging, args.log_level), stream=sys.stderr,
                            format="fastlock run: %(levelname)s %(message)s")
    servers = args.server or servers_from_env() or [f"127.0.0.1:{DEFAULT_PORT}"]
    try:
        secret = read_token_file(args.auth_secret_file) if args.auth_secret_file else None
        secret = resolve_credential(token_file=args.token_file, auth=secret)
    except FastlockError as exc:
        log.error("%s", exc)
        return EXIT_USAGE
    client_name = args.client_name or f"fastlock-run@{socket.gethostname()}:{os.getpid()}"
    return asyncio.run(_run(args, command, servers, secret, client_name))


async def _run(args: argparse.Namespace, command: list[str], servers: list[str], secret: str | None,
               client_name: str) -> int:
    loop = asyncio.get_running_loop()
    main_task = asyncio.current_task()
    assert main_task is not None  # a coroutine run by asyncio.run
    state: dict = {"proc": None, "signal": None}

    def on_signal(signum: int) -> None:
        proc = state["proc"]
        if proc is not None and proc.returncode is None:
            log.info("forwarding signal %d to the command", signum)
            _signal_group(proc.pid, signum)
        elif state["signal"] is None:
            state["signal"] = signum
            main_task.cancel()  # still connecting or waiting for the lock: give up

    for sig in FORWARDED_SIGNALS:
        loop.add_signal_handler(sig, on_signal, sig)
    client = None
    window_run = None
    try:
        try:
            # --wait covers finding the primary: a connect during a failover rides through it that long
            started = loop.time()
            client = await connect(*servers, auth=secret, client_name=client_name,
                                   failover_timeout=FAILOVER_TIMEOUT if args.wait is None else args.wait,
                                   sequencers=args.sequencer, **client_tls_options(args))
            wait = None if args.wait is None else max(0.0, args.wait - (loop.time() - started))
            correlation_id = f"fastlock run: {' '.join(command)}"[:256]
            if getattr(args, "once_per", None) is not None:
                # renewed with the window as its TTL: the process guard's bound follows one TTL throughout
                window_run = client.once_per(args.name, args.once_per, ttl=args.once_per,
                                             correlation_id=correlation_id)
                lease = await window_run.start()
            else:
                reporter = asyncio.ensure_future(_report_holder(client, args.name))
                try:
                    lease = await client.lock(args.name, ttl=args.ttl, wait=wait, correlation_id=correlation_id,
                                              shared=args.shared, limit=args.limit,
                                              priority=getattr(args, "priority", 0))
                finally:
                    reporter.cancel()
        except asyncio.CancelledError:
            return 128 + (state["signal"] or signal.SIGINT)
        except LimitConflict as exc:  # another --limit holds NAME: a usage error, not a timeout
            log.error("%s", exc)
            return EXIT_USAGE
        except LockNotAcquired:
            if getattr(args, "once_per", None) is not None:
                log.warning("%r ran less than %g s ago (or runs now): not run in this window", args.name,
                            args.once_per)
            else:
                log.warning("%r not acquired within %s s", args.name, args.wait)
            return args.conflict_exit_code
        except ConnectionLost as exc:
            log.error("%s", exc)
            return EXIT_UNAVAILABLE
        except (InvalidArgument, WrongArgumentType) as exc:  # main() checks first; for direct callers
            log.error("bad arguments: %s", exc)
            return EXIT_USAGE
        except (AuthError, PermissionDenied) as exc:  # PermissionErrors, so before OSError
            log.error("refused: %s", exc)
            return EXIT_NOPERM
        except OSError as exc:  # a TLS file that cannot be read or is not a PEM certificate/key
            log.error("cannot load the TLS files: %s", exc)
            return EXIT_USAGE
        except FastlockError as exc:
            log.error("could not acquire %r: %s", args.name, exc)
            return EXIT_UNAVAILABLE
        log.info("acquired %r, fencing token %d", args.name, lease.fencing_token)
        env = dict(os.environ)
        if not args.pass_credentials:
            for var in CREDENTIAL_VARIABLES:
                env.pop(var, None)
        env.update(FASTLOCK_FENCING_TOKEN=str(lease.fencing_token), FASTLOCK_LOCK_NAME=args.name,
                   FASTLOCK_SERVER=",".join(servers))
        follower = None
        if lease.sequencer is not None:
            env["FASTLOCK_SEQUENCER"] = lease.sequencer
            env["FASTLOCK_SEQUENCER_FILE"] = sequencer_file = _sequencer_file(lease.sequencer)
            follower = asyncio.ensure_future(_follow_sequencer(lease, sequencer_file,
                                                               min(SEQUENCER_FILE_POLL, args.ttl / 10.0)))
        group = {"process_group": 0} if sys.version_info >= (3, 11) else {"start_new_session": True}
        try:
            proc = await asyncio.create_subprocess_exec(*command, env=env, **group)
        except FileNotFoundError:
            log.error("command not found: %s", command[0])
            code = EXIT_NOT_FOUND
        except PermissionError:
            log.error("cannot execute: %s", command[0])
            code = EXIT_NOT_EXECUTABLE
        else:
            state["proc"] = proc
            code = await _supervise(proc, lease, *stop_times(args))
        finally:
            if follower is not None:
                follower.cancel()
                shutil.rmtree(os.path.dirname(env["FASTLOCK_SEQUENCER_FILE"]), ignore_errors=True)
        try:
            # bounded: a lost lease may be lost because the server is unreachable
            end = client.release(lease) if window_run is None else window_run.finish()  # a window keeps its lease
            await asyncio.wait_for(end, max(1.0, min(args.ttl, 10.0)))
        except (LeaseLost, ConnectionLost, asyncio.TimeoutError) as exc:
            if code not in (EXIT_LOST, EXIT_OVERRAN):
                log.warning("releasing %r: %s", args.name, exc or type(exc).__name__)
                if isinstance(exc, LeaseLost):
                    code = EXIT_LOST
        return code
    finally:
        for sig in FORWARDED_SIGNALS:
            loop.remove_signal_handler(sig)
        if client is not None:
            await client.close()


def _write_sequencer(path: str, text: str) -> None:
    """Replace the file at ``path`` by one holding ``text`` and a newline (an atomic rename)."""
    part = path + ".part"
    with open(part, "w", encoding="ascii") as f:
        f.write(text + "\n")
    os.replace(part, path)


def _sequencer_file(text: str) -> str:
    """A new file holding sequencer ``text`` (FASTLOCK_SEQUENCER_FILE), in a directory of its
    own (mode 0700, :func:`tempfile.mkdtemp`); the caller removes the directory."""
    path = os.path.join(tempfile.mkdtemp(prefix="fastlock-run-"), "sequencer")
    _write_sequencer(path, text)
    return path


async def _follow_sequencer(lease: Any, path: str, every: float) -> None:
    """Rewrite FASTLOCK_SEQUENCER_FILE ``path`` whenever a renewal re-signed ``lease``'s
    sequencer, looking every ``every`` seconds, until cancelled or the lease is lost."""
    written = lease.state.sequencer
    while not lease.lost.is_set():
        await asyncio.sleep(every)
        blob = lease.state.sequencer
        if blob is not written:
            try:
                _write_sequencer(path, lease.sequencer)
            except OSError as exc:
                log.warning("could not rewrite %s: %s", path, exc)
                continue
            written = blob


#: seconds between two "waiting for" lines while ``fastlock run`` waits for its lock
REPORT_EVERY = 10.0


async def _report_holder(client: Any, name: str) -> None:
    """While the lock is being waited for: say who holds it (INFO), at once and every
    :data:`REPORT_EVERY` seconds; quiet when it is free, when the holder is this connection
    (its own grant, which on a sync primary waits for the standby's acknowledgement before the
    acquire is answered), and if the principal may not ask."""
    while True:
        try:
            holder = await client.holder(name)
        except FastlockError:
            return
        if holder is not None and not holder.get("this_session"):
            who = ":".join(p for p in (holder.get("principal"), holder.get("client")) if p) or "an unnamed client"
            log.info("waiting for %r: held by %s (token %d, correlation id %s, %.1f s left on its lease)",
                     name, who, holder["token"], holder.get("correlation_id"), holder["remaining_ms"] / 1000)
        await asyncio.sleep(REPORT_EVERY)


async def _supervise(proc: asyncio.subprocess.Process, lease, bound: WorkBound, grace: float) -> int:
    loop = asyncio.get_running_loop()
    lost_at: list[float] = []
    lease.health.when_lost(lambda: lost_at.append(loop.time()))
    guard = ProcessGuard(lease, proc.pid, bound, grace, group=True).start()
    try:
        returncode = await proc.wait()
    finally:
        guard.stop()
    seen_dead = loop.time()  # the command died at or before this moment
    if guard.termed is None and not lease.lost.is_set():
        return _status(returncode)
    # the earliest re-grant from the last renewal the server confirmed (no margin)
    regrant = stop_at(lease, WorkBound(0.0, bound.drift))
    in_time = seen_dead <= regrant and (not lost_at or seen_dead <= lost_at[0])
    if guard.termed is not None:
        log.error("lease on %r (token %d) could not be kept: the command was sent SIGTERM%s", lease.name,
                  lease.fencing_token, " and SIGKILL" if guard.killed is not None else "")
    else:
        log.error("lease on %r (token %d) lost", lease.name, lease.fencing_token)
    if in_time:
        log.error("the command ended %.3f s before the server's earliest re-grant of %r", regrant - seen_dead,
                  lease.name)
        return EXIT_LOST
    log.error("the command could not be shown to have ended before the server's earliest re-grant of %r "
              "(lost, a renewal refused, or this process stalled)", lease.name)
    return EXIT_OVERRAN


def _signal_group(pid: int, signum: int) -> None:
    try:
        os.killpg(pid, signum)  # the command leads its own process group
    except ProcessLookupError:
        pass
    except PermissionError:  # pragma: no cover - group changed under us
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass


def _status(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode


if __name__ == "__main__":
    sys.exit(main())
