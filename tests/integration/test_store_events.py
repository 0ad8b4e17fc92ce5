"""A consumer decoding the node's page events with vLLM's own classes rebuilds its inventory, page for page and
tier for tier, through a subscriber restarted, a subscriber left behind past the replay buffer, and the node
killed and restarted."""

from __future__ import annotations

import time

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvstore_client import KVStoreClient, Namespace
from kvstore_client.events import StoreInventory

zmq = pytest.importorskip("zmq")
msgspec = pytest.importorskip("msgspec")
kv_events = pytest.importorskip("vllm.distributed.kv_events")

PAGE = 65536
NS = Namespace(model="events", page_bytes=PAGE, page_tokens=16)
CHAIN = 6


def vllm_decode(payload: bytes):
    return msgspec.msgpack.Decoder(type=kv_events.KVEventBatch).decode(payload)


def settings(tmp_path, **more):
    return {"nvme.enabled": "true", "nvme.paths": f"{tmp_path}/shard0,{tmp_path}/shard1",
            "nvme.map_bytes": "6MiB",   # NVMe holds fewer pages than are put: its evictions show too
            "controller.write_policy": "write_back", "controller.high_watermark": 0.5,
            "dram.arena_bytes": "8MiB", "dram.slab_bytes": "1MiB",
            "events_out.enabled": "true", "events_out.endpoint": f"ipc://{tmp_path}/events.pub",
            "events_out.replay_endpoint": f"ipc://{tmp_path}/events.replay",
            "events_out.replay_batches": 16, "events_out.batch_events_max": 8, **more}


def scrape(server) -> dict[str, float]:
    return {s.name: s.value for family in text_string_to_metric_families(server.metrics_text()) for s in family.samples}


def keys_of(chain: int) -> list[str]:
    return [f"chain{chain}-page{i}" for i in range(CHAIN)]


