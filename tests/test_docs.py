"""Docs that run: every ``python``, ``sh`` and ``toml`` block of README.md and docs/**/*.md
is run against a real server, and every command they quote from the repository runs.

How a block runs:

* A ``python`` block that defines ``test_*`` functions (docs/testing.md) is a user's test
  file: it is written to a fresh temporary directory and run by pytest in a separate
  process (the installed plugin gives it its fixtures); every test function in it must
  pass, none may be skipped.
* Any other ``python`` or ``sh`` block runs in a fresh temporary directory, as a separate
  process, with ``FASTLOCK_SERVER`` naming a real ``fastlock serve`` (open mode, on a free
  port) and ``fastlock`` on the PATH; the address ``127.0.0.1:7420`` the docs use is
  replaced by that server's.  It must exit 0.
* A ``toml`` block is a server config file: ``fastlock serve --config FILE --print-config``
  must accept it and show every key it sets as read from that file.

Markers, each an HTML comment on its own line (invisible when rendered):

* ``<!-- docs-test: skip REASON -->`` on the line before a block's fence: the block is not
  run and is reported as skipped with that reason (it continues an earlier block, needs
  your own code, starts servers that run until stopped, or is the quick start itself).
* ``<!-- docs-test: repository-root -->`` on the line before a block's fence: the block
  runs with the repository root as its working directory (``python -m benches.load``),
  not in a temporary directory.  Such a block must not write outside ignored paths.
* ``<!-- docs-test: output -->`` on the line before a ``text`` block's fence, that block
  following a ``python`` or ``sh`` block (blank lines between are allowed): the text is
  the block's expected standard output, compared line by line.  Within a line ``...``
  matches any text; a line that is only ``...`` matches any number of lines (none
  included).  Trailing spaces are ignored.

Commands quoted inline are checked too: every ``python -m benches.NAME ...`` in the docs
(README.md, docs/**/*.md, benches/README.md) imports from the repository root and knows
every ``--flag`` it is quoted with; ``make bench`` and ``python -m fastlock.wal dump
--state DIR`` run from the repository root.  The test also checks that no document links
a file outside the repository.
"""

from __future__ import annotations

import ast
import os
import re
import shlex
import subprocess
import sys
from functools import cache
from pathlib import Path
from typing import NamedTuple

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
LANGUAGES = {"python": "python", "py": "python", "sh": "sh", "bash": "sh", "shell": "sh", "toml": "toml"}
MARKER = re.compile(r"^\s*<!--\s*docs-test:\s*(?P<what>skip|output|repository-root)\b\s*(?P<reason>.*?)\s*-->\s*$")
#: a fence, indented or not (mkdocs admonitions and tabs indent their blocks)
FENCE = re.compile(r"^(?P<indent>\s*)```(?P<language>\w*)\s*$")
TIMEOUT = 60.0
#: a user's test file runs whole servers (a primary and a standby, a failover)
PYTEST_TIMEOUT = 300.0
#: ``python -m benches.NAME`` and the arguments quoted after it, up to the end of the inline code
BENCH_COMMAND = re.compile(r"python -m benches\.(?P<module>[\w.]+)(?P<args>[^`\n]*)")

pytestmark = pytest.mark.skipif(not (ROOT / "README.md").is_file(), reason="needs the source tree")


class Block(NamedTuple):
    """One fenced code block of a document."""

    where: str  # "path:line" of the opening fence, relative to the repository root
    language: str  # "python", "sh" or "toml"
    code: str
    skip: str | None  # the skip marker's reason
    from_root: bool  # run with the repository root as the working directory
    output: list[str] | None  # the expected standard output, or None when none is shown


class Document(NamedTuple):
    """A document's blocks, and the output markers that are not attached to a block."""

    blocks: list[Block]
    stray_outputs: list[str]


def _fence_end(lines: list[str], start: int) -> int:
    """The index of the closing fence of the block opened at ``start`` (or len(lines))."""
    i = start + 1
    while i < len(lines) and not lines[i].lstrip().startswith("```"):
        i += 1
    return i


