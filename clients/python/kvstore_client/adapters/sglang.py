"""SGLang HiCache storage backend: kvstore as SGLang's L3 tier.

Load it with SGLang's dynamic backend (no change to SGLang):

    --enable-hierarchical-cache --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "kvstore",
        "module_path": "kvstore_client.adapters.sglang", "class_name": "KVStoreHiCacheStorage",
        "interface_v1": 1, "kvstore_target": "127.0.0.1:50051"}'

`interface_v1` makes SGLang call the zero-copy batch_get_v1 / batch_set_v1: each page is
copied once, between SGLang's host KV pool and a slot of the server's shared-memory arena.
Other settings: kvstore_timeout_s, kvstore_control ("local" | "grpc"), kvstore_tenant,
kvstore_salt.
Add "hicache_storage_pass_prefix_keys": true (an SGLang setting) so each stored batch names
the page before it, and kvstore keeps its index prefix-closed across batches. A batch whose
page before it the node has evicted is stored anyway, anchored at that page's key (SGLang
backs up only the pages after its own cache hit and does not back up the batch again).

Which pages may be shared is the Namespace's job, not a key suffix (HiCacheFile appends
"_{model}_{tp_rank}_{tp_size}" to each key): the namespace carries the model, the KV
layout (dtype, layers, heads, head dim, tokens per page, host-pool layout) and the rank
that wrote the page. For MLA models every TP rank holds the same KV, so the namespace
leaves the TP rank out: SGLang backs pages up from one writer rank (is_storage_writer) and
every rank reads them. A backup asked of another rank writes nothing and answers, like the
file backend, True exactly for the pages the store holds already.
Without a model name (model_name=None, which SGLang's file and Mooncake backends accept), the
model is UNNAMED_MODEL; the rest of the namespace (the KV layout) keeps models of other KV
shapes apart. Keys stay SGLang's own SHA-256 hex digests, byte for byte, so the SDK's
prefix_hashes() names the same pages.

Salts. SGLang 0.5.23 passes a storage backend no request's extra_key or cache_salt: the
batch_*_v1/v2 calls carry the page keys, the host indices and a HiCacheStorageExtraInfo whose
fields are prefix_keys (the pages before the batch) and an extra_info dict that HiCache's own
calls leave empty (only Mooncake's direct linker fills it, with a session id). What SGLang
does instead is seed each request's key chain with storage_namespace_seed(extra_key,
cache_salt) (mem_cache/utils.py), so a salted request's keys already differ from an
unsalted one's, and they reach kvstore as they are. What the backend can carry is a
per-deployment salt: kvstore_salt in the extra-config becomes the namespace's hash_seed
(keys.salt_seed), so a salted deployment shares no page with an unsalted one or another
salt's, even where their requests carry no salt at all. The seed also starts the chain of a
lookup by tokens (lookup(tokens=), Route) in that namespace, which then names no page SGLang
stored: ask a salted deployment's namespace by keys.

A page is stored as one page even when the host pool keeps K and V apart: its segments
(K and V, or K and V of each layer for layer_first) are copied back to back into one
slot. One key per page (Mooncake stores "_k" and "_v" keys) means one index entry, one
checksum and one lease per page, and K never becomes visible without its V. When all of a
page's segments lie in the pool's one kv_buffer (MHA and MLA pools), they are copied in
address order, which is the order of SGLang's flat data page (get_data_page(flat=True) is
a box slice of that C-contiguous buffer): the zero-copy and the generic get/set paths
then share one namespace and read each other's pages. Pools that keep buffers apart keep
SGLang's buffer order, in a namespace of their own.
"""

from __future__ import annotations

import logging
import time
from typing import Any, List, Optional

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig, HiCacheStorageExtraInfo
from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer, PoolTransferResult

from kvstore_client.adapters.settings import AdapterSettings, ClientPerThread
from kvstore_client.adapters.sglang_pools import (HeldSidecars, SidecarPool, exists_result, group_parts, parent_of,
                                                  sidecar_pool, span_hits)
from kvstore_client.buffers import Segment
from kvstore_client.errors import KVStoreError
from kvstore_client.keys import Namespace, salt_seed

log = logging.getLogger(__name__)

