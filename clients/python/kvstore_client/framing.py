"""Frames of the local control channel: the same protobuf messages as gRPC, over a Unix socket.

Why a second carrier: a unary gRPC call from Python costs about 0.7 ms here, while moving a
batch of 128 pages of 64 KiB through shared memory takes about 1 ms. Two calls per batch
(reserve + commit, or acquire + release) would cap the same-host data plane near half of
memcpy. On the Unix socket that already hands out the arena fd, one request/response costs
tens of microseconds and requests can be pipelined (a release is sent without waiting).

Pure encoding, no I/O. Requests and responses are answered in order on one connection.

    request  = u32 payload_bytes | u8 method | payload (the request message)
    response = u32 payload_bytes | u8 error_code | payload (response message, or UTF-8
               error text when error_code != 0)
"""

from __future__ import annotations

import hmac
import struct
from typing import Any

from google.protobuf.message import DecodeError

from kvstore_client import errors
from kvstore_client.proto import pb

HEADER = struct.Struct("<IB")
FRAME_BYTES_MAX = 16 << 20

# Method 0 asks for the arena file descriptor (sent with SCM_RIGHTS beside the response).
MAP_ARENA = 0
# MAP_ARENA's answer when the fd is one tenant's memfd, holding only that tenant's slabs (its other
# ranges are holes); an empty answer: the fd holds the whole arena.
ARENA_OF_ONE_TENANT = b"one-tenant"
# A bearer token (UTF-8), the connection's first frame: the node checks it against the peer uid's
# tenant (required with auth.local_require_token) and refuses the connection once it is revoked.
AUTHENTICATE = 255
# The node's proof that it answered the client's Hello (kvstore/control/local_proof.py): the first frame
# carries HelloResponse.local_challenge, the answer must equal HelloResponse.local_answer.
PROVE = 254
# A page buffer the client shares with the node (shared_buffers.py): the frame carries nothing, and one byte sent
# right after it carries the buffer's memfd (SCM_RIGHTS); the answer is the u32 id the node gives it on this
# connection. UNSHARE_BUFFER's payload is that id; the node unmaps the buffer and answers nothing.
SHARE_BUFFER = 253
UNSHARE_BUFFER = 252
BUFFER_ID = struct.Struct("<I")
# Pages the node and the client copy at once between a shared buffer and a lease's slots (shared_buffers.py):
#     MOVE_HEADER | data token | count u32 lease indices | count u64 buffer offsets
# answered with count bytes (1: the node copied that page) and count u64 checksums (those of its pages).
MOVE_PAGES = 251
MOVE_HEADER = struct.Struct("<QIIIIB")   # lease_id, buffer_id, cursor, count, page_bytes, into_buffer
# What check_proof is given for a socket that closed, stayed silent or sent no frame: not the node either.
NO_ANSWER = (-1, b"")

_SERVICE = pb.DESCRIPTOR.services_by_name["KVStore"]
# method id -> (name, request class, response class); ids follow the order in the .proto.
METHODS: dict[int, tuple[str, type, type]] = {
    index + 1: (
        method.name,
        getattr(pb, method.input_type.name),
        getattr(pb, method.output_type.name),
    )
    for index, method in enumerate(_SERVICE.methods)
}
_LOCAL_FRAMES = {AUTHENTICATE, PROVE, SHARE_BUFFER, UNSHARE_BUFFER, MOVE_PAGES}
assert not _LOCAL_FRAMES & set(METHODS), "method ids reached the local frames' kinds"
METHOD_IDS: dict[str, int] = {name: method_id for method_id, (name, _, _) in METHODS.items()}


class FrameError(ValueError):
    """The byte stream cannot be read as frames; the connection must be closed."""


def encode(kind: int, payload: bytes) -> bytes:
    if len(payload) > FRAME_BYTES_MAX:
        raise FrameError(f"frame of {len(payload)} bytes exceeds {FRAME_BYTES_MAX}")
    return HEADER.pack(len(payload), kind) + payload


