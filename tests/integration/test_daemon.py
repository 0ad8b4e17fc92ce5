"""kvstore-server as a daemon: refuses bad start-ups with one clear line, drains on SIGTERM, exits 0."""

import signal
import socket
import subprocess
import sys
import time

import grpc
import pytest

from kvstore_client import KVStoreClient, Namespace, errors
from kvstore_client.proto import pb


def run_server(*args, env=None, timeout=20):
    return subprocess.run([sys.executable, "-m", "kvstore.server", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


@pytest.mark.parametrize("args, words", [
    (["--set", "dram.arena_bites=1GiB"], "dram.arena_bites: unknown setting"),
    (["--arena-bytes", "a lot"], "dram.arena_bytes: cannot read"),
    (["--set", "server.log_level=LOUD"], "server.log_level"),
])
def test_bad_configuration_stops_start_up(args, words):
    result = run_server("--grpc-address", "127.0.0.1:0", *args)
    assert result.returncode == 2
    assert words in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_bad_config_file(tmp_path):
    path = tmp_path / "kvstore.toml"
    path.write_text("[dram]\narena_bytes = -5x\n")
    result = run_server("--config", str(path))
    assert result.returncode == 2 and "not valid TOML" in result.stderr


def test_port_in_use_is_a_clear_failure(tmp_path):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    try:
        result = run_server("--grpc-address", f"127.0.0.1:{port}", "--shm-socket", str(tmp_path / "s.sock"),
                            "--arena-bytes", "16MiB", "--set", "dram.slab_bytes=4MiB")
    finally:
        taken.close()
    assert result.returncode == 1
    assert f"cannot bind gRPC to 127.0.0.1:{port}" in result.stderr


def test_effective_configuration_is_logged_once(server):
    assert server.log().count("effective configuration") == 1
    assert '"arena_bytes": 67108864' in server.log()


def test_sigterm_drains_open_leases_then_exits_zero(start_server):
    server = start_server({"server.drain_timeout_s": 20})
    ns = Namespace(model="m", page_bytes=8192)
    with KVStoreClient(server.address, control="grpc") as c:
        ns_id = c._namespace_id(ns)
        lease = c._grpc.call("Reserve", pb.ReserveRequest(namespace_id=ns_id, keys=[b"a"], page_bytes=8192))
        server.process.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        assert server.process.poll() is None, "the server must wait for the open lease"
        with pytest.raises(errors.Draining):
            c._grpc.call("Acquire", pb.AcquireRequest(namespace_id=ns_id, keys=[b"a"]))
        c._grpc.call("Commit", pb.CommitRequest(lease_id=lease.lease_id))
        started = time.monotonic()
        assert server.process.wait(10) == 0
        assert time.monotonic() - started < 15  # it left when the lease ended, not at drain_timeout_s (20 s)
    assert "draining complete open_leases_left=0" in server.log()


def test_sigterm_gives_up_on_leases_at_the_drain_deadline(start_server):
    server = start_server({"server.drain_timeout_s": 0.5})
    with grpc.insecure_channel(server.address):
        with KVStoreClient(server.address, control="grpc") as c:
            ns_id = c._namespace_id(Namespace(model="m", page_bytes=8192))
            c._grpc.call("Reserve", pb.ReserveRequest(namespace_id=ns_id, keys=[b"a"], page_bytes=8192))
            server.process.send_signal(signal.SIGTERM)
            assert server.process.wait(10) == 0
    assert "draining complete open_leases_left=1" in server.log()
