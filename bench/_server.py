"""Start and stop a real kvstore-server process for benchmarks (never collected by pytest)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time


class ServerProcess:
    def __init__(self, *settings: str, cpus: str | None = None, log_path: str | None = None):
        self.tmp = tempfile.TemporaryDirectory(prefix="kvstore-bench-")
        ready = os.path.join(self.tmp.name, "ready.json")
        command = [sys.executable, "-m", "kvstore.server", "--grpc-address", "127.0.0.1:0",
                   "--shm-socket", os.path.join(self.tmp.name, "kvstore.sock"), "--ready-file", ready,
                   "--set", "server.log_level=WARNING", "--set", "nvme.enabled=false",
                   *[a for s in settings for a in ("--set", s)]]
        if cpus:
            command = ["taskset", "-c", cpus, *command]
        self._log = open(log_path, "ab") if log_path else None
        self.process = subprocess.Popen(command, stderr=self._log)
        deadline = time.monotonic() + 60
        while not os.path.exists(ready):
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("kvstore-server did not start")
            time.sleep(0.05)
        with open(ready) as f:
            self.address = json.load(f)["grpc_address"]

    def stop(self) -> None:
        self.process.send_signal(signal.SIGTERM)
        self.process.wait(30)
        if self._log:
            self._log.close()
        self.tmp.cleanup()
