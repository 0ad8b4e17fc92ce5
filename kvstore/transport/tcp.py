"""The TCP data plane: a uvloop stream server moving page bytes between sockets and arena slots.

Frames and the per-connection reader are in kvstore_client/tcp_framing.py (pure); this
module is the thin I/O layer under it. It runs its own event loop on one thread, beside
the gRPC server.

- PUT bodies land in the slot through a landing (kvstore_client/landing.py): the protocol
  is an asyncio BufferedProtocol whose get_buffer() returns where the landing says the
  next bytes of the body go (a small private buffer in the CPU's cache, copied into the
  slot and hashed in one native pass; without kvstore_native, the slot itself), so each
  piece is hashed as it lands (hashing a whole page after its last byte read it back from
  memory: a second pass over every byte). Once the body is all in, the digest goes back
  with the slot; the Commit records it instead of reading the slot again, unless a later
  write to the slot voided it.
  PUT answers are gathered over one pass of the loop (pages read back to back) and sent
  together: on loopback each send costs about half a page's receive. GET answers are
  written straight out of the slot: uvloop keeps a reference to the arena view until the
  kernel has taken its bytes, no copy. An answer is flagged VOUCHED where no other process
  can have written the slot since its commit (the grant says so: store_exposure.py), and
  the reader skips hashing it.
- Each frame is resolved through a SlotResolver (the service, wired by server.py): the
  token must be the lease's and the slot one of its slots. A refused frame gets an error
  answer and the connection goes on. Headers are read many to a read (tcp_framing.RequestReader),
  and each read's frames are served in one pass (_serve): a batch of 64 GETs of 1 MiB cost the
  loop a read and a pass of Python per 40-byte header (gets over loopback, client and node on
  two cores: 0.85-0.90 of a raw socket before, 0.90-0.98 after, alternated runs).
- A grant is held until its bytes have moved: a PUT until its body is in, a GET until the
  transport's write queue has drained past it. A connection lost mid-body cuts the write,
  which ends the lease: the torn page is never visible and its slots are reclaimed.
- With tcp.tls_cert the server speaks TLS only (uvloop's SSL transport under the same
  protocol). A GET's slot view then waits in the TLS layer's backlog until it is encrypted;
  that backlog counts in get_write_buffer_size, so its grant is held until then.
- Backpressure and bounded memory: the transport pauses reading when its write queue is
  above write_buffer_high_bytes (queued GET answers are references into the arena, not
  copies), and a connection still holding a grant at its lease's deadline is aborted, so a
  client that stops reading holds nothing past its lease.
- Identity: with hello_required (authentication on), a connection's first frame must be a
  HELLO showing a data ticket; the resolver bound to that identity (SlotResolver.bind)
  resolves every later frame, so a lease of another tenant reads as unknown. Any other
  first frame is answered UNAUTHENTICATED and the connection closed.
- Connections are bounded: beyond connections_max a new one is closed at once, and one
  that has sent no frame for idle_timeout_s (and moves no page) is closed, so idle or
  half-open peers cannot hold every place.
- Control calls (CALL frames, where the resolver serves them: kvstore/control/tcp_calls.py) come on a
  connection of their own: a connection carries pages or calls, and a frame of the other kind is
  refused and closes it. Each call runs on a worker thread (as many as gRPC has), one call of a
  connection at a time, so their answers go out in order and a call that waits (an Acquire waiting
  for commits) holds up neither the loop nor other connections. A call's body is read into memory
  mapped as it arrives, so what a frame announces costs memory only once it is sent; beyond
  CALLS_QUEUED_MAX calls waiting, the connection is not read. The leases its calls opened end
  when the connection closes, once its running call is over.
- A broken invariant (an AssertionError from the resolver, in any callback of the loop, or from a
  call) stops the node (kvstore/invariants.py); it is never logged and carried on from.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import mmap
import socket
import ssl
import threading
import time
from concurrent import futures

import uvloop

from kvstore.invariants import stop_node
from kvstore.transport.slots import ControlCalls, Grant, SlotResolver
from kvstore_client import errors
from kvstore_client.landing import landing_buffer, new_landing
from kvstore_client.tcp_framing import (SKIP_CHUNK_BYTES, VOUCHED, Event, FrameError, Hello, Op, Request,
                                        RequestReader, encode_error, encode_response)

log = logging.getLogger(__name__)

# At connections_max, a new connection takes the place of the one idle longest, if it has
# been idle this long: idle sockets (an attacker's, or a crashed client's) never lock real
# clients out until tcp.idle_timeout_s.
RECLAIM_IDLE_S = 1.0
# While GET answers are queued, the write queue is checked this often to hand back grants
# whose bytes the kernel has taken (uvloop has no per-write completion callback).
DRAIN_POLL_S = 0.002
PUT_ANSWER = encode_response(0, Op.PUT, 0)
# Calls of one connection waiting for their turn beyond which it is not read: a client pipelines a few.
CALLS_QUEUED_MAX = 64
# A call's body up to this size is read into a buffer allocated at once; a larger one into mapped memory.
CALL_BODY_EAGER_BYTES = 64 << 10


@dataclasses.dataclass(frozen=True)
class TcpSettings:
    host: str
    port: int
    body_bytes_max: int              # the largest page
    connections_max: int
    idle_timeout_s: float            # close a connection that sent no frame and moves no page for this long
    write_buffer_high_bytes: int     # pause reading a connection above this much queued output
    write_buffer_low_bytes: int
    congestion: str = ""             # TCP_CONGESTION for accepted sockets; "" = system default
    hello_required: bool = False     # serve no frame before a HELLO with a data ticket
    tls: ssl.SSLContext | None = None  # speak TLS only (tcp.tls_cert); None = plaintext
    call_workers: int = 4            # threads serving CALL frames (the node gives it server.grpc_workers)


class TcpServer:
    """Serves the data plane on its own thread; start() returns once it listens."""

    def __init__(self, settings: TcpSettings, resolver: SlotResolver):
        self.settings = settings
        self._resolver = resolver
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.base_events.Server | None = None
        self._connections: set[_Connection] = set()
        self._scratch = memoryview(bytearray(SKIP_CHUNK_BYTES))  # shared: one loop thread
        self._landing_buffer = landing_buffer()                   # the same: each read is copied out at once
        self.call_workers = futures.ThreadPoolExecutor(settings.call_workers, thread_name_prefix="tcp-calls")
        self._thread = threading.Thread(target=self._run, name="tcp-data-plane", daemon=True)
        self._ready = threading.Event()
        self._failure: BaseException | None = None
        self.port = 0

    @property
    def endpoint(self) -> str:
        return f"{self.settings.host}:{self.port}"

    def start(self) -> None:
        self._thread.start()
        self._ready.wait()
        if self._failure is not None:
            raise OSError(f"cannot listen for the TCP data plane on {self.endpoint} "
                          f"(tcp.address, tcp.congestion): {self._failure}")

    def close(self) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        loop.call_soon_threadsafe(self._stop)
        self._thread.join(10)
        self.call_workers.shutdown(wait=False, cancel_futures=True)

    # -- loop thread ------------------------------------------------------------------

    def _run(self) -> None:
        loop = uvloop.new_event_loop()
        loop.set_exception_handler(_stop_on_broken_invariant)
        self._loop = loop
        try:
            self._server = loop.run_until_complete(loop.create_server(
                self._accept, self.settings.host, self.settings.port, backlog=256, reuse_address=True,
                ssl=self.settings.tls))
            self.port = self._server.sockets[0].getsockname()[1]
            if self.settings.congestion:  # fail at start-up, not on every accepted connection
                self._server.sockets[0].setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION,
                                                   self.settings.congestion.encode())
        except OSError as exc:
            self._failure = exc
            self._ready.set()
            loop.close()
            return
        log.info("tcp data plane listening endpoint=%s", self.endpoint)
        self._ready.set()
        try:
            loop.run_forever()
        finally:
            loop.close()

    def _stop(self) -> None:
        assert self._server is not None
        self._server.close()
        for connection in list(self._connections):
            connection.abort()
        self._loop.call_later(0.05, self._loop.stop)  # let connection_lost callbacks hand grants back

    def _accept(self) -> "_Connection":
        return _Connection(self)

    def reclaim_idlest(self) -> bool:
        """At the connection limit (loop thread): close the connection idle longest, if any has
        been idle RECLAIM_IDLE_S; True when a place was freed."""
        now = self._loop.time()
        idle = [(since, c) for c in self._connections if (since := c.idle_since()) is not None
                and now - since >= RECLAIM_IDLE_S]
        if not idle:
            return False
        since, victim = min(idle, key=lambda pair: pair[0])
        log.info("tcp connections_max reached: closing peer=%s idle for %.1f s to admit a new one",
                 victim.peer, now - since)
        victim.abort()
        return True


def _stop_on_broken_invariant(loop: asyncio.AbstractEventLoop, context: dict) -> None:
    """The loop's handler for what its callbacks raise: frame handling, timers, connection_lost.

    uvloop reports an exception from a protocol callback here, then closes that
    connection; an AssertionError means a slot's state is impossible, so the node stops.
    """
    exc = context.get("exception")
    if isinstance(exc, AssertionError):
        stop_node("the TCP data plane", exc)
    loop.default_exception_handler(context)


class _Connection(asyncio.BufferedProtocol):
    def __init__(self, server: TcpServer):
        self._server = server
        self._resolver = server._resolver
        self._reader = RequestReader(server.settings.body_bytes_max, server._scratch)
        self._transport: asyncio.Transport | None = None
        self._peer = "?"
        self._body: Grant | None = None            # the PUT being received
        self._landing = new_landing(server._landing_buffer)   # where its bytes land, and their hash so far
        self._sent = 0                             # bytes handed to the transport
        self._reads: collections.deque[tuple[int, Grant]] = collections.deque()   # GET answers queued
        self._put_answers = 0                      # PUT answers not yet written (see _answer_put)
        self._flush: asyncio.Handle | None = None
        self._drain_timer: asyncio.TimerHandle | None = None
        self._deadline_timer: asyncio.TimerHandle | None = None
        self._deadline = float("inf")              # when _deadline_timer fires
        self._idle_timer: asyncio.TimerHandle | None = None
        self._last_frame = 0.0                     # loop.time() of the last frame received
        self._closed = False
        self._greeted = False                      # a HELLO bound _resolver to the peer's identity
        self._writing_paused = False               # its output is above write_buffer_high_bytes: no new frame
        self._carries: str | None = None           # "pages" or "calls", from its first PUT, GET or CALL
        self._calls: ControlCalls | None = None    # opened by its first CALL
        self._call_body: tuple[int, memoryview] | None = None   # the CALL being received: (method id, body)
        self._call_queue: collections.deque[tuple[int, object]] = collections.deque()   # [0] is running

    # -- asyncio callbacks -------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport
        sock = transport.get_extra_info("socket")
        self._peer = str(transport.get_extra_info("peername"))
        settings = self._server.settings
        if len(self._server._connections) >= settings.connections_max and not self._server.reclaim_idlest():
            log.warning("tcp connection refused peer=%s: tcp.connections_max=%d reached, none idle",
                        self._peer, settings.connections_max)
            transport.abort()
            self._closed = True
            return
        self._server._connections.add(self)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if settings.congestion:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, settings.congestion.encode())
        transport.set_write_buffer_limits(high=settings.write_buffer_high_bytes, low=settings.write_buffer_low_bytes)
        self._last_frame = self._server._loop.time()
        self._idle_timer = self._server._loop.call_later(settings.idle_timeout_s, self._idle_check)

    def get_buffer(self, sizehint: int) -> memoryview:
        buffer = self._reader.buffer()
        return buffer if self._body is None else self._landing.place(buffer)

    def buffer_updated(self, nbytes: int) -> None:
        self._serve(nbytes)

    def pause_writing(self) -> None:
        self._writing_paused = True
        self._transport.pause_reading()

    def resume_writing(self) -> None:
        self._writing_paused = False
        self._serve(0)   # the frames read ahead before the pause
        if not self._closed and not self._writing_paused:
            self._transport.resume_reading()

    def eof_received(self) -> bool:
        return False  # close our side too

    def connection_lost(self, exc: Exception | None) -> None:
        self._closed = True
        self._server._connections.discard(self)
        for timer in (self._drain_timer, self._deadline_timer, self._idle_timer, self._flush):
            if timer is not None:
                timer.cancel()
        if self._body is not None:
            grant, self._body = self._body, None
            log.info("tcp peer=%s closed mid-page; the write is cut and its lease ended", self._peer)
            self._resolver.cut_transfer(grant)
        # The socket is gone, so nothing reads the queued views any more.
        while self._reads:
            self._resolver.finish_transfer(self._reads.popleft()[1])
        while len(self._call_queue) > 1:   # only the running call is left: its end closes the calls
            self._call_queue.pop()
        if self._calls is not None and not self._call_queue:
            self._calls.close()

    def abort(self) -> None:
        self._server._connections.discard(self)  # its place is free now, not when connection_lost runs
        if self._transport is not None:
            self._transport.abort()

    # -- frames ------------------------------------------------------------------------

    def _serve(self, nbytes: int) -> None:
        """Take `nbytes` just read into get_buffer()'s buffer, then what was read ahead with them: the bytes of a
        body its header came with, and every whole frame, but no new frame while writing is paused."""
        reader = self._reader
        try:
            event = self._received(nbytes) if nbytes else None
            if event is None and reader.mid_body and not reader.read_ahead():
                return   # most reads of a page: more of its body, nothing else
            while True:
                if event is not None:
                    self._handle(event)
                    if self._transport.is_closing():   # refused for good
                        return
                if reader.read_ahead():
                    event = self._received(reader.move_read_ahead(self.get_buffer(0)))
                elif self._writing_paused:
                    break
                else:
                    event = reader.next_frame()
                    if event is None and not reader.read_ahead():
                        break
        except FrameError as exc:
            log.warning("tcp peer=%s sent an unreadable frame, closing: %s", self._peer, exc)
            self._write([encode_error(0, errors.MalformedRequest.code, str(exc))])
            self._transport.close()
            return
        self._collect_reads()

    def _received(self, nbytes: int) -> Request | Event | Hello | None:
        """What `nbytes` written into get_buffer()'s buffer complete; a body's bytes land in its slot, hashed."""
        if self._body is not None:
            self._landing.landed(self._reader.buffer(), nbytes)
        return self._reader.received(nbytes)

    def _handle(self, event: Request | Event | Hello) -> None:
        self._last_frame = self._server._loop.time()
        if isinstance(event, Hello):
            self._hello(event.ticket)
        elif isinstance(event, Request):
            if not self._admitted(event):
                return
            if event.op == Op.PUT:
                self._start_put(event)
            elif event.op == Op.GET:
                self._get(event)
            else:
                self._start_call(event)
        elif event is Event.BODY_DONE and self._call_body is not None:
            (method_id, body), self._call_body = self._call_body, None
            self._queue_call(method_id, body)
        elif event is Event.BODY_DONE:
            grant, self._body = self._body, None
            # Hashed as it landed: its Commit reads nothing back, so no 16 MiB hash sits between the last byte
            # and the answer.
            self._resolver.finish_transfer(grant, self._landing.intdigest())
            self._answer_put()

    def _hello(self, ticket: bytes) -> None:
        try:
            self._resolver = self._server._resolver.bind(ticket)
        except errors.KVStoreError as exc:
            log.info("tcp peer=%s refused at HELLO: %s", self._peer, exc)
            self._refuse(Op.HELLO, exc)
            self._transport.close()
            return
        self._greeted = True
        self._write([encode_response(0, Op.HELLO, 0)])

    def _start_put(self, request: Request) -> None:
        try:
            grant = self._resolver.resolve_write(request.lease_id, request.token, request.slot, request.length)
        except errors.KVStoreError as exc:
            if request.length:
                self._reader.skip_body()
            self._refuse(Op.PUT, exc)
            self._close_if_unauthenticated(exc)
            return
        self._reader.accept_body(grant.view)
        self._body = grant
        self._landing.reset()
        self._watch_deadline(grant.deadline)

    def _get(self, request: Request) -> None:
        try:
            grant = self._resolver.resolve_read(request.lease_id, request.token, request.slot, request.length)
        except errors.KVStoreError as exc:
            self._refuse(Op.GET, exc)
            self._close_if_unauthenticated(exc)
            return
        self._write([encode_response(0, Op.GET, len(grant.view), VOUCHED if grant.vouched else 0), grant.view])
        self._reads.append((self._sent, grant))
        self._watch_deadline(grant.deadline)

    def _admitted(self, request: Request) -> bool:
        """Whether the connection may serve this frame, else it is refused and the connection closed: after a HELLO
        where the node needs one; and of the kind its first PUT, GET or CALL set (pages or calls: answers to
        the other kind would not come in order)."""
        kind = "calls" if request.op == Op.CALL else "pages"
        if not self._greeted and self._server.settings.hello_required:
            refusal = errors.Unauthenticated(
                "this node needs the connection's first frame to be a HELLO with the data_ticket of a gRPC "
                "Hello (pass token= or TLS files to KVStoreClient)")
        elif self._carries not in (None, kind):
            refusal = errors.MalformedRequest(
                f"this connection carries {self._carries}, and a {request.op.name} frame is not one: a client moves "
                "pages on one connection and sends its calls on another")
        else:
            self._carries = kind
            return True
        self._refuse(request.op, refusal)
        self._transport.close()
        return False

    def _start_call(self, request: Request) -> None:
        """A CALL's header: its body is read into a buffer of its own, then the call waits its turn."""
        if self._calls is None:
            try:
                self._calls = self._resolver.open_calls()
            except errors.KVStoreError as exc:
                if request.length:
                    self._reader.skip_body()
                self._refuse(Op.CALL, exc)
                return
        if not request.length:
            self._queue_call(request.slot, b"")
            return
        body = memoryview(bytearray(request.length) if request.length <= CALL_BODY_EAGER_BYTES
                          else mmap.mmap(-1, request.length))
        self._reader.accept_body(body)
        self._call_body = (request.slot, body)

    def _queue_call(self, method_id: int, body: object) -> None:
        self._call_queue.append((method_id, body))
        if len(self._call_queue) == 1:
            self._run_call()
        elif len(self._call_queue) > CALLS_QUEUED_MAX:
            self._transport.pause_reading()   # read again as the calls before are answered

    def _run_call(self) -> None:
        """Hand the call at the head of the queue to a worker thread; its end comes back on the loop."""
        loop = self._server._loop
        future = self._server.call_workers.submit(self._calls.call, *self._call_queue[0])
        future.add_done_callback(lambda done: loop.call_soon_threadsafe(self._call_done, done))

    def _call_done(self, future: futures.Future) -> None:
        """A call ended (loop thread): write its answer, start the next one; a broken invariant raises out of here."""
        self._call_queue.popleft()
        refusal = None
        try:
            answer = future.result()
            pieces = [encode_response(0, Op.CALL, len(answer)), answer]
        except errors.KVStoreError as exc:
            refusal = exc
            pieces = [encode_error(Op.CALL, exc.code, str(exc))]
        except AssertionError:
            raise
        except Exception:
            log.exception("tcp call of peer=%s failed", self._peer)
            pieces = [encode_error(Op.CALL, errors.Internal.code, "internal error, see the server log")]
        if self._closed:
            if not self._call_queue:
                self._calls.close()
            return
        self._write(pieces)
        if refusal is not None:
            log.debug("tcp peer=%s call refused: %s", self._peer, refusal)
            self._close_if_unauthenticated(refusal)
        if self._call_queue:
            self._run_call()
            if len(self._call_queue) == CALLS_QUEUED_MAX:
                self._transport.resume_reading()

    def _refuse(self, op: Op, exc: errors.KVStoreError) -> None:
        log.debug("tcp peer=%s frame refused: %s", self._peer, exc)
        self._write([encode_error(op, exc.code, str(exc))])

    def _close_if_unauthenticated(self, exc: errors.KVStoreError) -> None:
        """The connection's token was revoked or expired: no later frame of it is served either."""
        if isinstance(exc, errors.Unauthenticated):
            log.info("tcp peer=%s closed: %s", self._peer, exc)
            self._transport.close()

    def _answer_put(self) -> None:
        """Queue a PUT's answer, written with the others of this loop pass: one send, not one per page."""
        self._put_answers += 1
        if self._flush is None:
            self._flush = self._server._loop.call_soon(self._flush_answers)

    def _flush_answers(self) -> None:
        self._flush = None
        if not self._closed:
            self._write([])

    def _write(self, pieces: list) -> None:
        """Every answer goes out through here, after the PUT answers queued before it: answers stay in order."""
        if self._put_answers:
            pieces = [PUT_ANSWER * self._put_answers, *pieces]
            self._put_answers = 0
        if not pieces:
            return
        self._sent += sum(map(len, pieces))
        self._transport.writelines(pieces)

    def _collect_reads(self) -> None:
        """Hand back the grants of GET answers the kernel has taken; poll while some are queued."""
        if self._closed:
            return
        taken = self._sent - self._transport.get_write_buffer_size()
        reads = self._reads
        while reads and reads[0][0] <= taken:
            self._resolver.finish_transfer(reads.popleft()[1])
        if reads and self._drain_timer is None:
            self._drain_timer = self._server._loop.call_later(DRAIN_POLL_S, self._drain_tick)

    def _drain_tick(self) -> None:
        self._drain_timer = None
        self._collect_reads()

    def _watch_deadline(self, deadline: float) -> None:
        """One timer per connection, at the earliest deadline of the grants it holds."""
        if deadline < self._deadline:
            if self._deadline_timer is not None:
                self._deadline_timer.cancel()
            self._deadline = deadline
            self._deadline_timer = self._server._loop.call_later(
                max(0.0, deadline - time.monotonic()), self._deadline_reached)

    @property
    def peer(self) -> str:
        return self._peer

    def idle_since(self) -> float | None:
        """loop.time() of its last frame when it moves no page now, else None (it is busy)."""
        if self._closed or self._body is not None or self._reads or self._busy_with_calls():
            return None
        return self._last_frame

    def _busy_with_calls(self) -> bool:
        """A call runs, or one opened a lease still open: between a put's Reserve and its Commit, its pages move
        on another connection, however long this one sends nothing."""
        return bool(self._call_queue) or (self._calls is not None and self._calls.holds_leases())

    def _idle_check(self) -> None:
        """Close the connection once it has sent no frame for idle_timeout_s; a page in flight is not idle."""
        loop, timeout_s = self._server._loop, self._server.settings.idle_timeout_s
        now = loop.time()
        if self._body is not None or self._reads or self._busy_with_calls():
            self._last_frame = now  # a page moving or a lease of its calls open is activity; leases bound both
        elif now - self._last_frame >= timeout_s:
            self._idle_timer = None
            log.info("tcp peer=%s sent no frame for %.1f s (tcp.idle_timeout_s); closing", self._peer,
                     now - self._last_frame)
            self.abort()
            return
        self._idle_timer = loop.call_later(self._last_frame + timeout_s - now, self._idle_check)

    def _deadline_reached(self) -> None:
        self._deadline_timer, self._deadline = None, float("inf")
        held = [grant for _, grant in self._reads] + ([self._body] if self._body is not None else [])
        now = time.monotonic()
        if any(grant.deadline <= now for grant in held):
            log.warning("tcp peer=%s still moving a page when its lease expired; closing the connection", self._peer)
            self.abort()
        elif held:
            self._watch_deadline(min(grant.deadline for grant in held))
