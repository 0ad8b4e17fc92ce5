"""The system packages that building and testing kvstore need: installed when root, named when not.

    python3 deploy/system_packages.py build   # a virtualenv and kvstore_native: venv, a C compiler, Python's headers
    python3 deploy/system_packages.py test    # that, and the programs the tests run (etcd, systemd-analyze, ...)

`make run` and `make test` call it first. Each need is a check and the Debian package that meets
it. Run as root where apt-get exists, the missing packages are installed (after one `apt-get
update`). Otherwise, or when apt-get fails, it prints one line naming exactly what to install and
exits 0: the native build then falls back loudly (the node says so in its log) and each test that
needs a missing program skips with that package in its reason (tests/system_tools.py), or fails
under CI=true, where this step must have installed it. Standard library only: it runs before any
virtual environment exists.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig

# Programs the tests run, each with the Debian package that ships it.
TEST_PROGRAMS = {
    "etcd": "etcd-server",                 # tests/cluster: a real etcd
    "systemd-analyze": "systemd",          # tests/deploy: `systemd-analyze verify` of the shipped unit
    "docker-compose": "docker-compose",    # tests/deploy: `docker-compose config` validates the compose file offline
    "setpriv": "util-linux",               # start-up errors as a user without CAP_DAC_OVERRIDE
    "ip": "iproute2",                      # network namespaces: remote clients, partitions
}


def python_headers() -> bool:
    return os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h"))


def python_venv() -> bool:
    """`python3 -m venv` works: Debian ships ensurepip, which venv needs, apart from python3."""
    return importlib.util.find_spec("ensurepip") is not None


def debian_package(template: str) -> str:
    """Debian's package of this interpreter's part (template: "libpython{}-dev"); "" for a Python apt did not install."""
    if not os.path.realpath(sys.executable).startswith("/usr/bin/"):
        return ""
    return template.format(f"{sys.version_info.major}.{sys.version_info.minor}")


def missing(scope: str) -> tuple[list[str], list[str]]:
    """(Debian packages to install, needs no package can meet) for `scope`: build or test."""
    packages, others = [], []
    if shutil.which("gcc") is None and shutil.which("cc") is None:
        packages.append("gcc")
    for present, template, what in ((python_venv, "python{}-venv", "the venv module"),
                                    (python_headers, "libpython{}-dev", "Python.h")):
        if present():
            continue
        if debian_package(template):
            packages.append(debian_package(template))
        else:
            others.append(f"{what} for {sys.executable} (reinstall that Python with it)")
    if scope == "test":
        packages += [package for program, package in TEST_PROGRAMS.items() if shutil.which(program) is None]
    return packages, others


def install(packages: list[str]) -> str:
    """"" once apt-get installed `packages`; why not otherwise."""
    if os.geteuid() != 0:
        return "not root"
    if shutil.which("apt-get") is None:
        return "no apt-get on this host"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for command in (["apt-get", "update", "-qq"],
                    ["apt-get", "install", "-y", "-qq", "--no-install-recommends", *packages]):
        done = subprocess.run(command, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            return f"`{' '.join(command[:2])}` failed: {(done.stderr or done.stdout).strip().splitlines()[-1:]}"
    return ""


def main(argv: list[str]) -> int:
    scope = argv[0] if argv else "test"
    if scope not in ("build", "test"):
        print(f"usage: {sys.argv[0]} build|test", file=sys.stderr)
        return 2
    packages, others = missing(scope)
    if packages:
        print(f"system packages: installing {' '.join(packages)}", flush=True)
        why = install(packages)
        if not why:
            packages, _ = missing(scope)
            why = "installed, yet still missing"
        if packages:
            print(f"system packages: {why}; install them with `sudo apt-get install {' '.join(packages)}`: "
                  f"until then the native build falls back and the tests that need them skip", file=sys.stderr)
    for need in others:
        print(f"system packages: missing {need}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
