"""Control channels: gRPC for any host, the local Unix-socket channel on the same host.

Both carry the messages of kvstore.v1.KVStore and raise the exceptions of errors.py.
`call` waits for the answer; `post` sends and lets the answer be checked later (used
for releases, so a get never waits for one). Every call has a deadline.
"""

from __future__ import annotations

import array
import collections
import logging
import socket
import threading
from typing import Any, Callable, Iterable

import grpc

from kvstore_client import errors, framing
from kvstore_client.proto import pb

log = logging.getLogger(__name__)


class GrpcChannel:
    """kvstore.v1.KVStore over gRPC; method stubs are derived from the proto descriptor."""

    def __init__(self, target: str, timeout_s: float):
        self.timeout_s = timeout_s
        self._channel = grpc.insecure_channel(target, options=[("grpc.max_receive_message_length", 64 << 20)])
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
            return self._stubs[name](request, timeout=timeout_s or self.timeout_s)
        except grpc.RpcError as exc:
            raise errors.error_from_rpc(exc) from None

    def post(self, name: str, request: Any) -> None:
        future = self._stubs[name].future(request, timeout=self.timeout_s)
        future.add_done_callback(_log_failed_post(name))

    def call_pipelined(self, name: str, requests: Iterable[Any]) -> list[Any | errors.KVStoreError]:
        """Send each request as the iterator yields it; answers (or errors) in order."""
        futures = [self._stubs[name].future(r, timeout=self.timeout_s) for r in requests]
        results: list[Any | errors.KVStoreError] = []
        for future in futures:
            try:
                results.append(future.result())
            except grpc.RpcError as exc:
                results.append(errors.error_from_rpc(exc))
        return results

    def close(self) -> None:
        self._channel.close()


def _log_failed_post(name: str) -> Callable[[Any], None]:
    def done(future: Any) -> None:
        if future.exception() is not None:
            log.warning("%s failed after it was posted: %s", name, errors.error_from_rpc(future.exception()))
    return done


class LocalChannel:
    """The same messages as frames on the server's Unix socket (see framing.py).

    Thread-safe: one lock orders writes, and answers come back in request order, so a
    caller reads (and checks) the answers of earlier posts before its own.
    """

    def __init__(self, path: str, timeout_s: float):
        self.timeout_s = timeout_s
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.settimeout(timeout_s)
        try:
            self._sock.connect(path)
        except OSError as exc:
            self._sock.close()
            raise errors.Unavailable(f"cannot connect to the shm socket {path}: {exc}") from None
        self._lock = threading.Lock()
        self._posted: collections.deque[str] = collections.deque()
        self._header = bytearray(framing.HEADER.size)

    def map_arena_fd(self) -> int:
        """Ask for the arena; the server answers with its memfd (SCM_RIGHTS) or an error."""
        with self._lock:
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
            return fds[0]

    def call(self, name: str, request: Any, timeout_s: float | None = None) -> Any:
        method_id = framing.METHOD_IDS[name]
        response_cls = framing.METHODS[method_id][2]
        with self._lock:
            self._sock.settimeout(timeout_s or self.timeout_s)
            self._send(method_id, request)
            self._drain_posted()
            code, payload = self._read_answer()
        if code:
            raise errors.error_from_code(code, payload.decode(errors="replace"))
        return response_cls.FromString(payload)

    def call_pipelined(self, name: str, requests: Iterable[Any]) -> list[Any | errors.KVStoreError]:
        """Send each request as the iterator yields it (work done between yields overlaps
        with the server handling the previous request); answers (or errors) in order."""
        method_id = framing.METHOD_IDS[name]
        response_cls = framing.METHODS[method_id][2]
        results: list[Any | errors.KVStoreError] = []
        with self._lock:
            self._sock.settimeout(self.timeout_s)
            sent = 0
            try:
                for request in requests:
                    self._send(method_id, request)
                    sent += 1
            finally:
                self._drain_posted()
                for _ in range(sent):
                    code, payload = self._read_answer()
                    results.append(errors.error_from_code(code, payload.decode(errors="replace"))
                                   if code else response_cls.FromString(payload))
        return results

    def post(self, name: str, request: Any) -> None:
        with self._lock:
            self._sock.settimeout(self.timeout_s)
            self._send(framing.METHOD_IDS[name], request)
            self._posted.append(name)

    def flush(self) -> None:
        """Read the answers of everything posted so far."""
        with self._lock:
            self._sock.settimeout(self.timeout_s)
            self._drain_posted()

    def close(self) -> None:
        try:
            self.flush()
        except (errors.KVStoreError, OSError):
            pass
        self._sock.close()

    def _send(self, method_id: int, request: Any) -> None:
        try:
            self._sock.sendall(framing.encode(method_id, request.SerializeToString()))
        except socket.timeout:
            raise errors.DeadlineExceeded("sending to the shm socket timed out") from None
        except OSError as exc:
            raise errors.Unavailable(f"shm socket closed: {exc}") from None

    def _drain_posted(self) -> None:
        while self._posted:
            name = self._posted.popleft()
            code, payload = self._read_answer()
            if code:
                log.warning("%s failed after it was posted: %s", name,
                            errors.error_from_code(code, payload.decode(errors="replace")))

    def _read_answer(self) -> tuple[int, bytes]:
        header = self._recv_exact(framing.HEADER.size)
        length, code = framing.decode_header(header)
        return code, self._recv_exact(length)

    def _recv_exact(self, nbytes: int) -> bytes:
        buf = bytearray(nbytes)
        view = memoryview(buf)
        got = 0
        try:
            while got < nbytes:
                n = self._sock.recv_into(view[got:])
                if n == 0:
                    raise errors.Unavailable("the server closed the shm socket")
                got += n
        except socket.timeout:
            # A frame may be half read: the stream cannot be trusted any more.
            self._sock.close()
            raise errors.DeadlineExceeded("no answer on the shm socket within the deadline") from None
        except OSError as exc:
            self._sock.close()
            raise errors.Unavailable(f"shm socket failed: {exc}") from None
        return bytes(buf)
