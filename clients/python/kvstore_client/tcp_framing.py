"""Frames of the TCP data plane, and the server's reader of them: pure, no I/O.

A client moves page bytes between its buffers and leased arena slots. The control plane
(Reserve/Acquire) hands out (lease_id, data_token, slot); a frame names them:

    request  = u8 op | u8 version | u16 0 | u32 length | u64 lease_id | 16s token | u32 slot | u32 0
               followed, for PUT, by `length` page bytes
    response = u8 status | u8 op | u16 flags | u32 length
               followed by `length` page bytes (GET answered 0), or by a UTF-8 error text
               (status = an ErrorCode), or by nothing (PUT answered 0)

A CALL frame carries a control call instead (where Hello says tcp_calls): `slot` is the method's id
(framing.METHOD_IDS, the local channel's), lease_id and token are 0, and its `length` bytes are the
kvstore.v1 request; the answer's bytes are the response message (or an error text). A connection
carries either pages or calls, never both: a client keeps one of each, and the calls of one are
answered in order, so they pipeline (pipeline.py) as on the local channel, without gRPC's cost.

A GET answer flagged VOUCHED carries a page of memory no other process has been able to write
since its commit (kvstore/control/store_exposure.py): the node vouches that its bytes are those
committed, and the reader need not hash them. A reader that ignores the flag hashes as before.

On a node with authentication, a connection's first frame is a HELLO whose body is the
data ticket of a gRPC Hello (the caller's identity, sealed by the node); no other frame is
served before it, and each frame's lease must then be of that identity's tenant, so a data
token replayed on another tenant's connection is refused as an unknown lease.

`slot` is the lease-wide key index for a write lease (as in Commit) and the position in
the AcquireResponse for a read lease. Requests on one connection are answered in order,
so a client pipelines them. A frame in error is answered and the connection goes on (a
PUT's body is skipped); only an unreadable stream (bad version or op, a length over the
limit) closes it.

RequestReader is the server's state machine: `buffer()` says where the next received bytes
go (frame headers, a slot of the arena, or a bounded scratch area for a skipped body) and
`received(n)` says what they completed. The I/O layer receives into that buffer (a body
through a landing, landing.py, which copies each read into it and hashes it). Headers are
read FRAMES_BYTES at a time, so a client's batch of GET requests costs the node a few reads,
not a read and a pass of its Python per 40-byte header: after each event the I/O layer takes
the next frame read ahead (`next_frame()`), and moves the bytes of a body read ahead with its
header where they go as if they had just been read (`move_read_ahead`), hashed like the rest.
After a PUT the next header is read alone: puts come in runs, and a page's first bytes moved
from there cost a pass of Python and a short read more than bytes read into place.
"""

from __future__ import annotations

import enum
import struct
from typing import NamedTuple

from kvstore_client import framing

REQUEST = struct.Struct("<BBHIQ16sII")
RESPONSE = struct.Struct("<BBHI")
VERSION = 1
TOKEN_BYTES = 16
TICKET_BYTES_MAX = 512          # a HELLO's body
ERROR_TEXT_BYTES_MAX = 1024
SKIP_CHUNK_BYTES = 64 << 10     # scratch that a skipped PUT body is read through, piece by piece
FRAMES_BYTES = 64 * REQUEST.size   # frame headers are read up to this many bytes at a time
CALL_BYTES_MAX = framing.FRAME_BYTES_MAX   # a CALL's request or answer, as on the local channel


class Op(enum.IntEnum):
    PUT = 1   # client -> slot of a write lease
    GET = 2   # slot of a read lease -> client
    HELLO = 3  # client -> node: the data ticket, the connection's first frame (answered 0 or an error)
    CALL = 4   # client -> node: a control call (slot = method id), answered with its response message


VOUCHED = 1     # response flag: see the module doc
_OPS = {int(op): op for op in Op}   # a dict lookup: Op(n) costs a microsecond per frame


class FrameError(framing.FrameError):
    """The stream cannot be read as frames; the connection must be closed."""


class Response(NamedTuple):
    status: int
    op: int
    length: int
    flags: int


class Request(NamedTuple):
    op: Op
    length: int
    lease_id: int
    token: bytes
    slot: int


