"""Shared fixtures: real kvstore-server processes on port 0 with their socket in a temp dir."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Every server a test starts binds its metrics on a free port (the default is a fixed one).
os.environ.setdefault("KVSTORE_OPS_METRICS_ADDRESS", "127.0.0.1:0")


class ServerProcess:
    """A kvstore-server child process; `address` is its gRPC target once it is serving."""

    def __init__(self, workdir: Path, settings: dict[str, object], env: dict[str, str] | None = None):
        self.workdir = workdir
        self.ready_file = workdir / "ready.json"
        self.socket_path = str(settings.get("shm.socket_path", workdir / "kvstore.sock"))
        self.log_path = workdir / "server.log"
        args = [sys.executable, "-m", "kvstore.server", "--grpc-address", "127.0.0.1:0",
                "--shm-socket", self.socket_path, "--ready-file", str(self.ready_file)]
        defaults = {"dram.arena_bytes": "64MiB", "dram.slab_bytes": "4MiB", "nvme.enabled": "false"}
        for key, value in {**defaults, **settings}.items():
            args += ["--set", f"{key}={value}"]
        self._log = open(self.log_path, "ab")
        self.process = subprocess.Popen(args, stdout=self._log, stderr=subprocess.STDOUT,
                                        env={**os.environ, **(env or {})})
        self.address = self._wait_ready()

    def _wait_ready(self, timeout_s: float = 30.0) -> str:
        deadline = time.monotonic() + timeout_s
        while not self.ready_file.exists():
            if self.process.poll() is not None:
                raise RuntimeError(f"kvstore-server exited with {self.process.returncode}:\n{self.log()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"kvstore-server not ready after {timeout_s}s:\n{self.log()}")
            time.sleep(0.02)
        return json.loads(self.ready_file.read_text())["grpc_address"]

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def terminate(self, timeout_s: float = 30.0) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout_s)

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)
        self._log.close()


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
