"""The documentation as a way in: every page of docs/ is reachable from README.md or the site's
nav (mkdocs.yml), the README stays short and starts with the quick start, the generated
command-line and configuration reference name every command, flag and variable, every extra the
docs name exists, and the site builds with ``mkdocs build --strict`` where mkdocs is installed
(``pip install '.[docs]'``; CI installs it with ``make docs``)."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
README = ROOT / "README.md"
MKDOCS = ROOT / "mkdocs.yml"
HOOK = DOCS / "hooks" / "reference.py"

pytestmark = pytest.mark.skipif(not MKDOCS.is_file(), reason="needs the source tree")


def pages() -> set[str]:
    """Every Markdown page of the site, relative to docs/."""
    return {p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md") if "hooks" not in p.parts}


def nav_pages() -> set[str]:
    """The pages mkdocs.yml's nav names (commented lines are not in the nav)."""
    text = MKDOCS.read_text().split("\nnav:", 1)[1]
    return {m.group(1) for line in text.splitlines() if not line.lstrip().startswith("#")
            for m in [re.search(r":\s*([\w/.-]+\.md)\s*$", line)] if m}


def readme_pages() -> set[str]:
    return {target.removeprefix("docs/") for target in re.findall(r"\]\((docs/[^)#\s]+\.md)", README.read_text())}


def reference_hook():
    spec = importlib.util.spec_from_file_location("docs_reference_hook", HOOK)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_page_is_reachable_from_the_readme_or_the_nav():
    unreachable = pages() - nav_pages() - readme_pages()
    assert not unreachable, f"pages neither in mkdocs.yml's nav nor linked from README.md: {sorted(unreachable)}"
    missing = (nav_pages() | readme_pages()) - pages()
    assert not missing, f"the nav or the README names pages that do not exist: {sorted(missing)}"


def test_readme_is_short_and_starts_with_the_quick_start():
    lines = README.read_text().splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines: move detail into docs/"
    commands = [line.split("#")[0].strip() for line in lines if line.startswith("make ")]
    assert commands[:2] == ["make demo", "make test"], commands
    assert "FAIL" not in README.read_text()


def _fastlock_help(*argv: str) -> str:
    out = subprocess.run([sys.executable, "-m", "fastlock", *argv, "--help"], capture_output=True, text=True,
                         timeout=60, cwd=DOCS)
    assert out.returncode == 0, out.stderr
    return out.stdout


#: prints, as JSON, ``{"<argv joined>": [exit status, stdout]}`` of ``fastlock <argv> --help`` for
#: each argv of the JSON list on stdin: argparse's own --help, in one interpreter for all of them
HELPS = r"""
import contextlib, io, json, sys
from fastlock.cli import main
answers = {}
for argv in json.loads(sys.stdin.read()):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            status = main([*argv, "--help"])
        except SystemExit as exc:
            status = exc.code or 0
    answers[" ".join(argv)] = [status, out.getvalue()]
print(json.dumps(answers))
"""


def _fastlock_helps(argvs: list[list[str]]) -> list[str]:
    """``fastlock <argv> --help`` of each of ``argvs``, from one Python process (its start and
    fastlock's import are most of a --help's time on a loaded machine)."""
    out = subprocess.run([sys.executable, "-c", HELPS], input=json.dumps(argvs), capture_output=True, text=True,
                         timeout=600, cwd=DOCS)
    assert out.returncode == 0, out.stderr
    answers = json.loads(out.stdout)
    texts = []
    for argv in argvs:
        status, text = answers[" ".join(argv)]
        assert status == 0, (argv, out.stderr)
        texts.append(text)
    return texts


def _subcommands(help_text: str) -> list[str]:
    usage = help_text.split("\n\n", 1)[0]
    choices = re.search(r"\{([\w,-]+)\}\s+\.\.\.", usage)  # a subcommand: "{dump} ..."
    return choices.group(1).split(",") if choices else []


def test_cli_reference_names_every_command_and_flag():
    """The reference is generated from the parsers; checked here against each command's --help
    (the commands of one level of subcommands asked of one Python process)."""
    reference = reference_hook().cli_reference()
    commands = [[name] for name in _subcommands(_fastlock_help())]
    assert len(commands) >= 10, commands
    seen = asked = 0
    while commands:
        level, commands = commands, []
        for argv, text in zip(level, _fastlock_helps(level)):
            asked += 1
            assert f"`fastlock {' '.join(argv)}`" in reference, argv
            assert text.startswith("usage: fastlock " + " ".join(argv)), (argv, text[:200])
            specs = re.findall(r"^  (-.*?)(?:  |$)", text, re.M)  # "  -o, --output {table,json}   help..."
            for flag in {f for spec in specs for f in re.findall(r"(?<![\w-])--?[a-zA-Z][\w-]*", spec)}:
                assert f"`{flag}`" in reference, (argv, flag)
                seen += 1
            commands += [[*argv, sub] for sub in _subcommands(text)]
    assert seen > 100 and asked > 10


def test_config_reference_names_every_serve_setting():
    reference = reference_hook().config_reference()
    text = _fastlock_help("serve")
    flags = set(re.findall(r"^\s+(--[a-z][\w-]*)", text, re.M)) - {"--help", "--config", "--print-config"}
    assert len(flags) > 50
    for flag in flags:
        name = flag.removeprefix("--")
        assert f"`FASTLOCK_{name.replace('-', '_').upper()}`" in reference, flag
        assert f"| `{name}` |" in reference, flag


def test_every_extra_the_docs_name_exists():
    extras = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    named = set()
    for path in [README, *DOCS.rglob("*.md")]:
        for group in re.findall(r"(?:fastlock|\.whl\)?)\[([\w,-]+)\]", path.read_text()):
            named |= set(group.split(","))
    assert named, "no extra named anywhere"
    assert named <= extras, f"named but not in pyproject.toml: {sorted(named - extras)}"
    table = set(re.findall(r"^\| `([\w-]+)` \|", (DOCS / "install.md").read_text(), re.M))
    assert table == extras, f"docs/install.md's extras table differs from pyproject.toml: {table ^ extras}"


@pytest.mark.timeout(300)
@pytest.mark.skipif(shutil.which("mkdocs", path=str(Path(sys.executable).parent)) is None,
                    reason="mkdocs is not installed (pip install '.[docs]'; CI installs it with make docs)")
def test_site_builds_strict(tmp_path):
    mkdocs = shutil.which("mkdocs", path=str(Path(sys.executable).parent))
    out = subprocess.run([mkdocs, "build", "--strict", "--site-dir", str(tmp_path / "site")], cwd=ROOT,
                         capture_output=True, text=True, timeout=280, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert out.returncode == 0, out.stdout + out.stderr
    cli = (tmp_path / "site" / "cli" / "index.html").read_text()
    assert "--max-leases" in cli and "fastlock revoke" in cli  # the generated reference is in the page
    api = (tmp_path / "site" / "api" / "index.html").read_text()
    assert "SyncClient" in api and "acquire" in api  # the API reference came from the docstrings
