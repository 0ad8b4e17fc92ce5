"""The TCP data plane for asyncio: tcp_transport.py's frames over asyncio streams, no thread per call.

The same wire as the blocking client (tcp_framing.py): a HELLO with the data ticket first
when the node handed one out, then PUT frames (header, then the page's segments) and GET
frames answered in order. One batch of frames at a time holds the connection (an
asyncio.Lock), so answers cannot interleave between tasks. Page bytes are copied out of a
GET's answer into the caller's segments as they arrive (asyncio streams have no
receive-into) and hashed after (unless the node vouched for them: tcp_framing.VOUCHED), and
written from the caller's buffers with no copy of their own.

A batch cut short (its task cancelled by a deadline, the node gone, an unreadable answer)
leaves the stream out of step: the path is then broken for good and reads as not alive,
so the client opens a new connection for its next call.
"""

from __future__ import annotations

import asyncio
import ctypes
import socket
import ssl

from kvstore_client import checksums, errors
from kvstore_client.buffers import Segment
from kvstore_client.data_path import Page
from kvstore_client.tcp_transport import SHAPE
from kvstore_client.tcp_framing import (RESPONSE, VOUCHED, FrameError, Op, check_answer, decode_response,
                                        encode_hello, encode_request)

GET_WINDOW_FRAMES = 256     # GET requests sent ahead of their answers, as tcp_transport.py


