"""Shared fixtures: real kvstore-server processes on port 0 with their socket in a temp dir."""

from __future__ import annotations

import os
import secrets
from pathlib import Path
from typing import Iterator

import pytest

from server_process import ServerProcess

# Every server a test starts binds its metrics on a free port (the default is a fixed one).
os.environ.setdefault("KVSTORE_OPS_METRICS_ADDRESS", "127.0.0.1:0")


@pytest.fixture
def start_server(tmp_path: Path) -> Iterator:
    """Factory: start_server(**{"dram.arena_bytes": "32MiB"}) -> ServerProcess."""
    started: list[ServerProcess] = []

    def start(settings: dict[str, object] | None = None, env: dict[str, str] | None = None) -> ServerProcess:
        workdir = tmp_path / f"server{len(started)}"
        workdir.mkdir()
        server = ServerProcess(workdir, settings or {}, env)
        started.append(server)
        return server

    yield start
    for server in started:
        server.kill()


@pytest.fixture
def server(start_server) -> "ServerProcess":
    return start_server()


@pytest.fixture
def private_server(start_server, tmp_path) -> "ServerProcess":
    """A node only this test's clients can call, for tests that count the calls it serves. Every caller shows a
    token, on the local socket too, and the test hands `server.token` to its own clients (token=): a client of
    an earlier test that finds this node at a port the kernel gave out again is refused before a call is
    counted. Not through KVSTORE_TOKEN: every client in this process reads that when it connects, one an
    earlier test left running included."""
    from identities import token_line

    token = secrets.token_urlsafe(24)
    tokens = tmp_path / "private-tokens"
    tokens.write_text(token_line(token, "tests", "admin"))
    server = start_server({"auth.tokens_file": str(tokens), "auth.local_uids": f"{os.getuid()}:tests:admin",
                           "auth.local_require_token": "true"})
    server.token = token
    return server


@pytest.fixture
def client(server):
    from kvstore_client import KVStoreClient

    with KVStoreClient(server.address, timeout_s=10) as c:
        yield c


def cuda_missing() -> str:
    """Why tests marked `gpu` cannot run here, or "" when they can."""
    try:
        import cupy
    except ImportError:
        return "cupy is not installed (GPU tests need cupy and a CUDA device)"
    try:
        if cupy.cuda.runtime.getDeviceCount() == 0:
            return "no CUDA device is visible"
    except cupy.cuda.runtime.CUDARuntimeError as exc:
        return f"no usable CUDA device: {exc}"
    return ""


def pytest_collection_modifyitems(config, items):
    """GPU tests run where cupy sees a CUDA device; elsewhere each is skipped with the reason."""
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    reason = cuda_missing() if gpu_items else ""
    for item in gpu_items:
        if reason:
            item.add_marker(pytest.mark.skip(reason=reason))
