"""Which data plane a cluster client picks for each node: shared memory on its host, RDMA where the node
advertises it and the client was given RdmaOptions, else TCP; a node whose RDMA cannot start is reached over TCP.

No NIC here: the node's RDMA side and the client's share one verbs model (kvstore_client/verbs_model.py; the
fixtures are tests/rdma_node.py's, as in tests/rdma/test_rdma_fallback.py). etcd is real; the member records point at one in-process node with
shared memory off (standing for a node on another host) and are written by hand, so a record can say RDMA.
Both records are that one node, so each page has one copy (replicas=1) and is put on its own: two copies, or two
pieces of one chain anchored at each other, would be two writers racing on one node, which two nodes never are.
"""

import time

import numpy as np
import pytest

from cluster_parts import etcd  # noqa: F401  (fixture)
from kvstore_client import Namespace
from kvstore_client.cluster import KVStoreCluster, data_plane
from kvstore_client.etcd import EtcdSession
from kvstore_client.membership import Member, node_key
from kvstore_client.rdma_transport import RdmaOptions
from rdma_node import model, node  # noqa: F401  (fixtures)

PAGE = 4096
HERE, THERE = "this-host", "another-host"


def member(host_id, rdma):
    return Member(node_id="n", host_id=host_id, state="serving", rdma=rdma)


@pytest.mark.parametrize("host_id, advertises, rdma_given, transport, plane", [
    (HERE, True, True, "auto", "shm"),        # on this host shared memory wins over any NIC
    (THERE, True, True, "auto", "rdma"),
    (THERE, True, False, "auto", "tcp"),      # no RdmaOptions: the client was not told to use a NIC
    (THERE, False, True, "auto", "tcp"),      # the node has no RDMA endpoint
    (THERE, True, True, "tcp", "tcp"),        # transport="tcp": TCP to every node
    (HERE, False, False, "tcp", "tcp"),
])
def test_the_plane_each_node_gets(host_id, advertises, rdma_given, transport, plane):
    assert data_plane(member(host_id, advertises), HERE, transport, rdma_given) == plane


@pytest.fixture
def members(etcd, node, request):  # noqa: F811
    """Two records of another host: one advertising RDMA, one not; both reach the in-process node."""
    cluster = f"rdma-{request.node.name[-40:].replace('[', '-').replace(']', '')}"
    session = EtcdSession([etcd.endpoint], timeout_s=3)
    try:
        for node_id, rdma in (("with-rdma", True), ("tcp-only", False)):
            record = Member(node_id=node_id, host_id=THERE, state="serving", grpc_address=node.grpc_address,
                            tcp_endpoint=node.service.tcp_endpoint,
                            rdma=rdma, serving_since=time.time() - 60)
            session.call(lambda client, k=node_key(cluster, node_id), v=record.encode(): client.put(k, v))
    finally:
        session.close()
    return f"etcd://{etcd.endpoint}/{cluster}"


def roundtrip(cluster, name, count=32):
    ns = Namespace(model="cluster-rdma", page_bytes=PAGE)
    data = np.random.default_rng(len(name)).integers(0, 256, (count, PAGE), dtype=np.uint8)
    keys = [f"{name}{i}".encode() for i in range(count)]
    assert all(cluster.put(ns, [key], page[None]) == 1 for key, page in zip(keys, data))
    out = np.zeros_like(data)
    assert cluster.get(ns, keys, out) == count
    assert np.array_equal(out, data)


def opened(cluster):
    """Each member's client opened once, one per member (stats asks every member), before pages move."""
    assert set(cluster.node_stats()) == {"with-rdma", "tcp-only"}
    return cluster


def planes(cluster):
    return {node_id: client.transport for node_id, (_, client) in cluster._nodes.items()}


def test_a_node_advertising_rdma_is_reached_over_it_when_rdma_options_are_given(members, model):
    with KVStoreCluster(members, rdma=RdmaOptions(), replicas=1, timeout_s=2) as cluster:
        opened(cluster)
        roundtrip(cluster, "r")
        assert planes(cluster) == {"with-rdma": "rdma", "tcp-only": "tcp"}
    with KVStoreCluster(members, replicas=1, timeout_s=2) as cluster:   # no RdmaOptions
        opened(cluster)
        roundtrip(cluster, "t")
        assert planes(cluster) == {"with-rdma": "tcp", "tcp-only": "tcp"}


@pytest.mark.parametrize("failure", ["device open fails", "port down", "queue pair creation fails", "peer not allowed"])
def test_a_failed_rdma_setup_falls_back_to_tcp(members, node, model, failure):
    {"device open fails": lambda: model.fail_call("open"),
     "port down": lambda: setattr(model, "ports_active", False),
     "queue pair creation fails": lambda: model.fail_call("create_queue_pair"),
     "peer not allowed": lambda: setattr(node.service.rdma, "allowed_peers", ("192.168.0.0/16",))}[failure]()
    with KVStoreCluster(members, rdma=RdmaOptions(), replicas=1, timeout_s=2) as cluster:
        opened(cluster)
        roundtrip(cluster, "f")
        assert planes(cluster) == {"with-rdma": "tcp", "tcp-only": "tcp"}


def test_rdma_lost_mid_session_moves_the_node_to_tcp(members, model):
    with KVStoreCluster(members, rdma=RdmaOptions(), replicas=1, timeout_s=2) as cluster:
        opened(cluster)
        roundtrip(cluster, "before")
        assert planes(cluster)["with-rdma"] == "rdma"
        model.ports_active = False                   # the fabric goes; RDMA cannot be opened again
        ns = Namespace(model="cluster-rdma", page_bytes=PAGE)
        caught = cluster.put(ns, [f"caught{i}".encode() for i in range(32)], np.ones((32, PAGE), np.uint8))
        assert 0 <= caught <= 32                     # pages in flight on the lost path are misses, not errors
        roundtrip(cluster, "after")
        assert planes(cluster) == {"with-rdma": "tcp", "tcp-only": "tcp"}
