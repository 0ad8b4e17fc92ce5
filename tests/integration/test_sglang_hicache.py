"""SGLang 0.5.23's own StorageBackendFactory builds the kvstore backend from the dynamic
extra-config, and SGLang's calls (exists, set/get, zero-copy v1 with host indices) move
pages between SGLang's host-pool layouts and a real kvstore-server, byte for byte.

The test plays HiCacheController's part, which needs a GPU (device pool, CUDA streams):
it creates the backend with the controller's call, registers the host pool, and calls
batch_exists / batch_set_v1 / batch_get_v1 with the arguments the controller passes
(page-aligned host index slices, HiCacheStorageExtraInfo). See sglang_harness.py for what
of SGLang's host pool runs here and what needs a GPU.
"""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from kvstore_client import KVStoreClient, prefix_hashes
from kvstore_client.groups import GroupPart
from sglang_harness import SGLangHostPool, SGLangMambaPool, import_sglang

import_sglang()
from sglang.srt.mem_cache.hicache_storage import (  # noqa: E402
    HiCacheFile,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
    count_pool_hits,
)
from sglang.srt.mem_cache.storage import StorageBackendFactory  # noqa: E402

from cluster_parts import cluster_pool, etcd, only_on, start_node  # noqa: E402,F401  (three nodes, a real etcd)
from kvstore_client.adapters.sglang import KVStoreHiCacheStorage  # noqa: E402

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
PAGE = 16


def extra_config(server, **more):
    return {"backend_name": "kvstore", "module_path": "kvstore_client.adapters.sglang",
            "class_name": "KVStoreHiCacheStorage", "interface_v1": 1, "kvstore_target": server.address,
            "kvstore_timeout_s": 10, **more}


def storage_config(server, tp_rank=0, tp_size=1, mla=False, layout="page_first", model_name=MODEL, **more):
    return HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=mla, enable_storage_metrics=False, is_page_first_layout=layout == "page_first",
        model_name=model_name, extra_config=extra_config(server, **more))


def create(server, pool, **config):
    """What HiCacheController.attach_storage_backend does: factory, then register the host pool."""
    backend = StorageBackendFactory.create_backend("dynamic", storage_config(server, layout=pool.layout, **config),
                                                   pool)
    backend.register_mem_pool_host(pool)
    return backend


def host_indices(first_page, pages):
    return torch.arange(first_page * PAGE, (first_page + pages) * PAGE, dtype=torch.int64)


