"""Follow a node's page events (its events_out stream) and keep its inventory: pages per namespace and tier.

The node publishes in vLLM's KV-event wire format (kvstore/control/events_out.py): ZMQ PUB
frames (topic, seq as 8 bytes big-endian, msgpack KVEventBatch), one stream per tenant
numbered from 0 by batch, a replay ROUTER, BlockStored/BlockRemoved per page and medium
("CPU": the node's DRAM, "DISK": its NVMe), `ownership` naming the namespace
("kvstore:<id as 16 hex digits>"), AllBlocksCleared opening every stream of every run.

`StoreInventory` rebuilds the inventory and keeps it, with no gap:
- a batch numbered past the next expected one is a loss: the missed batches are asked of the
  replay socket; if it no longer holds the first of them, the inventory is rebuilt from a snapshot;
- a snapshot is ListPages over each followed namespace (client.list_pages), whose first answer
  gives S, the stream's number as the walk began; the inventory is the walk's pages with their
  tiers, then every batch numbered S or later applied over them in order (each (page, tier)
  takes its last event's word: events "set" or "unset" a fact, so one the walk saw already is
  only set again). The batches from S on come from replay, then live;
- a batch numbered below the next expected one is either one seen already (a replayed batch also
  received live: skipped) or the node's next run (a payload never seen at that number, or the
  connection to the node dropped and came back): the stream is replayed from 0, which begins with
  AllBlocksCleared (the inventory is emptied and rebuilt from the run's first batch), or, where the
  replay buffer no longer holds batch 0, a snapshot is taken.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import logging
import time
from typing import Any, Callable, Sequence

from kvstore_client import errors
from kvstore_client.keys import Namespace, namespace_id

log = logging.getLogger(__name__)

CPU = "CPU"                 # the node's DRAM
DISK = "DISK"               # its NVMe
END_SEQ = -1                # a replay's last frame
OWNERSHIP_PREFIX = "kvstore:"
_SEEN_MAX = 65_536          # payload digests kept, by sequence number, to tell a duplicate from a new run


@dataclasses.dataclass
class PageSnapshot:
    """A namespace's pages with their tiers (ListPages), and where the event stream completes it."""
    namespace_id: int
    pages: dict[bytes, tuple[bytes, bool, bool]]   # key -> (parent key, in DRAM, on NVMe)
    events_seq: int
    events_topic: bytes
    events_enabled: bool
    events_run: bytes = b""

    def tiers(self) -> dict[bytes, set[str]]:
        """key -> the mediums of the event stream ("CPU", "DISK") the page is in."""
        return {key: {m for m, held in ((CPU, dram), (DISK, nvme)) if held}
                for key, (_, dram, nvme) in self.pages.items()}


def page_snapshot(namespace_id: int, answers: Sequence[Any]) -> PageSnapshot:
    """One walk's ListPagesResponses, first to last, as a PageSnapshot (the first one names the sequence number)."""
    first = answers[0]
    pages = {page.key: (page.parent_key, page.dram, page.nvme) for answer in answers for page in answer.pages}
    return PageSnapshot(namespace_id, pages, first.events_seq, first.events_topic, first.events_enabled,
                        first.events_run)


def event_wire_decoder() -> Callable[[bytes], Any]:
    from kvstore_client.event_wire import decoder   # msgspec: the [events] extra
    return decoder()


def ownership_of(namespace_id: int) -> str:
    """How the stream's `ownership` names a namespace."""
    return f"{OWNERSHIP_PREFIX}{namespace_id:016x}"


def namespace_of(ownership: str | None) -> int | None:
    if not ownership or not ownership.startswith(OWNERSHIP_PREFIX):
        return None
    try:
        return int(ownership[len(OWNERSHIP_PREFIX):], 16)
    except ValueError:
        return None


