"""Control channels: gRPC for any host, and channels answered in order on a node's own sockets.

All carry the messages of kvstore.v1.KVStore, raise the exceptions of errors.py, and
give every call a deadline. `submit` sends a request and returns an answer-to-be whose
`result()` waits for it; `post` is a submit whose answer nobody waits for (its error, if
any, is logged), used for releases and aborts so a call never waits for one.

An OrderedChannel (the local channel on the node's Unix socket, here; the call connection of the
TCP data plane, tcp_control.py) is answered in order (`answers_in_order`), so submitted requests
pipeline: the client copies pages while the server reserves the next group and checks the
previous one. gRPC gives no order between calls in flight, so the pipeline (pipeline.py) waits
where order matters.

A client call that names its own `timeout_s` runs inside call_deadline(): every message it
sends, on any channel, must be answered before that one deadline (DeadlineExceeded). On an
ordered channel a request whose answer comes too late stays queued, and its answer is read and
dropped when it arrives, so the channel stays in step; a lease it opened expires by its TTL.
"""

from __future__ import annotations

import array
import collections
import contextlib
import contextvars
import logging
import os
import select
import socket
import struct
import threading
import time
from typing import Any, Iterator

import grpc

from kvstore_client import errors, framing
from kvstore_client.arguments import check_timeout_s
from kvstore_client.credentials import Credentials

log = logging.getLogger(__name__)

# The local socket's send buffer: room for the several Lookups of a long chain (128 KiB each) to wait in the kernel
# while the node reads the first, instead of the caller blocking in sendall (a cluster's residency sends every
# node its parts from one thread: blocked on one node, it neither hashes the next part nor feeds the others).
# The kernel holds it to net.core.wmem_max (twice that: it doubles the value asked for).
SEND_BUFFER_BYTES = 1 << 20

# time.monotonic() by which the current call must be answered; None = each message gets the channel's timeout_s.
_call_deadline: contextvars.ContextVar[float | None] = contextvars.ContextVar("kvstore_call_deadline", default=None)


@contextlib.contextmanager
def call_deadline(timeout_s: float | None) -> Iterator[None]:
    """Every message sent inside the block (this thread or task) must be answered within timeout_s from now."""
    if timeout_s is None:
        yield
        return
    check_timeout_s(timeout_s)
    outer = _call_deadline.get()
    deadline = time.monotonic() + timeout_s
    token = _call_deadline.set(deadline if outer is None else min(outer, deadline))
    try:
        yield
    finally:
        _call_deadline.reset(token)


def call_deadline_at() -> float | None:
    """time.monotonic() by which the current call must be answered; None when it named no timeout_s."""
    return _call_deadline.get()


def seconds_left(default_s: float) -> float:
    """The gRPC timeout of a message sent now: what is left of the call's deadline, else default_s."""
    deadline = _call_deadline.get()
    if deadline is None:
        return default_s
    left = deadline - time.monotonic()
    if left <= 0:
        raise errors.DeadlineExceeded("the call's timeout_s ran out before it finished")
    return left


class Pending:
    """The answer to a request submitted on an ordered channel, once it arrives."""

    __slots__ = ("name", "posted", "deadline", "_channel", "_response", "_error", "_done")

    def __init__(self, name: str, channel: "OrderedChannel"):
        self.name = name
        self.posted = False                  # nobody waits: an error is logged instead
        self.deadline = _call_deadline.get()
        self._channel = channel
        self._response: Any = None
        self._error: errors.KVStoreError | None = None
        self._done = False

    def result(self) -> Any:
        if not self._done:
            self._channel._wait_for(self)
        if self._error is not None:
            raise self._error
        return self._response

    def _settle(self, response: Any, error: errors.KVStoreError | None) -> None:
        self._response, self._error, self._done = response, error, True
        if error is not None and self.posted:
            log.warning("%s failed after it was posted: %s", self.name, error)


class GrpcCall:
    """A gRPC call in flight; result() waits and raises the call's kvstore error."""

    __slots__ = ("_future",)

    def __init__(self, future: Any):
        self._future = future

    def result(self) -> Any:
        try:
            return self._future.result()
        except grpc.RpcError as exc:
            raise errors.error_from_rpc(exc) from None


