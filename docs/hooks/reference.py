"""mkdocs hook: the command-line and configuration reference pages, generated from the
``fastlock`` argument parsers (:func:`fastlock.cli.build_parser`), so that the pages list
exactly the commands and flags the installed ``fastlock`` accepts.

A page holds a marker line where the generated Markdown goes:

- ``<!-- generated: cli -->``: every command and subcommand, its usage line and a table of
  its arguments (flag, value, default, meaning);
- ``<!-- generated: config -->``: every ``fastlock serve`` setting with its environment
  variable and its key in the ``--config`` TOML file (the names follow
  :mod:`fastlock.cli.config`: ``--max-leases`` is ``FASTLOCK_MAX_LEASES`` and
  ``max-leases``).

``python docs/hooks/reference.py cli|config`` prints the Markdown (tests/test_docs_site.py
uses the same functions).
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Iterator

from fastlock.cli import build_parser
from fastlock.cli import run as run_command
from fastlock.cli.config import NOT_CONFIGURABLE

#: subcommands whose subparser takes its arguments verbatim and parses them with a parser of its own
OWN_PARSERS = {"run": run_command.build_parser}

MARKERS = {"<!-- generated: cli -->": "cli", "<!-- generated: config -->": "config"}


def _actions(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    # argparse keeps a parser's arguments only in this attribute: no public accessor exists
    return list(parser._actions)


def _subcommands(parser: argparse.ArgumentParser) -> Iterator[tuple[str, str, argparse.ArgumentParser]]:
    """(name, one-line help, parser) of each subcommand of ``parser``, in the order they were added."""
    for action in _actions(parser):
        if isinstance(action, argparse._SubParsersAction):
            helps = {choice.dest: choice.help or "" for choice in action._choices_actions}
            for name, sub in action.choices.items():
                own = OWN_PARSERS.get(name) if parser.prog == "fastlock" else None
                yield name, helps.get(name, ""), own() if own else sub


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def _help(action: argparse.Action, prog: str) -> str:
    """The action's help with argparse's ``%(default)s``-style fields filled in, as ``--help`` shows it."""
    text = action.help or ""
    if "%" in text:
        fields = {**vars(action), "prog": prog}
        fields = {k: getattr(v, "__name__", v) for k, v in fields.items()}
        text = text % fields
    return text


def _value(action: argparse.Action) -> str:
    if action.nargs == 0:
        return ""
    if action.choices is not None and not isinstance(action, argparse._SubParsersAction):
        return " \\| ".join(f"`{c}`" for c in action.choices)
    metavar = action.metavar or (action.dest.upper() if action.option_strings else action.dest)
    return f"`{metavar if isinstance(metavar, str) else ' '.join(metavar)}`"


def _default(action: argparse.Action) -> str:
    default = action.default
    if action.nargs == 0 or default in (None, argparse.SUPPRESS) or default == []:
        return ""
    if isinstance(default, tuple) and len(default) == 2 and isinstance(default[1], int):
        default = f"{default[0]}:{default[1]}"  # an address
    return f"`{default}`"


def _argument_rows(parser: argparse.ArgumentParser) -> list[str]:
    rows = []
    for action in _actions(parser):
        if isinstance(action, argparse._SubParsersAction) or action.help == argparse.SUPPRESS:
            continue
        name = ", ".join(f"`{s}`" for s in action.option_strings) or f"`{action.dest}`"
        rows.append(f"| {name} | {_value(action)} | {_cell(_default(action))} | {_cell(_help(action, parser.prog))} |")
    return rows


def _command(parser: argparse.ArgumentParser, summary: str, depth: int) -> list[str]:
    out = [f"{'#' * depth} `{parser.prog}`", ""]
    if summary:
        out += [_cell(summary[0].upper() + summary[1:]) + ".", ""]
    usage = parser.format_usage().strip()
    out += ["```text", usage, "```", ""]
    rows = _argument_rows(parser)
    if rows:
        out += ["| argument | value | default | meaning |", "|---|---|---|---|", *rows, ""]
    for _name, text, sub in _subcommands(parser):
        out += _command(sub, text, depth + 1)
    return out


def cli_reference() -> str:
    """Markdown for every ``fastlock`` command: its usage and a table of its arguments."""
    parser = build_parser()
    out = ["Generated from the argument parsers of the installed `fastlock` (`fastlock COMMAND --help`",
           "prints the same).", "", "```text", parser.format_usage().strip(), "```", ""]
    for _name, text, sub in _subcommands(parser):
        out += _command(sub, text, 2)
    return "\n".join(out)


def serve_settings() -> list[argparse.Action]:
    """The configurable options of ``fastlock serve`` (each a flag, a variable and a file key)."""
    serve = next(sub for name, _, sub in _subcommands(build_parser()) if name == "serve")
    return [a for a in _actions(serve) if a.option_strings and a.dest not in NOT_CONFIGURABLE]


def config_reference() -> str:
    """Markdown table of every ``fastlock serve`` setting: flag, variable, TOML key, default, meaning."""
    out = ["| flag | environment variable | config file key | default | meaning |", "|---|---|---|---|---|"]
    for action in serve_settings():
        flag = max(action.option_strings, key=len)
        key = flag.lstrip("-")
        env = "FASTLOCK_" + key.replace("-", "_").upper()
        value = f" {_value(action)}" if action.nargs != 0 else ""
        out.append(f"| `{flag}`{value} | `{env}` | `{key}` | {_cell(_default(action))} "
                   f"| {_cell(_help(action, 'fastlock serve'))} |")
    return "\n".join(out)


GENERATORS = {"cli": cli_reference, "config": config_reference}
#: a Sphinx cross-reference role left in a docstring, as Markdown renders it: ":class:<code>~a.b.C</code>"
SPHINX_ROLE = re.compile(r":(?:mod|class|func|meth|data|attr|exc|obj|const):<code>(~?)([^<]+)</code>")


def on_page_markdown(markdown: str, page, config, files) -> str:
    """Replace each marker line with its generated Markdown."""
    for marker, what in MARKERS.items():
        if marker in markdown:
            markdown = markdown.replace(marker, GENERATORS[what]())
    return markdown


def on_page_content(html: str, page, config, files) -> str:
    """Show a docstring's Sphinx roles as code: ``:class:`~fastlock.Lease``` as ``Lease``."""
    return SPHINX_ROLE.sub(lambda m: f"<code>{m.group(2).rsplit('.', 1)[-1] if m.group(1) else m.group(2)}</code>",
                           html)


if __name__ == "__main__":
    print(GENERATORS[sys.argv[1]]())