SETTINGS_PREFIX = "kvstore_"
# The model of a namespace when SGLang names none (model_name=None): the namespace's other fields (dtype,
# layers, heads, head dim, page size, host-pool layout) still keep models of other KV shapes apart.
UNNAMED_MODEL = "sglang-unnamed-model"


class KVStoreHiCacheStorage(HiCacheStorage):
    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Optional[dict] = None):
        self.storage_config = storage_config
        extra = storage_config.extra_config or {}
        self.settings = AdapterSettings.from_mapping(extra, SETTINGS_PREFIX, "SGLang extra-config for kvstore")
        self.zero_copy = bool(extra.get("interface_v1", 0))
        self.is_writer = storage_config.is_storage_writer
        self.mem_pool_host = None
        self.namespace: Namespace | None = None       # pages moved by the zero-copy path
        self.flat_namespace: Namespace | None = None  # pages moved as flat tensors (generic path)
        self._address_order = False
        self._clients = ClientPerThread(self.settings, client_name=f"sglang-tp{storage_config.tp_rank}")
        self._metrics = _Metrics() if storage_config.enable_storage_metrics else None
        self._sidecars: dict[str, SidecarPool] = {}   # register_mem_host_pool_v2's pools, by name
        self._held = HeldSidecars()   # sidecar pages waiting for their KV pages' commit (sglang_pools.py)

    # -- set-up -----------------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Fix the namespace from the host pool SGLang copies pages to and from."""
        super().register_mem_pool_host(mem_pool_host)
        for buffer in _pool_buffers(mem_pool_host):   # registered once, as Mooncake does, not per page
            self._clients.register_buffer(buffer.data_ptr(), buffer.numel() * buffer.element_size(), buffer)
        self._address_order = _segments_in_one_buffer(mem_pool_host)
        self.namespace, self.flat_namespace = namespaces_for(
            self.storage_config, mem_pool_host, self.settings.tenant, self._address_order, self.settings.salt)
        if not self.storage_config.model_name:
            log.warning("SGLang gave no model name: kvstore pages go to model %r, shared with every unnamed model "
                        "whose KV has the same shape (dtype, layers, heads, head dim, page size)", UNNAMED_MODEL)
        log.info("kvstore HiCache backend ready: model=%s layout=%s page_bytes=%d tp=%d/%d writer=%s zero_copy=%s",
                 self.namespace.model, self.namespace.layout, self.namespace.page_bytes,
                 self.namespace.tp_rank, self.namespace.tp_size, self.is_writer, self.zero_copy)

    # -- zero-copy path (interface_v1) ------------------------------------------------

    def batch_get_v1(self, keys: List[str], host_indices: torch.Tensor,
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> List[bool]:
        namespace = self._require_namespace()
        if not keys:
            return []
        started = time.perf_counter()
        loaded = self._clients.get().get(namespace, keys, self._page_segments(keys, host_indices))
        if self._metrics is not None:
            self._metrics.prefetch(loaded, loaded * namespace.page_bytes, time.perf_counter() - started)
        return [i < loaded for i in range(len(keys))]

    def batch_set_v1(self, keys: List[str], host_indices: torch.Tensor,
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> List[bool]:
        namespace = self._require_namespace()
        if not keys:
            return []
        if not self.is_writer:
            return [i < self._stored_already(namespace, keys) for i in range(len(keys))]
        started = time.perf_counter()
        stored = self._put_kv(namespace, keys, self._page_segments(keys, host_indices), _parent_key(extra_info))
        if self._metrics is not None:
            self._metrics.backup(stored, stored * namespace.page_bytes, time.perf_counter() - started)
        return [i < stored for i in range(len(keys))]

    def _page_segments(self, keys: List[str], host_indices: torch.Tensor) -> list[list[Segment]]:
        """(pointer, nbytes) segments of each page in the host pool, in flat-data-page order."""
        page_tokens = self.mem_pool_host.page_size
        if host_indices.numel() != len(keys) * page_tokens:
            raise ValueError(f"{host_indices.numel()} host indices for {len(keys)} pages of {page_tokens} tokens")
        pointers, sizes = self.mem_pool_host.get_page_buffer_meta(host_indices)
        per_page = len(pointers) // len(keys)
        if per_page * len(keys) != len(pointers):
            raise ValueError(f"the host pool gave {len(pointers)} buffers for {len(keys)} pages")
        pages = []
        for page in range(len(keys)):
            first = page * per_page
            segments = list(zip(pointers[first:first + per_page], sizes[first:first + per_page]))
            pages.append(sorted(segments) if self._address_order else segments)
        return pages

    # -- generic path (copies through a flat tensor) ----------------------------------

    def get(self, key: str, target_location: Optional[Any] = None, target_sizes: Optional[Any] = None):
        return self.batch_get([key], [target_location], None if target_sizes is None else [target_sizes])[0]

    def batch_get(self, keys: List[str], target_locations: Optional[Any] = None,
                  target_sizes: Optional[Any] = None) -> List[Optional[torch.Tensor]]:
        namespace = self._require_namespace(flat=True)
        if not keys:
            return []
        if target_locations is None or any(t is None for t in target_locations):
            raise ValueError("kvstore needs target_locations: a flat page tensor to load each page into")
        loaded = self._clients.get().get(namespace, keys, _pages(target_locations, target_sizes))
        return [target if i < loaded else None for i, target in enumerate(target_locations)]

    def set(self, key: str, value: Optional[Any] = None, target_location: Optional[Any] = None,
            target_sizes: Optional[Any] = None) -> bool:
        """Store one page: a tensor (`value`), or `target_sizes` bytes at the host pointer `target_location`."""
        if value is None:
            return self.batch_set([key], None, [target_location], [target_sizes])
        return self.batch_set([key], [value])

    def batch_set(self, keys: List[str], values: Optional[Any] = None, target_locations: Optional[Any] = None,
                  target_sizes: Optional[Any] = None) -> bool:
        namespace = self._require_namespace(flat=True)
        if not keys:
            return True
        if not self.is_writer:
            return self._stored_already(namespace, keys) == len(keys)
        try:
            pages = [v.contiguous() for v in values] if values is not None else _pages(target_locations, target_sizes)
            return self._put_kv(namespace, keys, pages, None) == len(keys)
        except (TypeError, AttributeError, ValueError) as exc:   # the file backend answers False here too
            log.warning("kvstore cannot store %d pages from what SGLang passed: %s", len(keys), exc)
            return False

    def _put_kv(self, namespace: Namespace, keys: List[str], pages: Any, anchor: Optional[str]) -> int:
        """Store KV pages; those whose sidecar pages are held (batch_set_v2) are committed with them in one
        group, a lease's worth of keys at a time, so each position becomes visible whole."""
        client = self._clients.get()
        step = client.limits.batch_pages_max
        stored = 0
        for start in range(0, len(keys), step):
            batch = keys[start:start + step]
            held = self._held.take(batch)
            before = anchor if start == 0 else keys[start - 1]
            if not held:
                batch_stored = client.put(namespace, batch, pages[start:start + step], anchor=before)
            else:
                batch_stored = self._commit_with_sidecars(client, namespace, batch, pages[start:start + step],
                                                          before, held)
            stored += batch_stored
            if batch_stored < len(batch):
                break
        return stored

    def _commit_with_sidecars(self, client: Any, namespace: Namespace, keys: List[str], pages: Any,
                              anchor: Optional[str], held: list) -> int:
        kv = client.stage(namespace, keys, pages, anchor=anchor)
        try:
            return client.commit_group([kv, *held])[0]
        except KVStoreError as exc:   # a held part's lease expired: its pages are gone; the KV stands alone
            log.warning("kvstore could not publish %d KV pages with their sidecar pages (%s): storing the KV "
                        "pages alone; those positions answer absent until their sidecar pages are backed up again",
                        len(keys), exc)
            return client.put(namespace, keys, pages, anchor=anchor)

    def _stored_already(self, namespace: Namespace, keys: List[str]) -> int:
        """A non-writer MLA rank's backup: nothing is written (the writer rank stores these pages); the
        leading pages the store holds already are the ones it may answer True for."""
        return self._clients.get().lookup(namespace, keys=keys)

    # -- sidecar pools of hybrid and sparse models (v2; see sglang_pools.py) ------------

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        """A sidecar pool (Mamba states, SWA KV, DSA indexer, MTP draft): its pages get a namespace of their own."""
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        if str(host_pool_name) == str(PoolName.KV):
            return
        kv_namespace = self._require_namespace()
        pool = sidecar_pool(host_pool_name, host_pool, kv_namespace, self.storage_config.tp_rank,
                            self.storage_config.tp_size)
        if pool.zero_copy:
            for buffer in _pool_buffers_v2(host_pool):
                self._clients.register_buffer(buffer.data_ptr(), buffer.numel() * buffer.element_size(), buffer)
        self._sidecars[str(host_pool_name)] = pool
        log.info("kvstore HiCache sidecar pool %s: page_bytes=%d zero_copy=%s", host_pool_name,
                 pool.namespace.page_bytes, pool.zero_copy)

    def batch_exists_v2(self, keys: List[str], pool_transfers: Optional[List[PoolTransfer]] = None,
                        extra_info: Optional[HiCacheStorageExtraInfo] = None) -> PoolTransferResult:
        """The usable prefix: one LookupGroup (one per limits.lookup_pages_max keys of a longer span), the KV
        pool and every asked pool answered by the node from one snapshot under each pool's hit policy (see
        sglang_pools.py)."""
        namespace = self._require_namespace(flat=not self.zero_copy)
        if not keys:
            return PoolTransferResult(0, {}, [])
        client = self._clients.get()
        parts, asked = group_parts(namespace, pool_transfers or [], self._sidecar)
        most = client.limits.lookup_pages_max or client.limits.batch_pages_max
        return exists_result(asked, span_hits(client.lookup_group, keys, parts, most))

    def batch_set_v2(self, transfers: List[PoolTransfer],
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> dict[str, List[bool]]:
        """Sidecar pages first (held for their KV pages where this rank writes the KV), then a KV transfer,
        which commits them with its pages."""
        ordered = sorted(transfers, key=lambda transfer: str(transfer.name) == str(PoolName.KV))
        results: dict[str, List[bool]] = {}
        for transfer in ordered:
            keys = list(transfer.keys or [])
            if str(transfer.name) == str(PoolName.KV):
                results[transfer.name] = self.batch_set_v1(keys, transfer.host_indices, extra_info)
                continue
            stored = self._set_sidecar(self._sidecar(transfer.name), keys, transfer.host_indices, extra_info) \
                if keys else 0
            results[transfer.name] = [i < stored for i in range(len(keys))]
        return {transfer.name: results[transfer.name] for transfer in transfers}

    def batch_get_v2(self, transfers: List[PoolTransfer],
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> dict[str, List[bool]]:
        """Every pool of the call read under one AcquireGroup; a key loads in every pool that names it or in none."""
        reads, copy_back = [], []
        for transfer in transfers:
            keys = list(transfer.keys or [])
            if not keys:
                continue
            if str(transfer.name) == str(PoolName.KV):
                reads.append((self._require_namespace(), keys, self._page_segments(keys, transfer.host_indices)))
                copy_back.append(None)
                continue
            pool = self._sidecar(transfer.name)
            if pool.zero_copy:
                reads.append((pool.namespace, keys, pool.page_segments(keys, transfer.host_indices)))
                copy_back.append(None)
            else:
                flat = [pool.host_pool.get_dummy_flat_data_page() for _ in keys]
                reads.append((pool.namespace, keys, flat))
                copy_back.append((pool, pool.first_indices(keys, transfer.host_indices), flat))
        counts = self._clients.get().get_group(reads) if reads else []
        for loaded, back in zip(counts, copy_back):
            if back is not None:
                pool, firsts, flat = back
                for first, page in zip(firsts[:loaded], flat[:loaded]):
                    pool.host_pool.set_from_flat_data_page(first, page)
        answers, results = iter(counts), {}
        for transfer in transfers:
            loaded = next(answers) if transfer.keys else 0
            results[transfer.name] = [i < loaded for i in range(len(transfer.keys or []))]
        return results

    def _set_sidecar(self, pool: SidecarPool, keys: List[str], host_indices: Any,
                     extra_info: Optional[HiCacheStorageExtraInfo]) -> int:
        client = self._clients.get()
        if not self.is_writer and not pool.per_rank:
            # A pool the ranks share (as MLA KV is): the writer rank stores it; answered as batch_set_v1 does.
            return self._stored_already(pool.namespace, keys)
        if pool.zero_copy:
            pages = pool.page_segments(keys, host_indices)
        else:
            pages = [pool.host_pool.get_data_page(i, flat=True).contiguous()
                     for i in pool.first_indices(keys, host_indices)]
        if not self.is_writer or len(keys) > client.limits.batch_pages_max:
            # No KV write follows on this rank (or more than one lease's worth): committed as it is.
            return client.put(pool.namespace, keys, pages, anchor=parent_of(extra_info))
        staged = client.stage(pool.namespace, keys, pages, anchor=parent_of(extra_info))
        self._held.hold(staged)   # published with the KV pages of the same keys (_put_kv)
        return staged.stored

    def _sidecar(self, name: Any) -> SidecarPool:
        pool = self._sidecars.get(str(name))
        if pool is None:
            raise ValueError(f"pool {name} is not registered: call register_mem_host_pool_v2(pool, {name}) first")
        return pool

    # -- lookups and housekeeping -----------------------------------------------------

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def batch_exists(self, keys: List[str], extra_info: Optional[HiCacheStorageExtraInfo] = None) -> int:
        """How many leading keys are stored (one Lookup, which extends no lease); with recompute_s_per_token set,
        how many of them load faster than SGLang would prefill them (fetch or recompute): SGLang loads what this
        answers and prefills the rest."""
        namespace = self._require_namespace(flat=not self.zero_copy)
        if not keys:
            return 0
        client, per_token = self._clients.get(), self.settings.recompute_s_per_token
        if not per_token:
            return client.lookup(namespace, keys=keys)
        here = client.residency(namespace, keys=keys)
        return here.worth_loading(namespace.page_bytes, self.mem_pool_host.page_size, per_token)

    def clear(self) -> bool:
        """Remove every page of this backend's namespace (other ranks' and models' stay)."""
        namespace = self._require_namespace()
        removed = self._clients.get().clear(namespace)
        if self.flat_namespace != namespace:
            removed += self._clients.get().clear(self.flat_namespace)
        log.info("kvstore HiCache backend cleared %d pages of model=%s tp_rank=%d",
                 removed, namespace.model, namespace.tp_rank)
        return True

    def get_stats(self):
        """SGLang's StorageMetrics since the last call (None unless enable_storage_metrics)."""
        return self._metrics.drain() if self._metrics is not None else None

    def close(self) -> None:
        self._clients.close()

    def _require_namespace(self, flat: bool = False) -> Namespace:
        if self.namespace is None:
            raise RuntimeError("register_mem_pool_host() was not called: the kvstore backend does not know "
                               "the page size yet")
        return self.flat_namespace if flat else self.namespace


def namespaces_for(config: HiCacheStorageConfig, host_pool: Any, tenant: str = "",
                   address_order: bool = True, salt: str = "") -> tuple[Namespace, Namespace]:
    """Namespaces of a host pool's pages (zero-copy, flat): what must match for two ranks to share a page.

    They are one and the same when the zero-copy segments, in address order, are the flat page.
    """
    page_tokens = host_pool.page_size
    _, sizes = host_pool.get_page_buffer_meta(torch.arange(page_tokens, dtype=torch.int64))
    page_bytes = int(sum(sizes))
    flat_bytes = host_pool.get_dummy_flat_data_page().nbytes
    flat = _namespace(config, host_pool, tenant, flat_bytes, "flat", salt)
    if address_order and flat_bytes == page_bytes:
        return flat, flat
    return _namespace(config, host_pool, tenant, page_bytes, "buffers", salt), flat


def _namespace(config: HiCacheStorageConfig, host_pool: Any, tenant: str, page_bytes: int, order: str,
               salt: str) -> Namespace:
    page_tokens = host_pool.page_size
    shard = []  # parallel shards that hold different bytes for the same tokens
    if config.pp_size > 1:
        shard.append(f"pp{config.pp_rank}/{config.pp_size}")
    if config.attn_cp_size > 1:
        shard.append(f"cp{config.attn_cp_rank}/{config.attn_cp_size}")
    if config.dcp_size > 1:
        shard.append(f"dcp{config.dcp_rank}/{config.dcp_size}")
    layout = ";".join([f"sglang:{host_pool.layout}:{type(host_pool).__name__}:{order}", *shard])
    replicated = config.is_mla_model  # every TP rank holds the same KV: one copy for all
    return Namespace(
        model=config.model_name or UNNAMED_MODEL,
        page_bytes=page_bytes,
        page_tokens=page_tokens,
        tenant=tenant,
        kv_dtype=str(host_pool.dtype).removeprefix("torch."),
        num_layers=int(getattr(host_pool, "layer_num", 0)),
        num_kv_heads=int(getattr(host_pool, "head_num", 0)),
        head_dim=int(getattr(host_pool, "head_dim", 0)),
        tp_rank=0 if replicated else config.tp_rank,
        tp_size=1 if replicated else config.tp_size,
        layout=layout,
        hash_seed=salt_seed(salt),
    )


def _pool_buffers(host_pool: Any) -> list[torch.Tensor]:
    """The host pool's KV tensors: one kv_buffer (MHA, MLA) or k/v buffers kept apart."""
    found = []
    for name in ("kv_buffer", "k_buffer", "v_buffer"):
        value = getattr(host_pool, name, None)
        for tensor in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(tensor, torch.Tensor) and tensor.numel():
                found.append(tensor)
    return found


def _pool_buffers_v2(host_pool: Any) -> list[torch.Tensor]:
    """A sidecar pool's host tensors (Mamba: temporal and conv buffers; KV-shaped pools: their buffers)."""
    found = _pool_buffers(host_pool)
    for name in ("temporal_buffer", "conv_buffer"):
        value = getattr(host_pool, name, None)
        for tensor in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(tensor, torch.Tensor) and tensor.numel():
                found.append(tensor)
    return found


def _segments_in_one_buffer(host_pool: Any) -> bool:
    """Whether a page's zero-copy segments all lie in the pool's single kv_buffer tensor.

    Only then is their address order the same in every process (and the flat page's order);
    buffers allocated apart can land in either order.
    """
    buffer = getattr(host_pool, "kv_buffer", None)
    if not isinstance(buffer, torch.Tensor):
        return False
    start, end = buffer.data_ptr(), buffer.data_ptr() + buffer.numel() * buffer.element_size()
    pointers, sizes = host_pool.get_page_buffer_meta(torch.arange(host_pool.page_size, dtype=torch.int64))
    return all(start <= p and p + n <= end for p, n in zip(pointers, sizes))


def _pages(locations: Any, sizes: Optional[Any]) -> list:
    """Pages as the generic get/set name them: flat tensors, or host pointers with their byte sizes."""
    if locations is None:
        raise ValueError("no pages given: pass values (a flat page tensor per key) or target_locations "
                         "(flat page tensors, or host pointers with target_sizes)")
    if sizes is None:
        return list(locations)
    return [(int(pointer), int(size)) if isinstance(pointer, int) else pointer
            for pointer, size in zip(locations, sizes, strict=True)]


def _parent_key(extra_info: Optional[HiCacheStorageExtraInfo]) -> str | None:
    """The page before this batch, when SGLang passes prefix keys (hicache_storage_pass_prefix_keys)."""
    if extra_info is not None and extra_info.prefix_keys:
        return extra_info.prefix_keys[-1]
    return None


class _Metrics:
    """Pages and GB/s per batch, in the shape of SGLang's StorageMetrics."""

    def __init__(self):
        self._prefetch: list[tuple[int, float]] = []
        self._backup: list[tuple[int, float]] = []

    def prefetch(self, pages: int, nbytes: int, seconds: float) -> None:
        self._prefetch.append((pages, nbytes / max(seconds, 1e-9) / 1e9))

    def backup(self, pages: int, nbytes: int, seconds: float) -> None:
        self._backup.append((pages, nbytes / max(seconds, 1e-9) / 1e9))

    def drain(self):
        from sglang.srt.observability.metrics_collector import StorageMetrics

        metrics = StorageMetrics()
        prefetch, self._prefetch = self._prefetch, []
        backup, self._backup = self._backup, []
        metrics.prefetch_pgs.extend(p for p, _ in prefetch)
        metrics.prefetch_bandwidth.extend(b for _, b in prefetch)
        metrics.backup_pgs.extend(p for p, _ in backup)
        metrics.backup_bandwidth.extend(b for _, b in backup)
        return metrics