def decode_call(method_id: int, payload: bytes | bytearray | memoryview) -> tuple[str, Any]:
    """The method's name and the request a frame carries (here, or in a TCP CALL frame); MalformedRequest
    naming what is wrong when the id is no method's or the bytes are not its request message."""
    method = METHODS.get(method_id)
    if method is None:
        raise errors.MalformedRequest(f"unknown method id {method_id}: this node does not serve it (a client newer "
                                      "than the node? upgrade the node, or call it over gRPC)")
    name, request_cls, _ = method
    try:
        return name, request_cls.FromString(payload)
    except DecodeError as exc:
        raise errors.MalformedRequest(f"{name}: request is not a valid {request_cls.__name__}: {exc}") from None


def decode_header(header: bytes) -> tuple[int, int]:
    """(payload_bytes, kind) of a frame header; rejects lengths over the limit."""
    length, kind = HEADER.unpack(header)
    if length > FRAME_BYTES_MAX:
        raise FrameError(f"frame of {length} bytes exceeds {FRAME_BYTES_MAX}")
    return length, kind


def check_proof(path: str, answer: tuple[int, bytes], expected: bytes) -> None:
    """The socket at `path` answered PROVE with `answer` (code, payload): TransportUnavailable unless it is
    `expected`, Hello's local_answer, which only the node that answered that Hello can give. A refusal
    (the node turns away a uid, or is full) is raised as it came: nothing more is sent either way."""
    code, payload = answer
    if code > 0:
        raise errors.error_from_code(code, bytes(payload).decode(errors="replace"))
    if code or not expected or not hmac.compare_digest(payload, expected):
        raise errors.TransportUnavailable(
            f"the socket at {path} is not the node's: it did not answer the challenge that node's Hello gave "
            f"(another host's path, or someone else's socket); nothing was sent to it. From another host, "
            f"connect with transport='tcp'; on the node's host, check who owns {path}")


def encode_move(lease_id: int, token: bytes, buffer_id: int, cursor: int, page_bytes: int, into_buffer: bool,
                indices: Any, buffer_offsets: Any) -> bytes:
    """A MOVE_PAGES payload; `indices` and `buffer_offsets` are numpy arrays of uint32 and uint64."""
    head = MOVE_HEADER.pack(lease_id, buffer_id, cursor, len(indices), page_bytes, into_buffer)
    return b"".join((head, bytes([len(token)]), token, indices.tobytes(), buffer_offsets.tobytes()))


def decode_move(payload: bytes | bytearray | memoryview) -> tuple:
    """(lease_id, token, buffer_id, cursor, page_bytes, into_buffer, indices, buffer_offsets) of a MOVE_PAGES
    payload, the last two as memoryviews of uint32s and uint64s; MalformedRequest if its lengths disagree."""
    view = memoryview(payload)
    if len(view) < MOVE_HEADER.size + 1:
        raise errors.MalformedRequest(f"a MOVE_PAGES frame of {len(view)} bytes is shorter than its header")
    lease_id, buffer_id, cursor, count, page_bytes, into_buffer = MOVE_HEADER.unpack_from(view)
    token_end = MOVE_HEADER.size + 1 + view[MOVE_HEADER.size]
    if len(view) != token_end + 12 * count:
        raise errors.MalformedRequest(f"a MOVE_PAGES frame of {len(view)} bytes does not hold the token and the "
                                      f"{count} pages its header names")
    token = bytes(view[MOVE_HEADER.size + 1:token_end])
    indices = bytes(view[token_end:token_end + 4 * count])
    offsets = bytes(view[token_end + 4 * count:])
    return (lease_id, token, buffer_id, cursor, page_bytes, bool(into_buffer), memoryview(indices).cast("I"),
            memoryview(offsets).cast("Q"))