class GrpcChannel:
    """kvstore.v1.KVStore over gRPC; method stubs are derived from the proto descriptor."""

    answers_in_order = False

    def __init__(self, target: str, timeout_s: float, credentials: Credentials | None = None):
        """`credentials`: None = from the KVSTORE_TOKEN / KVSTORE_TLS_* variables (credentials.py)."""
        self.timeout_s = timeout_s
        credentials = credentials if credentials is not None else Credentials.resolve()
        self._metadata = credentials.metadata
        # Its own subchannel pool: by default gRPC shares connections among channels to one target,
        # so a new channel (connection.py opens one per reconnect) would inherit the old one's
        # reconnect backoff, and fail at once for up to a second after the node is back.
        self._channel = credentials.channel(target, [("grpc.max_receive_message_length", 64 << 20),
                                                     ("grpc.use_local_subchannel_pool", 1)])
        self._posted: set[Any] = set()
        self._stubs = {
            name: self._channel.unary_unary(
                f"/kvstore.v1.KVStore/{name}",
                request_serializer=request_cls.SerializeToString,
                response_deserializer=response_cls.FromString,
            )
            for name, request_cls, response_cls in framing.METHODS.values()
        }

    def call(self, name: str, request: Any, timeout_s: float | None = None) -> Any:
        try:
            return self._stubs[name](request, timeout=timeout_s or seconds_left(self.timeout_s),
                                     metadata=self._metadata)
        except grpc.RpcError as exc:
            raise errors.error_from_rpc(exc) from None

    def submit(self, name: str, request: Any) -> GrpcCall:
        """Send the call now and return at once; result() waits. No order between submitted calls."""
        return GrpcCall(self._stubs[name].future(request, timeout=seconds_left(self.timeout_s),
                                                 metadata=self._metadata))

    def post(self, name: str, request: Any) -> None:
        future = self._stubs[name].future(request, timeout=self.timeout_s, metadata=self._metadata)
        self._posted.add(future)

        def done(f: Any) -> None:
            self._posted.discard(f)
            if f.exception():
                log.warning("%s failed after it was posted: %s", name, errors.error_from_rpc(f.exception()))
        future.add_done_callback(done)

    def alive(self) -> bool:
        """Always true: gRPC reconnects by itself, and a node it cannot reach fails the call (Unavailable)."""
        return True

    def close(self) -> None:
        # Posted calls (releases, aborts) finish first, or their leases would wait for their TTL.
        for future in list(self._posted):
            try:
                future.result()
            except grpc.RpcError:
                pass
        self._channel.close()


def peer_open(sock: socket.socket) -> bool:
    """Whether the other end of a stream socket is still open: one poll(2) with no wait, for
    POLLRDHUP (POLLHUP and POLLERR come unasked), so data waiting to be read does not count."""
    poller = select.poll()
    try:
        poller.register(sock, select.POLLRDHUP)
    except (OSError, ValueError):  # closed here
        return False
    return not poller.poll(0)


