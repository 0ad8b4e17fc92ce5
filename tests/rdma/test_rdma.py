"""The RDMA data plane: clear refusals where there is no device; put/get through a device where one exists.

Tests marked `rdma` need an RDMA NIC and pyverbs; they have never run where this was
written (no device, none can be emulated) and are skipped, not passed, without one. They
repeat, on a real NIC, the cases tests/unit/test_rdma_transport.py runs against the verbs
model, so that the first run on hardware exercises them.
"""

import threading

import numpy as np
import pytest

from kvstore_client import KVStoreClient, Namespace, errors, rdma_transport

HAS_DEVICE = rdma_transport.device_present()
# Loopback through the NIC: this host's own addresses are the only peers.
RDMA_NODE = {"rdma.enabled": "true", "rdma.allowed_peers": "0.0.0.0/0,::/0"}
needs_device = [pytest.mark.rdma, pytest.mark.skipif(not HAS_DEVICE, reason="needs an RDMA device and pyverbs")]


@pytest.mark.skipif(HAS_DEVICE, reason="this host has an RDMA device")
def test_rdma_enabled_without_a_device_stops_start_up_naming_why(start_server):
    with pytest.raises(RuntimeError) as failure:
        start_server({"rdma.enabled": "true"})
    assert "rdma.enabled is set but" in str(failure.value)
    assert "python3-pyverbs" in str(failure.value) or "RDMA device" in str(failure.value)   # no, or no usable


def test_asking_for_rdma_from_a_node_without_it_is_a_clear_error(server):
    with pytest.raises(errors.TransportUnavailable, match="does not offer the rdma data plane"):
        KVStoreClient(server.address, transport="rdma")
    with KVStoreClient(server.address) as client:
        assert client.transport == "shm"  # auto never picks what the node does not offer


@pytest.mark.rdma
@pytest.mark.skipif(not HAS_DEVICE, reason="needs an RDMA device and pyverbs")
def test_put_get_through_rdma(start_server):
    server = start_server(RDMA_NODE)
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


def _roundtrip(client, ns, name, count, segments_per_page=1):
    data = np.random.default_rng(count).integers(0, 256, (count, ns.page_bytes), dtype=np.uint8)
    part = ns.page_bytes // segments_per_page
    pages = [[row[i * part:(i + 1) * part] for i in range(segments_per_page)] for row in data]
    keys = [f"{name}{i}" for i in range(count)]
    assert client.put(ns, keys, pages, verify=True) == count
    out = np.zeros_like(data)
    out_pages = [[row[i * part:(i + 1) * part] for i in range(segments_per_page)] for row in out]
    assert client.get(ns, keys, out_pages, verify=True) == count
    assert np.array_equal(out, data)


@pytest.mark.parametrize("count", [129, 410, 1000])
@needs_device[0]
@needs_device[1]
def test_one_call_of_more_pages_than_the_send_queue_holds(start_server, count):
    server = start_server(RDMA_NODE)
    with KVStoreClient(server.address, transport="rdma", timeout_s=30) as client:
        _roundtrip(client, Namespace(model="rdma-big", page_bytes=16384), f"b{count}-", count)


@needs_device[0]
@needs_device[1]
def test_a_thousand_calls_and_a_fresh_buffer_each(start_server):
    server = start_server(RDMA_NODE)
    with KVStoreClient(server.address, transport="rdma", timeout_s=30) as client:
        ns = Namespace(model="rdma-many", page_bytes=65536)
        for i in range(500):
            _roundtrip(client, ns, f"m{i}-", 2)     # new arrays each call: malloc reuses addresses


@needs_device[0]
@needs_device[1]
def test_pages_of_32_segments_and_over_1024_in_one_call(start_server):
    server = start_server(RDMA_NODE)
    with KVStoreClient(server.address, transport="rdma", timeout_s=30) as client:
        _roundtrip(client, Namespace(model="rdma-segs", page_bytes=32768), "s", 80, segments_per_page=32)


@needs_device[0]
@needs_device[1]
def test_two_threads_on_one_client(start_server):
    server = start_server(RDMA_NODE)
    failures = []
    with KVStoreClient(server.address, transport="rdma", timeout_s=30) as client:
        ns = Namespace(model="rdma-threads", page_bytes=65536)

        def work(name):
            try:
                for i in range(50):
                    _roundtrip(client, ns, f"{name}{i}-", 4)
            except Exception as exc:  # reported below
                failures.append(exc)
        threads = [threading.Thread(target=work, args=(n,)) for n in "ab"]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert not failures


@needs_device[0]
@needs_device[1]
def test_queue_pairs_max_one_with_two_clients(start_server):
    server = start_server({**RDMA_NODE, "rdma.queue_pairs_max": "1", "shm.enabled": "false"})
    ns = Namespace(model="rdma-qp", page_bytes=65536)
    with KVStoreClient(server.address, transport="rdma", timeout_s=30) as a, \
            KVStoreClient(server.address, control="grpc", timeout_s=30) as b:
        assert a.transport == "rdma" and b.transport == "tcp"   # refused, not evicting a
        _roundtrip(a, ns, "a", 4)
        _roundtrip(b, ns, "b", 4)
