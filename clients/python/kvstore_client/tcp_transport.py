"""The client side of the TCP data plane: one blocking socket, pipelined frames.

Pages go out with sendmsg straight from the caller's buffers (a frame header and the
page's segments in one scatter-gather list, many pages per call) and come back through a
landing (landing.py: read into a buffer in cache, copied into them and hashed in one
pass). Requests are answered in order, so a batch is sent ahead and its answers read
after (GET headers within a bounded window, so neither side can block the other). Wire
format: tcp_framing.py. A node with tcp.tls_cert speaks TLS (Hello's tcp_tls): the
socket is wrapped before the HELLO, its certificate checked against the client's tls_ca,
and pages go out piece by piece (an SSL socket has no sendmsg).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import socket
import ssl
import struct
import threading
import time
from typing import Any, Iterator

from kvstore_client import errors
from kvstore_client.buffers import Segment
from kvstore_client.channel import call_deadline_at, peer_open
from kvstore_client.data_path import Page, PipelineShape
from kvstore_client.landing import new_landing
from kvstore_client.tcp_framing import (RESPONSE, VOUCHED, FrameError, Op, check_answer, decode_response,
                                        encode_hello, encode_request)

IOV_MAX = 1024              # entries in one sendmsg (Linux UIO_MAXIOV)
GET_WINDOW_FRAMES = 256     # GET requests sent ahead of their answers
# The node hashes each page as its bytes land (kvstore/transport/tcp.py), so a Commit reads
# nothing back and there is no checksumming to overlap: one run per Reserve group, and the wire
# never idles between runs. Groups stay large so the next Reserve hides behind the transfer.
SHAPE = PipelineShape(reserve_group_pages_min=1, reserve_group_bytes=64 << 20, commit_run_bytes=64 << 20)


def _view(segment: Segment) -> memoryview:
    address, nbytes = segment
    return memoryview((ctypes.c_char * nbytes).from_address(address)).cast("B")


def sendmsg_all(sock: socket.socket, iov: list) -> None:
    """Send every piece of a scatter-gather list, IOV_MAX pieces per sendmsg, resuming a piece cut part-way."""
    if isinstance(sock, ssl.SSLSocket):
        for piece in iov:
            sock.sendall(piece)
        return
    start = 0
    while start < len(iov):
        chunk = iov[start:start + IOV_MAX]
        sent = sock.sendmsg(chunk)
        for piece in chunk:
            if sent < len(piece):
                if sent:
                    iov[start] = memoryview(piece)[sent:]
                break
            sent -= len(piece)
            start += 1


def connect(endpoint: str, timeout_s: float, congestion: str = "", tls: ssl.SSLContext | None = None) -> socket.socket:
    """A connection to the TCP data plane at host:port, without delay (TCP_NODELAY), with the congestion control
    asked for ("" = the system's), and speaking TLS where `tls` is given (the node's tcp.tls_cert checked)."""
    host, _, port = endpoint.rpartition(":")
    try:
        sock = socket.create_connection((host, int(port)), timeout=timeout_s)
    except (OSError, ValueError) as exc:
        raise errors.Unavailable(f"cannot connect to the TCP data plane at {endpoint}: {exc}") from None
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if congestion:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, congestion.encode())
    if tls is not None:
        try:
            return tls.wrap_socket(sock, server_hostname=host.strip("[]"))
        except (OSError, ValueError) as exc:   # ssl.SSLError is an OSError
            sock.close()
            raise errors.Unavailable(
                f"TLS with the TCP data plane at {endpoint} failed: {exc} (tls_ca must be the CA that signed "
                "the node's tcp.tls_cert)") from None
    return sock


class TcpDataPath:
    name = "tcp"
    rdma_qp_num = 0
    shape = SHAPE

    def __init__(self, endpoint: str, timeout_s: float, congestion: str = "", ticket: bytes = b"",
                 tls: ssl.SSLContext | None = None):
        """`ticket`: Hello's data_ticket; when the node handed one out, it opens the connection (its HELLO).
        `tls`: the context of a node whose data plane speaks TLS (Credentials.tcp_tls)."""
        sock = self._sock = connect(endpoint, timeout_s, congestion, tls)
        self.endpoint = endpoint
        # Blocking calls bounded by kernel timeouts: no poll() before every recv, as settimeout() adds.
        sock.settimeout(None)
        self._timeout_s = timeout_s
        self._step_timeout_s = 0.0           # what SO_RCVTIMEO/SO_SNDTIMEO hold now
        self._deadline: float | None = None  # the running batch's call deadline (channel.call_deadline)
        self._set_step_timeout(timeout_s)
        self._header = bytearray(RESPONSE.size)
        self._landing = new_landing()   # where GET answers land and are hashed (landing.py)
        self._tls = isinstance(self._sock, ssl.SSLSocket)   # its bytes come through OpenSSL, not recv(2)
        self._broken: errors.KVStoreError | None = None
        self._lock = threading.Lock()   # one batch of frames at a time: answers come back in order
        if ticket:
            self._hello(ticket)

    def put(self, lease_id: int, token: bytes, pages: list[Page], page_bytes: int) -> None:
        """Write each page into its slot; raises the first refusal after every answer is read."""
        with self._lock, self._bounded_by_call():
            self._put(lease_id, token, pages, page_bytes)

    def get(self, lease_id: int, token: bytes, pages: list[Page], page_bytes: int) -> list[int]:
        """Read each page of a read lease into the caller's segments; returns each page's xxh3 as it landed."""
        with self._lock, self._bounded_by_call():
            return self._get(lease_id, token, pages, page_bytes)

    def alive(self) -> bool:
        """False once the path broke or the node closed the connection (it stopped, or the
        connection sat idle past tcp.idle_timeout_s). One poll(2) with no wait, for POLLRDHUP
        (POLLHUP and POLLERR come unasked), so answers on their way do not count."""
        return self._broken is None and peer_open(self._sock)

    def close(self) -> None:
        self._sock.close()

    # -- internals --------------------------------------------------------------------

    @contextlib.contextmanager
    def _bounded_by_call(self) -> Iterator[None]:
        """Inside a call with its own timeout_s, no socket step outlives the call's deadline: each step's
        kernel timeout is what is left of it (re-armed as steps go by), the client's timeout_s otherwise."""
        self._deadline = call_deadline_at()
        try:
            yield
        finally:
            self._deadline = None
            if self._step_timeout_s != self._timeout_s and self._broken is None:
                self._set_step_timeout(self._timeout_s)

    def _arm(self) -> None:
        """Bound the next socket step by what is left of the call's deadline (never beyond timeout_s)."""
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(errno.EAGAIN, "the call's timeout_s ran out")
        step = min(self._timeout_s, left)
        if abs(step - self._step_timeout_s) > 0.01:
            self._set_step_timeout(step)

    def _set_step_timeout(self, seconds: float) -> None:
        seconds = max(seconds, 1e-3)   # a zero timeval would mean no timeout at all
        timeval = struct.pack("ll", int(seconds), int(seconds % 1 * 1e6))
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval)
        self._step_timeout_s = seconds

    def _put(self, lease_id: int, token: bytes, pages: list[Page], page_bytes: int) -> None:
        self._check()
        iov: list = []
        for slot, _, segments in pages:
            iov.append(encode_request(Op.PUT, lease_id, token, slot, page_bytes))
            iov.extend(_view(s) for s in segments)
        self._io(lambda: sendmsg_all(self._sock, iov))
        first_error = None
        for _ in pages:
            error, _ = self._io(lambda: self._answer(Op.PUT, None))
            first_error = first_error or error
        if first_error is not None:
            raise first_error

    def _get(self, lease_id: int, token: bytes, pages: list[Page], page_bytes: int) -> list[int | None]:
        """The pages read, and each one's xxh3, taken as each piece lands (landing.py: hashing a 1-4 MiB page
        after its last byte read it back from memory, and hashing the whole batch afterwards held 1 MiB gets to
        0.8 of a raw socket's pace); None for a page the node vouched for, landed unhashed."""
        self._check()
        landed = []
        requests = [encode_request(Op.GET, lease_id, token, slot, page_bytes) for slot, _, _ in pages]
        sent = min(len(requests), GET_WINDOW_FRAMES)
        self._io(lambda: self._sock.sendall(b"".join(requests[:sent])))
        first_error = None
        for index, (_, _, segments) in enumerate(pages):
            if sent < len(requests) and sent - index <= GET_WINDOW_FRAMES // 2:
                more = min(len(requests), sent + GET_WINDOW_FRAMES // 2)
                self._io(lambda: self._sock.sendall(b"".join(requests[sent:more])))
                sent = more
            error, vouched = self._io(lambda: self._answer(Op.GET, segments, self._landing))
            first_error = first_error or error
            landed.append(0 if error else None if vouched else self._landing.intdigest())
        if first_error is not None:
            raise first_error
        return landed

    def _hello(self, ticket: bytes) -> None:
        self._io(lambda: self._sock.sendall(encode_hello(ticket)))
        refusal, _ = self._io(lambda: self._answer(Op.HELLO, None))
        if refusal is not None:
            self._sock.close()
            raise refusal

    def _check(self) -> None:
        if self._broken is not None:
            raise self._broken

    def _io(self, action):
        """Run socket I/O; any failure leaves the stream out of step, so the path is broken for good."""
        try:
            if self._deadline is not None:
                self._arm()
            return action()
        except FrameError as exc:
            self._break(errors.Internal(f"the TCP data plane sent an unreadable answer: {exc}"))
        except OSError as exc:
            # a kernel timeout under TLS surfaces as OpenSSL's want-read/want-write, not EAGAIN
            if exc.errno in (errno.EAGAIN, errno.EWOULDBLOCK) or isinstance(exc, (ssl.SSLWantReadError,
                                                                                  ssl.SSLWantWriteError)):
                self._break(errors.DeadlineExceeded(
                    "no progress on the TCP data plane within the deadline" if self._deadline is None else
                    "the TCP data plane did not move the pages within the call's timeout_s"))
            else:
                self._break(errors.Unavailable(f"the TCP data plane at {self.endpoint} failed: {exc}"))
        raise self._broken

    def _break(self, error: errors.KVStoreError) -> None:
        if self._broken is None:
            self._broken = error
            self._sock.close()

    def _answer(self, op: Op, segments: list[Segment] | None,
                landing: Any = None) -> tuple[errors.KVStoreError | None, bool]:
        """Read one answer; a GET's page goes into `segments` through `landing`, which hashes it unless the node
        vouched for its bytes. Returns (the refusal if any, whether the page was vouched for)."""
        self._recv_into(memoryview(self._header))
        status, answered_op, length, flags = decode_response(self._header)
        if status:
            text = bytearray(length)
            self._recv_into(memoryview(text))
            return errors.error_from_code(status, text.decode(errors="replace")), False
        check_answer(op, answered_op, length, None if segments is None else sum(n for _, n in segments))
        vouched = bool(flags & VOUCHED)
        if landing is not None:
            landing.reset(hashed=not vouched)
        for segment in segments or ():
            self._recv_into(_view(segment), landing)
        return None, vouched

    def _recv_into(self, view: memoryview, landing: Any = None) -> None:
        """Fill `view` from the socket; with a landing, each read goes where it says and is hashed by it (the
        whole loop in the landing's native code where it has one and the socket is plain TCP)."""
        if landing is not None and landing.receives and not self._tls:
            landing.receive(self._sock.fileno(), view, self._deadline)
            return
        got, total, recv_into, deadline = 0, len(view), self._sock.recv_into, self._deadline
        while got < total:
            if deadline is not None and time.monotonic() > deadline:   # a trickle must not outlive the call
                raise TimeoutError(errno.EAGAIN, "the call's timeout_s ran out")
            rest = view[got:]
            n = recv_into(rest if landing is None else landing.place(rest))
            if n == 0:
                raise ConnectionResetError("the server closed the TCP data plane connection")
            if landing is not None:
                landing.landed(rest, n)
            got += n
