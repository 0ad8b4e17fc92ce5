"""KVStoreClient: store and load KV pages by prefix hash through a kvstore-server.

    with KVStoreClient("127.0.0.1:50051") as client:
        ns = Namespace(model="llama-3-8b", page_bytes=page.nbytes, page_tokens=64)
        keys = prefix_hashes(prompt_tokens, page_tokens=64)
        client.put(ns, keys, pages)                # pages: array/tensor/list/(ptr, nbytes)
        loaded = client.get(ns, keys, out)         # leading pages copied into `out`

A miss is a result (a count below len(keys)), never an exception. Control messages go
over the server's Unix socket when `control="local"` (the default; see framing.py for
why) or over gRPC; page bytes always move through the shared-memory arena.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Iterator, Sequence

from kvstore_client import errors
from kvstore_client.arena import ArenaMapping
from kvstore_client.buffers import Segment, page_segments
from kvstore_client.channel import GrpcChannel, LocalChannel
from kvstore_client.keys import Key, Namespace, encode_key, encode_keys
from kvstore_client.proto import pb

log = logging.getLogger(__name__)

# A copy into or out of a leased slot must end this long before the lease can expire.
LEASE_MARGIN_S = 0.5
# Pages committed per message, so the server checks one group while the next is copied.
COMMIT_GROUP_BYTES = 4 << 20

_STORED_STATES = (pb.RESERVED, pb.PRESENT, pb.IN_FLIGHT)


class KVStoreClient:
    def __init__(self, target: str, *, timeout_s: float = 5.0, control: str = "local", client_name: str = ""):
        if control not in ("local", "grpc"):
            raise ValueError(f"control must be 'local' or 'grpc', got {control!r}")
        self._grpc = GrpcChannel(target, timeout_s)
        self._local: LocalChannel | None = None
        try:
            hello = self._grpc.call("Hello", pb.HelloRequest(client_name=client_name))
            if not hello.shm_socket:
                raise errors.Unavailable("the server offers no shared-memory data plane")
            self._local = LocalChannel(hello.shm_socket, timeout_s)
            self._arena = ArenaMapping(self._local.map_arena_fd())
        except BaseException:
            self.close()
            raise
        self.limits = hello.limits
        self.server_version = hello.server_version
        self._control = self._local if control == "local" else self._grpc
        self._namespace_ids: dict[Namespace, int] = {}

    # -- public API -------------------------------------------------------------------

    def put(self, namespace: Namespace, keys: Sequence[Key], buffers: Any, parent: Key | None = None) -> int:
        """Store pages under their keys; returns how many leading keys are now cached.

        `parent` is the key of the page before keys[0] (None at the start of a sequence).
        A key already cached (or being written by another client) is not copied again.
        """
        raw_keys = encode_keys(keys)
        segments, keepalive = page_segments(buffers, len(raw_keys), namespace.page_bytes, writable=False)
        parent_key = encode_key(parent) if parent is not None else b""
        stored = 0
        for start, stop in self._batches(len(raw_keys)):
            batch_stored = self._put_batch(namespace, parent_key, raw_keys[start:stop], segments[start:stop])
            stored += batch_stored
            if batch_stored < stop - start:
                break
            parent_key = raw_keys[stop - 1]
        del keepalive
        return stored

    def get(self, namespace: Namespace, keys: Sequence[Key], out: Any, verify: bool = False) -> int:
        """Copy the leading cached pages into `out`; returns how many were loaded."""
        raw_keys = encode_keys(keys)
        segments, keepalive = page_segments(out, len(raw_keys), namespace.page_bytes, writable=True)
        loaded = 0
        for start, stop in self._batches(len(raw_keys)):
            batch_loaded = self._get_batch(namespace, raw_keys[start:stop], segments[start:stop], verify)
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

    def delete(self, namespace: Namespace, keys: Sequence[Key]) -> int:
        """Remove pages and every page that extends them; returns pages removed."""
        return self._call_in(namespace, "Delete", pb.DeleteRequest(keys=encode_keys(keys))).deleted_pages

    def stats(self) -> pb.StatsResponse:
        return self._control.call("Stats", pb.StatsRequest())

    def close(self) -> None:
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

    # -- batches ----------------------------------------------------------------------

    def _put_batch(self, namespace: Namespace, parent: bytes, keys: list[bytes], segments: list[list[Segment]]) -> int:
        request = pb.ReserveRequest(parent_key=parent, keys=keys, page_bytes=namespace.page_bytes)
        sent_at = time.monotonic()
        reserved = self._call_in(namespace, "Reserve", request)
        states = list(reserved.states)
        todo = [i for i, state in enumerate(states) if state == pb.RESERVED]
        if todo:
            copy_until = sent_at + reserved.lease_ttl_ms / 1000 - LEASE_MARGIN_S
            groups = self._commit_groups(reserved, todo, segments, copy_until)
            try:
                answers = self._control.call_pipelined("Commit", groups)
            except BaseException:
                self._control.post("Abort", pb.AbortRequest(lease_id=reserved.lease_id))
                raise
            failed = [a for a in answers if isinstance(a, errors.KVStoreError)]
            if failed:
                self._control.post("Abort", pb.AbortRequest(lease_id=reserved.lease_id))
                raise failed[0]
            committed = [state for answer in answers for state in answer.states]
            for index, state in zip(todo, committed):
                if state != pb.COMMITTED:
                    states[index] = pb.PARENT_MISSING
        stored = 0
        for state in states:
            if state not in _STORED_STATES:
                break
            stored += 1
        return stored

    def _commit_groups(self, reserved: pb.ReserveResponse, todo: list[int], segments: list[list[Segment]],
                       copy_until: float) -> Iterator[pb.CommitRequest]:
        """Copy pages into their slots group by group, yielding the commit of each group."""
        page_bytes = sum(n for _, n in segments[0])
        group_pages = max(1, COMMIT_GROUP_BYTES // page_bytes)
        arena = self._arena
        for start in range(0, len(todo), group_pages):
            indices = todo[start:start + group_pages]
            checksums = []
            for index in indices:
                if time.monotonic() > copy_until:
                    raise errors.LeaseNotFound("the write lease would expire before the copy finished; "
                                               "raise lease_ttl_ms or put fewer pages per call")
                offset = reserved.offsets[index]
                arena.write(offset, segments[index])
                checksums.append(arena.checksum(offset, page_bytes))
            yield pb.CommitRequest(lease_id=reserved.lease_id, indices=indices,
                                   checksums=checksums if checksums[0] is not None else ())

    def _get_batch(self, namespace: Namespace, keys: list[bytes], segments: list[list[Segment]], verify: bool) -> int:
        sent_at = time.monotonic()
        acquired = self._call_in(namespace, "Acquire", pb.AcquireRequest(keys=keys))
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
            if got is None:
                raise errors.InvalidArgument("verify=True needs the xxhash package (pip install kvstore-client[fast])")
            if got != acquired.checksums[index]:
                raise errors.ChecksumMismatch(f"page {index} does not match its checksum")

    # -- helpers ----------------------------------------------------------------------

    def _batches(self, count: int) -> Iterator[tuple[int, int]]:
        step = self.limits.batch_pages_max
        for start in range(0, count, step):
            yield start, min(start + step, count)

    def _call_in(self, namespace: Namespace, method: str, request: Any) -> Any:
        """Call a namespace-scoped method, (re)opening the namespace when the server lost it."""
        for attempt in range(2):
            request.namespace_id = self._namespace_id(namespace)
            try:
                return self._control.call(method, request)
            except errors.NamespaceNotFound:
                if attempt:
                    raise
                self._namespace_ids.pop(namespace, None)
        raise AssertionError("unreachable")

    def _namespace_id(self, namespace: Namespace) -> int:
        namespace_id = self._namespace_ids.get(namespace)
        if namespace_id is None:
            request = pb.OpenNamespaceRequest(spec=namespace.to_proto())
            namespace_id = self._control.call("OpenNamespace", request).namespace_id
            self._namespace_ids[namespace] = namespace_id
        return namespace_id
