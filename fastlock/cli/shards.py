"""``fastlock serve --shards N``: shard-per-core, N shard processes under one parent.

The parent writes the shard map of N groups ``shard-0`` .. ``shard-{N-1}`` (the slots
split evenly, :mod:`fastlock.sharding`) to ``DIR/shard-map.json``, then runs one server
process per group: ``--listen HOST:P+K`` (with port 0: free ports it picks), data
directory ``DIR/shard-K``, each a group of its own with its own write-ahead log and
group commit, all with the other settings given to ``serve``.  It writes each shard's pid
and address to ``DIR/shards.json`` and, once every shard listens, tells systemd it is ready
(the shards themselves do not talk to systemd).  It forwards SIGTERM and
SIGINT to every shard and waits for them; when a shard exits on its own the parent stops
the others and exits with that shard's status (a supervisor restarts the whole set).
A shard whose parent is gone (killed with -9) stops itself within a second or so.

A map already in ``DIR`` that differs from the one N shards make is refused (exit 1):
the names would move to other shards' data directories, and moving slots is not done.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import multiprocessing
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

from .. import sdnotify
from ..auth import Credentials
from ..logformat import configure
from ..server import ServerConfig, serve
from ..sharding import ShardGroup, ShardMap, ShardMapError, even_ranges, load_map_file, write_map_file
from ..units import format_address

__all__ = ["shard_configs", "run_shards", "MAP_FILE", "STATUS_FILE"]

log = logging.getLogger(__name__)

#: the map file the parent writes in the data directory
MAP_FILE = "shard-map.json"
#: seconds a shard has to stop after SIGTERM before it is killed
STOP_TIMEOUT = 30.0
#: the file naming each running shard's pid and address (removed when they stop)
STATUS_FILE = "shards.json"
#: seconds between a shard's checks that its parent still runs (it stops itself when not)
PARENT_CHECK_INTERVAL = 1.0
#: seconds the shards have to listen before the parent tells systemd it is ready (it runs on regardless)
READY_TIMEOUT = 120.0


def _ports(host: str, port: int, count: int) -> list[int]:
    """``port .. port+count-1``, or ``count`` free ports of ``host`` if ``port`` is 0."""
    if port:
        return [port + k for k in range(count)]
    sockets = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
            sockets.append(s)
            s.bind((host, 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def shard_configs(config: ServerConfig, count: int) -> tuple[ShardMap, list[ServerConfig]]:
    """The shard map of ``count`` shards of ``config`` (its host, port and data directory) and
    each shard's config.  A map in ``config.data_dir`` of the same slot ranges keeps its epoch, or
    gets the next one when its addresses differ (port 0 picks other free ports).
    :raises ShardMapError: ``config.data_dir`` holds a map of other ranges (or addresses, with a fixed port)."""
    host = config.host
    ports = _ports(host, config.port, count)
    names = [f"shard-{k}" for k in range(count)]
    groups = tuple(ShardGroup(name, (format_address((host, ports[k])),)) for k, name in enumerate(names))
    shard_map = ShardMap(1, groups, even_ranges(names))
    path = Path(config.data_dir) / MAP_FILE
    if path.exists():
        old = load_map_file(path)
        same_ports = config.port != 0
        if old.ranges != shard_map.ranges or (same_ports and old.groups != shard_map.groups):
            raise ShardMapError(f"{path} is a map of {len(old.groups)} shards with other slot ranges or addresses: "
                                f"each shard's locks are in its own data directory and moving slots is not "
                                f"done; start with the same --shards and --listen, or a new --data-dir")
        if old.groups != shard_map.groups:  # other free ports: a map clients must tell from the one they hold
            shard_map = shard_map.with_epoch(old.epoch + 1)
        else:
            shard_map = shard_map.with_epoch(old.epoch)
    configs = [dataclasses.replace(config, port=ports[k], data_dir=os.path.join(config.data_dir, names[k]),
                                   name=f"{config.name or 'fastlock'}/{names[k]}", shard_map=shard_map,
                                   shard_group=names[k])
               for k in range(count)]
    return shard_map, configs


def _run_one(config: ServerConfig, credentials: str | None, log_level: str, log_format: str,
             use_uvloop: bool) -> None:
    """A shard process's body: its logging, its credentials (read again from the file: keys
    are not passed between processes), then the server."""
    configure(log_level, log_format, sys.stderr)
    threading.Thread(target=_stop_when_orphaned, args=(os.getppid(),), name="parent-watch", daemon=True).start()
    if credentials is not None:
        config = dataclasses.replace(config, credentials=Credentials.load(credentials))
    sys.exit(serve(config, use_uvloop=use_uvloop))


def _stop_when_orphaned(parent: int) -> None:
    """In a shard: SIGTERM to itself (a clean stop) once its parent ``parent`` is gone (killed
    with -9, it forwards no signal), checked every PARENT_CHECK_INTERVAL seconds."""
    while os.getppid() == parent:
        time.sleep(PARENT_CHECK_INTERVAL)
    log.error("the parent process (pid %d) is gone: stopping", parent)
    os.kill(os.getpid(), signal.SIGTERM)


def run_shards(config: ServerConfig, count: int, args: argparse.Namespace) -> int:
    """Run ``count`` shards of ``config`` until SIGTERM/SIGINT or one exits; returns the exit status."""
    os.makedirs(config.data_dir, mode=0o700, exist_ok=True)
    try:
        shard_map, configs = shard_configs(config, count)
    except (ShardMapError, OSError) as exc:
        log.critical("cannot start: %s", exc)
        return 1
    write_map_file(Path(config.data_dir) / MAP_FILE, shard_map)
    context = multiprocessing.get_context("spawn")  # a fresh interpreter per shard: no loop or thread inherited
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda _sig, _frame: stop.set())
    processes = []
    notify_socket = os.environ.pop("NOTIFY_SOCKET", None)  # systemd hears the parent only
    try:
        for shard in configs:
            process = context.Process(target=_run_one, name=shard.shard_group,
                                      args=(dataclasses.replace(shard, credentials=None), args.credentials,
                                            args.log_level, args.log_format, not args.no_uvloop))
            process.start()
            processes.append(process)
            log.info("%s (pid %d) on %s, data directory %s", shard.shard_group, process.pid,
                     format_address((shard.host, shard.port)), shard.data_dir)
    finally:
        if notify_socket is not None:
            os.environ["NOTIFY_SOCKET"] = notify_socket
    _write_status(Path(config.data_dir) / STATUS_FILE, configs, processes)
    log.info("shard-per-core: %d shards, map in %s, their pids in %s", count, Path(config.data_dir) / MAP_FILE,
             Path(config.data_dir) / STATUS_FILE)
    if _listening(configs, processes, stop):
        sdnotify.ready(f"{count} shards on {', '.join(format_address((c.host, c.port)) for c in configs)}")
    status = 0
    while not stop.is_set():
        ended = [p for p in processes if p.exitcode is not None]
        if ended:
            status = _exit_status(ended[0].exitcode)
            log.error("%s exited with status %s: stopping the other shards", ended[0].name, ended[0].exitcode)
            break
        stop.wait(0.2)
    for process in processes:
        if process.exitcode is None and process.pid is not None:
            os.kill(process.pid, signal.SIGTERM)
    for process in processes:
        process.join(STOP_TIMEOUT)
        if process.exitcode is None:
            log.error("%s did not stop within %g s: killing it", process.name, STOP_TIMEOUT)
            process.kill()
            process.join()
    if stop.is_set():
        # a shard the forwarded SIGTERM ended before it set its handler (still starting) stopped as asked
        status = max((_exit_status(p.exitcode) for p in processes if p.exitcode not in (0, -signal.SIGTERM)),
                     default=0)
    (Path(config.data_dir) / STATUS_FILE).unlink(missing_ok=True)
    log.info("every shard stopped")
    return status


def _exit_status(exitcode: int | None) -> int:
    """A shard's exit status as the parent's: a signal's as a shell reports it (128 + its number),
    1 for none."""
    if not exitcode:
        return 1
    return 128 - exitcode if exitcode < 0 else exitcode


def _write_status(path: Path, configs: list[ServerConfig], processes: list[Any]) -> None:
    """``DIR/shards.json``: each running shard's group, pid, address and data directory."""
    rows = [{"group": c.shard_group, "pid": p.pid, "address": format_address((c.host, c.port)),
             "data_dir": c.data_dir} for c, p in zip(configs, processes)]
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"parent": os.getpid(), "shards": rows}, indent=1) + "\n")
    os.replace(tmp, path)


def _listening(configs: list[ServerConfig], processes: list[Any], stop: threading.Event) -> bool:
    """Wait (at most READY_TIMEOUT s) until every shard accepts connections; False if one exited
    or a signal came first."""
    deadline = time.monotonic() + READY_TIMEOUT
    for c in configs:
        while True:
            if stop.is_set() or any(p.exitcode is not None for p in processes) or time.monotonic() > deadline:
                return False
            try:
                socket.create_connection((c.host, c.port), timeout=0.5).close()
                break
            except OSError:
                stop.wait(0.05)
    return True
