"""``fastlock serve``'s configuration from four sources: flag > environment > file > default.

Every ``serve`` flag ``--some-flag`` is also

* the environment variable ``FASTLOCK_SOME_FLAG`` (``FASTLOCK_DATA_DIR=/var/lib/fastlock``;
  a switch such as ``--repair-wal`` takes ``1``/``true``/``yes``/``on`` or ``0``/``false``/``no``/``off``);
* the key ``some-flag`` (or ``some_flag``) of a TOML file named by ``--config FILE`` or
  ``$FASTLOCK_CONFIG`` (read with the stdlib ``tomllib``; a switch is a TOML boolean, a
  number a TOML integer or float, everything else a string)::

      listen = "0.0.0.0:7420"
      data-dir = "/var/lib/fastlock"
      fsync = "always"
      credentials = "/etc/fastlock/credentials.toml"
      max-leases = 100000

A flag on the command line wins over the variable, which wins over the file, which wins
over the built-in default.  Every value goes through the flag's own type and choices, so a
file or a variable accepts exactly what the flag accepts; a wrong one is a usage error
naming where it came from (exit 2).  An unknown key in the file is an error too (a typo
must not leave a setting at its default unnoticed).  ``fastlock serve --print-config``
prints the resulting settings, each with its source, as TOML, and exits.

Note that the client commands read ``FASTLOCK_TLS_CA``/``_CERT``/``_KEY`` as *their* TLS
files; ``serve`` reads the same names as the server's (a shell that runs both should set
them for one only).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from ..logsafe import display
from .args import COMMAND_NAMES, asks_json, print_error

__all__ = ["CONFIG_VARIABLE", "NOT_CONFIGURABLE", "RecordingParser", "layer_defaults", "render", "toml_string"]

#: the environment variable naming the config file when ``--config`` is not given
CONFIG_VARIABLE = "FASTLOCK_CONFIG"
#: the ``serve`` options that only the command line sets
NOT_CONFIGURABLE = frozenset({"help", "config", "print_config"})

#: a usage error shows the usage only up to this many lines; a longer one gets a pointer to --help
MAX_USAGE_LINES = 8

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


class RecordingParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` that keeps every option added to it or to its groups, in
    :attr:`options` (argparse has no public list of them).  It takes no abbreviated
    option (``allow_abbrev=False``): ``--conf`` is refused, not read as ``--config``
    (which the config layers would not see).  A usage error is argparse's text with exit
    status 2 (a one-line usage pointing to ``--help`` instead of a usage longer than
    :data:`MAX_USAGE_LINES` lines), or, when the command line asks for ``-o json``,
    one JSON object on stderr, ``{"command": ..., "error": "usage", "message": ...}`` (as a runtime error under
    ``-o json``: :func:`~fastlock.cli.args.print_error`), still with exit status 2."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.options: list[argparse.Action] = []
        self.argv: list[str] = []  # the arguments of the last parse (for error())
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        self.argv = list(sys.argv[1:] if args is None else args)
        return super().parse_known_args(args, namespace)

    def error(self, message: str) -> Any:
        if not asks_json(self.argv):
            if self.format_usage().count("\n") <= MAX_USAGE_LINES:
                return super().error(message)
            # a long usage (serve's is 40-odd lines) would bury the one line that says what is wrong
            self.exit(2, f"usage: {self.prog} [OPTION ...] (`{self.prog} --help` lists every option)\n"
                         f"{self.prog}: error: {message}\n")
        command = " ".join(self.prog.split()[1:])  # "fastlock wal dump": "wal dump"
        if not command:  # the top parser: the command is its first argument
            first = self.argv[0]
            command = "fastlock" if first.startswith("-") else COMMAND_NAMES.get(first, first)
        print_error(argparse.Namespace(output="json"), command, message, "usage")
        self.exit(2)

    def add_argument(self, *args: Any, **kwargs: Any) -> argparse.Action:
        action = super().add_argument(*args, **kwargs)
        self.options.append(action)
        return action

    def add_argument_group(self, *args: Any, **kwargs: Any) -> Any:
        group = super().add_argument_group(*args, **kwargs)
        add = group.add_argument

        def recorded(*a: Any, **k: Any) -> argparse.Action:
            action = add(*a, **k)
            self.options.append(action)
            return action

        group.add_argument = recorded  # type: ignore[method-assign]
        return group


def _options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """dest -> action of every configurable option of ``parser`` (a :class:`RecordingParser`)."""
    return {a.dest: a for a in getattr(parser, "options", ())
            if a.option_strings and a.dest not in NOT_CONFIGURABLE}


def _flag(action: argparse.Action) -> str:
    return max(action.option_strings, key=len)


def _env_name(action: argparse.Action) -> str:
    return "FASTLOCK_" + _flag(action).lstrip("-").replace("-", "_").upper()


def _convert(parser: argparse.ArgumentParser, action: argparse.Action, raw: Any, where: str) -> Any:
    """``raw`` (a file's TOML value or a variable's text) through ``action``'s type and choices."""
    if action.nargs == 0:  # a switch (store_true)
        if isinstance(raw, bool):
            return raw
        text = str(raw).strip().lower()
        if text in _TRUE:
            return True
        if text in _FALSE:
            return False
        parser.error(f"{where}: {_flag(action)} is a switch: true or false, not {raw!r}")
    if isinstance(raw, bool) or isinstance(raw, (dict, list)):
        parser.error(f"{where}: {_flag(action)} takes one value, not {raw!r}")
    text = str(raw)
    try:
        value = action.type(text) if callable(action.type) else text
    except (argparse.ArgumentTypeError, ValueError, TypeError) as exc:
        parser.error(f"{where}: {_flag(action)}: {exc}")
    if action.choices is not None and value not in action.choices:
        parser.error(f"{where}: {_flag(action)} must be one of {', '.join(map(str, action.choices))}, not {raw!r}")
    return value


