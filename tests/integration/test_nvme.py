"""The NVMe tier on real LMDB files: pages survive SIGKILL and restart, corruption is never served,
a full map evicts, and the controller's write and prefetch policies do what they say."""

import signal
import time

import lmdb
import numpy as np
import pytest

from kvstore.tiers.nvme import record_key
from kvstore_client import KVStoreClient, Namespace, errors, namespace_id
from kvstore_client.proto import pb

PAGE = 65536
NS = Namespace(model="nvme-test", page_bytes=PAGE)


def chain_data(chain, length):
    return np.stack([np.full(PAGE, (chain * 7 + i) % 256, np.uint8) for i in range(length)])


def keys_of(chain, length):
    return [f"n{chain}-{i}" for i in range(length)]


def nvme_settings(tmp_path, **more):
    """Two paths of four shards each: write-down writes shards at once, and a restart reads them back."""
    return {"nvme.enabled": "true", "nvme.paths": f"{tmp_path}/shard0,{tmp_path}/shard1",
            "nvme.shards_per_path": "4", "nvme.map_bytes": "256MiB", **more}


def wait_for(predicate, timeout_s=20.0):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)


def tier(stats, name):
    return next(t for t in stats.tiers if t.tier == {"DRAM": 2, "NVME": 3}[name])


def test_pages_survive_sigkill_and_restart(start_server, tmp_path):
    settings = nvme_settings(tmp_path)
    first = start_server(settings)
    with KVStoreClient(first.address) as c:
        for chain in range(4):
            assert c.put(NS, keys_of(chain, 6), chain_data(chain, 6)) == 6
        wait_for(lambda: tier(c.stats(), "NVME").pages == 24)
    first.process.send_signal(signal.SIGKILL)
    first.process.wait()
    second = start_server(settings)
    assert "recovery complete pages=24" in second.log()
    with KVStoreClient(second.address) as c:
        stats = c.stats()
        assert stats.recovered_pages == 24 and tier(stats, "DRAM").pages == 0
        assert [n.model for n in stats.namespaces] == ["nvme-test"]  # the namespace came back too
        for chain in range(4):
            out = np.zeros((6, PAGE), np.uint8)
            assert c.get(NS, keys_of(chain, 6), out, verify=True) == 6
            assert np.array_equal(out, chain_data(chain, 6))
        stats = c.stats()
        assert tier(stats, "DRAM").promotions == 24 and tier(stats, "NVME").hits == 24
        assert c.get(NS, keys_of(0, 6), np.zeros((6, PAGE), np.uint8)) == 6
        assert tier(c.stats(), "DRAM").hits == 6  # the second read is served from DRAM


def test_a_corrupt_record_is_dropped_with_its_descendants(start_server, tmp_path):
    settings = nvme_settings(tmp_path, **{"nvme.paths": f"{tmp_path}/only", "nvme.shards_per_path": "1"})
    server = start_server(settings)
    with KVStoreClient(server.address) as c:
        assert c.put(NS, keys_of(0, 5), chain_data(0, 5)) == 5
        wait_for(lambda: tier(c.stats(), "NVME").pages == 5)
    assert server.terminate() == 0
    # One byte of the page rots where it lies on disk (rewriting it through LMDB would move it).
    env = lmdb.open(f"{tmp_path}/only", max_dbs=3, readonly=True)
    with env.begin(buffers=True) as txn:
        page = bytes(txn.get(record_key(namespace_id(NS), b"n0-2"), db=env.open_db(b"data", txn=txn)))
    env.close()
    with open(f"{tmp_path}/only/data.mdb", "r+b") as f:
        contents = f.read()
        assert contents.count(page) == 1
        f.seek(contents.index(page) + 1000)
        f.write(bytes([page[1000] ^ 0xFF]))
    restarted = start_server(settings)
    with KVStoreClient(restarted.address) as c:
        out = np.zeros((5, PAGE), np.uint8)
        assert c.get(NS, keys_of(0, 5), out, verify=True) == 2
        assert np.array_equal(out[:2], chain_data(0, 2))
        stats = c.stats()
        assert tier(stats, "NVME").corrupt_pages == 3
        assert c.lookup(NS, keys_of(0, 5)) == 2
        assert tier(stats, "NVME").pages == 2
    assert "corrupt page dropped" in restarted.log()


