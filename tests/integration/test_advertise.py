"""A node serving other hosts advertises a data-plane endpoint they can reach, and refuses to advertise loopback to them.

The node runs in a network namespace of its own (another host, as far as the network goes); the
client runs here and reaches it over a veth pair, dialling only what Hello answered."""

from __future__ import annotations

import json

import numpy as np
import pytest

from identities import Tokens
from kvstore_client import KVStoreClient, Namespace
from netns import NetnsServer, veth_namespace

NS = Namespace(model="advertise-test", page_bytes=64 << 10)


def serve_in(ns, workdir, settings, tokens):
    workdir.mkdir()
    return NetnsServer(workdir, {"shm.enabled": "false", "auth.tokens_file": str(tokens.path), **settings}, ns.name)


def round_trip(address: str, token: str) -> str:
    """Put and get four pages; the data path they took (a TCP client dials only Hello's tcp_endpoint)."""
    data = np.random.default_rng(7).integers(0, 256, (4, NS.page_bytes), dtype=np.uint8)
    with KVStoreClient(address, token=token, transport="tcp", timeout_s=20) as client:
        keys = [f"k{i}" for i in range(4)]
        assert client.put(NS, keys, data, verify=True) == 4
        out = np.zeros_like(data)
        assert client.get(NS, keys, out, verify=True) == 4 and np.array_equal(out, data)
        return client.transport


@pytest.mark.parametrize("grpc_host", ["0.0.0.0", "ns_ip"])
def test_a_remote_client_reaches_the_advertised_endpoint(tmp_path, grpc_host):
    """Bound to every interface, the node advertises its default route's address; bound to one, that one."""
    tokens = Tokens(tmp_path)
    with veth_namespace(default_route=True) as ns:
        host = ns.ns_ip if grpc_host == "ns_ip" else grpc_host
        node = serve_in(ns, tmp_path / "node", {"server.grpc_address": f"{host}:0"}, tokens)
        try:
            ready = json.loads(node.ready_file.read_text())
            assert ready["tcp_endpoint"].startswith(f"{ns.ns_ip}:"), ready
            assert round_trip(f"{ns.ns_ip}:{ready['grpc_port']}", tokens.alice) == "tcp"
        finally:
            node.kill()


def test_an_explicit_advertise_host_wins(tmp_path):
    tokens = Tokens(tmp_path)
    with veth_namespace(default_route=True) as ns:
        node = serve_in(ns, tmp_path / "node", {"server.grpc_address": "0.0.0.0:0",
                                                "tcp.advertise_host": "kvstore-7.example"}, tokens)
        try:
            assert json.loads(node.ready_file.read_text())["tcp_endpoint"].startswith("kvstore-7.example:")
        finally:
            node.kill()


@pytest.mark.parametrize("settings, default_route, words", [
    ({"tcp.address": "127.0.0.1:0"}, True, ["tcp.address would advertise 127.0.0.1", "server.grpc_address serves"]),
    ({}, False, ["no IPv4 default route", "set tcp.advertise_host"]),
])
def test_an_unreachable_endpoint_is_refused_at_start(tmp_path, settings, default_route, words):
    tokens = Tokens(tmp_path)
    with veth_namespace(default_route=default_route) as ns:
        with pytest.raises(RuntimeError) as refused:
            serve_in(ns, tmp_path / "node", {"server.grpc_address": "0.0.0.0:0", **settings}, tokens)
        errors = [line for line in str(refused.value).splitlines() if " ERROR " in line]
        assert len(errors) == 1 and "exited with 1" in str(refused.value), refused.value
        for word in words:
            assert word in errors[0], errors[0]
