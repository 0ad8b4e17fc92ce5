"""Pages moved over the TCP data plane of a real kvstore-server come back byte for byte, for many clients at once."""

import threading
import time

import numpy as np
import pytest

from kvstore_client import KVStoreClient, Namespace

PAGE = 256 << 10


def pages(n, seed=0, page=PAGE):
    return np.random.default_rng(seed).integers(0, 256, (n, page), dtype=np.uint8)


@pytest.fixture
def tcp_client(server):
    with KVStoreClient(server.address, transport="tcp", timeout_s=20) as c:
        assert c.transport == "tcp"
        yield c


def test_put_get_over_tcp_with_checksums_both_ways(tcp_client):
    ns = Namespace(model="tcp", page_bytes=PAGE)
    keys = [f"t{i}" for i in range(100)]  # several reserve groups and commit runs
    data = pages(100)
    assert tcp_client.put(ns, keys, data, verify=True) == 100
    assert tcp_client.lookup(ns, keys) == 100
    out = np.zeros_like(data)
    assert tcp_client.get(ns, keys, out, verify=True) == 100
    assert np.array_equal(out, data)
    deadline = time.monotonic() + 10   # the get's Release is posted, not waited for (pipeline.py)
    while tcp_client.stats().leases_open and time.monotonic() < deadline:
        time.sleep(0.02)
    assert tcp_client.stats().leases_open == 0


def test_tcp_and_shm_clients_see_the_same_pages(server, tcp_client):
    ns = Namespace(model="mixed", page_bytes=PAGE)
    data = pages(6, seed=3)
    with KVStoreClient(server.address) as shm_client:
        assert shm_client.transport == "shm"
        assert tcp_client.put(ns, ["m0", "m1", "m2"], data[:3]) == 3
        assert shm_client.put(ns, ["m3", "m4", "m5"], data[3:], parent="m2") == 3
        out = np.zeros_like(data)
        assert shm_client.get(ns, [f"m{i}" for i in range(6)], out, verify=True) == 6
        assert np.array_equal(out, data)
        out[:] = 0
        assert tcp_client.get(ns, [f"m{i}" for i in range(6)], out, verify=True) == 6
        assert np.array_equal(out, data)


def test_segmented_pages_and_misses_over_tcp(tcp_client):
    page = 4096 * 3
    ns = Namespace(model="segments", page_bytes=page)
    k = [np.full(4096, i, np.uint8) for i in range(4)]
    v = [np.full(8192, 100 + i, np.uint8) for i in range(4)]
    assert tcp_client.put(ns, ["s0", "s1", "s2", "s3"], [[k[i], v[i]] for i in range(4)]) == 4
    out_k = [np.zeros(4096, np.uint8) for _ in range(5)]
    out_v = [np.zeros(8192, np.uint8) for _ in range(5)]
    loaded = tcp_client.get(ns, ["s0", "s1", "s2", "s3", "missing"], [[out_k[i], out_v[i]] for i in range(5)])
    assert loaded == 4
    assert all((out_k[i] == i).all() and (out_v[i] == 100 + i).all() for i in range(4))
    assert not out_k[4].any()


def test_many_concurrent_tcp_clients(server):
    ns = Namespace(model="concurrent", page_bytes=64 << 10)
    failures = []

    def worker(n):
        try:
            data = pages(24, seed=n, page=64 << 10)
            keys = [f"w{n}-{i}" for i in range(24)]
            with KVStoreClient(server.address, transport="tcp", timeout_s=30) as c:
                for _ in range(3):
                    assert c.put(ns, keys, data) == 24
                    out = np.zeros_like(data)
                    assert c.get(ns, keys, out, verify=True) == 24
                    assert np.array_equal(out, data)
        except BaseException as exc:  # reported below
            failures.append((n, exc))

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not failures
    with KVStoreClient(server.address) as c:
        assert c.stats().leases_open == 0


def test_an_unknown_congestion_control_stops_start_up_naming_the_setting(start_server):
    with pytest.raises(RuntimeError, match="tcp.congestion"):
        start_server({"tcp.congestion": "no-such-cc"})
