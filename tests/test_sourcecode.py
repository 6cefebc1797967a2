"""The source tree's gates: lint (ruff), types (mypy), and the architecture's
import rules, as asyncpg's ``tests/test__sourcecode.py`` runs its linters
inside the test suite.

The import rules are those of ``docs/architecture.md``, checked on the
source with :mod:`ast` (every ``import`` statement, including those inside
functions; imports under ``if TYPE_CHECKING:`` are left out, since they never
run):

* ``errors``, ``units``, ``logsafe``, ``tokens``, ``sequencer`` and ``_version`` are leaves: they import no other
  layer (``units`` imports ``errors``; ``sequencer`` ``errors`` and ``tokens``);
* the Cython core imports nothing from fastlock; ``protocol`` and ``wal``
  import only leaves;
* ``replication`` never imports ``server``;
* ``client`` imports only ``protocol``, leaves, ``tls`` and ``auth``;
* nothing below imports the top (``cli``, ``_testbase``); a ``__main__`` module
  (``python -m fastlock.x``) is an entry point of the top;
* no import cycle between modules;
* no module reads another module's private (``_x``) names, except the
  Cython core's and the test base's.

The lines per module and the instance attributes per class are a report, not a rule
(``test_size_report`` prints them; ``python tests/source_sizes.py`` prints them alone).

A check that a module fails today is marked ``xfail`` (not strict) with the
reason, module by module, in :data:`PENDING`; files not yet clean for ruff or
mypy are listed in :data:`LINT_PENDING` and :data:`TYPES_PENDING` (checked
apart, as ``xfail``), so that every other file stays clean.
"""

from __future__ import annotations

import ast
import functools
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import source_sizes

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "fastlock"

pytestmark = pytest.mark.skipif(not (PACKAGE / "__init__.py").is_file(),
                                reason="needs the source tree (tests/ beside fastlock/)")

#: modules that import no other layer
LEAVES = {"errors", "units", "logsafe", "_version", "tokens", "sequencer"}
#: the layers above everything else: nothing below them may import them
TOP = {"cli", "_testbase", "testing"}  # testing: the pytest plugin, on top of _testbase
#: what each layer may import, besides itself (None: anything below the top)
ALLOWED: dict[str, set[str] | None] = {
    "errors": set(),
    "units": {"errors"},
    "logsafe": set(),
    "_version": set(),
    "tokens": set(),
    "sequencer": {"errors", "tokens"},  # what a resource verifies with: never the client or the server
    "_core": set(),
    "protocol": LEAVES,
    "wal": LEAVES,
    "client": {"protocol", "tls", "auth", "sharding", *LEAVES},
    "sharding": {"protocol", *LEAVES},  # slots, the shard map, each op's names: no client, no server
    "replication": None,  # and never "server", below
    "server": None,
}
#: top-level modules that re-export a layer's names (old import paths): counted in that layer
LAYER_OF = {
    "election": "client",
    "sync": "client",
    "demo": "cli",  # the `python -m fastlock.demo` shim
}
#: modules whose private names other modules may use
PRIVATE_OK = {"fastlock._core", "fastlock._testbase"}
#: members of a base class from another library that its subclasses are meant to use:
#: tooz's driver base classes keep the member id, joined groups and hooks there
FOREIGN_BASE_MEMBERS = {
    "fastlock.contrib.tooz": {"self._member_id", "self._joined_groups", "self._hooks_elected_leader"},
}
#: the public API of named tuples, whose names begin with "_"
NAMEDTUPLE_API = {"_replace", "_asdict", "_fields", "_make", "_field_defaults"}

_REASON = "not yet lint- or type-clean after the package moves of issue 11"

#: (check, module) -> why the module of the pre-package layout fails that check today
PENDING: dict[tuple[str, str], str] = {}

#: ruff and mypy: files not yet clean, as paths without ".py" (a module and the package it becomes
#: both match); empty: every file passes
LINT_PENDING: list[str] = []
TYPES_PENDING: list[str] = []


