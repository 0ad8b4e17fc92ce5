"""LMCache 0.5.6's own RemoteBackend loads the kvstore connector through its
remote_storage_plugins mechanism, and stores, counts (leading chunks) and retrieves
chunks through it against a real kvstore-server, byte for byte.

Everything here is LMCache's CPU path: its config, metadata, LocalCPUBackend (the buffers
chunks are loaded into), RemoteBackend and plugin loader. What needs a GPU is moving the
chunks between vLLM's paged KV cache and those buffers (LMCache's GPU connector), which
is not the storage plugin's business.
"""

from __future__ import annotations

import asyncio
import threading
from importlib.metadata import version

import pytest
import torch

from lmcache.utils import CacheEngineKey  # noqa: E402
from lmcache.v1.config import LMCacheEngineConfig  # noqa: E402
from lmcache.v1.metadata import LMCacheMetadata  # noqa: E402
from lmcache.v1.storage_backend.connector import CreateConnector  # noqa: E402
from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend  # noqa: E402
from lmcache.v1.storage_backend.remote_backend import RemoteBackend  # noqa: E402

from kvstore_client.adapters.lmcache import KVStoreConnector  # noqa: E402

LMCACHE_VERSION = "0.5.6"
MODEL = "meta-llama/Llama-3.1-8B-Instruct"
CHUNK = 16
KV_SHAPE = (4, 2, CHUNK, 2, 32)  # layers, K/V, tokens, kv heads, head dim


def test_lmcache_is_the_pinned_release():
    assert version("lmcache") == LMCACHE_VERSION


@pytest.fixture
def loop():
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield loop
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)
    loop.close()


def make_config(server, plugin="kvstore", class_name="KVStoreConnector", **settings):
    extra = {f"remote_storage_plugin.{plugin}.module_path": "kvstore_client.adapters.lmcache",
             f"remote_storage_plugin.{plugin}.class_name": class_name,
             f"remote_storage_plugin.{plugin}.target": server.address,
             f"remote_storage_plugin.{plugin}.timeout_s": 10}
    extra.update({f"remote_storage_plugin.{plugin}.{k}": v for k, v in settings.items()})
    return LMCacheEngineConfig.from_defaults(
        chunk_size=CHUNK, local_cpu=False, max_local_cpu_size=0.05, remote_serde="naive",
        remote_storage_plugins=[plugin], extra_config=extra, lmcache_instance_id="kvstore-test")


def make_metadata(worker_id=0, world_size=1):
    return LMCacheMetadata(model_name=MODEL, world_size=world_size, local_world_size=world_size,
                           worker_id=worker_id, local_worker_id=worker_id, kv_dtype=torch.bfloat16,
                           kv_shape=KV_SHAPE, chunk_size=CHUNK)


class Engine:
    """LMCache's CPU buffer plus its remote backend for one plugin, as LMCache wires them."""

    def __init__(self, config, loop, worker_id=0, world_size=1, plugin="kvstore"):
        self.metadata = make_metadata(worker_id, world_size)
        self.cpu = LocalCPUBackend(config, self.metadata, dst_device="cpu")
        self.remote = RemoteBackend(config, self.metadata, loop, self.cpu, dst_device="cpu", plugin_name=plugin)
        self.loop = loop
        assert self.remote.connection is not None, "LMCache could not create the kvstore connector"

    def chunk(self, seed, tokens=CHUNK):
        obj = self.cpu.allocate(self.metadata.get_shapes(tokens), self.metadata.get_dtypes())
        generator = torch.Generator().manual_seed(seed)
        obj.tensor.copy_(torch.randn(obj.tensor.shape, generator=generator).to(obj.tensor.dtype))
        return obj

    def key(self, chunk_hash):
        return CacheEngineKey(MODEL, self.metadata.world_size, self.metadata.worker_id, chunk_hash, torch.bfloat16)

    def put(self, keys, objs):
        """LMCache's batched put, waited for through its per-key completion callback."""
        done = threading.Semaphore(0)
        self.remote.batched_submit_put_task(keys, objs, on_complete_callback=lambda key: done.release())
        for _ in keys:
            assert done.acquire(timeout=10), "LMCache's put task did not finish"

    def leading(self, keys):
        future = asyncio.run_coroutine_threadsafe(self.remote.batched_async_contains("lookup", keys), self.loop)
        return future.result(10)


