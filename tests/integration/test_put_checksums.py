"""Puts over shared memory record each page's checksum as the SDK took it while copying (kvstore_native),
and a get with verify=True checks the bytes against it; verify=True on the put still has the node
hash the slots and compare. Pages of every size the copy treats differently come back exact."""

import numpy as np
import pytest

from kvstore_client import KVStoreClient, Namespace, native


@pytest.mark.parametrize("page_bytes", [4096, 4096 + 24, 256 << 10])
@pytest.mark.parametrize("verify_put", [False, True])
def test_checksums_taken_while_copying_match_the_bytes(start_server, page_bytes, verify_put):
    server = start_server({"dram.arena_bytes": "64MiB", "dram.slab_bytes": "1MiB"})
    ns = Namespace(model=f"c{page_bytes}", page_bytes=page_bytes)
    data = np.random.default_rng(page_bytes).integers(0, 256, (40, page_bytes), dtype=np.uint8)
    keys = [f"k{i}" for i in range(40)]
    with KVStoreClient(server.address, timeout_s=10) as client:
        assert client.transport == "shm"
        # two segments per page, the first of odd length: the copy is not aligned for the rest of it
        segmented = [[page[:7], page[7:]] for page in data[:20]]
        assert client.put(ns, keys[:20], segmented, verify=verify_put) == 20
        assert client.put(ns, keys[20:], data[20:], parent=keys[19], verify=verify_put) == 20
        out = np.zeros_like(data)
        assert client.get(ns, keys, out, verify=True) == 40
        assert np.array_equal(out, data)
        stats = client.stats()
        assert stats.pages_committed == 40 and stats.checksum_failures == 0


def test_the_sdk_takes_the_one_pass_copy_where_it_is_built():
    from kvstore_client.arena import ArenaMapping
    import os
    fd = os.memfd_create("arena")
    os.ftruncate(fd, 1 << 20)
    arena = ArenaMapping(fd)
    source = np.arange(8192, dtype=np.uint8)
    sums = arena.write_hashed([4096], [[(source.ctypes.data, 8192)]])
    if native.available():
        import xxhash
        assert sums == [xxhash.xxh3_64_intdigest(source.tobytes())]
        assert bytes(arena.view[4096:4096 + 8192]) == source.tobytes()
    else:
        assert sums is None
    arena.close()


def test_without_kvstore_native_the_node_hashes_at_commit(start_server, monkeypatch):
    monkeypatch.setattr(native, "module", None)   # as on a machine without a compiler
    server = start_server({"dram.arena_bytes": "16MiB"})
    ns = Namespace(model="fallback", page_bytes=8192, page_tokens=4)
    data = np.random.default_rng(1).integers(0, 256, (8, 8192), dtype=np.uint8)
    tokens = list(range(32))
    from kvstore_client import prefix_hashes
    keys = prefix_hashes(tokens, 4)
    with KVStoreClient(server.address, timeout_s=10) as client:
        assert client.put(ns, keys, data) == 8
        assert client.lookup(ns, tokens=tokens) == 8
        out = np.zeros_like(data)
        assert client.get(ns, keys, out, verify=True) == 8 and np.array_equal(out, data)
