"""Programs the tests run that come from system packages (etcd, systemd-analyze, docker-compose, ...).

`make test` installs them first (deploy/system_packages.py) when it runs as root. A missing one
skips the test with the package to install, except under CI=true, where it fails: CI runs as
root, so a missing program there is a broken install step, not a reason to skip.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location(
    "system_packages", Path(__file__).resolve().parent.parent / "deploy" / "system_packages.py")
system_packages = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(system_packages)


def require_tool(name: str) -> str:
    """The program's path, or a skip (a failure under CI) naming the package that ships it."""
    path = shutil.which(name)
    if path:
        return path
    message = (f"{name} is not installed: apt-get install {system_packages.TEST_PROGRAMS[name]} "
               "(make test does when run as root)")
    if os.environ.get("CI"):
        pytest.fail(message)
    pytest.skip(message)