def tokens(n, seed=0):
    return torch.randint(0, 128_000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("layout", ["page_first", "layer_first", "page_first_direct"])
def test_zero_copy_round_trip_is_sglangs_flat_page(server, layout):
    pool = SGLangHostPool(layout, pages=24, page_size=PAGE)
    pool.fill_random(seed=1)
    backend = create(server, pool)
    assert isinstance(backend, KVStoreHiCacheStorage)
    keys = prefix_hashes(tokens(8 * PAGE), PAGE)
    written = [pool.page_bytes(p * PAGE) for p in range(8)]

    assert backend.batch_exists(keys, HiCacheStorageExtraInfo()) == 0
    assert backend.batch_set_v1(keys, host_indices(0, 8), HiCacheStorageExtraInfo()) == [True] * 8
    assert backend.batch_exists(keys) == 8
    assert backend.batch_exists(keys + ["f" * 64]) == 8          # leading hits only
    assert backend.batch_exists(["f" * 64] + keys) == 0

    # Load into other host pages (pages 10..17), as a prefetch does, and compare bytes.
    assert backend.batch_get_v1(keys, host_indices(10, 8)) == [True] * 8
    assert [pool.page_bytes((10 + p) * PAGE) for p in range(8)] == written

    # The generic path reads the same stored page as SGLang's flat data page.
    flat = backend.get(keys[3], pool.get_dummy_flat_data_page())
    assert flat is not None and flat.view(torch.uint8).numpy().tobytes() == written[3]


def test_sglangs_factory_takes_a_cluster_and_a_lost_node_costs_only_its_pages(cluster_pool):
    pool = SGLangHostPool("page_first", pages=128, page_size=PAGE)
    pool.fill_random(seed=9)
    backend = create(cluster_pool, pool)                                  # kvstore_target: etcd://...
    assert isinstance(backend, KVStoreHiCacheStorage)
    keys = prefix_hashes(tokens(60 * PAGE, seed=9), PAGE)
    written = [pool.page_bytes(p * PAGE) for p in range(60)]
    assert backend.batch_set_v1(keys[:40], host_indices(0, 40), HiCacheStorageExtraInfo(prefix_keys=[])) == [True] * 40
    assert backend.batch_set_v1(keys[40:], host_indices(40, 20),
                                HiCacheStorageExtraInfo(prefix_keys=keys[:40])) == [True] * 20
    assert backend.batch_exists(keys) == 60
    assert backend.batch_get_v1(keys, host_indices(64, 60)) == [True] * 60
    assert [pool.page_bytes((64 + p) * PAGE) for p in range(60)] == written

    lost = only_on(cluster_pool, keys[:40], "p2") + only_on(cluster_pool, keys[40:], "p2", chain_start=False)
    kept = lost.index(True) if any(lost) else 60
    cluster_pool.nodes["p2"].kill()                                       # SIGKILL, mid-run
    time.sleep(3)                                                         # past its 2 s lease
    assert backend.batch_exists(keys) == kept
    assert backend.batch_get_v1(keys, host_indices(64, 60)) == [True] * kept + [False] * (60 - kept)
    assert [pool.page_bytes((64 + p) * PAGE) for p in range(kept)] == written[:kept]


def test_generic_set_is_read_by_zero_copy_get(server):
    pool = SGLangHostPool("layer_first", pages=8, page_size=PAGE)
    pool.fill_random(seed=2)
    backend = create(server, pool)
    keys = prefix_hashes(tokens(2 * PAGE, seed=2), PAGE)
    assert backend.batch_set(keys, [pool.get_data_page(p * PAGE, flat=True) for p in range(2)])
    assert backend.exists(keys[0]) and backend.exists(keys[1])
    expected = [pool.page_bytes(p * PAGE) for p in range(2)]
    assert backend.batch_get_v1(keys, host_indices(4, 2)) == [True, True]
    assert [pool.page_bytes((4 + p) * PAGE) for p in range(2)] == expected


def test_misses_load_nothing_past_the_first_gap(server):
    pool = SGLangHostPool("page_first", pages=12, page_size=PAGE)
    pool.fill_random(seed=3)
    backend = create(server, pool)
    keys = prefix_hashes(tokens(4 * PAGE, seed=3), PAGE)
    assert backend.batch_set_v1(keys[:2], host_indices(0, 2)) == [True, True]
    before = pool.page_bytes(6 * PAGE)
    assert backend.batch_get_v1(keys, host_indices(4, 4)) == [True, True, False, False]
    assert pool.page_bytes(6 * PAGE) == before                   # a miss writes nothing
    assert backend.get(keys[3], pool.get_dummy_flat_data_page()) is None


def test_a_hit_slower_to_load_than_to_prefill_is_answered_as_a_miss(start_server):
    """Fetch or recompute through SGLang's own factory: with kvstore_recompute_s_per_token, batch_exists answers
    only the leading pages that load faster than SGLang would prefill them. A slow node (every page an Acquire
    answers costs 10 ms more: the test-only failpoint) answers none at 20 us a token; a fast one answers all."""
    for settings, expected in (({"testing.failpoints": "acquire.each_page=sleep:10"}, 0), ({}, 6)):
        server = start_server(settings)
        pool = SGLangHostPool("page_first", pages=12, page_size=PAGE)
        pool.fill_random(seed=5)
        plain, weighing = create(server, pool), create(server, pool, kvstore_recompute_s_per_token=20e-6)
        keys = prefix_hashes(tokens(6 * PAGE, seed=5), PAGE)
        assert plain.batch_set_v1(keys, host_indices(0, 6)) == [True] * 6
        assert weighing.batch_get_v1(keys, host_indices(6, 6)) == [True] * 6   # a read measures the tier
        assert plain.batch_exists(keys) == 6
        assert weighing.batch_exists(keys) == expected


def test_prefix_keys_chain_batches(server):
    """With hicache_storage_pass_prefix_keys, a batch hangs off the page before it."""
    pool = SGLangHostPool("page_first", pages=8, page_size=PAGE)
    pool.fill_random(seed=4)
    backend = create(server, pool)
    keys = prefix_hashes(tokens(4 * PAGE, seed=4), PAGE)
    assert backend.batch_set_v1(keys[:2], host_indices(0, 2), HiCacheStorageExtraInfo(prefix_keys=[])) == [True] * 2
    assert backend.batch_set_v1(keys[2:], host_indices(2, 2), HiCacheStorageExtraInfo(prefix_keys=keys[:2])) \
        == [True] * 2
    assert backend.batch_exists(keys) == 4
    assert backend._clients.get().lookup(backend.namespace, keys=keys) == 4


def test_a_salted_deployment_shares_no_page_with_an_unsalted_one(server):
    """SGLang passes no request's extra_key to a storage backend; kvstore_salt is the deployment's own, in
    the namespace's hash_seed: the same keys put by salted and unsalted backends never hit each other."""
    pool = SGLangHostPool("page_first", pages=8, page_size=PAGE)
    pool.fill_random(seed=11)
    plain, salted, other = (create(server, pool, **more) for more in
                            ({}, {"kvstore_salt": "tenant-a"}, {"kvstore_salt": "tenant-b"}))
    assert plain.namespace.hash_seed == "" and salted.namespace.hash_seed != other.namespace.hash_seed
    keys = prefix_hashes(tokens(3 * PAGE, seed=11), PAGE)
    assert plain.batch_set_v1(keys, host_indices(0, 3)) == [True] * 3
    assert salted.batch_exists(keys) == 0 and salted.batch_get_v1(keys, host_indices(4, 3)) == [False] * 3
    assert salted.batch_set_v1(keys, host_indices(0, 3)) == [True] * 3
    assert other.batch_exists(keys) == 0
    plain.clear()
    assert plain.batch_exists(keys) == 0 and salted.batch_exists(keys) == 3


def test_a_batch_whose_parent_the_store_evicted_is_backed_up_like_the_file_backend_does(server, tmp_path):
    """SGLang backs up the pages after its own cache hit; the store may have evicted the page before
    them. The batch is stored anchored at that parent, found by the queries SGLang makes (the pages
    after its host hit), never from the chain's start across the gap, and joined again when the
    parent is stored again: the same answers as SGLang's file backend on the same calls."""
    pool = SGLangHostPool("page_first", pages=8, page_size=PAGE)
    pool.fill_random(seed=5)
    backend = create(server, pool)
    file_backend = HiCacheFile(storage_config(server, file_storage_path=str(tmp_path / "hicache")))
    keys = prefix_hashes(tokens(6 * PAGE, seed=5), PAGE)
    flat = [pool.get_data_page(p * PAGE, flat=True).clone() for p in range(6)]
    written = [pool.page_bytes(p * PAGE) for p in range(6)]

    def set_batch(first, count, prefix):
        info = HiCacheStorageExtraInfo(prefix_keys=list(prefix))
        ours = backend.batch_set_v1(keys[first:first + count], host_indices(first, count), info)
        theirs = file_backend.batch_set(keys[first:first + count], flat[first:first + count])
        return ours, theirs

    def exists(ks):
        return backend.batch_exists(ks), file_backend.batch_exists(ks)

    assert set_batch(0, 2, []) == ([True] * 2, True)
    # The first batch leaves both stores (kvstore evicted it; the file backend's evictor did too).
    assert backend._clients.get().delete(backend.namespace, keys[:2]) == 2
    for key in keys[:2]:
        os.remove(os.path.join(file_backend.file_path, f"{file_backend._get_suffixed_key(key)}.bin"))

    assert set_batch(2, 4, keys[:2]) == ([True] * 4, True)         # kvstore used to answer [False] * 4
    assert exists(keys[2:]) == (4, 4)                              # what SGLang asks after its host hit
    assert exists(keys) == (0, 0)                                  # from the chain's start: the gap
    assert backend.batch_get_v1(keys[2:], host_indices(0, 4)) == [True] * 4
    assert [pool.page_bytes(p * PAGE) for p in range(4)] == written[2:]

    pool.set_from_flat_data_page(0, flat[0])      # the prefix is computed again and backed up again
    pool.set_from_flat_data_page(PAGE, flat[1])
    assert set_batch(0, 2, []) == ([True] * 2, True)
    assert exists(keys) == (6, 6)


def test_tp_ranks_of_an_mha_model_keep_their_own_pages(server):
    pool = SGLangHostPool("page_first", pages=4, page_size=PAGE)
    pool.fill_random(seed=5)
    rank0 = create(server, pool, tp_rank=0, tp_size=2)
    rank1 = create(server, pool, tp_rank=1, tp_size=2)
    keys = prefix_hashes(tokens(2 * PAGE, seed=5), PAGE)
    assert rank0.batch_set_v1(keys, host_indices(0, 2)) == [True, True]
    assert rank0.batch_exists(keys) == 2
    assert rank1.batch_exists(keys) == 0                         # rank 1's heads are other bytes


def test_mla_has_one_writer_and_every_rank_reads(server):
    pool = SGLangHostPool("page_first", pages=8, page_size=PAGE)
    pool.fill_random(seed=6)
    writer = create(server, pool, tp_rank=0, tp_size=2, mla=True)
    reader = create(server, pool, tp_rank=1, tp_size=2, mla=True)
    assert writer.storage_config.is_storage_writer and not reader.storage_config.is_storage_writer
    keys = prefix_hashes(tokens(2 * PAGE, seed=6), PAGE)
    assert writer.batch_set_v1(keys, host_indices(0, 2)) == [True, True]
    assert reader.batch_exists(keys) == 2
    assert reader.batch_get_v1(keys, host_indices(4, 2)) == [True, True]
    assert pool.page_bytes(4 * PAGE) == pool.page_bytes(0)


def test_a_non_writer_mla_rank_answers_what_it_stored_like_the_file_backend(server, tmp_path):
    """SGLang backs MLA pages up from the writer rank only; a backup asked of another rank answered True
    for pages it never stored. Like the file backend it writes nothing, and answers True exactly for the
    pages the store holds (once the writer stored them). The file backend does the same when it is a bounded
    cache (max_size); unbounded, its non-writer ranks write the shared file themselves."""
    pool = SGLangHostPool("page_first", pages=4, page_size=PAGE)
    pool.fill_random(seed=7)
    reader = create(server, pool, tp_rank=1, tp_size=2, mla=True)
    writer = create(server, pool, tp_rank=0, tp_size=2, mla=True)
    files = {"file_storage_path": str(tmp_path / "hicache"), "max_size": 1 << 30}   # a bounded file cache
    file_reader = HiCacheFile(storage_config(server, tp_rank=1, tp_size=2, mla=True, **files))
    file_writer = HiCacheFile(storage_config(server, tp_rank=0, tp_size=2, mla=True, **files))
    assert not reader.storage_config.is_storage_writer
    keys = prefix_hashes(tokens(2 * PAGE, seed=7), PAGE)
    flat = [pool.get_data_page(p * PAGE, flat=True).clone() for p in range(2)]
    assert reader.batch_set_v1(keys, host_indices(0, 2)) == [False, False]       # was [True, True]
    assert file_reader.batch_set(keys, flat) is False
    assert reader.batch_exists(keys) == file_reader.batch_exists(keys) == 0
    assert writer.batch_set_v1(keys[:1], host_indices(0, 1)) == [True]
    assert file_writer.batch_set(keys[:1], flat[:1]) is True
    assert reader.batch_set_v1(keys, host_indices(0, 2)) == [True, False]       # what the store holds
    assert file_reader.batch_set(keys, flat) is False and file_reader.exists(keys[0])
    assert reader.batch_set(keys[:1], flat[:1]) is file_reader.batch_set(keys[:1], flat[:1]) is True


def test_no_model_name_derives_one_like_the_file_backend_accepts_it(server, tmp_path):
    pool = SGLangHostPool("page_first", pages=4, page_size=PAGE)
    pool.fill_random(seed=8)
    backend = StorageBackendFactory.create_backend(
        "dynamic", storage_config(server, layout=pool.layout, model_name=None), pool)
    backend.register_mem_pool_host(pool)
    file_backend = HiCacheFile(storage_config(server, model_name=None,
                                              file_storage_path=str(tmp_path / "hicache")))
    keys = prefix_hashes(tokens(2 * PAGE, seed=8), PAGE)
    assert backend.batch_set_v1(keys, host_indices(0, 2)) == [True, True]   # was InvalidArgument: model empty
    assert file_backend.batch_set(keys, [pool.get_data_page(p * PAGE, flat=True) for p in range(2)]) is True
    assert backend.batch_exists(keys) == file_backend.batch_exists(keys) == 2
    assert backend.namespace.model


def test_pointer_only_set_stores_the_page_where_the_file_backend_answers_false(server, tmp_path):
    pool = SGLangHostPool("page_first", pages=4, page_size=PAGE)
    pool.fill_random(seed=9)
    backend = create(server, pool)
    file_backend = HiCacheFile(storage_config(server, file_storage_path=str(tmp_path / "hicache")))
    key = prefix_hashes(tokens(PAGE, seed=9), PAGE)[0]
    page = pool.get_data_page(0, flat=True).clone()
    pointer, nbytes = page.data_ptr(), page.numel() * page.element_size()
    assert file_backend.set(key, target_location=pointer, target_sizes=nbytes) is False
    assert backend.set(key, target_location=pointer, target_sizes=nbytes) is True   # was AttributeError
    out = torch.zeros_like(page)
    assert backend.get(key, out) is out and torch.equal(out, page)
    assert backend.set("other", target_location=pointer, target_sizes=nbytes - 1) is False   # not a page


def test_clear_empties_only_this_backends_namespace(server):
    pool = SGLangHostPool("page_first", pages=4, page_size=PAGE)
    pool.fill_random(seed=7)
    rank0 = create(server, pool, tp_rank=0, tp_size=2)
    rank1 = create(server, pool, tp_rank=1, tp_size=2)
    keys = prefix_hashes(tokens(2 * PAGE, seed=7), PAGE)
    assert rank0.batch_set_v1(keys, host_indices(0, 2)) == [True, True]
    assert rank1.batch_set_v1(keys, host_indices(0, 2)) == [True, True]
    rank0.clear()
    assert rank0.batch_exists(keys) == 0
    assert rank1.batch_exists(keys) == 2


def test_namespace_carries_model_layout_and_page_bytes(server):
    pool = SGLangHostPool("page_first", pages=4, page_size=PAGE, layer_num=3, head_num=2, head_dim=64)
    backend = create(server, pool, tp_rank=1, tp_size=4)
    ns = backend.namespace
    assert ns == backend.flat_namespace
    assert (ns.model, ns.page_tokens, ns.tp_rank, ns.tp_size) == (MODEL, PAGE, 1, 4)
    assert ns.page_bytes == 2 * 3 * PAGE * 2 * 64 * 2            # K+V, layers, tokens, heads, dim, bf16
    assert ns.kv_dtype == "bfloat16" and "page_first" in ns.layout
    with KVStoreClient(server.address) as client:                 # any client reaches the same pages
        keys = prefix_hashes(tokens(PAGE, seed=8), PAGE)
        assert backend.batch_set_v1(keys, host_indices(0, 1)) == [True]
        assert client.lookup(ns, keys=keys) == 1


@pytest.mark.parametrize("bad, message", [
    ({"kvstore_target": ""}, "kvstore_target is required"),
    ({"kvstore_tagret": "x"}, "unknown setting(s) kvstore_tagret"),
    ({"kvstore_control": "tcp"}, "kvstore_control must be"),
    ({"kvstore_timeout_s": 0}, "kvstore_timeout_s must be a positive number"),
    ({"kvstore_recompute_s_per_token": -1}, "kvstore_recompute_s_per_token must be seconds a token"),
])
def test_bad_extra_config_stops_start_up_naming_the_key(server, bad, message):
    pool = SGLangHostPool("page_first", pages=2, page_size=PAGE)
    config = storage_config(server)
    config.extra_config.update(bad)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        StorageBackendFactory.create_backend("dynamic", config, pool)


def test_unreachable_server_fails_at_start_up(tmp_path):
    from kvstore_client.errors import KVStoreError

    pool = SGLangHostPool("page_first", pages=2, page_size=PAGE)
    config = HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1, is_mla_model=False,
        enable_storage_metrics=False, is_page_first_layout=True, model_name=MODEL,
        extra_config={"backend_name": "kvstore", "module_path": "kvstore_client.adapters.sglang",
                      "class_name": "KVStoreHiCacheStorage", "kvstore_target": f"unix:{tmp_path}/no-server.sock", "kvstore_timeout_s": 1})
    with pytest.raises(KVStoreError):
        StorageBackendFactory.create_backend("dynamic", config, pool)


