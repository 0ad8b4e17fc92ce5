"""The HBM mover: brings the pages that engines on this host read again and again into the node's
HBM pool, and drops the copies of pages that left the index. A thread of its own, outside the
store's lock except for the bookkeeping steps (store_hbm.py).

Policy: a page is offered when a GPU reader on this host (AcquireRequest.hbm_reader: the only readers
that can use the pool) was answered it, and comes in once it has been read `hbm.promote_hits` times,
counting every Acquire that answered it. A page read once (a prompt seen once) never costs a copy;
the first pages of a shared prefix (a system prompt, a RAG document), which every request that
shares it reads, come in first and stay, since copies leave leaf-first and least recently read
first. A chain comes in parents first: a page whose parent has no copy waits. bench/hbm_policy.py
replays chat traffic (80% of conversations on 10 system prompts): with a pool of 10% of the pages
touched, copying on the second read answered 0.79 of page reads from the pool against 0.80 for
copying on the first, with two thirds of the copies (0.13 a page read, not 0.20); with 3% it answered
more (0.70 vs 0.68), and with 30% fewer (0.86 vs 0.90) for 0.65 of the copies. Two is the default.

A copy: the page's DRAM slot (pinned by the claim) into a buffer of the mover's own, the buffer's
xxh3 against the page's commit checksum, the buffer into the pool (PoolDevice.write, synchronous),
then published. So what an engine reads from the pool is what was committed, even where a writer
with the arena mapped changed the DRAM slot after its commit; such a page is not copied (a get that
reads it from DRAM finds the mismatch, and the node drops it then).
"""

from __future__ import annotations

import collections
import itertools
import logging
import threading

import numpy as np
import xxhash

from kvstore import failpoints
from kvstore.control.index import PageRecord
from kvstore.control.store import PageStore
from kvstore.invariants import stop_node
from kvstore.tiers.hbm import PoolDevice

log = logging.getLogger(__name__)

MOVE_BATCH_PAGES = 256      # pages claimed, copied and published together
OFFERED_MAX = 65536         # pages waiting to be considered; past it an offer is dropped (it comes again)
SWEEP_EVERY_S = 1.0


class HbmMover:
    def __init__(self, store: PageStore, pool: PoolDevice, promote_hits: int, page_bytes_max: int):
        self._store, self._pool, self._promote_hits = store, pool, promote_hits
        self._staging = np.empty(page_bytes_max, dtype=np.uint8)
        self._offered: collections.OrderedDict[PageRecord, None] = collections.OrderedDict()
        self._cond = threading.Condition()
        self._stopping = False
        self._moving = False          # a batch taken off the queue is being moved
        self.corrupt_sources = 0      # DRAM slots that no longer matched their checksum when copied
        self._thread = threading.Thread(target=self._run, name="hbm-mover", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def alive(self) -> bool:
        return self._thread.is_alive()

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._thread.join(10)

    def offer(self, records: list[PageRecord]) -> None:
        """Pages a reader on this host was just answered, in chain order (the store's lock is not held)."""
        wanted = [r for r in records if r.hits >= self._promote_hits]
        if not wanted:
            return
        with self._cond:
            for record in wanted[:max(0, OFFERED_MAX - len(self._offered))]:
                self._offered[record] = None
            self._cond.notify()

    def idle(self) -> bool:
        """Nothing offered waits (tests wait on it before they look at the pool)."""
        with self._cond:
            return not self._offered and not self._moving

    def _run(self) -> None:
        cursor = 0
        while True:
            with self._cond:
                if not (self._offered or self._stopping):
                    self._cond.wait(SWEEP_EVERY_S)
                if self._stopping:
                    return
                batch = list(itertools.islice(self._offered, MOVE_BATCH_PAGES))
                for record in batch:
                    del self._offered[record]
                self._moving = bool(batch)
            try:
                if batch:
                    self._move(batch)
                cursor = self._store.hbm_sweep(cursor)
            except AssertionError as exc:
                stop_node("HBM mover", exc)
            except Exception:   # the claims were released (finally); the pages come again with their next read
                log.exception("HBM mover pass failed")
            finally:
                with self._cond:
                    self._moving = False

    def _move(self, records: list[PageRecord]) -> None:
        claimed = self._store.hbm_claim(records)
        done: list[tuple[PageRecord, int, bool]] = []
        try:
            for record, offset in claimed:
                done.append((record, offset, self._copy(record, offset)))
            failpoints.hit("hbm.before_publish")
        finally:
            done += [(record, offset, False) for record, offset in claimed[len(done):]]
            self._store.hbm_finish(done)

    def _copy(self, record: PageRecord, offset: int) -> bool:
        source = self._store.hbm_source(record)
        staged = self._staging[:len(source)]
        staged[:] = np.frombuffer(source, dtype=np.uint8)
        if xxhash.xxh3_64_intdigest(staged) != record.checksum:
            self.corrupt_sources += 1
            log.error("a DRAM page no longer matches its checksum and is not copied to HBM namespace=%016x key=%s",
                      record.page_id[0], record.page_id[1].hex()[:32])
            return False
        self._pool.write(offset, memoryview(staged))
        return True

