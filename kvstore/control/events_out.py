"""Publish the store's page events (store_events.py) as vLLM publishes its KV events.

The wire is vLLM's ZmqEventPublisher's, byte for byte in framing, so that vLLM's own classes
(vllm.distributed.kv_events.KVEventBatch) and any consumer of vLLM's events decode it unchanged:
- PUB: multipart (topic, seq as 8 bytes big-endian, payload), payload a msgpack KVEventBatch
  `[ts, [event, ...], data_parallel_rank]`, each event a map tagged by "type" (BlockStored,
  BlockRemoved, AllBlocksCleared), fields left at their defaults omitted.
- Replay: a ROUTER answering (identity, b"", start seq) with (identity, b"", topic, seq, payload)
  for every buffered batch from `start` on, then (identity, b"", b"", -1, b""). A fourth frame
  may name the topic (the tenant's stream) to replay; without one, the default tenant's ("").

What the fields hold:
- block_hashes / parent_block_hash: the page's key and its parent's, as the bytes the store
  keeps (for namespaces keyed by kvstore_client.keys' chain, the 64 hex digits of SGLang's
  get_hash_str digest; an engine's own seeded hashes are not invertible, so they are never
  published). Consecutive pages of one chain share one BlockStored, as vLLM's do.
- token_ids: empty (the store keeps no tokens); block_size: the namespace's page_tokens.
- medium: "CPU" for this store's DRAM, "DISK" for its NVMe (SGLang's names for host memory and
  disk tiers; vLLM's consumers take any string).
- ownership ("secondary offloading tier identifier"): `kvstore:<namespace id, 16 hex digits>`,
  so a consumer tells the namespaces (model, page size, layout) of one tenant apart.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Any

import msgspec

from kvstore.config import EventsOutConfig
from kvstore.control.store_events import CLEARED, REMOVED, STORED, Batch, PageEvent, StoreEvents, topic_of
from kvstore_client.event_wire import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from kvstore_client.events import END_SEQ, ownership_of

log = logging.getLogger(__name__)

POLL_MS = 50


def wire_events(events: list[PageEvent]) -> list:
    """vLLM's event structs of a batch's page events: a chain's pages stored in a row share one BlockStored."""
    out: list = []
    for event in events:
        last = out[-1] if out else None
        if event.kind == CLEARED:
            out.append(AllBlocksCleared())
            continue
        ownership = ownership_of(event.namespace_id)
        if event.kind == STORED:
            if (isinstance(last, BlockStored) and last.medium == event.medium and last.ownership == ownership
                    and last.block_hashes[-1] == event.parent_key):
                last.block_hashes.append(event.key)
                continue
            out.append(BlockStored(block_hashes=[event.key], parent_block_hash=event.parent_key or None,
                                   token_ids=[], block_size=event.page_tokens, lora_id=None,
                                   medium=event.medium, lora_name=None, ownership=ownership))
        else:
            assert event.kind == REMOVED
            if isinstance(last, BlockRemoved) and last.medium == event.medium and last.ownership == ownership:
                last.block_hashes.append(event.key)
                continue
            out.append(BlockRemoved(block_hashes=[event.key], medium=event.medium, ownership=ownership))
    return out


class EventPublisher:
    """One thread: publishes what the journal holds, keeps each tenant's last batches, answers replays."""

    def __init__(self, config: EventsOutConfig, journal: StoreEvents):
        import zmq  # the [events] extra

        self.config = config
        self.journal = journal
        self._zmq = zmq
        self._context = zmq.Context()
        self._pub = self._context.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.set_hwm(config.hwm)
        self._pub.bind(config.endpoint)
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self._replay = None
        self.replay_endpoint = ""
        if config.replay_endpoint:
            self._replay = self._context.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self._replay.setsockopt(zmq.SNDHWM, 2 * (config.replay_batches + 1))   # a whole replay and its end
            self._replay.bind(config.replay_endpoint)
            self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        self._buffers: dict[bytes, collections.deque[tuple[int, bytes]]] = {}
        self._encoder = msgspec.msgpack.Encoder()
        self.batches_published = 0
        self.replays_answered = 0
        self.batches_replayed = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-events-out", daemon=True)

    def collector(self) -> "PublisherCollector":
        return PublisherCollector(self)

    def start(self) -> None:
        log.info("publishing store events endpoint=%s replay=%s replay_batches=%d", self.endpoint,
                 self.replay_endpoint or "-", self.config.replay_batches)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self.journal.ready.set()
        self._thread.join(timeout=5)
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)
        self._context.term()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                if self.journal.ready.is_set():
                    for batch in self.journal.take():
                        self._publish(batch)
                if self._replay is not None:
                    if self._replay.poll(POLL_MS):
                        self._answer_replay()
                else:
                    self.journal.ready.wait(POLL_MS / 1000)
            except Exception:  # the publisher must outlive one bad batch or request
                log.exception("store event publisher step failed")
                self._stop.wait(0.1)

    def _publish(self, batch: Batch) -> None:
        topic = topic_of(batch.tenant)
        payload = self._encoder.encode(KVEventBatch(ts=time.time(), events=wire_events(batch.events),
                                                    data_parallel_rank=0))
        self._pub.send_multipart((topic, batch.seq.to_bytes(8, "big"), payload))
        buffer = self._buffers.get(topic)
        if buffer is None:
            buffer = self._buffers[topic] = collections.deque(maxlen=self.config.replay_batches)
        buffer.append((batch.seq, payload))
        self.batches_published += 1

    def _answer_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) not in (3, 4) or frames[1] or len(frames[2]) != 8:
            log.warning("malformed replay request of %d frames: want (b'', start seq as 8 bytes[, topic])",
                        len(frames))
            return
        client = frames[0]
        start = int.from_bytes(frames[2], "big", signed=True)
        topic = frames[3] if len(frames) == 4 else topic_of("")
        for seq, payload in self._buffers.get(topic, ()):
            if seq >= start:
                self._replay.send_multipart((client, b"", topic, seq.to_bytes(8, "big"), payload))
                self.batches_replayed += 1
        self.replays_answered += 1
        self._replay.send_multipart((client, b"", b"", END_SEQ.to_bytes(8, "big", signed=True), b""))


class PublisherCollector:
    """kvstore_events_out_*: what the page event publisher sent, replayed and lost, read at scrape time."""

    def __init__(self, publisher: EventPublisher):
        self._publisher = publisher

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Any:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        p, journal = self._publisher, self._publisher.journal
        yield CounterMetricFamily("kvstore_events_out_batches_published", "Event batches published (every tenant)",
                                  value=p.batches_published)
        yield CounterMetricFamily("kvstore_events_out_replays", "Replay requests answered", value=p.replays_answered)
        yield CounterMetricFamily("kvstore_events_out_batches_replayed", "Event batches sent again by replay",
                                  value=p.batches_replayed)
        yield CounterMetricFamily("kvstore_events_out_events_dropped",
                                  "Events lost to a full journal queue (events_out.queue_pages_max): each a gap "
                                  "its subscribers fill from a snapshot", value=journal.dropped)
        yield GaugeMetricFamily("kvstore_events_out_queued_events", "Events journalled, not yet published",
                                value=journal.queued)