def test_the_host_pool_is_registered_once_with_every_client(server):
    """RDMA moves pages inside SGLang's host pool without per-call registrations (Mooncake does the same)."""
    import threading

    pool = SGLangHostPool("page_first", pages=4, page_size=PAGE)
    backend = create(server, pool)
    buffer = pool.kv_buffer
    whole = (buffer.data_ptr(), buffer.numel() * buffer.element_size())
    later = []
    thread = threading.Thread(target=lambda: later.append(backend._clients.get()))   # an I/O thread's own client
    thread.start()
    thread.join()
    for client in [backend._clients.get(), later[0]]:
        assert [(a, n) for a, n, _ in client._registered] == [whole]
    backend.close()


def test_hybrid_model_pools_back_up_and_hit_like_the_file_backend(server, tmp_path):
    """SGLang's v2 calls for a hybrid model (a Mamba state pool, trailing pages only, and a KV-shaped
    sidecar on every page, as a DSA indexer): back up, ask, load; every answer equals SGLang's file
    backend's on the same calls, and the loaded pages are the written ones, byte for byte."""
    hybrid_round_trip(server, tmp_path)


def test_a_hybrid_model_on_a_cluster_backs_up_and_hits_like_the_file_backend(cluster_pool, tmp_path):
    """The same v2 calls with kvstore_target naming a cluster: each node commits its positions' pages whole."""
    hybrid_round_trip(cluster_pool, tmp_path)


