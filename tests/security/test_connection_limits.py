"""Connections cannot exhaust a node: local connections are capped and checked for identity before any
frame is read, idle local and TCP connections make room for new ones, and a client that finds every
local connection busy takes TCP, so real clients still get in."""

import json
import os
import socket
import time

import numpy as np
import pytest

from identities import Tokens
from raw_socket import recv_exact
from kvstore_client import KVStoreClient, Namespace, framing
from kvstore_client.channel import LocalChannel
from kvstore_client.proto import pb

PAGE = 64 << 10
NS = Namespace(model="connection-limits", page_bytes=PAGE)
NOBODY = 65534


def pages(n, seed=0):
    return np.random.default_rng(seed).integers(0, 256, (n, PAGE), dtype=np.uint8)


def read_frame(sock):
    length, code = framing.decode_header(recv_exact(sock, framing.HEADER.size))
    return code, recv_exact(sock, length).decode()


def server_threads(server):
    return len(os.listdir(f"/proc/{server.process.pid}/task"))


def wait_for(predicate, timeout_s=20.0):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)


def put_and_get(client, seed):
    keys = [f"s{seed}-{i}" for i in range(3)]
    data = pages(3, seed)
    assert client.put(NS, keys, data) == 3
    out = np.zeros_like(data)
    assert client.get(NS, keys, out, verify=True) == 3
    assert np.array_equal(out, data)


def test_local_connections_beyond_the_cap_are_answered_and_get_no_thread(start_server):
    server = start_server({"shm.connections_max": 8})
    baseline = server_threads(server)
    socks = []
    for _ in range(20):
        sock = socket.socket(socket.AF_UNIX)
        sock.settimeout(10)
        sock.connect(server.socket_path)
        socks.append(sock)
    try:
        # accepted in order: the first 8 are served, the other 12 refused as they arrive
        for sock in socks[8:]:
            code, text = read_frame(sock)
            assert code == pb.CAPACITY_EXHAUSTED and "shm.connections_max=8" in text, text
            assert sock.recv(1) == b""
        for sock in socks[:8]:
            sock.setblocking(False)
            with pytest.raises(BlockingIOError):  # served connections were told nothing
                sock.recv(1)
        assert server_threads(server) <= baseline + 8
        assert server.log().count("shm.connections_max=8 reached") == 12
    finally:
        for sock in socks:
            sock.close()
    wait_for(lambda: server_threads(server) <= baseline)  # the served ones ended and gave their places back
    with KVStoreClient(server.address, transport="shm") as client:
        put_and_get(client, seed=1)


def as_nobody_announce(socket_path, payload_bytes):
    """In a child running as uid NOBODY: connect, send a header announcing `payload_bytes` and never the payload,
    then read the answer. Returns (error code, text, what followed the answer)."""
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(read_fd)
            os.chdir(os.path.dirname(socket_path))  # as root: the test's temp directories are closed to nobody
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            sock = socket.socket(socket.AF_UNIX)
            sock.settimeout(10)
            sock.connect(os.path.basename(socket_path))
            sock.sendall(framing.HEADER.pack(payload_bytes, framing.METHOD_IDS["Hello"]))
            code, text = read_frame(sock)
            after = sock.recv(16)
            os.write(write_fd, json.dumps([code, text, after.hex()]).encode())
            os._exit(0)
        except BaseException as exc:  # the parent reports it
            os.write(write_fd, json.dumps(["failed", repr(exc), ""]).encode())
            os._exit(1)
    os.close(write_fd)
    with os.fdopen(read_fd, "rb") as pipe:
        result = json.loads(pipe.read())
    os.waitpid(pid, 0)
    return result


@pytest.mark.skipif(os.geteuid() != 0, reason="connecting as another uid needs root")
def test_a_refused_uid_is_answered_before_its_frame_is_read(start_server):
    server = start_server()  # shm.allowed_uids defaults to the server's own uid (root here)
    code, text, after = as_nobody_announce(server.socket_path, framing.FRAME_BYTES_MAX)
    # the 16 MiB payload was never sent, yet the answer came: the server read no frame first
    assert code == pb.PERMISSION_DENIED, text
    assert f"uid {NOBODY} may not use this kvstore node; add it to shm.allowed_uids" in text
    assert after == ""  # then the server closed its side
    assert "shm peer refused pid=" in server.log() and f"uid={NOBODY}" in server.log()
    with KVStoreClient(server.address, transport="shm") as client:
        put_and_get(client, seed=2)


def test_idle_tcp_connections_are_closed_and_a_real_client_gets_in(start_server):
    server = start_server({"tcp.connections_max": 4, "tcp.idle_timeout_s": 2})
    host, _, port = json.loads(server.ready_file.read_text())["tcp_endpoint"].rpartition(":")
    idle = [socket.create_connection((host, int(port)), timeout=20) for _ in range(4)]
    try:
        for sock in idle:
            try:
                assert sock.recv(1) == b""  # closed by the server, not by us
            except ConnectionResetError:
                pass
    finally:
        for sock in idle:
            sock.close()
    assert server.log().count("(tcp.idle_timeout_s); closing") == 4
    with KVStoreClient(server.address, transport="tcp", timeout_s=20) as client:
        assert client.transport == "tcp"
        put_and_get(client, seed=3)


