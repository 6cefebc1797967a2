"""Install what the peer comparison needs, only what is missing.

Debian packages (``apt-get install -y``, after one ``apt-get update``): redis-server,
etcd-server (+ etcd-client for etcdctl), zookeeper (needs a Java runtime),
postgresql.  Python packages (pip, into the running interpreter): redis (+ hiredis),
kazoo, asyncpg, aiohttp (etcd's JSON gateway), psutil, matplotlib.

Servers are never started as system services here: the Debian packages only
supply the binaries, and each peer module starts its own server on 127.0.0.1
with a throwaway data dir.
"""

from __future__ import annotations

import glob
import importlib.util
import os
import shutil
import subprocess
import sys

PIP_PACKAGES = {            # import name -> pip requirement
    "redis": "redis>=5",
    "hiredis": "hiredis",
    "kazoo": "kazoo>=2.9",
    "asyncpg": "asyncpg>=0.29",
    "aiohttp": "aiohttp>=3.9",
    "psutil": "psutil>=5.9",
    "matplotlib": "matplotlib>=3.7",
}


def postgres_bindir() -> str | None:
    """Newest /usr/lib/postgresql/<ver>/bin that has ``postgres`` and ``initdb``."""
    found = []
    for d in glob.glob("/usr/lib/postgresql/*/bin"):
        if os.path.exists(os.path.join(d, "postgres")) and os.path.exists(os.path.join(d, "initdb")):
            try:
                found.append((int(d.split("/")[-2].split(".")[0]), d))
            except ValueError:
                pass
    return max(found)[1] if found else None


ZOOKEEPER_JAR = "/usr/share/java/zookeeper.jar"


def _java() -> str | None:
    return shutil.which("java")


APT_CHECKS = {              # system name -> (is it there?, Debian packages)
    "redis": (lambda: shutil.which("redis-server") is not None, ["redis-server"]),
    "etcd": (lambda: shutil.which("etcd") is not None, ["etcd-server", "etcd-client"]),
    "zookeeper": (lambda: os.path.exists(ZOOKEEPER_JAR) and _java() is not None, ["zookeeper"]),
    "postgres": (lambda: postgres_bindir() is not None, ["postgresql"]),
}


def missing_apt(systems: list[str]) -> list[str]:
    pkgs: list[str] = []
    for s in systems:
        check, names = APT_CHECKS[s]
        if not check():
            pkgs += names
    return pkgs


def ensure(systems: list[str], *, log=print, allow_install: bool = True) -> dict[str, str]:
    """Install what ``systems`` need; return {system: reason} for those still unusable."""
    problems: dict[str, str] = {}
    pkgs = missing_apt([s for s in systems if s in APT_CHECKS])
    if pkgs:
        if not allow_install:
            problems.update({s: "not installed" for s in systems if s in APT_CHECKS and not APT_CHECKS[s][0]()})
        elif os.geteuid() != 0 or not shutil.which("apt-get"):
            log(f"missing Debian packages {pkgs}: run `sudo apt-get install -y {' '.join(pkgs)}`")
        else:
            env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
            log(f"apt-get update && apt-get install -y {' '.join(pkgs)}")
            subprocess.run(["apt-get", "update", "-q"], env=env, check=False,
                           stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, timeout=600)
            r = subprocess.run(["apt-get", "install", "-y", "-q", "--no-install-recommends", *pkgs], env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=1200)
            if r.returncode != 0:
                log(r.stdout.decode(errors="replace")[-2000:])
    for s in systems:
        if s in APT_CHECKS and not APT_CHECKS[s][0]():
            problems[s] = f"server binary missing (Debian packages {APT_CHECKS[s][1]})"
    need = [req for mod, req in PIP_PACKAGES.items() if importlib.util.find_spec(mod) is None]
    if need:
        if allow_install:
            log(f"pip install {' '.join(need)}")
            subprocess.run([sys.executable, "-m", "pip", "install", "-q", *need], check=False, timeout=1200)
            importlib.invalidate_caches()
        for mod, req in PIP_PACKAGES.items():
            if importlib.util.find_spec(mod) is None and mod != "hiredis":
                problems.setdefault({"redis": "redis", "kazoo": "zookeeper", "asyncpg": "postgres",
                                     "aiohttp": "etcd"}.get(mod, "all"), f"python package {req} missing")
    return problems
