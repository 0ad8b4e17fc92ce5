"""vLLM 0.33's own tiering offload (TieringOffloadingSpec, SecondaryTierFactory, the tiering manager
and its CPU primary tier in shared memory) stores chunks to and loads them from a real kvstore-server
through KVStoreSecondaryTier, giving the same lookup answers and the same bytes as vLLM's built-in
file-system tier ("fs") on the same inputs, in a few calls per batch (counted by the node), not one per
chunk; refused stores and misses are reported, not hidden.

The test plays the GPU worker's part (it writes the chunk rows that a GPU->CPU copy would fill and
reads the rows a CPU->GPU copy would read); everything from the primary tier down is vLLM's code.
"""

from __future__ import annotations

import collections
import logging
import os
import signal
import time
import uuid

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families
from vllm.utils.hashing import sha256_cbor
from vllm.v1.core import kv_cache_utils
from vllm.v1.kv_offload.base import LookupResult, ReqContext, ScheduleEndContext, make_offload_key
from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

from cluster_parts import cluster_pool, etcd, only_on, start_node  # noqa: F401  (three nodes in a real etcd)
from kvstore_client import KVStoreClient
from kvstore_client.adapters.vllm import KVStoreSecondaryTier, Metric

BLOCK_TOKENS = 16
CHUNK_BYTES = 8192
CHUNKS = 32
STEP = ScheduleEndContext(new_req_ids=(), preempted_req_ids=())


def kvstore_tier(server, **more):
    return {"type": "KVStoreSecondaryTier", "module_path": "kvstore_client.adapters.vllm",
            "target": server.address, "timeout_s": 10, **more}


def make_engine(tier_config, chunks=CHUNKS):
    """An engine's scheduler-side offloading manager, built by vLLM's own spec and tier factory; its CPU
    primary tier holds `chunks` chunks."""
    config = OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=BLOCK_TOKENS, layer_names=("layers.0", "layers.1"),
                                      group_id=0),),
        worker_kv_bytes_per_block=CHUNK_BYTES, enable_kv_cache_events=False,
        extra_config={"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": CHUNK_BYTES * chunks,
                      "secondary_tiers": [dict(tier_config)], "tier_poll_interval_s": 0},
        engine_id=f"kvstore-test-{uuid.uuid4().hex[:12]}",
        model=OffloadingModelConfig(name="meta-llama/Llama-3.1-8B-Instruct", dtype="bfloat16"),
        cache=OffloadingCacheConfig(tokens_per_hash=BLOCK_TOKENS, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1,
                                          data_parallel_index=0, data_parallel_size=1,
                                          data_parallel_rank_local=None, is_parallelism_agnostic=False))
    spec = TieringOffloadingSpec(config)
    return Engine(spec, spec.get_manager(), config.engine_id)


class Engine:
    def __init__(self, spec, manager, engine_id):
        self.spec, self.manager, self.engine_id = spec, manager, engine_id
        self.rows = np.asarray(manager.primary_tier.get_kv_memoryview())
        self.tier = manager.secondary_tiers[0]

    def step(self):
        with self.manager.lock:
            self.manager.on_schedule_end(STEP)

    def settle(self, timeout_s=20.0):
        """Step until every tier job has finished and been collected."""
        deadline = time.monotonic() + timeout_s
        self.step()   # submits what this step queued (promotions are submitted at the step's end)
        while self.manager.has_pending_work() or self.tier.has_pending_work():
            assert time.monotonic() < deadline, "tier jobs did not finish"
            self.step()
            time.sleep(0.01)
        self.step()

    def offload(self, req_id, keys, pages):
        """What the connector does for a finished prefill: GPU -> primary rows -> cascade to the tier."""
        context = ReqContext(req_id=req_id)
        with self.manager.lock:
            self.manager.on_new_request(context)
            out = self.manager.prepare_store(keys, context)
            for key, row in zip(out.keys_to_store, np.asarray(out.store_spec.block_ids).tolist()):
                self.rows[row] = pages[keys.index(key)]
            self.manager.complete_store(keys, context)
        self.settle()
        with self.manager.lock:
            self.manager.on_request_finished(context)
        self.settle()

    def lookup_all(self, req_id, keys, timeout_s=20.0):
        """Look chunks up as the scheduler does, step after step, until every answer is final:
        returns the first answer other than RETRY for each key, and the final one."""
        context = ReqContext(req_id=req_id)
        with self.manager.lock:
            self.manager.on_new_request(context)
        first: list[LookupResult | None] = [None] * len(keys)
        deadline = time.monotonic() + timeout_s
        while True:
            with self.manager.lock:
                answers = [self.manager.lookup(key, context) for key in keys]
            for i, answer in enumerate(answers):
                if first[i] is None and answer is not LookupResult.RETRY:
                    first[i] = answer
            if all(a in (LookupResult.HIT, LookupResult.MISS) for a in answers):
                return context, first, answers
            assert time.monotonic() < deadline, f"lookups still pending: {answers}"
            self.step()
            time.sleep(0.01)

    def read(self, context, keys):
        """What a CPU -> GPU load reads: the primary rows of hit chunks."""
        with self.manager.lock:
            spec = self.manager.prepare_load(keys, context)
            rows = [bytes(self.rows[r]) for r in np.asarray(spec.block_ids).tolist()]
            self.manager.complete_load(keys, context)
            self.manager.on_request_finished(context)
        return rows

    def close(self):
        self.manager.shutdown()
        path = f"/dev/shm/vllm_offload_{self.engine_id}.mmap"
        if os.path.exists(path):
            os.unlink(path)


