"""AsyncKVStoreClient: the client's methods as coroutines, for asyncio engines; no thread per call.

    async with AsyncKVStoreClient("127.0.0.1:50051") as client:
        stored = await client.put(ns, keys, pages)
        hits = await client.lookup(ns, tokens=prompt)

Same arguments, results (PutResult, counts, RouteResponse, StatsResponse) and errors as
KVStoreClient; argument checks are shared (arguments.py). Control messages go over the node's
Unix socket as asyncio streams (the same frames as LocalChannel, answered in order) when the
node is on this host, else over grpc.aio. Page bytes move through the shared-memory arena,
copied inline: a memcpy of a page costs less than handing it to a thread. The arena's fd
comes over its own socket (asyncio streams cannot receive SCM_RIGHTS), which stays open as
the mapping's liveness signal, exactly as in the sync client: one short blocking exchange on
the local socket at connect, never per call. Where shared memory cannot be used (the node is
on another host, this identity may not map the arena, or transport="tcp"), pages move over
the node's TCP data plane on asyncio streams (async_tcp_transport.py). RDMA is the sync
client's only: with transport="rdma" put/get raise TransportUnavailable, while lookup, route,
delete, clear and stats work over grpc.aio.

A put reserves, copies and commits one group at a time, without the sync client's overlap.
A lost node is noticed before a call (no round trip) and the connection is opened again once;
a call caught by the loss fails with Unavailable. `timeout_s` bounds a whole call; without it
each message waits up to the client's timeout_s. One client serves any number of tasks of
one event loop; it is not for use from other threads.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from typing import Any, Awaitable, Callable, Sequence, TypeVar

import grpc
import grpc.aio

from kvstore_client import errors, framing, groups, lookup
from kvstore_client.arguments import (engine_id_list, get_pages, is_cluster_url, keys_or_tokens, node_target,
                                      parent_list, prefetch_policy, put_pages)
from kvstore_client.async_tcp_transport import AsyncTcpDataPath
from kvstore_client.channel import LocalChannel
from kvstore_client.credentials import Credentials
from kvstore_client.events import PageSnapshot, page_snapshot
from kvstore_client.data_path import PageColumns
from kvstore_client.groups import GroupHits, GroupPart, StagedPages
from kvstore_client.keys import Key, Namespace, encode_key, encode_keys
from kvstore_client.pipeline import (LEASE_MARGIN_S, PutResult, acquire_channel, changed_pages, check_loaded,
                                     commit_checksums, reserved_pages, stored_pages)
from kvstore_client.proto import pb
from kvstore_client.shm_transport import ShmDataPath
from kvstore_client.transport_choice import candidates

log = logging.getLogger(__name__)

T = TypeVar("T")


class AsyncLocalChannel:
    """kvstore.v1 frames on the node's Unix socket over asyncio streams; answers are matched in order."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self._reader, self._writer = reader, writer
        self._inflight: collections.deque[tuple[asyncio.Future, type]] = collections.deque()
        self._broken: errors.KVStoreError | None = None
        self._reading = asyncio.ensure_future(self._read_answers())

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
        return cls(reader, writer)

    async def call(self, name: str, request: Any, timeout_s: float) -> Any:
        answer = self._submit(name, request)
        try:
            async with asyncio.timeout(timeout_s):
                return await answer
        except TimeoutError:   # the answer, when it comes, is read and dropped: the channel stays in step
            raise errors.DeadlineExceeded(f"{name}: no answer on the shm socket within timeout_s") from None

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
        self._writer.write(framing.encode(method_id, request.SerializeToString()))
        return answer

    async def _read_answers(self) -> None:
        try:
            while True:
                length, code = framing.decode_header(await self._reader.readexactly(framing.HEADER.size))
                payload = await self._reader.readexactly(length)
                answer, response_cls = self._inflight.popleft()
                if answer.done():      # its caller gave up (timeout_s)
                    continue
                if code:
                    answer.set_exception(errors.error_from_code(code, payload.decode(errors="replace")))
                else:
                    answer.set_result(response_cls.FromString(payload))
        except (asyncio.IncompleteReadError, OSError) as exc:
            self._broken = errors.Unavailable(f"the shm socket closed: {exc}")
            for answer, _ in self._inflight:
                if not answer.done():
                    answer.set_exception(self._broken)
            self._inflight.clear()