def test_a_full_map_evicts_instead_of_failing(start_server, tmp_path):
    settings = nvme_settings(tmp_path, **{"nvme.paths": f"{tmp_path}/small", "nvme.map_bytes": "4MiB",
                                          "nvme.shards_per_path": "1"})
    server = start_server(settings)
    with KVStoreClient(server.address) as c:
        for chain in range(12):  # 96 pages of 64 KiB into a 4 MiB map
            assert c.put(NS, keys_of(chain, 8), chain_data(chain, 8)) == 8
        wait_for(lambda: tier(c.stats(), "NVME").evictions > 0)
        assert tier(c.stats(), "NVME").pages < 96
    server.process.send_signal(signal.SIGKILL)
    server.process.wait()
    restarted = start_server(settings)
    with KVStoreClient(restarted.address) as c:
        out = np.zeros((8, PAGE), np.uint8)
        for chain in range(12):
            keys = keys_of(chain, 8)
            present = [c.lookup(NS, [k]) for k in keys]
            assert present == sorted(present, reverse=True)
            loaded = c.get(NS, keys, out, verify=True)
            assert np.array_equal(out[:loaded], chain_data(chain, 8)[:loaded])


def test_prefetch_policies_after_a_restart(start_server, tmp_path):
    settings = nvme_settings(tmp_path)
    first = start_server(settings)
    with KVStoreClient(first.address) as c:
        assert c.put(NS, keys_of(0, 16), chain_data(0, 16)) == 16
        wait_for(lambda: tier(c.stats(), "NVME").pages == 16)
    first.terminate()
    second = start_server(settings)
    out = np.zeros((16, PAGE), np.uint8)
    with KVStoreClient(second.address) as c:
        assert c.lookup(NS, keys_of(0, 16)) == 16  # known, on NVMe
        assert c.get(NS, keys_of(0, 16), out, policy="best_effort") == 0  # nothing in DRAM yet
        wait_for(lambda: tier(c.stats(), "DRAM").pages == 16)  # prefetched in the background
        assert c.get(NS, keys_of(0, 16), out, policy="best_effort") == 16
        assert np.array_equal(out, chain_data(0, 16))
        assert c.get(NS, keys_of(0, 16), out, policy="timeout", timeout_ms=5000) == 16


def test_write_through_selective_writes_hot_pages_only(start_server, tmp_path):
    server = start_server(nvme_settings(tmp_path, **{"controller.write_policy": "write_through_selective",
                                                      "controller.selective_hits": 2}))
    out = np.zeros((4, PAGE), np.uint8)
    with KVStoreClient(server.address) as c:
        c.put(NS, keys_of(0, 4), chain_data(0, 4))
        c.put(NS, keys_of(1, 4), chain_data(1, 4))
        c.get(NS, keys_of(0, 4), out)
        time.sleep(0.3)
        assert tier(c.stats(), "NVME").pages == 0
        c.get(NS, keys_of(0, 4), out)  # second hit
        wait_for(lambda: tier(c.stats(), "NVME").pages == 4)
        time.sleep(0.3)
        assert tier(c.stats(), "NVME").pages == 4  # the cold chain stays in DRAM only


def test_write_back_demotes_when_dram_fills(start_server, tmp_path):
    settings = nvme_settings(tmp_path, **{"controller.write_policy": "write_back",
                                          "controller.high_watermark": 0.5,
                                          "dram.arena_bytes": "8MiB", "dram.slab_bytes": "1MiB"})
    server = start_server(settings)
    with KVStoreClient(server.address) as c:
        for chain in range(24):  # 192 pages through a 128-page arena
            assert c.put(NS, keys_of(chain, 8), chain_data(chain, 8)) == 8
        wait_for(lambda: tier(c.stats(), "DRAM").demotions > 0)
        assert tier(c.stats(), "DRAM").used_bytes <= 8 << 20
        out = np.zeros((8, PAGE), np.uint8)
        assert c.get(NS, keys_of(0, 8), out, verify=True) == 8  # the oldest chain was written down
        assert np.array_equal(out, chain_data(0, 8))


