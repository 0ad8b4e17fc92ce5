"""Scrubbing: the scrubber's batches, walked over the index in bounded steps and pinned while
their bytes are hashed outside the lock; a page found changed is dropped with its descendants.

A part of PageStore (store.py), which owns the state and the one lock these methods take.
"""

from __future__ import annotations

import logging

import xxhash

from kvstore.control.index import NO_SLOT, PageRecord
from kvstore.control.store_types import PageId, SCAN_POSITIONS

log = logging.getLogger(__name__)


class Scrubbing:
    """The scrubber's batches and what it drops."""

    def scrub_batch(self, cursor: int, count: int) -> tuple[list[PageRecord], int | None]:
        """Up to `count` pages held and not moving, from index position `cursor` on, pinned (so a DRAM
        slot stays put), and the position to go on from (None: the pass is over)."""
        with self._lock:
            found, cursor = self.index.scan(cursor, SCAN_POSITIONS, found_max=count)
            batch = [r for r in found if not r.busy]
            for record in batch:
                record.pins += 1
            return batch, cursor

    def scrub_done(self, batch: list[PageRecord], bad: list[PageRecord]) -> list[PageId]:
        """Unpin a scrubbed batch; drop the bad pages with their descendants. NVMe ids to delete."""
        garbage: list[PageId] = []
        with self._lock:
            bad = [r for r in bad if r.alive]   # a page deleted meanwhile is not bad, only gone
            for record in bad:
                if record.alive:   # an earlier one's subtree may have taken it
                    garbage += self._drop_corrupt(record)
            self.index.unpin_all(batch)
            self._deleting(garbage)
            self.counters.scrub_pages_checked += len(batch)
            self.counters.scrub_pages_bad += len(bad)
        return garbage

    def dram_checksum_ok(self, record: PageRecord) -> bool:
        """Re-hash a pinned page's DRAM copy (unlocked: a pinned slot is never reused)."""
        offset = record.offset
        if offset == NO_SLOT:
            return True
        return xxhash.xxh3_64_intdigest(self.arena.view[offset:offset + self._page_bytes(record)]) == record.checksum

    def _drop_corrupt(self, record: PageRecord) -> list[PageId]:
        removed = self.index.remove_subtree(record)
        self._sync_events(removed)
        self.counters.corrupt_pages += len(removed)
        log.error("corrupt page dropped namespace=%016x key=%s pages_dropped=%d",
                  record.page_id[0], record.page_id[1].hex()[:32], len(removed))
        return [r.page_id for r in removed if r.on_nvme]
