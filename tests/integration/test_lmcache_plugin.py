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
import time
from importlib.metadata import version

import pytest
import torch

from lmcache.utils import CacheEngineKey  # noqa: E402
from lmcache.v1.config import LMCacheEngineConfig  # noqa: E402
from lmcache.v1.metadata import LMCacheMetadata  # noqa: E402
from lmcache.v1.storage_backend.connector import CreateConnector  # noqa: E402
from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend  # noqa: E402
from lmcache.v1.storage_backend.remote_backend import RemoteBackend  # noqa: E402

from cluster_parts import cluster_pool, etcd, start_node  # noqa: E402,F401  (three nodes in a real etcd)
from kvstore_client.adapters.lmcache import KVStoreConnector  # noqa: E402

LMCACHE_VERSION = "0.5.6"
MODEL = "meta-llama/Llama-3.1-8B-Instruct"
CHUNK = 16
KV_SHAPE = (4, 2, CHUNK, 2, 32)  # layers, K/V, tokens, kv heads, head dim


def test_lmcache_is_the_pinned_release():
    assert version("lmcache") == LMCACHE_VERSION


@pytest.fixture
def loop():
    """LMCache's event loop on its thread; the engines a test made on it are closed before it stops, so their
    connectors' threads do not outlive the test."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield loop
    for engine in Engine.made.pop(loop, []):
        engine.remote.close()
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

    made: dict = {}   # loop -> the engines made on it, for the loop fixture to close

    def __init__(self, config, loop, worker_id=0, world_size=1, plugin="kvstore"):
        self.metadata = make_metadata(worker_id, world_size)
        self.cpu = LocalCPUBackend(config, self.metadata, dst_device="cpu")
        self.remote = RemoteBackend(config, self.metadata, loop, self.cpu, dst_device="cpu", plugin_name=plugin)
        self.loop = loop
        Engine.made.setdefault(loop, []).append(self)
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


def fs_control(loop, path):
    """LMCache's own fs connector on the same CPU path: the control for LMCache's contracts."""
    config = LMCacheEngineConfig.from_defaults(chunk_size=CHUNK, local_cpu=False, max_local_cpu_size=0.05,
                                               remote_serde="naive", remote_url=f"fs://host:0/{path}",
                                               lmcache_instance_id="kvstore-test-fs")
    metadata = make_metadata()
    cpu = LocalCPUBackend(config, metadata, dst_device="cpu")
    return RemoteBackend(config, metadata, loop, cpu, dst_device="cpu")


def scribble(cpu, seed):
    """Fill the CPU buffer LMCache's next allocation gets with new bytes, as serving requests does."""
    obj = cpu.allocate(cpu.metadata.get_shapes(), cpu.metadata.get_dtypes())
    obj.tensor.copy_(torch.randn(obj.tensor.shape, generator=torch.Generator().manual_seed(seed)).to(obj.tensor.dtype))
    obj.ref_count_down()


def test_health_monitor_probe_recovers_like_the_fs_connector(server, loop, tmp_path):
    """LMCache's RemoteBackendHealthCheck puts fresh bytes under one probe key and reads them back after a
    failure; kvstore kept the first write, so the check failed forever. It passes again and again, as on fs."""
    from lmcache.v1.health_monitor.checks.remote_backend_check import RemoteBackendHealthCheck

    engine = Engine(make_config(server), loop)
    for backend in (fs_control(loop, tmp_path), engine.remote):
        check = RemoteBackendHealthCheck(backend)
        for probe in range(3):
            scribble(backend.local_cpu_backend, seed=probe)   # the probe's buffer holds other bytes each time
            check.failure_time = time.time() - 3600    # a read failure long enough ago: recovery is tried
            assert check.check(), f"health check of {backend.remote_url} did not recover"
            assert check.failure_time is None


def test_a_chunk_put_again_keeps_its_first_bytes_and_what_extends_it(server, loop):
    """A chunk's key names its content, so the first write stands (LMCache's own probe key aside)."""
    engine = Engine(make_config(server), loop)
    keys = [engine.key(0x6000 + i) for i in range(3)]
    first = [engine.chunk(seed=50 + i) for i in range(3)]
    expected = raw(first[0])
    engine.put(keys, first)
    engine.put(keys[:1], [engine.chunk(seed=60)])     # the same chunk again, its bytes not bit-identical
    assert raw(engine.remote.get_blocking(keys[0])) == expected
    assert engine.leading(keys) == 3, "the put again dropped the chunks after it"


