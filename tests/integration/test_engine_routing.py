"""vLLM's own hashing and ZMQ publisher (and SGLang's, for its bigram pages) feed a real server's ENGINE tier;
Route scores follow what each engine published, never crediting what it cannot attribute.

Each fake engine is vLLM's ZmqEventPublisher (PUB + replay ROUTER) publishing KVEventBatches
built from vLLM's event classes, with block hashes from vLLM's prefix-cache hashing
(sha256_cbor, as `--prefix-caching-hash-algo sha256_cbor`). Only the scheduler that would
call publish() is absent: it needs a GPU model runner.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time

import numpy as np
import pytest
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from vllm.utils.hashing import sha256_cbor
from vllm.v1.core import kv_cache_utils

from vllm_publisher import BLOCK, FakeEngine

from kvstore_client import AsyncKVStoreClient, KVStoreClient, Namespace, errors, prefix_hashes
from kvstore_client.load_estimate import NO_COSTS
from kvstore_client.residency import EngineHeld
from kvstore_client.proto import pb

PAGE_BYTES = 4096
NS = Namespace(model="route-test", page_bytes=PAGE_BYTES, page_tokens=BLOCK)


@pytest.fixture(scope="module", autouse=True)
def vllm_hashing():
    kv_cache_utils.init_none_hash(sha256_cbor)


@pytest.fixture
def engines(tmp_path):
    made = [FakeEngine(tmp_path, "e1"), FakeEngine(tmp_path, "e2", int_hashes=False)]
    yield made
    for engine in made:
        engine.close()


def routed(client, tokens, engine_ids, until, timeout_s=20.0):
    deadline = time.monotonic() + timeout_s
    while True:
        answer = client.route(NS, engine_ids, tokens=tokens)
        scores = {s.engine_id: s for s in answer.scores}
        if until(scores) or time.monotonic() > deadline:
            return answer, scores
        time.sleep(0.05)


def test_route_follows_engine_events(start_server, engines, tmp_path):
    e1, e2 = engines
    server = start_server({
        "events.engine_ids": "e1,e2", "events.endpoints": f"{e1.endpoint},{e2.endpoint}",
        "events.replay_endpoints": f"{e1.replay},{e2.replay}",
        "route.weight_engine_gpu": 1.0, "route.weight_dram": 0.5, "route.weight_nvme": 0.25})
    rng = np.random.default_rng(7)
    conversation = rng.integers(0, 32000, 8 * BLOCK).tolist()
    other = rng.integers(0, 32000, 4 * BLOCK).tolist()
    ids = ["e1", "e2", "e3"]
    with KVStoreClient(server.address, timeout_s=10) as client:
        # e1 prefilled the whole conversation in two turns; e2 only its first 3 pages and another prompt.
        hashes1 = e1.prefill(conversation[:5 * BLOCK])
        e1.prefill(conversation, cached_blocks=5)
        e2.prefill(conversation[:3 * BLOCK])
        e2.prefill(other)
        # The store holds the first 5 pages in DRAM: any engine can load them.
        keys = prefix_hashes(conversation, BLOCK)
        assert client.put(NS, keys[:5], np.zeros((5, PAGE_BYTES), np.uint8)) == 5

        answer, s = routed(client, conversation, ids, lambda s: s["e1"].engine_gpu_pages == 8
                           and s["e2"].engine_gpu_pages == 3)
        assert answer.best_engine_id == "e1"
        assert (s["e1"].prefix_pages, s["e1"].engine_gpu_pages, s["e1"].score) == (8, 8, 8.0)
        assert (s["e2"].prefix_pages, s["e2"].engine_gpu_pages, s["e2"].dram_pages) == (5, 3, 2)
        assert s["e2"].score == pytest.approx(3 + 2 * 0.5)
        assert (s["e3"].prefix_pages, s["e3"].dram_pages, s["e3"].score) == (5, 5, 2.5)
        # The other prompt is only on e2.
        answer, s = routed(client, other, ids, lambda s: s["e2"].engine_gpu_pages == 4)
        assert answer.best_engine_id == "e2" and s["e1"].prefix_pages == 0 and s["e3"].score == 0

        # e1 evicts its last 4 pages: page 4 is still in the store's DRAM, pages 5.. nowhere.
        e1.publish(BlockRemoved(block_hashes=e1.block_hashes(conversation)[4:], medium="GPU"))
        _, s = routed(client, conversation, ids, lambda s: s["e1"].engine_gpu_pages == 4)
        assert (s["e1"].prefix_pages, s["e1"].engine_gpu_pages, s["e1"].dram_pages) == (5, 4, 1)
        assert hashes1 == e1.block_hashes(conversation)[:5]

        # e2 resets its prefix cache: it is back to what the store offers.
        e2.publish(AllBlocksCleared())
        answer, s = routed(client, conversation, ["e2", "e1"], lambda s: s["e2"].engine_gpu_pages == 0)
        assert (s["e2"].prefix_pages, s["e2"].dram_pages, s["e2"].score) == (5, 5, 2.5)
        assert answer.best_engine_id == "e1"


def test_subscriber_joining_late_catches_up_through_replay(start_server, engines):
    e1, _ = engines
    rng = np.random.default_rng(8)
    tokens = rng.integers(0, 32000, 6 * BLOCK).tolist()
    e1.prefill(tokens[:2 * BLOCK])             # published before any subscriber exists
    e1.prefill(tokens, cached_blocks=2)
    time.sleep(0.3)
    server = start_server({"events.engine_ids": "e1", "events.endpoints": e1.endpoint,
                           "events.replay_endpoints": e1.replay})
    with KVStoreClient(server.address, timeout_s=10) as client:
        _, s = routed(client, tokens, ["e1"], lambda s: s["e1"].engine_gpu_pages == 6)
        assert s["e1"].prefix_pages == 6 and s["e1"].engine_gpu_pages == 6


def resident(client, tokens, engine_ids, until, timeout_s=20.0):
    deadline = time.monotonic() + timeout_s
    while True:
        answer = client.residency(NS, tokens=tokens, engine_ids=engine_ids)
        if until(answer) or time.monotonic() > deadline:
            return answer
        time.sleep(0.05)


def test_residency_says_how_much_of_a_prompt_each_engine_and_tier_holds(start_server, engines):
    """One call for a prompt longer than one Lookup: the store's leading pages with each one's tier, and each
    engine's leading pages in its own GPU (from its events), however the chain is split."""
    e1, e2 = engines
    server = start_server({"events.engine_ids": "e1,e2", "events.endpoints": f"{e1.endpoint},{e2.endpoint}",
                           "events.replay_endpoints": f"{e1.replay},{e2.replay}", "limits.lookup_pages_max": 1000})
    tokens = np.random.default_rng(11).integers(0, 32000, 2500 * BLOCK).tolist()   # 2,500 pages: 3 Lookups
    keys = prefix_hashes(tokens, BLOCK)
    e1.prefill(tokens)                     # all 2,500 pages
    e2.prefill(tokens[:1200 * BLOCK])      # a run that ends inside the second Lookup
    with KVStoreClient(server.address, timeout_s=10) as client:
        assert client.put(NS, keys[:2100], np.zeros((2100, PAGE_BYTES), np.uint8)) == 2100
        answer = resident(client, tokens, ["e1", "e2", "e3"],
                          lambda a: a.engines["e1"].gpu_pages == 2500 and a.engines["e2"].gpu_pages == 1200)
        assert answer.pages == 2100 and answer.tier_pages() == {"hbm": 0, "dram": 2100, "nvme": 0}
        assert answer.engines == {"e1": EngineHeld(2500, 2500), "e2": EngineHeld(1200, 1200), "e3": EngineHeld(0, 0)}
        assert client.residency(NS, keys=keys[:10]).engines == {}            # no engine asked: none answered
        e1.publish(BlockRemoved(block_hashes=e1.block_hashes(tokens)[2000:], medium="GPU"))
        answer = resident(client, tokens, ["e1"], lambda a: a.engines["e1"].gpu_pages == 2000)
        assert answer.engines["e1"] == EngineHeld(2000, 2000) and answer.pages == 2100

        async def through_async():
            async with AsyncKVStoreClient(server.address, timeout_s=10) as aclient:
                return await aclient.residency(NS, tokens=tokens, engine_ids=["e1", "e2"])
        through_sync = client.residency(NS, tokens=tokens, engine_ids=["e1", "e2"])
        answered_async = asyncio.run(through_async())
        # the costs carry each connection's own measured round trip: equal in kind, not in value
        assert answered_async.costs.round_trip_s > 0 and through_sync.costs.round_trip_s > 0
        assert dataclasses.replace(answered_async, costs=NO_COSTS) == dataclasses.replace(through_sync, costs=NO_COSTS)
        with pytest.raises(errors.InvalidArgument, match="same engine twice"):
            client.residency(NS, keys=keys[:4], engine_ids=["e1", "e1"])


