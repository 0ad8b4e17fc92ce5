"""Pages stored through a real kvstore-server come back byte for byte, from every buffer kind."""

import ctypes
import time

import numpy as np
import pytest

from kvstore_client import KVStoreClient, Namespace, prefix_hashes

PAGE = 16384


@pytest.fixture
def ns():
    return Namespace(model="tiny-llama", page_bytes=PAGE, page_tokens=16, kv_dtype="bfloat16")


def pages(n, seed=0):
    return np.random.default_rng(seed).integers(0, 256, (n, PAGE), dtype=np.uint8)


def test_put_lookup_get_numpy(client, ns):
    tokens = list(range(16 * 10))
    keys = prefix_hashes(tokens, 16)
    data = pages(10)
    assert client.put(ns, keys, data) == 10
    assert client.lookup(ns, keys) == 10
    assert client.lookup(ns, tokens=tokens) == 10
    assert client.lookup(ns, tokens=tokens[:16 * 4] + [99999] * 16) == 4
    out = np.zeros_like(data)
    assert client.get(ns, keys, out, verify=True) == 10
    assert np.array_equal(out, data)


def test_get_stops_at_the_first_miss(client, ns):
    keys = [f"k{i}" for i in range(6)]
    data = pages(6, seed=1)
    client.put(ns, keys[:3], data[:3])
    out = np.zeros_like(data)
    assert client.get(ns, keys, out) == 3
    assert np.array_equal(out[:3], data[:3]) and not out[3:].any()


@pytest.mark.parametrize("control", ["local", "grpc"])
def test_a_get_acquired_in_parts_stops_at_the_first_miss_and_releases_every_part(server, ns, control):
    """300 pages over shared memory are acquired in four parts; a miss in the second ends the count there,
    and the third and fourth parts, all hits, are released without being copied."""
    keys = [f"part{i}" for i in range(300)]
    data = pages(300, seed=9)
    with KVStoreClient(server.address, control=control) as c:
        assert c.transport == "shm"
        assert c.put(ns, keys, data) == 300
        out = np.zeros_like(data)
        assert c.get(ns, keys, out, verify=True) == 300 and np.array_equal(out, data)
        out[:] = 0
        holed = keys[:100] + ["never-put"] + keys[101:]
        assert c.get(ns, holed, out) == 100
        assert np.array_equal(out[:100], data[:100]) and not out[100:].any()
        for _ in range(100):   # releases are posted: over gRPC one may still be on its way
            if c.stats().leases_open == 0:
                break
            time.sleep(0.05)
        assert c.stats().leases_open == 0


def test_second_put_of_a_prefix_extends_it(client, ns):
    keys = [f"c{i}" for i in range(8)]
    data = pages(8, seed=2)
    assert client.put(ns, keys[:4], data[:4]) == 4
    assert client.put(ns, keys[4:], data[4:], parent=keys[3]) == 4
    assert client.put(ns, keys, data) == 8  # all present: nothing is copied again
    out = np.zeros_like(data)
    assert client.get(ns, keys, out) == 8 and np.array_equal(out, data)


def test_orphan_pages_are_not_stored(client, ns):
    assert client.put(ns, ["orphan"], pages(1), parent="never-stored") == 0
    assert client.lookup(ns, ["orphan"]) == 0


def test_pages_after_an_anchor_never_stored_are_stored_anchored_at_it(client, ns):
    assert client.put(ns, ["orphan", "orphan-child"], pages(2), anchor="never-stored") == 2
    assert client.lookup(ns, ["orphan", "orphan-child"]) == 2
    assert client.lookup(ns, ["never-stored", "orphan", "orphan-child"]) == 0
    assert client.put(ns, ["never-stored"], pages(1)) == 1
    assert client.lookup(ns, ["never-stored", "orphan", "orphan-child"]) == 3


def test_torch_tensors(client, ns):
    torch = pytest.importorskip("torch")
    src = torch.arange(4 * PAGE // 2, dtype=torch.int16).reshape(4, PAGE // 2)
    keys = ["t0", "t1", "t2", "t3"]
    assert client.put(ns, keys, src) == 4
    out = torch.zeros_like(src)
    assert client.get(ns, keys, out) == 4
    assert torch.equal(out, src)
    per_page = [torch.zeros(PAGE, dtype=torch.uint8) for _ in keys]
    assert client.get(ns, keys, per_page) == 4
    assert torch.equal(torch.stack(per_page).view(torch.int16), src)


def test_raw_pointers_and_split_k_v_segments(client, ns):
    half = PAGE // 2
    k = np.random.default_rng(3).integers(0, 256, (3, half), dtype=np.uint8)
    v = np.random.default_rng(4).integers(0, 256, (3, half), dtype=np.uint8)
    segments = [[(k[i].ctypes.data, half), (v[i].ctypes.data, half)] for i in range(3)]
    assert client.put(ns, ["s0", "s1", "s2"], segments) == 3
    out = (ctypes.c_uint8 * (3 * PAGE))()
    base = ctypes.addressof(out)
    assert client.get(ns, ["s0", "s1", "s2"], [(base + i * PAGE, PAGE) for i in range(3)]) == 3
    got = np.frombuffer(out, dtype=np.uint8).reshape(3, PAGE)
    assert np.array_equal(got[:, :half], k) and np.array_equal(got[:, half:], v)


def test_batches_larger_than_the_server_limit_are_split(start_server, ns):
    server = start_server({"limits.batch_pages_max": 8})
    keys = [f"long{i}" for i in range(30)]
    data = pages(30, seed=5)
    with KVStoreClient(server.address) as c:
        assert c.put(ns, keys, data) == 30
        out = np.zeros_like(data)
        assert c.get(ns, keys, out) == 30 and np.array_equal(out, data)
        assert c.lookup(ns, keys[:8]) == 8


def test_grpc_control_gives_the_same_results(server, ns):
    keys = [f"g{i}" for i in range(40)]
    data = pages(40, seed=6)
    with KVStoreClient(server.address, control="grpc") as c:
        assert c.put(ns, keys, data, verify=True) == 40
        out = np.zeros_like(data)
        assert c.get(ns, keys, out) == 40 and np.array_equal(out, data)


def test_delete_and_stats(client, ns):
    keys = [f"d{i}" for i in range(5)]
    client.put(ns, keys, pages(5))
    before = client.stats()
    assert client.delete(ns, [keys[2]]) == 3
    assert client.lookup(ns, keys) == 2
    after = client.stats()
    dram = after.tiers[0]
    assert dram.pages == before.tiers[0].pages - 3
    assert dram.used_bytes == dram.pages * PAGE
    assert [n.pages for n in after.namespaces if n.model == "tiny-llama"] == [2]
    assert after.leases_open == 0


def test_namespaces_never_mix(client):
    a = Namespace(model="a", page_bytes=PAGE)
    b = Namespace(model="b", page_bytes=PAGE)
    client.put(a, ["same-key"], pages(1))
    assert client.lookup(b, ["same-key"]) == 0
    assert client.get(b, ["same-key"], np.zeros((1, PAGE), np.uint8)) == 0


def test_a_client_reopens_namespaces_after_a_server_restart(start_server, ns):
    first = start_server()
    with KVStoreClient(first.address) as c:
        c.put(ns, ["r0"], pages(1))
    first.terminate()
    second = start_server()
    with KVStoreClient(second.address) as c:
        assert c.lookup(ns, ["r0"]) == 0  # DRAM does not survive a restart
        assert c.put(ns, ["r0"], pages(1)) == 1
