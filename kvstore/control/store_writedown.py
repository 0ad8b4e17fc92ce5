"""Write-down claims for the controller: DRAM-only pages claimed with their unsaved ancestors,
admitted under their tenants' NVMe quotas, marked on NVMe once written (prefix-closed), and NVMe
shards' victims taken when a shard is full.

A part of PageStore (store.py), which owns the state and the one lock these methods take.
"""

from __future__ import annotations

import itertools
import logging
from typing import Iterable

from kvstore import failpoints
from kvstore.control.index import NO_SLOT, PageRecord
from kvstore.control.store_types import PageId, REMOVE_PAGES

log = logging.getLogger(__name__)

# Walk points kept (a 64-page batch's each): chains up to 262,144 unsaved pages are walked once; points
# past this, the farthest from a saved end, are found again by a walk from a leaf.
WALK_POINTS_MAX = 4096


class WriteDown:
    """What the controller writes down, and what leaves NVMe."""

    def claim_unsaved(self, records: Iterable[PageRecord], pages_max: int) -> list[PageRecord]:
        """Pages to write down with their unsaved ancestors first, pinned and marked busy: at most
        `pages_max`. A page with more unsaved ancestors than that is walked up `pages_max` pages at a
        time, each step a lock section of its own, to its chain's saved end, whose pages are the batch:
        no step walks more than `pages_max` pages under the lock. The points the walk stopped at are kept
        (_unsaved_walk), so the next claim starts `pages_max` pages further from the saved end instead
        of at the leaf, and a long chain is walked once, not once a batch. Returning nothing after a step
        left write-back a step a pass (a tenth of a second each: a chain of 3,200 pages took minutes)."""
        batch, walking = self._claim_step(records, pages_max)
        while not batch and walking:   # each step pushes a point higher up a chain or pops one: the walk ends
            batch, walking = self._claim_step((), pages_max)
        return batch

    def _claim_step(self, records: Iterable[PageRecord], pages_max: int) -> tuple[list[PageRecord], bool]:
        """claim_unsaved's batch under one lock section, from the last walk point first, then `records`; and
        whether a walk goes on (a point is left and none is held up by a page another write-down is moving)."""
        batch: list[PageRecord] = []
        seen: set[PageRecord] = set()
        walk, blocked = self._unsaved_walk, False
        with self._lock:
            if walk:
                point = walk[-1]
                batch, stopped_at = _unsaved_chain(point, self._nvme_deleting, seen, pages_max)
                if stopped_at is not None:
                    walk.append(stopped_at)
                elif batch or not point.alive or point.on_nvme or point.offset == NO_SLOT:
                    walk.pop()      # claimed here, saved, or gone: the next point is pages_max further down
                else:
                    blocked = True  # a page up its chain is being written or deleted: come back to it later
                seen.update(batch)
            for record in records:
                if len(batch) >= pages_max:
                    break
                chain, stopped_at = _unsaved_chain(record, self._nvme_deleting, seen, pages_max - len(batch))
                if stopped_at is not None:
                    walk.append(stopped_at)
                seen.update(chain)
                batch += chain
            del walk[:-WALK_POINTS_MAX]
            for record in batch:
                record.busy = True
                record.pins += 1
            return batch, bool(walk) and not blocked

    def unsaved_lru(self, count: int, tenant: str | None = None) -> list[PageRecord]:
        """Up to `count` unpinned pages held only in DRAM (of this tenant; None: any), least recently used first."""
        with self._lock:
            return self.index.dram_only_lru(count, tenant)

    def admit_nvme(self, batch: list[PageRecord]) -> tuple[list[PageRecord], list[PageRecord]]:
        """The pages of a claimed write-down batch (chain order) their tenants' NVMe quotas allow, and
        the pages taken off NVMe to make that room: each tenant's own least recently used NVMe pages,
        never one the batch extends (its children would then be written for nothing). The caller
        deletes the victims first; pages refused (and the pages of the batch that extend them) stay in
        DRAM only, unsaved, marked so that write-back passes them over until their tenant holds less
        on NVMe. Returns (admitted, victims)."""
        admitted: list[PageRecord] = []
        victims: list[PageRecord] = []
        with self._lock:
            limited = [r for r in batch if self.ledger.nvme_limit(r.tenant)]
            if not limited:
                return batch, []
            kept = _nvme_ancestors(limited)
            for record in kept:
                record.pins += 1     # not victims of this batch's own room
            writing = self.ledger.nvme_writing_bytes
            refused: set[PageRecord] = set()
            for record in batch:
                tenant = record.tenant
                if self.ledger.nvme_limit(tenant) and (record.parent in refused or not self._nvme_room(
                        tenant, record.slot_bytes, victims)):
                    refused.add(record)
                    usage = self.index.usage.get(tenant)
                    record.nvme_refused_bytes = (usage.nvme_bytes if usage else 0) + writing.get(tenant, 0)
                    self.ledger.of(tenant).nvme_refused_pages += 1
                    continue
                record.nvme_refused_bytes = -1
                if self.ledger.nvme_limit(tenant):
                    writing[tenant] = writing.get(tenant, 0) + record.slot_bytes
                    self._nvme_admitted.add(record)
                admitted.append(record)
            self.index.unpin_all(kept)
            self._sync_events(victims)
            self.counters.nvme_evictions += len(victims)
            for record in victims:
                self.ledger.of(record.tenant).nvme_evictions += 1
            self._deleting([r.page_id for r in victims])
        if victims:
            log.info("NVMe quota: evicted pages=%d", len(victims))
        return admitted, victims

    def dram_fill(self) -> float:
        with self._lock:
            return self.allocator.used_bytes / max(self.allocator.capacity_bytes, 1)

    def finish_writedown(self, batch: list[PageRecord], on_disk: dict[PageRecord, int]) -> tuple[
            list[PageRecord], list[PageId]]:
        """The batch (chain order) is no longer moving; `on_disk` reached NVMe, each on its shard. A page is marked on
        NVMe only when its parent is, so the NVMe tier stays prefix-closed even when another
        shard's write failed. Returns (pages now on NVMe, ids deleted meanwhile: the caller
        deletes those from NVMe too)."""
        garbage, written = [], []
        with self._lock:
            for record in batch:
                if record not in on_disk:
                    continue
                if record.alive and (record.parent is None or record.parent.on_nvme):
                    self.index.set_on_nvme(record, True, on_disk[record])
                    written.append(record)
                else:  # deleted meanwhile, or its parent is not on NVMe: its bytes must not stay there
                    garbage.append(record.page_id)
            self._sync_events(written)
            self.counters.demotions += len(written)
            self.counters.demoted_bytes += sum(self._page_bytes(r) for r in written)
            for record in batch:
                self.index.release_busy(record)
                if record in self._nvme_admitted:
                    self._nvme_admitted.discard(record)
                    self.ledger.nvme_writing_bytes[record.tenant] -= record.slot_bytes
            self.index.unpin_all(batch)
            self._deleting(garbage)
            self._settled.notify_all()
        return written, garbage

    def nvme_deleted(self, page_ids: list[PageId]) -> None:
        """The NVMe deletes of these pages (from delete, eviction or garbage) are done (REMOVE_PAGES
        of them per lock section: a namespace's Delete may hand over millions)."""
        for start in range(0, len(page_ids), REMOVE_PAGES):
            with self._lock:
                for page_id in page_ids[start:start + REMOVE_PAGES]:
                    left = self._nvme_deleting[page_id] - 1
                    if left:
                        self._nvme_deleting[page_id] = left
                    else:
                        del self._nvme_deleting[page_id]

    def leading_on_nvme(self, records: list[PageRecord]) -> tuple[int, bool]:
        """(leading pages of this chain on NVMe, whether the next one can never get there: it left)."""
        with self._lock:
            durable = sum(1 for _ in itertools.takewhile(lambda r: r.alive and r.on_nvme, records))
            return durable, durable < len(records) and not records[durable].alive

    def nvme_victims(self, shard: int, count: int) -> list[PageRecord]:
        """Take up to `count` least recently used pages off one NVMe shard (the caller deletes them)."""
        with self._lock:
            victims = self.index.evict_nvme(shard, count)
            self._sync_events(victims)
            self.counters.nvme_evictions += len(victims)
            for record in victims:
                self.ledger.of(record.tenant).nvme_evictions += 1
            self._deleting([r.page_id for r in victims])
        failpoints.hit("evict.after_victims")
        return victims

    def stored_page(self, record: PageRecord) -> tuple[int, bytes, bytes, int, int, memoryview] | None:
        """(namespace, key, parent key, page bytes, checksum, slot bytes) of a busy page to write down;
        None once it was deleted: it is not written (a removed page's parent may read None, and a
        page stored as a root would come back as one after a restart)."""
        with self._lock:
            assert record.busy and record.offset != NO_SLOT, "only a claimed DRAM page is written down"
            if not record.alive:
                return None
            page_bytes = self._page_bytes(record)
            parent_key = record.parent.page_id[1] if record.parent is not None else b""
            view = self.arena.view[record.offset:record.offset + page_bytes]
            return record.page_id[0], record.page_id[1], parent_key, page_bytes, record.checksum, view

    def _nvme_room(self, tenant: str, slot_bytes: int, victims: list[PageRecord]) -> bool:
        """Whether the tenant's NVMe quota takes one more page, after taking its own least recently used
        NVMe pages off (appended to `victims`) to make room."""
        limit = self.ledger.nvme_limit(tenant)
        while True:
            usage = self.index.usage.get(tenant)
            held = (usage.nvme_bytes if usage else 0) + self.ledger.nvme_writing_bytes.get(tenant, 0)
            if held + slot_bytes <= limit:
                return True
            taken = self.index.evict_nvme(None, 1, tenant)
            if not taken:
                return False
            victims += taken

    def _deleting(self, page_ids: list[PageId]) -> None:
        """Lock held: these pages' NVMe copies are about to be deleted (see nvme_deleted)."""
        for page_id in page_ids:
            self._nvme_deleting[page_id] = self._nvme_deleting.get(page_id, 0) + 1


def _nvme_ancestors(records: list[PageRecord]) -> list[PageRecord]:
    """The alive ancestors on NVMe of these pages, each once."""
    found: dict[PageRecord, None] = {}
    for record in records:
        node = record.parent
        while node is not None and node not in found:
            if node.alive and node.on_nvme:
                found[node] = None
            node = node.parent
    return list(found)


def _unsaved_chain(record: PageRecord, deleting: dict[PageId, int], batched: set[PageRecord],
                   room: int) -> tuple[list[PageRecord], PageRecord | None]:
    """The page and its ancestors not yet on NVMe nor in this batch, root first, and None; ([], None)
    if one is gone, moving, or its NVMe copy is being deleted; ([], the highest one reached) if there
    are more than `room` of them."""
    chain = []
    node: PageRecord | None = record
    while node is not None and not node.on_nvme and node not in batched:
        if not node.alive or node.offset == NO_SLOT or node.busy or node.page_id in deleting:
            return [], None
        if len(chain) == room:
            return [], node
        chain.append(node)
        node = node.parent
    chain.reverse()
    return chain, None
