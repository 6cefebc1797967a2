"""``mypy --strict`` on a user's script that touches every public API (tests/typecheck/).

user_script.py must check clean with every value's type pinned by ``assert_type`` (which
fails on ``Any``): SyncClient.lock()/lock_many() as context managers, Client.watch() and
holder() included.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("mypy")

HERE = Path(__file__).resolve().parent / "typecheck"
_ERROR = re.compile(r"^(?P<file>[^:]+):(?P<line>\d+): error: (?P<message>.*)$")


def mypy_strict(path: Path, cwd: Path) -> tuple[int, list[tuple[int, str]]]:
    """Run mypy --strict on one file (against the installed fastlock); (exit status, [(line, error)])."""
    result = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--no-incremental", "--cache-dir", str(cwd / "cache"),
         "--python-version", "3.11", str(path)],
        capture_output=True, text=True, timeout=300, cwd=cwd,
    )
    errors = [(int(m["line"]), m["message"]) for m in map(_ERROR.match, result.stdout.splitlines()) if m]
    assert result.returncode == 0 or errors, result.stdout + result.stderr  # a crash is not a type error
    return result.returncode, errors


def test_user_script_is_strict_clean(tmp_path):
    status, errors = mypy_strict(HERE / "user_script.py", tmp_path)
    assert (status, errors) == (0, [])


def test_plugin_and_recipes_are_strict_clean(tmp_path):
    """The modules users import from their own typed code (celery and django ship no types,
    so their recipes are left out)."""
    result = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--no-incremental", "--cache-dir", str(tmp_path / "cache"),
         "-p", "fastlock.testing", "-p", "fastlock.sdnotify", "-p", "fastlock.contrib.fastapi",
         "-p", "fastlock.contrib.clients"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )
    assert result.returncode == 0, result.stdout + result.stderr
