"""KVStoreCluster: one pool of KV pages across the kvstore nodes registered in etcd.

    with KVStoreCluster("etcd://10.0.0.1:2379/prod") as cluster:
        cluster.put(ns, keys, pages)            # keys: a chain from its first page
        loaded = cluster.get(ns, keys, out)

Membership comes from etcd (membership.py) and placement is computed here without asking
anyone (placement.py): each chain segment of `segment_pages` pages lives on one node, the
first `replicated_segments` segments (where shared system prompts sit) on `replicas` nodes. Every call asks all the nodes it needs at once, in
one round. Each node is reached over its best data plane (data_plane() decides, from the
node's record alone): shared memory when it runs on this host (same host id), else RDMA when
the node advertises it and the cluster was given `rdma=RdmaOptions(...)`, else TCP. An RDMA
node's client falls back to TCP as KVStoreClient's transport="auto" does, at connect and
mid-session, whenever RDMA cannot start or breaks (no device, port down, a refused peer).

A lost node costs misses, not errors: get and lookup count its pages as absent, put stops
counting at its segment. A get of a replicated segment that one replica misses (or cannot
answer) reads it from the next. No call returns, not even with an error, before every piece it
started has ended: a piece still running may be copying into the caller's buffer. A node that stops renewing its etcd lease leaves the view within
one lease TTL and its segments are placed on the others. Errors a caller can act on (bad
input, a full node, a refused identity) are raised as in KVStoreClient.

Every node connection carries the same identity, given as KVStoreClient takes it: `token`,
`tls_ca`, `tls_cert`, `tls_key`, each one left None read from KVSTORE_TOKEN, KVSTORE_TLS_CA,
KVSTORE_TLS_CERT, KVSTORE_TLS_KEY (credentials.py). A node that refuses it answers
errors.Unauthenticated (or PermissionDenied), raised to the caller, not counted as a miss.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from concurrent.futures import Executor, ThreadPoolExecutor, wait
from typing import Any, Callable, Sequence, TypeVar
from urllib.parse import urlsplit

from kvstore_client import errors, lookup, placement
from kvstore_client.buffers import page_segments
from kvstore_client.client import KVStoreClient
from kvstore_client.credentials import Credentials
from kvstore_client.keys import Key, Namespace, encode_keys
from kvstore_client.membership import Member, MembershipView, local_host_id
from kvstore_client.rdma_transport import RdmaOptions

log = logging.getLogger(__name__)

T = TypeVar("T")

# What a lost or leaving node answers with: the call on it reads as a miss.
NODE_LOST = (errors.Unavailable, errors.DeadlineExceeded, errors.Draining, errors.TransportUnavailable)


def parse_cluster_url(url: str) -> tuple[list[str], str]:
    """'etcd://h1:2379,h2:2379/prod' -> (['h1:2379', 'h2:2379'], 'prod')."""
    parts = urlsplit(url)
    cluster = parts.path.strip("/")
    if parts.scheme != "etcd" or not parts.netloc or not cluster or "/" in cluster:
        raise errors.InvalidArgument(f"cluster URL {url!r} must look like etcd://host:2379[,host:2379]/<cluster>")
    return parts.netloc.split(","), cluster


class KVStoreCluster:
    def __init__(self, url: str, *, timeout_s: float = 5.0, transport: str = "auto", segment_pages: int = 16,
                 replicas: int = 3, replicated_segments: int = 2, client_name: str = "", members_wait_s: float = 5.0,
                 token: str | None = None, tls_ca: str | None = None, tls_cert: str | None = None,
                 tls_key: str | None = None, rdma: RdmaOptions | None = None):
        """`transport`: "auto" (shm on this host, else RDMA or TCP) or "tcp" (TCP to every node).
        `token`, `tls_*`: who this client is to every node (see above). `rdma`: this host's NIC settings
        (rdma_transport.RdmaOptions); given, nodes that advertise RDMA are reached over it; None = TCP."""
        if transport not in ("auto", "tcp"):
            raise errors.InvalidArgument(f"transport must be 'auto' or 'tcp', got {transport!r}")
        placement.check_layout(segment_pages, replicas, replicated_segments)
        endpoints, self.cluster = parse_cluster_url(url)
        self._credentials = Credentials.resolve(token=token, tls_ca=tls_ca, tls_cert=tls_cert, tls_key=tls_key)
        self.segment_pages = segment_pages
        self.replicas = replicas
        self.replicated_segments = replicated_segments
        self._timeout_s = timeout_s
        self._transport = transport
        self._rdma = rdma
        self._client_name = client_name
        self._host_id = local_host_id()
        self._lock = threading.Lock()
        self._nodes: dict[str, tuple[Member, KVStoreClient]] = {}
        self._pool = ThreadPoolExecutor(max_workers=32, thread_name_prefix="kvstore-cluster")
        self._view = MembershipView(endpoints, self.cluster, timeout_s=min(timeout_s, 3.0))
        if not self._view.wait_listed(members_wait_s):
            log.warning("no membership from etcd at %s after %.1fs: every call misses until it answers",
                        ",".join(endpoints), members_wait_s)

    # -- public API -------------------------------------------------------------------

    def members(self) -> list[Member]:
        return sorted(self._view.members(), key=lambda m: m.node_id)

    @property
    def etcd_lost(self) -> bool:
        return bool(self._view.etcd_lost_since)

    def put(self, namespace: Namespace, keys: Sequence[Key], buffers: Any, skip_pages: int = 0) -> int:
        """Store a chain's pages; returns how many leading pages of the chain are stored.

        `keys` run from the chain's first page (they fix where each segment lives); `buffers`
        hold the pages of keys[skip_pages:] only: the leading `skip_pages` were stored by an
        earlier call (a prefill engine storing each chunk as soon as it is computed).
        """
        raw = _chain_keys(keys, skip_pages)
        pages, keepalive = page_segments(buffers, len(raw) - skip_pages, namespace.page_bytes, writable=False)
        segments = self._plan(raw)

        def put_piece(segment: placement.Segment, node_id: str) -> int:
            first = max(segment.start, skip_pages)        # a node holds a segment as a chain from its first page
            parent = raw[first - 1] if first > segment.start else None
            stored = self._node(node_id).put(namespace, raw[first:segment.stop],
                                             pages[first - skip_pages:segment.stop - skip_pages], parent=parent)
            return first - segment.start + stored

        calls = [(segment, node_id) for segment in segments if segment.stop > skip_pages for node_id in segment.nodes]
        counts = fan_out(self._pool, [(lambda s=s, n=n: put_piece(s, n)) for s, n in calls], miss=0)
        stored_by_segment = {s.start: s.stop - s.start for s in segments if s.stop <= skip_pages}
        for (segment, _), count in zip(calls, counts):    # a replicated segment is stored if any replica has it
            stored_by_segment[segment.start] = max(stored_by_segment.get(segment.start, 0), count)
        del keepalive
        return _leading(segments, stored_by_segment)

    def get(self, namespace: Namespace, keys: Sequence[Key], out: Any, wait_ms: int = 0, skip_pages: int = 0) -> int:
        """Copy the chain's leading stored pages into `out`; returns how many were loaded.

        `wait_ms`: each node waits up to that long for its pages not yet committed (a
        producer writing them now); segments are waited for in parallel. `skip_pages`: the
        leading pages the caller already holds; `out` then holds keys[skip_pages:] only and
        the count is of those (a decode engine asking again for the rest).
        """
        raw = _chain_keys(keys, skip_pages)
        pages, keepalive = page_segments(out, len(raw) - skip_pages, namespace.page_bytes, writable=True)
        segments = [s for s in self._plan(raw) if s.stop > skip_pages]

        def get_piece(segment: placement.Segment) -> int:
            first = max(segment.start, skip_pages)
            best, lost = 0, None
            for node_id in _readers(segment):   # the next replica when one misses or is lost
                try:
                    got = self._node(node_id).get(
                        namespace, raw[first:segment.stop], pages[first - skip_pages:segment.stop - skip_pages],
                        wait_ms=wait_ms, timeout_s=self._timeout_s + wait_ms / 1000)
                except NODE_LOST as exc:
                    lost = exc
                    continue
                best = max(best, got)
                if first + best == segment.stop:
                    break
            if not best and lost is not None:
                raise lost
            return first - segment.start + best

        placed = [s for s in segments if s.nodes]
        counts = fan_out(self._pool, [(lambda s=s: get_piece(s)) for s in placed], miss=0)
        del keepalive
        if not segments:
            return 0
        held = skip_pages - segments[0].start              # pages of the first segment the caller holds
        counts_by_start = {s.start: c for s, c in zip(placed, counts)}
        counts_by_start[segments[0].start] = max(counts_by_start.get(segments[0].start, 0), held)
        return _leading(segments, counts_by_start) - held

    def lookup(self, namespace: Namespace, keys: Sequence[Key] | None = None, tokens: Any = None) -> int:
        """How many leading pages of the chain are stored in the cluster: one parallel round.

        By keys, or by token ids (a list, numpy array or tensor): those are hashed here with the
        namespace's chain (keys.prefix_hashes), so placement sees the same keys a put by keys did.
        """
        raw = lookup.chain_keys(namespace, keys, tokens)
        segments = [s for s in self._plan(raw) if s.nodes]
        counts = fan_out(self._pool, [(lambda s=s: self._node(_readers(s)[0]).lookup(namespace,
                                                                                  keys=raw[s.start:s.stop]))
                                      for s in segments], miss=0)
        return _leading(self._plan(raw), {s.start: c for s, c in zip(segments, counts)})

    def delete(self, namespace: Namespace, keys: Sequence[Key]) -> int:
        """Remove the chain's pages on every node that holds them; returns pages removed."""
        raw = encode_keys(keys)
        calls = [(segment, node_id) for segment in self._plan(raw) for node_id in segment.nodes]
        counts = fan_out(self._pool, [(lambda s=s, n=n: self._node(n).delete(namespace, raw[s.start:s.stop]))
                                      for s, n in calls], miss=0)
        return sum(counts)

    def stats(self) -> dict[str, Any]:
        """Each reachable member's StatsResponse, by node id (a lost node is left out)."""
        members = self.members()
        answers = fan_out(self._pool, [(lambda m=m: self._node(m.node_id).stats()) for m in members], miss=None)
        return {m.node_id: a for m, a in zip(members, answers) if a is not None}

    def close(self) -> None:
        self._view.close()
        self._pool.shutdown(wait=True)
        with self._lock:
            nodes, self._nodes = self._nodes, {}
        for _, client in nodes.values():
            client.close()

    def __enter__(self) -> "KVStoreCluster":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- placement and nodes ----------------------------------------------------------

    def _plan(self, raw: list[bytes]) -> list[placement.Segment]:
        weights = placement.placeable(self._view.members(), time.time())
        return placement.plan(raw, weights, self.segment_pages, self.replicas, self.replicated_segments)

    def _node(self, node_id: str) -> KVStoreClient:
        """The client of a member, opened on first use (and again when its record changed)."""
        member = next((m for m in self._view.members() if m.node_id == node_id), None)
        if member is None:
            raise errors.Unavailable(f"node {node_id} left the cluster")
        with self._lock:
            known = self._nodes.get(node_id)
            if known is not None and known[0].grpc_address == member.grpc_address:
                return known[1]
        client = self._open(member)
        with self._lock:
            known = self._nodes.get(node_id)
            if known is not None and known[0].grpc_address == member.grpc_address:
                stale, client = client, known[1]      # another call opened it meanwhile
            else:
                stale = known[1] if known is not None else None
                self._nodes[node_id] = (member, client)
        if stale is not None:
            stale.close()
        return client

    def _open(self, member: Member) -> KVStoreClient:
        """A client of `member` over the data plane data_plane() picks for it."""
        plane = data_plane(member, self._host_id, self._transport, self._rdma is not None)
        who = self._credentials
        # RDMA: KVStoreClient's "auto" tries it, then TCP (shared memory, tried first, fails on another host:
        # the socket is absent or answers another node's instance id).
        transport = "tcp" if plane == "tcp" else "auto"
        client = KVStoreClient(member.grpc_address, timeout_s=self._timeout_s, transport=transport,
                               control="local" if plane == "shm" else "grpc", client_name=self._client_name,
                               rdma=self._rdma if plane == "rdma" else None,
                               token=who.token, tls_ca=who.tls_ca, tls_cert=who.tls_cert, tls_key=who.tls_key)
        if plane == "rdma" and client.transport != "rdma":
            log.warning("node %s advertises RDMA but it cannot be used from here: its pages move over %s",
                        member.node_id, client.transport)
        return client