def encode_request(op: Op, lease_id: int, token: bytes, slot: int, length: int) -> bytes:
    if len(token) != TOKEN_BYTES:
        raise ValueError(f"a data token has {TOKEN_BYTES} bytes, got {len(token)}")
    return REQUEST.pack(op, VERSION, 0, length, lease_id, token, slot, 0)


def encode_call(method_id: int, payload: bytes) -> bytes:
    if len(payload) > CALL_BYTES_MAX:
        raise ValueError(f"a call of {len(payload)} bytes exceeds {CALL_BYTES_MAX}")
    return REQUEST.pack(Op.CALL, VERSION, 0, len(payload), 0, bytes(TOKEN_BYTES), method_id, 0) + payload


def encode_hello(ticket: bytes) -> bytes:
    if len(ticket) > TICKET_BYTES_MAX:
        raise ValueError(f"a data ticket has at most {TICKET_BYTES_MAX} bytes, got {len(ticket)}")
    return REQUEST.pack(Op.HELLO, VERSION, 0, len(ticket), 0, bytes(TOKEN_BYTES), 0, 0) + ticket


def decode_request(header: bytes | bytearray | memoryview, body_bytes_max: int) -> Request:
    op_code, version, _, length, lease_id, token, slot, _ = REQUEST.unpack(header)
    if version != VERSION:
        raise FrameError(f"data-plane frame version {version}; this server speaks {VERSION}")
    op = _OPS.get(op_code)
    if op is None:
        raise FrameError(f"unknown data-plane op {op_code}")
    if op == Op.HELLO and length > TICKET_BYTES_MAX:
        raise FrameError(f"a HELLO of {length} bytes exceeds {TICKET_BYTES_MAX}")
    if op == Op.CALL:
        if length > CALL_BYTES_MAX:
            raise FrameError(f"a call of {length} bytes exceeds {CALL_BYTES_MAX}")
    elif length > body_bytes_max:
        raise FrameError(f"a frame of {length} bytes exceeds the largest page ({body_bytes_max})")
    return Request(op, length, lease_id, token, slot)


def encode_response(status: int, op: int, length: int, flags: int = 0) -> bytes:
    return RESPONSE.pack(status, op, flags, length)


def encode_error(op: int, code: int, text: str) -> bytes:
    raw = text.encode()[:ERROR_TEXT_BYTES_MAX]
    return RESPONSE.pack(code, op, 0, len(raw)) + raw


def decode_response(header: bytes | bytearray | memoryview) -> Response:
    status, op, flags, length = RESPONSE.unpack(header)
    if op not in _OPS and not status:  # op 0: the error that closes an unreadable stream
        raise FrameError(f"response for unknown op {op}")
    return Response(status, op, length, flags)


def decode_call_answer(header: bytes | bytearray | memoryview) -> tuple[int, int]:
    """(status, length) of an answer on a connection of calls; FrameError unless it answers a CALL (or is an
    error) and fits CALL_BYTES_MAX."""
    status, op, length, _ = decode_response(header)
    if length > CALL_BYTES_MAX:
        raise FrameError(f"an answer of {length} bytes exceeds {CALL_BYTES_MAX}")
    if op != Op.CALL and not status:
        raise FrameError(f"answer for op {op} on a connection of calls")
    return status, length


def check_answer(op: Op, answered_op: int, length: int, page_bytes: int | None) -> None:
    """Raise FrameError unless an accepted answer to `op` carries `page_bytes` (None: no body)."""
    if answered_op != op:
        raise FrameError(f"answer for op {answered_op} where op {int(op)} was asked")
    if page_bytes is None:
        if length:
            raise FrameError(f"a {op.name} answer with {length} bytes")
    elif length != page_bytes:
        raise FrameError(f"a page of {length} bytes for a buffer of {page_bytes}")


class Event(enum.Enum):
    BODY_DONE = 1       # the accepted PUT (or CALL) body is all in place
    BODY_SKIPPED = 2    # the refused PUT (or CALL) body was read and dropped


class Hello(NamedTuple):
    ticket: bytes       # a HELLO's whole body


