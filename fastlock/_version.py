"""The package's version, read from the installed distribution's metadata
(single-sourced from ``pyproject.toml``).  A leaf: the server, the CLI and the
package root import it without importing each other."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__: str = version("fastlock")
except PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0+unknown"

__all__ = ["__version__"]
