"""A cluster of three token-protected nodes: a cluster client (and `kvstore cluster status`) with a
tenant's token stores and finds pages on every node; one without a token is refused at once with
errors.Unauthenticated, never counted as a miss or left waiting."""

from __future__ import annotations

import ipaddress
import json
import subprocess

import numpy as np
import pytest
from cryptography import x509

from cluster_parts import etcd, server_args, start_node, wait_members  # noqa: F401
from identities import Certificates, Tokens
from kvstore.admin import cli
from kvstore_client import errors
from kvstore_client.cluster import KVStoreCluster
from kvstore_client.keys import Namespace, prefix_hashes

NS = Namespace(model="cluster-identity", page_bytes=4096, page_tokens=4)


@pytest.fixture
def protected(start_node, etcd, tmp_path, request, monkeypatch):
    """Three nodes that accept only the token file's identities; no KVSTORE_* identity in the environment."""
    for variable in ("KVSTORE_TOKEN", "KVSTORE_TLS_CA", "KVSTORE_TLS_CERT", "KVSTORE_TLS_KEY"):
        monkeypatch.delenv(variable, raising=False)
    tokens = Tokens(tmp_path)
    cluster = request.node.name.removeprefix("test_")[:40]
    nodes = {name: start_node(name, cluster=cluster, **{"auth.tokens_file": str(tokens.path)})
             for name in ("n1", "n2", "n3")}
    return f"etcd://{etcd.endpoint}/{cluster}", set(nodes), tokens


def chain(pages: int) -> tuple[list[int], np.ndarray]:
    tokens = list(range(1000, 1000 + 4 * pages))
    return tokens, np.random.default_rng(pages).integers(0, 255, (pages, NS.page_bytes), dtype=np.uint8)


def test_a_cluster_client_with_the_token_reaches_every_node_and_one_without_is_unauthenticated(protected):
    url, nodes, tokens = protected
    ids, data = chain(24)
    keys = prefix_hashes(ids, page_tokens=4)
    with KVStoreCluster(url, replicas=1, token=tokens.alice) as alice:
        wait_members(alice, nodes)
        assert alice.put(NS, keys, data) == 24
        out = np.zeros_like(data)
        assert alice.get(NS, keys, out) == 24 and np.array_equal(out, data)
        assert set(alice.node_stats()) == nodes            # every node answered the token
    with KVStoreCluster(url, replicas=1, timeout_s=5) as anonymous:
        wait_members(anonymous, nodes)
        with pytest.raises(errors.Unauthenticated, match="token"):
            anonymous.lookup(NS, keys)
        with pytest.raises(errors.Unauthenticated):
            anonymous.put(NS, keys, data)
        with pytest.raises(errors.Unauthenticated):
            anonymous.get(NS, keys, np.zeros_like(data))
    with KVStoreCluster(url, replicas=1, token="not-a-token-of-this-cluster") as stranger:
        wait_members(stranger, nodes)
        with pytest.raises(errors.Unauthenticated):
            stranger.lookup(NS, keys)


def test_the_token_comes_from_kvstore_token_for_the_client_and_cluster_status(protected, monkeypatch, capsys):
    url, nodes, tokens = protected
    assert cli.main(["--json", "cluster", "status", url]) == 1
    assert "Unauthenticated" in capsys.readouterr().err
    monkeypatch.setenv("KVSTORE_TOKEN", tokens.alice)
    ids, data = chain(8)
    with KVStoreCluster(url, replicas=1) as alice:
        wait_members(alice, nodes)
        assert alice.put(NS, prefix_hashes(ids, page_tokens=4), data) == 8
    monkeypatch.setenv("KVSTORE_TOKEN", tokens.ops)   # tier totals are every tenant's: an admin's view
    assert cli.main(["--json", "cluster", "status", url]) == 0
    report = json.loads(capsys.readouterr().out)
    assert {m["node_id"] for m in report["members"]} == nodes and all(m["answers"] for m in report["members"])
    assert sum(m["pages"] for m in report["members"]) == 8


def test_tls_files_reach_every_node(start_node, etcd, tmp_path, request, monkeypatch):
    for variable in ("KVSTORE_TOKEN", "KVSTORE_TLS_CA", "KVSTORE_TLS_CERT", "KVSTORE_TLS_KEY"):
        monkeypatch.delenv(variable, raising=False)
    tokens, certs = Tokens(tmp_path), Certificates(tmp_path)
    cluster = request.node.name.removeprefix("test_")[:40]
    nodes = {"n1", "n2", "n3"}
    for name in sorted(nodes):                                     # each node's certificate names its id
        cert, key = certs.issue(f"node-{name}", name, [x509.DNSName(name), x509.IPAddress(ipaddress.ip_address(
            "127.0.0.1"))])
        start_node(name, cluster=cluster, **{"auth.tokens_file": str(tokens.path), "auth.tls_cert": cert,
                                             "auth.tls_key": key})
    url = f"etcd://{etcd.endpoint}/{cluster}"
    ids, data = chain(12)
    keys = prefix_hashes(ids, page_tokens=4)
    monkeypatch.setenv("KVSTORE_TLS_CA", certs.ca)                 # the CA from the environment, the token given
    with KVStoreCluster(url, replicas=1, transport="tcp", token=tokens.alice) as alice:
        wait_members(alice, nodes)
        assert alice.put(NS, keys, data) == 12
        assert alice.lookup(NS, tokens=ids) == 12
        assert set(alice.node_stats()) == nodes


def test_a_node_whose_certificate_does_not_name_its_id_refuses_to_start(etcd, tmp_path):
    certs = Certificates(tmp_path)                                 # its server certificate names localhost only
    args = server_args("shm.enabled=false", f"cluster.endpoints=http://{etcd.endpoint}", "cluster.name=refused",
                       "cluster.node_id=n9", f"auth.tls_cert={certs.server_cert}", f"auth.tls_key={certs.server_key}")
    refused = subprocess.run(args, capture_output=True, text=True, timeout=60)
    assert refused.returncode == 1, refused.stderr
    assert "names localhost, not node id 'n9'" in refused.stderr and "cluster.node_id" in refused.stderr
