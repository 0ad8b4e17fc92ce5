"""The store's page events, journalled under its lock and numbered per tenant. No I/O.

KV-aware routers follow engines by their KV events (vLLM's BlockStored, BlockRemoved,
AllBlocksCleared); this journal turns the store's page changes into the same events, for
events_out.py to encode and publish. Its unit is a (page, tier) fact: "page P of namespace N is
in DRAM" (medium "CPU") or "on NVMe" (medium "DISK"). The store calls `sync(records)` with the
lock held after any step that may have changed those facts for these pages (a commit, a
write-down, a promotion, an eviction, a delete); the journal keeps the facts it last announced
per page and appends one event per fact that changed, so a caller may name a page twice, or one
that did not change, at no cost but the look-up: O(pages of that operation), nothing more.
The facts cost a Python dict entry per page held (more than the C index spends on
the page itself): the price of publishing, paid only where events_out is on.

Streams. One per tenant (its ZMQ topic, `topic_of`), each numbered from 0 by batch; the first
batch of every stream, after every start of the node, opens with AllBlocksCleared: whatever a
consumer held from an earlier run is gone (DRAM-only pages are lost on restart; pages recovered
from NVMe are announced again as stored on DISK).

Bounded. At most `queue_pages_max` events wait for the publisher. Past that the waiting events
of every stream are dropped and each such stream skips one sequence number per drop (a number
never published nor kept for replay), so a consumer sees a gap no replay fills and takes a
snapshot: an event is delivered, replayed, or its loss is visible.

Snapshots. `snapshot_seq(tenant)`, read under the store's lock as a walk of the index begins, is
a number no event appended later can be below. A consumer that applies, per (page, tier), the
last event numbered from there on over the walk's pages holds the store's state (events are
"set" and "unset" of a fact: the last one wins, whatever the walk saw before it).

Thread-safe: sync and snapshot_seq run with the store's lock held; `take` runs on the
publisher's thread; a lock of its own guards what they share.
"""

from __future__ import annotations

import dataclasses
import threading
import urllib.parse
from typing import Callable, Iterable

from kvstore.control.index import PageRecord
from kvstore_client.events import CPU, DISK

DRAM = 1
NVME = 2
MEDIUMS = ((DRAM, CPU), (NVME, DISK))
STORED = "stored"
REMOVED = "removed"
CLEARED = "cleared"


@dataclasses.dataclass(frozen=True)
class PageEvent:
    kind: str                 # STORED, REMOVED or CLEARED
    namespace_id: int = 0
    medium: str = ""
    key: bytes = b""
    parent_key: bytes = b""   # of a stored page: its parent's key, or the absent parent it is anchored at
    page_tokens: int = 0


@dataclasses.dataclass
class Batch:
    tenant: str
    seq: int
    events: list[PageEvent]


def topic_of(tenant: str) -> bytes:
    """A tenant's ZMQ topic. Quoted and ended by '/', so no tenant's topic is a prefix of another's
    (a SUB socket subscribes by prefix)."""
    return f"kvstore/{urllib.parse.quote(tenant, safe='')}/".encode()


class _Stream:
    __slots__ = ("next_seq", "skips", "open")

    def __init__(self) -> None:
        self.next_seq = 0
        self.skips = 0                      # sequence numbers lost to drops, not yet passed
        self.open: list[PageEvent] = [PageEvent(CLEARED)]   # every stream of this run starts with a clear


class StoreEvents:
    def __init__(self, batch_events_max: int, queue_pages_max: int,
                 page_tokens_of: Callable[[int], int] = lambda namespace_id: 0):
        assert 0 < batch_events_max <= queue_pages_max
        self.batch_events_max = batch_events_max
        self.queue_pages_max = queue_pages_max
        self.page_tokens_of = page_tokens_of   # called with the store's lock held
        self._lock = threading.Lock()
        self._facts: dict[tuple[int, bytes], int] = {}   # page id -> DRAM|NVME bits last announced
        self._streams: dict[str, _Stream] = {}
        self._queued = 0
        self.dropped = 0                        # events lost to a full queue (each seen as a gap)
        self.ready = threading.Event()          # set when there is something to take

    def open_stream(self, tenant: str) -> None:
        """Start the tenant's stream now (its AllBlocksCleared), even before it has a page event."""
        with self._lock:
            self._stream(tenant)
            self.ready.set()

    def sync(self, records: Iterable[PageRecord]) -> None:
        """Store lock held: announce what changed of these pages' tiers since the journal last did."""
        with self._lock:
            for record in records:
                now = ((DRAM if record.in_dram else 0) | (NVME if record.on_nvme else 0)) if record.alive else 0
                self._sync_one(record, now)

    @property
    def queued(self) -> int:
        """Events journalled and not yet taken by the publisher."""
        return self._queued

    def dram_dropped(self, record: PageRecord) -> None:
        """Store lock held: the page's DRAM copy is going (the index has yet to clear its offset)."""
        with self._lock:
            self._sync_one(record, (NVME if record.on_nvme else 0) if record.alive else 0)

    def _sync_one(self, record: PageRecord, now: int) -> None:
        page_id = record.page_id
        before = self._facts.get(page_id, 0)
        if now == before:
            return
        if now:
            self._facts[page_id] = now
        else:
            del self._facts[page_id]
        parent = b""
        if now & ~before:
            parent = record.parent.page_id[1] if record.parent is not None else (record.anchor or b"")
        ns_id, key = page_id
        page_tokens = self.page_tokens_of(ns_id)
        for bit, medium in MEDIUMS:
            if now & bit and not before & bit:
                self._append(record.tenant, PageEvent(STORED, ns_id, medium, key, parent, page_tokens))
            elif before & bit and not now & bit:
                self._append(record.tenant, PageEvent(REMOVED, ns_id, medium, key))

    def snapshot_seq(self, tenant: str) -> int:
        """Store lock held: the first sequence number an event appended from now on can have."""
        with self._lock:
            stream = self._stream(tenant)
            self.ready.set()
            return stream.next_seq + stream.skips

    def take(self) -> list[Batch]:
        """The publisher's thread: every waiting event, as numbered batches of batch_events_max at most."""
        with self._lock:
            self.ready.clear()
            batches = []
            for tenant, stream in self._streams.items():
                stream.next_seq += stream.skips
                stream.skips = 0
                events, stream.open = stream.open, []
                for start in range(0, len(events), self.batch_events_max):
                    batches.append(Batch(tenant, stream.next_seq, events[start:start + self.batch_events_max]))
                    stream.next_seq += 1
            self._queued = 0
            return batches

    def _stream(self, tenant: str) -> _Stream:
        stream = self._streams.get(tenant)
        if stream is None:
            stream = self._streams[tenant] = _Stream()
            self._queued += 1
        return stream

    def _append(self, tenant: str, event: PageEvent) -> None:
        stream = self._stream(tenant)
        if self._queued >= self.queue_pages_max:
            for other in self._streams.values():   # every waiting event goes: each stream with one skips a number
                if other.open:
                    self.dropped += len(other.open)
                    other.open = []
                    other.skips += 1
            self._queued = 0
        stream.open.append(event)
        self._queued += 1
        self.ready.set()
