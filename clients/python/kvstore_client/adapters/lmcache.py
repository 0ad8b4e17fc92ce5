"""LMCache remote storage plugin: kvstore as LMCache's remote backend.

Load it through LMCache's remote_storage_plugins (no change to LMCache):

    remote_storage_plugins: ["kvstore"]
    extra_config:
      remote_storage_plugin.kvstore.module_path: kvstore_client.adapters.lmcache
      remote_storage_plugin.kvstore.class_name: KVStoreConnector
      remote_storage_plugin.kvstore.target: "127.0.0.1:50051"
      # optional: .timeout_s, .control ("local" | "grpc"), .tenant, .salt

(class_name KVStoreConnectorAdapter does the same through LMCache's adapter path, which
also hands over the plugin's name, so several kvstore plugins can be configured at once:
name them "kvstore.<instance>". The adapter claims only `plugin://kvstore` and
`plugin://kvstore.<instance>` URLs, never another plugin's, and `remote_url:
kvstore://host:port` with remote_storage_plugins naming it. Two plugins given the connector
class itself cannot be told apart, since LMCache's dynamic path does not say which one it
builds: that stops LMCache's start-up with an error naming the fix, never a swallowed warning.)

A chunk's key names its content: its chunk hash is chained over the tokens before it, for one
model and format. So a chunk put again is one already stored, and the first write stands: the
chunks other engines stored after it (their own continuations of a shared prefix) stay, where
rewriting it would delete them with it. Only LMCache's health probe (RemoteBackendHealthCheck:
model "test", chunk hash 0) puts new bytes under one key and must read them back, as from a
file or a Redis SET: that one key is replaced.

Each LMCache chunk is one kvstore page: LMCache's own RemoteMetadata header (length,
shapes, dtypes, format) followed by the chunk's bytes, padded to a full chunk, so a
partial last chunk (save_unfull_chunk) loads back with its true shape, and a chunk put in
another format than the engine's (a KV_T2D object, say) comes back as the object that was
put, rebuilt from its header as LMCache's fs and redis connectors do: `contains` and `get`
never disagree. The bytes move
with one copy each way between LMCache's CPU buffer (MemoryObj.byte_array) and a slot of
the server's shared-memory arena.

A CacheEngineKey's model, world size, worker id and dtype become the Namespace; its
chunk hash is the key. Salts: what LMCache 0.5.6 passes a storage connector per request is the
key's tags (request_configs "lmcache.tag.<name>", from vLLM's kv_transfer_params); vLLM's
cache_salt does not reach a CacheEngineKey on this path. The tags, after the deployment's own
.salt, become the namespace's hash_seed (keys.salt_seed), so a tagged or salted request never
shares a page with an untagged one, or with other tags or another salt. Chunk hashes are chained over the prefix, and the chunks of one
batched_put are consecutive chunks of one request, so each is stored as the child of the
one before it: the index stays prefix-closed and batched_async_contains (the number of
leading chunks stored) is one Lookup.
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, List, Optional

import numpy as np

from lmcache.utils import CacheEngineKey
from lmcache.v1.exceptions import IrrecoverableException
from lmcache.v1.memory_management import MemoryObj
from lmcache.v1.protocol import RemoteMetadata
from lmcache.v1.storage_backend.connector import ConnectorAdapter, ConnectorContext
from lmcache.v1.storage_backend.connector.base_connector import RemoteConnector

from kvstore_client.adapters.settings import AdapterSettings, ClientPerThread
from kvstore_client.keys import KEY_BYTES_MAX, Namespace, salt_seed

log = logging.getLogger(__name__)

PLUGIN_KEYS = ("module_path", "class_name")  # LMCache's own keys under remote_storage_plugin.<name>.
IO_THREADS = 2                               # blocking client calls run here, off LMCache's event loop


class KVStoreConnector(RemoteConnector):
    def __init__(self, loop: asyncio.AbstractEventLoop, local_cpu_backend: Any, config: Any,
                 plugin_name: Optional[str] = None, target: Optional[str] = None):
        """`plugin_name`: the remote_storage_plugins entry (found in the config when None); `target`: the
        node's address from a kvstore:// URL, in place of the plugin's .target setting."""
        metadata = getattr(local_cpu_backend, "metadata", None)
        if metadata is None:
            raise ValueError("the kvstore connector needs LMCache's local CPU backend (max_local_cpu_size > 0): "
                             "it allocates the buffers chunks are loaded into")
        if config.use_layerwise:
            raise ValueError("the kvstore connector stores whole chunks: set use_layerwise: false")
        super().__init__(local_cpu_backend.config, metadata)
        self.loop = loop
        self.local_cpu_backend = local_cpu_backend
        self.plugin_name = plugin_name or _plugin_name(config, type(self))
        prefix = f"remote_storage_plugin.{self.plugin_name}."
        ours = {k: v for k, v in (config.extra_config or {}).items()
                if k.startswith(prefix) and k[len(prefix):] not in PLUGIN_KEYS}
        if target is not None:
            ours[prefix + "target"] = target
        self.settings = AdapterSettings.from_mapping(ours, prefix, f"LMCache plugin {self.plugin_name!r}")
        if self.settings.recompute_s_per_token:
            raise ValueError(f"LMCache plugin {self.plugin_name!r}: {prefix}recompute_s_per_token is not taken here: "
                             "LMCache asks about one chunk at a time, so the plugin cannot weigh a prefix's load "
                             "against its prefill (SGLang's backend can)")
        self.chunk_tokens = metadata.chunk_size
        self.page_bytes = self.remote_metadata_bytes + self.full_chunk_size_bytes
        self._kv_shape = tuple(metadata.kv_shape)
        self._zeros = bytes(self.full_chunk_size_bytes)
        self._clients = ClientPerThread(self.settings, client_name=f"lmcache-{metadata.worker_id}")
        self._executor = ThreadPoolExecutor(IO_THREADS, thread_name_prefix="kvstore-lmcache")
        self._namespaces: dict[tuple, Namespace] = {}
        log.info("kvstore LMCache connector ready: plugin=%s target=%s page_bytes=%d chunk_tokens=%d",
                 self.plugin_name, self.settings.target, self.page_bytes, self.chunk_tokens)

    # -- lookups ----------------------------------------------------------------------

    async def exists(self, key: CacheEngineKey) -> bool:
        return await self._run(lambda: self._leading([key]) == 1)

    def exists_sync(self, key: CacheEngineKey) -> bool:
        return self._leading([key]) == 1

    def support_batched_contains(self) -> bool:
        return True

    def batched_contains(self, keys: List[CacheEngineKey]) -> int:
        return self._leading(keys)

    def support_batched_async_contains(self) -> bool:
        return True

    async def batched_async_contains(self, lookup_id: str, keys: List[CacheEngineKey], pin: bool = False) -> int:
        """Leading chunks stored. `pin` is not needed: a page is pinned while it is copied out."""
        return await self._run(lambda: self._leading(keys))

    def _leading(self, keys: List[CacheEngineKey]) -> int:
        hits = 0
        for namespace, group in self._groups(keys):
            found = self._clients.get().lookup(namespace, keys=[_page_key(k) for k in group])
            hits += found
            if found < len(group):
                break
        return hits

    # -- reads ------------------------------------------------------------------------

    async def get(self, key: CacheEngineKey) -> Optional[MemoryObj]:
        return (await self.batched_get([key]))[0]

    def support_batched_get(self) -> bool:
        return True

    async def batched_get(self, keys: List[CacheEngineKey]) -> List[Optional[MemoryObj]]:
        """The leading stored chunks, then None for the rest."""
        return await self._run(lambda: self._get(keys))

    async def batched_get_non_blocking(self, lookup_id: str, keys: List[CacheEngineKey]) -> List[MemoryObj]:
        loaded = await self.batched_get(keys)
        return [obj for obj in loaded[:_leading_count(loaded)]]

    def _get(self, keys: List[CacheEngineKey]) -> List[Optional[MemoryObj]]:
        results: List[Optional[MemoryObj]] = []
        for namespace, group in self._groups(keys):
            loaded = self._get_group(namespace, group)
            results += loaded
            if _leading_count(loaded) < len(group):
                break
        return results + [None] * (len(keys) - len(results))

    def _get_group(self, namespace: Namespace, keys: List[CacheEngineKey]) -> List[Optional[MemoryObj]]:
        objs: list[MemoryObj] = []
        for _ in keys:
            obj = self.local_cpu_backend.allocate(self.meta_shapes, self.meta_dtypes, self.meta_fmt)
            if obj is None:  # LMCache's CPU buffer is full: load what fits
                break
            objs.append(obj)
        headers = [bytearray(self.remote_metadata_bytes) for _ in objs]
        pages = [[header, obj.byte_array] for header, obj in zip(headers, objs)]
        loaded = 0
        try:
            loaded = self._clients.get().get(namespace, [_page_key(k) for k in keys[:len(objs)]], pages)
        finally:
            results: list[Optional[MemoryObj]] = []
            for i, obj in enumerate(objs):
                leading = i < loaded and (not results or results[-1] is not None)
                chunk = self._chunk(obj, headers[i]) if leading else None
                if chunk is None:
                    obj.ref_count_down()
                results.append(chunk)   # _chunk released obj if it answered with a rebuilt object
        return results + [None] * (len(keys) - len(results))

    def _chunk(self, obj: MemoryObj, header: bytearray) -> Optional[MemoryObj]:
        """The loaded chunk as it was put: in the engine's format, `obj` with the stored length; else a
        new object of the stored shapes, dtypes and format holding its bytes (None if the CPU buffer is full)."""
        meta = RemoteMetadata.deserialize(header)
        if meta.fmt == self.meta_fmt and list(meta.dtypes) == list(self.meta_dtypes):
            try:
                return self.reshape_partial_chunk(obj, meta.length)
            except ValueError:
                pass    # the engine's format with another shape: rebuilt below like any other
        rebuilt = self.local_cpu_backend.allocate(list(meta.shapes), list(meta.dtypes), meta.fmt)
        if rebuilt is None:
            log.warning("no room in LMCache's CPU buffer for a kvstore chunk stored as %s %s: treated as a miss",
                        meta.fmt, list(meta.shapes))
            return None
        if len(rebuilt.byte_array) != meta.length:
            rebuilt.ref_count_down()
            log.warning("kvstore chunk header says %d bytes for %s %s: treated as a miss",
                        meta.length, meta.fmt, list(meta.shapes))
            return None
        np.copyto(np.frombuffer(rebuilt.byte_array, np.uint8), np.frombuffer(obj.byte_array, np.uint8)[:meta.length])
        obj.ref_count_down()
        return rebuilt

    # -- writes -----------------------------------------------------------------------

    async def put(self, key: CacheEngineKey, memory_obj: MemoryObj) -> None:
        await self.batched_put([key], [memory_obj])

    def support_batched_put(self) -> bool:
        return True

    async def batched_put(self, keys: List[CacheEngineKey], memory_objs: List[MemoryObj]) -> None:
        """Store chunks, each as the child of the one before it (LMCache drops the references)."""
        await self._run(lambda: self._put(keys, memory_objs))

    def _put(self, keys: List[CacheEngineKey], memory_objs: List[MemoryObj]) -> None:
        if len(keys) != len(memory_objs):
            raise ValueError(f"{len(keys)} keys for {len(memory_objs)} chunks")
        offset = 0
        for namespace, group in self._groups(keys):
            pages = [self._page(obj) for obj in memory_objs[offset:offset + len(group)]]
            offset += len(group)
            client, page_keys = self._clients.get(), [_page_key(k) for k in group]
            if _is_health_probe(group[0]) and client.lookup(namespace, page_keys[:1]):
                client.delete(namespace, page_keys[:1])   # the probe reads back what it just put
            stored = client.put(namespace, page_keys, pages)
            if stored < len(group):
                log.debug("kvstore stored %d of %d chunks: %s", stored, len(group), stored.reason)
                break

    def _page(self, obj: MemoryObj) -> list:
        data = obj.byte_array
        length = len(data)
        if length > self.full_chunk_size_bytes:
            raise ValueError(f"chunk of {length} bytes is larger than a full chunk ({self.full_chunk_size_bytes})")
        header = RemoteMetadata(length, obj.get_shapes(), obj.get_dtypes(), obj.get_memory_format()).serialize()
        page = [header, data]
        if length < self.full_chunk_size_bytes:
            page.append(memoryview(self._zeros)[:self.full_chunk_size_bytes - length])
        return page

    def remove_sync(self, key: CacheEngineKey) -> bool:
        """Remove a chunk (and the chunks stored after it, which no lookup could reach)."""
        namespace, _ = next(self._groups([key]))
        return self._clients.get().delete(namespace, [_page_key(key)]) > 0

    # -- housekeeping -----------------------------------------------------------------

    async def list(self) -> List[str]:
        """Every chunk stored in this connector's format, as CacheEngineKey strings (what LMCache's fs
        connector lists as file names): the node's namespaces of LMCache chunks of this size (among the
        first limits.stats_namespaces_max namespaces Stats names), key by key."""
        return await self._run(self._list)

    def _list(self) -> List[str]:
        client = self._clients.get()
        stats = client.stats()
        found: List[str] = []
        for entry in stats.namespaces:
            namespace = Namespace.from_proto(entry.spec)
            identity = _lmcache_identity(namespace)
            if identity is None or namespace.page_bytes != self.page_bytes or namespace.hash_seed != self._seed(None):
                continue
            if self.settings.tenant and namespace.tenant != self.settings.tenant:
                continue
            model, world_size, worker_id, dtype = identity
            found += [f"{model}@{world_size}@{worker_id}@{key.decode()}@{dtype}"
                      for key in client.list_keys(namespace)]
        return found

    def support_ping(self) -> bool:
        return True

    async def ping(self) -> int:
        try:
            await self._run(lambda: self._clients.get().stats())
            return 0
        except Exception as exc:  # a health probe reports, it does not raise
            log.warning("kvstore ping failed: %s", exc)
            return 1

    async def close(self) -> None:
        self._executor.shutdown(wait=True)
        self._clients.close()

    async def _run(self, call: Callable[[], Any]) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._executor, call)

    def _groups(self, keys: List[CacheEngineKey]):
        """Runs of consecutive keys that share a namespace, with that namespace."""
        start = 0
        for i in range(1, len(keys) + 1):
            if i == len(keys) or _identity(keys[i]) != _identity(keys[start]):
                yield self._namespace(keys[start]), keys[start:i]
                start = i

    def _seed(self, tags: Optional[tuple]) -> str:
        return salt_seed(self.settings.salt, *(f"{name}={value}" for name, value in tags or ()))

    def _namespace(self, key: CacheEngineKey) -> Namespace:
        identity = _identity(key)
        namespace = self._namespaces.get(identity)
        if namespace is None:
            layers, _, _, heads, head_dim = self._kv_shape
            # LMCache's worker id is a rank in the world where it can be (it names the TP shard); any
            # other pair (its own tests use worker 123 of 3) is kept apart by the layout instead.
            rank = 0 <= key.worker_id < key.world_size
            worker = "" if rank else f";worker={key.worker_id}/{key.world_size}"
            namespace = Namespace(
                model=key.model_name, page_bytes=self.page_bytes, page_tokens=self.chunk_tokens,
                tenant=self.settings.tenant, kv_dtype=str(key.dtype).removeprefix("torch."),
                num_layers=layers, num_kv_heads=heads, head_dim=head_dim,
                tp_rank=key.worker_id if rank else 0, tp_size=key.world_size if rank else 1,
                layout=f"lmcache:{self.meta_fmt.name}{worker}", hash_seed=self._seed(key.tags))
            self._namespaces[identity] = namespace
        return namespace


class KVStoreConnectorAdapter(ConnectorAdapter):
    """LMCache's adapter path to the same connector: it knows the plugin's instance name."""

    def __init__(self) -> None:
        super().__init__("kvstore://")

    def can_parse(self, url: str) -> bool:
        """kvstore://host:port, plugin://kvstore and plugin://kvstore.<instance>: never another plugin's URL."""
        if url.startswith(self.schema):
            return True
        return url.startswith("plugin://") and _is_kvstore_plugin(url.removeprefix("plugin://"))

    def create_connector(self, context: ConnectorContext) -> RemoteConnector:
        if context.url.startswith(self.schema):   # remote_url: kvstore://host:port[/ignored]
            target = context.url.removeprefix(self.schema).split("/", 1)[0]
            name = context.plugin_name or _plugin_name(context.config, type(self))
            return KVStoreConnector(context.loop, context.local_cpu_backend, context.config, plugin_name=name,
                                    target=target)
        name = context.plugin_name or context.url.removeprefix("plugin://")
        return KVStoreConnector(context.loop, context.local_cpu_backend, context.config, plugin_name=name)


