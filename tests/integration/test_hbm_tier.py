"""The HBM tier on a real node, with a host memfd standing in for the GPU pool (testing.hbm_on_host, the
same seam as the CUDA pool): pages read repeatedly by a reader on this host come into the pool, parents
first, and are answered from it; the pool stays prefix-closed and makes room leaf-first; a copy a lease
reads is never dropped; deleted pages leave it; a reader elsewhere is never named an HBM offset."""

from __future__ import annotations

import hashlib
import time

import numpy as np
import pytest
import torch

from kv_layout_cases import cases
from kvstore_client import KVStoreClient, Namespace, kv_layout
from kvstore_client.gpu import GpuPages
from kvstore_client.gpu_device import HostDevice
from kvstore_client.proto import pb
from kvstore_client.residency import TIER_NAMES

PAGE = 64 << 10
NS = Namespace(model="hbm-tier", page_bytes=PAGE)
POOL_PAGES = 4
HBM = {"dram.arena_bytes": "8MiB", "dram.slab_bytes": "256KiB", "hbm.pool_bytes": "256KiB",
       "testing.hbm_on_host": "true", "hbm.promote_hits": 2}


def page_of(key: bytes) -> np.ndarray:
    """A page's bytes, derived from its key."""
    return np.frombuffer(hashlib.blake2b(key, digest_size=64).digest() * (PAGE // 64), dtype=np.uint8)


def chain(name: str, n: int) -> list[bytes]:
    return [f"{name}{i}".encode() for i in range(n)]


def stored(client: KVStoreClient, keys: list[bytes]) -> None:
    assert client.put(NS, keys, np.stack([page_of(k) for k in keys])).stored == len(keys)


def engine_read(client: KVStoreClient, keys: list[bytes]) -> tuple[pb.AcquireResponse, list[bytes]]:
    """An Acquire as a GPU engine on this host makes one (GpuPages: hbm_reader), and each page's bytes where the
    answer says it is: in the pool at its HBM offset, else in the arena. The lease stays open (release it)."""
    acquired = client._conn.call_in(NS, "Acquire", pb.AcquireRequest(keys=keys, hbm_reader=True))
    in_pool = list(acquired.hbm_offsets) or [-1] * acquired.hit_pages
    device = HostDevice()
    base = device.open_ipc(client._conn.hello.hbm.ipc_handle)
    try:
        pool, arena = device.opened[base], client._conn.data.arena.view
        seen = [bytes(pool[o:o + PAGE] if o >= 0 else arena[a:a + PAGE]) for o, a in zip(in_pool, acquired.offsets)]
    finally:
        device.close_ipc(base)
    return acquired, seen


def read(client: KVStoreClient, keys: list[bytes], times: int = 1) -> int:
    """Read the pages as a GPU engine does (engine_read), `times` times, checking every byte; returns how many
    came from the pool the last time."""
    for _ in range(times):
        acquired, seen = engine_read(client, keys)
        release(client, acquired.lease_id)
        assert acquired.hit_pages == len(keys) and seen == [page_of(k).tobytes() for k in keys]
    return len([offset for offset in acquired.hbm_offsets if offset >= 0])


def tiers(client: KVStoreClient, keys: list[bytes]) -> list[str]:
    return [TIER_NAMES[tier] for tier in client.residency(NS, keys=keys).tiers]


def until(what, timeout_s: float = 10.0):
    deadline = time.monotonic() + timeout_s
    while not (answer := what()) and time.monotonic() < deadline:
        time.sleep(0.02)
    return answer


def hbm_stats(client: KVStoreClient) -> pb.TierStats:
    return next(t for t in client.stats().tiers if t.tier == pb.HBM)


def pool_bytes(client: KVStoreClient, keys: list[bytes]) -> tuple[list[int], list[bytes], int]:
    """A held read lease's HBM offsets, the pool's bytes at each (b"" where not in HBM), and the lease."""
    acquired, seen = engine_read(client, keys)
    offsets = list(acquired.hbm_offsets)
    return offsets, [page if offset >= 0 else b"" for page, offset in zip(seen, offsets)], acquired.lease_id


def release(client: KVStoreClient, lease_id: int) -> None:
    client._conn.control.call("Release", pb.ReleaseRequest(lease_ids=[lease_id]))


def test_pages_read_again_on_this_host_come_into_hbm_and_are_answered_from_it(start_server):
    server = start_server(HBM)
    with KVStoreClient(server.address, timeout_s=10) as client:
        keys = chain("a", 3)
        stored(client, keys)
        read(client, keys)
        time.sleep(0.3)
        assert tiers(client, keys) == ["dram"] * 3          # read once: never copied
        read(client, keys)
        assert until(lambda: tiers(client, keys) == ["hbm"] * 3)
        offsets, seen, lease = pool_bytes(client, keys)
        assert min(offsets) >= 0 and len(set(offsets)) == 3
        assert seen == [page_of(k).tobytes() for k in keys]           # the committed bytes, in the pool
        release(client, lease)
        assert read(client, keys) == 3
        assert client.lookup(NS, keys) == 3
        stats = hbm_stats(client)
        assert (stats.pages, stats.used_bytes, stats.capacity_bytes) == (3, 3 * PAGE, POOL_PAGES * PAGE)
        assert stats.promotions == 3 and stats.hits >= 6


def test_hex_keys_sent_as_their_digests_are_found_in_the_pool(start_server):
    """A chain of hex keys (a token chain's) goes to the node as their digests (LookupRequest.hex_digests): the
    pages in the pool are named HBM by that form as by the keys' digits, each key on its own too."""
    server = start_server(HBM)
    with KVStoreClient(server.address, timeout_s=10) as client:
        keys = [hashlib.sha256(b"%d" % i).hexdigest().encode() for i in range(3)]
        stored(client, keys)
        read(client, keys, times=2)
        assert until(lambda: tiers(client, keys) == ["hbm"] * 3)
        by_digits = client._conn.call_in(NS, "Lookup", pb.LookupRequest(keys=keys))
        assert [TIER_NAMES[t] for t in by_digits.tiers] == ["hbm"] * 3
        assert client.held(NS, keys + [b"0" * 64]) == [True] * 3 + [False]


def test_only_a_gpu_reader_on_this_host_is_named_hbm_offsets(start_server):
    server = start_server({**HBM, "tcp.enabled": "true"})
    keys = chain("r", 2)
    with KVStoreClient(server.address, timeout_s=10) as local:
        stored(local, keys)
        for _ in range(3):          # a reader into host memory (an engine's host pool): nothing comes in
            out = np.zeros((2, PAGE), np.uint8)
            assert local.get(NS, keys, out, verify=True) == 2
        time.sleep(0.3)
        assert tiers(local, keys) == ["dram"] * 2 and hbm_stats(local).promotions == 0
        read(local, keys)           # a GPU reader's first read: these pages have been read often enough
        assert until(lambda: tiers(local, keys) == ["hbm"] * 2)
        assert read(local, keys) == 2
        answer = local._conn.call_in(NS, "Acquire", pb.AcquireRequest(keys=keys))   # not a GPU reader
        assert answer.hit_pages == 2 and list(answer.hbm_offsets) == []
        release(local, answer.lease_id)
    with KVStoreClient(server.address, timeout_s=10, control="grpc", transport="tcp") as remote:
        assert remote.transport == "tcp"
        answer = remote._conn.call_in(NS, "Acquire", pb.AcquireRequest(keys=keys, hbm_reader=True))
        assert answer.hit_pages == 2 and list(answer.hbm_offsets) == []      # not on this host's socket
        remote._conn.control.call("Release", pb.ReleaseRequest(lease_ids=[answer.lease_id]))


def test_the_pool_stays_prefix_closed_and_makes_room_leaf_first_never_from_a_leased_copy(start_server):
    server = start_server(HBM)
    with KVStoreClient(server.address, timeout_s=10) as client:
        a, b, c = chain("a", 4), chain("b", 2), chain("c", 4)
        for keys in (a, b, c):
            stored(client, keys)
        read(client, a, times=2)
        assert until(lambda: tiers(client, a) == ["hbm"] * 4)
        read(client, b, times=2)                             # the pool is full: a's leaves make room
        assert until(lambda: tiers(client, b) == ["hbm"] * 2)
        assert tiers(client, a) == ["hbm", "hbm", "dram", "dram"]
        held_offsets, held_bytes, lease = pool_bytes(client, b)   # b is read from now on
        read(client, c, times=2)                             # room: a's two copies, not b's (leased)
        assert until(lambda: tiers(client, c) == ["hbm", "hbm", "dram", "dram"])
        assert tiers(client, a) == ["dram"] * 4 and tiers(client, b) == ["hbm"] * 2
        _, again, second = pool_bytes(client, b)
        assert again == held_bytes == [page_of(k).tobytes() for k in b]
        release(client, lease)
        release(client, second)
        read(client, c)   # b's copies are free to go now, least recently read (its leaf) first
        assert until(lambda: tiers(client, c) == ["hbm"] * 4)
        assert tiers(client, b) == ["dram"] * 2
        offsets, seen, lease = pool_bytes(client, c)
        assert seen == [page_of(k).tobytes() for k in c]
        release(client, lease)
        assert hbm_stats(client).evictions == 6     # a's four, then b's two


def test_deleted_pages_leave_the_pool(start_server):
    server = start_server(HBM)
    with KVStoreClient(server.address, timeout_s=10) as client:
        keys = chain("d", 4)
        stored(client, keys)
        read(client, keys, times=2)
        assert until(lambda: hbm_stats(client).pages == 4)
        dram_before = next(t for t in client.stats().tiers if t.tier == pb.DRAM).used_bytes
        assert client.delete(NS, keys[2:3]) == 2
        dram_after = next(t for t in client.stats().tiers if t.tier == pb.DRAM).used_bytes
        assert dram_after == dram_before - 2 * PAGE    # a copy pins nothing: their DRAM slots are free at once
        assert tiers(client, keys) == ["hbm", "hbm"]        # the leading pages held: two, both in HBM
        assert until(lambda: hbm_stats(client).pages == 2)   # swept: their pool slots are free again
        assert hbm_stats(client).used_bytes == 2 * PAGE
        stored(client, keys[2:])     # written again: their new DRAM copies, read twice, come in again
        read(client, keys, times=2)
        assert until(lambda: tiers(client, keys) == ["hbm"] * 4)
        assert pool_bytes(client, keys)[1] == [page_of(k).tobytes() for k in keys]


def test_an_engine_loads_pages_from_the_pool_when_they_are_there(start_server):
    """GpuPages.get_to_gpu with the host stand-in device: the pages the node answers in HBM are read from the
    pool (the device opens it), the bytes land in the engine's cache blocks as put."""
    server = start_server(HBM)
    case = cases()[0]
    fmt = kv_layout.PAGE_FORMATS["sglang_page_first"]
    ns = Namespace(model="hbm-engine", page_bytes=case.shape.page_bytes)
    with KVStoreClient(server.address, timeout_s=10) as client:
        device = HostDevice()
        pages = GpuPages(client, device)
        assert pages.put_from_gpu(ns, ["e0", "e1"], case.cache, fmt, [1, 3]) == 2
        target = cases(seed=9)[0]
        for _ in range(2):
            assert pages.get_to_gpu(ns, ["e0", "e1"], target.cache, fmt, [0, 2]) == 2
        assert device.open_calls == 0          # nothing was in HBM yet: both reads came from the arena
        residency = until(lambda: (r := client.residency(ns, keys=["e0", "e1"])).tier_pages()["hbm"] == 2 and r)
        assert residency
        fresh = cases(seed=11)[0]
        assert pages.get_to_gpu(ns, ["e0", "e1"], fresh.cache, fmt, [0, 2]) == 2
        assert device.open_calls == 1          # this one read the pool
        for stored_block, loaded_block in ((1, 0), (3, 2)):
            assert torch.equal(fresh.logical(loaded_block).view(torch.uint8),
                               case.logical(stored_block).view(torch.uint8))
        pages.close()


@pytest.mark.parametrize("setting, why", [
    ({"hbm.pool_bytes": "1MiB", "dram.slab_bytes": "4MiB"}, "at least dram.slab_bytes"),
    ({"hbm.promote_hits": 0}, "at least 1")])
def test_a_pool_smaller_than_a_slab_or_no_read_count_is_refused_at_start(start_server, setting, why):
    with pytest.raises(RuntimeError, match=why):
        start_server({**HBM, **setting})