class OrderedChannel:
    """Requests framed on one stream socket, answered in order. Thread-safe. A kind of it says how a request
    is framed (_frame) and an answer read (_answer_frame); `what` names its socket in errors."""

    answers_in_order = True

    def __init__(self, sock: socket.socket, timeout_s: float, what: str, spin_s: float = 0.0):
        """spin_s: how long a wait for an answer polls the socket, without sleeping, before it sleeps in recv."""
        self.timeout_s = timeout_s
        self._sock = sock
        self._what = what
        self._spin_s = spin_s
        self._arrivals = select.poll()
        self._arrivals.register(sock, select.POLLIN)
        self._send_lock = threading.RLock()
        self._recv_lock = threading.Lock()
        self._inflight: collections.deque[tuple[Pending, type]] = collections.deque()
        self._broken: errors.KVStoreError | None = None

    def _frame(self, method_id: int, payload: bytes) -> bytes:
        raise NotImplementedError

    def _answer_frame(self) -> tuple[int, bytes]:
        """(error code, payload) of the next answer; FrameError when the stream cannot be read as answers."""
        raise NotImplementedError

    def call(self, name: str, request: Any, timeout_s: float | None = None) -> Any:
        with call_deadline(timeout_s):
            return self.submit(name, request).result()

    def submit(self, name: str, request: Any) -> Pending:
        method_id = framing.METHOD_IDS[name]
        return self.submit_frame(name, self._frame(method_id, request.SerializeToString()),
                                 framing.METHODS[method_id][2])

    def submit_frame(self, name: str, frame: bytes, answer_type: Any, fd: int = -1) -> Pending:
        """Send a framed request whose answer answer_type.FromString reads; `fd`: sent after the frame,
        with one byte (SCM_RIGHTS), where the frame says one follows."""
        pending = Pending(name, self)
        with self._send_lock:
            if self._broken is not None:
                raise self._broken
            # Queued before sending, so a reader on another thread matches answers in order.
            self._inflight.append((pending, answer_type))
            try:
                self._sock.sendall(frame)
                if fd >= 0:
                    self._sock.sendmsg([b"\0"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack("i", fd))])
            except OSError as exc:
                self._break(errors.Unavailable(f"{self._what} closed: {exc}"))
                raise self._broken from None
        return pending

    def post(self, name: str, request: Any) -> None:
        try:
            self.submit(name, request).posted = True
        except errors.KVStoreError as exc:
            # The channel is broken: the node ends a connection's leases when it closes, so
            # there is nothing left to release or abort.
            log.debug("%s not sent, the %s is broken: %s", name, self._what, exc)

    def alive(self) -> bool:
        """False once the channel broke or the node closed its end (a stopped node's socket reads as hung up).

        One poll(2) with no wait, for POLLRDHUP (POLLHUP and POLLERR come unasked): answers
        waiting to be read do not count, only the node's end having closed.
        """
        return self._broken is None and peer_open(self._sock)

    def flush(self) -> None:
        """Read the answers of everything sent so far (posted releases included)."""
        with self._send_lock:
            last = self._inflight[-1][0] if self._inflight else None
        if last is not None:
            try:
                self._wait_for(last)
            except errors.KVStoreError:
                pass

    def close(self) -> None:
        self.flush()
        self._sock.close()

    def _wait_for(self, target: Pending) -> None:
        """Read answers in order, settling each pending one, until `target` is settled."""
        with self._recv_lock:
            while not target._done:
                if self._broken is not None:
                    target._settle(None, self._broken)
                    return
                pending, response_cls = self._inflight[0]
                if self._spin_s:
                    self._spin_until_readable()
                if target.deadline is not None and not self._readable_before(target.deadline):
                    raise errors.DeadlineExceeded(f"{target.name}: no answer on the {self._what} within the "
                                                  "call's timeout_s")
                try:
                    code, payload = self._answer_frame()
                except errors.KVStoreError as exc:
                    self._break(exc)
                    continue
                except framing.FrameError as exc:   # tcp_framing's is one too
                    self._break(errors.Internal(f"the {self._what} sent an unreadable answer: {exc}"))
                    continue
                self._inflight.popleft()
                if code:
                    pending._settle(None, errors.error_from_code(code, payload.decode(errors="replace")))
                else:
                    pending._settle(response_cls.FromString(payload), None)

    def _break(self, error: errors.KVStoreError) -> None:
        """A frame may be half sent or read: nothing on this socket can be trusted any more."""
        with self._send_lock:
            self._broken = error
            self._sock.close()
            for pending, _ in self._inflight:
                pending._settle(None, error)
            self._inflight.clear()

    def _spin_until_readable(self) -> None:
        """Poll, without sleeping, until an answer starts to arrive or spin_s passes. A thread that sleeps
        in recv wakes up 30-100 us after its answer arrives (more where an idle core is a halted virtual
        CPU), and on the local channel that is more than the node takes to answer most calls. With this
        and the put's short last Commit (pipeline.py), bench/hot_path.py's 64 KiB puts moved 0.65-0.72 of
        memmove where they moved 0.53-0.56, and 4 KiB gets 577-754k pages/s where 471-550k (old and new
        code alternated in one hour)."""
        deadline = time.perf_counter() + self._spin_s
        while not self._arrivals.poll(0) and time.perf_counter() < deadline:
            os.sched_yield()   # a node on this same core runs first

    def _readable_before(self, deadline: float) -> bool:
        """Wait until an answer starts to arrive or `deadline` passes; a frame once started is read whole."""
        return bool(self._arrivals.poll(max(0, int((deadline - time.monotonic()) * 1000))))

    def _recv_exact(self, nbytes: int) -> bytes:
        buf = bytearray(nbytes)
        view = memoryview(buf)
        got = 0
        try:
            while got < nbytes:
                n = self._sock.recv_into(view[got:])
                if n == 0:
                    raise errors.Unavailable(f"the server closed the {self._what}")
                got += n
        except socket.timeout:
            raise errors.DeadlineExceeded(f"no answer on the {self._what} within the deadline") from None
        except OSError as exc:
            raise errors.Unavailable(f"{self._what} failed: {exc}") from None
        return bytes(buf)


