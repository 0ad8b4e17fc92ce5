"""Bad requests to a real server get a clear status and message; the server keeps serving and loses nothing."""

import socket

import grpc
import numpy as np
import pytest

from kvstore_client import KVStoreClient, Namespace, errors, framing
from kvstore_client.channel import LocalChannel
from kvstore_client.proto import pb

PAGE = 8192
NS = Namespace(model="m", page_bytes=PAGE)


@pytest.fixture
def stored(client):
    keys = [f"safe{i}" for i in range(4)]
    data = np.random.default_rng(0).integers(0, 256, (4, PAGE), dtype=np.uint8)
    assert client.put(NS, keys, data) == 4
    return keys, data


def still_serving(client, stored):
    keys, data = stored
    out = np.zeros_like(data)
    assert client.get(NS, keys, out) == 4 and np.array_equal(out, data)


def raw_call(address, method, payload: bytes):
    with grpc.insecure_channel(address) as channel:
        return channel.unary_unary(f"/kvstore.v1.KVStore/{method}")(payload, timeout=5)


def test_malformed_grpc_message(server, client, stored):
    with pytest.raises(grpc.RpcError) as info:
        raw_call(server.address, "Reserve", b"\xff\xff\xff\xff")
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "not a valid ReserveRequest" in info.value.details()
    still_serving(client, stored)


@pytest.mark.parametrize("make, status, code, words", [
    (lambda ns: pb.ReserveRequest(namespace_id=ns ^ 1, keys=[b"a"], page_bytes=PAGE),
     grpc.StatusCode.NOT_FOUND, pb.NAMESPACE_NOT_FOUND, "OpenNamespace"),
    (lambda ns: pb.ReserveRequest(namespace_id=ns, keys=[b"a"], page_bytes=PAGE * 2),
     grpc.StatusCode.INVALID_ARGUMENT, pb.PAGE_SIZE_MISMATCH, "stores pages of 8192 bytes"),
    (lambda ns: pb.ReserveRequest(namespace_id=ns, keys=[b"a", b"a"], page_bytes=PAGE),
     grpc.StatusCode.INVALID_ARGUMENT, pb.DUPLICATE_KEY, "same key twice"),
    (lambda ns: pb.ReserveRequest(namespace_id=ns, keys=[b"%d" % i for i in range(2000)], page_bytes=PAGE),
     grpc.StatusCode.INVALID_ARGUMENT, pb.BATCH_TOO_LARGE, "split it"),
    (lambda ns: pb.AcquireRequest(namespace_id=ns, keys=[b"x" * 65]),
     grpc.StatusCode.INVALID_ARGUMENT, pb.INVALID_ARGUMENT, "1 to 64 bytes"),
    (lambda ns: pb.CommitRequest(lease_id=42),
     grpc.StatusCode.NOT_FOUND, pb.LEASE_NOT_FOUND, "expired"),
    (lambda ns: pb.ReleaseRequest(lease_ids=[42]),
     grpc.StatusCode.NOT_FOUND, pb.LEASE_NOT_FOUND, "expired"),
    (lambda ns: pb.AbortRequest(lease_id=42),
     grpc.StatusCode.NOT_FOUND, pb.LEASE_NOT_FOUND, "expired"),
    (lambda ns: pb.DeleteRequest(namespace_id=ns, keys=[b"safe0"], all_pages=True),
     grpc.StatusCode.INVALID_ARGUMENT, pb.INVALID_ARGUMENT, "send no keys with it"),
    (lambda ns: pb.LookupRequest(namespace_id=ns, keys_packed=b"x" * 130, key_bytes=65),
     grpc.StatusCode.INVALID_ARGUMENT, pb.INVALID_ARGUMENT, "limits.key_bytes_max"),
    (lambda ns: pb.LookupRequest(namespace_id=ns, keys_packed=b"safe0safe1saf", key_bytes=5),
     grpc.StatusCode.INVALID_ARGUMENT, pb.INVALID_ARGUMENT, "not a whole number of key_bytes=5"),
    (lambda ns: pb.LookupRequest(namespace_id=ns, keys_packed=b"k" * 4 * 40000, key_bytes=4),
     grpc.StatusCode.INVALID_ARGUMENT, pb.BATCH_TOO_LARGE, "limits.lookup_pages_max is 32768"),
])
def test_each_bad_request_gets_its_status(server, client, stored, make, status, code, words):
    ns_id = client._namespace_id(NS)
    request = make(ns_id)
    method = type(request).__name__.removesuffix("Request")
    with grpc.insecure_channel(server.address) as channel:
        stub = channel.unary_unary(f"/kvstore.v1.KVStore/{method}", request_serializer=type(request).SerializeToString)
        with pytest.raises(grpc.RpcError) as info:
            stub(request, timeout=5)
    assert info.value.code() == status
    assert words in info.value.details()
    assert dict(info.value.trailing_metadata())[errors.ERROR_CODE_METADATA_KEY] == str(code)
    still_serving(client, stored)


