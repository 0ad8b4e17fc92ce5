"""The cache controller: moves pages between DRAM and NVMe, always outside the store's lock.

- Write-down (background thread, bounded queue), by policy:
  write_through            every committed page;
  write_through_selective  a page once it has been hit `selective_hits` times;
  write_back               the least recently used DRAM-only pages once DRAM is fuller than
                           `high_watermark`, or as soon as the store reports DRAM short. Under
                           write_back the store never evicts a page that is not yet on NVMe,
                           and at first only one on NVMe that is older than every unsaved page
                           (Evict.COLD: a page read all along stays): a caller short of slots
                           has the controller write pages down (`clean`), then asks the store
                           again.
  A page is written after its ancestors (its whole unsaved chain goes first), and is marked
  on NVMe only once its parent is, so what is on NVMe stays prefix-closed and survives a
  restart as whole prefixes.
- Promotion (on Acquire, and prefetch for best_effort gets): a page only on NVMe is copied
  once, from its shard straight into a DRAM slot of its own size, and its checksum verified;
  a corrupt page is dropped with everything that extends it, counted and logged, never served.
- Durable commits: `make_durable` writes given pages down before the commit is answered.

The controller's queues have their own lock; the store calls the listener methods
(on_commit, on_hit, on_wanted, on_dram_short) with its lock held, so they only queue work.
Lock order: store, then controller; the controller never calls the store holding its own.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
from concurrent import futures


from kvstore import failpoints
from kvstore.config import ControllerConfig
from kvstore.control.index import PageRecord
from kvstore.control.store import PageStore
from kvstore.control.store_types import Claim, Evict, PageId
from kvstore.invariants import stop_node
from kvstore.tiers.nvme import MISSING, NvmeError, NvmeFull, NvmeShardQuarantined, NvmeTier, StoredPage

log = logging.getLogger(__name__)

WRITE_THROUGH, SELECTIVE, WRITE_BACK = "write_through", "write_through_selective", "write_back"
# Pages whose NVMe reads are issued together; the TIMEOUT policy's deadline is checked between groups.
PROMOTE_GROUP_PAGES = 128
# A full NVMe tier is a cache at capacity, its normal state: its evictions are counted
# (nvme_evictions) and said in the log at most this often.
FULL_LOG_EVERY_S = 60.0


class CacheController:
    def __init__(self, store: PageStore, nvme: NvmeTier, config: ControllerConfig, waiters_max: int = 4):
        self._store = store
        # Gets that may wait for promotions at once: the rest are answered best-effort, so
        # waiting gets never take every RPC worker (health checks and other calls go on).
        self._waiters = threading.BoundedSemaphore(waiters_max)
        self._nvme = nvme
        self.config = config
        self._queue = threading.Condition()
        self._writes: collections.OrderedDict[PageRecord, None] = collections.OrderedDict()
        self._prefetch: collections.OrderedDict[PageRecord, None] = collections.OrderedDict()
        self._dram_short = False
        self._saved_namespaces: set[int] = set()
        # Room is made by the controller thread and by RPC threads writing pages down (clean,
        # make_durable): the count and the time of the last line change under this lock.
        self._full_lock = threading.Lock()
        self._full_evicted = 0                  # NVMe pages evicted for room since the last line said so
        self._full_logged_at = -FULL_LOG_EVERY_S
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="cache-controller", daemon=True)
        # A disk commits several shards' transactions in the time of fewer than that many one after another
        # (its queue takes the syncs together): a batch's shards are written at once, a thread each. The
        # background's writers yield the CPU to serving (writer_idle, writer_nice), so its batches are
        # written on them even with one shard; a caller's own write-down (room for its Reserve, a durable
        # commit) is serving, and has writers of its own.
        self._background_writers = futures.ThreadPoolExecutor(
            len(nvme.shards), thread_name_prefix="nvme-writer", initializer=self._yield_cpu)
        self._foreground_writers = futures.ThreadPoolExecutor(len(nvme.shards), thread_name_prefix="nvme-writer-fg")
        store.protect_unsaved = config.write_policy == WRITE_BACK
        store.listener = self

    def start(self) -> None:
        self._thread.start()

    def alive(self) -> bool:
        return self._thread.is_alive()

    def stop(self) -> None:
        with self._queue:
            self._stopping = True
            self._queue.notify_all()
        self._thread.join(10)
        self._background_writers.shutdown(wait=True)
        self._foreground_writers.shutdown(wait=True)

    # -- listener (the store's lock is held: queue only) ---------------------------------

    @property
    def wants_commits(self) -> bool:
        """Only write_through queues committed pages as they come (write_back finds them in the index)."""
        return self.config.write_policy == WRITE_THROUGH

    def on_commit(self, records: list[PageRecord]) -> None:   # called only while wants_commits
        self._enqueue(records)

    def on_hit(self, records: list[PageRecord]) -> None:
        if self.config.write_policy == SELECTIVE:
            self._enqueue([r for r in records if r.hits >= self.config.selective_hits and not r.on_nvme])

    def on_wanted(self, records: list[PageRecord]) -> None:
        with self._queue:
            room = self.config.queue_pages_max - len(self._prefetch)
            for record in records[:max(room, 0)]:
                self._prefetch[record] = None   # a page asked for twice is queued once
            self._queue.notify()

    def on_dram_short(self) -> None:
        if self.config.write_policy == WRITE_BACK:
            with self._queue:
                self._dram_short = True
                self._queue.notify()

    def _enqueue(self, records: list[PageRecord]) -> None:
        dropped = 0
        with self._queue:
            for record in records:
                if record in self._writes:
                    continue
                if len(self._writes) >= self.config.queue_pages_max:
                    dropped += 1
                    continue
                self._writes[record] = None
            self._queue.notify()
        if dropped:
            self._store.counters.write_queue_drops += dropped  # store lock held by our caller

    # -- called by the service, without any lock ------------------------------------------

    def promote(self, records: list[PageRecord], deadline: float) -> tuple[int, int]:
        """Bring these NVMe pages into DRAM, in order, until the deadline; returns the pages promoted and
        how many got no DRAM slot (every page that could make room pinned, moving, or unsaved under write_back)."""
        claim = self._store.claim_for_promotion(records, self._store.evict_first)
        if claim.short and self._store.protect_unsaved:   # as Reserve does (service.py)
            cleaned = self.clean(claim.short)
            for evict in (Evict.CLEAN,) if cleaned else (Evict.CLEAN, Evict.ANY):
                more = self._store.claim_for_promotion(records, evict)
                claim = Claim(claim.records + more.records, claim.slots + more.slots, more.short)
                if not claim.short:
                    break
        return self._promote(claim, deadline), claim.short

    def take_waiter(self) -> bool:
        """A place among the gets waiting for promotions, or False when they are all taken."""
        return self._waiters.acquire(blocking=False)

    def leave_waiter(self) -> None:
        self._waiters.release()

    def clean(self, pages: int, tenant: str | None = None) -> int:
        """Write down up to `pages` (at least a batch) least recently used DRAM-only pages (of this tenant,
        when its quota is what is short; None: any), so that allocation can drop their DRAM copies;
        returns pages written."""
        candidates = self._store.unsaved_lru(max(pages, self.config.write_batch_pages), tenant)
        batch = self._store.claim_unsaved(candidates, max(pages, self.config.write_batch_pages))
        return len(self._write_down(batch)) if batch else 0

    def make_durable(self, records: list[PageRecord], deadline: float) -> int:
        """Write these pages (a chain, in order) down now; returns how many leading ones are on NVMe."""
        while True:
            batch = self._store.claim_unsaved(records, len(records) + 4096)
            written = self._write_down(batch) if batch else []
            self._store.wait_settled(records, deadline)   # pages another pass is writing
            durable, gone = self._store.leading_on_nvme(records)
            if durable == len(records) or gone or time.monotonic() > deadline or (batch and not written):
                return durable
            if not batch:
                time.sleep(0.005)  # an ancestor outside `records` is still moving

    def nvme_quarantined(self) -> list:
        """The NVMe shards found damaged since start-up (tiers.nvme.Quarantine)."""
        return self._nvme.quarantined()

    def nvme_usage(self) -> tuple[int, int]:
        """(capacity, used) bytes of the NVMe tier."""
        return self._nvme.capacity_bytes, self._nvme.used_bytes()

    def forget(self, page_ids: list[PageId]) -> None:
        """Delete pages from NVMe (they already left the index)."""
        if page_ids:
            try:
                failpoints.hit("delete.before_nvme")
                self._nvme.delete(page_ids)
            finally:
                self._store.nvme_deleted(page_ids)

    # -- the background loop ----------------------------------------------------------

    def _take_queued(self) -> tuple[list[PageRecord], list[PageRecord], bool]:
        """Off the queue (its lock held): a batch of writes, every prefetch, and whether DRAM ran short."""
        writes = list(self._writes)[:self.config.write_batch_pages]
        for record in writes:
            del self._writes[record]
        prefetch = list(self._prefetch)
        self._prefetch.clear()
        short, self._dram_short = self._dram_short, False
        return writes, prefetch, short

    def _yield_cpu(self) -> None:
        """This background writer lets serving threads have the CPU first: SCHED_IDLE (writer_idle), or
        writer_nice above the node's niceness. A Linux thread's policy and niceness are its own; lowering
        them needs no privilege, raising them again would."""
        if self.config.writer_idle:
            try:
                os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))   # 0: the calling thread
                return
            except OSError as exc:   # a seccomp filter or an old kernel: niceness is still allowed
                log.warning("background write-down threads keep the node's scheduling policy "
                            "(SCHED_IDLE refused: %s); controller.writer_nice applies", exc)
        thread = threading.get_native_id()
        nice = os.getpriority(os.PRIO_PROCESS, thread) + self.config.writer_nice
        os.setpriority(os.PRIO_PROCESS, thread, min(nice, 19))

    def _run(self) -> None:
        behind = False   # the last pass wrote write-back's pages down: more may be due, so look again at once
        while True:
            with self._queue:
                if not (behind or self._stopping or self._writes or self._prefetch or self._dram_short):
                    self._queue.wait(0.1)   # also the pace of write_back's watermark check
                if self._stopping:
                    return
                writes, prefetch, short = self._take_queued()
            behind = False
            if not (writes or prefetch or short or self._write_back_due()):  # store lock: never under ours
                continue
            try:
                behind = self._pass(writes, prefetch, short)
            except AssertionError as exc:
                stop_node("cache controller", exc)
            except Exception:  # a pass releases what it claimed (finally blocks); the next one may work
                log.exception("cache controller pass failed")

    def _pass(self, writes: list[PageRecord], prefetch: list[PageRecord], short: bool) -> bool:
        """Write a batch down and prefetch what was asked for; returns whether write-back wrote pages of its own
        down. Then DRAM may still be above the watermark with more unsaved pages: the next pass starts at once,
        where waiting for the watermark's next check let a saturated node write one batch a tenth of a second,
        and its Reserves, short of clean slots, write the rest down themselves. A batch that reached no disk (a
        quarantined shard) waits, so a failing disk is not retried in a loop."""
        backlog = self.config.write_policy == WRITE_BACK and (short or self._write_back_due())
        if backlog:
            writes += self._store.unsaved_lru(self.config.write_batch_pages)
        batch = self._store.claim_unsaved(writes, self.config.write_batch_pages)
        written = self._write_down(batch, background=True) if batch else []
        if prefetch:
            self.promote(prefetch, time.monotonic() + self.config.prefetch_timeout_ms / 1000)
        return backlog and bool(written)

    def _write_back_due(self) -> bool:
        return self.config.write_policy == WRITE_BACK and self._store.dram_fill() > self.config.high_watermark

    # -- promotion --------------------------------------------------------------------

    def _promote(self, claim: Claim, deadline: float) -> int:
        results: list[bool | None] = []
        try:
            failpoints.hit("promote.before_read")
            for start in range(0, len(claim.records), PROMOTE_GROUP_PAGES):
                if time.monotonic() > deadline:
                    break
                results += self._read_pages(claim.records[start:start + PROMOTE_GROUP_PAGES],
                                            claim.slots[start:start + PROMOTE_GROUP_PAGES])
            failpoints.hit("promote.after_read")
        finally:
            promoted, garbage = self._store.finish_promotion(claim, results)
        self._delete_from_nvme(garbage)
        return promoted

    def _read_pages(self, records: list[PageRecord], slots: list[int]) -> list[bool | None]:
        """Copy pages from NVMe into their new slots; True where the bytes match the checksum,
        None where the page is gone with a quarantined shard (a miss, not a corrupt page)."""
        views = [self._store.slot_view(r, slot) for r, slot in zip(records, slots)]
        sums = self._nvme.read_into([(*r.page_id, view) for r, view in zip(records, views)])
        return [None if checksum == MISSING else checksum == r.checksum for r, checksum in zip(records, sums)]

    # -- write-down -------------------------------------------------------------------

    def _write_down(self, batch: list[PageRecord], background: bool = False) -> list[PageRecord]:
        """Write a claimed batch (chain order) to its shards (on the background's writers, or a caller's); release
        it. Returns pages now on NVMe."""
        writers = self._background_writers if background else self._foreground_writers
        started = time.perf_counter()
        on_disk: set[PageRecord] = set()
        try:
            admitted, victims = self._store.admit_nvme(batch)   # tenants' NVMe quotas: room from their own pages
            self._delete_from_nvme([r.page_id for r in victims])
            on_disk = self._write_pages(admitted, writers)
        finally:
            written, garbage = self._store.finish_writedown(batch, on_disk)
        self._delete_from_nvme(garbage)
        log.debug("write-down complete pages=%d duration_ms=%.1f", len(written), (time.perf_counter() - started) * 1e3)
        return written

    def _write_pages(self, batch: list[PageRecord], writers: futures.Executor) -> dict[PageRecord, int]:
        """Each shard's pages in transactions of their own, the shards at once; returns the pages that reached
        disk, each with its shard (the store decides which count as on NVMe: those whose parent does).
        Every shard's writes are over when this returns, failed or not: the caller releases the batch."""
        by_shard: dict[int, list[PageRecord]] = {}
        for record in batch:
            by_shard.setdefault(self._nvme.shard_of(*record.page_id), []).append(record)
        if len(by_shard) == 1 and writers is self._foreground_writers:   # the caller's thread writes its own
            return self._write_shard(*next(iter(by_shard.items())))
        writes = [writers.submit(self._write_shard, *item) for item in by_shard.items()]
        futures.wait(writes)
        on_disk: dict[PageRecord, int] = {}
        for write in writes:
            on_disk.update(write.result())   # a broken invariant in any of them is raised here, after all ended
        return on_disk

    def _write_shard(self, shard: int, group: list[PageRecord]) -> dict[PageRecord, int]:
        """One shard's pages in chain order, a transaction per write_txn_bytes; returns those on disk."""
        on_disk: dict[PageRecord, int] = {}
        for run in _by_bytes(group, self.config.write_txn_bytes):
            stored = [(record, page) for record in run if (page := self._stored(record)) is not None]
            run, pages = [record for record, _ in stored], [page for _, page in stored]
            if not pages:   # every page of the run was deleted since it was claimed
                continue
            try:
                self._save_namespaces(run)
                failpoints.hit("writedown.before_lmdb_commit")
                try:
                    self._nvme.write(shard, pages)
                except NvmeFull:
                    self._make_room(shard, len(run))
                    self._nvme.write(shard, pages)
                failpoints.hit("writedown.after_lmdb_commit")
            except NvmeShardQuarantined:   # said once, when it was quarantined
                self._store.count(nvme_write_errors=1)
                continue
            except NvmeError as exc:
                self._store.count(nvme_write_errors=1)
                log.error("write-down failed shard=%d pages=%d (they stay in DRAM only): %s", shard, len(run), exc)
                continue
            on_disk.update(dict.fromkeys(run, shard))
        return on_disk

    def _delete_from_nvme(self, page_ids: list[PageId]) -> None:
        """Delete pages the store marked as being deleted, then tell it they are gone."""
        if page_ids:
            try:
                self._nvme.delete(page_ids)
            finally:
                self._store.nvme_deleted(page_ids)

    def _stored(self, record: PageRecord) -> tuple[StoredPage, memoryview] | None:
        """The page as written down, or None once it left the index."""
        stored = self._store.stored_page(record)
        if stored is None:
            return None
        ns_id, key, parent_key, page_bytes, checksum, view = stored
        return StoredPage(ns_id, key, parent_key, page_bytes, checksum), view

    def _save_namespaces(self, records: list[PageRecord]) -> None:
        for ns_id in {r.page_id[0] for r in records} - self._saved_namespaces:
            self._nvme.save_namespace(ns_id, self._store.namespace_spec(ns_id))
            self._saved_namespaces.add(ns_id)

    def _make_room(self, shard: int, pages: int) -> None:
        victims = self._store.nvme_victims(shard, 2 * pages)
        self._delete_from_nvme([r.page_id for r in victims])
        with self._full_lock:
            self._full_evicted += len(victims)
            now = time.monotonic()
            if now - self._full_logged_at < FULL_LOG_EVERY_S:
                return
            evicted, self._full_evicted, self._full_logged_at = self._full_evicted, 0, now
        log.info("NVMe full: evicted pages=%d (said at most once a minute; nvme_evictions counts them all)", evicted)


def _by_bytes(pages: list[PageRecord], txn_bytes: int) -> list[list[PageRecord]]:
    """Pages in runs of at most `txn_bytes` (one page at least), in chain order."""
    runs: list[list[PageRecord]] = []
    run: list[PageRecord] = []
    nbytes = 0
    for record in pages:
        if run and nbytes + record.slot_bytes > txn_bytes:
            runs.append(run)
            run, nbytes = [], 0
        run.append(record)
        nbytes += record.slot_bytes
    if run:
        runs.append(run)
    return runs
