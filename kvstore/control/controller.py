"""The cache controller: moves pages between DRAM and NVMe.

- Write-down (background thread, bounded queue), by policy:
  write_through            every committed page;
  write_through_selective  a page once it has been hit `selective_hits` times;
  write_back               the least recently used DRAM-only pages once DRAM is fuller than
                           `high_watermark`, so that eviction only has to drop DRAM copies;
                           when clients fill DRAM faster than that, eviction writes the
                           pages it needs down itself, under the lock (slow, but nothing
                           committed is lost while NVMe has room).
  A page is written after its ancestors (its whole unsaved chain goes first), so what is on
  NVMe stays prefix-closed and survives a restart as whole prefixes.
- Promotion (on Acquire): a page only on NVMe is copied once, from LMDB's mapping straight
  into a DRAM slot, and its checksum verified; a corrupt page is dropped with everything
  that extends it, counted and logged, never served.

The controller shares the service's lock; disk I/O happens outside it, with the pages
involved pinned (so their slots cannot be reused) and marked busy.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import TYPE_CHECKING

import xxhash

from kvstore.config import ControllerConfig
from kvstore.control.index import NO_SLOT, PageRecord
from kvstore.tiers.nvme import NvmeError, NvmeFull, NvmeTier, StoredPage

if TYPE_CHECKING:
    from kvstore.control.service import KVStoreService

log = logging.getLogger(__name__)

WRITE_THROUGH, SELECTIVE, WRITE_BACK = "write_through", "write_through_selective", "write_back"
# Pages whose NVMe reads are issued together; the TIMEOUT policy's deadline is checked between groups.
PROMOTE_GROUP_PAGES = 128


class CacheController:
    def __init__(self, service: "KVStoreService", nvme: NvmeTier, config: ControllerConfig):
        self._service = service
        self._nvme = nvme
        self.config = config
        self._writes: collections.deque[PageRecord] = collections.deque()
        self._prefetch: collections.deque[PageRecord] = collections.deque()
        self._wake = threading.Condition(service.lock)
        self._promoted = threading.Condition(service.lock)
        self._saved_namespaces: set[int] = set()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="cache-controller", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def alive(self) -> bool:
        return self._thread.is_alive()

    def stop(self) -> None:
        with self._wake:
            self._stopping = True
            self._wake.notify_all()
        self._thread.join(10)

    # -- triggers (called with the service lock held) -----------------------------------

    def on_commit(self, records: list[PageRecord]) -> None:
        if self.config.write_policy == WRITE_THROUGH:
            self._enqueue(records)

    def on_hit(self, records: list[PageRecord]) -> None:
        if self.config.write_policy == SELECTIVE:
            self._enqueue([r for r in records if r.hits >= self.config.selective_hits and not r.on_nvme])

    def prefetch(self, records: list[PageRecord]) -> None:
        room = self.config.queue_pages_max - len(self._prefetch)
        self._prefetch.extend(r for r in records[:max(room, 0)] if not r.busy)
        self._wake.notify()

    def _enqueue(self, records: list[PageRecord]) -> None:
        for record in records:
            if record.on_nvme or record.queued:
                continue
            if len(self._writes) >= self.config.queue_pages_max:
                self._service.counters.write_queue_drops += 1
                continue
            record.queued = True
            self._writes.append(record)
        self._wake.notify()

    def demote_before_eviction(self, pages: int) -> None:
        """Lock held. Under write_back, write down the least recently used DRAM-only pages so
        that eviction can drop their DRAM copies instead of losing them."""
        if self.config.write_policy != WRITE_BACK:
            return
        chains: list[PageRecord] = []
        seen: set[PageRecord] = set()
        for record in self._service.index.dram_only_lru(max(pages, self.config.write_batch_pages)):
            _add_unsaved_chain(record, chains, seen)
        self._mark_written(self._write_pages(chains, locked=True))

    # -- promotion (called without the lock, from the Acquire handler) ------------------

    def promote(self, records: list[PageRecord], deadline: float) -> int:
        """Bring these NVMe pages into DRAM, in order, until the deadline; returns pages promoted."""
        service = self._service
        with service.lock:
            todo = [r for r in records if r.alive and not r.in_dram and r.on_nvme and not r.busy]
            slots = service.allocate_slots(todo[0].slot_bytes, len(todo)) if todo else []
            todo = todo[:len(slots)]
            for record in todo:
                record.busy = True
                record.pins += 1
        results: list[bool] = []
        for start in range(0, len(todo), PROMOTE_GROUP_PAGES):
            if time.monotonic() > deadline:
                break
            results += self._read_pages(todo[start:start + PROMOTE_GROUP_PAGES], slots[start:start + PROMOTE_GROUP_PAGES])
        promoted, garbage = 0, []
        with service.lock:
            for index, (record, slot) in enumerate(zip(todo, slots)):
                ok = index < len(results) and results[index]
                service.index.release_busy(record)
                if ok and record.alive:
                    service.index.set_dram(record, slot)
                    promoted += 1
                    continue
                service.allocator.free(slot)
                if index < len(results) and not ok and record.alive:
                    garbage += self._drop_corrupt(record)
            service.index.unpin_all(todo)
            service.counters.promotions += promoted
            service.counters.promoted_bytes += promoted * (self._page_bytes(todo[0]) if todo else 0)
            self._promoted.notify_all()
        if garbage:
            self._nvme.delete(garbage)
        return promoted

    def wait_promoted(self, records: list[PageRecord], deadline: float) -> None:
        """Wait while another caller is still promoting one of these pages (up to the deadline)."""
        with self._promoted:
            while any(r.alive and r.busy and not r.in_dram for r in records):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return
                self._promoted.wait(remaining)

    def _read_pages(self, records: list[PageRecord], slots: list[int]) -> list[bool]:
        """Copy pages from NVMe into their new slots; True where the bytes match the checksum."""
        arena = self._service.arena.view
        views = [arena[slot:slot + self._page_bytes(r)] for r, slot in zip(records, slots)]
        found = self._nvme.read_into([(*r.page_id, view) for r, view in zip(records, views)])
        return [ok and xxhash.xxh3_64_intdigest(view) == r.checksum for r, view, ok in zip(records, views, found)]

    def _drop_corrupt(self, record: PageRecord) -> list[tuple[int, bytes]]:
        """Lock held. Drop a page that failed its checksum, with its descendants; NVMe ids to delete."""
        removed = self._service.index.remove_subtree(record)
        self._service.counters.corrupt_pages += len(removed)
        log.error("corrupt page dropped namespace=%016x key=%s pages_dropped=%d",
                  record.page_id[0], record.page_id[1].hex()[:32], len(removed))
        return [r.page_id for r in removed if r.on_nvme]

    # -- the background loop ----------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._wake:
                while True:
                    if self._stopping:
                        return
                    if not self._writes and self._write_back_due():
                        self._enqueue(self._service.index.dram_only_lru(self.config.write_batch_pages))
                    batch = self._take_batch()
                    prefetch = list(self._prefetch)
                    self._prefetch.clear()
                    if batch or prefetch:
                        break
                    self._wake.wait(0.1)  # nothing movable now (e.g. every candidate is busy): wait
            try:
                if batch:
                    self._write_down(batch)
                if prefetch:
                    self.promote(prefetch, time.monotonic() + self.config.prefetch_timeout_ms / 1000)
            except Exception:  # the controller must outlive one bad batch
                log.exception("cache controller pass failed")

    def _write_back_due(self) -> bool:
        allocator = self._service.allocator
        return (self.config.write_policy == WRITE_BACK
                and allocator.used_bytes > self.config.high_watermark * allocator.capacity_bytes)

    def _take_batch(self) -> list[PageRecord]:
        """Lock held: queued pages with their unsaved ancestors first, pinned and marked busy."""
        batch: list[PageRecord] = []
        seen: set[PageRecord] = set()
        while self._writes and len(batch) < self.config.write_batch_pages:
            record = self._writes.popleft()
            record.queued = False
            _add_unsaved_chain(record, batch, seen)
        for record in batch:
            record.busy = True
            record.pins += 1
        return batch

    def _write_down(self, batch: list[PageRecord]) -> None:
        started = time.perf_counter()
        written: list[PageRecord] = []
        try:
            written = self._write_pages(batch, locked=False)
        finally:
            self._finish_write_down(batch, written)
        log.debug("write-down complete pages=%d duration_ms=%.1f", len(written), (time.perf_counter() - started) * 1e3)

    def _finish_write_down(self, batch: list[PageRecord], written: list[PageRecord]) -> None:
        service = self._service
        with service.lock:
            garbage = self._mark_written(written)
            for record in batch:
                service.index.release_busy(record)
            service.index.unpin_all(batch)
        if garbage:
            self._nvme.delete(garbage)

    def _mark_written(self, written: list[PageRecord]) -> list[tuple[int, bytes]]:
        """Lock held: pages now on NVMe; returns those deleted meanwhile, to delete from disk too."""
        garbage = []
        for record in written:
            if record.alive:
                self._service.index.set_on_nvme(record, True)
            else:
                garbage.append(record.page_id)
        self._service.counters.demotions += len(written)
        self._service.counters.demoted_bytes += sum(self._page_bytes(r) for r in written)
        return garbage

    def _write_pages(self, records: list[PageRecord], locked: bool) -> list[PageRecord]:
        """Write pages to their shards, one transaction per shard, making room when a map is full."""
        by_shard: dict[int, list[PageRecord]] = {}
        for record in records:
            by_shard.setdefault(self._nvme.shard_of(*record.page_id), []).append(record)
        written: list[PageRecord] = []
        for shard, group in by_shard.items():
            pages = [self._stored(record) for record in group]
            try:
                self._save_namespaces(group)
                try:
                    self._nvme.write(shard, pages)
                except NvmeFull:
                    self._make_room(shard, len(group), locked)
                    self._nvme.write(shard, pages)
            except NvmeError as exc:
                self._service.counters.nvme_write_errors += 1
                log.error("write-down failed shard=%d pages=%d (they stay in DRAM only): %s", shard, len(group), exc)
                continue
            written += group
        return written

    def _page_bytes(self, record: PageRecord) -> int:
        return self._service.namespaces[record.page_id[0]].page_bytes

    def _stored(self, record: PageRecord) -> tuple[StoredPage, memoryview]:
        ns_id, key = record.page_id
        page_bytes = self._page_bytes(record)
        parent_key = record.parent.page_id[1] if record.parent is not None else b""
        page = StoredPage(ns_id, key, parent_key, page_bytes, record.checksum)
        return page, self._service.arena.view[record.offset:record.offset + page_bytes]

    def _save_namespaces(self, records: list[PageRecord]) -> None:
        for ns_id in {r.page_id[0] for r in records} - self._saved_namespaces:
            self._nvme.save_namespace(ns_id, self._service.namespace_spec(ns_id))
            self._saved_namespaces.add(ns_id)

    def _make_room(self, shard: int, pages: int, locked: bool) -> None:
        service = self._service

        def evict() -> list[PageRecord]:
            victims = service.index.evict_nvme(lambda r: self._nvme.shard_of(*r.page_id), shard, 2 * pages)
            service.counters.nvme_evictions += len(victims)
            return victims

        if locked:
            victims = evict()
        else:
            with service.lock:
                victims = evict()
        self._nvme.delete([r.page_id for r in victims])
        log.info("NVMe shard %d full: evicted pages=%d", shard, len(victims))


def _add_unsaved_chain(record: PageRecord, batch: list[PageRecord], seen: set[PageRecord]) -> None:
    """Append the page's unsaved chain to `batch`, root first, skipping pages already in it."""
    for node in _unsaved_chain(record):
        if node not in seen:
            seen.add(node)
            batch.append(node)


def _unsaved_chain(record: PageRecord) -> list[PageRecord]:
    """The page and its ancestors not yet on NVMe, root first; [] if one is gone or moving."""
    chain = []
    node: PageRecord | None = record
    while node is not None and not node.on_nvme:
        if not node.alive or node.offset == NO_SLOT or node.busy:
            return []
        chain.append(node)
        node = node.parent
    chain.reverse()
    return chain

