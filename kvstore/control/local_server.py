"""The Unix-socket server of a node: hands out the arena fd and carries the local control channel.

A connection's peer uid (SO_PEERCRED) must be in the allow list, or every request on it
is answered PERMISSION_DENIED. Frame 0 (MAP_ARENA) is answered with the arena's memfd
over SCM_RIGHTS; other frames carry kvstore.v1 requests (framing.py). Leases taken on a
connection end when it closes, so a client killed mid-put frees its slots at once.
"""

from __future__ import annotations

import logging
import os
import socket
import stat
import struct
import threading

from google.protobuf.message import DecodeError

from kvstore.control.service import KVStoreService
from kvstore_client import errors, framing

log = logging.getLogger(__name__)

_UCRED = struct.Struct("3i")  # pid, uid, gid


class LocalServer:
    def __init__(self, path: str, service: KVStoreService, arena_fd: int, allowed_uids: frozenset[int]):
        self.path = path
        self._service = service
        self._arena_fd = arena_fd
        self._allowed_uids = allowed_uids
        self._listener = _listen(path)
        self._connections: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=self._accept_loop, name="shm-accept", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._closed = True
        try:
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._listener.close()
        with self._lock:
            for conn in self._connections:
                try:
                    conn.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                if self._closed:
                    return
                log.exception("accept failed on %s", self.path)
                continue
            with self._lock:
                self._connections.add(conn)
            threading.Thread(target=self._serve, args=(conn,), name="shm-conn", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        owner = object()
        pid, uid, _ = _UCRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
        allowed = uid in self._allowed_uids
        if not allowed:
            log.warning("shm peer refused pid=%d uid=%d (not in shm.allowed_uids)", pid, uid)
        try:
            while True:
                header = _recv_exact(conn, framing.HEADER.size)
                if header is None:
                    return
                length, kind = framing.decode_header(header)
                payload = _recv_exact(conn, length)
                if payload is None:
                    return
                if not allowed:
                    _send_error(conn, errors.PermissionDenied(
                        f"uid {uid} may not use this kvstore node; add it to shm.allowed_uids"))
                    return
                if kind == framing.MAP_ARENA:
                    conn.sendmsg([framing.encode(0, b"")],
                                 [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack("i", self._arena_fd))])
                    continue
                self._answer(conn, kind, payload, owner)
        except framing.FrameError as exc:
            log.warning("shm peer pid=%d sent an unreadable frame, closing: %s", pid, exc)
        except OSError as exc:
            log.info("shm connection of pid=%d ended: %s", pid, exc)
        finally:
            with self._lock:
                self._connections.discard(conn)
            conn.close()
            self._service.end_owner(owner)

    def _answer(self, conn: socket.socket, kind: int, payload: bytes, owner: object) -> None:
        method = framing.METHODS.get(kind)
        try:
            if method is None:
                raise errors.MalformedRequest(f"unknown method id {kind}")
            name, request_cls, _ = method
            try:
                request = request_cls.FromString(payload)
            except DecodeError as exc:
                raise errors.MalformedRequest(f"{name}: request is not a valid {request_cls.__name__}: {exc}") from None
            response = self._service.handle(name, request, owner)
        except errors.KVStoreError as exc:
            _send_error(conn, exc)
            return
        except Exception:
            log.exception("local %s failed", method[0] if method else kind)
            _send_error(conn, errors.Internal("internal error, see the server log"))
            return
        conn.sendall(framing.encode(0, response.SerializeToString()))


def _send_error(conn: socket.socket, exc: errors.KVStoreError) -> None:
    conn.sendall(framing.encode(exc.code, str(exc).encode()))


def _recv_exact(conn: socket.socket, nbytes: int) -> bytes | None:
    """Exactly nbytes, or None when the peer closed the connection."""
    buf = bytearray(nbytes)
    view = memoryview(buf)
    got = 0
    while got < nbytes:
        n = conn.recv_into(view[got:])
        if n == 0:
            return None
        got += n
    return bytes(buf)


def _listen(path: str) -> socket.socket:
    directory = os.path.dirname(path)
    if directory:
        os.makedirs(directory, mode=0o755, exist_ok=True)
    if os.path.lexists(path):
        if not stat.S_ISSOCK(os.lstat(path).st_mode):
            raise OSError(f"{path} exists and is not a socket")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(path)
        except ConnectionRefusedError:
            os.unlink(path)  # left behind by a server that died
        else:
            raise OSError(f"another kvstore-server is serving {path}")
        finally:
            probe.close()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    # Anyone may connect; the peer-uid check decides who is served.
    os.chmod(path, 0o666)
    listener.listen(128)
    return listener
