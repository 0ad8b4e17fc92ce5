"""Nodes the clients can trust: etcd over TLS with client certificates, member records signed by each node under a
certificate of the cluster's CA naming its id, and a node that restores its own record.

The attacker here holds an etcd client certificate (an operator's tool, a leaked certificate): it can write any
record. What it writes cannot prove itself, so no token, no page and no placement goes to it; and a node whose
record it overwrites or deletes puts its own back within one lease TTL.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import logging
import socket
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from cryptography import x509

from cluster_parts import EtcdProcess, EtcdTls, node_settings, wait_members
from server_process import ServerProcess
from identities import Certificates, Tokens
from kvstore.admin import cli, cluster_certs
from kvstore_client import KVStoreClient, Namespace, prefix_hashes
from kvstore_client.credentials import EtcdTlsFiles
from kvstore_client.etcd import EtcdSession, EtcdUnavailable
from kvstore_client.membership import Member, node_key
from kvstore_client.record_trust import RecordTrust, sign

NS = Namespace(model="trust-test", page_bytes=4096, page_tokens=4)
LOCALHOST = x509.IPAddress(ipaddress.ip_address("127.0.0.1"))
NODES = ("n1", "n2", "n3")


class Listener:
    """An attacker's endpoint: counts the connections and bytes anything sends it."""

    def __init__(self):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.connections, self.received = 0, b""
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            conn.settimeout(2)
            try:
                while chunk := conn.recv(65536):
                    self.received += chunk
            except OSError:
                pass
            conn.close()


@dataclasses.dataclass
class Trusted:
    etcd: EtcdProcess
    certs: Path                      # what `kvstore cluster certs` wrote
    tokens: Tokens
    nodes: dict
    url: str
    etcd_files: EtcdTlsFiles

    @property
    def ca(self) -> str:
        return str(self.certs / "ca.pem")

    def client(self, **more):
        return KVStoreClient(self.url, token=self.tokens.alice, tls_ca=self.ca, etcd_tls_ca=self.ca,
                             etcd_tls_cert=self.etcd_files.cert, etcd_tls_key=self.etcd_files.key, **more)

    def session(self) -> EtcdSession:
        """What the attacker writes with: a valid etcd client certificate."""
        return EtcdSession([self.etcd.url], timeout_s=3, tls=self.etcd_files)

    def record(self, node_id: str) -> Member | None:
        session = self.session()
        try:
            found = session.call(lambda client: client.get(node_key(CLUSTER, node_id)))
        finally:
            session.close()
        return Member.decode(found.value) if found is not None else None

    def write(self, member: Member) -> None:
        session = self.session()
        try:
            session.call(lambda client: client.put(node_key(CLUSTER, member.node_id), member.encode()))
        finally:
            session.close()


CLUSTER = "trusted"


@pytest.fixture
def trusted(tmp_path, monkeypatch):
    """etcd and three nodes set up as deploy/README.md shows: `kvstore cluster certs`, then the files it wrote."""
    for variable in ("KVSTORE_TOKEN", "KVSTORE_TLS_CA", "KVSTORE_TLS_CERT", "KVSTORE_TLS_KEY"):
        monkeypatch.delenv(variable, raising=False)
    certs = tmp_path / "certs"
    assert cli.main(["cluster", "certs", str(certs), "--nodes", ",".join(NODES), "--node-names", "127.0.0.1"]) == 0
    tokens = Tokens(tmp_path)
    files = EtcdTlsFiles(str(certs / "ca.pem"), str(certs / "etcd-client.pem"), str(certs / "etcd-client.key"))
    etcd = EtcdProcess(tmp_path, tls=EtcdTls(files.ca, str(certs / "etcd.pem"), str(certs / "etcd.key"), files.cert,
                                             files.key))
    nodes = {}
    try:
        for node_id in NODES:
            workdir = tmp_path / node_id
            workdir.mkdir()
            nodes[node_id] = ServerProcess(workdir, node_settings(etcd, node_id, CLUSTER, **{
                "auth.tokens_file": str(tokens.path), "auth.tls_cert": str(certs / f"node-{node_id}.pem"),
                "auth.tls_key": str(certs / f"node-{node_id}.key")}))
        yield Trusted(etcd, certs, tokens, nodes, f"etcd://{etcd.endpoint}/{CLUSTER}", files)
    finally:
        for node in nodes.values():
            node.kill()
        etcd.kill()


