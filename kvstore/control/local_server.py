"""The Unix-socket server of a node: hands out a tenant's arena memfd and carries the local control channel.

Each connection is checked as it is accepted, before any frame is read: a peer uid
(SO_PEERCRED) outside shm.allowed_uids, or (with authentication configured) one that
auth.local_uids maps to no tenant, is answered PERMISSION_DENIED, and a connection
beyond shm.connections_max is answered CAPACITY_EXHAUSTED; either gets that one frame and
no thread. An accepted connection gets a thread. Its first frame may be PROVE: the node answers
the challenge the client's Hello gave it (kvstore/control/local_proof.py), so the client knows
whom it talks to before it shows anything. The next (or the first) may be AUTHENTICATE, a
bearer token of the uid's tenant; with auth.local_require_token it must be, and any other
first frame is answered UNAUTHENTICATED and the connection closed. A connection that showed
a token is checked against the token table on each frame: once SIGHUP revokes the token, or
it expires, the next frame is answered UNAUTHENTICATED and the connection closed. Frame 0 (MAP_ARENA) is answered with
the memfd of the caller's tenant over SCM_RIGHTS (tiers/dram.py: each tenant's pages live
in a memfd of their own, so the fd exposes no other tenant's bytes); an admin gets its own
tenant's memfd too, and moves other tenants' pages over TCP. Where tenants share one memfd
(rdma.enabled with authentication) only an admin may map it. Before a memfd first goes out, the
node stops vouching for TCP reads of its pages and waits for those in flight (store_exposure.py).
SHARE_BUFFER, UNSHARE_BUFFER and MOVE_PAGES carry a client's shared page buffers and the node's part of the
copies of pages in them (peer_buffers.py); the buffers are unmapped when the connection ends.
Other frames carry kvstore.v1 requests (framing.py).
A process keeps what it mapped after its token is revoked or expires. So the node notes which
tokens each tenant's memfd went to, and once one of them is no longer in force
(cut_off_revoked, on every reaper pass) it closes that tenant's local connections, refuses
MAP_ARENA for it meanwhile, and replaces the tenant's memfd (Arena.replace_memfd) at the first
moment none of its leases is open: the old mapping then shows none of the tenant's pages. The
tenant's clients reconnect and map the new memfd.
After each answer a connection polls for its next frame for shm.spin_us before it sleeps in
recv: a put's Reserves and Commits follow each other closely, and each wake-up of a sleeping
thread adds 25-45 us on a VM (4 KiB puts: about 10% more pages/s). It polls in kvstore_native,
without the GIL: two clients putting at once, each connection's polls held up the other's Python
(4-9% more pages/s for both together without). Longer polls were measured and not kept: 1 ms
gave 64 KiB puts 10% more pages/s, and a reader beside a writer on a one-core node 1.5x its p99.
Leases taken on a connection end when it closes, so a client killed mid-put frees its slots at
once. A broken invariant in the service stops the node (kvstore/invariants.py).
"""

from __future__ import annotations

import array
import collections
import logging
import os
import select
import socket
import stat
import struct
import threading
import time

from kvstore.config import AuthConfig
from kvstore.control import local_proof
from kvstore.control.identity import Authenticator, Caller, TokenStanding
from kvstore.control.peer_buffers import PeerBuffers
from kvstore.control.service import KVStoreService
from kvstore.invariants import stop_node
from kvstore.tiers.dram import Arena
from kvstore_client import errors, framing, native

log = logging.getLogger(__name__)

_UCRED = struct.Struct("3i")  # pid, uid, gid
# How long a refused peer has to read its answer before its socket is closed.
REFUSAL_LINGER_S = 1.0
# At shm.connections_max, a new connection takes the place of the one idle longest (no frame in
# that long, none being answered, no lease open), so idle sockets never lock local clients out.
RECLAIM_IDLE_S = 1.0
# Where the token authenticates (auth.local_require_token), the first frame is PROVE or
# AUTHENTICATE: a peer that has shown nothing may announce no more than this.
FIRST_FRAME_BYTES_MAX = 4096
# The frames of a client's shared page buffers, and the most fds read with one (one is kept, see _receive_fd).
_BUFFER_FRAMES = frozenset((framing.SHARE_BUFFER, framing.UNSHARE_BUFFER, framing.MOVE_PAGES))
_FDS_READ_MAX = 4
# A payload's buffer starts at most this large and doubles as its bytes arrive: what a frame
# announces costs memory only once it is sent.
_FIRST_READ_BYTES = 1 << 16