def test_at_the_tcp_limit_the_connection_idle_longest_makes_room(start_server):
    """Idle sockets cannot lock real clients out until tcp.idle_timeout_s (300 s by default)."""
    server = start_server({"tcp.connections_max": 4})
    host, _, port = json.loads(server.ready_file.read_text())["tcp_endpoint"].rpartition(":")
    idle = [socket.create_connection((host, int(port)), timeout=20) for _ in range(4)]
    try:
        time.sleep(1.2)   # past RECLAIM_IDLE_S
        with KVStoreClient(server.address, transport="tcp", timeout_s=20) as client:
            assert client.transport == "tcp"
            put_and_get(client, seed=4)
    finally:
        for sock in idle:
            sock.close()
    assert "to admit a new one" in server.log()


def test_at_the_tcp_limit_a_call_connection_holding_a_lease_is_not_taken(start_server):
    """A TCP client's call connection sends nothing while its put's pages move on its data connection: the
    lease it holds keeps it from being reclaimed, though it is the connection idle longest."""
    from kvstore_client.tcp_control import TcpControlChannel

    server = start_server({"tcp.connections_max": 4})
    endpoint = json.loads(server.ready_file.read_text())["tcp_endpoint"]
    with KVStoreClient(server.address, transport="tcp", control="grpc") as opener:
        ns_id = opener._namespace_id(NS)
    holder = TcpControlChannel(endpoint, 5.0)
    host, _, port = endpoint.rpartition(":")
    idle = []
    try:
        reserved = holder.call("Reserve", pb.ReserveRequest(namespace_id=ns_id, keys=[b"held"], page_bytes=PAGE,
                                                            lease_ttl_ms=60_000))
        idle = [socket.create_connection((host, int(port)), timeout=20) for _ in range(3)]
        time.sleep(1.2)   # past RECLAIM_IDLE_S, for the holder first
        with KVStoreClient(server.address, transport="tcp", timeout_s=20) as client:   # two connections
            put_and_get(client, seed=7)
        holder.call("Abort", pb.AbortRequest(lease_id=reserved.lease_id))   # its lease, still open
    finally:
        holder.close()
        for sock in idle:
            sock.close()
    assert server.log().count("to admit a new one") == 2


def test_at_the_local_limit_the_connection_idle_longest_makes_room(start_server):
    """Idle local sockets (one byte each, a frame never finished) lock no local client out."""
    server = start_server({"shm.connections_max": 8})
    idle = []
    for _ in range(8):
        sock = socket.socket(socket.AF_UNIX)
        sock.connect(server.socket_path)
        sock.sendall(b"\x01")
        idle.append(sock)
    try:
        time.sleep(1.2)   # past RECLAIM_IDLE_S
        with KVStoreClient(server.address, transport="shm", timeout_s=20) as client:
            assert client.transport == "shm"
            put_and_get(client, seed=5)
    finally:
        for sock in idle:
            sock.close()
    assert "to admit a new one" in server.log()


def test_a_client_finding_every_local_connection_busy_takes_tcp(start_server):
    """Connections holding leases are not reclaimed (their clients may be copying); a new client moves on."""
    server = start_server({"shm.connections_max": 2})
    with KVStoreClient(server.address, transport="tcp") as opener:
        ns_id = opener._namespace_id(NS)
        hello = opener._conn.hello
    holders = [LocalChannel(hello.shm_socket, 5.0) for _ in range(2)]
    try:
        for i, holder in enumerate(holders):
            reserved = holder.call("Reserve", pb.ReserveRequest(namespace_id=ns_id, keys=[f"held{i}".encode()],
                                                                page_bytes=PAGE, lease_ttl_ms=60_000))
            assert reserved.lease_id
        time.sleep(1.2)
        with KVStoreClient(server.address, timeout_s=20) as client:
            assert client.transport == "tcp"
            put_and_get(client, seed=6)
    finally:
        for holder in holders:
            holder.close()
    assert "shm.connections_max=2 reached, none idle" in server.log()


def test_a_first_frame_before_the_token_is_small(start_server, tmp_path):
    tokens = Tokens(tmp_path)
    server = start_server({"auth.tokens_file": str(tokens.path), "auth.local_uids": f"{os.getuid()}:alice",
                           "auth.local_require_token": "true"})
    sock = socket.socket(socket.AF_UNIX)
    sock.settimeout(10)
    sock.connect(server.socket_path)
    sock.sendall(framing.HEADER.pack(1 << 20, framing.AUTHENTICATE))   # 1 MiB announced, none sent
    code, text = read_frame(sock)
    assert code == pb.MALFORMED_REQUEST and "before its token" in text and "at most 4096 bytes" in text, text
    assert sock.recv(1) == b""
    sock.close()