@pytest.fixture(scope="module", autouse=True)
def vllm_hashing():
    kv_cache_utils.init_none_hash(sha256_cbor)


@pytest.fixture
def engines():
    made = []

    def make(tier_config, chunks=CHUNKS):
        made.append(make_engine(tier_config, chunks))
        return made[-1]

    yield make
    for engine in made:
        engine.close()


def chunk_keys(tokens):
    """OffloadKeys of each full block, chained by vLLM's own block hashing (sha256_cbor)."""
    keys, parent = [], None
    for start in range(0, len(tokens) - BLOCK_TOKENS + 1, BLOCK_TOKENS):
        block_hash = kv_cache_utils.hash_block_tokens(sha256_cbor, parent, tokens[start:start + BLOCK_TOKENS])
        keys.append(make_offload_key(block_hash, 0))
        parent = block_hash
    return keys


def random_pages(count, seed):
    return np.random.default_rng(seed).integers(0, 256, (count, CHUNK_BYTES), dtype=np.uint8).view(np.int8)


def test_vllm_stores_to_and_loads_from_kvstore_like_its_fs_tier(server, engines, tmp_path):
    tokens = np.random.default_rng(3).integers(0, 128_000, 8 * BLOCK_TOKENS).tolist()
    keys = chunk_keys(tokens)
    pages = random_pages(len(keys), seed=4)
    unknown = chunk_keys(np.random.default_rng(5).integers(0, 128_000, 2 * BLOCK_TOKENS).tolist())
    asked = keys[:6] + [unknown[0]]

    answers = {}
    for name, tier in (("kvstore", kvstore_tier(server)), ("fs", {"type": "fs", "root_dir": str(tmp_path / "fs"),
                                                                  "n_read_threads": 1, "n_write_threads": 1})):
        writer = engines(tier)
        assert isinstance(writer.tier, KVStoreSecondaryTier) == (name == "kvstore")   # vLLM's factory built it
        writer.offload("prefill", keys, pages)
        reader = engines(tier)   # another engine: an empty primary tier, the same secondary store
        context, first, final = reader.lookup_all("follow-up", asked)
        hits = [k for k, a in zip(asked, final) if a is LookupResult.HIT]
        answers[name] = (first, final, reader.read(context, hits))

    first, final, loaded = answers["kvstore"]
    assert first == [LookupResult.HIT_PENDING] * 6 + [LookupResult.MISS]    # found below, promoted
    assert final == [LookupResult.HIT] * 6 + [LookupResult.MISS]
    assert loaded == [pages[i].tobytes() for i in range(6)]
    assert answers["kvstore"] == answers["fs"]


def test_chunks_are_keyed_by_vllm_block_hashes_in_their_own_namespace(server, engines, client):
    engine = engines(kvstore_tier(server))
    keys = chunk_keys(list(range(3 * BLOCK_TOKENS)))
    pages = random_pages(3, seed=6)
    engine.offload("r", keys, pages)
    namespace = engine.tier.namespace
    assert namespace.page_bytes == CHUNK_BYTES and namespace.page_tokens == BLOCK_TOKENS
    assert namespace.model == "meta-llama/Llama-3.1-8B-Instruct" and namespace.kv_dtype == "bfloat16"
    assert client.lookup(namespace, keys=keys) == 3
    out = np.zeros((3, CHUNK_BYTES), dtype=np.uint8)
    assert client.get(namespace, keys, out) == 3
    assert out.tobytes() == pages.tobytes()
    # Another KV layout (here: a chunk of a different size) never sees these chunks.
    other = engine.tier.namespace.__class__(**{**namespace.__dict__, "page_bytes": CHUNK_BYTES * 2})
    assert client.lookup(other, keys=keys) == 0

    other_engine = engines(kvstore_tier(server))
    other_engine.offload("again", keys, pages)      # the same chunks from another engine: nothing copied
    assert other_engine.tier.counters().get(Metric.PAGES_ALREADY_STORED) == 3
    assert engine.tier.counters().get(Metric.PAGES_ALREADY_STORED) is None
    stats = other_engine.manager.get_stats()
    values = stats.metric_sections()[1]
    assert values[Metric.PAGES_ALREADY_STORED][()] == 3


