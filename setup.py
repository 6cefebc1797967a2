"""Build the compiled core.  Everything else lives in pyproject.toml.

Switches (environment variables):
  FASTLOCK_DEBUG=1     build without optimisation, with Cython's bounds checks on
  FASTLOCK_ANNOTATE=1  write fastlock/_core.html (``cython -a``) to find Python calls on hot paths
"""

import os

from Cython.Build import cythonize
from setuptools import Extension, setup

debug = os.environ.get("FASTLOCK_DEBUG") == "1"

directives = {
    "language_level": 3,
    "boundscheck": debug,
    "wraparound": debug,
    "initializedcheck": debug,
    "cdivision": True,
    "embedsignature": True,
}

extensions = [
    Extension(
        "fastlock._core",
        ["fastlock/_core.pyx"],
        extra_compile_args=["-O0", "-g"] if debug else ["-O2"],
    ),
    # the WAL's write + fdatasync thread loop, without the GIL (fastlock/wal/writer.py)
    Extension(
        "fastlock.wal._syncer",
        ["fastlock/wal/_syncer.pyx"],
        libraries=["z"],  # zlib's crc32 for the frames (append_frame), as the zlib module's
        extra_compile_args=["-O0", "-g"] if debug else ["-O2"],
    ),
    # a server connection's input, dispatch and reply templates (fastlock/server/session.py)
    Extension(
        "fastlock.server._wire",
        ["fastlock/server/_wire.pyx"],
        extra_compile_args=["-O0", "-g"] if debug else ["-O2"],
    ),
    # a client connection's requests and replies (fastlock/protocol/rpc.py)
    Extension(
        "fastlock.protocol._wire",
        ["fastlock/protocol/_wire.pyx"],
        extra_compile_args=["-O0", "-g"] if debug else ["-O2"],
    ),
    # the asyncio client's argument checks and grant decoding (fastlock/client/client.py)
    Extension(
        "fastlock.client._path",
        ["fastlock/client/_path.pyx"],
        extra_compile_args=["-O0", "-g"] if debug else ["-O2"],
    ),
    # the slots of a lease's mutable state (fastlock/client/lease.py LeaseState)
    Extension(
        "fastlock.client._lease_slots",
        ["fastlock/client/_lease_slots.pyx"],
        extra_compile_args=["-O0", "-g"] if debug else ["-O2"],
    ),
    # who calls the client, and its self-wait table (fastlock/client/acquire.py)
    Extension(
        "fastlock.client._callers",
        ["fastlock/client/_callers.pyx"],
        extra_compile_args=["-O0", "-g"] if debug else ["-O2"],
    ),
    # the watch history's record of each holder change and its publication (fastlock/server/watchlog.py)
    Extension(
        "fastlock.server._watchlog",
        ["fastlock/server/_watchlog.pyx"],
        extra_compile_args=["-O0", "-g"] if debug else ["-O2"],
    ),
    # group commit: a record's append, the hand-off to the writer, a written batch's acknowledgement
    Extension(
        "fastlock.wal.commit",
        ["fastlock/wal/commit.pyx"],
        extra_compile_args=["-O0", "-g"] if debug else ["-O2"],
    ),
    # the replication source's and sync gate's flags the request path reads (fastlock/replication/source.py)
    Extension(
        "fastlock.replication._wire",
        ["fastlock/replication/_wire.pyx"],
        extra_compile_args=["-O0", "-g"] if debug else ["-O2"],
    ),
]

setup(
    ext_modules=cythonize(
        extensions,
        compiler_directives=directives,
        annotate=os.environ.get("FASTLOCK_ANNOTATE") == "1",
    ),
)