def churn(c: KVStoreClient, chains: range) -> None:
    """Puts that overflow DRAM (evictions, write-downs, NVMe evictions), reads of old chains (promotions), deletes."""
    out = np.zeros((CHAIN, PAGE), np.uint8)
    for chain in chains:
        data = np.full((CHAIN, PAGE), chain % 251, np.uint8)
        for _ in range(50):   # under write_back a full DRAM waits for write-down: NO_SPACE says to retry
            if c.put(NS, keys_of(chain), data).stored == CHAIN:
                break
            time.sleep(0.1)
        else:
            raise AssertionError(f"chain {chain} never fit")
        if chain % 3 == 0:
            c.get(NS, keys_of(chain // 2), out)
        if chain % 5 == 0:
            c.delete(NS, keys_of(chain - 2)[3:])


def truth(c: KVStoreClient) -> dict[bytes, set[str]]:
    """The node's pages and tiers: the snapshot RPC's tiers over exactly the keys ListKeys lists (asked again
    while background write-downs and NVMe evictions change them between the two calls)."""
    for _ in range(100):
        snapshot = c.list_pages(NS).tiers()
        if sorted(snapshot) == c.list_keys(NS):
            return snapshot
        time.sleep(0.05)
    raise AssertionError("ListPages and ListKeys never agreed")


def converge(inventory: StoreInventory, c: KVStoreClient, timeout_s: float = 60.0) -> dict[bytes, set[str]]:
    """Poll until the rebuilt inventory equals the node's twice in a row (write-downs settle in the background)."""
    deadline = time.monotonic() + timeout_s
    agreed = 0
    while True:
        inventory.poll(100)
        expected = truth(c)
        got = inventory.inventory().get(inventory_ns(inventory), {})
        agreed = agreed + 1 if got == expected else 0
        if agreed == 2:
            return expected
        if time.monotonic() > deadline:
            missing = {k: v for k, v in expected.items() if got.get(k) != v}
            extra = {k: v for k, v in got.items() if k not in expected}
            raise AssertionError(f"inventory differs (restarts={inventory.restarts} snapshots={inventory.snapshots} "
                                 f"replays={inventory.replays} clears={inventory.clears} next_seq={inventory.next_seq} "
                                 f"received={inventory.received} last={inventory.last_received_seq}"
                                 f"): {len(missing)} pages wrong or missing, e.g. "
                                 f"{list(missing.items())[:3]}; {len(extra)} extra, e.g. {list(extra.items())[:3]}")


def inventory_ns(inventory: StoreInventory) -> int:
    (ns_id,) = inventory.followed
    return ns_id


def follow(c: KVStoreClient, tmp_path) -> StoreInventory:
    inventory = StoreInventory(c, [NS], f"ipc://{tmp_path}/events.pub", f"ipc://{tmp_path}/events.replay",
                               decode=vllm_decode)
    inventory.start()
    return inventory


def test_the_wire_is_vllm_kv_events(start_server, tmp_path):
    server = start_server(settings(tmp_path))
    context = zmq.Context()
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"ipc://{tmp_path}/events.pub")
    try:
        with KVStoreClient(server.address, timeout_s=10) as c:
            ns_id = c.list_pages(NS).namespace_id
            deadline = time.monotonic() + 30
            stored: list = []
            while not stored:   # a SUB joins late: put until its batches arrive
                assert time.monotonic() < deadline, "no BlockStored arrived"
                c.put(NS, keys_of(0), np.zeros((CHAIN, PAGE), np.uint8))
                while sub.poll(200):
                    topic, seq, payload = sub.recv_multipart()
                    assert topic == b"kvstore//" and len(seq) == 8
                    batch = vllm_decode(payload)
                    stored += [e for e in batch.events if isinstance(e, kv_events.BlockStored)]
            event = stored[0]
            keys = [k.encode() for k in keys_of(0)]
            assert event.block_hashes == keys and event.parent_block_hash is None   # one chain, one event
            assert event.medium == "CPU" and event.token_ids == [] and event.block_size == 16
            assert event.ownership == f"kvstore:{ns_id:016x}"
            # The replay socket answers in vLLM's framing: from seq 0, which opens with AllBlocksCleared.
            dealer = context.socket(zmq.DEALER)
            dealer.connect(f"ipc://{tmp_path}/events.replay")
            dealer.send_multipart((b"", (0).to_bytes(8, "big")))
            frames = dealer.recv_multipart()
            assert frames[0] == b"" and frames[1] == b"kvstore//" and int.from_bytes(frames[2], "big") == 0
            assert isinstance(vllm_decode(frames[3]).events[0], kv_events.AllBlocksCleared)
            while int.from_bytes(frames[2], "big", signed=True) != -1:
                frames = dealer.recv_multipart()
            dealer.close(linger=0)
        metrics = scrape(server)                    # the publisher's own figures, on the node's metrics endpoint
        assert metrics["kvstore_events_out_batches_published_total"] >= 2
        assert metrics["kvstore_events_out_replays_total"] == 1
        assert metrics["kvstore_events_out_batches_replayed_total"] >= 2      # AllBlocksCleared and a BlockStored
        assert metrics["kvstore_events_out_events_dropped_total"] == 0
        assert "kvstore_events_out_queued_events" in metrics
    finally:
        sub.close(linger=0)
        context.term()


@pytest.mark.parametrize("native_index", ["true", "false"])
def test_inventory_rebuilt_through_subscriber_restart_lag_and_node_restart(start_server, tmp_path, native_index):
    config = settings(tmp_path, **{"events_out.hwm": 4,   # a subscriber that does not read loses batches
                                   "server.native_index": native_index})
    server = start_server(config)
    c = KVStoreClient(server.address, timeout_s=10)
    try:
        churn(c, range(0, 10))
        first = follow(c, tmp_path)            # joins with pages on both tiers: from a snapshot
        churn(c, range(10, 30))
        converge(first, c)

        # (a) a subscriber killed and started again rebuilds from a snapshot.
        first.close()
        churn(c, range(30, 40))
        second = follow(c, tmp_path)
        churn(c, range(40, 50))
        converge(second, c)

        # (b) a subscriber that falls behind past the replay buffer takes a snapshot and catches up.
        snapshots = second.snapshots
        churn(c, range(50, 80))                 # hundreds of batches, none read; replay keeps 16
        converge(second, c)
        assert second.snapshots > snapshots, "the lagging subscriber did not go back to a snapshot"
        stats = c.stats()
        assert stats.tiers[0].evictions and [t for t in stats.tiers if t.tier == 3][0].evictions, \
            "the workload must evict from both tiers"

        # (c) the node killed and started again: its DRAM-only pages are gone, the NVMe ones recovered.
        assert second.restarts == 0, "batches of this run were taken for the next run's"
        churn(c, range(90, 92))                 # pages just put: in DRAM, some not yet written down
        before = truth(c)
        assert any("DISK" in tiers for tiers in before.values())
        c.close()
        server.kill()
        clears = second.clears
        server = start_server({**config, "events_out.replay_batches": 4096})   # replay reaches back to seq 0
        c = KVStoreClient(server.address, timeout_s=10)
        second.client = c
        after = truth(c)
        assert all(tiers == {"DISK"} for tiers in after.values())
        # A page the node took off NVMe to make room in the moments before the kill may still be on disk, its
        # erasure not yet committed: it comes back whole. A page the client deleted never does. Each of the two
        # shards makes room for one write-down transaction at a time, taking twice its pages (controller
        # _make_room): at most 2 x 2 x 4 pages of 64 KiB come back (8 did in one run, from two shards at once).
        back = set(after) - set(before)
        deleted = {key.encode() for chain in range(92) if chain % 5 == 0 for key in keys_of(chain - 2)[3:]}
        assert not back & deleted and len(back) <= 2 * 2 * (256 << 10) // PAGE, back
        for key in back:
            chain = int(key.decode().removeprefix("chain").split("-")[0])
            out = np.zeros((1, PAGE), np.uint8)
            got = c.get(NS, [key.decode()], out)   # 0 where it was evicted again since
            assert got == 0 or (out == chain % 251).all(), key
        churn(c, range(80, 90))
        final = converge(second, c)
        assert second.restarts >= 1 and second.clears > clears, "the node's new run was not seen as one"
        assert final and any("DISK" in tiers for tiers in final.values())
        second.close()
    finally:
        c.close()


def test_the_async_client_takes_the_same_snapshot(start_server, tmp_path):
    import asyncio

    from kvstore_client import AsyncKVStoreClient

    server = start_server(settings(tmp_path, **{"nvme.enabled": "false", "controller.write_policy": "write_through"}))
    with KVStoreClient(server.address, timeout_s=10) as c:
        assert c.put(NS, keys_of(1), np.ones((CHAIN, PAGE), np.uint8)).stored == CHAIN
        expected = c.list_pages(NS)
        run = c.events_run(NS)

    async def snapshot():
        async with AsyncKVStoreClient(server.address, timeout_s=10) as a:
            return await a.list_pages(NS), await a.events_run(NS)

    got, got_run = asyncio.run(snapshot())
    assert got.pages == expected.pages and got.events_topic == expected.events_topic == b"kvstore//"
    assert got_run == run and run and got.events_seq >= expected.events_seq
    assert got.pages[b"chain1-page1"] == (b"chain1-page0", True, False)
