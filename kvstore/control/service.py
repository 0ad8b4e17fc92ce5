"""The kvstore service: the rules of every control-plane method, carrier-agnostic.

gRPC (grpc_server.py) and the local Unix-socket channel (local_server.py) both call
`handle(method, request, owner)`, the owner being the caller (identity.Caller: the
connection or call its leases end with, and who it is). What the caller's identity may name
is checked first (tenancy.py), then methods check their input whole (checks.py) before any
work, then ask the page store (store.py), which owns all page state and its lock, and the
cache controller (controller.py), which does the disk I/O. The service itself holds no
lock and touches no disk. Methods raise the exceptions of kvstore_client.errors; the
carriers turn them into statuses.
"""

from __future__ import annotations

import binascii
import ctypes
import logging
import secrets
import time
from typing import Any, Callable

from kvstore import __version__, failpoints
from kvstore.control import checks, route, tenancy
from kvstore_client import groups
from kvstore.control.controller import CacheController
from kvstore.control.store_events import topic_of
from kvstore.control.engine_index import EngineIndex
from kvstore.control.hbm_mover import HbmMover
from kvstore.control.identity import TRUSTED, Caller
from kvstore.control.load_rates import LoadRates
from kvstore.control.local_proof import LocalProof
from kvstore.control.read_heat import ReadHeat
from kvstore.control.scrubber import Scrubber
from kvstore.control.store import PageStore
from kvstore.control.store_types import CommitPart, Counters, Evict
from kvstore.transport.slots import QueuePairAddress, RdmaAcceptor
from kvstore_client import errors, packed
from kvstore_client.keys import HEX_DIGEST_BYTES, HEX_KEY_BYTES
from kvstore_client.proto import pb

log = logging.getLogger(__name__)


