"""The scrubber: re-reads pages in DRAM and on NVMe and checks them against their checksums.

Memory and disks rot quietly (a flipped DRAM bit, a misdirected write, a bad sector that
LMDB never reads back); a KV cache that served such a page would make a model answer
garbage with no error anywhere. A page whose DRAM or NVMe bytes no longer hash to the
checksum it was committed with is dropped with everything that extends it, and counted.

Off by default: `scrub.bytes_per_s` > 0 runs passes in the background at that rate; the
Scrub RPC (and `kvstore-admin scrub`) runs one pass at once, at full speed.
"""

from __future__ import annotations

import logging
import threading
import time

import numpy as np

from kvstore.control.store import PageStore
from kvstore.invariants import stop_node
from kvstore.tiers.nvme import MISSING, NvmeTier

log = logging.getLogger(__name__)

BATCH_PAGES = 64
IDLE_BETWEEN_PASSES_S = 60.0


class Scrubber:
    def __init__(self, store: PageStore, nvme: NvmeTier | None, bytes_per_s: int):
        self._store = store
        self._nvme = nvme
        self._bytes_per_s = bytes_per_s
        self._pass_lock = threading.Lock()   # one pass at a time
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="scrubber", daemon=True)

    def start(self) -> None:
        if self._bytes_per_s:
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(10)

    def alive(self) -> bool:
        return not self._bytes_per_s or self._thread.is_alive()

    def run_pass(self, bytes_per_s: int = 0) -> tuple[int, int]:
        """Check every page held from the pass's start to its end (in steps of BATCH_PAGES, so the store's
        lock is never held for the whole index); returns (pages checked, pages found bad)."""
        started = time.monotonic()
        checked = bad_total = 0
        with self._pass_lock:
            cursor: int | None = 0
            while cursor is not None:
                if self._stop.is_set():
                    break
                batch, cursor = self._store.scrub_batch(cursor, BATCH_PAGES)
                bad, nbytes = [], 0
                try:
                    for record in batch:
                        ok, moved = self._check(record)
                        nbytes += moved
                        if not ok:
                            bad.append(record)
                finally:
                    garbage = self._store.scrub_done(batch, bad)
                if garbage:
                    try:
                        if self._nvme is not None:
                            self._nvme.delete(garbage)
                    finally:
                        self._store.nvme_deleted(garbage)
                checked += len(batch)
                bad_total += len(bad)
                if bytes_per_s:
                    self._stop.wait(nbytes / bytes_per_s)
            self._store.count(scrub_passes=1)
        log.info("scrub pass complete pages_checked=%d pages_bad=%d duration_s=%.1f",
                 checked, bad_total, time.monotonic() - started)
        return checked, bad_total

    def _check(self, record) -> tuple[bool, int]:
        """(the page's bytes match its checksum in every tier that holds it, bytes read)."""
        page_bytes = self._store.namespace_page_bytes(record.page_id[0])
        ok = self._store.dram_checksum_ok(record)
        if ok and record.on_nvme and self._nvme is not None:
            scratch = np.empty(page_bytes, np.uint8)
            checksum = self._nvme.read_into([(*record.page_id, memoryview(scratch))])[0]
            ok = checksum in (record.checksum, MISSING)   # a quarantined shard's page is gone, not bad
            return ok, 2 * page_bytes
        return ok, page_bytes

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self.run_pass(self._bytes_per_s)
                self._stop.wait(IDLE_BETWEEN_PASSES_S)
        except AssertionError as exc:
            stop_node("scrubber", exc)
