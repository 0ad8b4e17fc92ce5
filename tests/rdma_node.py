"""Fixtures for an in-process node on loopback (gRPC and TCP real, shared memory and NVMe off) whose RDMA
server and the client's RDMA path share one verbs model (kvstore_client/verbs_model.py): RDMA without a NIC."""

import pytest

from kvstore import config
from kvstore.server import Node
from kvstore.transport.rdma import RdmaServer
from kvstore_client import rdma_transport
from kvstore_client.verbs_model import VerbsModel


@pytest.fixture
def node():
    cfg = config.load(environ={}, overrides=[
        "server.grpc_address=127.0.0.1:0", "shm.enabled=false", "nvme.enabled=false", "ops.metrics_address=",
        "dram.arena_bytes=16MiB", "dram.slab_bytes=1MiB", "server.drain_timeout_s=1"])
    node = Node(cfg)
    node.start()
    yield node
    node.drain_and_stop()
    if node.service.rdma is not None:
        node.service.rdma.close()


@pytest.fixture
def model(node, monkeypatch):
    model = VerbsModel()
    node.service.rdma = RdmaServer("", 1, -1, 8, node.arena.view, allowed_peers=("10.0.0.0/8",), verbs=model)
    monkeypatch.setattr(rdma_transport, "default_verbs", lambda: model)
    return model
