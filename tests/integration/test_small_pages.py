"""Pages smaller than 4 KiB (a 448-byte Mamba state, a 1 KiB indexer page) cost a real node's DRAM their own size,
over shared memory and over TCP: a small arena holds as many of them as its bytes allow, each back byte for byte."""

import numpy as np
import pytest

from kvstore_client import KVStoreClient, Namespace

ARENA = 1 << 20
SLAB = 64 << 10
SLABS = ARENA // SLAB
MAMBA, INDEXER = 448, 1024
PER_SLAB = {MAMBA: SLAB // MAMBA, INDEXER: SLAB // INDEXER}   # 146 and 64 (against 16 with 4 KiB slots)


@pytest.fixture(params=["shm", "tcp"])
def small_node(request, start_server):
    server = start_server({"dram.arena_bytes": ARENA, "dram.slab_bytes": SLAB})
    with KVStoreClient(server.address, transport=request.param, timeout_s=20) as client:
        assert client.transport == request.param
        yield client


def pages(n, page_bytes, seed):
    return np.random.default_rng(seed).integers(0, 256, (n, page_bytes), dtype=np.uint8)


def dram(client):
    tier = next(t for t in client.stats().tiers if t.capacity_bytes)
    return tier.used_bytes, tier.capacity_bytes


def held(client, namespaces):
    counts = {ns.page_bytes: 0 for ns in namespaces}
    models = {(ns.model, ns.page_bytes) for ns in namespaces}
    for entry in client.stats().namespaces:
        if (entry.model, entry.page_bytes) in models:
            counts[entry.page_bytes] += entry.pages
    return counts


def chain_keys(ns, first, n):
    return [f"{ns.model}-{first + i}" for i in range(n)]


def chain_pages(ns, first, n):
    return pages(n, ns.page_bytes, seed=first)


def put_chains(client, spaces, count, chain=100):
    """`count` pages in each namespace as chains of `chain` pages, each its own prefix (evicting one leaves
    no hole in another), the namespaces taking turns (each holds its latest chains)."""
    for first in range(0, count, chain):
        for ns in spaces:
            n = min(chain, count - first)
            client.put(ns, chain_keys(ns, first, n), chain_pages(ns, first, n))


def test_pages_under_4_kib_take_their_own_size_in_several_namespaces(small_node):
    client = small_node
    mamba = [Namespace(model=f"mamba-{i}", page_bytes=MAMBA) for i in range(2)]
    indexer = [Namespace(model=f"indexer-{i}", page_bytes=INDEXER) for i in range(2)]
    # 12 of the 16 slabs' worth, 1,178 pages: 4.6 MiB at 4 KiB a page, 665 KiB at their own size.
    counts = {mamba[0]: 3 * PER_SLAB[MAMBA], mamba[1]: 2 * PER_SLAB[MAMBA],
              indexer[0]: 4 * PER_SLAB[INDEXER], indexer[1]: 3 * PER_SLAB[INDEXER]}
    written = {}
    for seed, (ns, n) in enumerate(counts.items()):
        keys = [f"{ns.model}-{i}" for i in range(n)]
        written[ns] = keys, pages(n, ns.page_bytes, seed)
        assert client.put(ns, keys, written[ns][1], verify=True) == n
    for ns, (keys, data) in written.items():
        out = np.zeros_like(data)
        assert client.get(ns, keys, out, verify=True) == len(keys)
        assert np.array_equal(out, data)
    used, capacity = dram(client)
    assert capacity == ARENA
    assert used == sum(n * ns.page_bytes for ns, n in counts.items())
    assert held(client, mamba + indexer) == {MAMBA: 5 * PER_SLAB[MAMBA], INDEXER: 7 * PER_SLAB[INDEXER]}

    # Filled past its memory with one size at a time, the arena holds a slab's worth of each slab.
    for ns in counts:
        client.clear(ns)
    assert dram(client)[0] == 0
    for size, spaces in ((MAMBA, mamba), (INDEXER, indexer)):
        count = 2 * SLABS * PER_SLAB[size]
        put_chains(client, spaces, count)
        assert held(client, spaces) == {size: SLABS * PER_SLAB[size]}
        assert dram(client)[0] == SLABS * PER_SLAB[size] * size
        last = (count - 1) // 100 * 100
        for ns in spaces:   # what is held reads back byte for byte: the last chain put in each namespace
            out = np.zeros((count - last, size), dtype=np.uint8)
            assert client.get(ns, chain_keys(ns, last, count - last), out, verify=True) == count - last
            assert np.array_equal(out, chain_pages(ns, last, count - last))
        for ns in spaces:
            client.clear(ns)
