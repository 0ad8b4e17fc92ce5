"""The system-packages step: without root it installs nothing and names, in one line, exactly the packages to install."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from system_tools import system_packages

SCRIPT = Path(__file__).resolve().parents[2] / "deploy" / "system_packages.py"


@pytest.mark.skipif(os.geteuid() != 0, reason="runs the step as another uid, which needs root")
def test_without_root_one_line_names_what_to_install(tmp_path):
    bare = tmp_path / "bin"     # a PATH holding nothing but the interpreter: every program is missing
    bare.mkdir()
    (bare / "python3").symlink_to(sys.executable)
    result = subprocess.run([shutil.which("setpriv"), "--reuid=65534", "--regid=65534", "--clear-groups", str(bare / "python3"),
                             str(SCRIPT), "test"], capture_output=True, text=True, timeout=60,
                            env={"PATH": str(bare), "HOME": str(tmp_path)})
    assert result.returncode == 0, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "not root" in lines[0], result.stderr
    wanted = ["gcc", *system_packages.TEST_PROGRAMS.values()]
    assert f"sudo apt-get install {' '.join(wanted)}" in lines[0]


def test_nothing_to_do_says_nothing():
    result = subprocess.run([sys.executable, str(SCRIPT), "build"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0
    if not system_packages.missing("build")[0]:
        assert result.stdout == result.stderr == ""


def test_an_unknown_scope_is_refused():
    result = subprocess.run([sys.executable, str(SCRIPT), "everything"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "build|test" in result.stderr
