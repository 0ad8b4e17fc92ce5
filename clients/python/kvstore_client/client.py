"""KVStoreClient: store and load KV pages by prefix hash through a kvstore-server.

    with KVStoreClient("127.0.0.1:50051") as client:
        ns = Namespace(model="llama-3-8b", page_bytes=page.nbytes, page_tokens=64)
        keys = prefix_hashes(prompt_tokens, page_tokens=64)
        client.put(ns, keys, pages)                # pages: array/tensor/list/(ptr, nbytes)
        loaded = client.get(ns, keys, out)         # leading pages copied into `out`

A miss is a result (a count below len(keys)), never an exception. Page bytes move over
one data plane (`transport`, see transport_choice.py): the shared-memory arena on the
node's host, else RDMA, else TCP. With shared memory, control messages go over the
server's Unix socket when `control="local"` (the default; see framing.py for why) or over
gRPC; with TCP or RDMA (another host) they go over gRPC.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Iterator, Sequence

from kvstore_client import errors
from kvstore_client.arena import ArenaMapping, checksums_available
from kvstore_client.buffers import Segment, page_segments
from kvstore_client.channel import GrpcChannel, LocalChannel, Pending
from kvstore_client.keys import Key, Namespace, encode_key, encode_keys
from kvstore_client.proto import pb
from kvstore_client.remote_pages import RemotePages
from kvstore_client.tcp_transport import TcpDataPath
from kvstore_client.transport_choice import candidates

log = logging.getLogger(__name__)

# A copy into or out of a leased slot must end this long before the lease can expire.
LEASE_MARGIN_S = 0.5
# A put is a pipeline: the server reserves the next group of pages while this one is
# copied, and checksums each committed run of pages while the next run is copied. Runs are
# short so the server reads them back while they are still in the shared L3 cache (a
# second stream from DRAM slows the copy itself by a third), and the last run's checksum,
# which nothing overlaps, is brief. Each message costs tens of microseconds, which is
# why small pages go in larger groups.
RESERVE_GROUP_PAGES = 32
COMMIT_RUN_BYTES = 2 << 20

_STORED_STATES = (pb.RESERVED, pb.PRESENT, pb.IN_FLIGHT)
_PREFETCH_POLICIES = {"wait_complete": pb.WAIT_COMPLETE, "best_effort": pb.BEST_EFFORT, "timeout": pb.TIMEOUT}


class KVStoreClient:
    def __init__(self, target: str, *, timeout_s: float = 5.0, control: str = "local", client_name: str = "",
                 transport: str = "auto", tcp_congestion: str = ""):
        if control not in ("local", "grpc"):
            raise ValueError(f"control must be 'local' or 'grpc', got {control!r}")
        self._grpc = GrpcChannel(target, timeout_s)
        self._local: LocalChannel | None = None
        self._arena: ArenaMapping | None = None
        self._remote: RemotePages | None = None
        try:
            hello = self._grpc.call("Hello", pb.HelloRequest(client_name=client_name))
            self.transport = self._open_data_path(hello, transport, timeout_s, tcp_congestion)
        except BaseException:
            self.close()
            raise
        self.limits = hello.limits
        self.server_version = hello.server_version
        self._control = self._local if self._local is not None and control == "local" else self._grpc
        self._namespace_ids: dict[Namespace, int] = {}

    # -- public API -------------------------------------------------------------------

    def put(self, namespace: Namespace, keys: Sequence[Key], buffers: Any, parent: Key | None = None,
            verify: bool = False) -> int:
        """Store pages under their keys; returns how many leading keys are now cached.

        `parent` is the key of the page before keys[0] (None at the start of a sequence).
        A key already cached (or being written by another client) is not copied again.
        The server always checksums a page at commit; `verify=True` also hashes each page
        here as it is copied, so the server refuses a slot that does not hold what this
        process wrote (needs xxhash).
        """
        _check_verify(verify)
        raw_keys = encode_keys(keys)
        segments, keepalive = page_segments(buffers, len(raw_keys), namespace.page_bytes, writable=False)
        parent_key = encode_key(parent) if parent is not None else b""
        stored = 0
        for start, stop in self._batches(len(raw_keys)):
            batch_stored = self._reopening(namespace, lambda: self._put_batch(
                namespace, parent_key, raw_keys[start:stop], segments[start:stop], verify))
            stored += batch_stored
            if batch_stored < stop - start:
                break
            parent_key = raw_keys[stop - 1]
        del keepalive
        return stored

    def get(self, namespace: Namespace, keys: Sequence[Key], out: Any, verify: bool = False,
            policy: str = "wait_complete", timeout_ms: int = 0) -> int:
        """Copy the leading cached pages into `out`; returns how many were loaded.

        Pages only on the node's NVMe tier come up into DRAM first; `policy` says how long
        to wait for them: "wait_complete" (all), "best_effort" (only what is in DRAM now;
        the rest is prefetched for next time) or "timeout" (up to `timeout_ms`).
        """
        if policy not in _PREFETCH_POLICIES:
            raise errors.InvalidArgument(f"policy must be one of {sorted(_PREFETCH_POLICIES)}, got {policy!r}")
        _check_verify(verify)
        raw_keys = encode_keys(keys)
        segments, keepalive = page_segments(out, len(raw_keys), namespace.page_bytes, writable=True)
        loaded = 0
        for start, stop in self._batches(len(raw_keys)):
            request = pb.AcquireRequest(keys=raw_keys[start:stop], policy=_PREFETCH_POLICIES[policy],
                                        timeout_ms=timeout_ms)
            batch_loaded = self._get_batch(namespace, request, segments[start:stop], verify)
            loaded += batch_loaded
            if batch_loaded < stop - start:
                break
        del keepalive
        return loaded

    def lookup(self, namespace: Namespace, keys: Sequence[Key] | None = None, tokens: Sequence[int] | None = None) -> int:
        """How many leading pages are cached, by keys or by token ids. Extends no lease."""
        if (keys is None) == (tokens is None):
            raise ValueError("pass exactly one of keys or tokens")
        request = pb.LookupRequest(keys=encode_keys(keys or ()), tokens=list(tokens or ()))
        return self._call_in(namespace, "Lookup", request).hit_pages

    def route(self, namespace: Namespace, engine_ids: Sequence[str], keys: Sequence[Key] | None = None,
              tokens: Sequence[int] | None = None) -> pb.RouteResponse:
        """Score candidate engines by how much of this prefix each can reuse (its GPU, then this store)."""
        if (keys is None) == (tokens is None):
            raise ValueError("pass exactly one of keys or tokens")
        request = pb.RouteRequest(keys=encode_keys(keys or ()), tokens=list(tokens or ()), engine_ids=list(engine_ids))
        return self._call_in(namespace, "Route", request)

    def delete(self, namespace: Namespace, keys: Sequence[Key]) -> int:
        """Remove pages and every page that extends them; returns pages removed."""
        return self._call_in(namespace, "Delete", pb.DeleteRequest(keys=encode_keys(keys))).deleted_pages

    def clear(self, namespace: Namespace) -> int:
        """Remove every page of the namespace; returns pages removed."""
        return self._call_in(namespace, "Delete", pb.DeleteRequest(all_pages=True)).deleted_pages

    def stats(self) -> pb.StatsResponse:
        return self._control.call("Stats", pb.StatsRequest())

    def close(self) -> None:
        if self._remote is not None:
            self._remote.close()
            self._remote = None
        if self._local is not None:
            self._local.close()
        if getattr(self, "_arena", None) is not None:
            self._arena.close()
            self._arena = None
        self._grpc.close()

    def __enter__(self) -> "KVStoreClient":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- data path --------------------------------------------------------------------

    def _open_data_path(self, hello: pb.HelloResponse, requested: str, timeout_s: float, tcp_congestion: str) -> str:
        from kvstore_client import rdma_transport  # imports pyverbs only when a device is looked for

        order = candidates(requested, bool(hello.shm_socket), hello.rdma_enabled, bool(hello.tcp_endpoint),
                           hello.rdma_enabled and rdma_transport.device_present())
        failures = []
        for name in order:
            try:
                if name == "shm":
                    self._open_shm(hello, timeout_s)
                elif name == "rdma":
                    self._remote = RemotePages(self._grpc, rdma_transport.RdmaDataPath(self._grpc))
                else:
                    self._remote = RemotePages(self._grpc, TcpDataPath(hello.tcp_endpoint, timeout_s, tcp_congestion))
                return name
            except (errors.Unavailable, errors.PermissionDenied, errors.TransportUnavailable) as exc:
                if requested != "auto":
                    raise
                log.info("data plane %s cannot be used, trying the next: %s", name, exc)
                failures.append(f"{name}: {exc}")
        raise errors.TransportUnavailable("no data plane of the node works from here: " + "; ".join(failures))

    def _open_shm(self, hello: pb.HelloResponse, timeout_s: float) -> None:
        local = LocalChannel(hello.shm_socket, timeout_s)
        try:
            arena = ArenaMapping(local.map_arena_fd())
            if local.call("Hello", pb.HelloRequest()).instance_id != hello.instance_id:
                arena.close()
                raise errors.Unavailable(f"{hello.shm_socket} on this host belongs to another kvstore node")
        except BaseException:
            local.close()
            raise
        self._local, self._arena = local, arena

    # -- batches ----------------------------------------------------------------------

    def _put_batch(self, namespace: Namespace, parent: bytes, keys: list[bytes], segments: list[list[Segment]],
                   verify: bool) -> int:
        """Reserve, copy and commit one batch as a pipeline of groups (see channel.py).

        While the pages of group g are copied, the server already reserves group g+1
        (extending the same write lease) and checksums the runs of pages committed so far.
        """
        ns_id = self._namespace_id(namespace)
        if self._remote is not None:
            return self._remote.put_batch(ns_id, namespace.page_bytes, parent, keys, segments, verify)
        control = self._control
        group = RESERVE_GROUP_PAGES
        run = max(1, COMMIT_RUN_BYTES // namespace.page_bytes)

        def reserve(start: int, lease_id: int, parent_key: bytes) -> tuple[float, Pending]:
            request = pb.ReserveRequest(namespace_id=ns_id, parent_key=parent_key, keys=keys[start:start + group],
                                        page_bytes=namespace.page_bytes, lease_id=lease_id)
            return time.monotonic(), control.submit("Reserve", request)

        states: list[int] = []
        commits = []
        leases: set[int] = set()
        sent_at, next_reserve = reserve(0, 0, parent)
        copy_until = 0.0
        try:
            for start in range(0, len(keys), group):
                reserved = next_reserve.result()
                group_states = list(reserved.states)
                states += group_states
                reserved_indices = [i for i, state in enumerate(group_states) if state == pb.RESERVED]
                if reserved.lease_id not in leases and reserved.lease_id:
                    leases.add(reserved.lease_id)
                    copy_until = sent_at + reserved.lease_ttl_ms / 1000 - LEASE_MARGIN_S
                chain_goes_on = all(state in _STORED_STATES for state in group_states)
                if start + group < len(keys) and chain_goes_on:
                    # Extend the lease only while it certainly holds uncommitted slots (this group's).
                    live = reserved.lease_id if reserved_indices else 0
                    _, next_reserve = reserve(start + group, live, keys[start + len(group_states) - 1])
                for first in range(0, len(reserved_indices), run):
                    commits.append(self._copy_and_commit(reserved, reserved_indices[first:first + run], segments,
                                                         start, namespace.page_bytes, copy_until, verify))
                if not chain_goes_on:
                    break
            answers = [commit.result() for commit in commits]
        except BaseException:
            for lease_id in leases:
                control.post("Abort", pb.AbortRequest(lease_id=lease_id))
            raise
        committed = iter(state for answer in answers for state in answer.states)
        stored = 0
        for state in states:
            if state == pb.RESERVED and next(committed) != pb.COMMITTED:
                break
            if state not in _STORED_STATES:
                break
            stored += 1
        return stored

    def _copy_and_commit(self, reserved: pb.ReserveResponse, indices: list[int], segments: list[list[Segment]],
                         start: int, page_bytes: int, copy_until: float, verify: bool) -> Pending:
        """Copy a run of pages (keys[start + i] for i in indices) into their slots, then submit its commit."""
        arena = self._arena
        checksums = []
        for i in indices:
            if time.monotonic() > copy_until:
                raise errors.LeaseNotFound("the write lease would expire before the copy finished; "
                                           "raise leases.write_ttl_ms or put fewer pages per call")
            offset = reserved.offsets[i]
            arena.write(offset, segments[start + i])
            if verify:
                checksums.append(arena.checksum(offset, page_bytes))
        first = reserved.first_index
        request = pb.CommitRequest(lease_id=reserved.lease_id, indices=[first + i for i in indices],
                                   checksums=checksums)
        return self._control.submit("Commit", request)

    def _get_batch(self, namespace: Namespace, request: pb.AcquireRequest, segments: list[list[Segment]],
                   verify: bool) -> int:
        if self._remote is not None:
            remote = self._remote

            def call() -> int:
                request.namespace_id = self._namespace_id(namespace)
                return remote.get_batch(request, segments, verify)
            return self._reopening(namespace, call)
        sent_at = time.monotonic()
        acquired = self._call_in(namespace, "Acquire", request)
        hits = acquired.hit_pages
        if not hits:
            return 0
        arena = self._arena
        try:
            for index in range(hits):
                arena.read(acquired.offsets[index], segments[index])
            if verify:
                self._verify(acquired)
        finally:
            self._control.post("Release", pb.ReleaseRequest(lease_ids=[acquired.lease_id]))
        # The server's lease started after sent_at, so finishing before sent_at + ttl means
        # no page could have been evicted (and its slot reused) under the copy.
        if time.monotonic() > sent_at + acquired.lease_ttl_ms / 1000:
            raise errors.LeaseNotFound("the read lease expired during the copy; the pages may be torn")
        return hits

    def _verify(self, acquired: pb.AcquireResponse) -> None:
        for index in range(acquired.hit_pages):
            got = self._arena.checksum(acquired.offsets[index], acquired.page_bytes)
            if got != acquired.checksums[index]:
                raise errors.ChecksumMismatch(f"page {index} does not match its checksum")

    # -- helpers ----------------------------------------------------------------------

    def _batches(self, count: int) -> Iterator[tuple[int, int]]:
        step = self.limits.batch_pages_max
        for start in range(0, count, step):
            yield start, min(start + step, count)

    def _call_in(self, namespace: Namespace, method: str, request: Any) -> Any:
        """Call a namespace-scoped method (the namespace is filled in and reopened if need be)."""
        def call() -> Any:
            request.namespace_id = self._namespace_id(namespace)
            return self._control.call(method, request)
        return self._reopening(namespace, call)

    def _reopening(self, namespace: Namespace, action: Callable[[], Any]) -> Any:
        """Run `action`; if the server lost the namespace (it restarted), open it again and retry once."""
        try:
            return action()
        except errors.NamespaceNotFound:
            self._namespace_ids.pop(namespace, None)
            return action()

    def _namespace_id(self, namespace: Namespace) -> int:
        namespace_id = self._namespace_ids.get(namespace)
        if namespace_id is None:
            request = pb.OpenNamespaceRequest(spec=namespace.to_proto())
            namespace_id = self._control.call("OpenNamespace", request).namespace_id
            self._namespace_ids[namespace] = namespace_id
        return namespace_id


def _check_verify(verify: bool) -> None:
    if verify and not checksums_available():
        raise errors.InvalidArgument("verify=True needs the xxhash package (pip install kvstore-client[fast])")
