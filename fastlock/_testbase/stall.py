"""A real server whose WAL ``fdatasync`` stalls on demand, for tests of what waits for a sync.

:func:`stalled_fsync_env` writes a ``sitecustomize`` hook into a directory and returns the
environment that loads it into a ``fastlock serve`` process: while the marker file exists,
every WAL ``fdatasync`` (or, with ``writer_thread_only``, only those off the main thread: the
writer thread's) waits, and says so by creating ``<marker>.stalled``.  The hook wraps the
segment writer's I/O seam (``SegmentWriter.disk``), so the server's own code is unchanged.
A stall lasts at most 20 seconds.
"""

from __future__ import annotations

import os
import textwrap

_HOOK = textwrap.dedent('''
    """Test hook: a WAL fdatasync waits while the marker file FASTLOCK_TEST_STALL_FSYNC exists
    (off the main thread only when FASTLOCK_TEST_STALL_THREAD_ONLY is set)."""
    import os
    import threading
    import time
    import types

    _marker = os.environ.get("FASTLOCK_TEST_STALL_FSYNC")
    _thread_only = bool(os.environ.get("FASTLOCK_TEST_STALL_THREAD_ONLY"))
    if _marker:
        from fastlock.wal import writer as _writer

        _init = _writer.SegmentWriter.__init__

        def _stalling_init(self, *args, **kwargs):
            _init(self, *args, **kwargs)
            real = self.disk

            def datasync(fd):
                stalls = not _thread_only or threading.current_thread() is not threading.main_thread()
                if stalls and os.path.exists(_marker):
                    open(_marker + ".stalled", "w").close()
                    deadline = time.monotonic() + 20
                    while os.path.exists(_marker) and time.monotonic() < deadline:
                        time.sleep(0.005)
                return real.datasync(fd)

            self.disk = types.SimpleNamespace(pwrite_all=real.pwrite_all, datasync=datasync,
                                              zero_fill=real.zero_fill)

        _writer.SegmentWriter.__init__ = _stalling_init
''')


def stalled_fsync_env(hook_dir: str | os.PathLike, marker: str | os.PathLike, *,
                      writer_thread_only: bool = False) -> dict[str, str]:
    """Write the stall hook into ``hook_dir`` (created if missing) and return the environment
    (``PYTHONPATH`` and the hook's variables) for a server process that loads it; the stall
    is on while ``marker`` exists, and ``<marker>.stalled`` appears once a sync has stalled."""
    os.makedirs(hook_dir, exist_ok=True)
    with open(os.path.join(hook_dir, "sitecustomize.py"), "w") as f:
        f.write(_HOOK)
    env = {"PYTHONPATH": os.fspath(hook_dir), "FASTLOCK_TEST_STALL_FSYNC": os.fspath(marker)}
    if writer_thread_only:
        env["FASTLOCK_TEST_STALL_THREAD_ONLY"] = "1"
    return env