def test_an_unusable_shard_directory_stops_start_up(start_server, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with pytest.raises(RuntimeError, match=r"NVMe path layout .*a-file/shard/shards \(nvme.paths\): .*Not a directory"):
        start_server(nvme_settings(tmp_path, **{"nvme.paths": f"{blocker}/shard"}))


def test_a_full_tier_is_said_in_the_log_at_most_once_a_minute(start_server, tmp_path):
    """A cache at capacity is its normal state: counted in nvme_evictions, not logged per eviction."""
    server = start_server(nvme_settings(tmp_path, **{"nvme.paths": f"{tmp_path}/small", "nvme.map_bytes": "4MiB",
                                                     "nvme.shards_per_path": "1"}))
    with KVStoreClient(server.address) as c:
        for chain in range(40):  # 320 pages of 64 KiB into a 4 MiB map
            assert c.put(NS, keys_of(chain, 8), chain_data(chain, 8)) == 8
        wait_for(lambda: tier(c.stats(), "NVME").evictions >= 128)   # room made many times
    assert server.log().count("NVMe full: evicted") == 1, server.log()


def test_a_full_disk_evicts_and_keeps_serving(start_server, tmp_path):
    import subprocess
    disk = tmp_path / "small-disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=6M", "tmpfs", str(disk)], capture_output=True).returncode:
        pytest.skip("mounting a small tmpfs needs root; the full-map test covers eviction")
    try:
        server = start_server(nvme_settings(tmp_path, **{"nvme.paths": f"{disk}/shard", "nvme.map_bytes": "64MiB"}))
        with KVStoreClient(server.address) as c:
            for chain in range(12):  # 6 MiB of pages onto a 6 MiB disk
                assert c.put(NS, keys_of(chain, 8), chain_data(chain, 8)) == 8
            wait_for(lambda: tier(c.stats(), "NVME").evictions > 0 or c.stats().nvme_write_errors > 0)
            out = np.zeros((8, PAGE), np.uint8)
            for chain in range(12):  # nothing was lost from DRAM, nothing served wrong
                assert c.get(NS, keys_of(chain, 8), out, verify=True) == 8
                assert np.array_equal(out, chain_data(chain, 8))
        server.terminate()
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def test_a_get_that_no_dram_slot_can_take_says_why(start_server, tmp_path):
    """Pages on NVMe with every DRAM slot pinned: the get is refused with the reason, as a put would be,
    not answered 0 as though the pages were missing; with a slot free again it loads them."""
    server = start_server(nvme_settings(tmp_path, **{"dram.arena_bytes": "512KiB", "dram.slab_bytes": "256KiB"}))
    with KVStoreClient(server.address) as c:
        cold, hot = keys_of(0, 4), keys_of(1, 8)                    # 8 slots in the arena
        assert c.put(NS, cold, chain_data(0, 4)) == 4
        wait_for(lambda: tier(c.stats(), "NVME").pages == 4)
        assert c.put(NS, hot, chain_data(1, 8)) == 8                # the cold pages leave DRAM
        ns_id = c._namespace_id(NS)
        held = c._grpc.call("Acquire", pb.AcquireRequest(namespace_id=ns_id, keys=[k.encode() for k in hot],
                                                         lease_ttl_ms=60_000))
        assert held.hit_pages == 8                                  # every slot pinned
        out = np.zeros((4, PAGE), np.uint8)
        with pytest.raises(errors.CapacityExhausted, match="on NVMe but none could come into DRAM"):
            c.get(NS, cold, out)
        c._grpc.call("Release", pb.ReleaseRequest(lease_ids=[held.lease_id]))
        wait_for(lambda: tier(c.stats(), "NVME").pages == 12)      # the hot pages written down: evictable
        assert c.get(NS, cold, out, verify=True) == 4 and np.array_equal(out, chain_data(0, 4))
