"""A node that cannot start refuses with one clear line naming the setting and exits non-zero
(what systemd sees as a failed start): bad config files, ports in use, a socket directory it
may not write, a missing arena size, unknown operations settings."""

import os
import socket
import subprocess
import sys
import time

import pytest


def run_server(tmp_path, *args, prefix=()):
    command = [*prefix, sys.executable, "-m", "kvstore.server", "--grpc-address", "127.0.0.1:0",
               "--shm-socket", str(tmp_path / "kvstore.sock"), "--set", "dram.slab_bytes=4MiB",
               "--set", "dram.arena_bytes=16MiB", "--set", f"nvme.paths={tmp_path / 'nvme-0'}",
               "--set", "nvme.map_bytes=64MiB", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=60)


def error_lines(result):
    return [line for line in result.stderr.splitlines() if " ERROR " in line or "configuration error" in line]


def refused(result, code, *words):
    assert result.returncode == code, result.stderr
    lines = error_lines(result)
    assert len(lines) == 1, result.stderr
    for word in words:
        assert word in lines[0], lines[0]
    return lines[0]


@pytest.mark.parametrize("text, words", [
    ("[ops]\nmetrics_port = 9000\n", ["ops.metrics_port: unknown setting", "metrics_address"]),
    ("[ops]\nlog_format = \"xml\"\n", ["ops.log_format: must be text, json or logfmt"]),
    ("[dram]\narena_bytes = \"\"\n", ["dram.arena_bytes: cannot read ''"]),
    ("[systemd]\nwatchdog_usec = -1\n", ["systemd.watchdog_usec: must not be negative"]),
    ("[ops\n", ["is not valid TOML"]),
])
def test_bad_config_file(tmp_path, text, words):
    path = tmp_path / "kvstore.toml"
    path.write_text(text)
    result = run_server(tmp_path, "--config", str(path))
    refused(result, 2, *words)
    assert len(result.stderr.strip().splitlines()) == 1


def test_missing_arena_size_on_the_command_line(tmp_path):
    refused(run_server(tmp_path, "--arena-bytes", ""), 2, "dram.arena_bytes: cannot read ''")


def test_missing_config_file(tmp_path):
    refused(run_server(tmp_path, "--config", str(tmp_path / "absent.toml")), 2, "cannot read config file")


@pytest.mark.parametrize("flag, words", [
    ("ops.metrics_address={}", "cannot bind metrics to {} (ops.metrics_address): Address already in use"),
    ("server.grpc_address={}", "cannot bind gRPC to {} (server.grpc_address)"),
])
def test_port_in_use(tmp_path, flag, words):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        address = f"127.0.0.1:{taken.getsockname()[1]}"
        result = run_server(tmp_path, "--set", flag.format(address))
    refused(result, 1, words.format(address))
    assert not (tmp_path / "kvstore.sock").exists(), "a refused start leaves no socket behind"


# root writes anywhere; without CAP_DAC_OVERRIDE it meets the same mode bits as anyone
AS_ANYONE = ("setpriv", "--bounding-set", "-dac_override,-dac_read_search") if os.geteuid() == 0 else ()


def test_socket_directory_not_writable(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o555)
    result = run_server(tmp_path, "--shm-socket", str(locked / "kvstore.sock"), prefix=AS_ANYONE)
    refused(result, 1, f"cannot listen on {locked / 'kvstore.sock'} (shm.socket_path): Permission denied")


def test_shard_directory_not_writable(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o555)
    result = run_server(tmp_path, "--set", f"nvme.paths={locked / 'nvme-0'}", prefix=AS_ANYONE)
    refused(result, 1, f"cannot open NVMe path {locked / 'nvme-0'} (nvme.paths)", "Permission denied")


def test_the_same_command_line_without_the_bad_setting_serves(tmp_path):
    """The refusals above come from their one bad setting, not from the rest of the command line."""
    result = run_server(tmp_path, "--ready-file", str(tmp_path / "ready.json"), "--set", "server.drain_timeout_s=0",
                        prefix=("timeout", "--preserve-status", "-s", "TERM", "3"))
    assert result.returncode == 0 and (tmp_path / "ready.json").exists(), result.stderr
    assert not error_lines(result)


def test_arena_larger_than_the_machine_can_give(tmp_path):
    """Refused by the host check before anything is allocated (tests/integration/test_host_memory.py has the rest)."""
    result = run_server(tmp_path, "--set", "dram.arena_bytes=64TiB", "--set", "dram.slab_bytes=1GiB")
    refused(result, 1, "dram.arena_bytes=64TiB", "more than this host can give", "set dram.arena_bytes to at most")


def test_a_socket_another_node_serves(tmp_path):
    first = subprocess.Popen([sys.executable, "-m", "kvstore.server", "--grpc-address", "127.0.0.1:0",
                              "--shm-socket", str(tmp_path / "kvstore.sock"), "--ready-file", str(tmp_path / "ready.json"),
                              "--set", "dram.arena_bytes=16MiB", "--set", "dram.slab_bytes=4MiB",
                              "--set", "nvme.enabled=false"], stderr=subprocess.DEVNULL)
    try:
        while not (tmp_path / "ready.json").exists():
            assert first.poll() is None, "the first node did not start"
            time.sleep(0.05)
        result = run_server(tmp_path, "--set", "nvme.enabled=false")
        refused(result, 1, f"another kvstore-server is serving {tmp_path / 'kvstore.sock'} (shm.socket_path)")
    finally:
        first.kill()
        first.wait()


def test_a_cluster_node_without_the_cluster_extra(tmp_path):
    blocked = tmp_path / "without-aetcd"
    blocked.mkdir()
    (blocked / "aetcd.py").write_text("raise ImportError(\"No module named 'aetcd'\")\n")
    result = run_server(tmp_path, "--set", "cluster.endpoints=http://127.0.0.1:1", "--set", "cluster.name=c",
                        prefix=("env", f"PYTHONPATH={blocked}"))
    refused(result, 1, "cluster.endpoints is set but etcd needs its client, aetcd", "pip install 'kvstore[cluster]'")
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("make, words", [
    (lambda d: (d.mkdir(mode=0o755), os.chown(d, 65534, 65534)), "belongs to uid 65534"),
    (lambda d: (d.mkdir(), d.chmod(0o777)), "is writable by others (mode 777)"),
    (lambda d: d.symlink_to(d.parent), "is a symbolic link"),
])
def test_a_socket_directory_another_user_could_write_is_refused(tmp_path, make, words):
    """Someone else's socket directory (or one anyone may write in) would let them swap the socket."""
    if os.geteuid() != 0 and "65534" in words:
        pytest.skip("giving a directory to another uid needs root")
    taken = tmp_path / "taken"
    make(taken)
    result = run_server(tmp_path, "--shm-socket", str(taken / "kvstore.sock"), "--set", "nvme.enabled=false")
    refused(result, 1, f"the socket directory {taken}", words, "(shm.socket_path)")
    assert not (taken / "kvstore.sock").exists()
