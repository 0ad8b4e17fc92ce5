"""Cluster test parts: a real etcd (the `etcd` binary, data in a temp dir) and kvstore nodes registered in it.

Test modules import the fixtures by name (`from cluster_parts import etcd, start_node`); an engine's
tests take `cluster_pool` (three nodes) to run its adapter against a cluster.
"""

from __future__ import annotations

import dataclasses
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Iterator

import pytest

from server_process import ServerProcess  # a real kvstore-server child
from system_tools import require_tool
from kvstore_client.cluster import KVStoreCluster


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclasses.dataclass(frozen=True)
class EtcdTls:
    """TLS files of an etcd that takes clients with certificates only (--client-cert-auth)."""

    ca: str
    server_cert: str
    server_key: str
    client_cert: str     # what nodes and clients present
    client_key: str


class EtcdProcess:
    """One etcd member on 127.0.0.1; restartable on the same ports and data dir. With `tls`, clients must
    speak TLS and present a certificate of its CA."""

    def __init__(self, workdir: Path, host: str = "127.0.0.1", started: bool = True, tls: EtcdTls | None = None):
        require_tool("etcd")
        self.workdir = workdir
        self.host = host
        self.tls = tls
        self.client_port, self.peer_port = free_port(), free_port()
        self.endpoint = f"{host}:{self.client_port}"
        self.url = f"{'https' if tls else 'http'}://{self.endpoint}"
        self.log_path = workdir / "etcd.log"
        self.process: subprocess.Popen | None = None
        if started:
            self.start()

    def start(self) -> None:
        client_url, peer_url = self.url, f"http://{self.host}:{self.peer_port}"
        args = ["etcd", "--name", "test", "--data-dir", str(self.workdir / "data"),
                "--listen-client-urls", client_url, "--advertise-client-urls", client_url,
                "--listen-peer-urls", peer_url, "--initial-advertise-peer-urls", peer_url,
                "--initial-cluster", f"test={peer_url}", "--log-level", "warn"]
        context = None
        if self.tls is not None:
            args += ["--cert-file", self.tls.server_cert, "--key-file", self.tls.server_key,
                     "--client-cert-auth", "--trusted-ca-file", self.tls.ca]
            import ssl
            context = ssl.create_default_context(cafile=self.tls.ca)
            context.load_cert_chain(self.tls.client_cert, self.tls.client_key)
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 20
        while True:
            try:
                with urllib.request.urlopen(f"{client_url}/health", timeout=1, context=context) as answer:
                    if b"true" in answer.read():
                        return
            except OSError:
                pass
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"etcd did not start:\n{self.log_path.read_text(errors='replace')}")
            time.sleep(0.1)

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(10)


@pytest.fixture(scope="module")
def etcd(tmp_path_factory) -> Iterator[EtcdProcess]:
    server = EtcdProcess(tmp_path_factory.mktemp("etcd"))
    yield server
    server.kill()


def node_settings(etcd: EtcdProcess, node_id: str, cluster: str, **extra: object) -> dict[str, object]:
    settings: dict[str, object] = {"cluster.endpoints": etcd.url, "cluster.name": cluster, "cluster.node_id": node_id,
                                   "cluster.lease_ttl_s": 2, "cluster.ramp_s": 0, "cluster.etcd_timeout_s": 1}
    if etcd.tls is not None:
        settings.update({"cluster.etcd_tls_ca": etcd.tls.ca, "cluster.etcd_tls_cert": etcd.tls.client_cert,
                         "cluster.etcd_tls_key": etcd.tls.client_key})
    return {**settings, **extra}


@pytest.fixture
def start_node(tmp_path: Path, etcd: EtcdProcess) -> Iterator:
    """Factory: start_node("a", cluster="c1") -> a ServerProcess registered in the module's etcd."""
    started: list[ServerProcess] = []

    def start(node_id: str, cluster: str, **extra: object) -> ServerProcess:
        workdir = tmp_path / f"node-{node_id}-{len(started)}"
        workdir.mkdir()
        node = ServerProcess(workdir, node_settings(etcd, node_id, cluster, **extra))
        started.append(node)
        return node

    yield start
    for node in started:
        node.kill()


@dataclasses.dataclass
class Pool:
    """Three nodes in a cluster of their own: `address` is its URL, where a test of one node passes
    server.address, so an engine's adapter is configured against the cluster the same way."""

    address: str
    nodes: dict[str, ServerProcess]


@pytest.fixture
def cluster_pool(start_node, etcd, request) -> Pool:
    cluster = "pool-" + request.node.name.removeprefix("test_")[:40]
    nodes = {name: start_node(name, cluster=cluster) for name in ("p1", "p2", "p3")}
    pool = Pool(f"etcd://{etcd.endpoint}/{cluster}", nodes)
    with KVStoreCluster(pool.address) as watcher:
        wait_members(watcher, set(nodes))
    return pool


def only_on(pool: Pool, keys: list, node_id: str, chain_start: bool = True) -> list[bool]:
    """held_only_on, as a client of the pool with the default replicas places the keys."""
    with KVStoreCluster(pool.address) as placer:
        return held_only_on(placer, keys, node_id, chain_start)


def wait_members(cluster: KVStoreCluster, serving: set[str], timeout_s: float = 15.0) -> None:
    """Until the client's view holds exactly these serving nodes."""
    deadline = time.monotonic() + timeout_s
    while True:
        seen = {m.node_id for m in cluster.members() if m.state == "serving"}
        if seen == serving:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"membership {seen} never became {serving}")
        time.sleep(0.05)


def held_only_on(cluster: KVStoreCluster, keys: list, node_id: str, chain_start: bool = False) -> list[bool]:
    """Whether each key's page is stored on `node_id` alone (lost with it), as a put of these keys through
    `cluster` placed them (chain_start: the put named no parent, so its leading pages have replicas)."""
    from kvstore_client.keys import encode_keys
    return [nodes == (node_id,) for nodes in cluster._place(encode_keys(keys), chain_start=chain_start)]


def first_page_on(cluster: KVStoreCluster, keys: list, node_id: str) -> int:
    """Where a chain's leading run ends once `node_id` is lost: its first page held there alone (replicas=1)."""
    return next((i for i, alone in enumerate(held_only_on(cluster, keys, node_id)) if alone), len(keys))


def server_args(*settings: str) -> list[str]:
    """kvstore-server's command line for a node run by hand, with small pools and no NVMe."""
    import sys
    args = [sys.executable, "-m", "kvstore.server", "--grpc-address", "127.0.0.1:0"]
    for item in ("dram.arena_bytes=8MiB", "dram.slab_bytes=4MiB", "nvme.enabled=false",
                 "ops.metrics_address=127.0.0.1:0", *settings):
        args += ["--set", item]
    return args


def wait_logged(node: ServerProcess, text: str, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while text not in node.log():
        if time.monotonic() > deadline:
            raise AssertionError(f"{text!r} never logged:\n{node.log()[-3000:]}")
        time.sleep(0.05)
