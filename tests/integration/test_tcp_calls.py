"""Control calls carried on the TCP data plane (tcp_framing.Op.CALL) of a real kvstore-server.

A TCP client sends its Reserves, Commits, Acquires and Releases on a call connection of its own,
answered in order; every call is checked as the gRPC carrier checks it, a bad frame is answered with
what is wrong, and the leases a call connection opened end when it closes.
"""

import json
import socket
import time

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvstore_client import KVStoreClient, Namespace, errors, framing
from kvstore_client.channel import GrpcChannel
from kvstore_client.proto import pb
from kvstore_client.tcp_control import TcpControlChannel
from kvstore_client.tcp_framing import (CALL_BYTES_MAX, REQUEST, RESPONSE, VERSION, Op, decode_response, encode_call,
                                        encode_request)
from raw_socket import recv_exact

PAGE = 64 << 10
NS = Namespace(model="tcp-calls", page_bytes=PAGE)


def pages(n, seed=0):
    return np.random.default_rng(seed).integers(0, 256, (n, PAGE), dtype=np.uint8)


def calls_per_carrier(server, method):
    counts = {}
    for family in text_string_to_metric_families(server.metrics_text()):
        for sample in family.samples:
            if sample.name == "kvstore_rpc_duration_seconds_count" and sample.labels.get("method") == method:
                counts[sample.labels["carrier"]] = sample.value
    return counts


def answer(sock):
    status, op, length, _ = decode_response(recv_exact(sock, RESPONSE.size))
    return status, op, recv_exact(sock, length)


def endpoint_of(server):
    host, _, port = json.loads(server.ready_file.read_text())["tcp_endpoint"].rpartition(":")
    return host, int(port)


def test_a_tcp_client_sends_its_leases_calls_on_the_tcp_data_plane(private_server):
    server = private_server
    data = pages(40)
    keys = [f"k{i}" for i in range(40)]
    with KVStoreClient(server.address, transport="tcp", timeout_s=20, token=server.token) as client:
        assert isinstance(client._control, TcpControlChannel)
        assert client.put(NS, keys, data) == 40
        out = np.zeros_like(data)
        assert client.get(NS, keys, out) == 40
        assert np.array_equal(out, data)
    for method in ("Reserve", "Commit", "Acquire"):
        counts = calls_per_carrier(server, method)
        assert counts.get("tcp", 0) >= 1 and counts.get("grpc", 0) == 0, (method, counts)
    with KVStoreClient(server.address, transport="tcp", control="grpc", token=server.token) as client:   # gRPC
        assert isinstance(client._control, GrpcChannel)
        out = np.zeros_like(data)
        assert client.get(NS, keys, out) == 40 and np.array_equal(out, data)
    assert calls_per_carrier(server, "Acquire").get("grpc", 0) >= 1


def test_a_bad_call_is_answered_and_the_connection_goes_on(server):
    with socket.create_connection(endpoint_of(server), timeout=5) as sock:
        sock.sendall(encode_call(250, b""))
        status, op, text = answer(sock)
        assert (status, op) == (errors.MalformedRequest.code, Op.CALL) and b"unknown method id 250" in text
        sock.sendall(encode_call(framing.METHOD_IDS["Reserve"], b"\xff\xff\xff"))
        status, _, text = answer(sock)
        assert status == errors.MalformedRequest.code and b"not a valid ReserveRequest" in text
        sock.sendall(encode_call(framing.METHOD_IDS["Commit"], pb.CommitRequest(lease_id=12345).SerializeToString()))
        status, _, text = answer(sock)
        assert status == errors.LeaseNotFound.code and b"unknown" in text
        sock.sendall(encode_call(framing.METHOD_IDS["Stats"], b""))   # an empty request is a whole one
        status, op, payload = answer(sock)
        assert (status, op) == (0, Op.CALL) and pb.StatsResponse.FromString(payload).tiers


def test_a_connection_carries_calls_or_pages_never_both(server):
    with socket.create_connection(endpoint_of(server), timeout=5) as sock:
        sock.sendall(encode_call(framing.METHOD_IDS["Stats"], b""))
        assert answer(sock)[0] == 0
        sock.sendall(encode_request(Op.GET, 1, bytes(16), 0, PAGE))
        status, op, text = answer(sock)
        assert (status, op) == (errors.MalformedRequest.code, Op.GET) and b"carries calls" in text
        assert sock.recv(1) == b""   # closed
    with socket.create_connection(endpoint_of(server), timeout=5) as sock:
        sock.sendall(encode_request(Op.GET, 1, bytes(16), 0, PAGE))
        assert answer(sock)[0] == errors.LeaseNotFound.code
        sock.sendall(encode_call(framing.METHOD_IDS["Stats"], b""))
        status, _, text = answer(sock)
        assert status == errors.MalformedRequest.code and b"carries pages" in text
        assert sock.recv(1) == b""


def test_a_call_longer_than_a_frame_may_be_closes_the_connection(server):
    with socket.create_connection(endpoint_of(server), timeout=5) as sock:
        sock.sendall(REQUEST.pack(Op.CALL, VERSION, 0, CALL_BYTES_MAX + 1, 0, bytes(16), 1, 0))
        status, _, text = answer(sock)
        assert status == errors.MalformedRequest.code and b"exceeds" in text
        assert sock.recv(1) == b""


def test_the_leases_of_a_call_connection_end_when_it_closes(server):
    with KVStoreClient(server.address, control="grpc") as observer:
        ns_id = observer._conn.namespace_id(NS)
        host, port = endpoint_of(server)
        channel = TcpControlChannel(f"{host}:{port}", 5.0)
        reserved = channel.call("Reserve", pb.ReserveRequest(namespace_id=ns_id, keys=[b"held0", b"held1"],
                                                             page_bytes=PAGE, lease_ttl_ms=60_000))
        assert reserved.lease_id and observer.stats().leases_open == 1
        channel.close()
        deadline = time.monotonic() + 10
        while observer.stats().leases_open and time.monotonic() < deadline:
            time.sleep(0.02)
        assert observer.stats().leases_open == 0   # not its 60 s TTL
        assert observer.stats().tiers[0].used_bytes == 0


@pytest.mark.parametrize("calls_ahead", [1, 100])
def test_calls_sent_ahead_are_answered_in_order(server, calls_ahead):
    """More calls than a connection queues (tcp.CALLS_QUEUED_MAX) before any answer is read: each is answered,
    in the order sent."""
    with KVStoreClient(server.address, transport="tcp") as client:
        assert client.put(NS, ["o0", "o1", "o2"], pages(3)) == 3
        channel = client._control
        ns_id = client._conn.namespace_id(NS)
        sent = [channel.submit("Lookup", pb.LookupRequest(namespace_id=ns_id, keys=[b"o0", b"o1", b"o2"][:1 + i % 3]))
                for i in range(calls_ahead)]
        assert [pending.result().hit_pages for pending in sent] == [1 + i % 3 for i in range(calls_ahead)]