def hybrid_round_trip(server, tmp_path):
    kv = SGLangHostPool("page_first", pages=12, page_size=PAGE)
    kv.fill_random(seed=11)
    indexer = SGLangHostPool("page_first", pages=12, page_size=PAGE, layer_num=1, head_num=1, head_dim=16)
    indexer.fill_random(seed=12)
    mamba = SGLangMambaPool(slots=8)
    mamba.fill_random(seed=13)
    ours, theirs = ours_and_file_backend(server, tmp_path, kv, indexer, mamba)
    # Mamba states move straight between their slots and the arena; the KV-shaped pool through its flat page.
    assert ours._sidecars[str(PoolName.MAMBA)].zero_copy and not ours._sidecars[str(PoolName.INDEXER)].zero_copy
    keys = prefix_hashes(tokens(4 * PAGE, seed=11), PAGE)
    kv_pages = [kv.page_bytes(p * PAGE) for p in range(4)]
    indexer_pages = [indexer.page_bytes(p * PAGE) for p in range(4)]
    state = mamba.page_bytes(5)

    # What the hybrid controller's backup does: sidecars first (v2), then the KV pages.
    def backup(backend):
        info = HiCacheStorageExtraInfo(prefix_keys=[])
        sidecars = backend.batch_set_v2(
            [PoolTransfer(name=PoolName.INDEXER, host_indices=host_indices(0, 4), keys=keys,
                          hit_policy=PoolHitPolicy.ALL_PAGES, indices_from_pool=PoolName.KV)], info)
        sidecars.update(backend.batch_set_v2(
            [PoolTransfer(name=PoolName.MAMBA, host_indices=torch.tensor([5]), keys=keys[3:],
                          hit_policy=PoolHitPolicy.TRAILING_PAGES)],
            HiCacheStorageExtraInfo(prefix_keys=keys[:3])))
        if backend is ours:
            kv_result = backend.batch_set_v1(keys, host_indices(0, 4), info)
        else:
            kv_result = [backend.batch_set(keys, [kv.get_data_page(p * PAGE, flat=True) for p in range(4)])] * 4
        return sidecars, kv_result

    assert backup(ours) == backup(theirs)
    assert backup(ours)[0] == {PoolName.INDEXER: [True] * 4, PoolName.MAMBA: [True]}

    def exists(backend, span, trailing):
        result = backend.batch_exists_v2(span, [
            PoolTransfer(name=PoolName.INDEXER, keys=span, hit_policy=PoolHitPolicy.ALL_PAGES),
            PoolTransfer(name=PoolName.MAMBA, keys=span[-trailing:], hit_policy=PoolHitPolicy.TRAILING_PAGES)])
        return result.kv_hit_pages, dict(result.extra_pool_hit_pages), result.restorable_prefix_pages

    other = prefix_hashes(tokens(6 * PAGE, seed=11), PAGE)   # the same prompt, two more pages
    for span, trailing in ((keys, 1), (keys[:3], 1), (other, 1), (keys, 2)):
        assert exists(ours, span, trailing) == exists(theirs, span, trailing)
    assert exists(ours, keys, 1) == (4, {PoolName.KV: 4, PoolName.INDEXER: 4, PoolName.MAMBA: 4}, [4])
    assert exists(ours, keys[:3], 1)[0] == 0        # no state for page 3 of 3: nothing restorable

    # What a prefetch does: KV through v1, then the sidecars through v2, into other slots.
    assert ours.batch_get_v1(keys, host_indices(6, 4)) == [True] * 4
    loaded = ours.batch_get_v2([
        PoolTransfer(name=PoolName.INDEXER, host_indices=host_indices(6, 4), keys=keys,
                     hit_policy=PoolHitPolicy.ALL_PAGES, indices_from_pool=PoolName.KV),
        PoolTransfer(name=PoolName.MAMBA, host_indices=torch.tensor([1]), keys=keys[3:],
                     hit_policy=PoolHitPolicy.TRAILING_PAGES)])
    assert loaded == {PoolName.INDEXER: [True] * 4, PoolName.MAMBA: [True]}
    assert [kv.page_bytes((6 + p) * PAGE) for p in range(4)] == kv_pages
    assert [indexer.page_bytes((6 + p) * PAGE) for p in range(4)] == indexer_pages
    assert mamba.page_bytes(1) == state
    # A state SGLang asks for that was never stored is a miss, pool by pool.
    assert ours.batch_get_v2([PoolTransfer(name=PoolName.MAMBA, host_indices=torch.tensor([2]), keys=keys[2:3],
                                           hit_policy=PoolHitPolicy.TRAILING_PAGES)]) == {PoolName.MAMBA: [False]}


