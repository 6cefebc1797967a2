"""Docs that run: every ``python`` and ``sh`` block of README.md and docs/*.md is run
against a real server.

A block runs in a fresh temporary directory, as a separate process, with
``FASTLOCK_SERVER`` naming a real ``fastlock serve`` (open mode, on a free port) and
``fastlock`` on the PATH; the address ``127.0.0.1:7420`` the docs use is replaced by that
server's.  A block that is deliberately partial (it continues an earlier one, needs your
own code, starts long-running servers, or is the quick start itself) carries the marker
``<!-- docs-test: skip REASON -->`` on the line before its fence and is reported as
skipped with that reason.  The test also checks that no document links a file outside
the repository.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LANGUAGES = {"python": "python", "py": "python", "sh": "sh", "bash": "sh", "shell": "sh"}
SKIP = re.compile(r"<!--\s*docs-test:\s*skip\s+(.+?)\s*-->")
FENCE = re.compile(r"^```(\w*)\s*$")
TIMEOUT = 60.0

pytestmark = pytest.mark.skipif(not (ROOT / "README.md").is_file(), reason="needs the source tree")


def blocks() -> list:
    """``pytest.param(language, code)`` for every python/sh block, with its skip marker."""
    found = []
    for path in DOCS:
        lines = path.read_text().splitlines()
        i = 0
        while i < len(lines):
            m = FENCE.match(lines[i])
            if not m:
                i += 1
                continue
            start = i
            i += 1
            while i < len(lines) and not lines[i].startswith("```"):
                i += 1
            language = LANGUAGES.get(m.group(1))
            code = "\n".join(lines[start + 1:i]) + "\n"
            i += 1
            if language is None:
                continue
            where = f"{path.relative_to(ROOT)}:{start + 1}"
            skip = SKIP.search(lines[start - 1]) if start else None
            marks = [pytest.mark.skip(reason=skip.group(1))] if skip else []
            found.append(pytest.param(language, code, id=where, marks=marks))
    return found


@pytest.fixture(scope="module")
def docs_server(tmp_path_factory):
    from fastlock._testbase import ServerProcess

    srv = ServerProcess(tmp_path_factory.mktemp("docs") / "data").start()
    try:
        yield srv
    finally:
        srv.stop()


@pytest.mark.parametrize("language, code", blocks())
def test_block_runs(docs_server, tmp_path, language, code):
    code = code.replace("127.0.0.1:7420", docs_server.address)
    env = {k: v for k, v in os.environ.items() if not k.startswith("FASTLOCK_")}
    env["FASTLOCK_SERVER"] = docs_server.address
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    if language == "python":
        argv = [sys.executable, "-c", code]
    else:
        argv = ["bash", "-euo", "pipefail", "-c", code]
    out = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=TIMEOUT)
    assert out.returncode == 0, f"exit {out.returncode}\n--- stdout\n{out.stdout}\n--- stderr\n{out.stderr}"


def test_docs_link_only_files_in_the_repository():
    wrong = []
    for path in DOCS:
        for target in re.findall(r"\]\(([^)#\s]+)", path.read_text()):
            if "://" in target or target.startswith("mailto:"):
                continue
            if not (path.parent / target).resolve().is_relative_to(ROOT) or not (path.parent / target).exists():
                wrong.append(f"{path.relative_to(ROOT)}: {target}")
    assert not wrong, wrong
