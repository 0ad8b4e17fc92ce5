"""Follow one engine's KV events over ZMQ and apply them to the EngineIndex.

The engine (vLLM or SGLang with `--kv-events-config '{"enable_kv_cache_events": true,
"publisher": "zmq", "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558"}'`)
publishes multipart messages (topic, seq as 8 bytes big-endian, msgpack KVEventBatch)
on a PUB socket. Sequence numbers start at 0 and grow by one per batch, so a jump is a
loss (the subscriber joined late, or the PUB high-water mark dropped batches). When a
replay endpoint is configured the subscriber asks the engine's ROUTER for the batches it
missed (a DEALER sends (b"", start seq); the answers are (b"", topic, seq, payload), ended
by an empty topic with seq -1); otherwise it counts the gap. A batch numbered 0 after
later ones means the engine restarted with an empty cache.
"""

from __future__ import annotations

import logging
import threading

from kvstore.control.engine_events import EventDecodeError, decode_batch
from kvstore.control.engine_index import Cleared, EngineIndex

log = logging.getLogger(__name__)

POLL_MS = 100
END_SEQ = -1


class EventSubscriber:
    def __init__(self, engine_id: str, endpoint: str, replay_endpoint: str, topic: str, index: EngineIndex,
                 replay_timeout_ms: int):
        import zmq  # the [events] extra; only a server with engines to follow needs it

        self.engine_id = engine_id
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.index = index
        self.replay_timeout_ms = replay_timeout_ms
        self.last_seq = -1
        self.decode_errors = 0
        self._zmq = zmq
        self._context = zmq.Context()
        self._sub = self._context.socket(zmq.SUB)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self._sub.connect(endpoint)
        self._replay = self._replay_socket() if replay_endpoint else None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"kv-events-{engine_id}", daemon=True)

    def _replay_socket(self):
        sock = self._context.socket(self._zmq.DEALER)
        sock.setsockopt(self._zmq.LINGER, 0)
        sock.connect(self.replay_endpoint)
        return sock

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        for sock in (self._sub, self._replay):
            if sock is not None:
                sock.close(linger=0)
        self._context.term()

    def _run(self) -> None:
        log.info("following KV events engine=%s endpoint=%s replay=%s", self.engine_id, self.endpoint,
                 self.replay_endpoint or "-")
        if self._replay is not None:
            self._catch_up(0)
        while not self._stop.is_set():
            try:
                if not self._sub.poll(POLL_MS):
                    continue
                frames = self._sub.recv_multipart()
                if len(frames) != 3 or len(frames[1]) != 8:
                    self._bad(f"expected 3 frames (topic, seq, payload), got {len(frames)}")
                    continue
                self._receive(int.from_bytes(frames[1], "big", signed=True), frames[2])
            except self._zmq.ZMQError:
                if self._stop.is_set():
                    return
                log.exception("KV event socket failed engine=%s", self.engine_id)
                self._stop.wait(1.0)
            except Exception:  # the subscriber must outlive one bad batch
                log.exception("KV event batch failed engine=%s", self.engine_id)

    def _receive(self, seq: int, payload: bytes) -> None:
        if seq <= self.last_seq:
            if seq != 0:
                return  # already applied (a replayed batch arriving twice)
            log.info("engine %s restarted (sequence back to 0); its cached pages are gone", self.engine_id)
            self.index.apply(self.engine_id, [Cleared()])
            self.last_seq = -1
        if seq > self.last_seq + 1:
            if self._replay is not None:
                self._catch_up(self.last_seq + 1)
            if seq > self.last_seq + 1:
                missed = seq - self.last_seq - 1
                self.index.note_gap(self.engine_id, missed)
                log.warning("engine %s: %d KV event batches lost before seq %d", self.engine_id, missed, seq)
        if seq > self.last_seq:  # not already applied by the catch-up
            self._apply(seq, payload)

    def _apply(self, seq: int, payload: bytes) -> None:
        try:
            _, events = decode_batch(payload)
        except EventDecodeError as exc:
            self._bad(str(exc))
        else:
            self.index.apply(self.engine_id, events)
        self.last_seq = seq

    def _catch_up(self, start: int) -> None:
        """Ask the engine's replay socket for every batch from `start`; bounded by replay_timeout_ms."""
        assert self._replay is not None
        self._replay.send_multipart((b"", start.to_bytes(8, "big", signed=True)))
        replayed = 0
        while not self._stop.is_set():
            if not self._replay.poll(self.replay_timeout_ms):
                log.warning("engine %s: no replay answer within %d ms", self.engine_id, self.replay_timeout_ms)
                # A fresh socket, so a late answer to this request is never read as the next one's.
                self._replay.close(linger=0)
                self._replay = self._replay_socket()
                return
            frames = self._replay.recv_multipart()
            if len(frames) != 4 or len(frames[2]) != 8:
                self._bad(f"replay answer of {len(frames)} frames")
                continue
            seq = int.from_bytes(frames[2], "big", signed=True)
            if seq == END_SEQ:
                break
            if seq > self.last_seq:
                if seq > self.last_seq + 1:
                    self.index.note_gap(self.engine_id, seq - self.last_seq - 1)
                self._apply(seq, frames[3])
                replayed += 1
        log.info("engine %s: replayed %d KV event batches from seq %d", self.engine_id, replayed, start)

    def _bad(self, why: str) -> None:
        self.decode_errors += 1
        log.warning("engine %s sent a malformed KV event message: %s", self.engine_id, why)
