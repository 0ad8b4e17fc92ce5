"""gRPC over TLS on a real node: a token over TLS, and mutual TLS where the client certificate names the
tenant; plaintext, unknown CAs and a certificate of another tenant than the token's are refused."""

from __future__ import annotations

import numpy as np
import pytest

from identities import Certificates, Tokens
from kvstore_client import KVStoreClient, Namespace, errors
from kvstore_client.channel import GrpcChannel
from kvstore_client.credentials import Credentials
from kvstore_client.proto import pb

PAGE = 8192
NS = Namespace(model="tls-model", page_bytes=PAGE)


@pytest.fixture
def certs(tmp_path):
    return Certificates(tmp_path)


@pytest.fixture
def tokens(tmp_path):
    return Tokens(tmp_path)


def test_token_over_tls(start_server, certs, tokens):
    node = start_server({"auth.tokens_file": str(tokens.path), "auth.tls_cert": certs.server_cert,
                         "auth.tls_key": certs.server_key})
    data = np.arange(2 * PAGE, dtype=np.uint8).reshape(2, PAGE)
    with KVStoreClient(node.address, token=tokens.alice, tls_ca=certs.ca, transport="tcp") as alice:
        assert alice.put(NS, ["k0", "k1"], data) == 2
        out = np.zeros_like(data)
        assert alice.get(NS, ["k0", "k1"], out) == 2 and np.array_equal(out, data)
    with KVStoreClient(node.address, token=tokens.bob, tls_ca=certs.ca, transport="tcp") as bob:
        assert bob.lookup(NS, ["k0", "k1"]) == 0
    with pytest.raises(errors.Unavailable):   # plaintext to a TLS port: no handshake, no answer
        KVStoreClient(node.address, token=tokens.alice, timeout_s=2)
    (certs.directory / "other").mkdir()
    other = Certificates(certs.directory / "other")
    with pytest.raises(errors.Unavailable):   # a node certificate from a CA the client does not trust
        KVStoreClient(node.address, token=tokens.alice, tls_ca=other.ca, timeout_s=2)


def test_tls_on_the_tcp_data_plane(start_server, certs, tokens):
    """With tcp.tls_cert the data plane speaks TLS only: the client checks it against the gRPC CA, the HELLO
    and pages travel encrypted, and a plaintext HELLO gets no answer."""
    import asyncio
    import socket

    from kvstore_client import AsyncKVStoreClient
    from kvstore_client.tcp_framing import encode_hello

    node = start_server({"auth.tokens_file": str(tokens.path), "auth.tls_cert": certs.server_cert,
                         "auth.tls_key": certs.server_key, "tcp.tls_cert": certs.server_cert,
                         "tcp.tls_key": certs.server_key})
    data = np.random.default_rng(3).integers(0, 256, (3, PAGE), dtype=np.uint8)
    with KVStoreClient(node.address, token=tokens.alice, tls_ca=certs.ca, transport="tcp") as alice:
        hello = alice._conn.hello
        assert hello.tcp_tls
        assert alice.put(NS, ["t0", "t1", "t2"], data) == 3
        out = np.zeros_like(data)
        assert alice.get(NS, ["t0", "t1", "t2"], out) == 3 and np.array_equal(out, data)

    async def read_async():
        async with AsyncKVStoreClient(node.address, token=tokens.alice, tls_ca=certs.ca, transport="tcp") as client:
            out = np.zeros_like(data)
            assert await client.get(NS, ["t0", "t1", "t2"], out) == 3 and np.array_equal(out, data)
    asyncio.run(read_async())
    host, port = hello.tcp_endpoint.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as sock:   # plaintext: not a TLS record
        sock.sendall(encode_hello(hello.data_ticket))
        assert sock.recv(64) == b""


def test_mutual_tls_client_certificate_names_the_tenant(start_server, certs, tokens):
    node = start_server({"auth.tokens_file": str(tokens.path), "auth.tls_cert": certs.server_cert,
                         "auth.tls_key": certs.server_key, "auth.tls_client_ca": certs.ca})
    alice_cert, alice_key = certs.issue("alice", "alice")
    bob_cert, bob_key = certs.issue("bob", "bob")
    with KVStoreClient(node.address, tls_ca=certs.ca, tls_cert=alice_cert, tls_key=alice_key, token="",
                       transport="tcp") as alice:
        assert alice.put(NS, ["m0"], np.ones((1, PAGE), np.uint8)) == 1
        assert [ns.tenant for ns in alice.stats().namespaces] == ["alice"]
    with KVStoreClient(node.address, tls_ca=certs.ca, tls_cert=bob_cert, tls_key=bob_key, token="",
                       transport="tcp") as bob:
        assert bob.lookup(NS, ["m0"]) == 0
    # A certificate of one tenant and a token of another: refused, saying so.
    mixed = GrpcChannel(node.address, 5, Credentials(token=tokens.bob, tls_ca=certs.ca, tls_cert=alice_cert,
                                                     tls_key=alice_key))
    with pytest.raises(errors.PermissionDenied, match="certificate names tenant 'alice'"):
        mixed.call("Hello", pb.HelloRequest())
    # No client certificate: the handshake itself fails.
    with pytest.raises(errors.Unavailable):
        GrpcChannel(node.address, 2, Credentials(token=tokens.alice, tls_ca=certs.ca)).call("Hello", pb.HelloRequest())


def test_client_tls_settings_are_checked(certs):
    with pytest.raises(ValueError, match="tls_cert and tls_key go together"):
        Credentials.resolve(environ={}, tls_cert="a.pem", tls_ca=certs.ca)
    assert Credentials.resolve(environ={"KVSTORE_TOKEN": "t", "KVSTORE_TLS_CA": certs.ca}).tls_ca == certs.ca
    assert Credentials.resolve(environ={"KVSTORE_TOKEN": "t"}, token="given").token == "given"