def data_plane(member: Member, host_id: str, transport: str, rdma_given: bool) -> str:
    """The data plane a node is reached over: "shm", "rdma" or "tcp" (a pure decision, from its record)."""
    if transport == "tcp":
        return "tcp"
    if member.host_id == host_id:
        return "shm"
    return "rdma" if member.rdma and rdma_given else "tcp"


def fan_out(pool: Executor, calls: list[Callable[[], T]], miss: Any) -> list[Any]:
    """Run the calls at once and wait for every one to end; a call on a lost node answers `miss`. Any other
    error is raised, but only once all have ended: one still running may be writing into a caller's buffer."""
    futures = [pool.submit(call) for call in calls]
    wait(futures)
    results, failure = [], None
    for future in futures:
        exc = future.exception()
        if exc is None:
            results.append(future.result())
            continue
        if not isinstance(exc, NODE_LOST):
            failure = failure or exc
        else:
            log.info("a node did not answer (%s: %s): counted as a miss", type(exc).__name__, exc)
        results.append(miss)
    if failure is not None:
        raise failure
    return results


def _readers(segment: placement.Segment) -> list[str]:
    """The replicas a read tries, in order: any of them first, so a shared prefix's reads spread."""
    if len(segment.nodes) <= 1:
        return list(segment.nodes)
    first = random.randrange(len(segment.nodes))
    return [*segment.nodes[first:], *segment.nodes[:first]]


def _chain_keys(keys: Sequence[Key], skip_pages: int) -> list[bytes]:
    raw = encode_keys(keys)
    if not 0 <= skip_pages <= len(raw):
        raise errors.InvalidArgument(f"skip_pages {skip_pages} is outside the chain of {len(raw)} pages")
    return raw


def _leading(segments: list[placement.Segment], counts: dict[int, int]) -> int:
    """Leading pages present: whole segments in order, then the first partial one."""
    total = 0
    for segment in segments:
        count = counts.get(segment.start, 0)
        total += count
        if count < segment.stop - segment.start:
            break
    return total
