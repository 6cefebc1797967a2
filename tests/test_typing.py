"""``mypy --strict`` on a user's script that touches every public API (tests/typecheck/).

user_script.py must check clean with every value's type pinned by ``assert_type``.
leaks.py holds the public APIs that still give ``Any``; each is an expected failure until its
annotation is fixed (strict: once fixed, the test reports XPASS as a failure, so the marker
goes and the check joins user_script.py).
"""

from __future__ import annotations

import ast
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


@pytest.fixture(scope="module")
def leak_errors(tmp_path_factory) -> dict[str, list[str]]:
    """mypy's errors in leaks.py, by the function they are in."""
    path = HERE / "leaks.py"
    _, errors = mypy_strict(path, tmp_path_factory.mktemp("mypy"))
    spans = {node.name: (node.lineno, node.end_lineno) for node in ast.parse(path.read_text()).body
             if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))}
    by_function: dict[str, list[str]] = {name: [] for name in spans}
    for line, message in errors:
        owner = next((name for name, (a, b) in spans.items() if a <= line <= (b or a)), None)
        assert owner is not None, f"leaks.py:{line}: {message} (outside every function)"
        by_function[owner].append(f"{line}: {message}")
    return by_function


LEAKS = {
    "sync_lock_enter": "fastlock.sync: SyncLockContext is not generic; SyncClient.lock() should return "
                       "SyncLockContext[SyncLease] (__enter__ -> SyncLease)",
    "sync_lock_many_enter": "SyncClient.lock_many() should return SyncLockContext[SyncMultiLease]",
    "async_watch": "Client.watch() is unannotated: -> AsyncIterator[WatchEvent]",
    "async_holder": "Client.holder() returns a bare dict: -> HolderInfo | None (a TypedDict)",
    "sync_holder": "SyncClient.holder() returns a bare dict: -> HolderInfo | None",
}


@pytest.mark.parametrize("function", sorted(LEAKS))
def test_public_api_gives_no_any(leak_errors, function, request):
    request.node.add_marker(pytest.mark.xfail(strict=True, reason=LEAKS[function]))
    assert leak_errors[function] == []


def test_every_leak_function_is_listed(leak_errors):
    assert sorted(leak_errors) == sorted(LEAKS)


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