class AsyncGrpcChannel:
    """kvstore.v1 over grpc.aio; errors mapped by errors.error_from_rpc, as in the sync client."""

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


class _ArenaPages:
    """Shared memory behind the same coroutines as AsyncTcpDataPath: the copy is inline (see the module doc)."""

    name = "shm"

    def __init__(self, path: ShmDataPath):
        self.path = path

    async def put(self, lease_id: int, token: bytes, pages: list, page_bytes: int) -> list[int] | None:
        return self.path.put(lease_id, token, pages, page_bytes)

    async def get(self, lease_id: int, token: bytes, pages: list, page_bytes: int) -> list[int] | None:
        return self.path.get(lease_id, token, pages, page_bytes)

    def alive(self) -> bool:
        return self.path.alive()

    def close(self) -> None:
        self.path.close()


class _Connection:
    """What one Hello set up: the control channel, the data path (None where pages cannot move), namespace ids."""

    def __init__(self, hello: pb.HelloResponse, grpc_channel: AsyncGrpcChannel, timeout_s: float,
                 credentials: Credentials = Credentials()):
        self.hello, self.grpc, self.timeout_s = hello, grpc_channel, timeout_s
        self.credentials = credentials
        self.token = credentials.token                   # shown on the local socket too (framing.AUTHENTICATE)
        self.control: AsyncLocalChannel | AsyncGrpcChannel = grpc_channel
        self.data: _ArenaPages | AsyncTcpDataPath | None = None
        self.no_data_reason = ""                         # why data is None, for put/get to say
        self.arena_channel: LocalChannel | None = None   # the arena came over it; open while the mapping is used
        self.namespace_ids: dict[Namespace, int] = {}

    @classmethod
    async def open(cls, target: str, timeout_s: float, transport: str, client_name: str,
                   credentials: Credentials) -> "_Connection":
        grpc_channel = AsyncGrpcChannel(target, credentials)
        conn = None
        try:
            hello = await grpc_channel.call("Hello", pb.HelloRequest(client_name=client_name), timeout_s)
            conn = cls(hello, grpc_channel, timeout_s, credentials)
            await conn._open_data_path(transport)
        except BaseException:
            await (conn.close() if conn is not None else grpc_channel.close())
            raise
        return conn

    async def _open_data_path(self, transport: str) -> None:
        """Shared memory when the node offers it and it works from here, else TCP (transport_choice.py, no RDMA)."""
        if transport == "rdma":
            self.no_data_reason = "AsyncKVStoreClient moves pages over shared memory or TCP: use KVStoreClient for RDMA"
            return
        hello = self.hello
        try:
            order = candidates(transport, bool(hello.shm_socket), False, bool(hello.tcp_endpoint), False)
        except errors.TransportUnavailable as exc:
            if transport != "auto":
                raise
            self.no_data_reason = str(exc)
            return
        failures = []
        for name in order:
            try:
                if name == "shm":
                    await self._open_shm()
                else:
                    tls = self.credentials.tcp_tls() if hello.tcp_tls else None
                    self.data = await asyncio.wait_for(AsyncTcpDataPath.open(hello.tcp_endpoint, hello.data_ticket, tls),
                                                       self.timeout_s)
                return
            except (errors.Unavailable, errors.PermissionDenied, errors.TransportUnavailable, TimeoutError) as exc:
                if transport != "auto":
                    raise
                log.info("data plane %s cannot be used, trying the next: %s", name, exc)
                failures.append(f"{name}: {exc}")
        self.no_data_reason = "no data plane of the node works from here: " + "; ".join(failures)

    async def _open_shm(self) -> None:
        proof = (self.hello.local_challenge, self.hello.local_answer)
        arena_channel = LocalChannel(self.hello.shm_socket, self.timeout_s, self.token, proof)
        try:
            self.data = _ArenaPages(ShmDataPath(arena_channel, self.hello.instance_id))
            self.control = await AsyncLocalChannel.open(self.hello.shm_socket, self.token, proof)
        except BaseException:
            if self.data is not None:
                self.data.close()
                self.data = None
            arena_channel.close()
            raise
        self.arena_channel = arena_channel

    def alive(self) -> bool:
        return self.control.alive() and (self.data is None or self.data.alive())

    async def close(self) -> None:
        if self.control is not self.grpc:
            await self.control.close(self.timeout_s)
        if self.data is not None:
            self.data.close()
        if self.arena_channel is not None:
            self.arena_channel.close()
        await self.grpc.close()


