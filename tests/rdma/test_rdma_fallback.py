"""transport="auto" falls back to TCP on every RDMA failure the verbs model produces, at connect and mid-session.

Runs anywhere: an in-process node on loopback (gRPC and TCP real, shared memory off) whose
RDMA server and the client's RDMA path share one verbs model (kvstore_client/verbs_model.py).
"""

import numpy as np
import pytest

from kvstore.transport.rdma import RdmaServer
from kvstore_client import KVStoreClient, Namespace, errors, rdma_transport
from rdma_node import model, node  # noqa: F401  (fixtures)

PAGE = 4096


def roundtrip(client, name, count=8):
    ns = Namespace(model="fallback", page_bytes=PAGE)
    data = np.random.default_rng(len(name)).integers(0, 256, (count, PAGE), dtype=np.uint8)
    ks = [f"{name}{i}" for i in range(count)]
    assert client.put(ns, ks, data, verify=True) == count
    out = np.zeros_like(data)
    assert client.get(ns, ks, out, verify=True) == count
    assert np.array_equal(out, data)


def test_rdma_is_used_when_it_works(node, model):
    with KVStoreClient(node.grpc_address, control="grpc") as client:
        assert client.transport == "rdma"
        roundtrip(client, "ok")
        assert node.service.rdma.queue_pairs() == 1
    assert node.service.rdma.queue_pairs() == 0   # RdmaDisconnect gave the node's queue pair back


def test_a_write_lease_ended_uncommitted_fences_its_queue_pair(node, model):
    """A late RDMA write of an aborted (or expired) lease must not land in a slot handed out again."""
    from kvstore_client.proto import pb

    with KVStoreClient(node.grpc_address, control="grpc") as client:
        ns = Namespace(model="fence", page_bytes=PAGE)
        client.lookup(ns, keys=[b"k"])                     # opens the namespace
        [qp_num] = node.service.rdma._peers              # the node's queue pair of this client
        ns_id = next(iter(node.store.namespaces))
        reserved = node.service.reserve(pb.ReserveRequest(namespace_id=ns_id, keys=[b"late"], page_bytes=PAGE,
                                                          rdma_qp_num=qp_num), None)
        assert node.store.leases.get(reserved.lease_id).rdma_qp_num == qp_num
        node.service.abort(pb.AbortRequest(lease_id=reserved.lease_id), None)
        assert model.queue_pairs[qp_num].state == "ERR", "the aborted lease's queue pair can still write"
        with pytest.raises(errors.Unavailable):           # the call that meets the fence fails, typed
            roundtrip(client, "at-fence")
        roundtrip(client, "after-fence")                  # and the next one reconnects


def _no_pyverbs():
    raise ImportError("RDMA needs pyverbs from rdma-core: apt install python3-pyverbs (not on PyPI)")


FAILURES = {
    "pyverbs missing": lambda node, model, mp: mp.setattr(rdma_transport, "default_verbs", _no_pyverbs),
    "device open fails": lambda node, model, mp: model.fail_call("open"),
    "port down": lambda node, model, mp: setattr(model, "ports_active", False),
    "queue pair creation fails": lambda node, model, mp: model.fail_call("create_queue_pair"),
    "registration fails": lambda node, model, mp: model.fail_call("register"),
    "the node's connect fails": lambda node, model, mp: model.fail_call("connect"),
    "the probe READ fails": lambda node, model, mp: model.fail_after(1),
    "the NIC never completes": lambda node, model, mp: setattr(model, "wrs_per_poll", 0),
    "peer not allowed": lambda node, model, mp: setattr(node.service.rdma, "allowed_peers", ("192.168.0.0/16",)),
    "node Internal": lambda node, model, mp: mp.setattr(node.service.rdma, "accept", _internal),
    "a RoCE v1 GID across a router": lambda node, model, mp: (
        setattr(model, "routers", 1), mp.setattr(rdma_transport, "choose_gid", lambda port, index: port.gids[0])),
}


def _internal(remote, owner=None):
    raise RuntimeError("a bug in the node")


@pytest.mark.parametrize("failure", sorted(FAILURES))
def test_auto_falls_back_to_tcp_when_rdma_cannot_start(node, model, monkeypatch, failure):
    FAILURES[failure](node, model, monkeypatch)
    with KVStoreClient(node.grpc_address, control="grpc", timeout_s=1.0) as client:
        assert client.transport == "tcp"
        roundtrip(client, "fb")
    model.wrs_per_poll, model.ports_active, model.routers = 4, True, 0


