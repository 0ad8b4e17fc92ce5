"""A node cut off by the network (its own namespace, its link taken down): clients lose only its pages, it serves
on, and it rejoins when the link comes back."""

from __future__ import annotations


import numpy as np
import pytest

from cluster_parts import EtcdProcess, first_page_on, node_settings, wait_logged, wait_members
from server_process import ServerProcess
from netns import NetnsServer, ip, veth_namespace
from kvstore_client.cluster import KVStoreCluster
from kvstore_client.keys import Namespace, prefix_hashes

NS = Namespace(model="partition-test", page_bytes=4096, page_tokens=4)


@pytest.fixture
def netns():
    with veth_namespace() as namespace:
        yield namespace.name, namespace.host_link, namespace.host_ip, namespace.ns_ip


def test_partitioned_node_costs_only_its_pages_and_rejoins(tmp_path, netns):
    name, host_link, host_ip, ns_ip = netns
    etcd = EtcdProcess(tmp_path, host=host_ip)
    nodes = []
    try:
        for node_id in ("a", "b"):
            (tmp_path / node_id).mkdir()
            nodes.append(ServerProcess(tmp_path / node_id, node_settings(etcd, node_id, "part")))
        (tmp_path / "cut").mkdir()
        remote = {"server.grpc_address": f"{ns_ip}:0", "tcp.address": f"{ns_ip}:0", "shm.enabled": "false",
                  "cluster.host_id": "another-host", "auth.allow_unauthenticated_remote": "true"}
        cut = NetnsServer(tmp_path / "cut", {**node_settings(etcd, "cut", "part"), **remote}, name)
        nodes.append(cut)
        chains = [prefix_hashes(list(range(seed, seed + 4 * 16)), page_tokens=4) for seed in range(0, 3000, 100)]
        pages = np.random.default_rng(5).integers(0, 255, (16, 4096), dtype=np.uint8)
        with KVStoreCluster(f"etcd://{etcd.endpoint}/part", replicas=1, timeout_s=3) as cluster:
            wait_members(cluster, {"a", "b", "cut"})
            assert cluster.members()[-1].grpc_address.startswith(ns_ip)
            for keys in chains:
                assert cluster.put(NS, keys, pages) == 16
            survives = [first_page_on(cluster, k, "cut") for k in chains]
            assert 0 < sum(survives) < 16 * len(chains)

            ip("link", "set", host_link, "down")            # the partition
            for keys, kept in zip(chains, survives):        # before and after its lease expires: misses only
                assert cluster.lookup(NS, keys) >= kept
            wait_members(cluster, {"a", "b"})
            for keys, kept in zip(chains, survives):
                out = np.zeros_like(pages)
                assert cluster.get(NS, keys, out) == kept
                assert np.array_equal(out[:kept], pages[:kept])
            assert cut.process.poll() is None
            wait_logged(cut, "serving on with the membership last seen")

            ip("link", "set", host_link, "up")               # healed: the node claims its id again
            wait_members(cluster, {"a", "b", "cut"})
            wait_logged(cut, "answers again")
            assert sum(cluster.lookup(NS, keys) for keys in chains) == 16 * len(chains)   # its pages are back
    finally:
        for node in nodes:
            node.kill()
        etcd.kill()
