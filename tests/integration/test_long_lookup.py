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


def test_a_bad_token_id_in_a_later_part_is_invalid_argument_and_the_client_goes_on(long_client):
    """Ids given as a list are read a part at a time (lookup.TokenChain): one past the first part that is not a
    valid id still fails the call with InvalidArgument, naming the range, and the connection stays usable."""
    from kvstore_client import errors

    ns = Namespace(model="bad-id", page_bytes=PAGE, page_tokens=16)
    tokens = np.random.default_rng(5).integers(0, 128_000, PAGES * 16).tolist()
    keys = prefix_hashes(tokens, 16)
    assert long_client.put(ns, keys[:100], np.zeros((100, PAGE), np.uint8)) == 100
    for bad in (-1, 2**64, "7"):
        odd = tokens[:1000 * 16] + [bad] + tokens[1000 * 16 + 1:]   # inside the fourth part of 300 pages
        with pytest.raises(errors.InvalidArgument, match="token ids must"):
            long_client.lookup(ns, tokens=odd)
        with pytest.raises(errors.InvalidArgument, match="token ids must"):
            long_client.residency(ns, tokens=odd)
    assert long_client.lookup(ns, tokens=tokens) == 100
    assert long_client.residency(ns, tokens=tokens).pages == 100