class KVStoreService:
    def __init__(self, store: PageStore, controller: CacheController | None = None,
                 scrubber: Scrubber | None = None, shm_socket: str = ""):
        self.store = store
        self.config = store.config
        self.limits = store.limits
        self.controller = controller
        self.scrubber = scrubber
        self.shm_socket = shm_socket
        # The ENGINE tier: pages engines hold in their own memory, fed by their KV events.
        events = self.config.events
        self.engines = EngineIndex(events.blocks_max, events.hash_seed,
                                   dict(zip(events.engine_ids, events.block_tokens)))
        self.instance_id = secrets.token_bytes(8)
        self.local_proof = LocalProof()            # answers PROVE on the Unix socket (local_server.py)
        # Tenants told apart but sharing one memfd (rdma.enabled pins it whole, tiers/dram.py): a freed slot
        # may still hold another tenant's page, and a writer that commits without writing (or an RDMA write
        # that never lands) would publish those bytes as its own. Such a node zeroes every slot it reserves.
        self.clear_reserved_slots = self.config.auth.enabled and not store.arena.tenants_apart
        self.tcp_endpoint = ""                   # set by the server once the TCP data plane listens
        self.tcp_tls = False                     # the TCP data plane speaks TLS (tcp.tls_cert)
        self.tcp_calls = False                   # the TCP data plane carries control calls (tcp_calls.py)
        self.rdma: RdmaAcceptor | None = None    # set by the server when the arena is registered
        self.hbm: pb.HbmRegion | None = None     # set by the server when it holds an HBM pool
        self.hbm_mover: HbmMover | None = None   # with it: what brings pages into the pool
        cluster = self.config.cluster
        self.read_heat = (ReadHeat(cluster.hot_reads, cluster.hot_half_life_s, cluster.hot_pages_max)
                          if cluster.endpoints and cluster.hot_reads else None)   # only a cluster replicates
        self.load_rates = LoadRates()   # what an Acquire's pages cost lately, per tier (fetch or recompute)
        self._methods: dict[str, Callable[[Any, object | None], Any]] = {
            "Hello": self.hello, "OpenNamespace": self.open_namespace, "Lookup": self.lookup,
            "Reserve": self.reserve, "Commit": self.commit, "Abort": self.abort,
            "Acquire": self.acquire, "Release": self.release, "Delete": self.delete, "Stats": self.stats,
            "RdmaConnect": self.rdma_connect, "Route": self.route, "Scrub": self.scrub,
            "RdmaDisconnect": self.rdma_disconnect, "ListKeys": self.list_keys,
            "CommitGroup": self.commit_group, "LookupGroup": self.lookup_group, "AcquireGroup": self.acquire_group,
            "ListPages": self.list_pages,
        }

    @property
    def counters(self) -> Counters:
        return self.store.counters

    @property
    def draining(self) -> bool:
        return self.store.draining

    def handle(self, method: str, request: Any, owner: object | None = None) -> Any:
        identity, arena = (owner.identity, owner.arena) if isinstance(owner, Caller) else (TRUSTED, None)
        tenancy.admit(self.store, method, request, identity)
        tenancy.own_arena(self.store, method, request, arena)
        if identity.admin:
            return self._methods[method](request, owner)
        if method == "Stats":
            return tenancy.tenant_stats(self.store, request, identity, checks.stats_page(request, self.config)[1])
        return tenancy.scoped(method, self._methods[method](request, owner))

    # -- methods ----------------------------------------------------------------------

    def hello(self, request: pb.HelloRequest, owner: object | None) -> pb.HelloResponse:
        leases = self.config.leases
        challenge, answer = self.local_proof.issue() if self.shm_socket else (b"", b"")
        return pb.HelloResponse(
            server_version=__version__, shm_socket=self.shm_socket, arena_bytes=self.store.arena.nbytes,
            limits=pb.Limits(
                batch_pages_max=self.limits.batch_pages_max, page_bytes_max=self.limits.page_bytes_max,
                lookup_pages_max=self.limits.lookup_pages_max, lookup_keys_packed=True,
                lookup_hex_digests=True, pages_packed=True, commit_copied_by_node=True,
                key_bytes_max=self.limits.key_bytes_max, read_lease_ttl_ms=leases.read_ttl_ms,
                write_lease_ttl_ms=leases.write_ttl_ms, frame_bytes_max=self.limits.frame_bytes_max),
            tcp_endpoint=self.tcp_endpoint, tcp_tls=self.tcp_tls, tcp_calls=self.tcp_calls,
            rdma_enabled=self.rdma is not None,
            instance_id=self.instance_id, hbm=self.hbm, local_challenge=challenge, local_answer=answer)

    def open_namespace(self, request: pb.OpenNamespaceRequest, owner: object | None) -> pb.OpenNamespaceResponse:
        namespace = checks.namespace_spec(request.spec, self.limits, self.config.limits.name_bytes_max)
        return pb.OpenNamespaceResponse(namespace_id=self.store.open_namespace(namespace))

    def lookup(self, request: pb.LookupRequest, owner: object | None) -> pb.LookupResponse:
        namespace = self.store.namespace(request.namespace_id)
        engine_ids = route.check_engine_ids(request.engine_ids, self.config.route.engines_max) \
            if request.engine_ids else []
        route.check_block_tokens(namespace.page_tokens, {e: self.engines.block_tokens(e) for e in engine_ids})
        followed = self.engines.heard_of(engine_ids)   # the others hold nothing this node knows of
        digests = False
        if request.hex_digests and not (request.key_bytes or request.keys_packed):
            raise errors.InvalidArgument("hex_digests says what keys_packed holds: send the digests there, "
                                         f"key_bytes={HEX_DIGEST_BYTES}")
        if request.each_key:
            if request.tokens:
                raise errors.InvalidArgument("each_key asks about keys: send them in keys or keys_packed, not as tokens")
            if request.key_bytes or request.keys_packed:
                keys, key_bytes, digests = checks.lookup_packed_keys(request, self.limits)
            else:
                keys, key_bytes = checks.lookup_keys(namespace, request, self.limits, request.parent_key), 0
            held = self.store.tiers_each(request.namespace_id, keys, key_bytes, digests)
            leading = held.find(0)
            answer = pb.LookupResponse(hit_pages=len(held) if leading < 0 else leading, held=held)
        elif request.key_bytes or request.keys_packed:
            keys, key_bytes, digests = checks.lookup_packed_keys(request, self.limits)
            tiers_packed = self.store.tiers_packed(request.namespace_id, keys, key_bytes, digests)
            answer = pb.LookupResponse(hit_pages=len(tiers_packed), tiers_packed=tiers_packed)
        else:
            keys, key_bytes = checks.lookup_keys(namespace, request, self.limits, request.parent_key), 0
            tiers = self.store.tiers(request.namespace_id, keys)
            last_key = keys[-1] if request.tokens and keys else b""
            answer = pb.LookupResponse(hit_pages=len(tiers), tiers=tiers, last_key=last_key)
        if request.load_rates:
            answer.load_rates.extend(self.load_rates.answer())
        if engine_ids:   # the engines' own caches, from their KV events (Route's view, as leading runs)
            if digests and followed:   # the engines' index knows hex keys by their digits
                keys, key_bytes = binascii.hexlify(keys), HEX_KEY_BYTES
            runs = self.engines.leading(keys, engine_ids, list(request.tokens) or None, namespace.page_tokens,
                                        key_bytes) if followed else [(0, 0)] * len(engine_ids)
            answer.engines.extend(pb.EnginePrefix(engine_id=engine_id, gpu_pages=gpu, held_pages=held)
                                  for engine_id, (gpu, held) in zip(engine_ids, runs))
        return answer

    def reserve(self, request: pb.ReserveRequest, owner: object | None) -> pb.ReserveResponse:
        namespace = self.store.namespace(request.namespace_id)
        if request.page_bytes != namespace.page_bytes:
            raise errors.PageSizeMismatch(
                f"page_bytes={request.page_bytes} but namespace {namespace.model!r} stores pages of "
                f"{namespace.page_bytes} bytes")
        keys = checks.keys(request.keys, self.limits)
        parent_key, parents = checks.parent_keys(request, keys, self.limits)
        ttl_ms = checks.lease_ttl_ms(request.lease_ttl_ms, self.config.leases.write_ttl_ms, self.config)
        store = self.store
        anchor = request.anchor_absent_parent or bool(request.parent_keys)
        reservation = store.reserve(request.namespace_id, keys, parent_key, request.lease_id, ttl_ms, owner,
                                    absent_parent="anchor" if anchor else "refuse", parents=parents)
        try:
            if reservation.lease is not None and request.rdma_qp_num:
                reservation.lease.rdma_qp_num = request.rdma_qp_num
                self._touch_rdma(request.rdma_qp_num)
            short = store.fill(reservation, store.evict_first)
            if short and self.controller and store.protect_unsaved:
                # DRAM holds pages not yet on NVMe older than any it could drop: write some down (outside every
                # lock), ask again; where none could be written, unsaved pages leave the cache last.
                cleaned = self.controller.clean(short, reservation.tenant if reservation.refusal else None)
                if store.fill(reservation, Evict.CLEAN) and not cleaned:
                    store.fill(reservation, Evict.ANY)
        finally:
            store.finish_reservation(reservation)
        if self.clear_reserved_slots:
            self._clear_slots(reservation.states, reservation.offsets, namespace.page_bytes)
        lease = reservation.lease
        if request.packed_answer:
            answer = pb.ReserveResponse(states_packed=bytes(reservation.states),
                                        offsets_packed=packed.u64s(reservation.offsets))
        else:
            answer = pb.ReserveResponse(states=reservation.states, offsets=reservation.offsets)
        if lease is not None:
            answer.lease_id, answer.lease_ttl_ms, answer.first_index = lease.lease_id, lease.ttl_ms, reservation.first_index
            answer.data_token = lease.token
            answer.no_space_reason = reservation.refusal if reservation.wanted else ""
        return answer

    def _clear_slots(self, states: list[int], offsets: list[int], page_bytes: int) -> None:
        """Zero the slots just reserved, outside the store's lock, before the writer learns where they are."""
        base = self.store.arena.address
        for state, offset in zip(states, offsets):
            if state == pb.RESERVED:
                ctypes.memset(base + offset, 0, page_bytes)

    def commit(self, request: pb.CommitRequest, owner: object | None) -> pb.CommitResponse:
        indices = checks.commit_indices(request)
        checksums = checks.commit_checksums(request)
        copied_by_node = checks.copied_by_node(request)
        if request.durable and self.controller is None:
            raise errors.InvalidArgument("durable=true needs the NVMe tier, and this node has none (nvme.enabled)")
        if request.checksums_from_writer:   # the writer hashed the pages as it copied them: no read-back
            states, sums, published = self.store.commit_written(request.lease_id, indices, checksums,
                                                                records=request.durable, copied_by_node=copied_by_node)
        else:
            states, sums, published = self.store.commit(request.lease_id, indices, checksums, records=request.durable)
        answer = _commit_answer(request, states, sums)
        if request.durable and published:
            deadline = time.monotonic() + self.config.controller.promote_wait_ms_max / 1000
            answer.durable_pages = self.controller.make_durable(published, deadline)
        return answer

    def abort(self, request: pb.AbortRequest, owner: object | None) -> pb.AbortResponse:
        aborted, lease = self.store.abort(request.lease_id, owner)
        if aborted:
            self._fence_rdma(lease.rdma_qp_num)
        return pb.AbortResponse(aborted_pages=aborted)

    def acquire(self, request: pb.AcquireRequest, owner: object | None) -> pb.AcquireResponse:
        namespace = self.store.namespace(request.namespace_id)
        keys = checks.keys(request.keys, self.limits)
        checks.prefetch_policy(request.policy)
        ttl_ms = checks.lease_ttl_ms(request.lease_ttl_ms, self.config.leases.read_ttl_ms, self.config)
        commit_wait_s = checks.commit_wait_s(request, self.config)
        self._touch_rdma(request.rdma_qp_num)
        if commit_wait_s:
            self.store.wait_committed(request.namespace_id, keys, time.monotonic() + commit_wait_s)
        started = time.monotonic()   # after any wait for commits: that is a writer's time, not the tier's
        # Every leading page is pinned first, so promoting the tail never evicts the head.
        lease = self.store.hold_chain(request.namespace_id, keys, ttl_ms, owner)
        return self._answer_acquire(request, keys, lease, ttl_ms, namespace.page_bytes, started, owner)

    def _answer_acquire(self, request: pb.AcquireRequest, keys: list[bytes], lease: Any, ttl_ms: int,
                        page_bytes: int, started: float, owner: object | None) -> pb.AcquireResponse:
        """Bring a held chain's pages into DRAM as the request's policy allows, keep the leading ones in
        DRAM under the lease and answer with them; what that cost per page goes into load_rates."""
        store = self.store
        deadline = time.monotonic() + checks.promote_wait_s(request, self.config)   # not used up by a commit wait
        promoted = from_dram = short = 0
        promote_s = 0.0
        try:
            missing = store.missing(lease)
            from_dram = lease.pinned.index(missing[0]) if missing else len(lease.pinned)
            controller = self.controller
            if missing and controller:
                if request.policy == pb.BEST_EFFORT or not controller.take_waiter():
                    store.want(lease)
                else:
                    promote_started = time.monotonic()
                    try:
                        promoted, short = controller.promote(missing, deadline)
                        store.wait_settled(missing, deadline)   # pages another get is promoting
                    finally:
                        controller.leave_waiter()
                        promote_s = time.monotonic() - promote_started
        finally:
            held = store.trim_read_lease(lease, len(keys), from_dram)
        if held is None:
            if short:   # as a put in the same state is refused: the caller learns why it got nothing
                raise errors.CapacityExhausted(
                    "the chain's pages are on NVMe but none could come into DRAM: every page that could make room "
                    "is pinned by a lease or being written down (under write_back, not yet written down); release "
                    "finished gets, try again, or raise dram.arena_bytes")
            return pb.AcquireResponse(page_bytes=page_bytes)
        pages = held.pinned
        failpoints.hit("acquire.each_page", len(pages))
        promoted = min(promoted, len(pages))
        self.load_rates.observe(pb.DRAM, len(pages), time.monotonic() - started - promote_s)
        self.load_rates.observe(pb.NVME, promoted, promote_s)
        hot = self.read_heat.read(request.namespace_id, keys[:len(pages)]) if self.read_heat is not None else ()
        hbm_offsets = self._hbm_offsets(held, owner) if request.hbm_reader else []
        answer = pb.AcquireResponse(
            lease_id=held.lease_id, hit_pages=len(pages), page_bytes=page_bytes, lease_ttl_ms=ttl_ms,
            promoted_pages=promoted, data_token=held.token, hot_pages=hot, hbm_offsets=hbm_offsets)
        offsets, sums = [r.offset for r in pages], [r.checksum for r in pages]
        if request.packed_answer:
            answer.offsets_packed, answer.checksums_packed = packed.u64s(offsets), packed.u64s(sums)
        else:
            answer.offsets.extend(offsets)
            answer.checksums.extend(sums)
        return answer

    def _hbm_offsets(self, lease: Any, owner: object | None) -> list[int]:
        """For a GPU reader (AcquireRequest.hbm_reader) on this host (it maps the arena, so it may open the pool)
        that may see every tenant's pages (the pool holds them all: tenancy.scoped keeps its handle from tenants):
        where each leased page is in the pool, or -1; the pages not in it are offered to the mover. [] for any
        other reader."""
        if (self.hbm_mover is None or not isinstance(owner, Caller) or owner.arena is None
                or not owner.identity.admin):
            return []
        offsets = self.store.hbm_offsets(lease)
        self.hbm_mover.offer([page for page, offset in zip(lease.pinned, offsets or [-1] * len(lease.pinned))
                              if offset < 0])
        return offsets

    def release(self, request: pb.ReleaseRequest, owner: object | None) -> pb.ReleaseResponse:
        if request.changed_pages:
            if len(request.lease_ids) != 1:
                raise errors.InvalidArgument("changed_pages names pages of one lease: send exactly one lease id with it")
            dropped, garbage = self.store.drop_changed(request.lease_ids[0], list(request.changed_pages))
            if garbage:   # copies on NVMe: only a node with NVMe has them
                assert self.controller is not None, "pages on NVMe without an NVMe tier"
                self.controller.forget(garbage)
            log.warning("a reader found pages changed in shared memory lease=%#x reported=%d dropped=%d",
                        request.lease_ids[0], len(request.changed_pages), dropped)
        return pb.ReleaseResponse(released=self.store.release(request.lease_ids))

    def delete(self, request: pb.DeleteRequest, owner: object | None) -> pb.DeleteResponse:
        self.store.namespace(request.namespace_id)
        if request.all_pages and request.keys:
            raise errors.InvalidArgument("all_pages=true deletes the whole namespace: send no keys with it")
        keys = None if request.all_pages else checks.keys(request.keys, self.limits)
        removed, on_disk = self.store.delete(request.namespace_id, keys)
        if self.controller and on_disk:
            # Before answering, so a deleted page never comes back at restart; a write-down in
            # flight may still put one on disk, so it is waited for and its pages deleted too.
            self.store.wait_settled(on_disk, time.monotonic() + self.config.controller.promote_wait_ms_max / 1000)
            self.controller.forget([r.page_id for r in on_disk])
        if removed:
            log.info("pages deleted namespace=%016x pages=%d", request.namespace_id, len(removed))
        if not request.report_keys:
            return pb.DeleteResponse(deleted_pages=len(removed))
        most = self.limits.lookup_pages_max
        return pb.DeleteResponse(deleted_pages=len(removed), removed_keys=[r.page_id[1] for r in removed[:most]],
                                 removed_keys_cut=len(removed) > most)

    # -- page groups (kvstore_client/groups.py) ----------------------------------------

    def commit_group(self, request: pb.CommitGroupRequest, owner: object | None) -> pb.CommitGroupResponse:
        """Publish every part's pages in one step, or none (store.commit_group)."""
        indices = checks.commit_group(request)
        parts = [CommitPart(part.lease_id, part_indices, checks.commit_checksums(part), part.checksums_from_writer)
                 for part, part_indices in zip(request.parts, indices)]
        results = self.store.commit_group(parts)
        return pb.CommitGroupResponse(parts=[_commit_answer(part, states, sums)
                                             for part, (states, sums, _) in zip(request.parts, results)])

    def lookup_group(self, request: pb.LookupGroupRequest, owner: object | None) -> pb.LookupGroupResponse:
        """The prefixes restorable in every part, from one snapshot of the store."""
        keys = checks.lookup_group(request, self.limits)
        ns_ids = [part.namespace_id for part in request.parts]
        for ns_id in ns_ids:
            self.store.namespace(ns_id)
        leading, present = self.store.group_presence(ns_ids, keys)
        hits = groups.fold(leading, present, request.parts)
        return pb.LookupGroupResponse(hit_pages=hits.hit_pages, part_hit_pages=hits.part_hit_pages,
                                      restorable_pages=hits.restorable_pages)

    def acquire_group(self, request: pb.AcquireGroupRequest, owner: object | None) -> pb.AcquireGroupResponse:
        """Read leases on every part's leading pages, all pinned in one step, then each part brought into
        DRAM and answered as Acquire answers it."""
        part_keys = checks.acquire_group(request, self.limits)
        page_bytes = [self.store.namespace(part.namespace_id).page_bytes for part in request.parts]
        ttl_ms = max(checks.lease_ttl_ms(part.lease_ttl_ms, self.config.leases.read_ttl_ms, self.config)
                     for part in request.parts)
        leases = self.store.hold_group([(part.namespace_id, keys) for part, keys in zip(request.parts, part_keys)],
                                       ttl_ms, owner)
        answers: list[pb.AcquireResponse] = []
        try:
            for part, keys, lease, size in zip(request.parts, part_keys, leases, page_bytes):
                answers.append(self._answer_acquire(part, keys, lease, ttl_ms, size, time.monotonic(), owner))
        except BaseException:   # no lease of a group that is not answered outlives the call
            self.store.release([answer.lease_id for answer in answers if answer.lease_id])
            self.store.drop_held(leases[len(answers) + 1:])
            raise
        return pb.AcquireGroupResponse(parts=answers)

    def list_keys(self, request: pb.ListKeysRequest, owner: object | None) -> pb.ListKeysResponse:
        self.store.namespace(request.namespace_id)
        most = checks.listing_max("keys_max", request.keys_max, self.limits)
        keys, cursor = self.store.keys_page(request.namespace_id, checks.list_cursor(request.cursor), most)
        return pb.ListKeysResponse(keys=keys, more=cursor is not None, cursor=cursor or 0)

    def list_pages(self, request: pb.ListPagesRequest, owner: object | None) -> pb.ListPagesResponse:
        namespace = self.store.namespace(request.namespace_id)
        most = checks.listing_max("pages_max", request.pages_max, self.limits)
        pages, cursor, seq = self.store.pages_page(request.namespace_id, checks.list_cursor(request.cursor), most)
        enabled = self.store.events is not None
        return pb.ListPagesResponse(
            pages=[pb.PageTiers(key=key, parent_key=parent, dram=dram, nvme=nvme) for key, parent, dram, nvme in pages],
            more=cursor is not None, cursor=cursor or 0, events_seq=seq, events_enabled=enabled,
            events_run=self.instance_id,
            events_topic=topic_of(namespace.tenant) if enabled else b"")

    def stats(self, request: pb.StatsRequest, owner: object | None) -> pb.StatsResponse:
        offset, count = checks.stats_page(request, self.config)
        c, dram, namespaces, total = self.store.snapshot(offset, count)
        tiers = [pb.TierStats(
            tier=pb.DRAM, capacity_bytes=dram["capacity_bytes"], used_bytes=dram["used_bytes"],
            pages=dram["dram_pages"], hits=c.dram_hits, misses=c.misses, evictions=c.evictions,
            promotions=c.promotions, demotions=c.demotions, bytes_in=c.promoted_bytes, bytes_out=c.demoted_bytes)]
        if self.hbm_mover is not None:
            copies, used, capacity = self.store.hbm_usage()
            h = self.store.hbm_counters
            tiers.insert(0, pb.TierStats(tier=pb.HBM, capacity_bytes=capacity, used_bytes=used, pages=copies,
                                         hits=h.hits, evictions=h.demotions, promotions=h.promotions,
                                         bytes_in=h.promoted_bytes, corrupt_pages=self.hbm_mover.corrupt_sources))
        nvme = self.controller.nvme_usage() if self.controller else None
        if nvme is not None:
            tiers.append(pb.TierStats(
                tier=pb.NVME, capacity_bytes=nvme[0], used_bytes=nvme[1], pages=dram["nvme_pages"],
                hits=c.nvme_hits, evictions=c.nvme_evictions, bytes_in=c.demoted_bytes,
                bytes_out=c.promoted_bytes, corrupt_pages=c.corrupt_pages))
        engines = [pb.EngineStats(
            engine_id=engine, pages=pages, blocks_seen=e.seen, blocks_stored=e.stored, blocks_removed=e.removed,
            blocks_unattributable=e.unattributable, blocks_not_in_memory=e.not_in_memory,
            blocks_dropped=e.dropped_full, batches=e.batches, batches_missed=e.gaps, block_tokens=e.block_tokens,
            blocks_refused=e.refused)
            for engine, pages, e in self.engines.snapshot()]
        if engines:
            tiers.append(pb.TierStats(tier=pb.ENGINE, pages=sum(e.pages for e in engines)))
        return pb.StatsResponse(
            engines=engines, tiers=tiers, namespaces=namespaces, namespaces_total=total, leases_open=dram["leases_open"],
            leases_expired=c.leases_expired, pages_committed=c.pages_committed,
            checksum_failures=c.checksum_failures, write_queue_drops=c.write_queue_drops,
            recovered_pages=c.recovered_pages, nvme_write_errors=c.nvme_write_errors,
            scrub_pages_checked=c.scrub_pages_checked, scrub_pages_bad=c.scrub_pages_bad,
            scrub_passes=c.scrub_passes, tenants=self.store.tenant_stats(),
            nvme_quarantined=[pb.QuarantinedShard(shard=q.shard, path=q.path, moved_to=q.moved_to, cause=q.cause,
                                                  at_start=q.at_start)
                              for q in (self.controller.nvme_quarantined() if self.controller else ())])

    def scrub(self, request: pb.ScrubRequest, owner: object | None) -> pb.ScrubResponse:
        if self.scrubber is None:
            raise errors.TransportUnavailable("this node runs no scrubber")
        checked, bad = self.scrubber.run_pass()
        return pb.ScrubResponse(pages_checked=checked, pages_bad=bad)

    def rdma_connect(self, request: pb.RdmaConnectRequest, owner: object | None) -> pb.RdmaConnectResponse:
        rdma = self._rdma_plane()
        qp = request.queue_pair
        if len(qp.gid) not in (0, 16) or not qp.qp_num:
            raise errors.InvalidArgument("queue_pair needs a qp_num and a 16-byte gid (or none)")
        local, arena_addr, rkey = rdma.accept(
            QueuePairAddress(qp.lid, bytes(qp.gid), qp.qp_num, qp.psn, qp.mtu, qp.gid_type))
        return pb.RdmaConnectResponse(
            queue_pair=pb.RdmaQueuePair(lid=local.lid, gid=local.gid, qp_num=local.qp_num, psn=local.psn,
                                        mtu=local.mtu, gid_type=local.gid_type),
            arena_addr=arena_addr, rkey=rkey, arena_bytes=self.store.arena.nbytes)

    def rdma_disconnect(self, request: pb.RdmaDisconnectRequest, owner: object | None) -> pb.RdmaDisconnectResponse:
        self._rdma_plane().disconnect(request.qp_num)
        return pb.RdmaDisconnectResponse()

    def _rdma_plane(self) -> RdmaAcceptor:
        if self.rdma is None:
            raise errors.TransportUnavailable("this node offers no RDMA data plane (rdma.enabled is off or no device): "
                                              "move pages over TCP or shared memory")
        return self.rdma

    def _touch_rdma(self, qp_num: int) -> None:
        if qp_num and self.rdma is not None:
            self.rdma.touch(qp_num)

    def _fence_rdma(self, qp_num: int) -> None:
        """A write lease ended uncommitted: its queue pair may still have writes in flight to slots
        that will be reused, so it is moved to error (the client reconnects)."""
        if qp_num and self.rdma is not None:
            log.info("rdma queue pair fenced qp_num=%d (its write lease ended uncommitted)", qp_num)
            self.rdma.fence(qp_num)

    def route(self, request: pb.RouteRequest, owner: object | None) -> pb.RouteResponse:
        namespace = self.store.namespace(request.namespace_id)
        keys = checks.lookup_keys(namespace, request, self.limits)
        engine_ids = route.check_engine_ids(request.engine_ids, self.config.route.engines_max)
        route.check_block_tokens(namespace.page_tokens, {e: self.engines.block_tokens(e) for e in engine_ids})
        store_tiers = self.store.tiers(request.namespace_id, keys)
        weights = self.config.route
        scores = route.score_engines(
            engine_ids, store_tiers,
            self.engines.holders(keys, engine_ids, list(request.tokens) or None, namespace.page_tokens), len(keys),
            route.Weights(weights.weight_engine_gpu, weights.weight_engine_host, weights.weight_dram, weights.weight_nvme))
        return pb.RouteResponse(scores=scores, best_engine_id=route.best_engine(scores))

    # -- lifecycle hooks for the carriers and the server --------------------------------

    def end_owner(self, owner: object) -> int:
        """A connection closed: abort its write leases and release its read leases."""
        ended = self.store.end_owner(owner)
        if ended:
            log.info("connection closed with open leases; ended leases=%d", ended)
        return ended

    def reap_expired(self) -> int:
        expired = self.store.reap_expired()
        for lease, uncommitted, pinned in expired:
            log.info("lease expired kind=%s lease=%016x uncommitted_pages=%d pinned_pages=%d",
                     lease.kind, lease.lease_id, uncommitted, pinned)
            if uncommitted:
                self._fence_rdma(lease.rdma_qp_num)
        return len(expired)

    def start_draining(self) -> None:
        self.store.start_draining()

    def open_leases(self) -> int:
        return self.store.open_leases()


def _commit_answer(request: pb.CommitRequest, states: list[int], sums: list[int]) -> pb.CommitResponse:
    """A Commit's (or a CommitGroup part's) answer, packed if it asked. The writer's own checksums are not
    echoed back: 512 of them cost a 4 KiB put's Commit 4-5% of its time."""
    echoed = [] if request.checksums_from_writer else sums
    if request.packed_answer:
        return pb.CommitResponse(states_packed=bytes(states), checksums_packed=packed.u64s(echoed))
    return pb.CommitResponse(states=states, checksums=echoed)
