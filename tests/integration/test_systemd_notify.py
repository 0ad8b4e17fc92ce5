"""kvstore-server speaks systemd's notify protocol over a real datagram socket: READY=1 only once
it serves, WATCHDOG=1 at half WATCHDOG_USEC while alive, STATUS= lines, STOPPING=1 on SIGTERM,
and nothing but a non-zero exit when start-up fails."""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvstore.config import SystemdConfig
from kvstore.ops.notify import Notifier
from kvstore.ops.supervise import serve_until_stopped


class NotifySocket:
    """What systemd listens on: an AF_UNIX datagram socket, by path or abstract name."""

    def __init__(self, address: str):
        self.env_value = address
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind("\0" + address[1:] if address.startswith("@") else address)

    def receive(self, timeout_s: float = 10.0) -> dict[str, str] | None:
        self.sock.settimeout(timeout_s)
        try:
            data = self.sock.recv(4096)
        except socket.timeout:
            return None
        return dict(line.split("=", 1) for line in data.decode().splitlines())

    def receive_until(self, key: str, timeout_s: float = 10.0) -> list[dict[str, str]]:
        messages, deadline = [], time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            message = self.receive(deadline - time.monotonic())
            if message is None:
                break
            messages.append(message)
            if key in message:
                return messages
        raise AssertionError(f"no {key} within {timeout_s}s; got {messages}")

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def notify_socket(tmp_path):
    sock = NotifySocket(str(tmp_path / "notify.sock"))
    yield sock
    sock.close()


def spawn(tmp_path, env, *extra):
    args = [sys.executable, "-m", "kvstore.server", "--grpc-address", "127.0.0.1:0",
            "--shm-socket", str(tmp_path / "kvstore.sock"), "--ready-file", str(tmp_path / "ready.json"),
            "--arena-bytes", "16MiB", "--set", "dram.slab_bytes=4MiB", "--set", "nvme.enabled=false", *extra]
    return subprocess.Popen(args, env={**os.environ, **env}, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def health(address):
    with grpc.insecure_channel(address) as channel:
        answer = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
    return answer.status


def test_ready_watchdog_status_and_stopping(tmp_path, notify_socket):
    process = spawn(tmp_path, {"NOTIFY_SOCKET": notify_socket.env_value, "WATCHDOG_USEC": "200000"})
    try:
        first = notify_socket.receive(30)
        # READY=1 is the first thing systemd hears, and by then the node answers.
        assert first is not None and first.get("READY") == "1", first
        assert first["MAINPID"] == str(process.pid) and first["STATUS"].startswith("serving")
        address = json.loads((tmp_path / "ready.json").read_text())["grpc_address"]
        assert health(address) == health_pb2.HealthCheckResponse.SERVING
        started = time.monotonic()
        pings = 0
        while time.monotonic() - started < 1.5:
            message = notify_socket.receive(2)
            assert message is not None and "READY" not in message
            pings += message.get("WATCHDOG") == "1"
        assert pings >= 4, f"{pings} watchdog pings in 1.5 s at a 0.2 s interval"
        process.send_signal(signal.SIGTERM)
        stopping = notify_socket.receive_until("STOPPING")[-1]
        assert stopping["STOPPING"] == "1" and stopping["STATUS"].startswith("draining")
        assert process.wait(20) == 0
    finally:
        process.kill()
        process.wait()


def test_abstract_socket_address(tmp_path):
    sock = NotifySocket(f"@kvstore-test-{uuid.uuid4().hex}")
    process = spawn(tmp_path, {"NOTIFY_SOCKET": sock.env_value})
    try:
        message = sock.receive(30)
        assert message is not None and message.get("READY") == "1"
        process.send_signal(signal.SIGTERM)
        assert sock.receive_until("STOPPING")[-1]["STOPPING"] == "1"
        assert process.wait(20) == 0
    finally:
        process.kill()
        process.wait()
        sock.close()


def test_watchdog_for_another_pid_is_not_ours(tmp_path, notify_socket):
    process = spawn(tmp_path, {"NOTIFY_SOCKET": notify_socket.env_value, "WATCHDOG_USEC": "100000",
                               "WATCHDOG_PID": "1"})
    try:
        assert notify_socket.receive(30)["READY"] == "1"
        assert notify_socket.receive(0.6) is None  # no WATCHDOG=1 (and nothing else) meanwhile
    finally:
        process.kill()
        process.wait()


def test_failed_start_never_says_ready(tmp_path, notify_socket):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    try:
        process = spawn(tmp_path, {"NOTIFY_SOCKET": notify_socket.env_value},
                        "--set", f"ops.metrics_address=127.0.0.1:{taken.getsockname()[1]}")
        _, stderr = process.communicate(timeout=30)
    finally:
        taken.close()
    assert process.returncode == 1
    assert "ops.metrics_address" in stderr.decode()
    assert notify_socket.receive(0.2) is None


def test_watchdog_is_withheld_while_the_node_is_unhealthy(notify_socket):
    notifier = Notifier(SystemdConfig(notify_socket=notify_socket.env_value, watchdog_usec=40_000))
    trouble = ["the lease reaper thread died"]
    stop = threading.Event()
    loop = threading.Thread(target=serve_until_stopped,
                            args=(stop, notifier, lambda: trouble[0], lambda: "serving"))
    loop.start()
    try:
        unhealthy = notify_socket.receive(2)
        assert unhealthy == {"STATUS": "unhealthy: the lease reaper thread died"}
        assert notify_socket.receive(0.3) is None  # no WATCHDOG=1 while unhealthy
        trouble[0] = ""
        assert notify_socket.receive(2) == {"WATCHDOG": "1"}
    finally:
        stop.set()
        loop.join(5)
        notifier.close()


def test_an_unreachable_notify_socket_is_logged_once(tmp_path, caplog):
    notifier = Notifier(SystemdConfig(notify_socket=str(tmp_path / "absent.sock"), watchdog_usec=1000))
    with caplog.at_level("WARNING", logger="kvstore.ops.notify"):
        assert [notifier.watchdog() for _ in range(5)] == [False] * 5
    assert len(caplog.records) == 1 and "absent.sock" in caplog.records[0].getMessage()
    notifier.close()
