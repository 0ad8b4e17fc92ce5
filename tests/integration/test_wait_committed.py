"""A get with wait_ms loads pages another client commits while it waits, and answers at its deadline with what came."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from kvstore_client import KVStoreClient, Namespace, errors, prefix_hashes

NS = Namespace(model="handoff", page_bytes=8192, page_tokens=4)


def test_get_waits_for_pages_committed_meanwhile(server):
    keys = prefix_hashes(list(range(4 * 16)), page_tokens=4)
    pages = np.random.default_rng(3).integers(0, 255, (16, NS.page_bytes), dtype=np.uint8)
    with KVStoreClient(server.address) as producer, KVStoreClient(server.address) as consumer:
        def produce() -> None:          # page by page, as a prefill engine computes them
            for i in range(16):
                time.sleep(0.02)
                assert producer.put(NS, keys[i:i + 1], pages[i:i + 1], parent=keys[i - 1] if i else None) == 1

        writer = threading.Thread(target=produce)
        writer.start()
        assert consumer.get(NS, keys, np.zeros_like(pages)) < 16          # without waiting: not there yet
        out = np.zeros_like(pages)
        assert consumer.get(NS, keys, out, wait_ms=10_000, timeout_s=15) == 16
        writer.join()
        assert np.array_equal(out, pages)


def test_wait_ends_at_the_deadline_with_what_was_committed(server):
    keys = prefix_hashes(list(range(100, 100 + 4 * 4)), page_tokens=4)
    pages = np.random.default_rng(4).integers(0, 255, (4, NS.page_bytes), dtype=np.uint8)
    with KVStoreClient(server.address) as client:
        assert client.put(NS, keys[:2], pages[:2]) == 2
        started = time.monotonic()
        assert client.get(NS, keys, np.zeros_like(pages), wait_ms=300) == 2
        assert time.monotonic() - started >= 0.3          # it did wait for the two never written


def test_wait_beyond_the_node_limit_is_refused(server):
    keys = prefix_hashes(list(range(8)), page_tokens=4)
    with KVStoreClient(server.address) as client:
        with pytest.raises(errors.InvalidArgument, match="promote_wait_ms_max"):
            client.get(NS, keys, np.zeros((2, NS.page_bytes), np.uint8), wait_ms=3_600_000)


def test_a_waiting_get_holds_up_no_other_call_of_the_same_client(server):
    import asyncio
    from kvstore_client import AsyncKVStoreClient
    keys = prefix_hashes(list(range(200, 200 + 4 * 4)), page_tokens=4)
    pages = np.random.default_rng(5).integers(0, 255, (4, NS.page_bytes), dtype=np.uint8)
    with KVStoreClient(server.address) as client:
        assert client.transport == "shm"                 # its calls go over the node's local channel
        out, loaded = np.zeros_like(pages), []

        def wait_for_pages() -> None:
            try:
                loaded.append(client.get(NS, keys, out, wait_ms=8_000, timeout_s=20))
            except Exception as exc:    # seen by the assertion below
                loaded.append(exc)

        waiting = threading.Thread(target=wait_for_pages)
        waiting.start()
        time.sleep(0.2)
        assert client.lookup(NS, keys) == 0 and client.put(NS, keys, pages) == 4   # the same client, meanwhile
        waiting.join(30)
        assert loaded == [4] and np.array_equal(out, pages)
    keys = prefix_hashes(list(range(300, 300 + 4 * 4)), page_tokens=4)

    async def run() -> None:
        async with AsyncKVStoreClient(server.address) as client:
            out = np.zeros_like(pages)
            reading = asyncio.create_task(client.get(NS, keys, out, wait_ms=8_000, timeout_s=20))
            await asyncio.sleep(0.2)
            assert await client.lookup(NS, keys) == 0 and await client.put(NS, keys, pages) == 4
            assert not reading.done() or reading.result() == 4
            assert await reading == 4 and np.array_equal(out, pages)

    asyncio.run(run())