def test_a_chunk_the_node_lost_is_a_miss_and_a_failed_load_says_which(server, engines, client):
    writer = engines(kvstore_tier(server))
    keys = chunk_keys(list(range(100, 100 + 4 * BLOCK_TOKENS)))
    pages = random_pages(4, seed=8)
    writer.offload("w", keys, pages)

    reader = engines(kvstore_tier(server))
    context = ReqContext(req_id="r")
    with reader.manager.lock:
        reader.manager.on_new_request(context)
        assert reader.manager.lookup(keys[0], context) is LookupResult.RETRY
    reader.step()
    deadline = time.monotonic() + 20
    while True:   # the async lookup answers on a worker thread; the scheduler asks again each step
        with reader.manager.lock:
            answer = reader.manager.lookup(keys[0], context)
        if answer is not LookupResult.RETRY:
            break
        assert time.monotonic() < deadline
        reader.step()
        time.sleep(0.01)
    assert answer is LookupResult.HIT_PENDING
    # Between the lookup and the load, the chunk goes from the node (another client deletes it).
    assert client.delete(reader.tier.namespace, [keys[0]]) >= 1
    reader.settle()
    with reader.manager.lock:
        assert reader.manager.lookup(keys[0], context) is LookupResult.MISS
        reader.manager.on_request_finished(context)
    assert reader.tier.counters()[Metric.LOAD_MISSES] == 1


def test_stores_beyond_jobs_max_are_refused_and_counted(server, engines):
    engine = engines(kvstore_tier(server, jobs_max=1, timeout_s=3))
    keys = chunk_keys(list(range(200, 200 + 4 * BLOCK_TOKENS)))
    pages = random_pages(4, seed=9)
    os.kill(server.process.pid, signal.SIGSTOP)    # the node stops answering: the first store hangs
    try:
        context = ReqContext(req_id="slow")
        with engine.manager.lock:
            engine.manager.on_new_request(context)
            out = engine.manager.prepare_store(keys[:2], context)
            for key, row in zip(out.keys_to_store, np.asarray(out.store_spec.block_ids).tolist()):
                engine.rows[row] = pages[keys.index(key)]
            engine.manager.complete_store(keys[:2], context)      # job 1: in flight, the node is stopped
            out = engine.manager.prepare_store(keys[2:], context)
            engine.manager.complete_store(keys[2:], context)      # job 2: refused at once
        assert engine.tier.counters().get(Metric.STORES_REFUSED) == 1
    finally:
        os.kill(server.process.pid, signal.SIGCONT)
    engine.settle()
    with engine.manager.lock:
        engine.manager.on_request_finished(context)
    counters = engine.tier.counters()
    assert counters[Metric.STORES_REFUSED] == 1


def test_a_job_that_fails_unexpectedly_still_reports_back_to_vllm(server, engines, monkeypatch):
    """Not only the SDK's own errors: any exception in a tier job fails that job, so vLLM never waits forever."""
    engine = engines(kvstore_tier(server))
    keys = chunk_keys(list(range(300, 300 + 2 * BLOCK_TOKENS)))

    def broken_put(*args, **kwargs):
        raise RuntimeError("an unexpected failure inside the client")

    monkeypatch.setattr(KVStoreClient, "put", broken_put)   # the tier's clients live in this process
    engine.offload("broken", keys, random_pages(2, seed=10))   # settles only when every job reported back
    assert engine.tier.counters()[Metric.ERRORS] == 1
    assert not engine.tier.has_pending_work()


def test_lookups_of_many_new_chunks_cost_one_lookup(server, engines):
    """vLLM batches a step's lookups (keys of several requests): each key is answered on its own, and a
    thousand chunks not yet stored cost one Lookup, where asking again after each miss cost a thousand."""
    engine = engines(kvstore_tier(server))
    stored = chunk_keys(list(range(300, 300 + 3 * BLOCK_TOKENS)))
    engine.offload("stored", stored, random_pages(3, seed=12))
    fresh = chunk_keys(list(range(5000, 5000 + 1000 * BLOCK_TOKENS)))
    asked = [stored[0], *fresh[:500], stored[2], *fresh[500:], stored[1]]   # hits between misses
    before = engine.tier.counters().get(Metric.LOOKUP_RPCS, 0)
    assert engine.tier.present(asked) == [True] + [False] * 500 + [True] + [False] * 500 + [True]
    assert engine.tier.counters()[Metric.LOOKUP_RPCS] - before == 1