def test_asking_for_rdma_names_the_failure(node, model):
    model.fail_after(1)
    with pytest.raises(errors.TransportUnavailable, match="probe"):
        KVStoreClient(node.grpc_address, control="grpc", transport="rdma")


@pytest.mark.parametrize("failure", ["qp error", "port down"])
def test_a_failure_mid_session_moves_the_client_to_tcp(node, model, failure):
    with KVStoreClient(node.grpc_address, control="grpc", timeout_s=1.0) as client:
        roundtrip(client, "before")
        assert client.transport == "rdma"
        ns = Namespace(model="fallback", page_bytes=PAGE)
        out = np.zeros((8, PAGE), np.uint8)
        model.ports_active = False          # the fabric goes (a single failed WR and a dead link alike)
        if failure == "qp error":
            model.ports_active = True
            model.fail_after(1)
            model.fail_call("open")          # ... and RDMA cannot be opened again
        # get is retried once on a new connection: RDMA fails its probe there, TCP serves it
        assert client.get(ns, [f"before{i}" for i in range(8)], out, verify=True) == 8
        assert client.transport == "tcp"
        roundtrip(client, "after")


def test_device_port_gid_and_traffic_class_are_the_clients_to_choose(node, model):
    options = rdma_transport.RdmaOptions(device="mlx5_0", port=1, gid_index=1, traffic_class=106, service_level=3)
    node.service.rdma.allowed_peers = ("10.0.0.0/8", "fe80::/10")
    with KVStoreClient(node.grpc_address, control="grpc", rdma=options) as client:
        assert client.transport == "rdma"
        roundtrip(client, "opts")
        route = client._conn.data._qp.route
        assert (route.gid_index, route.traffic_class, route.service_level, route.hop_limit) == (1, 106, 3, 64)


def test_a_registered_buffer_is_used_across_reconnects(node, model):
    pool = np.random.default_rng(7).integers(0, 256, (16, PAGE), dtype=np.uint8)
    ns = Namespace(model="fallback", page_bytes=PAGE)
    with KVStoreClient(node.grpc_address, control="grpc", timeout_s=1.0) as client:
        client.register_buffer(pool.ctypes.data, pool.nbytes, pool)
        before = model.calls["register"]
        assert client.put(ns, [f"pool{i}" for i in range(16)], pool, verify=True) == 16
        assert model.calls["register"] == before          # inside the registered pool: nothing per call
        client._conn.data._broken = "test: lost"           # the path breaks; the next call reconnects
        out = np.zeros_like(pool)
        assert client.get(ns, [f"pool{i}" for i in range(16)], out, verify=True) == 16
        assert client.transport == "rdma" and np.array_equal(out, pool)
        assert client._conn.data._registered.find(pool.ctypes.data, pool.nbytes) is not None


def test_the_nodes_rdma_restarting_mid_session_costs_one_reconnect(node, model):
    with KVStoreClient(node.grpc_address, control="grpc", timeout_s=1.0) as client:
        roundtrip(client, "r1")
        old = node.service.rdma                  # the node's RDMA side goes and comes back (new QPs, new rkey)
        node.service.rdma = RdmaServer("", 1, -1, 8, node.arena.view, allowed_peers=("10.0.0.0/8",), verbs=model)
        old.close()
        ns = Namespace(model="fallback", page_bytes=PAGE)
        out = np.zeros((8, PAGE), np.uint8)
        assert client.get(ns, [f"r1{i}" for i in range(8)], out, verify=True) == 8   # retried on a new connection
        assert client.transport == "rdma"
        roundtrip(client, "r2")


def test_gid_types_are_exchanged_and_a_mismatch_is_refused_by_name(node, model):
    """A RoCE v1 client and a RoCE v2 node would connect and then time out on every WR."""
    v1_gid = 2                                    # the model lists mlx5's order: index 2 is RoCE v1, IPv4-mapped
    with pytest.raises(errors.TransportUnavailable, match="GIDs of one type"):
        KVStoreClient(node.grpc_address, control="grpc", transport="rdma",
                      rdma=rdma_transport.RdmaOptions(gid_index=v1_gid))
    assert node.service.rdma.queue_pairs() == 0
    with KVStoreClient(node.grpc_address, control="grpc", rdma=rdma_transport.RdmaOptions(gid_index=v1_gid)) as client:
        assert client.transport == "tcp"          # auto falls back
        roundtrip(client, "v1")