def _lmcache_identity(namespace: Namespace) -> Optional[tuple[str, int, int, str]]:
    """(model, world size, worker id, dtype) of a namespace of LMCache chunks (see _namespace), else None.

    Namespaces with tags are left out by the caller (their hash_seed is not the untagged one):
    CacheEngineKey.to_string() does not carry tags either."""
    layout = namespace.layout
    if not layout.startswith("lmcache:"):
        return None
    fields = dict(part.split("=", 1) for part in layout.split(";")[1:] if "=" in part)
    if set(fields) - {"worker"}:
        return None
    if "worker" in fields:
        worker_id, world_size = (int(v) for v in fields["worker"].split("/"))
    else:
        worker_id, world_size = namespace.tp_rank, namespace.tp_size
    return namespace.model, world_size, worker_id, namespace.kv_dtype


def _identity(key: CacheEngineKey) -> tuple:
    return key.model_name, key.world_size, key.worker_id, key.dtype, key.tags


def _is_health_probe(key: CacheEngineKey) -> bool:
    """The key LMCache's RemoteBackendHealthCheck puts fresh bytes under and reads back."""
    return key.model_name == "test" and key.chunk_hash == 0


def _page_key(key: CacheEngineKey) -> str:
    page_key = key.chunk_hash_hex
    if len(page_key) > KEY_BYTES_MAX:
        raise ValueError(f"chunk hash of {len(page_key)} hex digits; kvstore keys hold at most {KEY_BYTES_MAX}")
    return page_key