async def open_stream(endpoint: str, ticket: bytes = b"", tls: ssl.SSLContext | None = None
                      ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A connection to the TCP data plane (TCP_NODELAY; TLS where `tls` is given), its HELLO answered where the
    node handed out a ticket (Hello's data_ticket)."""
    host, _, port = endpoint.rpartition(":")
    try:
        reader, writer = await asyncio.open_connection(
            host, int(port), ssl=tls, server_hostname=host.strip("[]") if tls is not None else None)
    except (OSError, ValueError) as exc:
        raise errors.Unavailable(f"cannot connect to the TCP data plane at {endpoint}: {exc}") from None
    writer.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if ticket:
        try:
            writer.write(encode_hello(ticket))
            status, op, length, _ = decode_response(await reader.readexactly(RESPONSE.size))
            text = await reader.readexactly(length)
            if status:
                raise errors.error_from_code(status, text.decode(errors="replace"))
            check_answer(Op.HELLO, op, length, None)
        except (OSError, asyncio.IncompleteReadError, FrameError) as exc:
            writer.transport.abort()
            raise errors.Unavailable(f"the TCP data plane at {endpoint} did not answer its HELLO: {exc}") from None
        except BaseException:
            writer.transport.abort()
            raise
    return reader, writer


def _view(segment: Segment) -> memoryview:
    address, nbytes = segment
    return memoryview((ctypes.c_char * nbytes).from_address(address)).cast("B")


class AsyncTcpDataPath:
    name = "tcp"
    rdma_qp_num = 0
    shape = SHAPE   # the blocking path's: the same node on the other end

    def __init__(self, endpoint: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.endpoint = endpoint
        self._reader, self._writer = reader, writer
        self._lock = asyncio.Lock()
        self._broken: errors.KVStoreError | None = None

    @classmethod
    async def open(cls, endpoint: str, ticket: bytes = b"", tls: ssl.SSLContext | None = None) -> "AsyncTcpDataPath":
        """Connect (and show `ticket`, Hello's data_ticket, when the node handed one out); `tls`: the context of
        a node whose data plane speaks TLS (Credentials.tcp_tls)."""
        return cls(endpoint, *await open_stream(endpoint, ticket, tls))

    async def put(self, lease_id: int, token: bytes, pages: list[Page], page_bytes: int) -> None:
        """Write each page into its slot; raises the first refusal after every answer is read."""
        async with self._lock:
            self._check()
            await self._io(self._put(lease_id, token, pages, page_bytes))

    async def get(self, lease_id: int, token: bytes, pages: list[Page], page_bytes: int) -> list[int | None]:
        """Read each page of a read lease into the caller's segments; returns each page's xxh3 as it landed, or
        None where the node vouched for its bytes (tcp_framing.VOUCHED)."""
        vouched: list[bool] = []
        async with self._lock:
            self._check()
            await self._io(self._get(lease_id, token, pages, page_bytes, vouched))
        return [None if sure else checksums.of_page(segments) for sure, (_, _, segments) in zip(vouched, pages)]

    def alive(self) -> bool:
        return self._broken is None and not self._reader.at_eof()

    def close(self) -> None:
        self._writer.transport.abort()   # nothing is queued between calls; a cut-short call's views are dropped

    # -- internals --------------------------------------------------------------------

    async def _put(self, lease_id: int, token: bytes, pages: list[Page], page_bytes: int) -> None:
        for slot, _, segments in pages:
            self._writer.write(encode_request(Op.PUT, lease_id, token, slot, page_bytes))
            self._writer.writelines(_view(s) for s in segments)
            await self._writer.drain()   # bounded: at most one page queued beyond the transport's limit
        first_error = None
        for _ in pages:
            error, _ = await self._answer(Op.PUT, None)
            first_error = first_error or error
        if first_error is not None:
            raise first_error

    async def _get(self, lease_id: int, token: bytes, pages: list[Page], page_bytes: int, vouched: list[bool]) -> None:
        """Read the pages, noting for each whether the node vouched for it."""
        requests = [encode_request(Op.GET, lease_id, token, slot, page_bytes) for slot, _, _ in pages]
        sent = min(len(requests), GET_WINDOW_FRAMES)
        self._writer.write(b"".join(requests[:sent]))
        first_error = None
        for index, (_, _, segments) in enumerate(pages):
            if sent < len(requests) and sent - index <= GET_WINDOW_FRAMES // 2:
                more = min(len(requests), sent + GET_WINDOW_FRAMES // 2)
                self._writer.write(b"".join(requests[sent:more]))
                sent = more
            await self._writer.drain()
            error, sure = await self._answer(Op.GET, segments)
            vouched.append(sure)
            first_error = first_error or error
        if first_error is not None:
            raise first_error

    def _check(self) -> None:
        if self._broken is not None:
            raise self._broken

    async def _io(self, frames) -> None:
        """Await a batch of frames; any failure or cancellation leaves the stream out of step: broken for good.
        A refusal the node answered in step (an error frame) is raised and the path stays usable."""
        try:
            await frames
        except errors.KVStoreError:
            raise
        except FrameError as exc:
            self._break(errors.Internal(f"the TCP data plane sent an unreadable answer: {exc}"))
        except (OSError, asyncio.IncompleteReadError) as exc:
            self._break(errors.Unavailable(f"the TCP data plane at {self.endpoint} failed: {exc}"))
        except BaseException:   # cancelled (the call's timeout_s), mid-frame
            self._break(errors.Unavailable(f"a call was cut short on the TCP data plane at {self.endpoint}"))
            raise
        else:
            return
        raise self._broken

    def _break(self, error: errors.KVStoreError) -> None:
        if self._broken is None:
            self._broken = error
            # abort, not close: close would go on sending what is queued, views of buffers the caller
            # may free once the call has failed
            self._writer.transport.abort()

    async def _answer(self, op: Op, segments: list[Segment] | None) -> tuple[errors.KVStoreError | None, bool]:
        """Read one answer; a GET's page goes into `segments`. Returns (the refusal if any, whether the node
        vouched for the page)."""
        status, answered_op, length, flags = decode_response(await self._reader.readexactly(RESPONSE.size))
        if status:
            text = await self._reader.readexactly(length)
            return errors.error_from_code(status, text.decode(errors="replace")), False
        check_answer(op, answered_op, length, None if segments is None else sum(n for _, n in segments))
        for segment in segments or ():
            view, got = _view(segment), 0
            while got < len(view):   # StreamReader.read hands back what is buffered, up to the limit asked
                chunk = await self._reader.read(len(view) - got)
                if not chunk:
                    raise asyncio.IncompleteReadError(b"", len(view) - got)
                view[got:got + len(chunk)] = chunk
                got += len(chunk)
        return None, bool(flags & VOUCHED)