def chain(seed: int, pages: int):
    tokens = list(range(seed, seed + 4 * pages))
    return prefix_hashes(tokens, page_tokens=4), np.random.default_rng(seed).integers(0, 255, (pages, 4096), np.uint8)


def test_nodes_and_clients_reach_an_etcd_that_takes_certificates_only(trusted):
    with trusted.client() as pool:
        wait_members(pool, set(NODES))
        keys, data = chain(1, 40)
        assert pool.put(NS, keys, data) == 40
        out = np.zeros_like(data)
        assert pool.get(NS, keys, out) == 40 and np.array_equal(out, data)
    for record in map(trusted.record, NODES):
        assert not RecordTrust(trusted.ca).problem(record)      # each node signed its own record
    bare = EtcdSession([trusted.etcd.endpoint], timeout_s=1)          # no TLS: etcd does not answer it
    try:
        with pytest.raises(EtcdUnavailable):
            bare.call(lambda client: client.get(node_key(CLUSTER, "n1")))
    finally:
        bare.close()


def test_rogue_registrations_get_no_token_no_page_and_no_placement(trusted, tmp_path, caplog):
    listener = Listener()
    (tmp_path / "other").mkdir()
    other_ca = Certificates(tmp_path / "other")
    rogue_cert, rogue_key = other_ca.issue("rogue", "rogue", [x509.DNSName("rogue-signed"), LOCALHOST])
    cluster_certs.issue(trusted.certs, cluster_certs.load_or_make_ca(trusted.certs, 1), "forged", "n1", ["n1"], 1)
    forged_cert, forged_key = trusted.certs / "forged.pem", trusted.certs / "forged.key"
    pib = 1 << 50
    unsigned = Member(node_id="rogue", host_id="elsewhere", state="serving", grpc_address=listener.address,
                      tcp_endpoint=listener.address, capacity_bytes=pib)
    trusted.write(unsigned)
    with open(rogue_cert, "rb") as c, open(rogue_key, "rb") as k:       # signed, by another CA
        trusted.write(sign(dataclasses.replace(unsigned, node_id="rogue-signed"), c.read(), k.read()))
    with open(forged_cert, "rb") as c, open(forged_key, "rb") as k:     # the cluster's CA, but for another id
        trusted.write(sign(dataclasses.replace(unsigned, node_id="forged"), c.read(), k.read()))

    with caplog.at_level(logging.WARNING, logger="kvstore_client.membership"), trusted.client() as pool:
        wait_members(pool, set(NODES))                                  # the three real nodes only
        for seed in range(10):
            keys, data = chain(100 + seed * 1000, 24)
            assert pool.put(NS, keys, data) == 24
            assert pool.lookup(NS, keys) == 24
    assert listener.connections == 0 and listener.received == b""
    ignored = " ".join(r.getMessage() for r in caplog.records)
    assert "rogue" in ignored and "not signed" in ignored
    assert "rogue-signed" in ignored and "not issued by the cluster's CA" in ignored
    assert "forged" in ignored and "does not name node id 'forged'" in ignored


def test_an_overwritten_or_deleted_record_is_never_followed_and_comes_back_within_one_lease_ttl(trusted):
    listener = Listener()
    ttl_s = 2
    with trusted.client() as pool:
        wait_members(pool, set(NODES))
        real = trusted.record("n2")
        trusted.write(dataclasses.replace(real, grpc_address=listener.address, tcp_endpoint=listener.address,
                                          signature=real.signature))   # n2's signed record, its address changed
        written = time.monotonic()
        for seed in range(6):
            keys, data = chain(5000 + seed * 1000, 24)
            assert pool.put(NS, keys, data) == 24
        while trusted.record("n2").grpc_address != real.grpc_address:
            assert time.monotonic() - written < ttl_s, "n2 did not restore its record within one lease TTL"
            time.sleep(0.05)
        assert not RecordTrust(trusted.ca).problem(trusted.record("n2"))

        session = trusted.session()
        try:
            session.call(lambda client: client.delete(node_key(CLUSTER, "n3")))
        finally:
            session.close()
        deleted = time.monotonic()
        while trusted.record("n3") is None:
            assert time.monotonic() - deleted < ttl_s, "n3 did not restore its record within one lease TTL"
            time.sleep(0.05)
        keys, data = chain(9000, 24)
        assert pool.put(NS, keys, data) == 24 and pool.get(NS, keys, np.zeros_like(data)) == 24
    assert listener.connections == 0 and listener.received == b""