def hybrid_backends(server, tmp_path):
    """Ours and SGLang's file backend over the same KV pool, a DSA indexer and an MTP draft pool (a KV-shaped
    sidecar on every page each) and a Mamba state pool (trailing pages), four pages backed up as the hybrid
    controller backs them up: sidecars first through v2, then the KV pages."""
    kv = SGLangHostPool("page_first", pages=12, page_size=PAGE)
    kv.fill_random(seed=21)
    indexer = SGLangHostPool("page_first", pages=12, page_size=PAGE, layer_num=1, head_num=1, head_dim=16)
    indexer.fill_random(seed=22)
    draft = SGLangHostPool("page_first", pages=12, page_size=PAGE, layer_num=1, head_num=2, head_dim=8)
    draft.fill_random(seed=23)
    mamba = SGLangMambaPool(slots=8)
    mamba.fill_random(seed=24)
    ours = create(server, kv)
    theirs = HiCacheFile(storage_config(server, file_storage_path=str(tmp_path / "hicache")))
    theirs.register_mem_pool_host(kv)
    keys = prefix_hashes(tokens(4 * PAGE, seed=21), PAGE)
    for backend in (ours, theirs):
        backend.register_mem_host_pool_v2(kv, PoolName.KV)
        backend.register_mem_host_pool_v2(indexer, PoolName.INDEXER)
        backend.register_mem_host_pool_v2(draft, PoolName.DRAFT)
        backend.register_mem_host_pool_v2(mamba, PoolName.MAMBA)
        info = HiCacheStorageExtraInfo(prefix_keys=[])
        assert backend.batch_set_v2([PoolTransfer(name=name, host_indices=host_indices(0, 4), keys=keys,
                                                  hit_policy=PoolHitPolicy.ALL_PAGES, indices_from_pool=PoolName.KV)
                                     for name in (PoolName.INDEXER, PoolName.DRAFT)], info) == {
            PoolName.INDEXER: [True] * 4, PoolName.DRAFT: [True] * 4}
        assert backend.batch_set_v2([PoolTransfer(name=PoolName.MAMBA, host_indices=torch.tensor([5]), keys=keys[3:],
                                                  hit_policy=PoolHitPolicy.TRAILING_PAGES)],
                                    HiCacheStorageExtraInfo(prefix_keys=keys[:3])) == {PoolName.MAMBA: [True]}
    assert ours.batch_set_v1(keys, host_indices(0, 4), HiCacheStorageExtraInfo(prefix_keys=[])) == [True] * 4
    assert theirs.batch_set(keys, [kv.get_data_page(p * PAGE, flat=True) for p in range(4)])
    return ours, theirs, keys


def delete_sidecar_page(ours, theirs, pool, key):
    """Remove one position's page of one sidecar pool from both stores (kvstore also drops the pages that
    extend it in that pool, as its index is prefix-closed; the file backend drops that one file)."""
    assert ours._clients.get().delete(ours._sidecars[str(pool)].namespace, [key]) >= 1
    os.remove(os.path.join(theirs.file_path, theirs._get_component_key(key, pool) + ".bin"))


