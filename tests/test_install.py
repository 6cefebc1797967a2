"""Installing fastlock into a user's own project: the wheel ``make wheel`` builds (in ``dist/``)
installs into a fresh virtual environment outside the repository with the extras docs/install.md
names, the README's asyncio example takes a lock through it, and every extra pyproject.toml
declares resolves.  Skipped without a wheel in ``dist/``: ``make wheel`` builds one (CI's
``make wheel-check`` does, before the suite)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text()) if (ROOT / "pyproject.toml").is_file() else {}
VERSION = PYPROJECT.get("project", {}).get("version", "")
WHEELS = sorted((ROOT / "dist").glob(f"fastlock-{VERSION}-*.whl")) if VERSION else []
#: the extras docs/install.md's first commands install
EXTRAS = "metrics,etcd"

pytestmark = [
    pytest.mark.skipif(not WHEELS, reason="no wheel in dist/: `make wheel` builds one (CI's make wheel-check does)"),
    pytest.mark.timeout(600),
]


def _run(argv: list[str], **kwargs) -> subprocess.CompletedProcess:
    out = subprocess.run(argv, capture_output=True, text=True, timeout=540, **kwargs)
    assert out.returncode == 0, f"{' '.join(argv)} exited {out.returncode}\n{out.stdout}\n{out.stderr}"
    return out


@pytest.fixture(scope="module")
def user_venv(tmp_path_factory) -> Path:
    """A fresh virtual environment, outside the repository, with the wheel and its extras installed
    as docs/install.md says: ``pip install "dist/fastlock-*.whl[metrics,etcd]"``."""
    where = tmp_path_factory.mktemp("user-project")
    _run([sys.executable, "-m", "venv", str(where / "venv")])
    python = where / "venv" / "bin" / "python"
    _run([str(python), "-m", "pip", "install", "-q", f"{WHEELS[-1]}[{EXTRAS}]"], cwd=where)
    return where / "venv"


def readme_asyncio_example() -> str:
    """The README's first python block after its "Take a lock" heading."""
    text = (ROOT / "README.md").read_text().split("\n## Take a lock", 1)[1]
    return re.search(r"```python\n(.*?)```", text, re.S).group(1)


def test_readme_example_takes_a_lock_in_a_fresh_environment(user_venv, server, tmp_path):
    code = readme_asyncio_example().replace("127.0.0.1:7420", server.address)
    out = _run([str(user_venv / "bin" / "python"), "-c", code], cwd=tmp_path)  # cwd: not the source tree
    assert re.fullmatch(r"holding orders/42 with fencing token [1-9]\d*\n", out.stdout), out.stdout
    where = _run([str(user_venv / "bin" / "python"), "-c", "import fastlock, fastlock.metrics, httpx; "
                  "print(fastlock.__file__)"], cwd=tmp_path)
    assert Path(where.stdout.strip()).is_relative_to(user_venv), where.stdout  # the installed copy


def test_the_command_is_installed(user_venv, tmp_path):
    out = _run([str(user_venv / "bin" / "fastlock"), "--version"], cwd=tmp_path)
    assert out.stdout.strip() == f"fastlock {VERSION}"


def test_every_extra_resolves(user_venv, tmp_path):
    """``pip install --dry-run`` of the wheel with every extra pyproject.toml declares: each exists
    (pip warns "does not provide the extra" otherwise) and its requirements resolve."""
    extras = sorted(PYPROJECT["project"]["optional-dependencies"])
    assert {"metrics", "etcd", "tooz", "celery", "django", "fastapi", "postgres", "docs"} <= set(extras)
    out = _run([str(user_venv / "bin" / "python"), "-m", "pip", "install", "--dry-run",
                f"{WHEELS[-1]}[{','.join(extras)}]"], cwd=tmp_path)
    assert "does not provide the extra" not in out.stdout + out.stderr, out.stderr
