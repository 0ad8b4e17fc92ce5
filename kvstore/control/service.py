"""The kvstore service: every control-plane method, over the wire messages, carrier-agnostic.

gRPC (grpc_server.py) and the local Unix-socket channel (local_server.py) both call
`handle(method, request, owner)`. Methods raise the exceptions of kvstore_client.errors;
the carriers turn them into statuses. One lock guards the index, allocator and leases;
checksums of committed slots, and NVMe reads and writes (controller.py), happen outside it.
"""

from __future__ import annotations

import dataclasses
import hmac
import itertools
import logging
import secrets
import threading
import time
from typing import Any, Callable, Sequence

import xxhash

from kvstore import __version__
from kvstore.config import Config
from kvstore.control import route
from kvstore.control.controller import CacheController
from kvstore.control.engine_index import EngineIndex
from kvstore.control.index import NO_SLOT, PageIndex, PageRecord
from kvstore.control.leases import READ, WRITE, Lease, LeaseTable
from kvstore.limits import Limits
from kvstore.tiers.dram import Arena, SlabAllocator, slot_bytes_for
from kvstore.tiers.nvme import NvmeTier
from kvstore.transport.slots import Grant, QueuePairAddress, RdmaAcceptor
from kvstore_client import errors
from kvstore_client.keys import Namespace, encode_key, namespace_id, prefix_hashes
from kvstore_client.proto import pb

log = logging.getLogger(__name__)

NAMESPACES_MAX = 4096


class Counters:
    def __init__(self) -> None:
        self.dram_hits = 0          # pages served from DRAM as they were
        self.nvme_hits = 0          # pages served after promotion from NVMe
        self.misses = 0
        self.evictions = 0          # DRAM copies dropped (pages only in DRAM leave the index)
        self.nvme_evictions = 0
        self.promotions = 0
        self.promoted_bytes = 0
        self.demotions = 0
        self.demoted_bytes = 0
        self.corrupt_pages = 0
        self.leases_expired = 0
        self.pages_committed = 0
        self.checksum_failures = 0
        self.write_queue_drops = 0
        self.nvme_write_errors = 0
        self.recovered_pages = 0
        self.bytes_reserved = 0      # page bytes of slots granted for writing (clients copy into them)
        self.bytes_acquired = 0      # page bytes of pages leased for reading (clients copy out of them)