def exists_v2(backend, keys, trailing=1):
    result = backend.batch_exists_v2(keys, [
        PoolTransfer(name=PoolName.INDEXER, keys=keys, hit_policy=PoolHitPolicy.ALL_PAGES),
        PoolTransfer(name=PoolName.DRAFT, keys=keys, hit_policy=PoolHitPolicy.ALL_PAGES),
        PoolTransfer(name=PoolName.MAMBA, keys=keys[-trailing:], hit_policy=PoolHitPolicy.TRAILING_PAGES)])
    return result.kv_hit_pages, result.restorable_prefix_pages


def test_a_position_whose_sidecar_page_was_deleted_is_no_hit_like_the_file_backend(server, tmp_path):
    ours, theirs, keys = hybrid_backends(server, tmp_path)
    assert exists_v2(ours, keys) == exists_v2(theirs, keys) == (4, [4])
    # The draft page of position 2 goes: positions 2 and 3 are no longer whole, and the trailing state
    # of position 1 was never stored, so nothing is restorable; without the Mamba pool, two pages are.
    delete_sidecar_page(ours, theirs, PoolName.DRAFT, keys[2])
    assert exists_v2(ours, keys) == exists_v2(theirs, keys) == (0, [])
    every_page = [PoolTransfer(name=name, keys=keys, hit_policy=PoolHitPolicy.ALL_PAGES)
                  for name in (PoolName.INDEXER, PoolName.DRAFT)]
    answers = [backend.batch_exists_v2(keys, every_page) for backend in (ours, theirs)]
    assert [(a.kv_hit_pages, a.restorable_prefix_pages) for a in answers] == [(2, [1, 2])] * 2
    # The KV pages themselves are all still there: only the group answer shrank.
    assert ours.batch_exists(keys) == 4


def test_a_trailing_state_deleted_is_no_hit_like_the_file_backend(server, tmp_path):
    ours, theirs, keys = hybrid_backends(server, tmp_path)
    delete_sidecar_page(ours, theirs, PoolName.MAMBA, keys[3])
    assert exists_v2(ours, keys) == exists_v2(theirs, keys) == (0, [])


def test_a_get_after_a_sidecar_eviction_fails_that_position_in_every_part(server, tmp_path):
    """A hit, then the indexer page of position 2 goes before the load: positions 2 and 3 fail in the KV
    pool and in every sidecar pool of the call, never a KV page loaded without its indexer page. The file
    backend answers each part on its own; SGLang clamps to the least pool's count, which is the same 2."""
    ours, theirs, keys = hybrid_backends(server, tmp_path)
    assert exists_v2(ours, keys) == (4, [4])
    delete_sidecar_page(ours, theirs, PoolName.INDEXER, keys[2])

    def load(backend):
        return backend.batch_get_v2([PoolTransfer(name=name, host_indices=host_indices(6, 4), keys=keys,
                                                  indices_from_pool=PoolName.KV)
                                     for name in (PoolName.KV, PoolName.INDEXER, PoolName.DRAFT)])

    loaded = load(ours)
    assert loaded == {name: [True, True, False, False] for name in (PoolName.KV, PoolName.INDEXER, PoolName.DRAFT)}
    theirs_loaded = load(theirs)
    assert theirs_loaded[PoolName.KV] == [True] * 4 and theirs_loaded[PoolName.INDEXER] == [True, True, False, True]
    assert min(count_pool_hits(loaded).values()) == min(count_pool_hits(theirs_loaded).values()) == 2
    # A trailing state asked beside pages that failed fails with them.
    assert ours.batch_get_v2([
        PoolTransfer(name=PoolName.INDEXER, host_indices=host_indices(6, 4), keys=keys, indices_from_pool=PoolName.KV),
        PoolTransfer(name=PoolName.MAMBA, host_indices=torch.tensor([1]), keys=keys[3:],
                     hit_policy=PoolHitPolicy.TRAILING_PAGES)]) == {PoolName.INDEXER: [True, True, False, False],
                                                                   PoolName.MAMBA: [False]}
    assert theirs.batch_get_v2([PoolTransfer(name=PoolName.MAMBA, host_indices=torch.tensor([1]), keys=keys[3:],
                                             hit_policy=PoolHitPolicy.TRAILING_PAGES)]) == {PoolName.MAMBA: [True]}


