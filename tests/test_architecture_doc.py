"""docs/architecture.md stays true: every module it names exists, and it names every module.

A name is a backquoted path ending in ``.py``, ``.pyx`` or ``.pxi``, or a package ending in ``/``.
A path with a ``/`` is read from ``fastlock/`` (``client/lease.py``), or from the repository
for ``tests/`` and ``fastlock/`` themselves; a bare file name in a row of the package table is
read in that row's package first (the ``wal/`` row names ``records.py``), else in ``fastlock/``.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "fastlock"
DOC = ROOT / "docs" / "architecture.md"

pytestmark = pytest.mark.skipif(not (PACKAGE / "__init__.py").is_file() or not DOC.is_file(),
                                reason="needs the source tree (tests/ beside fastlock/ and docs/)")

_NAME = re.compile(r"`([\w./]+\.(?:py|pyx|pxi)|[\w./]*/)`")


def _row_package(line: str) -> str | None:
    """The one package (``wal/``) the first cell of a table row names, if it names one."""
    if not line.startswith("|"):
        return None
    first = line.strip("|").split("|")[0]
    packages = [n for n in re.findall(r"`([\w]+/)`", first)]
    return packages[0] if len(packages) == 1 else None


def named_paths(text: str) -> tuple[set[Path], list[str]]:
    """The files and packages ``text`` names (resolved), and the names that resolve to nothing."""
    found: set[Path] = set()
    unknown: list[str] = []
    for line in text.splitlines():
        package = _row_package(line)
        for name in _NAME.findall(line):
            if name.startswith(("tests/", "fastlock/")):
                candidates = [ROOT / name]
            elif "/" in name.rstrip("/"):
                candidates = [PACKAGE / name]
            else:
                candidates = ([PACKAGE / package / name] if package and not name.endswith("/") else []) + [
                    PACKAGE / name]
            hit = next((c for c in candidates if c.exists()), None)
            if hit is None:
                unknown.append(name)
            else:
                found.add(hit.resolve())
    return found, unknown


def modules_and_packages() -> tuple[list[Path], list[Path]]:
    """Every module of fastlock/ (``.py``, ``.pyx``, ``.pxi``; a package's ``__init__`` and
    ``__main__`` are the package's) and every subpackage."""
    modules = sorted(p.resolve() for ext in ("py", "pyx", "pxi") for p in PACKAGE.rglob(f"*.{ext}")
                     if p.name not in ("__init__.py", "__main__.py") and "__pycache__" not in p.parts)
    packages = sorted(p.parent.resolve() for p in PACKAGE.rglob("__init__.py") if p.parent != PACKAGE)
    return modules, packages


def test_every_module_the_architecture_names_exists():
    _, unknown = named_paths(DOC.read_text(encoding="utf-8"))
    assert not unknown, f"docs/architecture.md names modules that do not exist: {sorted(set(unknown))}"


def test_the_architecture_names_every_package_and_module():
    found, _ = named_paths(DOC.read_text(encoding="utf-8"))
    modules, packages = modules_and_packages()
    missing = [str(p.relative_to(PACKAGE)) for p in packages + modules if p not in found]
    assert not missing, f"docs/architecture.md does not name: {missing}"


def test_the_reader_resolves_table_rows_and_sees_a_wrong_name():
    """The checks above cannot pass by reading nothing."""
    text = ("| `wal/` | `records.py`, `nothing_here.py` |\n"
            "see `client/lease.py`, `roles.py` and `server/`\n")
    found, unknown = named_paths(text)
    assert found == {(PACKAGE / p).resolve() for p in ("wal", "wal/records.py", "client/lease.py", "roles.py",
                                                       "server")}
    assert unknown == ["nothing_here.py"]
    modules, packages = modules_and_packages()
    assert (PACKAGE / "_core_state.pxi").resolve() in modules and (PACKAGE / "client").resolve() in packages