class StoreInventory:
    """The pages of `namespaces` on one node, per medium, from its event stream (see the module docstring).

    `client` is a KVStoreClient of the tenant (its list_pages takes the snapshots); `decode` turns a
    payload into a batch whose events are vLLM's classes or any with their names and fields (default:
    this module's own). Not thread-safe: one thread calls poll()."""

    def __init__(self, client: Any, namespaces: Sequence[Namespace], endpoint: str, replay_endpoint: str = "",
                 decode: Callable[[bytes], Any] | None = None, replay_timeout_ms: int = 5_000,
                 idle_check_ms: int = 1_000):
        import zmq

        self._zmq = zmq
        self.client = client
        self.namespaces = list(namespaces)
        self.followed = {namespace_id(ns) for ns in self.namespaces}
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.decode = decode or event_wire_decoder()
        self.replay_timeout_ms = replay_timeout_ms
        self.idle_check_ms = idle_check_ms    # quiet this long: ask replay for batches lost at a burst's end
        self._quiet_since = time.monotonic()
        self.pages: dict[int, dict[bytes, set[str]]] = {ns: {} for ns in self.followed}
        self.next_seq: int | None = None
        self.topic = b""
        self._seen: collections.OrderedDict[int, bytes] = collections.OrderedDict()
        self.snapshots = 0       # rebuilds from a snapshot
        self.replays = 0         # catch-ups from the replay socket
        self.clears = 0          # AllBlocksCleared applied (a run of the node began)
        self.restarts = 0        # new runs of the node noticed
        self.received = 0        # live batches received
        self.last_received_seq = -1
        self._context = zmq.Context()
        self._sub = None
        self._monitor = None
        self._dropped = False
        self.run = b""           # the node's run the inventory follows (ListPages' events_run)
        self._last_ts = 0.0      # the newest batch applied: a batch numbered lower but newer is the next run's

    # -- life ---------------------------------------------------------------------------

    def start(self) -> None:
        """Take a snapshot (it names the tenant's topic), subscribe, and catch up from the snapshot on."""
        snapshots = self._snapshot_pages()
        self._subscribe()
        self._resnapshot(snapshots)

    def _subscribe(self) -> None:
        """A fresh SUB socket (and its monitor: a dropped connection may mean the node's next run)."""
        for sock in (self._monitor, self._sub):
            if sock is not None:
                sock.close(linger=0)
        zmq = self._zmq
        self._sub = self._context.socket(zmq.SUB)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        self._monitor = self._sub.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._sub.connect(self.endpoint)

    def close(self) -> None:
        for sock in (self._monitor, self._sub):
            if sock is not None:
                sock.close(linger=0)
        self._context.term()

    def inventory(self) -> dict[int, dict[bytes, set[str]]]:
        """namespace id -> key -> mediums, a copy."""
        return {ns: {key: set(m) for key, m in pages.items() if m} for ns, pages in self.pages.items()}

    def poll(self, timeout_ms: int) -> int:
        """Apply the batches that arrive within `timeout_ms` (at most the ones waiting then); returns how many."""
        applied = 0
        while self._monitor.poll(0):
            self._monitor.recv_multipart()
            self._dropped = True   # the node went away: what comes next may be its next run
        if self._dropped:
            try:
                run = self.client.events_run(self.namespaces[0])
            except errors.KVStoreError as exc:   # not back yet: asked again on the next poll
                log.info("store events: the node is not answering (%s); asking again", exc)
                return 0
            self._dropped = False
            self._subscribe()   # a connection to the last run's socket need not come back by itself
            if run != self.run:
                self.run = run
                return self._new_run()
        if not self._sub.poll(timeout_ms):
            # PUB drops silently past its high-water mark, and a loss at the end of a burst shows no gap until
            # the next batch: when idle, ask the replay socket whether anything came after the last batch.
            now = time.monotonic()
            if self.replay_endpoint and now - self._quiet_since >= self.idle_check_ms / 1000:
                self._quiet_since = now
                before = self.next_seq
                self._catch_up(self.next_seq)
                return self.next_seq - before
            return 0
        self._quiet_since = time.monotonic()
        while self._sub.poll(0):
            frames = self._sub.recv_multipart()
            if len(frames) != 3 or len(frames[1]) != 8:
                log.warning("store events: malformed message of %d frames", len(frames))
                continue
            self.received += 1
            self.last_received_seq = int.from_bytes(frames[1], "big", signed=True)
            applied += self._receive(self.last_received_seq, frames[2])
        return applied

    # -- the stream -----------------------------------------------------------------------

    def _receive(self, seq: int, payload: bytes) -> int:
        assert self.next_seq is not None
        if seq < self.next_seq and (self._seen.get(seq) == _digest(payload)
                                    or self.decode(payload).ts <= self._last_ts):
            return 0   # replayed already, or older than the snapshot the inventory was rebuilt from
        if seq != self.next_seq:
            # A gap, or a lower number never seen: this run's, or the next one's?
            run = self.client.events_run(self.namespaces[0])
            if run != self.run:
                self.run = run
                return self._new_run()
            if seq < self.next_seq:
                return 0
        if seq > self.next_seq:
            if not self._catch_up(self.next_seq):
                return 1
            if seq < self.next_seq:
                return 0
        self._apply(seq, payload)
        return 1

    def _new_run(self) -> int:
        """The node began a new run: its stream from 0 (it opens with AllBlocksCleared), or a snapshot."""
        self.restarts += 1
        log.info("store events: the node began a new run; rebuilding")
        self.next_seq = 0
        self._seen.clear()
        self._catch_up(0, from_start=True)
        return 1

    def _catch_up(self, start: int, from_start: bool = False) -> bool:
        """Apply batches start.. from the replay socket. False: it no longer holds `start`, and a
        snapshot was taken instead."""
        batches = self._replay(start)
        if batches is None or (batches and batches[0][0] != start):
            self._resnapshot()
            return False
        if from_start and not batches:   # a run always has its batch 0: the socket answered another run's end
            self._resnapshot()
            return False
        for seq, payload in batches:
            self._apply(seq, payload)
        self.replays += 1
        return True

    def _replay(self, start: int) -> list[tuple[int, bytes]] | None:
        """Buffered batches from `start` on; None without a replay socket or an answer in time."""
        if not self.replay_endpoint:
            return None
        zmq = self._zmq
        sock = self._context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.replay_endpoint)
        try:
            sock.send_multipart((b"", start.to_bytes(8, "big", signed=True), self.topic))
            found = []
            while True:
                if not sock.poll(self.replay_timeout_ms):
                    log.warning("store events: no replay answer within %d ms", self.replay_timeout_ms)
                    return None
                frames = sock.recv_multipart()
                if len(frames) != 4 or len(frames[2]) != 8:
                    continue
                seq = int.from_bytes(frames[2], "big", signed=True)
                if seq == END_SEQ:
                    return found
                found.append((seq, frames[3]))
        finally:
            sock.close(linger=0)

    def _resnapshot(self, snapshots: list[PageSnapshot] | None = None) -> None:
        """Install a snapshot, then the batches from its S on that the replay socket holds. The batch before S
        dates the snapshot: a batch numbered lower that arrives later is older than it, unless it is newer."""
        for _ in range(8):
            self._install(snapshots or self._snapshot_pages())
            snapshots = None
            start = self.next_seq
            batches = self._replay(max(start - 1, 0))
            if batches and start and batches[0][0] == start - 1:
                self._last_ts = max(self._last_ts, self.decode(batches[0][1]).ts)
                batches = batches[1:]
            if batches is not None and (not batches or batches[0][0] == start):
                for seq, payload in batches:
                    self._apply(seq, payload)
                return
            if batches is None and not self.replay_endpoint:
                return   # no replay socket: live batches from S on are all there is
        raise RuntimeError("store events: the stream outran eight snapshots in a row; raise events_out.replay_batches")

    def _snapshot_pages(self) -> list[PageSnapshot]:
        snapshots = [self.client.list_pages(ns) for ns in self.namespaces]
        if snapshots:
            if not snapshots[0].events_enabled:
                raise RuntimeError("the node publishes no store events (events_out.enabled is false)")
            self.topic = snapshots[0].events_topic
        return snapshots

    def _install(self, snapshots: list[PageSnapshot]) -> None:
        """The walks' pages, and the first of their sequence numbers to apply the stream from."""
        self.snapshots += 1
        self.followed = {s.namespace_id for s in snapshots}   # the node's ids (it fills in the tenant)
        if snapshots:
            self.run = snapshots[0].events_run
        self.pages = {ns: {} for ns in self.followed}
        for snapshot in snapshots:
            self.pages[snapshot.namespace_id] = snapshot.tiers()
        self.next_seq = min((s.events_seq for s in snapshots), default=0)
        self._seen.clear()


    def _apply(self, seq: int, payload: bytes) -> None:
        batch = self.decode(payload)
        for event in batch.events:
            kind = type(event).__name__
            if kind == "AllBlocksCleared":
                self.clears += 1
                self.pages = {ns: {} for ns in self.followed}
                continue
            ns = namespace_of(getattr(event, "ownership", None))
            if ns not in self.followed:
                continue
            pages = self.pages[ns]
            if kind == "BlockStored":
                for key in event.block_hashes:
                    pages.setdefault(bytes(key), set()).add(event.medium)
            elif kind == "BlockRemoved":
                for key in event.block_hashes:
                    held = pages.get(bytes(key))
                    if held is not None:
                        held.discard(event.medium)
                        if not held:
                            del pages[bytes(key)]
        self.next_seq = seq + 1
        self._last_ts = max(self._last_ts, batch.ts)
        self._seen[seq] = _digest(payload)
        while len(self._seen) > _SEEN_MAX:
            self._seen.popitem(last=False)


def _digest(payload: bytes) -> bytes:
    return hashlib.blake2b(payload, digest_size=8).digest()