def test_route_refuses_bad_requests(client):
    with pytest.raises(errors.InvalidArgument, match="engine_ids is empty"):
        client.route(NS, [], tokens=list(range(BLOCK)))
    with pytest.raises(errors.InvalidArgument, match="not both|empty"):
        client.route(NS, ["e1"], keys=[])


def sglang_events():
    """SGLang 0.5.23's own event classes and ZMQ publisher."""
    from sglang_harness import import_sglang

    import_sglang()
    from sglang.srt.disaggregation import kv_events

    return kv_events


def test_blocks_route_cannot_attribute_are_counted_and_never_credited(start_server, tmp_path):
    """LoRA and salted blocks (vLLM), EAGLE bigram pages (SGLang) and a second block size are not
    credited to the plain prefix; Stats and the metrics count them per engine as unattributable."""
    sg = sglang_events()
    vllm_engine = FakeEngine(tmp_path, "v")
    sglang_publisher = sg.ZmqEventPublisher(attn_dp_rank=0, endpoint=f"ipc://{tmp_path}/s-pub", buffer_steps=100)
    try:
        server = start_server({"events.engine_ids": "v,s",
                               "events.endpoints": f"{vllm_engine.endpoint},ipc://{tmp_path}/s-pub"})
        rng = np.random.default_rng(9)
        tokens = rng.integers(0, 32000, 4 * BLOCK).tolist()
        hashes = vllm_engine.block_hashes(tokens)
        with KVStoreClient(server.address, timeout_s=10) as client:
            # vLLM: the plain prompt's first page, then the same tokens under a LoRA adapter and a salt.
            vllm_engine.publish(BlockStored(block_hashes=hashes[:1], parent_block_hash=None,
                                            token_ids=tokens[:BLOCK], block_size=BLOCK, lora_id=None, medium="GPU",
                                            lora_name=None))
            vllm_engine.publish(
                BlockStored(block_hashes=[101, 102], parent_block_hash=None, token_ids=tokens[:2 * BLOCK],
                            block_size=BLOCK, lora_id=3, medium="GPU", lora_name="sql-adapter"),
                BlockStored(block_hashes=[201, 202, 203, 204], parent_block_hash=None, token_ids=tokens,
                            block_size=BLOCK, lora_id=None, medium="GPU", lora_name=None,
                            extra_keys=[("salt-of-tenant-a",), None, None, None]))
            # SGLang: an EAGLE (bigram) page and a plain page with 32 tokens per block.
            pairs = [(tokens[j], tokens[j + 1]) for j in range(BLOCK)]
            published = 0
            deadline = time.monotonic() + 20
            while True:
                sglang_publisher.publish(sg.KVEventBatch(ts=time.time(), events=[
                    sg.BlockStored(block_hashes=[301 + published], parent_block_hash=None, token_ids=pairs,
                                   block_size=BLOCK, lora_id=None, medium="GPU")]))
                published += 1
                engines = {e.engine_id: e for e in client.stats().engines}
                if "s" in engines and "v" in engines and engines["v"].blocks_seen == 7:
                    break
                assert time.monotonic() < deadline, f"events not seen: {engines}"
                time.sleep(0.1)
            sglang_publisher.publish(sg.KVEventBatch(ts=time.time(), events=[
                sg.BlockStored(block_hashes=[401], parent_block_hash=None, token_ids=tokens[:2 * BLOCK],
                               block_size=2 * BLOCK, lora_id=None, medium="GPU")]))

            _, s = routed(client, tokens, ["v", "s"], lambda s: s["v"].engine_gpu_pages == 1)
            assert (s["v"].prefix_pages, s["v"].engine_gpu_pages) == (1, 1)    # only the plain page
            assert (s["s"].prefix_pages, s["s"].engine_gpu_pages) == (0, 0)

            deadline = time.monotonic() + 20
            while (engines := {e.engine_id: e for e in client.stats().engines})["s"].blocks_seen < published + 1:
                assert time.monotonic() < deadline
                time.sleep(0.05)
            v, s_ = engines["v"], engines["s"]
            assert (v.blocks_seen, v.blocks_stored, v.blocks_unattributable, v.pages) == (7, 1, 6, 1)
            assert (s_.blocks_stored, s_.blocks_unattributable, s_.block_tokens) == (0, published + 1, BLOCK)
            engine_tier = [t for t in client.stats().tiers if t.tier == pb.ENGINE]
            assert engine_tier and engine_tier[0].pages == 1

            metrics = server.metrics_text()
            assert 'kvstore_engine_blocks_unattributable_total{engine_id="v"} 6.0' in metrics
            assert 'kvstore_engine_pages{engine_id="v"} 1.0' in metrics
    finally:
        sglang_publisher.shutdown()
        vllm_engine.close()


