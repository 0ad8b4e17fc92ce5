"""A node says once, in its start-up log, whether its page index, hashing and copies run in C, and CI builds the C core."""

from __future__ import annotations

import os

import pytest

from kvstore_client import native

TURNED_OFF = "turned off for this run" in native.missing_reason   # make test's pure-Python pass


def test_the_node_says_which_core_it_runs(start_server):
    server = start_server()
    lines = [line for line in server.log().splitlines() if "native core" in line]
    assert len(lines) == 1, server.log()
    if native.available():
        assert "INFO" in lines[0] and "index=c hashing=c copies=c" in lines[0]
    else:
        assert "WARNING" in lines[0] and "index=python hashing=python copies=python" in lines[0]
        assert native.missing_reason in lines[0] and "pip install ./native" in lines[0]


def test_the_python_index_when_asked_for(start_server):
    server = start_server({"server.native_index": "false"})
    assert "native core index=python" in server.log()


@pytest.mark.skipif(not os.environ.get("CI") or TURNED_OFF, reason="only CI must have the C core built")
def test_ci_builds_the_native_core():
    assert native.available(), native.missing_reason
