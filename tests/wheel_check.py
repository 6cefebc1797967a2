"""Install a built wheel into a fresh virtual environment without Cython or the source tree,
and check that it works: every extension module setup.py declares loads compiled, the version
is the one pyproject.toml gives, the ``fastlock`` command runs a server and a client takes a
lock from it.

    python tests/wheel_check.py DIST_DIR      (``make wheel-check`` builds DIST_DIR first)

Exits 0 with one line per check, or 1 with the failing step's output.
"""

from __future__ import annotations

import glob
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parent.parent

SMOKE = r'''
import importlib, importlib.util, json, sys, tempfile
import fastlock, fastlock._core
from fastlock._testbase import ServerProcess
from fastlock.sync import SyncClient

assert importlib.util.find_spec("Cython") is None, "Cython is installed in the fresh environment"
# every extension module setup.py builds (argv[2:]) is in the wheel, compiled
for name in sys.argv[2:]:
    compiled = importlib.import_module(name)
    assert compiled.__file__.endswith(".so"), compiled.__file__
assert fastlock.__version__ == sys.argv[1], (fastlock.__version__, sys.argv[1])
with tempfile.TemporaryDirectory() as tmp:
    with ServerProcess(tmp + "/data") as srv, SyncClient(srv.address, client_name="wheel-check") as client:
        with client.lock("wheel-check", ttl=5) as lease:
            assert client.holder("wheel-check")["token"] == lease.fencing_token
        print(json.dumps({"version": fastlock.__version__, "token": lease.fencing_token}))
'''


def extension_modules() -> list[str]:
    """The dotted names of the extension modules setup.py declares (``Extension("name", ...)``)."""
    names = re.findall(r'Extension\(\s*"([\w.]+)"', (ROOT / "setup.py").read_text())
    if not names:
        raise SystemExit("wheel check: setup.py declares no Extension")
    return names


def run(argv: list[str], **kwargs) -> str:
    result = subprocess.run(argv, capture_output=True, text=True, timeout=600, **kwargs)
    if result.returncode != 0:
        sys.stderr.write(f"wheel check: {' '.join(argv)} failed ({result.returncode}):\n"
                         f"{result.stdout}{result.stderr}")
        sys.exit(1)
    return result.stdout


def main(dist: str) -> int:
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    wheels = glob.glob(f"{dist}/fastlock-{version}-*.whl")
    sdists = glob.glob(f"{dist}/fastlock-{version}.tar.gz")
    if len(wheels) != 1 or len(sdists) != 1:
        sys.stderr.write(f"wheel check: expected one wheel and one sdist of {version} in {dist}, found "
                         f"{wheels + sdists}\n")
        return 1
    print(f"wheel check: built {Path(sdists[0]).name} and {Path(wheels[0]).name}")
    with tempfile.TemporaryDirectory() as tmp:
        venv = Path(tmp) / "venv"
        run([sys.executable, "-m", "venv", str(venv)])
        py = str(venv / "bin" / "python")
        run([py, "-m", "pip", "install", "-q", str(Path(wheels[0]).resolve())], cwd=tmp)
        print(f"wheel check: installed into a fresh venv: {run([str(venv / 'bin' / 'fastlock'), '--version']).strip()}")
        modules = extension_modules()
        out = run([py, "-c", SMOKE, version, *modules], cwd=tmp)  # cwd: not the source tree
        print(f"wheel check: no Cython, {len(modules)} compiled modules loaded, server started, lock taken: "
              f"{out.strip()}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "dist"))
