"""The RDMA data plane: clear refusals where there is no device; put/get through a device where one exists.

Tests marked `rdma` need an RDMA NIC and pyverbs; they have never run where this was
written (no device, none can be emulated) and are skipped, not passed, without one.
"""

import numpy as np
import pytest

from kvstore_client import KVStoreClient, Namespace, errors, rdma_transport

HAS_DEVICE = rdma_transport.device_present()


@pytest.mark.skipif(HAS_DEVICE, reason="this host has an RDMA device")
def test_rdma_enabled_without_a_device_stops_start_up_naming_why(start_server):
    with pytest.raises(RuntimeError) as failure:
        start_server({"rdma.enabled": "true"})
    assert "rdma.enabled is set but" in str(failure.value)
    assert "python3-pyverbs" in str(failure.value) or "no RDMA device" in str(failure.value)


def test_asking_for_rdma_from_a_node_without_it_is_a_clear_error(server):
    with pytest.raises(errors.TransportUnavailable, match="does not offer the rdma data plane"):
        KVStoreClient(server.address, transport="rdma")
    with KVStoreClient(server.address) as client:
        assert client.transport == "shm"  # auto never picks what the node does not offer


@pytest.mark.rdma
@pytest.mark.skipif(not HAS_DEVICE, reason="needs an RDMA device and pyverbs")
def test_put_get_through_rdma(start_server):
    server = start_server({"rdma.enabled": "true"})
    ns = Namespace(model="rdma", page_bytes=1 << 20)
    data = np.random.default_rng(2).integers(0, 256, (16, 1 << 20), dtype=np.uint8)
    with KVStoreClient(server.address, transport="rdma", timeout_s=30) as client:
        assert client.transport == "rdma"
        keys = [f"r{i}" for i in range(16)]
        assert client.put(ns, keys, data, verify=True) == 16
        out = np.zeros_like(data)
        assert client.get(ns, keys, out, verify=True) == 16
        assert np.array_equal(out, data)
        assert client.stats().leases_open == 0