def _dedent(lines: list[str], indent: str) -> list[str]:
    return [line[len(indent):] if line.startswith(indent) else line.lstrip() for line in lines]


def _markers(lines: list[str], fence: int) -> dict[str, str]:
    """The docs-test markers on the lines right above the fence at ``fence``: what -> reason."""
    found: dict[str, str] = {}
    i = fence - 1
    while i >= 0 and (m := MARKER.match(lines[i])):
        found[m["what"]] = m["reason"]
        i -= 1
    return found


def parse(path: Path) -> Document:
    """Every python/sh/toml block of ``path``, with its markers and expected output."""
    lines = path.read_text().splitlines()
    blocks: list[Block] = []
    attached: set[int] = set()  # line indexes of output markers that belong to a block
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        start, end = i, _fence_end(lines, i)
        i = end + 1
        language = LANGUAGES.get(m["language"])
        if language is None:
            continue
        markers = _markers(lines, start)
        output = None
        if language != "toml":
            j = i
            while j < len(lines) and not lines[j].strip():
                j += 1
            if (j + 1 < len(lines) and (om := MARKER.match(lines[j])) and om["what"] == "output"
                    and lines[j + 1].strip() == "```text"):
                text_end = _fence_end(lines, j + 1)
                text_fence = FENCE.match(lines[j + 1])
                output = _dedent(lines[j + 2:text_end], text_fence["indent"] if text_fence else "")
                attached.add(j)
                i = text_end + 1
        blocks.append(Block(where=f"{path.relative_to(ROOT)}:{start + 1}", language=language,
                            code="\n".join(_dedent(lines[start + 1:end], m["indent"])) + "\n",
                            skip=markers.get("skip"),
                            from_root="repository-root" in markers, output=output))
    stray = [f"{path.relative_to(ROOT)}:{n + 1}" for n, line in enumerate(lines)
             if (m := MARKER.match(line)) and m["what"] == "output" and n not in attached]
    return Document(blocks, stray)


def blocks(*, toml: bool) -> list:
    """``pytest.param(block)`` for every toml block (``toml``) or every python/sh block,
    skipped if it says so."""
    found = []
    for path in DOCS:
        for block in parse(path).blocks:
            if (block.language == "toml") != toml:
                continue
            marks = [pytest.mark.skip(reason=block.skip)] if block.skip is not None else []
            found.append(pytest.param(block, id=block.where, marks=marks))
    return found


def output_matches(expected: list[str], actual: list[str]) -> bool:
    """Whether ``actual`` lines match ``expected``: ``...`` within a line matches any text, a
    line that is only ``...`` any number of lines; trailing spaces are ignored."""
    expected = [line.rstrip() for line in expected]
    actual = [line.rstrip() for line in actual]

    @cache
    def match(e: int, a: int) -> bool:
        if e == len(expected):
            return a == len(actual)
        if expected[e] == "...":
            return match(e + 1, a) or (a < len(actual) and match(e, a + 1))
        if a == len(actual):
            return False
        pattern = ".*".join(re.escape(part) for part in expected[e].split("..."))
        return re.fullmatch(pattern, actual[a]) is not None and match(e + 1, a + 1)

    return match(0, 0)


def test_output_matching():
    assert output_matches(["a", "b"], ["a", "b  "])
    assert not output_matches(["a", "b"], ["a"])
    assert not output_matches(["a"], ["a", "b"])
    assert output_matches(["x=...!"], ["x=42!"])
    assert not output_matches(["x=...!"], ["x=42"])
    assert output_matches(["start", "...", "end"], ["start", "end"])
    assert output_matches(["start", "...", "end"], ["start", "1", "2", "end"])
    assert not output_matches(["start", "...", "end"], ["start", "1", "2"])
    assert not output_matches(["a.b"], ["axb"])  # only ``...`` is a wildcard


def test_every_output_block_follows_a_runnable_block():
    stray = [where for path in DOCS for where in parse(path).stray_outputs]
    assert not stray, f"a `docs-test: output` marker must come right after a python or sh block: {stray}"