@pytest.mark.parametrize("engines", [2, 4, 16])
def test_engines_sharing_a_prefix_keep_every_continuation(server, loop, tmp_path, engines):
    """Engines with one shared first chunk (each computed it: its bytes differ a little), each its own
    continuation: through LMCache's own backend every continuation survives byte for byte, read by another
    engine, as with its fs connector; the shared chunk is one engine's."""
    control = [fs_control(loop, tmp_path) for _ in range(engines)]
    ours = [Engine(make_config(server), loop) for _ in range(engines)]
    for backends in (control, [engine.remote for engine in ours]):
        shared = ours[0].key(0x7000)
        chains = [[shared] + [ours[0].key(0x7100 * (e + 1) + i) for i in range(2)] for e in range(engines)]
        put = []
        for e, (backend, keys) in enumerate(zip(backends, chains)):
            objs = [chunk_of(backend, seed=70 + 10 * e + i) for i in range(3)]
            put.append([raw(obj) for obj in objs])
            put_through(backend, keys, objs)
        for e, keys in enumerate(chains):
            reader = backends[(e + 1) % engines]
            assert leading_of(reader, loop, keys) == 3, (reader.remote_url, e)
            loaded = [raw_of(reader, key) for key in keys]
            assert loaded[1:] == put[e][1:], (reader.remote_url, e)
            assert loaded[0] in [chain[0] for chain in put]


def raw_of(backend, key):
    obj = backend.get_blocking(key)
    assert obj is not None, f"{backend.remote_url}: {key} is gone"
    data = raw(obj)
    obj.ref_count_down()
    return data


def put_through(backend, keys, objs):
    done = threading.Semaphore(0)
    backend.batched_submit_put_task(keys, objs, on_complete_callback=lambda key: done.release())
    for _ in keys:
        assert done.acquire(timeout=10), "LMCache's put task did not finish"


def chunk_of(backend, seed):
    cpu = backend.local_cpu_backend
    obj = cpu.allocate(cpu.metadata.get_shapes(), cpu.metadata.get_dtypes())
    obj.tensor.copy_(torch.randn(obj.tensor.shape, generator=torch.Generator().manual_seed(seed)).to(obj.tensor.dtype))
    return obj


def leading_of(backend, loop, keys):
    return asyncio.run_coroutine_threadsafe(backend.batched_async_contains("lookup", keys), loop).result(10)


def test_the_adapter_claims_only_kvstore_urls(server, loop):
    """With a second third-party plugin configured, LMCache builds each plugin's connector from its own
    adapter whatever order the plugins load in (it is a set: the order follows the hash seed)."""
    from lmcache.v1.storage_backend.connector import ConnectorManager
    from lmcache_other_plugin import OtherConnector

    from kvstore_client.adapters.lmcache import KVStoreConnectorAdapter

    adapter = KVStoreConnectorAdapter()
    assert adapter.can_parse("plugin://kvstore") and adapter.can_parse("plugin://kvstore.main")
    assert adapter.can_parse(f"kvstore://{server.address}")
    assert not adapter.can_parse("plugin://other") and not adapter.can_parse("plugin://kvstorex")
    config = make_config(server, plugin="kvstore.main", class_name="KVStoreConnectorAdapter")
    config.remote_storage_plugins = ["kvstore.main", "other"]
    config.extra_config.update({"remote_storage_plugin.other.module_path": "lmcache_other_plugin",
                                "remote_storage_plugin.other.class_name": "OtherConnector"})
    cpu = LocalCPUBackend(config, make_metadata(), dst_device="cpu")
    for name, expected in (("other", OtherConnector), ("kvstore.main", KVStoreConnector)):
        manager = ConnectorManager(f"plugin://{name}", loop, cpu, config, make_metadata(), plugin_name=name)
        for order in (list(manager.adapters), list(reversed(manager.adapters))):
            manager.adapters = order
            assert isinstance(manager.create_connector(), expected)


def test_two_instances_of_the_connector_class_stop_lmcache_saying_why(server, loop):
    """LMCache's dynamic path cannot say which of two plugins naming the connector class it builds; a
    warning it swallows left the engine without a store. Now LMCache's start-up fails, naming the fix."""
    from lmcache.v1.exceptions import IrrecoverableException

    config = make_config(server, plugin="kvstore.a")
    config.remote_storage_plugins = ["kvstore.a", "kvstore.b"]
    config.extra_config.update({f"remote_storage_plugin.kvstore.b.{k}": v for k, v in {
        "module_path": "kvstore_client.adapters.lmcache", "class_name": "KVStoreConnector",
        "target": server.address}.items()})
    with pytest.raises(IrrecoverableException, match="KVStoreConnectorAdapter"):
        Engine(config, loop, plugin="kvstore.b")


