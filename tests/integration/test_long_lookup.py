"""A prompt longer than one Lookup holds is looked up in one SDK call, by keys and by tokens, over
either control channel."""

import asyncio

import numpy as np
import pytest

from kvstore_client import AsyncKVStoreClient, KVStoreClient, Namespace, prefix_hashes

PAGE = 4096
PAGES = 2000


@pytest.fixture(params=["local", "grpc"])
def long_client(start_server, request):
    server = start_server({"limits.lookup_pages_max": 300, "limits.batch_pages_max": 256,
                           "dram.arena_bytes": "64MiB"})
    with KVStoreClient(server.address, timeout_s=10, control=request.param) as c:
        yield c


def test_a_long_prompt_is_looked_up_in_parts(long_client):
    ns = Namespace(model="long", page_bytes=PAGE, page_tokens=16, hash_seed="cd" * 32)
    tokens = np.random.default_rng(3).integers(0, 128_000, PAGES * 16 + 5).astype(np.uint32)
    keys = prefix_hashes(tokens, 16, ns.hash_seed)
    stored = 1234   # ends inside the fifth part of 300
    assert long_client.put(ns, keys[:stored], np.zeros((stored, PAGE), np.uint8)) == stored
    assert long_client.lookup(ns, keys=keys) == stored
    assert long_client.lookup(ns, tokens=tokens) == stored
    assert long_client.lookup(ns, tokens=tokens.tolist()) == stored
    assert long_client.lookup(ns, keys=keys[:900]) == 900   # three whole parts
    assert long_client.lookup(ns, tokens=tokens[:15]) == 0   # not one full page


def test_lookup_of_an_early_miss_stops_at_it(long_client):
    ns = Namespace(model="miss", page_bytes=PAGE, page_tokens=16)
    keys = [f"m{i}" for i in range(PAGES)]   # of mixed lengths: sent one by one
    assert long_client.put(ns, keys[:10], np.zeros((10, PAGE), np.uint8)) == 10
    assert long_client.lookup(ns, keys=keys) == 10
    packed = [f"p{i:05d}".encode() for i in range(PAGES)]   # of one length: sent packed
    assert long_client.put(ns, packed[:700], np.zeros((700, PAGE), np.uint8)) == 700
    assert long_client.lookup(ns, keys=packed) == 700   # a miss inside the third part
    assert long_client.lookup(ns, keys=packed[:1]) == 1
    assert long_client.limits.lookup_pages_max == 300


def test_the_async_client_looks_up_a_long_prompt_in_one_call(start_server):
    server = start_server({"limits.lookup_pages_max": 300, "limits.batch_pages_max": 256,
                           "dram.arena_bytes": "64MiB"})
    ns = Namespace(model="long-async", page_bytes=PAGE, page_tokens=16)
    tokens = np.random.default_rng(4).integers(0, 128_000, PAGES * 16).astype(np.uint32)
    keys = prefix_hashes(tokens, 16)
    with KVStoreClient(server.address, timeout_s=10) as c:
        assert c.put(ns, keys[:1000], np.zeros((1000, PAGE), np.uint8)) == 1000

    async def run():
        async with AsyncKVStoreClient(server.address, timeout_s=10) as client:
            return (await client.lookup(ns, keys=keys), await client.lookup(ns, tokens=tokens),
                    await client.lookup(ns, keys=keys[:900]), await client.lookup(ns, tokens=tokens[:15]))

    assert asyncio.run(run()) == (1000, 1000, 900, 0)