def _config_path(argv: Sequence[str], env: Mapping[str, str]) -> str | None:
    for i, arg in enumerate(argv):
        if arg == "--config" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--config="):
            return arg.partition("=")[2]
    return env.get(CONFIG_VARIABLE) or None


def _read_file(parser: argparse.ArgumentParser, path: str) -> dict[str, Any]:
    import tomllib

    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except OSError as exc:
        parser.error(f"config file {path}: {exc.strerror or exc}")
    except tomllib.TOMLDecodeError as exc:
        parser.error(f"config file {path}: not valid TOML: {exc}")
    raise AssertionError  # pragma: no cover - parser.error exits


def layer_defaults(parser: argparse.ArgumentParser, argv: Sequence[str],
                   env: Mapping[str, str] | None = None) -> dict[str, str]:
    """Make the config file's and the environment's values ``parser``'s defaults (the
    command line, parsed afterwards, overrides them); return ``dest -> source`` for
    every option (``"flag"`` is filled in by :func:`render` from the parsed arguments).

    Exits 2 (``parser.error``) for an unreadable file, an unknown key or a bad value.
    """
    env = os.environ if env is None else env
    options = _options(parser)
    sources = {dest: "default" for dest in options}
    values: dict[str, Any] = {}
    path = _config_path(argv, env)
    if path is not None:
        by_key = {dest.replace("_", "-"): dest for dest in options}
        spelled: dict[str, str] = {}  # dest -> the key that set it
        for key, raw in _read_file(parser, path).items():
            dest = by_key.get(str(key).replace("_", "-"))
            if dest is None:
                parser.error(f"config file {path}: unknown setting {key!r} (settings are the flags of "
                             f"`fastlock serve`, without the dashes)")
            if dest in spelled:
                parser.error(f"config file {path}: {spelled[dest]!r} and {key!r} are the same setting; "
                             f"keep one")
            spelled[dest] = str(key)
            values[dest] = _convert(parser, options[dest], raw, f"config file {path}")
            sources[dest] = f"file {path}"
    for dest, action in options.items():
        var = _env_name(action)
        if var in env:
            values[dest] = _convert(parser, action, env[var], f"${var}")
            sources[dest] = f"env {var}"
    parser.set_defaults(**values)
    return sources


def _given(parser: argparse.ArgumentParser, argv: Sequence[str]) -> set[str]:
    """The dests whose flag is on the command line ``argv``."""
    given = set()
    for dest, action in _options(parser).items():
        for arg in argv:
            if any(arg == o or arg.startswith(o + "=") for o in action.option_strings):
                given.add(dest)
    return given


#: TOML's short escapes (every other control character is written as \\uXXXX)
_TOML_ESCAPES = {"\\": "\\\\", '"': '\\"', "\b": "\\b", "\t": "\\t", "\n": "\\n", "\f": "\\f", "\r": "\\r"}


def toml_string(text: str) -> str:
    """``text`` as a TOML basic string: quoted, with a backslash, a double quote and every
    control character (U+0000..U+001F and U+007F, which TOML forbids raw) escaped."""
    out = []
    for c in text:
        if c in _TOML_ESCAPES:
            out.append(_TOML_ESCAPES[c])
        elif c < " " or c == "\x7f":
            out.append(f"\\u{ord(c):04X}")
        else:
            out.append(c)
    return '"' + "".join(out) + '"'


def _toml(value: Any) -> str:
    """``value`` as the TOML value its flag reads back: a switch a boolean, a number a
    number, an address ``(host, port)`` ``"HOST:PORT"`` (``"[IPv6]:PORT"``), a tuple of
    strings (``--reachable-as``) its items comma-separated, anything else a string."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, tuple) and len(value) == 2 and isinstance(value[1], int):  # an address
        host, port = value
        value = f"[{host}]:{port}" if ":" in str(host) else f"{host}:{port}"
    elif isinstance(value, tuple):
        value = ",".join(map(str, value))
    return toml_string(str(value))


def render(parser: argparse.ArgumentParser, args: argparse.Namespace, argv: Sequence[str],
           sources: Mapping[str, str]) -> str:
    """The settings ``args`` holds, as TOML lines ``key = value  # source`` (unset ones commented out)."""
    given = _given(parser, argv)
    lines = []
    for dest, action in sorted(_options(parser).items()):
        key = _flag(action).lstrip("-")
        source = display("flag" if dest in given else sources.get(dest, "default"))  # a file's path: one line
        value = getattr(args, dest, None)
        if value is None or value == ():  # an empty tuple: no item given (no flag value spells it)
            lines.append(f"# {key} =  (not set; {source})")
        else:
            lines.append(f"{key} = {_toml(value)}  # {source}")
    return "\n".join(lines)
