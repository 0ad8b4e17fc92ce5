"""Pages straight between the node's DRAM arena and an engine's KV cache on the GPU.

    pages = GpuPages(client)                            # client: a KVStoreClient on the node's host
    cache = kv_layout.vllm(kv_caches)                   # or sglang_mha(...), sglang_mla(...), from_views(...)
    loaded = pages.get_to_gpu(ns, keys, cache, "sglang_page_first", block_ids)
    stored = pages.put_from_gpu(ns, keys, cache, "sglang_page_first", block_ids)

The arena the client mapped (shared memory, so only on the node's host) is registered with CUDA
once per client as mapped pinned memory, and the node's HBM pool, when it has one, is opened once
over CUDA IPC (a page the node answers with an HBM offset is read from there); the gather/scatter kernel then reads each page from the
store's DRAM and writes it into its block of the engine's cache (and back for a put), one launch
per call: a page crosses PCIe once, with no host buffer of the engine's in between. `layout` is the
byte order of a stored page (kv_layout.PAGE_FORMATS, or a PageFormat): it must be the one the
namespace's other writers use, so pages put by an engine's host-pool path load here unchanged.

The lease rules are the pipeline's (pipeline.py): a get copies under a read lease and fails with
LeaseNotFound if the copy outlasted it; a put reserves, copies, then commits, and aborts on
failure. After a node restart the client maps the new arena; the old registration is dropped
(its mapping is kept until then) and the new one made on first use. The device calls are behind
gpu_device.Device; one device copy runs at a time per GpuPages. The kernel runs on cupy's current
stream and is synchronized before a call returns; the engine must have finished writing the blocks
it puts (and must not read the blocks it loads) before the call.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Sequence

import numpy as np

from kvstore_client import errors, kv_layout
from kvstore_client.client import KVStoreClient
from kvstore_client.connection import NodeConnection
from kvstore_client.gpu_device import CudaDevice, Device
from kvstore_client.keys import Key, Namespace, encode_key, encode_keys
from kvstore_client.pipeline import LEASE_MARGIN_S, stored_pages
from kvstore_client.proto import pb

_PREFETCH_POLICIES = {"wait_complete": pb.WAIT_COMPLETE, "best_effort": pb.BEST_EFFORT, "timeout": pb.TIMEOUT}


class ArenaRegistration:
    """One arena mapping, registered with the device, and kept mapped until it is unregistered."""

    def __init__(self, arena: Any, device: Device):
        self.arena = arena
        self._hold = arena.hold()
        self.device_base = device.register_host(arena.base, arena.nbytes)

    def drop(self, device: Device) -> None:
        device.unregister_host(self.arena.base)
        self._hold = None


class GpuPages:
    def __init__(self, client: KVStoreClient, device: Device | None = None):
        """`device`: the seam to the GPU (gpu_device.py); None = CudaDevice (cupy on the current device)."""
        self._client = client
        self._device = device if device is not None else CudaDevice()
        self._lock = threading.Lock()       # one device copy at a time; guards the registration
        self._registration: ArenaRegistration | None = None
        self._hbm: tuple[bytes, int] | None = None     # the node's HBM pool opened here: (IPC handle, address)
        self._closed = False

    def get_to_gpu(self, namespace: Namespace, keys: Sequence[Key], kv_cache: kv_layout.CacheLayout,
                   layout: str | kv_layout.PageFormat, block_ids: Sequence[int], policy: str = "wait_complete",
                   timeout_ms: int = 0) -> int:
        """Load the leading stored pages of `keys` into blocks `block_ids` of `kv_cache`; returns how many.

        `policy` and `timeout_ms` as for KVStoreClient.get. Blocks past the count are untouched;
        when the call fails, the blocks it was given may hold anything.
        """
        if policy not in _PREFETCH_POLICIES:
            raise errors.InvalidArgument(f"policy must be one of {sorted(_PREFETCH_POLICIES)}, got {policy!r}")
        plan, raw_keys, blocks = self._prepare(namespace, keys, kv_cache, layout, block_ids)
        loaded = 0
        for start, stop in self._batches(len(raw_keys)):
            request = pb.AcquireRequest(keys=raw_keys[start:stop], policy=_PREFETCH_POLICIES[policy],
                                        timeout_ms=timeout_ms, hbm_reader=True)
            batch_loaded = self._client._with_connection(
                lambda conn: conn.reopening(namespace, lambda ns_id: self._get_batch(
                    conn, ns_id, request, plan, blocks[start:stop])), retry_if=lambda: True)
            loaded += batch_loaded
            if batch_loaded < stop - start:
                break
        return loaded

    def put_from_gpu(self, namespace: Namespace, keys: Sequence[Key], kv_cache: kv_layout.CacheLayout,
                     layout: str | kv_layout.PageFormat, block_ids: Sequence[int], parent: Key | None = None,
                     durable: bool = False) -> int:
        """Store blocks `block_ids` of `kv_cache` as the pages of `keys`; returns how many leading keys are stored.

        `parent` and `durable` and the count mean what they do for KVStoreClient.put.
        """
        plan, raw_keys, blocks = self._prepare(namespace, keys, kv_cache, layout, block_ids)
        parent_key = encode_key(parent) if parent is not None else b""
        stored = 0
        for start, stop in self._batches(len(raw_keys)):
            batch = _PutBatch(raw_keys[start:stop], parent_key, blocks[start:stop], durable)
            batch_stored = self._client._with_connection(
                lambda conn: conn.reopening(namespace, lambda ns_id: self._put_batch(conn, ns_id, batch, plan)),
                retry_if=lambda: not batch.slots_reserved)
            stored += batch_stored
            if batch_stored < stop - start:
                break
            parent_key = raw_keys[stop - 1]
        return stored

    def close(self) -> None:
        """Unregister the arena and close the HBM pool's handle; the client itself stays open (it is the caller's)."""
        with self._lock:
            self._closed = True
            self._close_hbm()
            if self._registration is not None:
                self._registration.drop(self._device)
                self._registration = None

    def __enter__(self) -> "GpuPages":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- one batch on one connection ----------------------------------------------------

    def _get_batch(self, conn: NodeConnection, ns_id: int, request: pb.AcquireRequest, plan: kv_layout.CopyPlan,
                   blocks: np.ndarray) -> int:
        _require_arena(conn)
        request.namespace_id = ns_id
        sent_at = time.monotonic()
        acquired = conn.control.call("Acquire", request)
        hits = acquired.hit_pages
        if not hits:
            return 0
        try:
            if acquired.page_bytes != plan.page_bytes:
                raise errors.PageSizeMismatch(f"the node answered {acquired.page_bytes}-byte pages, "
                                              f"the cache's are {plan.page_bytes}")
            with self._lock:
                self._device.pages_to_cache(plan, self._page_addresses(conn, acquired, hits), blocks[:hits])
        finally:
            conn.control.post("Release", pb.ReleaseRequest(lease_ids=[acquired.lease_id]))
        _check_node(conn)
        if time.monotonic() > sent_at + acquired.lease_ttl_ms / 1000:
            raise errors.LeaseNotFound("the read lease expired during the copy; the loaded blocks may be torn")
        return hits

    def _put_batch(self, conn: NodeConnection, ns_id: int, batch: "_PutBatch", plan: kv_layout.CopyPlan) -> int:
        _require_arena(conn)
        sent_at = time.monotonic()
        reserved = conn.control.call("Reserve", pb.ReserveRequest(
            namespace_id=ns_id, parent_key=batch.parent, keys=batch.keys, page_bytes=plan.page_bytes))
        states = list(reserved.states)
        indices = [i for i, state in enumerate(states) if state == pb.RESERVED]
        batch.slots_reserved |= bool(indices)
        if not indices:
            return stored_pages(states, [], batch.durable)
        try:
            with self._lock:
                base = self._arena_base(conn)
                addrs = base + np.asarray([reserved.offsets[i] for i in indices], dtype=np.uint64)
                self._device.cache_to_pages(plan, addrs, batch.blocks[indices])
            _check_node(conn)
            if time.monotonic() > sent_at + reserved.lease_ttl_ms / 1000 - LEASE_MARGIN_S:
                raise errors.LeaseNotFound("the write lease would expire before the commit; raise "
                                           "leases.write_ttl_ms or put fewer pages per call")
            answer = conn.control.call("Commit", pb.CommitRequest(
                lease_id=reserved.lease_id, indices=[reserved.first_index + i for i in indices], durable=batch.durable))
        except BaseException:
            conn.control.post("Abort", pb.AbortRequest(lease_id=reserved.lease_id))
            raise
        return stored_pages(states, [answer], batch.durable)

    # -- shared steps -------------------------------------------------------------------

    def _prepare(self, namespace: Namespace, keys: Sequence[Key], kv_cache: kv_layout.CacheLayout,
                 layout: str | kv_layout.PageFormat, block_ids: Sequence[int]
                 ) -> tuple[kv_layout.CopyPlan, list[bytes], np.ndarray]:
        if self._closed:
            raise ValueError("this GpuPages is closed")
        page_format = layout if isinstance(layout, kv_layout.PageFormat) else kv_layout.PAGE_FORMATS.get(layout)
        if page_format is None:
            raise errors.InvalidArgument(f"layout must be a PageFormat or one of {sorted(kv_layout.PAGE_FORMATS)}, "
                                         f"got {layout!r}")
        shape = kv_layout.PageShape(kv=kv_cache.kv, layers=kv_cache.layers, tokens=kv_cache.tokens,
                                    heads=kv_cache.heads, dim=kv_cache.dim, dtype_bytes=kv_cache.dtype_bytes)
        if shape.page_bytes != namespace.page_bytes:
            raise errors.PageSizeMismatch(f"a block of this cache holds {shape.page_bytes} bytes, the namespace's "
                                          f"pages {namespace.page_bytes}")
        raw_keys = encode_keys(keys)
        blocks = np.asarray(block_ids, dtype=np.int64).reshape(-1)
        if len(blocks) != len(raw_keys):
            raise errors.InvalidArgument(f"got {len(blocks)} block ids for {len(raw_keys)} keys")
        plan = kv_layout.plan(shape, page_format, kv_cache)
        plan.check_blocks(blocks)
        return plan, raw_keys, blocks

    def _page_addresses(self, conn: NodeConnection, acquired: pb.AcquireResponse, hits: int) -> np.ndarray:
        """Where each hit page is, as the device sees it: in the node's HBM pool when the answer says so, else in
        the arena (under _lock)."""
        addrs = self._arena_base(conn) + np.asarray(acquired.offsets[:hits], dtype=np.uint64)
        if len(acquired.hbm_offsets):
            hbm = np.asarray(acquired.hbm_offsets[:hits], dtype=np.int64)
            in_hbm = hbm >= 0
            if in_hbm.any():
                region = conn.hello.hbm
                if int(hbm.max()) + acquired.page_bytes > region.nbytes:
                    raise errors.Internal(f"the node answered an HBM offset {int(hbm.max())} past its "
                                          f"{region.nbytes}-byte pool")
                addrs[in_hbm] = self._hbm_base(region) + hbm[in_hbm].astype(np.uint64)
        return addrs

    def _hbm_base(self, region: pb.HbmRegion) -> int:
        """The address of the node's HBM pool here: its handle is opened once and kept while the node serves it
        (a restarted node exports a new pool; the old one is closed then). Under _lock."""
        if self._hbm is None or self._hbm[0] != region.ipc_handle:
            self._close_hbm()
            self._hbm = (region.ipc_handle, self._device.open_ipc(region.ipc_handle))
        return self._hbm[1]

    def _close_hbm(self) -> None:
        if self._hbm is not None:
            self._device.close_ipc(self._hbm[1])
            self._hbm = None

    def _arena_base(self, conn: NodeConnection) -> int:
        """The device address of the arena this connection mapped; registers it on first use (under _lock)."""
        arena = _require_arena(conn)
        if self._registration is None or self._registration.arena is not arena:
            if self._registration is not None:      # the node restarted: its old arena goes
                self._registration.drop(self._device)
                self._registration = None
            self._registration = ArenaRegistration(arena, self._device)
        return self._registration.device_base

    def _batches(self, count: int) -> list[tuple[int, int]]:
        step = self._client.limits.batch_pages_max
        return [(start, min(start + step, count)) for start in range(0, count, step)]


class _PutBatch:
    def __init__(self, keys: list[bytes], parent: bytes, blocks: np.ndarray, durable: bool):
        self.keys, self.parent, self.blocks, self.durable = keys, parent, blocks, durable
        self.slots_reserved = False     # once set, a failed attempt is not repeated on a new connection


def _require_arena(conn: NodeConnection) -> Any:
    arena = getattr(conn.data, "arena", None)
    if arena is None:
        raise errors.InvalidArgument(f"GPU transfers copy to and from the node's shared-memory arena: the client "
                                     f"must run on the node's host (its data plane is {conn.data.name!r})")
    if not arena.whole:
        # The device registration pins the whole mapping: in a tenant's memfd that would allocate its holes,
        # and a slab the node later moved away and back would be new memory the registration never sees.
        raise errors.InvalidArgument("GPU transfers register the node's whole arena with the device, which needs the "
                                     "arena in one memfd: this node keeps tenants in memfds of their own (auth "
                                     "configured); load pages with KVStoreClient.get and copy them to the GPU")
    return arena


def _check_node(conn: NodeConnection) -> None:
    """Offsets answered by a node that stopped during the copy may be a restarted node's: nothing copied counts."""
    if not conn.data.alive():
        raise errors.Unavailable("the node's shm socket closed during the copy (the node stopped): "
                                 "the arena mapping is stale and nothing copied counts")