def _leading_count(objs: List[Optional[MemoryObj]]) -> int:
    return next((i for i, obj in enumerate(objs) if obj is None), len(objs))


def _is_kvstore_plugin(name: str) -> bool:
    return name == "kvstore" or name.startswith("kvstore.")


def _plugin_name(config: Any, cls: type) -> str:
    """The remote_storage_plugins entry that names this class (LMCache's dynamic path does not pass it).

    Several entries naming it cannot be told apart: LMCache would build one of them for each. That is
    an IrrecoverableException, the one error LMCache's RemoteBackend lets through to the user.
    """
    extra = config.extra_config or {}
    names = [name for name in (config.remote_storage_plugins or [])
             if extra.get(f"remote_storage_plugin.{name}.module_path") == cls.__module__
             and extra.get(f"remote_storage_plugin.{name}.class_name") == cls.__name__]
    if len(names) > 1:
        raise IrrecoverableException(
            f"{len(names)} remote_storage_plugins ({', '.join(sorted(names))}) name {cls.__module__}.{cls.__name__}, "
            "and LMCache does not say which one it is building: name them kvstore.<instance> with class_name "
            "KVStoreConnectorAdapter")
    if not names:
        raise ValueError(f"no remote_storage_plugins entry names {cls.__module__}.{cls.__name__}")
    return names[0]