# -- the import graph ------------------------------------------------------------------------------


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _sources() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


MODULES = _sources()


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _runtime_nodes(tree: ast.AST) -> Iterator[ast.AST]:
    """Every node of ``tree`` except those under ``if TYPE_CHECKING:``."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child.test):
                stack.extend(child.orelse)
                continue
            stack.append(child)


def _resolve(module: str, is_package: bool, level: int, target: str | None) -> str:
    if not level:
        return target or ""
    base = module.split(".")
    if not is_package:
        base = base[:-1]
    base = base[:len(base) - (level - 1)]
    return ".".join(base + ([target] if target else []))


class _Module:
    """One source module: what it imports (fastlock modules) and which private names it reads."""

    def __init__(self, name: str, path: Path):
        self.name = name
        self.path = path
        self.text = path.read_text(encoding="utf-8")
        self.tree = ast.parse(self.text, str(path))
        is_package = path.name == "__init__.py"
        self.imports: set[str] = set()
        self.private: list[str] = []  # "fastlock.x._y" read from outside fastlock.x
        aliases: dict[str, str] = {}  # local name -> fastlock module
        for node in _runtime_nodes(self.tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.name == "fastlock" or a.name.startswith("fastlock."):
                        self.imports.add(a.name)
                        aliases[a.asname or a.name.split(".")[0]] = a.name if a.asname else "fastlock"
            elif isinstance(node, ast.ImportFrom):
                source = _resolve(name, is_package, node.level, node.module)
                if source != "fastlock" and not source.startswith("fastlock."):
                    continue
                for a in node.names:
                    full = f"{source}.{a.name}"
                    if full in MODULES:  # `from package import module`
                        self.imports.add(full)
                        aliases[a.asname or a.name] = full
                    else:
                        self.imports.add(source)
                        if a.name.startswith("_") and not a.name.startswith("__"):
                            self.private.append(full)
        for node in _runtime_nodes(self.tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.value.id in aliases and node.attr.startswith("_")
                    and not node.attr.startswith("__")):
                self.private.append(f"{aliases[node.value.id]}.{node.attr}")
        self.imports.discard(name)
        # private members read on objects, not defined in this module: another module's internals
        own = {n.name for n in ast.walk(self.tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                                        ast.ClassDef))}
        others: set[str] = set()  # names bound to modules outside fastlock (os._exit is theirs)
        for node in ast.walk(self.tree):
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, (ast.Store, ast.Del)):
                own.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                own.add(node.id)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("_"):
                own.add(node.value)  # __slots__ entries, getattr names
            elif isinstance(node, ast.Import):
                others.update(a.asname or a.name.split(".")[0] for a in node.names)
            elif isinstance(node, ast.ImportFrom) and not node.level and not (node.module or "").startswith("fastlock"):
                others.update(a.asname or a.name for a in node.names)
        self.foreign_members = sorted({
            f"{ast.unparse(node.value)}.{node.attr}" for node in _runtime_nodes(self.tree)
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load)
            and node.attr.startswith("_") and not node.attr.startswith("__") and node.attr not in own
            and node.attr not in NAMEDTUPLE_API
            and not (isinstance(node.value, ast.Name) and (node.value.id in others or node.value.id in aliases))
        })


GRAPH = {name: _Module(name, path) for name, path in MODULES.items()}


def _layer(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1:
        return "fastlock"  # the package root: re-exports the public API
    if parts[-1] == "__main__":
        return "cli"  # `python -m fastlock.x`: a command-line entry point, on top of everything
    return LAYER_OF.get(parts[1], parts[1])


def _owner(module: str) -> str:
    """The module a private name belongs to: a package's names belong to the whole package."""
    while module not in MODULES and "." in module:
        module = module.rsplit(".", 1)[0]
    return module