def test_route_refuses_a_namespace_whose_page_size_is_not_the_engines(start_server, tmp_path):
    engine = FakeEngine(tmp_path, "e")
    try:
        server = start_server({"events.engine_ids": "e", "events.endpoints": engine.endpoint})
        tokens = list(range(2 * BLOCK))
        with KVStoreClient(server.address, timeout_s=10) as client:
            deadline = time.monotonic() + 20
            while not any(e.block_tokens for e in client.stats().engines):
                engine.prefill(tokens)
                assert time.monotonic() < deadline
                time.sleep(0.1)
            wide = Namespace(model="route-test", page_bytes=PAGE_BYTES, page_tokens=2 * BLOCK)
            with pytest.raises(errors.InvalidArgument, match=f"publishes {BLOCK}-token blocks"):
                client.route(wide, ["e"], tokens=tokens)
            assert client.route(NS, ["e"], tokens=tokens).scores[0].engine_gpu_pages == 2
    finally:
        engine.close()


def test_a_block_size_the_subscription_does_not_declare_is_refused_at_subscription(start_server, tmp_path):
    """events.block_tokens declares each engine's block size: Route refuses a namespace of another page
    size before the engine has published anything, and blocks of another size than declared are refused
    by the subscription (counted in Stats, never indexed) instead of being indexed under keys no
    namespace of the declared size will ever ask for."""
    engine = FakeEngine(tmp_path, "e")
    try:
        server = start_server({"events.engine_ids": "e", "events.endpoints": engine.endpoint,
                               "events.block_tokens": 2 * BLOCK})
        tokens = list(range(4 * BLOCK))
        wide = Namespace(model="route-test", page_bytes=PAGE_BYTES, page_tokens=2 * BLOCK)
        with KVStoreClient(server.address, timeout_s=10) as client:
            with pytest.raises(errors.InvalidArgument, match=f"publishes {2 * BLOCK}-token blocks"):
                client.route(NS, ["e"], tokens=tokens)
            deadline = time.monotonic() + 20
            while not (engines := {e.engine_id: e for e in client.stats().engines}).get("e", pb.EngineStats()).blocks_seen:
                engine.prefill(tokens)   # BLOCK-token blocks: not what the subscription declares
                assert time.monotonic() < deadline
                time.sleep(0.1)
            refused = engines["e"]
            assert refused.blocks_refused == refused.blocks_seen > 0 and refused.blocks_stored == refused.pages == 0
            assert client.route(wide, ["e"], tokens=tokens).scores[0].engine_gpu_pages == 0
    finally:
        engine.close()


