"""Control channels for asyncio (AsyncKVStoreClient): the sync channels' twins (channel.py, tcp_control.py).

An AsyncOrderedChannel frames kvstore.v1 requests on one asyncio stream and matches answers in
order: the node's Unix socket (AsyncLocalChannel) on its host, or a call connection of its TCP data
plane (AsyncTcpControlChannel) beside TCP pages. AsyncGrpcChannel carries the same messages over
grpc.aio. A request whose caller gives up (timeout_s) stays queued; its answer is read and dropped
when it comes, so the channel stays in step.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import ssl
from typing import Any

import grpc
import grpc.aio

from kvstore_client import errors, framing
from kvstore_client.async_tcp_transport import open_stream
from kvstore_client.credentials import Credentials
from kvstore_client.tcp_framing import RESPONSE, decode_call_answer, encode_call

log = logging.getLogger(__name__)


class AsyncOrderedChannel:
    """kvstore.v1 requests framed on one asyncio stream, answers matched in order (channel.OrderedChannel's
    asyncio twin). A kind of it says how a request is framed (_frame) and an answer read (_answer_frame);
    `what` names its socket in errors."""

    answers_in_order = True

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, what: str):
        self._reader, self._writer, self._what = reader, writer, what
        self._inflight: collections.deque[tuple[asyncio.Future, type]] = collections.deque()
        self._broken: errors.KVStoreError | None = None
        self._reading = asyncio.ensure_future(self._read_answers())

    def _frame(self, method_id: int, payload: bytes) -> bytes:
        raise NotImplementedError

    async def _answer_frame(self) -> tuple[int, bytes]:
        """(error code, payload) of the next answer; FrameError when the stream cannot be read as answers."""
        raise NotImplementedError

    async def call(self, name: str, request: Any, timeout_s: float) -> Any:
        return await self._within(name, self._submit(name, request), timeout_s)

    def submit(self, name: str, request: Any, timeout_s: float) -> asyncio.Future:
        """Send now (frames leave in the order submitted); the answer is a future, settled within timeout_s."""
        return asyncio.ensure_future(self._within(name, self._submit(name, request), timeout_s))

    async def _within(self, name: str, answer: asyncio.Future, timeout_s: float) -> Any:
        try:
            async with asyncio.timeout(timeout_s):
                return await answer
        except TimeoutError:   # the answer, when it comes, is read and dropped: the channel stays in step
            raise errors.DeadlineExceeded(f"{name}: no answer on the {self._what} within timeout_s") from None

    def post(self, name: str, request: Any) -> None:
        """Send without waiting; an error in the answer is logged."""
        if self._broken is not None:
            return   # the node ends the connection's leases itself
        answer = self._submit(name, request)
        answer.add_done_callback(lambda f: f.cancelled() or f.exception() is None or
                                 log.warning("%s failed after it was posted: %s", name, f.exception()))

    def alive(self) -> bool:
        return self._broken is None and not self._reader.at_eof()

    async def close(self, timeout_s: float = 5.0) -> None:
        """Read the answers of everything sent (posted releases included), then close."""
        pending = [answer for answer, _ in self._inflight]
        if pending and self._broken is None:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout_s):
                    await asyncio.gather(*pending, return_exceptions=True)
        self._writer.close()
        with contextlib.suppress(OSError):
            await self._writer.wait_closed()
        self._reading.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._reading

    def _submit(self, name: str, request: Any) -> asyncio.Future:
        if self._broken is not None:
            raise self._broken
        method_id = framing.METHOD_IDS[name]
        answer = asyncio.get_running_loop().create_future()
        self._inflight.append((answer, framing.METHODS[method_id][2]))
        self._writer.write(self._frame(method_id, request.SerializeToString()))
        return answer

    async def _read_answers(self) -> None:
        try:
            while True:
                code, payload = await self._answer_frame()
                answer, response_cls = self._inflight.popleft()
                if answer.done():      # its caller gave up (timeout_s)
                    continue
                if code:
                    answer.set_exception(errors.error_from_code(code, payload.decode(errors="replace")))
                else:
                    answer.set_result(response_cls.FromString(payload))
        except (asyncio.IncompleteReadError, OSError, framing.FrameError) as exc:
            self._broken = errors.Unavailable(f"the {self._what} closed: {exc}")
            for answer, _ in self._inflight:
                if not answer.done():
                    answer.set_exception(self._broken)
            self._inflight.clear()


class AsyncLocalChannel(AsyncOrderedChannel):
    """kvstore.v1 frames on the node's Unix socket (framing.py)."""

    @classmethod
    async def open(cls, path: str, token: str = "", proof: tuple[bytes, bytes] | None = None) -> "AsyncLocalChannel":
        """As LocalChannel: the socket proves it is Hello's node (framing.PROVE), then a token is shown."""
        try:
            reader, writer = await asyncio.open_unix_connection(path)
        except OSError as exc:
            raise errors.Unavailable(f"cannot connect to the shm socket {path}: {exc}") from None
        try:
            if proof is not None:
                writer.write(framing.encode(framing.PROVE, proof[0]))
                try:
                    length, code = framing.decode_header(await reader.readexactly(framing.HEADER.size))
                    answer = (code, await reader.readexactly(length))
                except (asyncio.IncompleteReadError, framing.FrameError, OSError):
                    answer = framing.NO_ANSWER
                framing.check_proof(path, answer, proof[1])
            if token:
                writer.write(framing.encode(framing.AUTHENTICATE, token.encode()))
                length, code = framing.decode_header(await reader.readexactly(framing.HEADER.size))
                payload = await reader.readexactly(length)
                if code:
                    raise errors.error_from_code(code, payload.decode(errors="replace"))
        except asyncio.IncompleteReadError:
            writer.close()
            raise errors.Unavailable(f"the node closed the shm socket {path} before answering its token") from None
        except BaseException:
            writer.close()
            raise
        return cls(reader, writer, "shm socket")

    def _frame(self, method_id: int, payload: bytes) -> bytes:
        return framing.encode(method_id, payload)

    async def _answer_frame(self) -> tuple[int, bytes]:
        length, code = framing.decode_header(await self._reader.readexactly(framing.HEADER.size))
        return code, await self._reader.readexactly(length)