def _cycles() -> dict[str, list[str]]:
    """Each module that is on an import cycle -> the modules of its cycle (Tarjan's SCCs)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: dict[str, list[str]] = {}
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(GRAPH) + 100))

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in GRAPH[v].imports:
            if w not in GRAPH:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                for w in component:
                    found[w] = sorted(component)

    for v in sorted(GRAPH):
        if v not in index:
            visit(v)
    return found


CYCLES = _cycles()


def _params(check: str) -> list[object]:
    return [pytest.param(m, marks=pytest.mark.xfail(strict=False, reason=PENDING[check, m]))
            if (check, m) in PENDING else m for m in sorted(MODULES)]


# -- import rules ----------------------------------------------------------------------------------


@pytest.mark.parametrize("module", _params("layers"))
def test_imports_follow_the_layer_rules(module):
    layer = _layer(module)
    allowed = ALLOWED.get(layer)
    wrong = []
    for target in sorted(GRAPH[module].imports):
        other = _layer(target)
        if other == layer:
            continue
        if other in TOP and layer not in TOP:
            wrong.append(f"{target} (the top layer)")
        elif other == "fastlock" and layer not in TOP:
            wrong.append(f"{target} (the package root, which imports the client)")
        elif allowed is not None and other not in allowed:
            wrong.append(target)
        elif layer == "replication" and other == "server":
            wrong.append(f"{target} (replication never imports the server)")
    assert not wrong, f"{module} (layer {layer!r}) imports {', '.join(wrong)}"


def _core_files() -> list[Path]:
    """The Cython core: ``_core.pyx``, the concept files it includes, its stub."""
    text = (PACKAGE / "_core.pyx").read_text(encoding="utf-8")
    included = re.findall(r'^include\s+"([^"]+)"', text, re.M)
    assert included, "_core.pyx includes no concept file"
    return [PACKAGE / "_core.pyx", *(PACKAGE / name for name in included), PACKAGE / "_core.pyi"]


def test_the_cython_core_imports_nothing_from_fastlock():
    for path in _core_files():
        text = path.read_text(encoding="utf-8")
        found = re.findall(r"^\s*(?:c?import|from)\s+(?:fastlock\b|\.)\S*", text, re.M)
        assert not found, f"{path.name}: {found}"


def test_the_cython_core_includes_every_concept_file_once():
    included = [p.name for p in _core_files()[1:-1]]
    assert len(set(included)) == len(included), f"_core.pyx includes a file twice: {included}"
    assert sorted(included) == sorted(p.name for p in PACKAGE.glob("_core_*.pxi"))


@pytest.mark.parametrize("module", _params("cycles"))
def test_no_import_cycle(module):
    assert module not in CYCLES, f"{module} is on an import cycle: {' <-> '.join(CYCLES[module])}"


def _shares_privates(module: str, owner: str) -> bool:
    """Modules of one package (not the top-level ``fastlock``) may share private names."""
    package = module if GRAPH[module].path.name == "__init__.py" else module.rsplit(".", 1)[0]
    return owner == module or (package != "fastlock" and owner.startswith(package + "."))


@pytest.mark.parametrize("module", _params("private"))
def test_no_private_names_of_other_modules(module):
    wrong = sorted({
        name for name in GRAPH[module].private
        if not any(name.startswith(ok + ".") for ok in PRIVATE_OK)
        and not _shares_privates(module, _owner(name.rsplit(".", 1)[0]))
    })
    wrong += [m for m in GRAPH[module].foreign_members if m not in FOREIGN_BASE_MEMBERS.get(module, ())]
    assert not wrong, f"{module} reads private names of other modules: {', '.join(wrong)}"


# -- sizes: a report, not a rule ------------------------------------------------------------------


def test_size_report(capsys):
    """Prints the lines per module and attributes per class (``tests/source_sizes.py``).

    A module is cut where its concepts part, never at a line count: the numbers are printed for
    a reader to look at, and the test fails only if the report misses files it must see."""
    modules = {m.path: m.lines for m in source_sizes.module_sizes()}
    assert {f"fastlock/{p.relative_to(PACKAGE)}" for p in PACKAGE.rglob("*.py")} <= set(modules)
    assert "fastlock/_core.pyx" in modules and all(n > 0 for n in modules.values())
    classes = source_sizes.class_sizes()
    assert any(c.name == "LockServer" and c.attributes > 0 for c in classes)
    with capsys.disabled():  # on the terminal whatever pytest's capture
        print("\n" + source_sizes.report())


def test_the_checker_sees_imports_cycles_and_private_names(tmp_path):
    """The rules above cannot pass by seeing nothing: the graph holds edges known to exist."""
    assert "fastlock.errors" in GRAPH["fastlock.units"].imports
    assert "fastlock.protocol.framing" in GRAPH["fastlock.protocol.rpc"].imports
    assert "fastlock.cli.args" in GRAPH["fastlock.cli.run"].imports
    path = tmp_path / "a.py"
    path.write_text("import os\n\n"
                    "def f(client):\n"
                    "    from .b import _x\n"
                    "    import fastlock.c as c\n"
                    "    os._exit, client._own\n"
                    "    return c._y, client._renewers\n\n"
                    "class A:\n"
                    "    def __init__(self):\n"
                    "        self._own = 1\n")
    fake = _Module("fastlock.a", path)
    assert fake.imports == {"fastlock.b", "fastlock.c"}
    assert sorted(fake.private) == ["fastlock.b._x", "fastlock.c._y"]
    assert fake.foreign_members == ["client._renewers"]


# -- linters ---------------------------------------------------------------------------------------


def _tool(name: str) -> str:
    found = shutil.which(name, path=os.path.dirname(sys.executable)) or shutil.which(name)
    if found is None:
        pytest.skip(f"{name} is not installed (pip install '.[test]')")
    return found


def _run(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=300)


def _pending_paths(stems: list[str]) -> list[str]:
    """The files and packages that the stems in ``stems`` name today."""
    found = []
    for stem in stems:
        found += [p for p in (f"{stem}.py", f"{stem}.pyi", stem) if (ROOT / p).exists()]
    return found


def test_ruff():
    exclude = [f"--extend-exclude={p}" for p in _pending_paths(LINT_PENDING)]
    out = _run(_tool("ruff"), "check", "--no-cache", *exclude, "fastlock", "tests", "benches")
    assert out.returncode == 0, f"ruff check failed:\n{out.stdout}{out.stderr}"


@pytest.mark.skipif(not LINT_PENDING, reason="no file is pending")
@pytest.mark.xfail(strict=False, reason=_REASON)
def test_ruff_pending():
    out = _run(_tool("ruff"), "check", "--no-cache", *_pending_paths(LINT_PENDING))
    assert out.returncode == 0, f"ruff check failed:\n{out.stdout}{out.stderr}"


@functools.cache
def _mypy_errors() -> tuple[list[str], str]:
    out = _run(sys.executable, "-m", "mypy", "--no-incremental", "--config-file", "pyproject.toml")
    if "No module named mypy" in out.stderr:
        pytest.skip("mypy is not installed (pip install '.[test]')")
    errors = [line for line in out.stdout.splitlines() if ": error:" in line]
    if out.returncode != 0 and not errors:  # mypy itself failed
        pytest.fail(f"mypy did not run:\n{out.stdout}{out.stderr}")
    return errors, out.stdout


def test_mypy():
    errors, _ = _mypy_errors()
    ours = [e for e in errors if not any(e.startswith((f"{p}.py", f"{p}/")) for p in TYPES_PENDING)]
    assert not ours, "mypy found:\n" + "\n".join(ours)


@pytest.mark.skipif(not TYPES_PENDING, reason="no file is pending")
@pytest.mark.xfail(strict=False, reason=_REASON)
def test_mypy_pending():
    errors, _ = _mypy_errors()
    assert not errors, "mypy found:\n" + "\n".join(errors)