def test_the_parser_attaches_output_and_markers(tmp_path, monkeypatch):
    doc = tmp_path / "doc.md"
    doc.write_text("\n".join([
        "<!-- docs-test: repository-root -->", "```sh", "echo hi", "```", "",
        "<!-- docs-test: output -->", "```text", "hi", "```",
        "<!-- docs-test: skip not here -->", "```python", "pass", "```",
        "<!-- docs-test: output -->", "```text", "orphan", "```",
    ]) + "\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    got = parse(doc)
    assert got.blocks == [
        Block("doc.md:2", "sh", "echo hi\n", None, True, ["hi"]),
        Block("doc.md:11", "python", "pass\n", "not here", False, ["orphan"]),
    ]
    assert got.stray_outputs == []  # the second output follows the python block: attached
    doc.write_text("text\n\n<!-- docs-test: output -->\n```text\norphan\n```\n")
    assert parse(doc).stray_outputs == ["doc.md:3"]
    # a block indented under an admonition or a tab runs too, dedented
    doc.write_text('!!! note\n    ```python\n    if True:\n        print(1)\n    ```\n\n'
                   '    <!-- docs-test: output -->\n    ```text\n    1\n    ```\n')
    assert parse(doc).blocks == [Block("doc.md:2", "python", "if True:\n    print(1)\n", None, False, ["1"])]


@pytest.fixture(scope="module")
def docs_server(tmp_path_factory):
    from fastlock._testbase import ServerProcess

    srv = ServerProcess(tmp_path_factory.mktemp("docs") / "data").start()
    try:
        yield srv
    finally:
        srv.stop()


def _clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FASTLOCK_")}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return env


def _test_functions(code: str) -> list[str]:
    return [node.name for node in ast.parse(code).body
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test_")]


def _run_as_pytest(block: Block, tmp_path: Path) -> None:
    """Run a block that defines test functions as a user's test file, in its own pytest session."""
    tests = _test_functions(block.code)
    (tmp_path / "test_example.py").write_text(block.code)
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rA", "test_example.py"],
                         cwd=tmp_path, env=_clean_env(), capture_output=True, text=True, timeout=PYTEST_TIMEOUT)
    report = f"exit {out.returncode}\n--- stdout\n{out.stdout}\n--- stderr\n{out.stderr}"
    assert out.returncode == 0, report
    summary = out.stdout.strip().splitlines()[-1]
    assert re.search(rf"\b{len(tests)} passed\b", summary) and "skipped" not in summary, report
    for name in tests:
        assert re.search(rf"^PASSED test_example.py::{name}\b", out.stdout, re.M), report


@pytest.mark.parametrize("block", blocks(toml=False))
def test_block_runs(docs_server, tmp_path, block):
    if block.language == "python" and _test_functions(block.code):
        _run_as_pytest(block, tmp_path)
        return
    code = block.code.replace("127.0.0.1:7420", docs_server.address)
    env = _clean_env()
    env["FASTLOCK_SERVER"] = docs_server.address
    if block.language == "python":
        argv = [sys.executable, "-c", code]
    else:
        argv = ["bash", "-euo", "pipefail", "-c", code]
    out = subprocess.run(argv, cwd=ROOT if block.from_root else tmp_path, env=env, capture_output=True,
                         text=True, timeout=TIMEOUT)
    report = f"exit {out.returncode}\n--- stdout\n{out.stdout}\n--- stderr\n{out.stderr}"
    assert out.returncode == 0, report
    if block.output is not None:
        expected = "\n".join(block.output)
        assert output_matches(block.output, out.stdout.splitlines()), f"expected output:\n{expected}\n{report}"


@pytest.mark.parametrize("block", blocks(toml=True))
def test_config_block_loads(tmp_path, block):
    import tomllib

    keys = tomllib.loads(block.code)
    config = tmp_path / "fastlock.toml"
    config.write_text(block.code)
    out = subprocess.run([sys.executable, "-m", "fastlock", "serve", "--config", str(config), "--print-config"],
                         cwd=tmp_path, env=_clean_env(), capture_output=True, text=True, timeout=TIMEOUT)
    assert out.returncode == 0, out.stdout + out.stderr
    for key in keys:
        shown = key.replace("_", "-")
        assert re.search(rf"^{re.escape(shown)} = .*# file {re.escape(str(config))}$", out.stdout, re.M), \
            f"{key!r} is not read from the file:\n{out.stdout}"


def _quoted_bench_commands() -> dict[str, set[str]]:
    """Bench module -> every ``--flag`` quoted with it, over the docs and benches/README.md."""
    commands: dict[str, set[str]] = {}
    for path in [*DOCS, ROOT / "benches" / "README.md"]:
        for m in BENCH_COMMAND.finditer(path.read_text()):
            flags = commands.setdefault(m["module"], set())
            try:
                words = shlex.split(m["args"])
            except ValueError:  # an unbalanced quote in prose after the command
                words = m["args"].split()
            # a quoted value with spaces (--server-args "--replication sync") is not this module's flag
            flags.update(word.split("=")[0] for word in words if word.startswith("--") and " " not in word)
    return commands


@pytest.mark.parametrize("module, flags", sorted(_quoted_bench_commands().items()))
def test_quoted_bench_command_runs_from_the_repository_root(module, flags):
    """``python -m benches.NAME --help`` from the repository root (where ``./fastlock`` is
    the package imported): it imports, and its help names every flag the docs quote."""
    out = subprocess.run([sys.executable, "-m", f"benches.{module}", "--help"], cwd=ROOT, env=_clean_env(),
                         capture_output=True, text=True, timeout=TIMEOUT)
    assert out.returncode == 0, out.stdout + out.stderr
    unknown = sorted(flag for flag in flags if not re.search(rf"{re.escape(flag)}\b", out.stdout))
    assert not unknown, f"benches.{module} has no {unknown}:\n{out.stdout}"


def test_make_bench_runs():
    """The recipe of ``make bench`` (a quick load run), with this Python, from the repository root."""
    makefile = (ROOT / "Makefile").read_text()
    recipe = re.search(r"^bench:.*\n\t(?P<command>.+)$", makefile, re.M)
    assert recipe, "the Makefile has no bench target"
    command = recipe["command"].replace("$(VENV)/bin/python", shlex.quote(sys.executable))
    out = subprocess.run(command, shell=True, cwd=ROOT, env=_clean_env(), capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    assert re.search(r"^W1 ", out.stdout, re.M) and "fastlock fsync=never" in out.stdout, out.stdout


def test_wal_dump_state_runs_from_the_repository_root(tmp_path):
    """``python -m fastlock.wal dump --state DIR`` from the repository root, on a real server's data."""
    from fastlock._testbase import ServerProcess
    from fastlock.sync import SyncClient

    data = tmp_path / "data"
    srv = ServerProcess(data).start()
    try:
        with SyncClient(srv.address) as client:
            lease = client.acquire("docs/held", ttl=600)
    finally:
        srv.stop()
    out = subprocess.run([sys.executable, "-m", "fastlock.wal", "dump", "--state", str(data)], cwd=ROOT,
                         env=_clean_env(), capture_output=True, text=True, timeout=TIMEOUT)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "docs/held" in out.stdout and str(lease.fencing_token) in out.stdout, out.stdout


def test_the_watch_event_table_lists_every_field():
    """docs/client-features.md's table of WatchEvent fields names each field, in order."""
    import dataclasses

    from fastlock.client import WatchEvent

    text = (ROOT / "docs" / "client-features.md").read_text()
    table = text[text.index("| `WatchEvent` field |"):].split("\n\n")[0]
    rows = re.findall(r"^\| `(\w+)` \|", table, re.M)
    assert rows == [field.name for field in dataclasses.fields(WatchEvent)]


def test_docs_link_only_files_in_the_repository():
    wrong = []
    for path in DOCS:
        for target in re.findall(r"\]\(([^)#\s]+)", path.read_text()):
            if "://" in target or target.startswith("mailto:"):
                continue
            if not (path.parent / target).resolve().is_relative_to(ROOT) or not (path.parent / target).exists():
                wrong.append(f"{path.relative_to(ROOT)}: {target}")
    assert not wrong, wrong