class LocalServer:
    def __init__(self, path: str, service: KVStoreService, arena: Arena | None, allowed_uids: frozenset[int],
                 connections_max: int, auth: Authenticator | None = None, spin_s: float = 0.0):
        """spin_s: how long a connection polls for its next frame before it sleeps (shm.spin_us)."""
        self.path = path
        self._spin_s = spin_s
        self._auth = auth or Authenticator(AuthConfig())
        self._service = service
        self._arena = arena
        self._allowed_uids = allowed_uids
        self._connections_max = connections_max
        self._listener = _listen(path)
        self._connections: dict[socket.socket, _Peer] = {}
        self._lock = threading.Lock()
        self._closed = False
        self._refusals = _Refusals(held_max=connections_max)
        self._handed: dict[str, set[bytes]] = {}   # tenant -> digests of the tokens its memfd went to
        self._replacing: set[str] = set()          # tenants whose memfd waits to be replaced
        self._thread = threading.Thread(target=self._accept_loop, name="shm-accept", daemon=True)

    def start(self) -> None:
        self._refusals.start()
        self._thread.start()

    def close(self) -> None:
        self._closed = True
        self._refusals.close()
        try:
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._listener.close()
        with self._lock:
            for conn in list(self._connections):
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
            pid, uid, _ = _UCRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
            try:
                identity = self._auth.local_identity(uid)
            except errors.KVStoreError as exc:
                log.warning("shm peer refused pid=%d uid=%d: %s", pid, uid, exc)
                self._refusals.refuse(conn, exc)
                continue
            peer = _Peer(conn, Caller(identity))
            refusal = self._admit(peer, pid, uid)
            if refusal is not None:
                self._refusals.refuse(conn, refusal)
                continue
            threading.Thread(target=self._serve, args=(peer, pid), name="shm-conn", daemon=True).start()

    def _admit(self, peer: "_Peer", pid: int, uid: int) -> errors.KVStoreError | None:
        """Counts the connection in and returns None, or returns why it is refused. Reads nothing from it."""
        if not self._auth.enabled and uid not in self._allowed_uids:   # with auth, local_uids decides
            log.warning("shm peer refused pid=%d uid=%d (not in shm.allowed_uids)", pid, uid)
            return errors.PermissionDenied(f"uid {uid} may not use this kvstore node; add it to shm.allowed_uids")
        with self._lock:
            if len(self._connections) >= self._connections_max and not self._reclaim_idlest():
                log.warning("shm connection refused pid=%d: shm.connections_max=%d reached, none idle",
                            pid, self._connections_max)
                return errors.CapacityExhausted(
                    f"this node already serves shm.connections_max={self._connections_max} local connections, "
                    f"none idle; close clients or raise shm.connections_max")
            self._connections[peer.conn] = peer
        return None

    def _reclaim_idlest(self) -> bool:
        """Lock held, at the connection limit: close the connection idle longest (RECLAIM_IDLE_S, nothing
        being answered, no lease open: its client may still be copying a leased page); True when one was."""
        now = time.monotonic()
        idle = sorted((peer for peer in self._connections.values()
                       if not peer.busy and now - peer.since >= RECLAIM_IDLE_S), key=lambda peer: peer.since)
        for peer in idle:
            if self._service.store.owns_leases(peer.owner):
                continue
            log.info("shm connections_max reached: closing a connection idle for %.1f s to admit a new one",
                     now - peer.since)
            del self._connections[peer.conn]
            try:
                peer.conn.shutdown(socket.SHUT_RDWR)   # its thread wakes from recv, ends its leases, closes
            except OSError:
                pass
            return True
        return False

    def cut_off_revoked(self) -> None:
        """Reaper pass: a tenant whose memfd went to a token no longer in force has its local connections
        closed and, once none of its leases is open, its memfd replaced."""
        with self._lock:
            for key, digests in list(self._handed.items()):
                if not all(map(self._auth.in_force, digests)):
                    log.warning("a token that mapped tenant %r's shared memory is revoked or expired: closing the "
                                "tenant's local connections and replacing its memory", key)
                    self._replacing.add(key)
                    del self._handed[key]
            if not self._replacing:
                return
            mapped = [peer.conn for peer in self._connections.values() if peer.owner.arena in self._replacing]
            pending = list(self._replacing)
        for conn in mapped:
            try:
                conn.shutdown(socket.SHUT_RDWR)   # its thread ends its leases; the client reconnects
            except OSError:
                pass
        for key in pending:
            if self._service.store.replace_memfd(key):
                with self._lock:
                    self._replacing.discard(key)
                log.info("tenant %r's shared memory replaced: what a revoked client mapped shows none of its pages",
                         key)

    def _serve(self, peer: "_Peer", pid: int) -> None:
        conn, owner = peer.conn, peer.owner
        identity = owner.identity
        standing = TokenStanding(self._auth, identity)
        require_token = self._auth.enabled and self._auth.config.local_require_token
        first, proven = True, False
        arrivals = select.poll()
        arrivals.register(conn, select.POLLIN)
        try:
            while True:
                peer.since, peer.busy = time.monotonic(), False   # the frame before is answered
                if self._spin_s:
                    _poll_until_readable(arrivals, conn, self._spin_s)
                header = _recv_exact(conn, framing.HEADER.size)
                if header is None:
                    return
                length, kind = framing.decode_header(header)
                if first and require_token and length > FIRST_FRAME_BYTES_MAX:
                    _send_error(conn, errors.MalformedRequest(
                        f"a first frame of {length} bytes: before its token, a connection sends PROVE or "
                        f"AUTHENTICATE, at most {FIRST_FRAME_BYTES_MAX} bytes"))
                    return
                payload = _recv_exact(conn, length)
                if payload is None:
                    return
                peer.busy = True
                try:
                    if kind == framing.PROVE:
                        if not first or proven or len(payload) != local_proof.CHALLENGE_BYTES:
                            raise errors.MalformedRequest("PROVE is only the connection's first frame, once, "
                                                          f"with the {local_proof.CHALLENGE_BYTES} bytes Hello gave")
                        proven = True
                        conn.sendall(framing.encode(0, self._service.local_proof.answer(bytes(payload))))
                        continue
                    if kind == framing.AUTHENTICATE:
                        if not first:
                            raise errors.MalformedRequest("AUTHENTICATE is only the connection's first frame")
                        identity = self._auth.local_token_identity(identity, payload.decode(errors="replace"))
                        owner.identity, standing = identity, TokenStanding(self._auth, identity)
                        first = False
                        conn.sendall(framing.encode(0, b""))
                        continue
                    if first and require_token:
                        refusal = errors.Unauthenticated(
                            "this node needs a token on the local socket too (auth.local_require_token): pass token= "
                            "to KVStoreClient (or set KVSTORE_TOKEN); it goes in the connection's first frame")
                        self._auth.refused("local", refusal)
                        raise refusal
                    standing.check("local")
                except (errors.Unauthenticated, errors.PermissionDenied, errors.MalformedRequest) as exc:
                    log.info("shm peer pid=%d refused, closing: %s", pid, exc)
                    _send_error(conn, exc)
                    return
                first = False
                if kind == framing.MAP_ARENA:
                    self._map_arena(conn, owner)
                elif kind in _BUFFER_FRAMES:
                    self._answer_buffers(peer, kind, payload)
                else:
                    self._answer(conn, kind, payload, owner)
        except framing.FrameError as exc:
            log.warning("shm peer pid=%d sent an unreadable frame, closing: %s", pid, exc)
        except OSError as exc:
            log.info("shm connection of pid=%d ended: %s", pid, exc)
        finally:
            with self._lock:
                self._connections.pop(conn, None)
            conn.close()
            if peer.buffers is not None:
                peer.buffers.close()
            try:
                self._service.end_owner(owner)
            except AssertionError as exc:
                stop_node("the local channel", exc)

    def _map_arena(self, conn: socket.socket, owner: Caller) -> None:
        """Answer MAP_ARENA with the memfd of the caller's tenant, or why it may not have one."""
        identity, arena = owner.identity, self._arena
        if arena is None:
            _send_error(conn, errors.TransportUnavailable("this node has no DRAM arena to map"))
            return
        if self._auth.enabled and not arena.tenants_apart and not identity.admin:
            refusal = errors.PermissionDenied(
                "the arena is one memfd holding every tenant's pages (rdma.enabled keeps slabs from moving between "
                "tenants) and is mapped only by an admin identity (auth.local_uids 'uid:tenant:admin'); a "
                "tenant's pages move over TCP")
            self._auth.refused("local", refusal)
            _send_error(conn, refusal)
            return
        key = arena.key(identity.tenant)
        with self._lock:   # noted before the fd goes out, so cut_off_revoked closes this connection too
            replacing = key in self._replacing
            if not replacing:
                owner.arena = key
                if identity.token_digest and arena.tenants_apart:
                    self._handed.setdefault(key, set()).add(identity.token_digest)
        if replacing:
            _send_error(conn, errors.TransportUnavailable(
                f"tenant {key!r}'s shared memory is being replaced after one of its tokens was revoked; a client "
                "moves its pages over TCP meanwhile, and maps the new memory when it reconnects"))
            return
        store = self._service.store
        # From here on, TCP reads of this memory are hashed by their readers (store_exposure.py).
        if not store.expose(identity.tenant, store.config.leases.ttl_ms_max / 1000):
            _send_error(conn, errors.TransportUnavailable(
                f"tenant {key!r}'s shared memory is still being read over TCP by a reader that stopped reading; "
                "a client moves its pages over TCP meanwhile, and maps the memory when it reconnects"))
            return
        fd = arena.fd_of(identity.tenant)
        answer = framing.ARENA_OF_ONE_TENANT if arena.tenants_apart else b""
        conn.sendmsg([framing.encode(0, answer)], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack("i", fd))])

    def _answer(self, conn: socket.socket, kind: int, payload: bytearray, owner: Caller) -> None:
        def serve() -> bytes:
            name, request = framing.decode_call(kind, payload)
            return self._service.handle(name, request, owner).SerializeToString()

        _reply(conn, kind, serve)

    def _answer_buffers(self, peer: "_Peer", kind: int, payload: bytearray) -> None:
        """SHARE_BUFFER, UNSHARE_BUFFER and MOVE_PAGES: the client's shared page buffers (peer_buffers.py)."""
        if peer.buffers is None:
            peer.buffers = PeerBuffers(self._service.store, self._service.limits.batch_pages_max)
        buffers = peer.buffers
        if kind == framing.SHARE_BUFFER:
            _reply(peer.conn, kind, lambda: buffers.share(_receive_fd(peer.conn, payload)))
        elif kind == framing.UNSHARE_BUFFER:
            _reply(peer.conn, kind, lambda: buffers.unshare(payload))
        else:
            _reply(peer.conn, kind, lambda: buffers.move(payload, peer.owner.identity))


