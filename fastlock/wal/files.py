"""Data-directory helpers: modes, fsync of a directory, atomic file writes, the directory lock.

A data directory holds owner-key hashes (in grants and snapshots): only its
owner may read it, so it is mode 0700 and its files 0600.  Every file that
must be whole or absent (snapshots, the node's state files) is written with
:func:`write_atomically`.  :class:`DirectoryLock` keeps a second process off
a directory in use, as etcd and ZooKeeper do.
"""

from __future__ import annotations

import fcntl
import logging
import os
import stat
from typing import Any

from ..errors import DataDirInUse

log = logging.getLogger(__name__)

#: a data directory holds owner key hashes (in grants and snapshots): only its owner may read it
DIR_MODE = 0o700
FILE_MODE = 0o600

_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


def fsync_dir(directory: str) -> None:
    """fsync ``directory`` itself (makes a create, rename or unlink in it durable).

    :raises OSError: from ``open``/``fsync``.
    """
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_file(path: str) -> bytes:
    """The whole content of ``path``."""
    with open(path, "rb") as f:
        return f.read()


def write_all(fd: int, data: Any) -> None:
    """``os.write`` until every byte of ``data`` is written."""
    n = os.write(fd, data)
    if n < len(data):  # a short write (a signal, a full disk on the way): write the rest
        mv = memoryview(data)[n:]
        while mv:
            n = os.write(fd, mv)
            mv = mv[n:]


def write_atomically(directory: str, name: str, data: Any) -> str:
    """Write ``data`` (bytes-like, or a list of them written one after the other) to
    ``<directory>/<name>`` so that the file is either its old self or whole: a ``.tmp``
    file (mode 0600) written and fsynced, renamed over the target, and the directory
    fsynced.  Returns the path.

    :raises OSError: the write, an fsync or the rename failed (a ``.tmp`` may remain).
    """
    path = os.path.join(directory, name)
    tmp = path + ".tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | _CLOEXEC, FILE_MODE)
    try:
        os.fchmod(fd, FILE_MODE)  # a leftover .tmp may have had another mode
        for part in data if isinstance(data, list) else (data,):
            write_all(fd, part)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    fsync_dir(directory)
    return path


def secure_directory(directory: str) -> None:
    """Create ``directory`` with mode 0700 if missing; tighten an existing one to
    0700 and every file in it to 0600 (each change logged at WARNING).

    :raises OSError: the directory cannot be created or changed.
    """
    os.makedirs(directory, mode=DIR_MODE, exist_ok=True)
    st = os.stat(directory)
    if st.st_mode & 0o777 != DIR_MODE:
        os.chmod(directory, DIR_MODE)
        log.warning("data directory %s was mode %o: tightened to %o", directory, st.st_mode & 0o777, DIR_MODE)
    loose = []
    for fn in os.listdir(directory):
        path = os.path.join(directory, fn)
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            continue
        if stat.S_ISREG(st.st_mode) and st.st_mode & 0o777 != FILE_MODE:
            os.chmod(path, FILE_MODE)
            loose.append(fn)
    if loose:
        log.warning("data directory %s: tightened %d files to mode %o (%s%s)", directory, len(loose), FILE_MODE,
                    ", ".join(sorted(loose)[:5]), ", ..." if len(loose) > 5 else "")


def io_error(op: str, path: str, cause: OSError | int) -> OSError:
    """The error that stops the log: ``op`` (``"open"``, ``"pwrite"``, ``"fdatasync"``,
    ``"fsync"``, ``"zero-fill"``, ``"ftruncate"``, ...) failed on ``path`` (a segment
    file, ``LOCK`` or the data directory) with ``cause`` (an OSError or an errno): an OSError with
    the cause's errno whose text names the operation, the path and the errno's text
    (``[Errno 28] WAL pwrite failed on /data/....seg: No space left on device``)."""
    err = cause if isinstance(cause, int) else cause.errno
    if not err:
        return OSError(f"WAL {op} failed on {path}: {cause}")
    return OSError(err, f"WAL {op} failed on {path}: {os.strerror(err)}")


class DirectoryLock:
    """An exclusive ``flock`` on ``<directory>/LOCK``, holding this process's pid.

    :param directory: the data directory (must exist).
    :raises DataDirInUse: another process holds the lock (its pid is in the message).
    """

    def __init__(self, directory: str):
        path = os.path.join(directory, "LOCK")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | _CLOEXEC, FILE_MODE)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            try:
                holder = os.read(fd, 64).decode("ascii", "replace").strip() or "?"
            finally:
                os.close(fd)
            raise DataDirInUse(
                f"data directory {directory} is in use by another fastlock process (pid {holder})"
            ) from None
        try:
            os.ftruncate(fd, 0)
            os.write(fd, f"{os.getpid()}\n".encode())
        except OSError as exc:
            os.close(fd)
            raise io_error("write of the pid", path, exc) from exc
        self._fd = fd

    def release(self) -> None:
        """Close the file (which releases the lock); idempotent."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
