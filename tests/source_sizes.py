"""A report of the source tree's sizes: lines per module and instance attributes per class.

The numbers are a guide to where a reader may get lost, never a rule: a module is cut where
its concepts part, not at a line count.  ``tests/test_sourcecode.py`` prints the report at the
end of its run (``test_size_report``); to print it alone::

    python tests/source_sizes.py            # the 15 largest of each
    python tests/source_sizes.py --all      # every module and class
"""

from __future__ import annotations

import argparse
import ast
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "fastlock"

#: a module or class above these numbers is marked in the report (a prompt to look, not a failure)
LINES_TO_LOOK_AT = 600
ATTRIBUTES_TO_LOOK_AT = 20


class ModuleSize(NamedTuple):
    """One source file: its path under the repository and its number of lines."""

    path: str
    lines: int


class ClassSize(NamedTuple):
    """One Python class: where it is, its name and how many ``self.x`` attributes it assigns."""

    path: str
    name: str
    attributes: int


def instance_attributes(cls: ast.ClassDef) -> set[str]:
    """The names ``self.<name>`` that the methods of ``cls`` assign (``=``, ``+=``, annotated)."""
    names: set[str] = set()
    for node in ast.walk(cls):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
            targets = [node.target]
        for t in targets:
            for e in ast.walk(t):
                if isinstance(e, ast.Attribute) and isinstance(e.value, ast.Name) and e.value.id == "self":
                    names.add(e.attr)
    return names


def module_sizes(package: Path = PACKAGE) -> list[ModuleSize]:
    """Every ``.py``, ``.pyx`` and ``.pxi`` file under ``package``, largest first."""
    found = [ModuleSize(str(p.relative_to(package.parent)), p.read_text(encoding="utf-8").count("\n"))
             for ext in ("py", "pyx", "pxi") for p in package.rglob(f"*.{ext}")]
    return sorted(found, key=lambda m: (-m.lines, m.path))


def class_sizes(package: Path = PACKAGE) -> list[ClassSize]:
    """Every class of every ``.py`` file under ``package``, most attributes first."""
    found = []
    for p in package.rglob("*.py"):
        tree = ast.parse(p.read_text(encoding="utf-8"), str(p))
        found += [ClassSize(str(p.relative_to(package.parent)), node.name, len(instance_attributes(node)))
                  for node in ast.walk(tree) if isinstance(node, ast.ClassDef)]
    return sorted(found, key=lambda c: (-c.attributes, c.path, c.name))


def report(top: int | None = 15) -> str:
    """The report as text: the ``top`` largest modules and classes (None: all of them)."""
    modules = module_sizes()
    classes = class_sizes()
    lines = [f"source sizes: {len(modules)} files, {sum(m.lines for m in modules):,} lines; "
             f"'*' marks more than {LINES_TO_LOOK_AT} lines or {ATTRIBUTES_TO_LOOK_AT} attributes"]
    lines += [f"  {'*' if m.lines > LINES_TO_LOOK_AT else ' '} {m.lines:6,}  {m.path}" for m in modules[:top]]
    lines.append(f"classes by instance attributes ({len(classes)} classes):")
    lines += [f"  {'*' if c.attributes > ATTRIBUTES_TO_LOOK_AT else ' '} {c.attributes:6}  {c.path}  {c.name}"
              for c in classes[:top]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Print the lines per module and attributes per class.")
    parser.add_argument("--all", action="store_true", help="every module and class, not the 15 largest")
    args = parser.parse_args(argv)
    print(report(None if args.all else 15))


if __name__ == "__main__":
    main()