class RequestReader:
    """The server side of one connection's request stream (see the module doc)."""

    _HEADER, _BODY, _SKIP = range(3)

    def __init__(self, body_bytes_max: int, scratch: memoryview):
        assert len(scratch) > 0
        self._body_bytes_max = body_bytes_max
        self._frames = memoryview(bytearray(FRAMES_BYTES))
        self._start = self._end = 0         # bytes read ahead and not yet taken: _frames[_start:_end]
        self._read_bytes = FRAMES_BYTES     # how far a header read may go from _start (one header after a PUT)
        self._scratch = scratch
        self._state = self._HEADER
        self._filled = 0
        self._target: memoryview | None = None
        self._remaining = 0
        self._hello = False                 # the body being read is a HELLO's, into _target

    @property
    def mid_body(self) -> bool:
        """Part of an accepted body (a PUT's, a CALL's, a HELLO's) has been received, but not all of it."""
        return self._state == self._BODY

    def buffer(self) -> memoryview:
        if self._state == self._HEADER:
            if self._start == self._end:
                self._start = self._end = 0
            elif FRAMES_BYTES - self._end < REQUEST.size:   # a header cut short: moved to the front
                kept = self._end - self._start
                self._frames[:kept] = self._frames[self._start:self._end]
                self._start, self._end = 0, kept
            return self._frames[self._end:max(self._start + self._read_bytes, self._end + 1)]
        if self._state == self._BODY:
            return self._target[self._filled:]
        return self._scratch[:min(self._remaining, len(self._scratch))]

    def received(self, nbytes: int) -> Request | Event | Hello | None:
        """Account for nbytes written into buffer(); returns what they completed, if anything.

        After a PUT or CALL Request with a body, call accept_body(view) or skip_body() before buffer() again.
        After each event (and after None), take what was read ahead: move_read_ahead while read_ahead(),
        else next_frame().
        """
        if self._state == self._HEADER:
            self._end += nbytes
            return self.next_frame()
        if self._state == self._BODY:
            self._filled += nbytes
            if self._filled < len(self._target):
                return None
            # Only a HELLO's few bytes are copied out; a page stays where it landed, in its slot.
            done = Hello(bytes(self._target)) if self._hello else Event.BODY_DONE
            self._reset()
            return done
        self._remaining -= nbytes
        if self._remaining:
            return None
        self._reset()
        return Event.BODY_SKIPPED

    def next_frame(self) -> Request | Hello | None:
        """The next request whose header was read ahead, or None (a HELLO's body follows: see read_ahead)."""
        if self._state != self._HEADER or self._end - self._start < REQUEST.size:
            return None
        header = self._frames[self._start:self._start + REQUEST.size]
        self._start += REQUEST.size
        request = decode_request(header, self._body_bytes_max)
        self._read_bytes = REQUEST.size if request.op == Op.PUT else FRAMES_BYTES
        if request.op == Op.HELLO:
            if not request.length:
                return Hello(b"")
            self._state, self._target, self._hello = self._BODY, memoryview(bytearray(request.length)), True
            return None
        if request.op in (Op.PUT, Op.CALL) and request.length:
            self._state = self._SKIP  # until accept_body says where the bytes go
            self._remaining = request.length
        return request

    def read_ahead(self) -> bool:
        """Bytes of the body being received were read ahead with its header: move them (move_read_ahead)."""
        return self._state != self._HEADER and self._end > self._start

    def move_read_ahead(self, target: memoryview) -> int:
        """Copy bytes read ahead into `target` (buffer(), or where a landing reads it into), as a read would;
        returns how many, for received()."""
        n = min(len(target), self._end - self._start)
        target[:n] = self._frames[self._start:self._start + n]
        self._start += n
        return n

    def accept_body(self, view: memoryview) -> None:
        """Receive the pending PUT or CALL body straight into `view` (its length is the frame's)."""
        assert self._state == self._SKIP and len(view) == self._remaining, "accept_body follows a PUT or CALL header"
        self._state, self._target, self._filled = self._BODY, view, 0

    def skip_body(self) -> None:
        assert self._state == self._SKIP, "skip_body follows a PUT or CALL header"

    def _reset(self) -> None:
        self._state, self._target, self._filled, self._remaining, self._hello = self._HEADER, None, 0, 0, False
