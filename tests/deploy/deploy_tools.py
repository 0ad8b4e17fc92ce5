"""Finding the external checkers deploy tests run (systemd-analyze, docker-compose)."""

import os
import shutil

import pytest


def require_tool(name: str, apt_package: str) -> str:
    """The tool's path; in CI a missing tool fails (.ci/run installs it), elsewhere it skips."""
    path = shutil.which(name)
    if path:
        return path
    message = f"{name} is not installed (apt-get install {apt_package}; .ci/run does)"
    if os.environ.get("CI"):
        pytest.fail(message)
    pytest.skip(message)
