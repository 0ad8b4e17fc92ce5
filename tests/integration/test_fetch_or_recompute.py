"""Fetch or recompute: a residency answer carries what loading its pages costs (the node's recent seconds a page
per tier, this client's data-plane rate), and worth_loading weighs it against a prefill of the same tokens. A
slow tier (a per-page delay in every Acquire, behind the test-only failpoint acquire.each_page) makes loading
slower than a fast prefill, and the answer says to recompute; a fast tier says to load."""

import asyncio

import numpy as np
import pytest

from kvstore import failpoints
from kvstore_client import AsyncKVStoreClient, KVStoreClient, Namespace, prefix_hashes
from kvstore_client.proto import pb

PAGE_TOKENS = 16
NS = Namespace(model="fetch-or-recompute", page_bytes=4096, page_tokens=PAGE_TOKENS)
TOKENS = list(range(20 * PAGE_TOKENS))


def stored_and_read(client):
    keys = prefix_hashes(TOKENS, PAGE_TOKENS)
    assert client.put(NS, keys, np.ones((20, NS.page_bytes), np.uint8)) == 20
    assert client.get(NS, keys, np.zeros((20, NS.page_bytes), np.uint8)) == 20   # measured on the way
    return keys


def test_a_slow_tier_says_recompute_and_a_fast_one_says_load(start_server):
    slow = start_server({"testing.failpoints": "acquire.each_page=sleep:10"})   # 10 ms a page
    fast = start_server()
    for server, slowed in ((slow, True), (fast, False)):
        with KVStoreClient(server.address) as client:
            stored_and_read(client)
            answer = client.residency(NS, tokens=TOKENS)
            assert answer.pages == 20
            per_page = answer.costs.seconds_per_page[pb.DRAM]
            assert (per_page >= 0.009) == slowed, per_page
            assert answer.costs.plane_bytes_per_s > 0 and answer.costs.round_trip_s > 0
            # A prefill of 20 us a token is 0.32 ms a page: cheaper than a slowed page, dearer than a fast one.
            worth = answer.worth_loading(NS.page_bytes, PAGE_TOKENS, recompute_s_per_token=20e-6)
            assert worth == (0 if slowed else 20)
            assert answer.worth_loading(NS.page_bytes, PAGE_TOKENS, recompute_s_per_token=0.01) == 20   # slow prefill
            assert (answer.load_seconds(NS.page_bytes) >= 20 * 0.009) == slowed

            async def through_async():
                async with AsyncKVStoreClient(server.address) as aclient:
                    await aclient.get(NS, prefix_hashes(TOKENS, PAGE_TOKENS), np.zeros((20, NS.page_bytes), np.uint8))
                    return await aclient.residency(NS, tokens=TOKENS)
            async_answer = asyncio.run(through_async())
            assert (async_answer.costs.seconds_per_page[pb.DRAM] >= 0.009) == slowed


@pytest.mark.parametrize("spec", ["acquire.each_page=sleep:soon", "acquire.each_page=sleep:0",
                                  "acquire.each_page=sleep:20000"])
def test_a_sleep_failpoint_takes_milliseconds_only(spec):
    try:
        with pytest.raises(ValueError, match="sleep:MS"):
            failpoints.arm(spec)
    finally:
        failpoints.arm("")