def test_two_instances_through_the_adapter_each_reach_their_own_node(start_server, loop):
    first, second = start_server(), start_server()
    config = make_config(first, plugin="kvstore.a", class_name="KVStoreConnectorAdapter")
    config.remote_storage_plugins = ["kvstore.a", "kvstore.b"]
    config.extra_config.update({f"remote_storage_plugin.kvstore.b.{k}": v for k, v in {
        "module_path": "kvstore_client.adapters.lmcache", "class_name": "KVStoreConnectorAdapter",
        "target": second.address}.items()})
    a, b = Engine(config, loop, plugin="kvstore.a"), Engine(config, loop, plugin="kvstore.b")
    a.put([a.key(0x7000)], [a.chunk(seed=60)])
    assert a.leading([a.key(0x7000)]) == 1 and b.leading([b.key(0x7000)]) == 0
    b.put([b.key(0x7001)], [b.chunk(seed=61)])
    assert b.leading([b.key(0x7001)]) == 1 and a.leading([a.key(0x7001)]) == 0


def test_list_names_every_stored_chunk_like_the_fs_connector(server, loop, tmp_path):
    engine = Engine(make_config(server), loop)
    control = fs_control(loop, tmp_path)
    worker1 = Engine(make_config(server), loop, worker_id=1, world_size=2)
    keys = [engine.key(0x8000 + i) for i in range(3)]
    other = [worker1.key(0x9000)]
    engine.put(keys, [engine.chunk(seed=70 + i) for i in range(3)])
    worker1.put(other, [worker1.chunk(seed=80)])
    for key, obj in [(k, engine.chunk(seed=90)) for k in keys] + [(other[0], worker1.chunk(seed=91))]:
        control.submit_put_task(key, obj).result(10)

    def listed(backend):
        return sorted(asyncio.run_coroutine_threadsafe(backend.connection.list(), loop).result(10))

    ours = listed(engine.remote)
    assert ours == sorted(k.to_string() for k in keys + other)    # was NotImplementedError
    assert ours == [name.replace("-SEP-", "/") for name in listed(control)]
    assert listed(worker1.remote) == ours                           # one node, one answer for every worker


def test_tags_and_the_salt_keep_requests_apart(server, loop):
    """A request's tags (request_configs "lmcache.tag.*", what LMCache passes a connector per request) and
    the plugin's .salt go into the namespace's hash_seed: the same chunk hashes, put with other tags or
    another salt, never hit each other."""
    plain = Engine(make_config(server), loop)
    salted = Engine(make_config(server, salt="tenant-a"), loop)
    hashes = [0x5A17 + i for i in range(3)]

    def tagged(chunk_hash):
        return CacheEngineKey(MODEL, 1, 0, chunk_hash, torch.bfloat16, request_configs={"lmcache.tag.user": "alice"})

    plain.put([plain.key(h) for h in hashes], [plain.chunk(i) for i in range(3)])
    assert plain.leading([plain.key(h) for h in hashes]) == 3
    assert plain.leading([tagged(h) for h in hashes]) == 0
    assert salted.leading([salted.key(h) for h in hashes]) == 0
    plain.put([tagged(h) for h in hashes], [plain.chunk(10 + i) for i in range(3)])
    assert plain.leading([tagged(h) for h in hashes]) == 3
    assert salted.leading([tagged(h) for h in hashes]) == 0
    salted.put([salted.key(h) for h in hashes[:1]], [salted.chunk(20)])
    assert salted.leading([salted.key(h) for h in hashes]) == 1 and plain.leading([plain.key(h) for h in hashes]) == 3


def test_lmcaches_loader_takes_a_cluster_and_a_lost_node_costs_only_its_chunks(cluster_pool, loop):
    engine = Engine(make_config(cluster_pool), loop)                    # remote_storage_plugin target: etcd://
    keys = [engine.key(0x2000 + i) for i in range(24)]
    objs = [engine.chunk(seed=100 + i) for i in range(24)]
    engine.put(keys, objs)
    assert engine.leading(keys) == 24
    assert [raw(o) for o in engine.remote.batched_get_blocking(keys)] == [raw(o) for o in objs]
    cluster_pool.nodes["p2"].kill()                                      # SIGKILL, mid-run
    time.sleep(3)                                                       # past its 2 s lease: it leaves the view
    loaded = engine.remote.batched_get_blocking(keys)
    kept = next((i for i, o in enumerate(loaded) if o is None), len(keys))
    assert kept == engine.leading(keys)
    assert [raw(o) for o in loaded[:kept]] == [raw(o) for o in objs[:kept]]   # what is loaded is what was put
    fresh = [engine.key(0x3000 + i) for i in range(8)]
    engine.put(fresh, objs[:8])                                          # new chunks land on the two left
    assert engine.leading(fresh) == 8
