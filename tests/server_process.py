"""A real kvstore-server child process on port 0 (the fixtures of tests/conftest.py start them).

Its own module, not conftest's: `from conftest import ...` names whichever conftest.py was imported
first (tests/unit's, tests/gpu's), so helpers import this by its own name.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from socket_peers import peers


class ServerProcess:
    """A kvstore-server child process; `address` is its gRPC target once it is serving."""

    token = ""   # where the node requires one (conftest's private_server): an admin token, shown by its scrapes

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

    def connected(self) -> list[str]:
        """The processes connected to its gRPC port now, one line each (socket_peers.peers)."""
        return peers(int(self.address.rpartition(":")[2]))

    def metrics_text(self) -> str:
        """Its Prometheus endpoint's page, scraped over HTTP."""
        port = json.loads(self.ready_file.read_text())["metrics_port"]
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        request = urllib.request.Request(f"http://127.0.0.1:{port}/metrics", headers=headers)
        with urllib.request.urlopen(request, timeout=5) as response:
            return response.read().decode()

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