class LocalChannel(OrderedChannel):
    """The same messages as frames on the server's Unix socket (see framing.py)."""

    def __init__(self, path: str, timeout_s: float, token: str = "", proof: tuple[bytes, bytes] | None = None,
                 spin_s: float = 0.0):
        """With `proof` (Hello's local_challenge and local_answer), the socket must first prove it is
        the node that answered Hello (framing.PROVE), else TransportUnavailable and nothing is sent;
        then a token is shown (framing.AUTHENTICATE). spin_s: see OrderedChannel."""
        self.path = path
        self.arena_of_one_tenant = False   # set by map_arena_fd
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)
        sock.settimeout(timeout_s)
        try:
            sock.connect(path)
        except OSError as exc:
            sock.close()
            raise errors.Unavailable(f"cannot connect to the shm socket {path}: {exc}") from None
        super().__init__(sock, timeout_s, "shm socket", spin_s)
        try:
            if proof is not None:
                self._prove(*proof)
            if token:
                self._authenticate(token)
        except BaseException:
            self._sock.close()
            raise

    def _frame(self, method_id: int, payload: bytes) -> bytes:
        return framing.encode(method_id, payload)

    def _answer_frame(self) -> tuple[int, bytes]:
        length, code = framing.decode_header(self._recv_exact(framing.HEADER.size))
        return code, bytes(self._recv_exact(length))

    def _prove(self, challenge: bytes, expected: bytes) -> None:
        self._sock.sendall(framing.encode(framing.PROVE, challenge))
        try:
            answer = self._answer_frame()
        except (errors.Unavailable, errors.DeadlineExceeded, framing.FrameError):
            answer = framing.NO_ANSWER
        framing.check_proof(self.path, answer, expected)

    def _authenticate(self, token: str) -> None:
        self._sock.sendall(framing.encode(framing.AUTHENTICATE, token.encode()))
        code, payload = self._answer_frame()
        if code:
            raise errors.error_from_code(code, payload.decode(errors="replace"))

    def map_arena_fd(self) -> int:
        """Ask for the arena; the server answers with its memfd (SCM_RIGHTS) or an error. Sets
        arena_of_one_tenant: the memfd holds only the caller's tenant's slabs, the rest are holes."""
        with self._send_lock, self._recv_lock:
            assert not self._inflight, "map the arena before any other request"
            self._sock.sendall(framing.encode(framing.MAP_ARENA, b""))
            fds = array.array("i")
            data, ancdata, _, _ = self._sock.recvmsg(framing.HEADER.size, socket.CMSG_SPACE(fds.itemsize))
            if len(data) < framing.HEADER.size:
                data += self._recv_exact(framing.HEADER.size - len(data))
            length, code = framing.decode_header(data)
            payload = self._recv_exact(length)
            for level, kind, cdata in ancdata:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    fds.frombytes(cdata[: len(cdata) - (len(cdata) % fds.itemsize)])
            if code:
                for fd in fds:
                    socket.close(fd)
                raise errors.error_from_code(code, payload.decode(errors="replace"))
            if len(fds) != 1:
                raise errors.Internal(f"expected one arena fd from the server, got {len(fds)}")
            self.arena_of_one_tenant = payload == framing.ARENA_OF_ONE_TENANT
            return fds[0]