def test_client_raises_typed_errors(client, stored):
    with pytest.raises(errors.PageSizeMismatch):
        client.put(NS, ["x"], np.zeros((1, PAGE + 1), np.uint8))
    with pytest.raises(errors.InvalidArgument, match="read-only"):
        client.get(NS, ["safe0"], [b"\0" * PAGE])
    with pytest.raises(errors.InvalidArgument):
        client.put(NS, ["x", "y"], [np.zeros(PAGE, np.uint8)])
    with pytest.raises(errors.DuplicateKey):
        client.put(NS, ["x", "x"], np.zeros((2, PAGE), np.uint8))
    still_serving(client, stored)


def test_a_get_into_buffers_of_python_objects_is_refused_before_any_copy(client, stored):
    """Their bytes are object pointers: a page copied over them would crash this process."""
    import ctypes

    objects = np.empty(PAGE // 8, dtype=object)
    structured = np.zeros(PAGE // 16, dtype=[("value", "<f8"), ("owner", "O")])
    for out in (memoryview(objects), (ctypes.py_object * (PAGE // 8))(), memoryview(structured), structured):
        with pytest.raises(errors.InvalidArgument, match="page 0: .*holds Python objects"):
            client.get(NS, stored[0][:1], [out])
    assert all(item is None for item in objects)
    still_serving(client, stored)


def test_checksum_mismatch_over_the_wire_makes_nothing_visible(server, client, stored):
    ns_id = client._namespace_id(NS)
    channel = LocalChannel(server.socket_path, 5)
    try:
        r = channel.call("Reserve", pb.ReserveRequest(namespace_id=ns_id, keys=[b"bad"], page_bytes=PAGE))
        with pytest.raises(errors.ChecksumMismatch, match="nothing in this commit was made visible"):
            channel.call("Commit", pb.CommitRequest(lease_id=r.lease_id, checksums=[123]))
        assert client.lookup(NS, ["bad"]) == 0
        assert channel.call("Abort", pb.AbortRequest(lease_id=r.lease_id)).aborted_pages == 1
    finally:
        channel.close()
    assert client.stats().checksum_failures == 1
    still_serving(client, stored)


def test_malformed_local_frames(server, client, stored):
    sock = socket.socket(socket.AF_UNIX)
    sock.connect(server.socket_path)
    sock.sendall(framing.encode(framing.METHOD_IDS["Reserve"], b"\xff\xff\xff"))
    length, code = framing.decode_header(sock.recv(framing.HEADER.size))
    assert code == pb.MALFORMED_REQUEST and b"not a valid ReserveRequest" in sock.recv(length)
    sock.sendall(framing.encode(200, b""))
    length, code = framing.decode_header(sock.recv(framing.HEADER.size))
    assert code == pb.MALFORMED_REQUEST and b"unknown method" in sock.recv(length)
    # a length over the frame limit cannot be skipped: the server closes the connection
    sock.sendall(framing.HEADER.pack(framing.FRAME_BYTES_MAX + 1, 1))
    assert sock.recv(16) == b""
    sock.close()
    still_serving(client, stored)


def test_a_uid_outside_the_allow_list_is_refused(start_server):
    server = start_server({"shm.allowed_uids": "4242424"})
    with pytest.raises(errors.PermissionDenied, match="shm.allowed_uids"):
        KVStoreClient(server.address, transport="shm")
    assert "shm peer refused" in server.log()
    with KVStoreClient(server.address) as client:  # "auto" moves on to the TCP data plane
        assert client.transport == "tcp"


def test_clear_removes_the_namespace_and_nothing_else(client, stored):
    other = Namespace(model="other", page_bytes=PAGE)
    assert client.put(other, ["o1"], np.ones((1, PAGE), dtype=np.uint8)) == 1
    assert client.clear(NS) == 4
    assert client.lookup(NS, keys=stored[0]) == 0
    assert client.lookup(other, keys=["o1"]) == 1