def test_plain_vllm_blocks_with_per_block_extra_keys_and_lookahead_hashing(start_server, tmp_path):
    """What vLLM publishes with --num-hash-lookahead-tokens (EAGLE drafters): extra_keys per block
    (None: a plain block) and the tokens after each block its hash covers. The last page is credited
    only to a request that goes on with those tokens."""
    engine = FakeEngine(tmp_path, "la")
    try:
        server = start_server({"events.engine_ids": "la", "events.endpoints": engine.endpoint})
        rng = np.random.default_rng(10)
        tokens = rng.integers(0, 32000, 4 * BLOCK).tolist()
        hashes = engine.block_hashes(tokens)[:3]
        lookahead = [tokens[(b + 1) * BLOCK:(b + 1) * BLOCK + 1] for b in range(3)]
        with KVStoreClient(server.address, timeout_s=10) as client:
            engine.publish(BlockStored(block_hashes=hashes, parent_block_hash=None, token_ids=tokens[:3 * BLOCK],
                                       block_size=BLOCK, lora_id=None, medium="GPU", lora_name=None,
                                       extra_keys=[None, None, None], lookahead_token_ids=lookahead))
            _, s = routed(client, tokens, ["la"], lambda s: s["la"].engine_gpu_pages == 3)
            assert s["la"].prefix_pages == 3
            turned = tokens[:3 * BLOCK] + [(tokens[3 * BLOCK] + 1) % 32000] + tokens[3 * BLOCK + 1:]
            assert client.route(NS, ["la"], tokens=turned).scores[0].engine_gpu_pages == 2
            assert client.route(NS, ["la"], tokens=tokens[:3 * BLOCK]).scores[0].engine_gpu_pages == 2
    finally:
        engine.close()
