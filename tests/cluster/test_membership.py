"""Nodes register in a real etcd under a lease: ids are unique, etcd's absence is named, its loss survived."""

from __future__ import annotations

import subprocess
import time

import numpy as np

from cluster_parts import (EtcdProcess, etcd, free_port, node_settings, server_args, start_node,  # noqa: F401
                           wait_logged, wait_members)
from server_process import ServerProcess
from kvstore_client.cluster import KVStoreCluster
from kvstore_client.keys import Namespace, prefix_hashes


def metrics(node: ServerProcess) -> str:
    return node.metrics_text()


def test_second_node_with_the_same_id_refuses_to_start(start_node, etcd):
    first = start_node("dup", cluster="m1")
    second = subprocess.run(server_args("shm.enabled=false", f"cluster.endpoints=http://{etcd.endpoint}",
                                        "cluster.name=m1", "cluster.node_id=dup"),
                            capture_output=True, text=True, timeout=60)
    assert second.returncode == 1, second.stderr
    assert "node id 'dup' is already registered in cluster 'm1'" in second.stderr
    assert first.address in second.stderr          # it names the node that holds the id
    assert first.process.poll() is None             # which serves on


def test_unreachable_etcd_at_start_is_named():
    port = free_port()    # nothing listens there
    result = subprocess.run(server_args("shm.enabled=false", f"cluster.endpoints=http://127.0.0.1:{port}",
                                        "cluster.etcd_timeout_s=1"), capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    assert f"etcd unreachable at 127.0.0.1:{port}" in result.stderr
    assert "(cluster.endpoints)" in result.stderr


def test_node_allowed_to_serve_alone_joins_once_etcd_answers(tmp_path):
    late = EtcdProcess(tmp_path, started=False)     # ports picked now, etcd started after the node
    (tmp_path / "node").mkdir()
    node = ServerProcess(tmp_path / "node", node_settings(late, "alone", "m2", **{"cluster.required": "false"}))
    try:
        assert "serving alone (cluster.required = false)" in node.log()
        late.start()
        with KVStoreCluster(f"etcd://{late.endpoint}/m2", timeout_s=5) as cluster:
            wait_members(cluster, {"alone"})
        wait_logged(node, "answers again")
    finally:
        node.kill()
        late.kill()


def test_etcd_lost_while_serving_nodes_serve_on_and_rejoin(tmp_path):
    own = EtcdProcess(tmp_path)
    nodes = []
    try:
        for name in ("x", "y"):
            (tmp_path / name).mkdir()
            nodes.append(ServerProcess(tmp_path / name, node_settings(own, name, "m3")))
        ns = Namespace(model="m", page_bytes=4096, page_tokens=4)
        keys = prefix_hashes(list(range(4 * 64)), page_tokens=4)
        pages = np.random.default_rng(1).integers(0, 255, (64, 4096), dtype=np.uint8)
        with KVStoreCluster(f"etcd://{own.endpoint}/m3", timeout_s=5, replicas=2) as cluster:
            wait_members(cluster, {"x", "y"})
            assert cluster.put(ns, keys, pages) == 64
            own.kill()
            time.sleep(3)    # past the lease TTL: etcd is gone, nothing expires without it
            out = np.zeros_like(pages)
            assert cluster.get(ns, keys, out) == 64     # placed by the membership last seen
            assert np.array_equal(out, pages)
            assert cluster.etcd_lost
            for node in nodes:
                assert node.process.poll() is None
                wait_logged(node, "serving on with the membership last seen")
                assert "kvstore_cluster_etcd_reachable 0.0" in metrics(node)
            own.start()                                  # same ports and data: the nodes renew or claim again
            wait_members(cluster, {"x", "y"})
            for node in nodes:
                wait_logged(node, "answers again")
                assert "kvstore_cluster_etcd_reachable 1.0" in metrics(node)
            assert cluster.get(ns, keys, out) == 64
    finally:
        for node in nodes:
            node.kill()
        own.kill()