def test_an_mla_hybrid_shares_its_indexer_across_ranks_and_shards_its_states_like_the_file_backend(server, tmp_path):
    """An MLA model with a DSA indexer and Mamba states at TP 2, backed up as SGLang's hybrid controller
    does: the writer rank stores the indexer, its Mamba shard and the KV; the other rank stores only its own
    Mamba shard. Both ranks then see the whole group (the indexer kept per rank was never found by rank 1),
    each loads its own state, and a deleted indexer page is no hit on either; as the file backend answers."""
    kv = SGLangHostPool("page_first", pages=12, page_size=PAGE)
    kv.fill_random(seed=31)
    indexer = SGLangHostPool("page_first", pages=12, page_size=PAGE, layer_num=1, head_num=1, head_dim=16)
    indexer.fill_random(seed=32)
    states = [SGLangMambaPool(slots=8) for _ in range(2)]
    for rank, state in enumerate(states):
        state.fill_random(seed=33 + rank)
    files = str(tmp_path / "hicache")
    ours = [create(server, kv, tp_rank=rank, tp_size=2, mla=True) for rank in range(2)]
    theirs = [HiCacheFile(storage_config(server, tp_rank=rank, tp_size=2, mla=True, file_storage_path=files))
              for rank in range(2)]
    keys = prefix_hashes(tokens(4 * PAGE, seed=31), PAGE)
    every_page = PoolTransfer(name=PoolName.INDEXER, host_indices=host_indices(0, 4), keys=keys,
                              hit_policy=PoolHitPolicy.ALL_PAGES, indices_from_pool=PoolName.KV)

    def last_state(rank, slot):
        return PoolTransfer(name=PoolName.MAMBA, host_indices=torch.tensor([slot]), keys=keys[3:],
                            hit_policy=PoolHitPolicy.TRAILING_PAGES)

    for backends in (ours, theirs):
        for rank, backend in enumerate(backends):
            if backend is theirs[rank]:
                backend.register_mem_pool_host(kv)
            backend.register_mem_host_pool_v2(indexer, PoolName.INDEXER)
            backend.register_mem_host_pool_v2(states[rank], PoolName.MAMBA)
        writer, other = backends
        assert writer.batch_set_v2([every_page], HiCacheStorageExtraInfo(prefix_keys=[])) == {
            PoolName.INDEXER: [True] * 4}
        for backend in backends:   # the state is TP-sharded: every rank backs up its own
            assert backend.batch_set_v2([last_state(0, 5)], HiCacheStorageExtraInfo(prefix_keys=keys[:3])) == {
                PoolName.MAMBA: [True]}
    assert ours[0].batch_set_v1(keys, host_indices(0, 4)) == [True] * 4
    assert theirs[0].batch_set(keys, [kv.get_data_page(p * PAGE, flat=True) for p in range(4)])
    for rank in range(2):
        assert exists_v2_indexer_mamba(ours[rank], keys) == exists_v2_indexer_mamba(theirs[rank], keys) == (4, [4])
    # A non-writer asked to back up the shared indexer writes nothing and answers what the store holds.
    assert ours[1].batch_set_v2([every_page]) == {PoolName.INDEXER: [True] * 4}
    assert ours[1].batch_get_v1(keys, host_indices(6, 4)) == [True] * 4
    assert ours[1].batch_get_v2([
        PoolTransfer(name=PoolName.INDEXER, host_indices=host_indices(6, 4), keys=keys, indices_from_pool=PoolName.KV),
        last_state(1, 1)], HiCacheStorageExtraInfo(prefix_keys=[])) == {PoolName.INDEXER: [True] * 4,
                                                                         PoolName.MAMBA: [True]}
    assert states[1].page_bytes(1) == states[1].page_bytes(5) != states[0].page_bytes(5)
    assert [indexer.page_bytes((6 + p) * PAGE) for p in range(4)] == [indexer.page_bytes(p * PAGE) for p in range(4)]

    delete_sidecar_page(ours[0], theirs[0], PoolName.INDEXER, keys[1])
    for rank in range(2):
        assert exists_v2_indexer_mamba(ours[rank], keys) == exists_v2_indexer_mamba(theirs[rank], keys) == (0, [])


def exists_v2_indexer_mamba(backend, keys):
    result = backend.batch_exists_v2(keys, [
        PoolTransfer(name=PoolName.INDEXER, keys=keys, hit_policy=PoolHitPolicy.ALL_PAGES),
        PoolTransfer(name=PoolName.MAMBA, keys=keys[-1:], hit_policy=PoolHitPolicy.TRAILING_PAGES)])
    return result.kv_hit_pages, result.restorable_prefix_pages


def ours_and_file_backend(server, tmp_path, kv, indexer, mamba):
    """kvstore's backend and SGLang's file backend over the same KV pool, each with the indexer and Mamba pools."""
    ours = create(server, kv)
    theirs = HiCacheFile(storage_config(server, file_storage_path=str(tmp_path / "hicache")))
    theirs.register_mem_pool_host(kv)
    for backend in (ours, theirs):
        backend.register_mem_host_pool_v2(indexer, PoolName.INDEXER)
        backend.register_mem_host_pool_v2(mamba, PoolName.MAMBA)
    return ours, theirs

def hybrid_pools(seed):
    """A KV pool, a DSA indexer pool (a page beside every KV page) and a Mamba state pool (trailing pages)."""
    kv = SGLangHostPool("page_first", pages=12, page_size=PAGE)
    indexer = SGLangHostPool("page_first", pages=12, page_size=PAGE, layer_num=1, head_num=1, head_dim=16)
    mamba = SGLangMambaPool(slots=12)
    for offset, pool in enumerate((kv, indexer, mamba)):
        pool.fill_random(seed=seed + offset)
    return kv, indexer, mamba


def back_up_position(backend, kv, keys, i):
    """One backup of the page at position i as SGLang's hybrid controller makes it: the sidecars through
    batch_set_v2 (the indexer page and the trailing Mamba state), then the KV page (v1, or the generic set)."""
    info = HiCacheStorageExtraInfo(prefix_keys=keys[:i])
    sidecars = backend.batch_set_v2([
        PoolTransfer(name=PoolName.INDEXER, host_indices=host_indices(i, 1), keys=keys[i:i + 1],
                     hit_policy=PoolHitPolicy.ALL_PAGES, indices_from_pool=PoolName.KV),
        PoolTransfer(name=PoolName.MAMBA, host_indices=torch.tensor([i]), keys=keys[i:i + 1],
                     hit_policy=PoolHitPolicy.TRAILING_PAGES)], info)
    if isinstance(backend, KVStoreHiCacheStorage):
        return sidecars, backend.batch_set_v1(keys[i:i + 1], host_indices(i, 1), info)
    return sidecars, [backend.batch_set(keys[i:i + 1], [kv.get_data_page(i * PAGE, flat=True)])]


