"""``mypy --strict`` on a user's script that touches every public API (tests/typecheck/).

user_script.py must check clean with every value's type pinned by ``assert_type`` (which
fails on ``Any``): SyncClient.lock()/lock_many() as context managers, Client.watch() and
holder() included.
"""

from __future__ import annotations

import os
import re
import site
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("mypy")

HERE = Path(__file__).resolve().parent / "typecheck"
_ERROR = re.compile(r"^(?P<file>[^:]+):(?P<line>\d+): error: (?P<message>.*)$")


def mypy(cwd: Path, *targets: str, checked: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """Run ``mypy --strict`` on ``targets`` from ``cwd``, against the fastlock this Python imports.

    An installed fastlock is found in site-packages, where mypy reports no error of its own
    modules.  An editable install (setuptools' import hook, which mypy does not run) is found
    through MYPYPATH naming the directory that holds the package (mypy refuses site-packages
    there); its modules then count as sources, so a config file silences their errors the same
    way, except in the ``checked`` modules.
    """
    import fastlock

    env = dict(os.environ)
    home = Path(fastlock.__file__).resolve().parent.parent
    config = cwd / "mypy.ini"
    sections = ["[mypy]", "[mypy-fastlock.*]", "ignore_errors = True"]
    sections += [f"[mypy-{module}]\nignore_errors = False" for module in checked]
    config.write_text("\n".join(sections) + "\n")
    if str(home) not in {str(Path(p).resolve()) for p in site.getsitepackages()}:
        env["MYPYPATH"] = str(home)
    return subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--no-incremental", "--cache-dir", str(cwd / "cache"),
         "--config-file", str(config), "--python-version", "3.11", *targets],
        capture_output=True, text=True, timeout=300, cwd=cwd, env=env,
    )


def mypy_strict(path: Path, cwd: Path) -> tuple[int, list[tuple[int, str]]]:
    """Run mypy --strict on one file (against the installed fastlock); (exit status, [(line, error)])."""
    result = mypy(cwd, str(path))
    errors = [(int(m["line"]), m["message"]) for m in map(_ERROR.match, result.stdout.splitlines()) if m]
    assert result.returncode == 0 or errors, result.stdout + result.stderr  # a crash is not a type error
    return result.returncode, errors


def test_user_script_is_strict_clean(tmp_path):
    status, errors = mypy_strict(HERE / "user_script.py", tmp_path)
    assert (status, errors) == (0, [])


def test_plugin_and_recipes_are_strict_clean(tmp_path):
    """The modules users import from their own typed code (celery and django ship no types,
    so their recipes are left out)."""
    modules = ("fastlock.testing", "fastlock.sdnotify", "fastlock.contrib.fastapi", "fastlock.contrib.clients")
    result = mypy(tmp_path, *(arg for module in modules for arg in ("-p", module)), checked=modules)
    assert result.returncode == 0, result.stdout + result.stderr