class _Peer:
    """An accepted local connection: its socket, the owner of its leases, and when it last finished a frame."""

    __slots__ = ("conn", "owner", "since", "busy", "buffers")

    def __init__(self, conn: socket.socket, owner: Caller):
        self.conn, self.owner = conn, owner
        self.buffers: PeerBuffers | None = None   # the page buffers it shared, once it shares one
        self.since = time.monotonic()   # accepted, or its last answer sent
        self.busy = False               # a frame of it is being answered


class _Refusals:
    """Refused connections: answered at once, then closed when the peer hangs up or after REFUSAL_LINGER_S.

    Closing right after the answer would give a client whose first frame is already on
    its way EPIPE instead of the reason. Only our side is shut down meanwhile; nothing is
    read from them. One thread watches them all (epoll for the peer's hang-up), and at
    most `held_max` are held: a flood closes the oldest first.
    """

    def __init__(self, held_max: int):
        self._held_max = held_max
        self._held: collections.OrderedDict[int, tuple[socket.socket, float]] = collections.OrderedDict()
        self._lock = threading.Lock()
        self._epoll = select.epoll()
        self._closed = False
        self._thread = threading.Thread(target=self._watch, name="shm-refusals", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def refuse(self, conn: socket.socket, error: errors.KVStoreError) -> None:
        try:
            conn.setblocking(False)  # a fresh socket's buffer takes one short frame; never wait for a peer
            conn.send(framing.encode(error.code, str(error).encode()))
            conn.shutdown(socket.SHUT_WR)
        except OSError:
            conn.close()
            return
        with self._lock:
            if self._closed:
                conn.close()
                return
            if len(self._held) >= self._held_max:
                _, (oldest, _) = self._held.popitem(last=False)
                self._drop(oldest)
            self._held[conn.fileno()] = (conn, time.monotonic() + REFUSAL_LINGER_S)
            self._epoll.register(conn.fileno(), select.EPOLLRDHUP)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            while self._held:
                self._drop(self._held.popitem()[1][0])
            if not self._thread.is_alive():  # never started; otherwise the watcher closes it
                self._epoll.close()

    def _watch(self) -> None:
        while not self._closed:
            with self._lock:
                # deadlines are in insertion order, so the first is the earliest
                first = next(iter(self._held.values()), None)
            timeout_s = REFUSAL_LINGER_S if first is None else max(0.0, first[1] - time.monotonic())
            hung_up = self._epoll.poll(timeout_s)
            now = time.monotonic()
            with self._lock:
                for fd, _ in hung_up:
                    entry = self._held.pop(fd, None)
                    if entry is not None:
                        self._drop(entry[0])
                while self._held:
                    fd, (conn, deadline) = next(iter(self._held.items()))
                    if deadline > now:
                        break
                    del self._held[fd]
                    self._drop(conn)
        with self._lock:  # close() may still be dropping what was held
            self._epoll.close()

    def _drop(self, conn: socket.socket) -> None:
        self._epoll.unregister(conn.fileno())
        conn.close()


def _check_directory(directory: str) -> None:
    """The socket's directory must be this node's alone: whoever else may write in it could swap the
    socket for one of their own after the node binds, and collect the tokens local clients send."""
    found = os.lstat(directory)
    if stat.S_ISLNK(found.st_mode):
        raise OSError(f"the socket directory {directory} is a symbolic link (shm.socket_path): remove it, "
                      f"or name a directory of this node's own")
    if found.st_uid not in (os.geteuid(), 0):
        raise OSError(f"the socket directory {directory} belongs to uid {found.st_uid}, not to this node's "
                      f"({os.geteuid()}) (shm.socket_path): that user could replace the socket; remove the "
                      f"directory, or name one of this node's own")
    if found.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise OSError(f"the socket directory {directory} is writable by others (mode {found.st_mode & 0o7777:o}) "
                      f"(shm.socket_path): they could replace the socket; chmod go-w it, or name another")


def _receive_fd(conn: socket.socket, payload: bytearray) -> int:
    """The memfd sent with the byte after a SHARE_BUFFER frame; FrameError (the connection closes) for anything else."""
    data, ancillary, flags, _ = conn.recvmsg(1, socket.CMSG_SPACE(4 * _FDS_READ_MAX))
    fds = array.array("i")
    for level, kind, cdata in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(cdata[: len(cdata) - len(cdata) % fds.itemsize])
    if payload or data != b"\0" or len(fds) != 1 or flags & socket.MSG_CTRUNC:
        for fd in fds:
            os.close(fd)
        raise framing.FrameError("SHARE_BUFFER is an empty frame followed by one byte that carries one memfd")
    return fds[0]


def _reply(conn: socket.socket, kind: int, serve) -> None:
    """Answer a frame with what serve() returns, or with its error: a KVStoreError as it is, anything else but
    a broken invariant (which stops the node) or an unreadable stream (which closes the connection) as Internal."""
    try:
        answer = serve()
    except errors.KVStoreError as exc:
        _send_error(conn, exc)
        return
    except AssertionError as exc:  # a broken invariant is never answered and carried on from
        stop_node("the local channel", exc)
    except framing.FrameError:
        raise
    except Exception:
        log.exception("local frame %d failed", kind)
        _send_error(conn, errors.Internal("internal error, see the server log"))
        return
    conn.sendall(framing.encode(0, answer))


def _send_error(conn: socket.socket, exc: errors.KVStoreError) -> None:
    conn.sendall(framing.encode(exc.code, str(exc).encode()))


def _poll_until_readable(poller: select.poll, conn: socket.socket, spin_s: float) -> None:
    """Poll, without sleeping, until a frame starts to arrive or spin_s passes (shm.spin_us): in kvstore_native
    without the GIL, so that other connections' threads run their Python meanwhile."""
    if native.spin_until_readable is not None:
        native.spin_until_readable(conn.fileno(), spin_s)
        return
    deadline = time.perf_counter() + spin_s
    while not poller.poll(0) and time.perf_counter() < deadline:
        os.sched_yield()   # a client on this same core runs first


def _recv_exact(conn: socket.socket, nbytes: int) -> bytearray | None:
    """Exactly nbytes, or None when the peer closed the connection. The buffer itself, not a copy
    of it: a payload is parsed once and dropped, and a long Lookup's is half a megabyte. It grows
    as bytes arrive (to at most twice what came), never to a length only announced."""
    buf = bytearray(min(nbytes, _FIRST_READ_BYTES))
    got = 0
    while got < nbytes:
        if got == len(buf):
            buf += bytes(min(len(buf), nbytes - len(buf)))
        with memoryview(buf) as view:
            n = conn.recv_into(view[got:])
        if n == 0:
            return None
        got += n
    return buf


def _listen(path: str) -> socket.socket:
    directory = os.path.dirname(path) or "."
    os.makedirs(directory, mode=0o755, exist_ok=True)
    _check_directory(directory)
    if os.path.lexists(path):
        if not stat.S_ISSOCK(os.lstat(path).st_mode):
            raise OSError(f"{path} exists and is not a socket (shm.socket_path)")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(path)
        except ConnectionRefusedError:
            os.unlink(path)  # left behind by a server that died
        else:
            raise OSError(f"another kvstore-server is serving {path} (shm.socket_path): stop it, "
                          f"or give this node its own")
        finally:
            probe.close()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    # Anyone may connect; the peer-uid check decides who is served.
    os.chmod(path, 0o666)
    listener.listen(128)
    return listener