class KVStoreService:
    def __init__(self, config: Config, arena: Arena, shm_socket: str = "", nvme: NvmeTier | None = None):
        self.config = config
        self.limits = Limits.from_config(config)
        self.arena = arena
        self.shm_socket = shm_socket
        self.allocator = SlabAllocator(arena.nbytes, config.dram.slab_bytes)
        self.index = PageIndex(on_removed=self._on_removed, on_dram_dropped=self._free_slot)
        self.leases = LeaseTable()
        self.namespaces: dict[int, Namespace] = {}
        self.pending: dict[tuple[int, bytes], int] = {}   # reserved, uncommitted page -> lease id
        self.counters = Counters()
        # The ENGINE tier: pages engines hold in their own memory, fed by their KV events.
        self.engines = EngineIndex(config.events.blocks_max, config.events.hash_seed)
        self.draining = False
        self.instance_id = secrets.token_bytes(8)
        self.tcp_endpoint = ""                   # set by the server once the TCP data plane listens
        self.rdma: RdmaAcceptor | None = None    # set by the server when the arena is registered
        self.lock = threading.Lock()
        self.nvme = nvme
        self.controller = CacheController(self, nvme, config.controller) if nvme else None
        self._methods: dict[str, Callable[[Any, object | None], Any]] = {
            "Hello": self.hello, "OpenNamespace": self.open_namespace, "Lookup": self.lookup,
            "Reserve": self.reserve, "Commit": self.commit, "Abort": self.abort,
            "Acquire": self.acquire, "Release": self.release, "Delete": self.delete, "Stats": self.stats,
            "RdmaConnect": self.rdma_connect,
            "Route": self.route,
        }

    def handle(self, method: str, request: Any, owner: object | None = None) -> Any:
        return self._methods[method](request, owner)

    # -- methods ----------------------------------------------------------------------

    def hello(self, request: pb.HelloRequest, owner: object | None) -> pb.HelloResponse:
        leases = self.config.leases
        return pb.HelloResponse(
            server_version=__version__, shm_socket=self.shm_socket, arena_bytes=self.arena.nbytes,
            limits=pb.Limits(
                batch_pages_max=self.limits.batch_pages_max, page_bytes_max=self.limits.page_bytes_max,
                key_bytes_max=self.limits.key_bytes_max, read_lease_ttl_ms=leases.read_ttl_ms,
                write_lease_ttl_ms=leases.write_ttl_ms, frame_bytes_max=self.limits.frame_bytes_max),
            tcp_endpoint=self.tcp_endpoint, rdma_enabled=self.rdma is not None, instance_id=self.instance_id)

    def open_namespace(self, request: pb.OpenNamespaceRequest, owner: object | None) -> pb.OpenNamespaceResponse:
        spec = request.spec
        if not spec.model:
            raise errors.InvalidArgument("spec.model is empty: name the model whose KV this is")
        if not 0 < spec.page_bytes <= self.limits.page_bytes_max:
            raise errors.InvalidArgument(
                f"spec.page_bytes={spec.page_bytes} must be 1 to {self.limits.page_bytes_max} (limits.page_bytes_max)")
        if spec.tp_size and spec.tp_rank >= spec.tp_size:
            raise errors.InvalidArgument(f"spec.tp_rank={spec.tp_rank} must be below spec.tp_size={spec.tp_size}")
        if spec.hash_seed:
            try:
                bytes.fromhex(spec.hash_seed)
            except ValueError:
                raise errors.InvalidArgument("spec.hash_seed must be a hex string") from None
        namespace = Namespace.from_proto(spec)
        ns_id = namespace_id(namespace)
        with self.lock:
            if ns_id not in self.namespaces:
                if len(self.namespaces) >= NAMESPACES_MAX:
                    raise errors.CapacityExhausted(f"this server already holds {NAMESPACES_MAX} namespaces")
                self.namespaces[ns_id] = namespace
                log.info("namespace opened id=%016x model=%s tenant=%s page_bytes=%d",
                         ns_id, namespace.model, namespace.tenant, namespace.page_bytes)
        return pb.OpenNamespaceResponse(namespace_id=ns_id)

    def lookup(self, request: pb.LookupRequest, owner: object | None) -> pb.LookupResponse:
        namespace = self._namespace(request.namespace_id)
        keys = self._lookup_keys(namespace, request)
        ns_id = request.namespace_id
        tiers = self._store_tiers(ns_id, keys)
        return pb.LookupResponse(hit_pages=len(tiers), tiers=tiers)

    def reserve(self, request: pb.ReserveRequest, owner: object | None) -> pb.ReserveResponse:
        namespace = self._namespace(request.namespace_id)
        if request.page_bytes != namespace.page_bytes:
            raise errors.PageSizeMismatch(
                f"page_bytes={request.page_bytes} but namespace {namespace.model!r} stores pages of "
                f"{namespace.page_bytes} bytes")
        keys = self._check_keys(request.keys)
        if request.parent_key:
            self._check_keys([request.parent_key], what="parent_key")
        ttl_ms = self._ttl(request.lease_ttl_ms, self.config.leases.write_ttl_ms)
        ns_id = request.namespace_id
        slot_bytes = slot_bytes_for(namespace.page_bytes)
        states = [pb.PARENT_MISSING] * len(keys)
        offsets = [0] * len(keys)
        with self.lock:
            self._check_not_draining()
            if request.lease_id:
                lease = self._extended_lease(request)
            else:
                parent_id = (ns_id, request.parent_key)
                parent = self.index.get(parent_id) if request.parent_key else None
                if request.parent_key and parent is None and parent_id not in self.pending:
                    return pb.ReserveResponse(states=states, offsets=offsets)
                lease = self.leases.open(WRITE, ns_id, time.monotonic(), ttl_ms, owner)
                lease.parent_key = request.parent_key
                if parent is not None:
                    self._pin(lease, parent)
            first_index = len(lease.keys)
            lease.keys.extend(keys)
            pages, pending = self.index, self.pending
            wanted = []
            for i, key in enumerate(keys):
                record = pages.get((ns_id, key))
                if record is not None:
                    states[i] = pb.PRESENT
                    self._pin(lease, record)
                elif (ns_id, key) in pending:
                    states[i] = pb.IN_FLIGHT
                else:
                    wanted.append(i)
            granted = self.allocate_slots(slot_bytes, len(wanted))
            for i, offset in zip(wanted, granted):
                pending[(ns_id, keys[i])] = lease.lease_id
                lease.slots[first_index + i] = offset
                states[i], offsets[i] = pb.RESERVED, offset
            for i in wanted[len(granted):]:
                states[i] = pb.NO_SPACE
            self.counters.bytes_reserved += len(granted) * namespace.page_bytes
            if not lease.slots and not request.lease_id:
                self._end_lease(lease)
                if wanted:
                    raise errors.CapacityExhausted(
                        f"no slot of {slot_bytes} bytes can be freed: every page is pinned by a lease "
                        "or the arena is full of other page sizes")
                return pb.ReserveResponse(states=states, offsets=offsets)
        return pb.ReserveResponse(lease_id=lease.lease_id, states=states, offsets=offsets,
                                  lease_ttl_ms=lease.ttl_ms, first_index=first_index, data_token=lease.token)

    def _extended_lease(self, request: pb.ReserveRequest) -> Lease:
        lease = self._lease(request.lease_id, WRITE)
        if lease.namespace_id != request.namespace_id:
            raise errors.InvalidArgument(f"lease {request.lease_id:#x} belongs to another namespace")
        if request.parent_key != lease.keys[-1]:
            raise errors.InvalidArgument(
                "parent_key of an extending Reserve must be the last key reserved under the lease")
        return lease

    def commit(self, request: pb.CommitRequest, owner: object | None) -> pb.CommitResponse:
        with self.lock:
            lease = self._lease(request.lease_id, WRITE)
            indices = list(request.indices) or sorted(lease.slots)
            if len(set(indices)) != len(indices):
                raise errors.DuplicateKey("an index appears twice in indices")
            for index in indices:
                if index not in lease.slots:
                    raise errors.InvalidArgument(
                        f"index {index} is not a reserved, uncommitted slot of lease {request.lease_id:#x}")
                if index in lease.writing:
                    raise errors.SlotBusy(f"index {index} of lease {request.lease_id:#x} is still being written "
                                          "over the data plane: commit it after its transfer is answered")
            if request.checksums and len(request.checksums) != len(indices):
                raise errors.InvalidArgument(
                    f"{len(request.checksums)} checksums for {len(indices)} pages: give one per page or none")
            page_bytes = self.namespaces[lease.namespace_id].page_bytes
            offsets = [lease.slots[i] for i in indices]
            lease.busy += 1
        try:
            # The slots belong to this lease alone, so their bytes can be hashed unlocked.
            view = self.arena.view
            sums = [xxhash.xxh3_64_intdigest(view[o:o + page_bytes]) for o in offsets]
        finally:
            with self.lock:
                lease.busy -= 1
        with self.lock:
            if request.checksums:
                for position, (want, got) in enumerate(zip(request.checksums, sums)):
                    if want != got:
                        self.counters.checksum_failures += 1
                        raise errors.ChecksumMismatch(
                            f"page at index {indices[position]} hashes to {got:#018x}, not {want:#018x}; "
                            "nothing in this commit was made visible: rewrite the slot or abort")
            if self.leases.get(lease.lease_id) is not lease:
                raise errors.LeaseNotFound(f"lease {request.lease_id:#x} ended while its commit was checked")
            states = self._publish(lease, indices, sums)
            if not lease.slots:
                self._end_lease(lease)
        return pb.CommitResponse(states=states, checksums=sums)

    def abort(self, request: pb.AbortRequest, owner: object | None) -> pb.AbortResponse:
        with self.lock:
            lease = self._lease(request.lease_id, WRITE)
            aborted = len(lease.slots)
            self._end_lease(lease)
        return pb.AbortResponse(aborted_pages=aborted)

    def acquire(self, request: pb.AcquireRequest, owner: object | None) -> pb.AcquireResponse:
        namespace = self._namespace(request.namespace_id)
        keys = self._check_keys(request.keys)
        ttl_ms = self._ttl(request.lease_ttl_ms, self.config.leases.read_ttl_ms)
        ns_id = request.namespace_id
        with self.lock:
            self._check_not_draining()
            records = self.index.leading(ns_id, keys)
            missing = [r for r in records if r.offset == NO_SLOT]
            if not missing or not self.controller or request.policy == pb.BEST_EFFORT:
                if missing and self.controller:
                    self.controller.prefetch(missing)
                ready = records[:records.index(missing[0])] if missing else records
                return self._read_lease(namespace, ns_id, keys, ready, len(ready), ttl_ms, owner, 0)
            in_dram = records.index(missing[0])
        deadline = time.monotonic() + self._promote_wait_s(request)
        promoted = self.controller.promote(missing, deadline)
        self.controller.wait_promoted(missing, deadline)
        with self.lock:
            ready = list(itertools.takewhile(lambda r: r.offset != NO_SLOT, self.index.leading(ns_id, keys)))
            return self._read_lease(namespace, ns_id, keys, ready, min(in_dram, len(ready)), ttl_ms, owner, promoted)

    def _read_lease(self, namespace: Namespace, ns_id: int, keys: list[bytes], records: list[PageRecord],
                    from_dram: int, ttl_ms: int, owner: object | None, promoted: int) -> pb.AcquireResponse:
        """Lock held: pin the leading pages ready in DRAM under a new read lease, and count."""
        self.counters.dram_hits += from_dram
        self.counters.nvme_hits += len(records) - from_dram
        self.counters.misses += len(keys) - len(records)
        if not records:
            return pb.AcquireResponse(page_bytes=namespace.page_bytes)
        lease = self.leases.open(READ, ns_id, time.monotonic(), ttl_ms, owner)
        self.index.pin_all(records, hit=True)
        lease.pinned = records
        if self.controller:
            self.controller.on_hit(records)
        self.counters.bytes_acquired += len(records) * namespace.page_bytes
        return pb.AcquireResponse(
            lease_id=lease.lease_id, hit_pages=len(records), offsets=[r.offset for r in records],
            checksums=[r.checksum for r in records], page_bytes=namespace.page_bytes, lease_ttl_ms=ttl_ms,
            promoted_pages=min(promoted, len(records)), data_token=lease.token)

    def release(self, request: pb.ReleaseRequest, owner: object | None) -> pb.ReleaseResponse:
        with self.lock:
            leases = [self._lease(lease_id, READ) for lease_id in request.lease_ids]
            for lease in leases:
                self._end_lease(lease)
        return pb.ReleaseResponse(released=len(leases))

    def delete(self, request: pb.DeleteRequest, owner: object | None) -> pb.DeleteResponse:
        self._namespace(request.namespace_id)
        if request.all_pages and request.keys:
            raise errors.InvalidArgument("all_pages=true deletes the whole namespace: send no keys with it")
        keys = [] if request.all_pages else self._check_keys(request.keys)
        removed: list[PageRecord] = []
        with self.lock:
            records = self.index.roots(request.namespace_id) if request.all_pages else [
                self.index.get((request.namespace_id, key)) for key in keys]
            for record in records:
                if record is not None and record.alive:
                    removed += self.index.remove_subtree(record)
        on_nvme = [r.page_id for r in removed if r.on_nvme]
        if on_nvme:
            self.nvme.delete(on_nvme)  # before answering: a deleted page never comes back at restart
        if removed:
            log.info("pages deleted namespace=%016x pages=%d", request.namespace_id, len(removed))
        return pb.DeleteResponse(deleted_pages=len(removed))

    def stats(self, request: pb.StatsRequest, owner: object | None) -> pb.StatsResponse:
        c = self.counters
        nvme_used = self.nvme.used_bytes() if self.nvme else 0
        with self.lock:
            tiers = [pb.TierStats(
                tier=pb.DRAM, capacity_bytes=self.allocator.capacity_bytes, used_bytes=self.allocator.used_bytes,
                pages=self.index.dram_pages, hits=c.dram_hits, misses=c.misses, evictions=c.evictions,
                promotions=c.promotions, demotions=c.demotions, bytes_in=c.promoted_bytes,
                bytes_out=c.demoted_bytes)]
            if self.nvme:
                tiers.append(pb.TierStats(
                    tier=pb.NVME, capacity_bytes=self.nvme.capacity_bytes, used_bytes=nvme_used,
                    pages=self.index.nvme_pages, hits=c.nvme_hits, evictions=c.nvme_evictions,
                    bytes_in=c.demoted_bytes, bytes_out=c.promoted_bytes, corrupt_pages=c.corrupt_pages))
            namespaces = [
                pb.NamespaceStats(namespace_id=ns_id, model=ns.model, tenant=ns.tenant, page_bytes=ns.page_bytes,
                                  pages=self.index.pages_by_namespace.get(ns_id, 0))
                for ns_id, ns in self.namespaces.items()]
            return pb.StatsResponse(
                tiers=tiers, namespaces=namespaces, leases_open=len(self.leases), leases_expired=c.leases_expired,
                pages_committed=c.pages_committed, checksum_failures=c.checksum_failures,
                write_queue_drops=c.write_queue_drops, recovered_pages=c.recovered_pages,
                nvme_write_errors=c.nvme_write_errors)

    def rdma_connect(self, request: pb.RdmaConnectRequest, owner: object | None) -> pb.RdmaConnectResponse:
        if self.rdma is None:
            raise errors.TransportUnavailable("this node offers no RDMA data plane (rdma.enabled is off or no device)")
        qp = request.queue_pair
        if len(qp.gid) not in (0, 16) or not qp.qp_num:
            raise errors.InvalidArgument("queue_pair needs a qp_num and a 16-byte gid (or none)")
        local, arena_addr, rkey = self.rdma.accept(QueuePairAddress(qp.lid, bytes(qp.gid), qp.qp_num, qp.psn, qp.mtu))
        return pb.RdmaConnectResponse(
            queue_pair=pb.RdmaQueuePair(lid=local.lid, gid=local.gid, qp_num=local.qp_num, psn=local.psn,
                                        mtu=local.mtu),
            arena_addr=arena_addr, rkey=rkey, arena_bytes=self.arena.nbytes)

    # -- data plane: transports resolve a frame's (lease, token, slot, length) here -------

    def resolve_write(self, lease_id: int, token: bytes, slot: int, nbytes: int) -> Grant:
        """The arena bytes of an uncommitted reserved slot, held until finish/cut_transfer."""
        with self.lock:
            lease = self._data_lease(lease_id, token, WRITE)
            offset = lease.slots.get(slot)
            if offset is None:
                raise errors.SlotNotInLease(f"slot {slot} is not a reserved, uncommitted slot of lease {lease_id:#x}")
            if slot in lease.writing:
                raise errors.SlotBusy(f"slot {slot} of lease {lease_id:#x} is already being written")
            page_bytes = self._transfer_bytes(lease, nbytes)
            lease.writing.add(slot)
            lease.transfers += 1
            return Grant(lease, slot, self.arena.view[offset:offset + page_bytes], lease.deadline, True)

    def resolve_read(self, lease_id: int, token: bytes, slot: int, nbytes: int) -> Grant:
        """The arena bytes of the slot-th page pinned by a read lease, held until finish_transfer."""
        with self.lock:
            lease = self._data_lease(lease_id, token, READ)
            if not 0 <= slot < len(lease.pinned):
                raise errors.SlotNotInLease(f"lease {lease_id:#x} pins {len(lease.pinned)} pages; no page {slot}")
            page_bytes = self._transfer_bytes(lease, nbytes)
            offset = lease.pinned[slot].offset
            lease.transfers += 1
            return Grant(lease, slot, self.arena.view[offset:offset + page_bytes], lease.deadline, False)

    def finish_transfer(self, grant: Grant) -> None:
        with self.lock:
            self._end_transfer(grant)

    def cut_transfer(self, grant: Grant) -> None:
        """A write stopped part-way (connection lost): its lease ends, so the torn page is never visible."""
        with self.lock:
            self._end_transfer(grant)
            lease = grant.lease
            if self.leases.get(lease.lease_id) is lease:
                log.info("data-plane write cut mid-page; lease=%016x aborted", lease.lease_id)
                self._end_lease(lease)

    def _end_transfer(self, grant: Grant) -> None:
        lease = grant.lease
        lease.transfers -= 1
        assert lease.transfers >= 0, "a transfer ended twice"
        if grant.write:
            lease.writing.discard(grant.slot)
        if lease.ended and not lease.transfers:
            self._free_lease_memory(lease)

    def _data_lease(self, lease_id: int, token: bytes, kind: str) -> Lease:
        lease = self.leases.get(lease_id)
        if lease is None or time.monotonic() > lease.deadline:
            raise errors.LeaseNotFound(f"lease {lease_id:#x} is unknown, already finished, or expired")
        if not hmac.compare_digest(lease.token, token):
            raise errors.TokenMismatch(f"the token does not match lease {lease_id:#x}")
        if lease.kind != kind:
            verb = "written" if kind == WRITE else "read"
            raise errors.SlotNotInLease(f"lease {lease_id:#x} is a {lease.kind} lease: its slots cannot be {verb}")
        return lease

    def _transfer_bytes(self, lease: Lease, nbytes: int) -> int:
        page_bytes = self.namespaces[lease.namespace_id].page_bytes
        if nbytes != page_bytes:
            raise errors.LengthMismatch(f"{nbytes} bytes for a page of {page_bytes}: move whole pages")
        return page_bytes

    def route(self, request: pb.RouteRequest, owner: object | None) -> pb.RouteResponse:
        namespace = self._namespace(request.namespace_id)
        keys = self._lookup_keys(namespace, request)
        engine_ids = route.check_engine_ids(request.engine_ids, self.config.route.engines_max)
        store_tiers = self._store_tiers(request.namespace_id, keys)
        weights = self.config.route
        scores = route.score_engines(
            engine_ids, store_tiers, self.engines.holders(keys, engine_ids), len(keys),
            route.Weights(weights.weight_engine_gpu, weights.weight_engine_host, weights.weight_dram, weights.weight_nvme))
        return pb.RouteResponse(scores=scores, best_engine_id=route.best_engine(scores))

    # -- lifecycle hooks for the carriers and the server --------------------------------

    def end_owner(self, owner: object) -> int:
        """A connection closed: abort its write leases and release its read leases."""
        with self.lock:
            leases = self.leases.owned_by(owner)
            for lease in leases:
                self._end_lease(lease)
        if leases:
            log.info("connection closed with open leases; ended leases=%d", len(leases))
        return len(leases)

    def reap_expired(self) -> int:
        with self.lock:
            expired = [(lease, len(lease.slots), len(lease.pinned)) for lease in self.leases.expired(time.monotonic())]
            for lease, _, _ in expired:
                self._end_lease(lease)
            self.counters.leases_expired += len(expired)
        for lease, uncommitted, pinned in expired:
            log.info("lease expired kind=%s lease=%016x uncommitted_pages=%d pinned_pages=%d",
                     lease.kind, lease.lease_id, uncommitted, pinned)
        return len(expired)

    def start_draining(self) -> None:
        with self.lock:
            self.draining = True

    def open_leases(self) -> int:
        with self.lock:
            return len(self.leases)

    # -- internals (called with the lock held where they touch shared state) -------------

    def _publish(self, lease: Lease, indices: list[int], sums: list[int]) -> list[int]:
        """Make checked pages visible in chain order; a page whose parent is gone is dropped."""
        ns_id, keys, index = lease.namespace_id, lease.keys, self.index
        slot_bytes = slot_bytes_for(self.namespaces[ns_id].page_bytes)
        states, published = [], []
        for position, checksum in zip(indices, sums):
            key = keys[position]
            offset = lease.slots.pop(position)
            del self.pending[(ns_id, key)]
            parent_key = keys[position - 1] if position else lease.parent_key
            parent = index.get((ns_id, parent_key)) if parent_key else None
            if parent_key and parent is None:
                self.allocator.free(offset)
                states.append(pb.COMMIT_PARENT_MISSING)
                continue
            published.append(index.add((ns_id, key), parent, offset, slot_bytes, checksum))
            states.append(pb.COMMITTED)
        index.touch_all(published)
        self.counters.pages_committed += len(published)
        if self.controller:
            self.controller.on_commit(published)
        return states

    def _end_lease(self, lease: Lease) -> None:
        if lease.ended:
            return
        lease.ended = True
        for index in lease.slots:
            del self.pending[(lease.namespace_id, lease.keys[index])]
        if not lease.transfers:  # else bytes still move through its slots: the last transfer frees them
            self._free_lease_memory(lease)
        if self.leases.get(lease.lease_id) is lease:
            self.leases.close(lease)

    def _free_lease_memory(self, lease: Lease) -> None:
        for offset in lease.slots.values():
            self.allocator.free(offset)
        lease.slots.clear()
        self.index.unpin_all(lease.pinned)
        lease.pinned = []

    def _store_tiers(self, ns_id: int, keys: list[bytes]) -> list[int]:
        """The tier of each leading page this store holds (DRAM when it is in both)."""
        with self.lock:
            return [pb.NVME if r.offset == NO_SLOT else pb.DRAM for r in self.index.leading(ns_id, keys)]

    def _on_removed(self, record: PageRecord) -> None:
        """A page left the index and no lease holds it: its DRAM slot may be reused."""
        if record.in_dram:
            self._free_slot(record)
            record.offset = NO_SLOT

    def _free_slot(self, record: PageRecord) -> None:
        self.allocator.free(record.offset)

    def namespace_spec(self, ns_id: int) -> dict:
        return dataclasses.asdict(self.namespaces[ns_id])

    def _promote_wait_s(self, request: pb.AcquireRequest) -> float:
        controller = self.config.controller
        if request.policy == pb.TIMEOUT:
            return (request.timeout_ms or controller.prefetch_timeout_ms) / 1000
        return controller.promote_wait_ms_max / 1000

    def _pin(self, lease: Lease, record: PageRecord) -> None:
        self.index.pin(record)
        lease.pinned.append(record)

    def allocate_slots(self, slot_bytes: int, count: int) -> list[int]:
        """Lock held. Up to `count` free slots, evicting least recently used pages when the arena is full."""
        offsets = self.allocator.allocate_many(slot_bytes, count)
        if len(offsets) < count and self.controller:
            self.controller.demote_before_eviction(count - len(offsets))
        while len(offsets) < count:
            if self.index.evict_dram(slot_bytes) is None and not self._evict_for_slab():
                break
            self.counters.evictions += 1
            offsets += self.allocator.allocate_many(slot_bytes, count - len(offsets))
        return offsets

    def _evict_for_slab(self) -> bool:
        """Evict the oldest leaves of other page sizes until a whole slab is free (bounded)."""
        budget = self.config.dram.slab_bytes // 4096
        while not self.allocator.has_free_slab() and budget > 0:
            slot_bytes = self.index.oldest_evictable_slot_bytes()
            if slot_bytes is None or self.index.evict_dram(slot_bytes) is None:
                return False
            self.counters.evictions += 1
            budget -= 1
        return self.allocator.has_free_slab()

    def _namespace(self, ns_id: int) -> Namespace:
        namespace = self.namespaces.get(ns_id)
        if namespace is None:
            raise errors.NamespaceNotFound(
                f"namespace {ns_id:#018x} is not open on this server; call OpenNamespace with its spec first")
        return namespace

    def _lease(self, lease_id: int, kind: str) -> Lease:
        lease = self.leases.get(lease_id)
        if lease is None:
            raise errors.LeaseNotFound(f"lease {lease_id:#x} is unknown, already finished, or expired")
        if lease.kind != kind:
            verb = "Abort or Commit" if lease.kind == WRITE else "Release"
            raise errors.InvalidArgument(f"lease {lease_id:#x} is a {lease.kind} lease: end it with {verb}")
        return lease

    def _check_keys(self, keys: Sequence[bytes], what: str = "keys") -> list[bytes]:
        if not keys:
            raise errors.InvalidArgument(f"{what} is empty: send at least one key")
        if len(keys) > self.limits.batch_pages_max:
            raise errors.BatchTooLarge(
                f"{len(keys)} keys in one call; limits.batch_pages_max is {self.limits.batch_pages_max}: split it")
        sizes = list(map(len, keys))
        if min(sizes) == 0 or max(sizes) > self.limits.key_bytes_max:
            position = next(i for i, n in enumerate(sizes) if not 0 < n <= self.limits.key_bytes_max)
            raise errors.InvalidArgument(
                f"{what}[{position}] has {sizes[position]} bytes; keys are 1 to {self.limits.key_bytes_max} bytes")
        if len(set(keys)) != len(keys):
            raise errors.DuplicateKey(f"{what} holds the same key twice; a chain never repeats a page")
        return list(keys)

    def _lookup_keys(self, namespace: Namespace, request: pb.LookupRequest) -> list[bytes]:
        if request.keys and request.tokens:
            raise errors.InvalidArgument("give keys or tokens, not both")
        if not request.tokens:
            return self._check_keys(request.keys)
        if not namespace.page_tokens:
            raise errors.InvalidArgument("lookup by tokens needs a namespace with page_tokens set")
        keys = [encode_key(k) for k in prefix_hashes(request.tokens, namespace.page_tokens, namespace.hash_seed)]
        if len(keys) > self.limits.batch_pages_max:
            raise errors.BatchTooLarge(f"{len(keys)} pages of tokens; limits.batch_pages_max is "
                                       f"{self.limits.batch_pages_max}")
        return keys

    def _ttl(self, asked_ms: int, default_ms: int) -> int:
        if asked_ms > self.config.leases.ttl_ms_max:
            raise errors.InvalidArgument(
                f"lease_ttl_ms={asked_ms} exceeds leases.ttl_ms_max={self.config.leases.ttl_ms_max}")
        return asked_ms or default_ms

    def _check_not_draining(self) -> None:
        if self.draining:
            raise errors.Draining("the server is draining for shutdown and takes no new leases")

