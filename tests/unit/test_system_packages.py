"""The system-packages step: without root it installs nothing and names, in one line, exactly the packages to install."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from system_tools import system_packages

SCRIPT = Path(__file__).resolve().parents[2] / "deploy" / "system_packages.py"


AS_NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]


@pytest.fixture
def bare_directory():
    """A directory uid 65534 can read (the checkout and pytest's temp dirs may be root's alone)."""
    directory = Path(tempfile.mkdtemp(prefix="kvstore-packages-"))
    directory.chmod(0o755)
    yield directory
    shutil.rmtree(directory)


@pytest.mark.skipif(os.geteuid() != 0, reason="runs the step as another uid, which needs root")
def test_without_root_one_line_names_what_to_install(bare_directory):
    if subprocess.run([*AS_NOBODY, sys.executable, "-c", ""], capture_output=True).returncode != 0:
        pytest.skip(f"uid 65534 cannot run {sys.executable} here")
    script = bare_directory / "system_packages.py"
    shutil.copy(SCRIPT, script)
    script.chmod(0o644)
    bare = bare_directory / "bin"     # a PATH holding nothing but the interpreter: every program is missing
    bare.mkdir()
    (bare / "python3").symlink_to(sys.executable)
    result = subprocess.run([shutil.which("setpriv"), *AS_NOBODY[1:], str(bare / "python3"), str(script), "test"],
                            capture_output=True, text=True, timeout=60,
                            env={"PATH": str(bare), "HOME": str(bare_directory)})
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
