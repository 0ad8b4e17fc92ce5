"""AsyncKVStoreClient: the client's methods as coroutines, for asyncio engines; no thread per call.

    async with AsyncKVStoreClient("127.0.0.1:50051") as client:
        stored = await client.put(ns, keys, pages)
        hits = await client.lookup(ns, tokens=prompt)

Same arguments, results (PutResult, counts, RouteResponse, StatsResponse) and errors as
KVStoreClient; argument checks are shared (arguments.py). Control messages go over the node's
Unix socket as asyncio streams (the same frames as LocalChannel, answered in order) when the
node is on this host, on a call connection of its TCP data plane when pages move over TCP (where
its Hello offers tcp_calls), else over grpc.aio (async_channel.py). Page bytes move through the
shared-memory arena, copied inline: a memcpy of a page costs less than handing it to a thread (a move the node
copies with this process waits on the node, and runs on a worker thread instead). The arena's fd
comes over its own socket (asyncio streams cannot receive SCM_RIGHTS), which stays open as
the mapping's liveness signal, exactly as in the sync client: one short blocking exchange on
the local socket at connect, never per call. Where shared memory cannot be used (the node is
on another host, this identity may not map the arena, or transport="tcp"), pages move over
the node's TCP data plane on asyncio streams (async_tcp_transport.py). RDMA is the sync
client's only: with transport="rdma" put/get raise TransportUnavailable, while lookup, route,
delete, clear and stats work over grpc.aio.

Every call is the sync client's, written once with no I/O (node_calls.py) and awaited here step
by step (node_steps.drive_async): the same messages in the same order, the same pipeline (the next
group's Reserve in flight while this group's pages move), the same results and errors. A lost node
is noticed before a call (no round trip) and the connection is opened again once; a call caught by
the loss fails with Unavailable, or is made once more on a new connection where KVStoreClient would.
`timeout_s` bounds a whole call; without it each message waits up to the client's timeout_s. One
client serves any number of tasks of one event loop; it is not for use from other threads.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from typing import Any, Callable, Sequence, TypeVar

from kvstore_client import errors, node_calls
from kvstore_client.arguments import check_timeout_s, is_cluster_url, node_target
from kvstore_client.async_channel import AsyncGrpcChannel, AsyncLocalChannel, AsyncTcpControlChannel
from kvstore_client.async_tcp_transport import AsyncTcpDataPath
from kvstore_client.channel import LocalChannel
from kvstore_client.credentials import Credentials
from kvstore_client.events import PageSnapshot
from kvstore_client.groups import GroupHits, GroupPart, StagedPages
from kvstore_client.keys import Key, Namespace
from kvstore_client.load_estimate import TransferRate
from kvstore_client.node_steps import OnNode, Steps, drive_async, lost_under, take_async_on
from kvstore_client.pipeline import PutResult
from kvstore_client.proto import pb
from kvstore_client.residency import Residency
from kvstore_client.shm_transport import ShmDataPath
from kvstore_client.transport_choice import candidates
from kvstore_client.worker_thread import to_the_end

log = logging.getLogger(__name__)

T = TypeVar("T")


class _ArenaPages:
    """Shared memory behind the same coroutines as AsyncTcpDataPath: the copy is inline (see the module doc), but
    for a move the node copies with this process (a shared page buffer's): that one waits for the node's answer, up
    to the call's deadline and more, so it runs on a worker thread and the loop serves other tasks meanwhile."""

    name = "shm"
    rdma_qp_num = 0

    def __init__(self, path: ShmDataPath):
        self.path = path
        self.shape = path.shape

    async def put(self, lease_id: int, token: bytes, pages: list, page_bytes: int) -> list[int] | None:
        return await self._move(self.path.put, lease_id, token, pages, page_bytes)

    async def get(self, lease_id: int, token: bytes, pages: list, page_bytes: int) -> list[int] | None:
        return await self._move(self.path.get, lease_id, token, pages, page_bytes)

    async def _move(self, copy: Callable[..., Any], lease_id: int, token: bytes, pages: list, page_bytes: int) -> Any:
        if self.path.waits_on_node(pages, page_bytes):
            return await to_the_end(functools.partial(copy, lease_id, token, pages, page_bytes))
        return copy(lease_id, token, pages, page_bytes)

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
        self.control: AsyncLocalChannel | AsyncTcpControlChannel | AsyncGrpcChannel = grpc_channel
        self.data: _ArenaPages | AsyncTcpDataPath | None = None
        self.no_data_reason = ""                         # why data is None, for put/get to say
        self.arena_channel: LocalChannel | None = None   # the arena came over it; open while the mapping is used
        self.namespace_ids: dict[Namespace, int] = {}
        self.transfer = TransferRate()                   # what its gets moved a second lately (load_estimate.py)

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
                    await self._open_tcp()
                return
            except (errors.Unavailable, errors.PermissionDenied, errors.TransportUnavailable, TimeoutError) as exc:
                if transport != "auto":
                    raise
                log.info("data plane %s cannot be used, trying the next: %s", name, exc)
                failures.append(f"{name}: {exc}")
        self.no_data_reason = "no data plane of the node works from here: " + "; ".join(failures)

    async def _open_tcp(self) -> None:
        """Pages over the TCP data plane, and the calls on a connection of their own beside them where it takes them."""
        hello = self.hello
        tls = self.credentials.tcp_tls() if hello.tcp_tls else None
        data = await asyncio.wait_for(AsyncTcpDataPath.open(hello.tcp_endpoint, hello.data_ticket, tls), self.timeout_s)
        try:
            if hello.tcp_calls:
                self.control = await asyncio.wait_for(
                    AsyncTcpControlChannel.open(hello.tcp_endpoint, hello.data_ticket, tls), self.timeout_s)
        except BaseException:
            data.close()
            raise
        self.data = data

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
        check_timeout_s(timeout_s)
        if transport not in ("auto", "shm", "tcp", "rdma"):
            raise errors.InvalidArgument(f"transport must be auto, shm, tcp or rdma, got {transport!r}")
        self._target, self._timeout_s, self._transport, self._client_name = (node_target(target), timeout_s,
                                                                             transport, client_name)
        self._credentials = Credentials.resolve(token=token, tls_ca=tls_ca, tls_cert=tls_cert, tls_key=tls_key)
        self._conn: _Connection | None = None
        self._opening = asyncio.Lock()
        self._closed = False
        # As KVStoreClient.on_hot: told (namespace, [(key, checksum)]) of loaded pages the node flagged hot.
        self.on_hot: Callable[[Namespace, list[tuple[bytes, int]]], None] | None = None

    async def connect(self) -> "AsyncKVStoreClient":
        await self._connection()
        return self

    @property
    def transport(self) -> str:
        """The data plane pages move over: "shm" or "tcp"; "none" when they cannot (control calls only)."""
        return self._conn.data.name if self._conn is not None and self._conn.data is not None else "none"

    # -- the same methods as KVStoreClient, each written once in node_calls.py ------------

    async def put(self, namespace: Namespace, keys: Sequence[Key] | None = None, buffers: Any = None,
                  parent: Key | None = None, verify: bool = False, durable: bool = False, *,
                  tokens: Any = None, timeout_s: float | None = None, anchor: Key | None = None,
                  parents: Sequence[Key | None] | None = None) -> PutResult:
        """KVStoreClient.put: store pages; a PutResult counts the leading keys stored and says why it is short."""
        return await self._run(node_calls.put(namespace, keys, buffers, parent, verify, durable, tokens, anchor,
                                              parents), timeout_s)

    async def get(self, namespace: Namespace, keys: Sequence[Key] | None = None, out: Any = None,
                  verify: bool = False, policy: str = "wait_complete", timeout_ms: int = 0, *,
                  tokens: Any = None, timeout_s: float | None = None, wait_ms: int = 0) -> int:
        """KVStoreClient.get: copy the leading stored pages into `out`; returns how many were loaded."""
        return await self._run(node_calls.get(namespace, keys, out, verify, policy, timeout_ms, tokens, wait_ms,
                                              self.on_hot), timeout_s)

    async def lookup(self, namespace: Namespace, keys: Sequence[Key] | None = None, tokens: Any = None, *,
                     timeout_s: float | None = None) -> int:
        """KVStoreClient.lookup: a prompt of any length in one call, its parts sent at once (lookup.py)."""
        return await self._run(node_calls.lookup(namespace, keys, tokens), timeout_s)

    async def held(self, namespace: Namespace, keys: Sequence[Key], *, timeout_s: float | None = None) -> list[bool]:
        """KVStoreClient.held: whether the node holds each key's page, its Lookups sent at once."""
        return await self._run(node_calls.held(namespace, keys), timeout_s)

    async def residency(self, namespace: Namespace, keys: Sequence[Key] | None = None, tokens: Any = None,
                        engine_ids: Sequence[str] = (), *, timeout_s: float | None = None) -> Residency:
        """KVStoreClient.residency: the store's prefix by tier and each named engine's, in one call."""
        return await self._run(node_calls.residency(namespace, keys, tokens, engine_ids), timeout_s)

    async def route(self, namespace: Namespace, engine_ids: Sequence[str], keys: Sequence[Key] | None = None,
                    tokens: Any = None, *, timeout_s: float | None = None) -> pb.RouteResponse:
        """KVStoreClient.route."""
        return await self._run(node_calls.route(namespace, engine_ids, keys, tokens), timeout_s)

    async def delete(self, namespace: Namespace, keys: Sequence[Key], *, timeout_s: float | None = None) -> int:
        """KVStoreClient.delete."""
        return await self._run(node_calls.delete(namespace, keys), timeout_s)

    async def clear(self, namespace: Namespace, *, timeout_s: float | None = None) -> int:
        """KVStoreClient.clear."""
        return await self._run(node_calls.clear(namespace), timeout_s)

    async def list_keys(self, namespace: Namespace, *, timeout_s: float | None = None) -> list[bytes]:
        """KVStoreClient.list_keys."""
        return await self._run(node_calls.list_keys(namespace), timeout_s)

    async def list_pages(self, namespace: Namespace, *, timeout_s: float | None = None) -> PageSnapshot:
        """KVStoreClient.list_pages."""
        return await self._run(node_calls.list_pages(namespace), timeout_s)

    async def events_run(self, namespace: Namespace, *, timeout_s: float | None = None) -> bytes:
        """KVStoreClient.events_run."""
        return await self._run(node_calls.events_run(namespace), timeout_s)

    # -- page groups (groups.py) ---------------------------------------------------------

    async def stage(self, namespace: Namespace, keys: Sequence[Key] | None = None, buffers: Any = None,
                    parent: Key | None = None, verify: bool = False, *, tokens: Any = None,
                    anchor: Key | None = None, timeout_s: float | None = None,
                    parents: Sequence[Key | None] | None = None) -> StagedPages:
        """KVStoreClient.stage: write pages into slots without making them visible, for commit_group()."""
        return await self._run(node_calls.stage(namespace, keys, buffers, parent, verify, tokens, anchor, parents),
                               timeout_s)

    async def commit_group(self, parts: Sequence[StagedPages], *, timeout_s: float | None = None) -> list[PutResult]:
        """KVStoreClient.commit_group: every staged page of every part visible in one step, or none (the group's
        leases are then aborted and the node's error raised)."""
        return await self._run(node_calls.commit_group(parts), timeout_s)

    async def abort_staged(self, parts: Sequence[StagedPages], *, timeout_s: float | None = None) -> None:
        """KVStoreClient.abort_staged."""
        return await self._run(node_calls.abort_staged(parts), timeout_s)

    async def put_group(self, keys: Sequence[Key], parts: Sequence[tuple[Namespace, Any]], parent: Key | None = None,
                        verify: bool = False, *, anchor: Key | None = None,
                        timeout_s: float | None = None) -> PutResult:
        """KVStoreClient.put_group: each key's pages of every namespace become visible together."""
        return await self._run(node_calls.put_group(keys, parts, parent, verify, anchor), timeout_s)

    async def lookup_group(self, keys: Sequence[Key], parts: Sequence[GroupPart], *,
                           timeout_s: float | None = None) -> GroupHits:
        """KVStoreClient.lookup_group: the prefixes every part can restore, from one snapshot of the node."""
        return await self._run(node_calls.lookup_group(keys, parts), timeout_s)

    async def get_group(self, parts: Sequence[tuple[Namespace, Sequence[Key], Any]], verify: bool = False,
                        policy: str = "wait_complete", *, timeout_s: float | None = None) -> list[int]:
        """KVStoreClient.get_group: every part pinned in one step, a key loaded in every part or in none."""
        return await self._run(node_calls.get_group(parts, verify, policy), timeout_s)

    async def stats(self, *, timeout_s: float | None = None) -> pb.StatsResponse:
        """KVStoreClient.stats."""
        return await self._run(node_calls.stats(), timeout_s)

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

    async def _run(self, call: Steps[T], timeout_s: float | None) -> T:
        """Await a call (node_calls.py) to its end, all of it within `timeout_s`."""
        if timeout_s is not None:
            check_timeout_s(timeout_s)
        try:
            async with asyncio.timeout(timeout_s):
                return await drive_async(call, self._on_node)
        except TimeoutError:
            raise errors.DeadlineExceeded(f"the call did not finish within its timeout_s={timeout_s}") from None

    async def _on_node(self, step: OnNode) -> Any:
        """Take a call's OnNode step: its attempt on a standing connection; if the node was lost under it and the
        step allows, once more on a new one (as KVStoreClient does)."""
        conn = await self._connection()
        try:
            return await self._attempt(step, conn)
        except errors.Unavailable:
            if not step.may_retry():
                raise
            log.info("the connection to %s was lost during a call; calling again on a new one", self._target)
        return await self._attempt(step, await self._connection())

    @staticmethod
    async def _attempt(step: OnNode, conn: _Connection) -> Any:
        if step.needs_data and conn.data is None:
            raise errors.TransportUnavailable(conn.no_data_reason)
        try:
            return await drive_async(step.attempt(conn), take_async_on(conn))
        except errors.KVStoreError as exc:
            reported = lost_under(exc, conn)
            if reported is exc:
                raise
            raise reported from exc

    async def _connection(self) -> _Connection:
        """The standing connection, or a new one in place of one found lost (no round trip)."""
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