class AsyncTcpControlChannel(AsyncOrderedChannel):
    """Calls on a connection of their own to the node's TCP data plane (tcp_control.py's twin)."""

    @classmethod
    async def open(cls, endpoint: str, ticket: bytes = b"", tls: ssl.SSLContext | None = None) -> "AsyncTcpControlChannel":
        reader, writer = await open_stream(endpoint, ticket, tls)
        return cls(reader, writer, f"TCP call connection to {endpoint}")

    def _frame(self, method_id: int, payload: bytes) -> bytes:
        return encode_call(method_id, payload)

    async def _answer_frame(self) -> tuple[int, bytes]:
        status, length = decode_call_answer(await self._reader.readexactly(RESPONSE.size))
        return status, await self._reader.readexactly(length)


class AsyncGrpcChannel:
    """kvstore.v1 over grpc.aio; errors mapped by errors.error_from_rpc, as in the sync client."""

    answers_in_order = False

    def __init__(self, target: str, credentials: Credentials):
        self._metadata = credentials.metadata
        self._channel = credentials.aio_channel(target, [("grpc.max_receive_message_length", 64 << 20),
                                                         ("grpc.use_local_subchannel_pool", 1)])
        self._stubs = {name: self._channel.unary_unary(f"/kvstore.v1.KVStore/{name}",
                                                       request_serializer=request_cls.SerializeToString,
                                                       response_deserializer=response_cls.FromString)
                       for name, request_cls, response_cls in framing.METHODS.values()}
        self._posted: set[asyncio.Task] = set()

    async def call(self, name: str, request: Any, timeout_s: float) -> Any:
        try:
            return await self._stubs[name](request, timeout=timeout_s, metadata=self._metadata)
        except grpc.RpcError as exc:
            raise errors.error_from_rpc(exc) from None

    def submit(self, name: str, request: Any, timeout_s: float) -> asyncio.Future:
        return asyncio.ensure_future(self.call(name, request, timeout_s))

    def post(self, name: str, request: Any, timeout_s: float = 5.0) -> None:
        task = asyncio.ensure_future(self.call(name, request, timeout_s))
        self._posted.add(task)
        task.add_done_callback(lambda t: self._posted.discard(t) or t.cancelled() or t.exception() is None or
                               log.warning("%s failed after it was posted: %s", name, t.exception()))

    def alive(self) -> bool:
        return True   # gRPC reconnects by itself; a node it cannot reach fails the call (Unavailable)

    async def close(self) -> None:
        if self._posted:   # releases and aborts finish first, or their leases would wait for their TTL
            await asyncio.gather(*self._posted, return_exceptions=True)
        await self._channel.close()