def raw(obj):
    return bytes(obj.byte_array)


def test_plugin_loader_creates_the_kvstore_connector(server, loop):
    engine = Engine(make_config(server), loop)
    assert isinstance(engine.remote.connection._connector, KVStoreConnector)
    assert engine.remote.connection.support_batched_put()
    assert engine.remote.connection.support_batched_get()
    assert engine.remote.connection.support_batched_async_contains()


def test_chunks_round_trip_and_count_leading_hits(server, loop):
    engine = Engine(make_config(server), loop)
    keys = [engine.key(0x1000 + i) for i in range(6)]
    objs = [engine.chunk(seed=i) for i in range(6)]
    expected = [raw(o) for o in objs]
    assert engine.leading(keys) == 0
    engine.put(keys[:4], objs[:4])
    assert engine.leading(keys) == 4
    assert engine.leading([keys[4]] + keys) == 0
    assert engine.remote.contains(keys[2]) and not engine.remote.contains(keys[5])

    loaded = engine.remote.batched_get_blocking(keys)
    assert [raw(o) for o in loaded[:4]] == expected[:4]
    assert loaded[4:] == [None, None]
    single = engine.remote.get_blocking(keys[1])
    assert raw(single) == expected[1] and single.get_shapes() == engine.metadata.get_shapes()


def test_a_partial_last_chunk_loads_with_its_own_shape(server, loop):
    engine = Engine(make_config(server), loop)
    keys = [engine.key(0x2000), engine.key(0x2001)]
    objs = [engine.chunk(seed=10), engine.chunk(seed=11, tokens=5)]
    expected = [raw(o) for o in objs]                            # LMCache frees the buffers once stored
    engine.put(keys, objs)
    loaded = engine.remote.batched_get_blocking(keys)
    assert [raw(o) for o in loaded] == expected
    assert loaded[1].get_shape()[2] == 5                         # [K/V, layers, tokens, hidden]


def test_workers_and_models_do_not_share_chunks(server, loop):
    config = make_config(server)
    worker0 = Engine(config, loop, worker_id=0, world_size=2)
    worker1 = Engine(config, loop, worker_id=1, world_size=2)
    keys0 = [worker0.key(0x3000)]
    worker0.put(keys0, [worker0.chunk(seed=20)])
    assert worker0.leading(keys0) == 1
    assert worker1.leading([worker1.key(0x3000)]) == 0         # same hash, other TP shard


def test_remove_drops_the_chunk_and_those_after_it(server, loop):
    engine = Engine(make_config(server), loop)
    keys = [engine.key(0x4000 + i) for i in range(3)]
    engine.put(keys, [engine.chunk(seed=30 + i) for i in range(3)])
    assert engine.remote.remove(keys[1])
    assert engine.leading(keys) == 1


def test_adapter_path_knows_the_plugin_instance(server, loop):
    config = make_config(server, plugin="kvstore.primary", class_name="KVStoreConnectorAdapter")
    engine = Engine(config, loop, plugin="kvstore.primary")
    connector = engine.remote.connection._connector
    assert isinstance(connector, KVStoreConnector) and connector.plugin_name == "kvstore.primary"
    keys = [engine.key(0x5000)]
    obj = engine.chunk(seed=40)
    expected = raw(obj)
    engine.put(keys, [obj])
    assert raw(engine.remote.get_blocking(keys[0])) == expected


@pytest.mark.parametrize("settings, message", [
    ({"target": ""}, "target is required"),
    ({"tagret": "x"}, r"unknown setting\(s\) remote_storage_plugin.kvstore.tagret"),
    ({"control": "tcp"}, "control must be"),
])
def test_bad_plugin_settings_fail_naming_the_key(server, loop, settings, message):
    config = make_config(server, **settings)
    cpu = LocalCPUBackend(config, make_metadata(), dst_device="cpu")
    with pytest.raises(ValueError, match=message):
        CreateConnector("plugin://kvstore", loop, cpu, config, make_metadata(), plugin_name="kvstore")
