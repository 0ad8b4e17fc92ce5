"""Filling a real server past its arena evicts leaves first: every cached chain stays a whole prefix."""

import numpy as np

from kvstore_client import KVStoreClient, Namespace

PAGE = 65536
NS = Namespace(model="evict", page_bytes=PAGE)


def test_eviction_keeps_every_chain_a_prefix(start_server):
    server = start_server({"dram.arena_bytes": "8MiB", "dram.slab_bytes": "1MiB"})
    chains, length = 48, 8  # 384 pages into a 128-page arena
    with KVStoreClient(server.address) as c:
        for chain in range(chains):
            data = np.stack([np.full(PAGE, (chain + i) % 256, np.uint8) for i in range(length)])
            assert c.put(NS, [f"c{chain}-{i}" for i in range(length)], data) == length
        stats = c.stats()
        assert stats.tiers[0].evictions >= chains * length - 128
        assert stats.tiers[0].pages <= 128
        out = np.zeros((length, PAGE), np.uint8)
        cached = 0
        for chain in range(chains):
            keys = [f"c{chain}-{i}" for i in range(length)]
            present = [c.lookup(NS, [k]) for k in keys]
            assert present == sorted(present, reverse=True), f"chain {chain} kept a page without its prefix"
            loaded = c.get(NS, keys, out, verify=True)
            assert loaded == sum(present)
            for i in range(loaded):
                assert (out[i] == (chain + i) % 256).all()
            cached += loaded
        assert cached == stats.tiers[0].pages
        # the most recent chain survived: eviction is least recently used first
        assert c.lookup(NS, [f"c{chains - 1}-{i}" for i in range(length)]) == length