class AsyncKVStoreClient:
    def __new__(cls, target: str = "", **options: Any) -> Any:
        """A cluster URL (etcd://host:2379/<cluster>) gives an AsyncKVStoreCluster (async_cluster.py)."""
        if cls is AsyncKVStoreClient and is_cluster_url(target):
            from kvstore_client.async_cluster import AsyncKVStoreCluster
            return AsyncKVStoreCluster(target, **options)
        return super().__new__(cls)

    def __init__(self, target: str, *, timeout_s: float = 5.0, transport: str = "auto", client_name: str = "",
                 token: str | None = None, tls_ca: str | None = None, tls_cert: str | None = None,
                 tls_key: str | None = None):
        """Nothing is sent until the first call (or `await client.connect()`, or `async with`). `token` and
        the TLS files as KVStoreClient's (credentials.py; each one None is read from its KVSTORE_* variable)."""
        if not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
            raise errors.InvalidArgument(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")
        if transport not in ("auto", "shm", "tcp", "rdma"):
            raise errors.InvalidArgument(f"transport must be auto, shm, tcp or rdma, got {transport!r}")
        self._target, self._timeout_s, self._transport, self._client_name = (node_target(target), timeout_s,
                                                                             transport, client_name)
        self._credentials = Credentials.resolve(token=token, tls_ca=tls_ca, tls_cert=tls_cert, tls_key=tls_key)
        self._conn: _Connection | None = None
        self._opening = asyncio.Lock()
        self._closed = False

    async def connect(self) -> "AsyncKVStoreClient":
        await self._connection()
        return self

    @property
    def transport(self) -> str:
        """The data plane pages move over: "shm" or "tcp"; "none" when they cannot (control calls only)."""
        return self._conn.data.name if self._conn is not None and self._conn.data is not None else "none"

    # -- the same methods as KVStoreClient --------------------------------------------

    async def put(self, namespace: Namespace, keys: Sequence[Key] | None = None, buffers: Any = None,
                  parent: Key | None = None, verify: bool = False, durable: bool = False, *,
                  tokens: Any = None, timeout_s: float | None = None, anchor: Key | None = None,
                  parents: Sequence[Key | None] | None = None) -> PutResult:
        """KVStoreClient.put: store pages; a PutResult counts the leading keys stored and says why it is short."""
        raw_keys, segments, keepalive = put_pages(namespace, keys, buffers, tokens, parent, anchor)
        raw_parents = parent_list(parents, len(raw_keys), parent, anchor)
        before = parent if parent is not None else anchor   # the page before keys[0]; anchor: maybe not held
        parent_key = encode_key(before) if before is not None else b""

        async def put_all(conn: _Connection) -> PutResult:
            stored, step = 0, conn.hello.limits.batch_pages_max
            prior = parent_key
            for start in range(0, len(raw_keys), step):
                anchored = anchor is not None and start == 0
                batch = await self._in_namespace(conn, namespace, lambda ns_id: _put_batch(
                    conn, ns_id, namespace.page_bytes, prior, raw_keys[start:start + step],
                    segments[start:start + step], verify, durable, self._timeout_s, anchored,
                    raw_parents[start:start + step] if raw_parents is not None else []))
                stored += batch
                if not batch.complete:
                    return PutResult(stored, len(raw_keys), batch.reason)
                prior = raw_keys[min(start + step, len(raw_keys)) - 1]
            return PutResult(stored, len(raw_keys))

        try:
            return await self._on_node(put_all, timeout_s, needs_data=True)
        finally:
            del keepalive

    async def get(self, namespace: Namespace, keys: Sequence[Key] | None = None, out: Any = None,
                  verify: bool = False, policy: str = "wait_complete", timeout_ms: int = 0, *,
                  tokens: Any = None, timeout_s: float | None = None, wait_ms: int = 0) -> int:
        """KVStoreClient.get: copy the leading stored pages into `out`; returns how many were loaded."""
        prefetch = prefetch_policy(policy)
        raw_keys, segments, keepalive = get_pages(namespace, keys, out, tokens)

        async def get_all(conn: _Connection) -> int:
            loaded, step = 0, conn.hello.limits.batch_pages_max
            for start in range(0, len(raw_keys), step):
                request = pb.AcquireRequest(keys=raw_keys[start:start + step], policy=prefetch, timeout_ms=timeout_ms,
                                            wait_ms=wait_ms)
                hits = await self._in_namespace(conn, namespace, lambda ns_id: _get_batch(
                    conn, ns_id, request, segments[start:start + step], verify, self._timeout_s))
                loaded += hits
                if hits < len(request.keys):
                    break
            return loaded

        try:
            return await self._on_node(get_all, timeout_s, needs_data=True)
        finally:
            del keepalive

    async def lookup(self, namespace: Namespace, keys: Sequence[Key] | None = None, tokens: Any = None, *,
                     timeout_s: float | None = None) -> int:
        """As KVStoreClient.lookup: a prompt of any length in one call, its parts sent at once (lookup.py)."""
        chain = lookup.lookup_chain(namespace, keys, tokens)
        if tokens is not None and not chain:
            return 0   # fewer tokens than one page

        async def call(conn: _Connection) -> int:
            async def in_namespace(ns_id: int) -> int:
                limits = conn.hello.limits
                answers = await asyncio.gather(*(conn.control.call("Lookup", request, self._timeout_s)
                                                 for request in lookup.lookup_requests(limits, ns_id, chain)))
                return lookup.leading_sum((answer.hit_pages for answer in answers), lookup.pages_per_part(limits))
            return await self._in_namespace(conn, namespace, in_namespace)
        return await self._on_node(call, timeout_s)

    async def held(self, namespace: Namespace, keys: Sequence[Key], *, timeout_s: float | None = None) -> list[bool]:
        """As KVStoreClient.held: whether the node holds each key's page, its Lookups sent at once."""
        raw = encode_keys(keys)

        async def call(conn: _Connection) -> list[bool]:
            async def in_namespace(ns_id: int) -> list[bool]:
                answers = await asyncio.gather(*(conn.control.call("Lookup", request, self._timeout_s)
                                                 for request in lookup.held_requests(conn.hello.limits, ns_id, raw)))
                return [bool(b) for answer in answers for b in answer.held]
            return await self._in_namespace(conn, namespace, in_namespace)
        return await self._on_node(call, timeout_s)

    async def route(self, namespace: Namespace, engine_ids: Sequence[str], keys: Sequence[Key] | None = None,
                    tokens: Any = None, *, timeout_s: float | None = None) -> pb.RouteResponse:
        request = pb.RouteRequest(**keys_or_tokens(keys, tokens), engine_ids=engine_id_list(engine_ids))
        return await self._call_in(namespace, "Route", request, timeout_s)

    async def delete(self, namespace: Namespace, keys: Sequence[Key], *, timeout_s: float | None = None) -> int:
        request = pb.DeleteRequest(keys=encode_keys(keys))
        return (await self._call_in(namespace, "Delete", request, timeout_s)).deleted_pages

    async def clear(self, namespace: Namespace, *, timeout_s: float | None = None) -> int:
        return (await self._call_in(namespace, "Delete", pb.DeleteRequest(all_pages=True), timeout_s)).deleted_pages

    async def list_keys(self, namespace: Namespace, *, timeout_s: float | None = None) -> list[bytes]:
        async def list_all(conn: _Connection) -> list[bytes]:
            async def in_namespace(ns_id: int) -> list[bytes]:
                answers = await _every_page(lambda cursor: conn.control.call(
                    "ListKeys", pb.ListKeysRequest(namespace_id=ns_id, cursor=cursor), self._timeout_s))
                return sorted({key for answer in answers for key in answer.keys})
            return await self._in_namespace(conn, namespace, in_namespace)
        return await self._on_node(list_all, timeout_s)

    async def list_pages(self, namespace: Namespace, *, timeout_s: float | None = None) -> PageSnapshot:
        """KVStoreClient.list_pages."""
        async def list_all(conn: _Connection) -> PageSnapshot:
            async def in_namespace(ns_id: int) -> PageSnapshot:
                return page_snapshot(ns_id, await _every_page(lambda cursor: conn.control.call(
                    "ListPages", pb.ListPagesRequest(namespace_id=ns_id, cursor=cursor), self._timeout_s)))
            return await self._in_namespace(conn, namespace, in_namespace)
        return await self._on_node(list_all, timeout_s)

    async def events_run(self, namespace: Namespace, *, timeout_s: float | None = None) -> bytes:
        """KVStoreClient.events_run."""
        async def first(conn: _Connection) -> bytes:
            async def in_namespace(ns_id: int) -> bytes:
                answer = await conn.control.call("ListPages", pb.ListPagesRequest(namespace_id=ns_id, pages_max=1),
                                                 self._timeout_s)
                return answer.events_run
            return await self._in_namespace(conn, namespace, in_namespace)
        return await self._on_node(first, timeout_s)

    # -- page groups (groups.py) ---------------------------------------------------------

    async def stage(self, namespace: Namespace, keys: Sequence[Key] | None = None, buffers: Any = None,
                    parent: Key | None = None, verify: bool = False, *, tokens: Any = None,
                    anchor: Key | None = None, timeout_s: float | None = None,
                    parents: Sequence[Key | None] | None = None) -> StagedPages:
        """KVStoreClient.stage: write pages into slots without making them visible, for commit_group()."""
        raw_keys, segments, keepalive = put_pages(namespace, keys, buffers, tokens, parent, anchor)
        raw_parents = parent_list(parents, len(raw_keys), parent, anchor) or []
        before = anchor if anchor is not None else parent
        before_key = encode_key(before) if before is not None else b""

        async def stage_all(conn: _Connection) -> StagedPages:
            most = conn.hello.limits.batch_pages_max
            if len(raw_keys) > most:
                raise errors.InvalidArgument(f"{len(raw_keys)} keys: a staged part is one write lease of at most "
                                             f"{most} pages (limits.batch_pages_max)")
            return await self._in_namespace(conn, namespace, lambda ns_id: _stage_batch(
                conn, ns_id, namespace, raw_keys, segments, before_key, anchor is not None, verify, self._timeout_s,
                raw_parents))

        try:
            return await self._on_node(stage_all, timeout_s, needs_data=True)
        finally:
            del keepalive

    async def commit_group(self, parts: Sequence[StagedPages], *, timeout_s: float | None = None) -> list[PutResult]:
        """KVStoreClient.commit_group: every staged page of every part visible in one step, or none (the group's
        leases are then aborted and the node's error raised)."""
        request = groups.commit_group_request(parts)
        if request is not None:
            async def commit(conn: _Connection) -> None:
                try:
                    await conn.control.call("CommitGroup", request, self._timeout_s)
                except BaseException:
                    for part in request.parts:
                        conn.control.post("Abort", pb.AbortRequest(lease_id=part.lease_id))
                    raise
            await self._on_node(commit, timeout_s)
        return groups.committed(parts)

    async def put_group(self, keys: Sequence[Key], parts: Sequence[tuple[Namespace, Any]], parent: Key | None = None,
                        verify: bool = False, *, anchor: Key | None = None,
                        timeout_s: float | None = None) -> PutResult:
        """KVStoreClient.put_group: each key's pages of every namespace become visible together."""
        if not parts:
            raise errors.InvalidArgument("put_group needs at least one (namespace, pages) part")

        async def put_all() -> PutResult:
            staged: list[StagedPages] = []
            try:
                for namespace, buffers in parts:
                    staged.append(await self.stage(namespace, keys, buffers, parent, verify, anchor=anchor))
            except BaseException:
                await self._on_node(lambda conn: _abort_staged(conn, staged), None)
                raise
            return min(await self.commit_group(staged), key=int)

        return await _within(put_all(), timeout_s)

    async def lookup_group(self, keys: Sequence[Key], parts: Sequence[GroupPart], *,
                           timeout_s: float | None = None) -> GroupHits:
        """KVStoreClient.lookup_group: the prefixes every part can restore, from one snapshot of the node."""
        async def lookup(conn: _Connection) -> GroupHits:
            request = groups.lookup_group_request(keys, parts, conn.hello.limits)

            async def in_namespaces(ns_ids: list[int]) -> GroupHits:
                for part, ns_id in zip(request.parts, ns_ids):
                    part.namespace_id = ns_id
                return groups.group_hits(await conn.control.call("LookupGroup", request, self._timeout_s))
            return await self._in_namespaces(conn, [part.namespace for part in parts], in_namespaces)
        return await self._on_node(lookup, timeout_s)

    async def get_group(self, parts: Sequence[tuple[Namespace, Sequence[Key], Any]], verify: bool = False,
                        policy: str = "wait_complete", *, timeout_s: float | None = None) -> list[int]:
        """KVStoreClient.get_group: every part pinned in one step, a key loaded in every part or in none."""
        prefetch = prefetch_policy(policy)
        if not parts:
            raise errors.InvalidArgument("get_group needs at least one (namespace, keys, out) part")
        prepared = [get_pages(namespace, part_keys, out, None) for namespace, part_keys, out in parts]

        async def get_all(conn: _Connection) -> list[int]:
            return await self._in_namespaces(conn, [namespace for namespace, _, _ in parts],
                                             lambda ns_ids: in_namespaces(conn, ns_ids))

        async def in_namespaces(conn: _Connection, ns_ids: list[int]) -> list[int]:
            request = pb.AcquireGroupRequest(parts=[
                pb.AcquireRequest(namespace_id=ns_id, keys=raw_keys, policy=prefetch)
                for ns_id, (raw_keys, _, _) in zip(ns_ids, prepared)])
            sent_at = time.monotonic()
            acquired = await conn.control.call("AcquireGroup", request, self._timeout_s)
            counts = groups.whole_positions([raw_keys for raw_keys, _, _ in prepared],
                                            [answer.hit_pages for answer in acquired.parts])
            landed: dict[int, list[int] | None] = {}
            try:
                for load in groups.part_loads(acquired, counts, [segments for _, segments, _ in prepared]):
                    landed[load[0]] = await conn.data.get(*load)
            finally:
                changed = groups.release(conn.control, acquired, landed)
            groups.check_group_loaded(acquired, counts, [segments for _, segments, _ in prepared], sent_at, verify,
                                      changed)
            return counts
        return await self._on_node(get_all, timeout_s, needs_data=True)

    async def stats(self, *, timeout_s: float | None = None) -> pb.StatsResponse:
        return await self._on_node(
            lambda conn: conn.control.call("Stats", pb.StatsRequest(), self._timeout_s), timeout_s)

    async def close(self) -> None:
        self._closed = True
        conn, self._conn = self._conn, None
        if conn is not None:
            await conn.close()

    async def __aenter__(self) -> "AsyncKVStoreClient":
        return await self.connect()

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    # -- the connection ---------------------------------------------------------------

    async def _call_in(self, namespace: Namespace, method: str, request: Any, timeout_s: float | None) -> Any:
        async def call(conn: _Connection) -> Any:
            async def in_namespace(ns_id: int) -> Any:
                request.namespace_id = ns_id
                return await conn.control.call(method, request, self._timeout_s)
            return await self._in_namespace(conn, namespace, in_namespace)
        return await self._on_node(call, timeout_s)

    async def _on_node(self, action: Callable[[_Connection], Awaitable[T]], timeout_s: float | None,
                       needs_data: bool = False) -> T:
        if timeout_s is not None and not timeout_s > 0:
            raise errors.InvalidArgument(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")
        try:
            async with asyncio.timeout(timeout_s):
                conn = await self._connection()
                if needs_data and conn.data is None:
                    raise errors.TransportUnavailable(conn.no_data_reason)
                return await action(conn)
        except TimeoutError:
            raise errors.DeadlineExceeded(f"the call did not finish within its timeout_s={timeout_s}") from None

    async def _connection(self) -> _Connection:
        if self._closed:
            raise errors.InvalidArgument("this AsyncKVStoreClient is closed: open a new one")
        async with self._opening:
            stale = self._conn
            if stale is not None and stale.alive():
                return stale
            self._conn = None
            if stale is not None:
                log.info("the connection to %s was lost; opening it again", self._target)
                await stale.close()
            self._conn = await _Connection.open(self._target, self._timeout_s, self._transport, self._client_name,
                                                self._credentials)
            return self._conn

    async def _in_namespaces(self, conn: _Connection, namespaces: Sequence[Namespace],
                             action: Callable[[list[int]], Awaitable[T]]) -> T:
        """Run action(namespace ids), each namespace opened first (all again, once, if the node forgot one)."""
        for attempt in (1, 2):
            ns_ids = [await self._in_namespace(conn, namespace, _same) for namespace in namespaces]
            try:
                return await action(ns_ids)
            except errors.NamespaceNotFound:
                for namespace in namespaces:
                    conn.namespace_ids.pop(namespace, None)
                if attempt == 2:
                    raise
        raise AssertionError("unreachable")

    async def _in_namespace(self, conn: _Connection, namespace: Namespace,
                            action: Callable[[int], Awaitable[T]]) -> T:
        """Run action(namespace id), opening the namespace first (again, once, if the node forgot it)."""
        for attempt in (1, 2):
            ns_id = conn.namespace_ids.get(namespace)
            if ns_id is None:
                opened = await conn.control.call("OpenNamespace", pb.OpenNamespaceRequest(spec=namespace.to_proto()),
                                                 self._timeout_s)
                ns_id = conn.namespace_ids[namespace] = opened.namespace_id
            try:
                return await action(ns_id)
            except errors.NamespaceNotFound:
                conn.namespace_ids.pop(namespace, None)
                if attempt == 2:
                    raise
        raise AssertionError("unreachable")


async def _put_batch(conn: _Connection, ns_id: int, page_bytes: int, parent: bytes, keys: list[bytes],
                     segments: list, verify: bool, durable: bool, timeout_s: float, anchored: bool,
                     parent_keys: list[bytes]) -> PutResult:
    """One Reserve, the copies, one Commit; an error aborts the lease. The count as pipeline.stored_pages says.
    `parent_keys`: each key's parent (put's parents=), or none."""
    control = conn.control
    sent_at = time.monotonic()
    reserved = await control.call("Reserve", pb.ReserveRequest(
        namespace_id=ns_id, parent_key=parent_keys[0] if parent_keys else parent, keys=keys, page_bytes=page_bytes,
        anchor_absent_parent=anchored, parent_keys=parent_keys), timeout_s)
    indices = [i for i, state in enumerate(reserved.states) if state == pb.RESERVED]
    if not indices:
        return stored_pages(reserved.states, [], durable)
    try:
        if time.monotonic() > sent_at + reserved.lease_ttl_ms / 1000 - LEASE_MARGIN_S:
            raise errors.LeaseNotFound("the write lease would expire before the pages moved; "
                                       "raise leases.write_ttl_ms or put fewer pages per call")
        pages = reserved_pages(reserved, indices, segments)
        written = await conn.data.put(reserved.lease_id, reserved.data_token, pages, page_bytes)
        sums, from_writer = commit_checksums(written, pages.segments if written is None else [], verify)
        committed = await control.call("Commit", pb.CommitRequest(
            lease_id=reserved.lease_id, indices=pages.indices, checksums=sums, durable=durable,
            checksums_from_writer=from_writer), timeout_s)
    except BaseException:
        control.post("Abort", pb.AbortRequest(lease_id=reserved.lease_id))
        raise
    return stored_pages(reserved.states, [committed], durable)


async def _stage_batch(conn: _Connection, ns_id: int, namespace: Namespace, keys: list[bytes], segments: list,
                       parent: bytes, anchored: bool, verify: bool, timeout_s: float,
                       parent_keys: list[bytes]) -> StagedPages:
    """groups.stage_batch over the async channel and data path."""
    sent_at = time.monotonic()
    reserved = await conn.control.call("Reserve", pb.ReserveRequest(
        namespace_id=ns_id, parent_key=parent_keys[0] if parent_keys else parent, keys=keys,
        page_bytes=namespace.page_bytes, anchor_absent_parent=anchored, parent_keys=parent_keys), timeout_s)
    try:
        positions = [i for i, state in enumerate(reserved.states) if state == pb.RESERVED]
        pages = reserved_pages(reserved, positions, segments)
        written = await conn.data.put(reserved.lease_id, reserved.data_token, pages, namespace.page_bytes) \
            if positions else None
        return groups.staged_pages(namespace, keys, reserved, positions, written, segments, verify, sent_at)
    except BaseException:
        if reserved.lease_id:
            conn.control.post("Abort", pb.AbortRequest(lease_id=reserved.lease_id))
        raise


async def _abort_staged(conn: _Connection, staged: Sequence[StagedPages]) -> None:
    for lease_id in {part.lease_id for part in staged if part.lease_id and part.slots}:
        conn.control.post("Abort", pb.AbortRequest(lease_id=lease_id))
    for part in staged:
        part.slots.clear()


async def _every_page(call: Callable[[int], Awaitable[Any]]) -> list[Any]:
    """Every answer of a call paged by a cursor (ListKeys, ListPages): from 0 until one says no more."""
    answers, cursor = [], 0
    while True:
        answers.append(await call(cursor))
        if not answers[-1].more:
            return answers
        cursor = answers[-1].cursor


async def _same(ns_id: int) -> int:
    return ns_id


async def _within(call: Awaitable[T], timeout_s: float | None) -> T:
    """A call of several node calls under one timeout_s (DeadlineExceeded when it runs out)."""
    if timeout_s is not None and not timeout_s > 0:
        raise errors.InvalidArgument(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")
    try:
        async with asyncio.timeout(timeout_s):
            return await call
    except TimeoutError:
        raise errors.DeadlineExceeded(f"the call did not finish within its timeout_s={timeout_s}") from None


async def _get_batch(conn: _Connection, ns_id: int, request: pb.AcquireRequest, segments: list, verify: bool,
                     timeout_s: float) -> int:
    """Acquire, copy the hits, post the release, then check them as pipeline.get_batch does."""
    request.namespace_id = ns_id
    control = acquire_channel(conn, request.wait_ms)
    sent_at = time.monotonic()
    acquired = await control.call("Acquire", request, timeout_s)
    hits = acquired.hit_pages
    if not hits:
        return 0
    landed = None
    try:
        landed = await conn.data.get(acquired.lease_id, acquired.data_token,
                                     PageColumns(range(hits), acquired.offsets[:hits], segments[:hits]),
                                     acquired.page_bytes)
    finally:
        changed = changed_pages(acquired, landed)
        control.post("Release", pb.ReleaseRequest(lease_ids=[acquired.lease_id], changed_pages=changed))
    check_loaded(acquired, sent_at, segments, verify, changed)
    return hits