def test_a_backup_makes_each_position_visible_whole_and_hits_like_the_file_backend(server, tmp_path):
    """The sidecar pages SGLang backs up before their KV page are not visible until the KV page is, and then
    all of them are, in one commit: a reader hammering the node's group lookup, with every part in turn as
    the one that bounds the answer, never finds one part of a position ahead of another. At the end every
    batch_exists_v2 answer equals SGLang's file backend's on the same backups."""
    kv, indexer, mamba = hybrid_pools(seed=41)
    ours, theirs = ours_and_file_backend(server, tmp_path, kv, indexer, mamba)
    keys = prefix_hashes(tokens(10 * PAGE, seed=41), PAGE)
    namespaces = [ours.namespace, ours._sidecars[str(PoolName.INDEXER)].namespace,
                  ours._sidecars[str(PoolName.MAMBA)].namespace]
    client = ours._clients.get()

    # Sidecars staged, KV not yet written: nothing of position 0 is visible, in any pool.
    ours.batch_set_v2([PoolTransfer(name=PoolName.INDEXER, host_indices=host_indices(0, 1), keys=keys[:1],
                                    hit_policy=PoolHitPolicy.ALL_PAGES, indices_from_pool=PoolName.KV),
                       PoolTransfer(name=PoolName.MAMBA, host_indices=torch.tensor([0]), keys=keys[:1],
                                    hit_policy=PoolHitPolicy.TRAILING_PAGES)], HiCacheStorageExtraInfo(prefix_keys=[]))
    assert [client.lookup(ns, keys=keys[:1]) for ns in namespaces] == [0, 0, 0]
    assert ours.batch_set_v1(keys[:1], host_indices(0, 1), HiCacheStorageExtraInfo(prefix_keys=[])) == [True]
    assert [client.lookup(ns, keys=keys[:1]) for ns in namespaces] == [1, 1, 1]

    done, ahead, failures = threading.Event(), [], []

    def backup():
        try:
            for i in range(1, len(keys)):
                assert back_up_position(ours, kv, keys, i) == ({PoolName.INDEXER: [True], PoolName.MAMBA: [True]},
                                                               [True])
        except Exception as exc:   # reported by the test's thread
            failures.append(exc)
        finally:
            done.set()

    with KVStoreClient(server.address, timeout_s=10) as reader:
        orders = [[GroupPart(namespaces[0]), GroupPart(namespaces[1])],
                  [GroupPart(namespaces[1]), GroupPart(namespaces[0])],
                  [GroupPart(namespaces[2]), GroupPart(namespaces[0]), GroupPart(namespaces[1])]]
        thread = threading.Thread(target=backup)
        thread.start()
        rounds = 0
        while not done.is_set():
            for parts in orders:
                hits = reader.lookup_group(keys[1:], parts)
                if hits.part_hit_pages[0] != hits.hit_pages:
                    ahead.append((parts[0].namespace.layout, hits))
            rounds += 1
        thread.join()
    assert not failures and rounds > 1
    assert not ahead, f"a part was visible before its position's other parts: {ahead[:2]}"
    assert len(ours._held) == 0

    for i in range(len(keys)):
        back_up_position(theirs, kv, keys, i)
    exists_answers_agree(ours, theirs, ((keys, 1), (keys[:5], 1), (keys, 3), (keys[:7], 2)))


def exists_answers_agree(ours, theirs, spans):
    """batch_exists_v2 answers the same on both backends, for each (span, the Mamba pool's trailing pages),
    and every span's KV pages all hit."""
    for span, trailing in spans:
        answers = [backend.batch_exists_v2(span, [
            PoolTransfer(name=PoolName.INDEXER, keys=span, hit_policy=PoolHitPolicy.ALL_PAGES),
            PoolTransfer(name=PoolName.MAMBA, keys=span[-trailing:], hit_policy=PoolHitPolicy.TRAILING_PAGES)])
            for backend in (ours, theirs)]
        ours_answer, theirs_answer = [(a.kv_hit_pages, dict(a.extra_pool_hit_pages), a.restorable_prefix_pages)
                                      for a in answers]
        assert ours_answer == theirs_answer and ours_answer[0] == len(span), (len(span), trailing)


def test_sidecar_pages_whose_kv_page_never_comes_are_never_visible(start_server, tmp_path):
    """A sidecar backup whose KV write never arrives: its pages stay staged until their write lease's TTL,
    then the node aborts them, unseen. The KV page stored later stands alone, and the position answers
    absent for a pool that needs the lost page (never a KV page paired with a missing state)."""
    server = start_server({"leases.write_ttl_ms": 1000, "leases.reap_interval_ms": 50})
    kv, indexer, mamba = hybrid_pools(seed=51)
    ours = create(server, kv)
    ours.register_mem_host_pool_v2(indexer, PoolName.INDEXER)
    keys = prefix_hashes(tokens(2 * PAGE, seed=51), PAGE)
    info = HiCacheStorageExtraInfo(prefix_keys=[])
    assert ours.batch_set_v2([PoolTransfer(name=PoolName.INDEXER, host_indices=host_indices(0, 2), keys=keys,
                                           hit_policy=PoolHitPolicy.ALL_PAGES, indices_from_pool=PoolName.KV)],
                             info) == {PoolName.INDEXER: [True, True]}
    client = ours._clients.get()
    assert client.stats().leases_open == 1
    time.sleep(1.3)
    assert client.stats().leases_open == 0 and client.stats().leases_expired == 1
    assert ours.batch_set_v1(keys, host_indices(0, 2), info) == [True, True]
    assert client.lookup(ours._sidecars[str(PoolName.INDEXER)].namespace, keys=keys) == 0
    answer = ours.batch_exists_v2(keys, [PoolTransfer(name=PoolName.INDEXER, keys=keys,
                                                      hit_policy=PoolHitPolicy.ALL_PAGES)])
    assert (answer.kv_hit_pages, answer.restorable_prefix_pages) == (0, [])
    assert ours.batch_exists(keys) == 2


def test_a_span_longer_than_one_group_lookup_hits_like_the_file_backend(start_server, tmp_path):
    """A prompt longer than limits.lookup_pages_max (32,768 pages: 32,768 tokens at SGLang's page size of
    1) is looked up window by window: the trailing pool's state at its end still counts, as on SGLang's
    file backend. Here the node's limit is 4 pages, so 10 positions take several windows."""
    server = start_server({"limits.lookup_pages_max": 4})
    kv, indexer, mamba = hybrid_pools(seed=61)
    ours, theirs = ours_and_file_backend(server, tmp_path, kv, indexer, mamba)
    keys = prefix_hashes(tokens(10 * PAGE, seed=61), PAGE)
    for i in range(len(keys)):
        for backend in (ours, theirs):
            back_up_position(backend, kv, keys, i)
    exists_answers_agree(ours, theirs, ((keys, 1), (keys, 3), (keys[:7], 2), (keys[:9], 1), (keys[:4], 1)))