def test_a_thousand_chunks_cost_the_node_one_lookup_per_store_and_per_lookup_batch(private_server, engines, caplog,
                                                                                      monkeypatch):
    """Counted where the calls are served (the node's per-method RPC counts): storing 1,000 chunks the node
    does not hold, looking up 1,000 it never held, and looking the stored ones up from another engine each
    cost one Lookup, not one per chunk; the misses are misses and the hits come back with their bytes."""
    caplog.set_level(logging.INFO, logger="kvstore_client")   # a call made again on a new connection shows in a failure
    server = private_server
    monkeypatch.setenv("KVSTORE_TOKEN", server.token)   # how the engines' adapter takes a token
    fresh = chunk_keys(list(range(9000, 9000 + 1000 * BLOCK_TOKENS)))
    pages = random_pages(len(fresh), seed=15)
    writer = engines(kvstore_tier(server), chunks=1100)
    before = served(server)
    writer.offload("prefill", fresh, pages)
    stored = served(server) - before
    assert stored["Lookup"] == 1, why(stored, server)
    assert stored.total() <= RPCS_PER_BATCH_MAX, why(stored, server)

    reader = engines(kvstore_tier(server), chunks=1100)
    unknown = chunk_keys(list(range(30_000, 30_000 + 1000 * BLOCK_TOKENS)))
    before = served(server)
    _, _, final = reader.lookup_all("never-stored", unknown)
    looked_up = served(server) - before
    assert final == [LookupResult.MISS] * len(unknown)
    assert looked_up["Lookup"] == 1, why(looked_up, server)

    before = served(server)
    context, _, final = reader.lookup_all("follow-up", fresh)
    looked_up = served(server) - before
    assert final == [LookupResult.HIT] * len(fresh)
    assert looked_up["Lookup"] == 1, why(looked_up, server)
    assert reader.read(context, fresh) == [p.tobytes() for p in pages]
    assert (served(server) - before).total() <= RPCS_PER_BATCH_MAX


# A batch of any size up to the limits costs a handful of calls (hello, namespace, lookup, and a few
# reserve/commit or acquire/release parts); one per chunk would be a thousand.
RPCS_PER_BATCH_MAX = 16


def served(server) -> collections.Counter:
    """Calls the node has served, by method, read from its Prometheus endpoint."""
    calls: collections.Counter = collections.Counter()
    for sample in _samples(server, "kvstore_rpc_duration_seconds_count"):
        calls[sample.labels["method"]] += int(sample.value)
    return calls


def why(counted: collections.Counter, server) -> str:
    """A counting assertion's message: the calls counted, those refused, and who is connected to the node. A
    str, which pytest prints whole (it cuts any other message to one short line)."""
    return f"served: {dict(counted)}; refused: {dict(refused(server))}; connected to the node now: {server.connected()}"


def refused(server) -> collections.Counter:
    """Calls the node answered with an error, by method and error (named in a failure: why a call was made
    again)."""
    errors: collections.Counter = collections.Counter()
    for sample in _samples(server, "kvstore_rpc_errors_total"):
        errors[sample.labels["method"], sample.labels["error"]] += int(sample.value)
    return errors


def _samples(server, name):
    return [sample for family in text_string_to_metric_families(server.metrics_text()) for sample in family.samples
            if sample.name == name]


def test_vllms_tier_factory_takes_a_cluster_and_a_lost_node_costs_only_its_chunks(cluster_pool, engines):
    tokens = np.random.default_rng(13).integers(0, 128_000, 24 * BLOCK_TOKENS).tolist()
    keys = chunk_keys(tokens)
    pages = random_pages(len(keys), seed=14)
    writer = engines(kvstore_tier(cluster_pool))                          # target: etcd://..., vLLM's own loader
    assert isinstance(writer.tier, KVStoreSecondaryTier)
    writer.offload("prefill", keys, pages)
    reader = engines(kvstore_tier(cluster_pool))
    context, _, final = reader.lookup_all("follow-up", keys)
    assert final == [LookupResult.HIT] * len(keys)
    assert reader.read(context, keys) == [p.tobytes() for p in pages]

    lost = only_on(cluster_pool, keys, "p3")
    cluster_pool.nodes["p3"].kill()                                       # SIGKILL, mid-run
    time.sleep(3)                                                         # past its 2 s lease
    late = engines(kvstore_tier(cluster_pool))
    context, _, final = late.lookup_all("after-the-loss", keys)
    assert final == [LookupResult.MISS if gone else LookupResult.HIT for gone in lost]   # p3's single copies
    hits = [k for k, a in zip(keys, final) if a is LookupResult.HIT]
    assert late.read(context, hits) == [pages[keys.index(k)].tobytes() for k in hits]
