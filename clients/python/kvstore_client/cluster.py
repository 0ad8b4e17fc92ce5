"""KVStoreCluster: one pool of KV pages across the kvstore nodes registered in etcd.

    with KVStoreClient("etcd://10.0.0.1:2379/prod") as pool:     # a KVStoreCluster
        pool.put(ns, keys, pages)
        loaded = pool.get(ns, keys, out)

KVStoreClient(target) gives a KVStoreCluster when the target is a cluster URL, and this class has
KVStoreClient's methods, arguments, results and errors, so a caller (every adapter) need not know
which it holds. Each call is KVStoreClient's, made on every node that holds some of its pages:

- Membership comes from etcd (membership.py); placement is computed here without asking
  anyone (placement.py): each page lives on the node its own key ranks best. A call's pages are
  grouped by node and every node is asked at once, one round, one call per node.
- Hot pages spread, cold ones stay single (hot_pages.py): a node flags the pages it serves
  often (decayed read counts, kvstore/control/read_heat.py); a get that loaded flagged pages
  writes them, before it returns, to their other `replicas` best nodes, and this client's later
  reads of them go to any of those, a random one first.
- Each page is stored naming its true parent, the page before it in the chain, whichever node
  that lives on (Reserve's parent_keys): where the parent is on the same node the page hangs
  under it (kept prefix-closed, evicted leaf first), else it is anchored at the parent's key.
  `parent` therefore acts as `anchor`: the page before keys[0] lives on whichever node its key
  names.
- While a node ramps up after it joins (cluster.ramp_s), a read it misses asks the node the key
  had before it came, so a join costs no misses for pages already stored.
- Leading counts (put, get, lookup) are the chain's leading run over all nodes: a page a node
  misses ends it. A get or lookup whose page one replica misses (or cannot answer) asks the
  next replica for it, in a second round.
- A lost node costs misses, not errors: its pages count as absent, a put stops counting at its
  first page. Errors a caller can act on (bad input, a full node, a refused identity) are
  raised as by KVStoreClient, once every node's piece of the call has ended: no call returns,
  not even with an error, while a piece may still copy into the caller's buffer.
- Delete and clear go to every member. A node removes the keys' pages and what extends them
  there: their children, and pages anchored at the keys (pages whose parent lives elsewhere).
  It answers the keys it removed, and the next round asks every member for pages anchored at
  those, until a round removes nothing new: every page that extends a deleted key, on every
  node, is gone.
- Page groups: a key's parts live on the same nodes (placement ignores the namespace), so each
  node commits its positions whole; a group lookup folds each part's presence by the node's own
  rule (groups.fold). Nodes commit in parallel: a group one node refuses may be visible on the
  others, position by position, each whole.

Trust: with `tls_ca` (the CA of the nodes' certificates) a member counts only if its record is
signed under a certificate of that CA naming its node id, and each node is dialled checking that
its certificate names that id, before any token or page goes out (record_trust.py). etcd itself
is reached over TLS with `etcd_tls_*` (etcd.py).

Each node is reached over its best data plane (data_plane() decides, from the node's record
alone): shared memory when it runs on this host (same host id), else RDMA when the node
advertises it and the cluster was given `rdma=RdmaOptions(...)`, else TCP. Every node connection
carries the same identity (`token`, `tls_*`, or KVSTORE_TOKEN, KVSTORE_TLS_* as KVStoreClient reads
them). A node that stops renewing its etcd lease leaves the view within one lease TTL and its pages
are placed on the others.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import threading
import time
from concurrent.futures import Executor, ThreadPoolExecutor, wait
from typing import Any, Callable, Sequence, TypeVar
from urllib.parse import urlsplit

import numpy as np

from kvstore_client import checksums, errors, groups, lookup, node_calls, placement
from kvstore_client.arguments import (SPIN_US_DEFAULT, check_spin_us, check_timeout_s, engine_id_list, get_pages,
                                      parent_list, put_pages)
from kvstore_client.client import KVStoreClient
from kvstore_client.credentials import Credentials, EtcdTlsFiles
from kvstore_client.etcd import parse_endpoint
from kvstore_client.events import PageSnapshot
from kvstore_client.groups import GroupHits, GroupPart, StagedPages
from kvstore_client.hot_pages import HotPages, rotated
from kvstore_client.keys import Key, Namespace, encode_key, encode_keys
from kvstore_client.membership import Member, MembershipView, local_host_id
from kvstore_client.pipeline import PutResult
from kvstore_client.proto import pb
from kvstore_client.rdma_transport import RdmaOptions
from kvstore_client.load_estimate import LoadCosts
from kvstore_client.residency import EngineHeld, Residency
from kvstore_client.record_trust import RecordTrust
from kvstore_client.together import ask_together

log = logging.getLogger(__name__)

T = TypeVar("T")

DELETE_ROUNDS_MAX = 64    # a chain's pieces hang off each other across nodes a few levels deep, not 64
NOT_HELD = 255            # a residency answer's "no tier", above every Tier

# What a lost or leaving node answers with: the call on it reads as a miss.
NODE_LOST = (errors.Unavailable, errors.DeadlineExceeded, errors.Draining, errors.TransportUnavailable)


def parse_cluster_url(url: str) -> tuple[list[str], str]:
    """'etcd://h1:2379,h2:2379/prod' -> (['h1:2379', 'h2:2379'], 'prod'). Each endpoint is checked here,
    so a bad port or host is refused before any connection is tried."""
    shape = f"cluster URL {url!r} must look like etcd://host:2379[,host:2379]/<cluster>"
    try:
        parts = urlsplit(url)
    except ValueError as exc:   # urlsplit's own refusals (an unclosed IPv6 bracket) are bad input too
        raise errors.InvalidArgument(f"{shape} ({exc})") from None
    cluster = parts.path.strip("/")
    if parts.scheme != "etcd" or not parts.netloc or not cluster or "/" in cluster:
        raise errors.InvalidArgument(shape)
    endpoints = parts.netloc.split(",")
    for endpoint in endpoints:
        parse_endpoint(endpoint)
    return endpoints, cluster


@dataclasses.dataclass(eq=False)
class ClusterStaged:
    """A part of a group commit staged across nodes (KVStoreCluster.stage): each node's StagedPages, and the
    positions in `keys` each of them holds."""

    namespace: Namespace
    keys: list[bytes]
    pieces: dict[str, tuple[list[int], StagedPages]]

    @property
    def stored(self) -> int:
        flags = [False] * len(self.keys)
        for positions, staged in self.pieces.values():
            for i in positions[:staged.stored]:
                flags[i] = True
        return _leading_run(flags)

    @property
    def slots(self) -> dict[bytes, Any]:
        """The staged keys (over every node's lease), as StagedPages.slots names them."""
        return {key: slot for _, staged in self.pieces.values() for key, slot in staged.slots.items()}

    @property
    def commit_by(self) -> float:
        """When the first of its nodes' write leases may expire (time.monotonic())."""
        return min((staged.commit_by for _, staged in self.pieces.values()), default=float("inf"))

    def take(self, keys: Sequence[Key]) -> "ClusterStaged":
        """StagedPages.take on every node: the staged pages of these keys as a part of their own."""
        wanted = set(encode_keys(keys))
        kept = [i for i, key in enumerate(self.keys) if key in wanted]
        renumbered = {old: new for new, old in enumerate(kept)}
        pieces = {}
        for node_id, (positions, staged) in self.pieces.items():
            mine = [renumbered[p] for p in positions if p in renumbered]
            if mine:
                pieces[node_id] = (mine, staged.take(keys))
        return ClusterStaged(self.namespace, [self.keys[i] for i in kept], pieces)


class KVStoreCluster:
    def __init__(self, url: str, *, timeout_s: float = 5.0, transport: str = "auto", control: str = "local",
                 tcp_congestion: str = "", replicas: int = 3, replicated_pages: int = 0, client_name: str = "",
                 members_wait_s: float = 5.0,
                 token: str | None = None, tls_ca: str | None = None, tls_cert: str | None = None,
                 tls_key: str | None = None, rdma: RdmaOptions | None = None, etcd_tls_ca: str | None = None,
                 etcd_tls_cert: str | None = None, etcd_tls_key: str | None = None, spin_us: int = SPIN_US_DEFAULT):
        """`transport`: "auto" (shm on this host, else RDMA or TCP) or "tcp" (TCP to every node). `control`:
        how nodes are asked ("local": a same-host node's Unix socket, another's TCP call connection; "grpc").
        `replicas`: copies of a hot page (hot_pages.py); `replicated_pages`: leading pages of a chain's first put written to `replicas` nodes
        whether hot or not (placement.py; 0 = none). `token`, `tls_*`: who this client is to every node.
        `rdma`: this host's NIC settings (rdma_transport.RdmaOptions); given, nodes that advertise RDMA are
        reached over it; None = TCP. `etcd_tls_*`: etcd over TLS (credentials.EtcdTlsFiles; each one None is read
        from KVSTORE_ETCD_TLS_CA, _CERT, _KEY). With `tls_ca`, only members whose record proves itself are
        used (record_trust.py), each dialled checking that its certificate names its node id. `spin_us`: as
        KVStoreClient's, for a node on this host."""
        if transport not in ("auto", "tcp"):
            raise errors.InvalidArgument(f"a cluster's transport must be 'auto' or 'tcp', got {transport!r}")
        if control not in ("local", "grpc"):
            raise errors.InvalidArgument(f"control must be 'local' or 'grpc', got {control!r}")
        check_timeout_s(timeout_s)
        check_spin_us(spin_us)
        placement.check_layout(replicas, replicated_pages)
        endpoints, self.cluster = parse_cluster_url(url)
        self._credentials = Credentials.resolve(token=token, tls_ca=tls_ca, tls_cert=tls_cert, tls_key=tls_key)
        self.replicas = replicas
        self.replicated_pages = replicated_pages
        self._timeout_s = timeout_s
        self._spin_us = spin_us
        self._transport = transport
        self._control = control
        self._tcp_congestion = tcp_congestion
        self._rdma = rdma
        self._client_name = client_name
        self._host_id = local_host_id()
        self._lock = threading.Lock()
        self._nodes: dict[str, tuple[Member, KVStoreClient]] = {}
        self._registered: list[tuple[int, int, Any]] = []
        self._closed = False
        self._pool = ThreadPoolExecutor(max_workers=32, thread_name_prefix="kvstore-cluster")
        self._hot = HotPages()
        self._rng = random.Random()
        trust = RecordTrust(self._credentials.tls_ca) if self._credentials.tls_ca else None
        etcd_tls = EtcdTlsFiles.resolve(ca=etcd_tls_ca, cert=etcd_tls_cert, key=etcd_tls_key)
        self._view = MembershipView(endpoints, self.cluster, timeout_s=min(timeout_s, 3.0), tls=etcd_tls, trust=trust)
        if not self._view.wait_listed(members_wait_s):
            log.warning("no membership from etcd at %s after %.1fs: every call misses until it answers",
                        ",".join(endpoints), members_wait_s)

    # -- the cluster ------------------------------------------------------------------

    def members(self) -> list[Member]:
        return sorted(self._view.members(), key=lambda m: m.node_id)

    @property
    def etcd_lost(self) -> bool:
        return bool(self._view.etcd_lost_since)

    @property
    def transport(self) -> str:
        """The data planes pages move over to the nodes asked so far: "shm", "tcp", "shm+tcp"..."""
        with self._lock:
            planes = sorted({client.transport for _, client in self._nodes.values()})
        return "+".join(planes) or "none"

    @property
    def limits(self) -> pb.Limits:
        """The smallest of each limit over the serving members (a call of KVStoreCluster obeys them all)."""
        limits = [client.limits for client in self._serving_clients()]
        if not limits:
            raise errors.Unavailable(f"no member of cluster {self.cluster!r} answers")
        fields = [f.name for f in pb.Limits.DESCRIPTOR.fields]
        return pb.Limits(**{name: min(getattr(one, name) for one in limits) for name in fields})

    @property
    def server_version(self) -> str:
        return ", ".join(sorted({client.server_version for client in self._serving_clients()}))

    # -- the same methods as KVStoreClient --------------------------------------------

    def put(self, namespace: Namespace, keys: Sequence[Key] | None = None, buffers: Any = None,
            parent: Key | None = None, verify: bool = False, durable: bool = False, *,
            tokens: Any = None, timeout_s: float | None = None, anchor: Key | None = None,
            parents: Sequence[Key | None] | None = None) -> PutResult:
        """KVStoreClient.put, each page on its nodes; the count is the chain's leading run stored anywhere."""
        raw, pages, keepalive = put_pages(namespace, keys, buffers, tokens, parent, anchor)
        pieces = self._write_pieces(raw, parent_list(parents, len(raw), parent, anchor), parent, anchor)

        def put_piece(node_id: str, positions: list[int], piece_parents: list[bytes | None]) -> PutResult:
            return self._node(node_id).put(namespace, [raw[i] for i in positions], _picked(pages, positions),
                                           verify=verify, durable=durable, timeout_s=timeout_s, parents=piece_parents)

        answers = fan_out(self._pool, [(lambda piece=piece: put_piece(*piece)) for piece in pieces], miss=None)
        del keepalive
        stored, reasons = [False] * len(raw), {}
        for (_, positions, _), answer in zip(pieces, answers):
            count = int(answer) if answer is not None else 0
            for i in positions[:count]:
                stored[i] = True
            if count < len(positions):
                reasons[positions[count]] = answer.reason if answer is not None else "UNAVAILABLE: node lost"
        count = _leading_run(stored)
        if count == len(raw):
            return PutResult(count, len(raw))
        fallback = "not stored" if pieces else f"UNAVAILABLE: no member of cluster {self.cluster!r} takes pages"
        return PutResult(count, len(raw), reasons.get(count, fallback))

    def get(self, namespace: Namespace, keys: Sequence[Key] | None = None, out: Any = None, verify: bool = False,
            policy: str = "wait_complete", timeout_ms: int = 0, *, tokens: Any = None,
            timeout_s: float | None = None, wait_ms: int = 0) -> int:
        """KVStoreClient.get across the nodes: copies the chain's leading stored pages into `out`."""
        raw, pages, keepalive = get_pages(namespace, keys, out, tokens)
        call_timeout = timeout_s if timeout_s is not None else self._timeout_s + wait_ms / 1000

        def get_piece(client: KVStoreClient, positions: list[int]) -> list[bool]:
            loaded = client.get(namespace, [raw[i] for i in positions], _picked(pages, positions), verify=verify,
                                policy=policy, timeout_ms=timeout_ms, wait_ms=wait_ms, timeout_s=call_timeout)
            return _leading_flags(loaded, len(positions))

        found = self._read(raw, get_piece, leading=True, namespace=namespace)
        loaded = _leading_run(found)
        self._copy_hot(namespace, raw[:loaded], pages, call_timeout)
        del keepalive
        return loaded

    def lookup(self, namespace: Namespace, keys: Sequence[Key] | None = None, tokens: Any = None, *,
               timeout_s: float | None = None) -> int:
        """How many leading pages of the chain the cluster holds (by keys, or tokens hashed here)."""
        raw = lookup.chain_keys(namespace, keys, tokens)
        found = self._read(raw, lambda client, positions: _leading_flags(client.lookup(
            namespace, keys=[raw[i] for i in positions], timeout_s=timeout_s), len(positions)), leading=True,
            namespace=namespace)
        return _leading_run(found)

    def held(self, namespace: Namespace, keys: Sequence[Key], *, timeout_s: float | None = None) -> list[bool]:
        """Whether the cluster holds each key's page, each key on its own."""
        raw = encode_keys(keys)
        return self._read(raw, lambda client, positions: client.held(
            namespace, [raw[i] for i in positions], timeout_s=timeout_s), leading=False, namespace=namespace)

    def residency(self, namespace: Namespace, keys: Sequence[Key] | None = None, tokens: Any = None,
                  engine_ids: Sequence[str] = (), *, timeout_s: float | None = None) -> Residency:
        """Where a prompt's pages are across the cluster (residency.py): the leading pages the cluster holds, the
        tier and node each is read from, and each engine's leading pages in its own memory, the most any node
        heard of (a node follows the engines configured to publish to it).

        One round: the chain is hashed once, and every serving member is asked, at once, where each of its
        pages is (Lookup each_key, in parts) and how much of it the engines hold. No placement is computed: a
        page counts wherever it is (its best node, a replica, a node it had before a join), read from the
        fastest tier that holds it, the lower node id on a tie. A member that does not answer holds nothing."""
        chain = lookup.shared_chain(namespace, keys, tokens)
        ids = engine_id_list(engine_ids)
        members = self._serving()
        answers = ask_together(self._clients(members), lambda: node_calls.tiers_each(namespace, chain, ids),
                               NODE_LOST, timeout_s)
        held = [(node_id, answer) for node_id, answer in sorted(answers.items()) if answer is not None]
        if not held and members:
            raise errors.Unavailable(f"no member of cluster {self.cluster!r} answers")
        if not held or not len(chain):
            return Residency(0, b"", {e: EngineHeld(0, 0) for e in ids})
        tiers = np.stack([np.frombuffer(answer[0], dtype=np.uint8) for _, answer in held])
        # Each page's tier (a lower Tier is a faster one) above its node's position: one min finds, for every
        # page, the fastest tier and the first node holding it there.
        ranked = np.where(tiers == 0, NOT_HELD, tiers).astype(np.uint32) << 16 \
            | np.arange(len(held), dtype=np.uint32)[:, None]
        best = ranked.min(axis=0)
        fastest = (best >> 16).astype(np.uint8)
        missing = np.flatnonzero(fastest == NOT_HELD)
        pages = int(missing[0]) if missing.size else len(fastest)
        engines = {e: EngineHeld(max(answer[1][e].gpu_pages for _, answer in held),
                                 max(answer[1][e].held_pages for _, answer in held)) for e in ids}
        return Residency(pages, fastest[:pages].tobytes(), engines, costs=_slowest([a[2] for _, a in held]),
                         node_ids=tuple(node_id for node_id, _ in held),
                         node_of=(best[:pages] & 0xFFFF).astype(np.uint16).tobytes())

    def route(self, namespace: Namespace, engine_ids: Sequence[str], keys: Sequence[Key] | None = None,
              tokens: Any = None, *, timeout_s: float | None = None) -> pb.RouteResponse:
        """Route asked of every serving member: each engine's best score (a node follows the KV events of the
        engines configured to publish to it, and sees this store's pages it holds: a prefix whose pages lie on
        several nodes scores, from this store, only the leading run of the best node's)."""
        ids = engine_id_list(engine_ids)
        answers = [a for a in self._each_member(lambda c: c.route(namespace, ids, keys, tokens, timeout_s=timeout_s),
                                                self._serving(), raise_errors=True).values() if a is not None]
        if not answers:
            raise errors.Unavailable(f"no member of cluster {self.cluster!r} answers")
        scores = [max((a.scores[i] for a in answers), key=lambda s: s.score) for i in range(len(ids))]
        best = max(scores, key=lambda s: s.score).engine_id if scores else ""
        return pb.RouteResponse(scores=scores, best_engine_id=best)

    def delete(self, namespace: Namespace, keys: Sequence[Key], *, timeout_s: float | None = None) -> int:
        """Remove the pages and every page that extends them, on every member; returns pages removed (each
        copy counts). Round by round: every member removes what extends the keys it is sent, and the next
        round sends every member the keys removed in this one (pages on other nodes are anchored at them)."""
        frontier, seen, removed = encode_keys(keys), set(), 0
        for _ in range(DELETE_ROUNDS_MAX):
            seen.update(frontier)
            answers = self._each_member(lambda c: c._removing(namespace, frontier, timeout_s=timeout_s),
                                        self.members(), raise_errors=True)
            named = set()
            for node_id, answer in answers.items():
                if answer is None:
                    continue
                count, keys_removed, cut = answer
                removed += count
                named.update(keys_removed)
                if cut:
                    log.warning("node %s removed more pages than it could name: pages on other nodes that extend "
                                "them stay until evicted (outside every leading run)", node_id)
            frontier = sorted(named - seen)
            if not frontier:
                return removed
        log.warning("delete stopped after %d rounds: pages that extend the last ones removed may stay until evicted",
                    DELETE_ROUNDS_MAX)
        return removed

    def clear(self, namespace: Namespace, *, timeout_s: float | None = None) -> int:
        """Remove every page of the namespace on every member; returns pages removed (copies count)."""
        return sum(a or 0 for a in self._each_member(lambda c: c.clear(namespace, timeout_s=timeout_s),
                                                     self.members(), raise_errors=True).values())

    def list_keys(self, namespace: Namespace, *, timeout_s: float | None = None) -> list[bytes]:
        """Keys of every page of the namespace on any reachable member, in byte order, each once."""
        answers = self._each_member(lambda c: c.list_keys(namespace, timeout_s=timeout_s), self.members(),
                                    raise_errors=True)
        return sorted({key for found in answers.values() if found for key in found})

    def list_pages(self, namespace: Namespace, *, timeout_s: float | None = None) -> PageSnapshot:
        """Refused: each node publishes its own event stream, numbered on its own, and a snapshot completes
        one node's stream only; node_list_pages() gives each member's."""
        raise errors.InvalidArgument("a cluster has no single page snapshot: each node's events and ListPages go "
                                     "together; use node_list_pages(namespace), by node id")

    def events_run(self, namespace: Namespace, *, timeout_s: float | None = None) -> bytes:
        """Refused as list_pages() is: a run belongs to one node (node_list_pages() carries each one's)."""
        raise errors.InvalidArgument("a cluster has no single run: each node restarts on its own; use "
                                     "node_list_pages(namespace), whose snapshots carry each node's run")

    def node_list_pages(self, namespace: Namespace, *, timeout_s: float | None = None) -> dict[str, PageSnapshot]:
        """Each reachable member's page snapshot of the namespace (KVStoreClient.list_pages), by node id."""
        answers = self._each_member(lambda c: c.list_pages(namespace, timeout_s=timeout_s), self.members(),
                                    raise_errors=True)
        return {node_id: answer for node_id, answer in answers.items() if answer is not None}

    def node_client(self, node_id: str) -> KVStoreClient:
        """The client of one member (opened on first use): what per-node tools, such as ClusterInventory's
        snapshots, call through. Unavailable when it is not a member."""
        return self._node(node_id)

    def stats(self, *, timeout_s: float | None = None) -> pb.StatsResponse:
        """The reachable members' Stats added up (counters summed, tiers, namespaces, engines and tenants
        merged by name); node_stats() has each member's own."""
        return merged_stats(list(self.node_stats(timeout_s=timeout_s).values()))

    def node_stats(self, *, timeout_s: float | None = None) -> dict[str, pb.StatsResponse]:
        """Each reachable member's StatsResponse, by node id (a lost node is left out)."""
        answers = self._each_member(lambda c: c.stats(timeout_s=timeout_s), self.members(), raise_errors=True)
        return {node_id: answer for node_id, answer in answers.items() if answer is not None}

    # -- page groups ------------------------------------------------------------------

    def stage(self, namespace: Namespace, keys: Sequence[Key] | None = None, buffers: Any = None,
              parent: Key | None = None, verify: bool = False, *, tokens: Any = None, anchor: Key | None = None,
              timeout_s: float | None = None, parents: Sequence[Key | None] | None = None) -> ClusterStaged:
        """KVStoreClient.stage on every node that will hold some of the pages."""
        raw, pages, keepalive = put_pages(namespace, keys, buffers, tokens, parent, anchor)
        pieces = self._write_pieces(raw, parent_list(parents, len(raw), parent, anchor), parent, anchor)

        def stage_piece(node_id: str, positions: list[int],
                        piece_parents: list[bytes | None]) -> tuple[list[int], StagedPages]:
            return positions, self._node(node_id).stage(namespace, [raw[i] for i in positions],
                                                        _picked(pages, positions), verify=verify,
                                                        parents=piece_parents, timeout_s=timeout_s)

        try:
            staged = fan_out(self._pool, [(lambda piece=piece: stage_piece(*piece)) for piece in pieces], miss=None)
        finally:
            del keepalive
        return ClusterStaged(namespace, raw, {piece[0]: answer for piece, answer in zip(pieces, staged)
                                              if answer is not None})

    def commit_group(self, parts: Sequence[ClusterStaged], *, timeout_s: float | None = None) -> list[PutResult]:
        """Commit every part's staged pages, each node its own positions in one CommitGroup."""
        by_node = _staged_by_node(parts)
        fan_out(self._pool, [(lambda n=n: self._node(n).commit_group(by_node[n], timeout_s=timeout_s))
                             for n in sorted(by_node)], miss=None)
        return [PutResult(part.stored, len(part.keys)) for part in parts]

    def abort_staged(self, parts: Sequence[ClusterStaged], *, timeout_s: float | None = None) -> None:
        by_node = _staged_by_node(parts)
        fan_out(self._pool, [(lambda n=n: self._node(n).abort_staged(by_node[n], timeout_s=timeout_s))
                             for n in sorted(by_node)], miss=None)

    def put_group(self, keys: Sequence[Key], parts: Sequence[tuple[Namespace, Any]], parent: Key | None = None,
                  verify: bool = False, *, anchor: Key | None = None, timeout_s: float | None = None) -> PutResult:
        """KVStoreClient.put_group: each key's pages of every part made visible together, node by node."""
        if not parts:
            raise errors.InvalidArgument("put_group needs at least one (namespace, pages) part")
        staged: list[ClusterStaged] = []
        try:
            for namespace, buffers in parts:
                staged.append(self.stage(namespace, keys, buffers, parent, verify, anchor=anchor,
                                         timeout_s=timeout_s))
        except BaseException:
            self.abort_staged(staged)
            raise
        return min(self.commit_group(staged, timeout_s=timeout_s), key=int)

    def lookup_group(self, keys: Sequence[Key], parts: Sequence[GroupPart], *,
                     timeout_s: float | None = None) -> GroupHits:
        """Which prefixes of `keys` every part can restore: each part's pages looked up on their nodes
        (all parts at once), folded by the node's own rule."""
        request = groups.lookup_group_request(keys, parts, self.limits)
        raw = list(request.keys)
        present = fan_out(self._pool, [(lambda p=p: self.held(p.namespace, raw, timeout_s=timeout_s))
                                       for p in parts], miss=None)
        present = [found if found is not None else [False] * len(raw) for found in present]
        return groups.fold(_leading_run(present[0]), present[1:], request.parts)

    def get_group(self, parts: Sequence[tuple[Namespace, Sequence[Key], Any]], verify: bool = False,
                  policy: str = "wait_complete", *, timeout_s: float | None = None) -> list[int]:
        """KVStoreClient.get_group across the nodes: each node pins its positions of every part in one
        AcquireGroup; a position one replica missed (or a lost node's) is asked of the next, as a get's; a
        part's count is its leading run, cut where another part that names the key missed."""
        if not parts:
            raise errors.InvalidArgument("get_group needs at least one (namespace, keys, out) part")
        prepared = [get_pages(namespace, part_keys, out, None) for namespace, part_keys, out in parts]
        part_keys = [raw for raw, _, _ in prepared]
        owners = [self._read_owners(raw, namespace)[0] for raw, (namespace, _, _) in zip(part_keys, parts)]
        loaded = [[False] * len(raw) for raw in part_keys]
        tried = [[0] * len(raw) for raw in part_keys]
        pending = [[p for p, nodes in enumerate(part) if nodes] for part in owners]

        def get_on(node_id: str, asked: list[tuple[int, list[int]]]) -> list[int]:
            reads = [(parts[i][0], [part_keys[i][p] for p in positions], _picked(prepared[i][1], positions))
                     for i, positions in asked]
            return self._node(node_id).get_group(reads, verify=verify, policy=policy, timeout_s=timeout_s)

        while any(pending):   # round by round, as _read: a position one replica missed asks the next
            by_node: dict[str, list[tuple[int, list[int]]]] = {}
            for part_index, positions in enumerate(pending):
                for node_id, on_node in _pieces([owners[part_index][p][tried[part_index][p]:] for p in positions],
                                                every_owner=False):
                    by_node.setdefault(node_id, []).append((part_index, [positions[j] for j in on_node]))
            nodes = sorted(by_node)
            answers = fan_out(self._pool, [(lambda n=n: get_on(n, by_node[n])) for n in nodes], miss=None)
            for node_id, counts in zip(nodes, answers):
                for piece_index, (part_index, positions) in enumerate(by_node[node_id]):
                    count = counts[piece_index] if counts is not None else 0
                    for p in positions[:count]:
                        loaded[part_index][p] = True
                    asked = len(positions) if counts is None else min(count + 1, len(positions))
                    for p in positions[:asked]:
                        tried[part_index][p] += 1
            for part_index, positions in enumerate(pending):
                part = owners[part_index]
                sure_miss = next((p for p in range(len(part)) if not loaded[part_index][p]
                                  and tried[part_index][p] >= len(part[p])), len(part))
                pending[part_index] = [p for p in positions
                                       if not loaded[part_index][p] and tried[part_index][p] < len(part[p])
                                       and p < sure_miss]
        return groups.whole_positions(part_keys, [_leading_run(flags) for flags in loaded])

    # -- buffers and the client's life ------------------------------------------------

    def register_buffer(self, address: int, nbytes: int, owner: Any = None) -> None:
        """KVStoreClient.register_buffer, on every node client now open and each one opened later."""
        if address <= 0 or nbytes <= 0:
            raise errors.InvalidArgument(f"bad buffer to register: address {address:#x}, {nbytes} bytes")
        with self._lock:
            self._registered.append((address, nbytes, owner))
            clients = [client for _, client in self._nodes.values()]
        for client in clients:
            client.register_buffer(address, nbytes, owner)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
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

    # -- placement, reads and nodes ---------------------------------------------------

    def _place(self, raw: Sequence[bytes], chain_start: bool) -> list[tuple[str, ...]]:
        weights = placement.placeable(self._view.members(), time.time())
        return placement.place(raw, weights, self.replicas, self.replicated_pages, chain_start)

    def _read(self, raw: list[bytes], ask: Callable[[KVStoreClient, list[int]], list[bool]],
              leading: bool, namespace: Namespace) -> list[bool]:
        """Each key found or not: asked of its best node (a random one of its replicas for a hot page this
        client copied), then of its next replica (or, while its node ramps up, of the node it had before)
        where that missed or was lost, round by round. `leading`: only keys before the chain's first sure
        miss are asked again."""
        owners, spread = self._read_owners(raw, namespace)
        found, tried = [False] * len(raw), [0] * len(raw)
        pending = [i for i, nodes in enumerate(owners) if nodes]
        while pending:
            by_node: dict[str, list[int]] = {}
            for i in pending:
                by_node.setdefault(owners[i][tried[i]], []).append(i)
            nodes = sorted(by_node)
            answers = fan_out(self._pool, [(lambda n=n: ask(self._node(n), by_node[n])) for n in nodes], miss=None)
            for node_id, flags in zip(nodes, answers):
                positions = by_node[node_id]
                for i, hit in zip(positions, flags or []):
                    found[i] = found[i] or bool(hit)
                for i in positions[:_answered(positions, flags, leading)]:
                    tried[i] += 1
            again = [i for i in pending if not found[i] and tried[i] < len(owners[i])]
            if leading:
                sure_miss = next((i for i in range(len(raw)) if not found[i] and tried[i] >= len(owners[i])),
                                 len(raw))
                again = [i for i in again if i < sure_miss]
            pending = again
        repair = [raw[i] for i in spread if found[i] and tried[i] > 1]   # a replica asked first missed it
        if repair:
            self._hot.lost_copy(namespace, repair)
        return found

    def _read_owners(self, raw: list[bytes], namespace: Namespace) -> tuple[list[tuple[str, ...]], list[int]]:
        """The nodes a read asks for each key, in order (placement.read_order), a hot page this client copied
        starting at a random one of its replicas; and the positions of those hot pages."""
        members, now = self._view.members(), time.time()
        owners = placement.read_order(raw, members, now, self.replicas, self.replicated_pages)
        spread = self._hot.spread(namespace, raw)
        if spread and self.replicas > 1:
            ranked = placement.place([raw[i] for i in spread], placement.placeable(members, now), self.replicas,
                                     len(spread), chain_start=True)
            for i, nodes in zip(spread, ranked):
                owners[i] = rotated(nodes, self._rng) + tuple(n for n in owners[i] if n not in nodes)
        return owners, spread

    def _copy_hot(self, namespace: Namespace, raw: list[bytes], pages: Any, timeout_s: float) -> None:
        """Write the loaded pages that a node flagged hot (and this client has not copied yet) to each of their
        `replicas` best nodes, from the caller's buffer, before the get returns; a node that has one answers
        PRESENT. Best effort: a node that takes no copy leaves the page where it was, and reads fall back."""
        flagged = self._hot.to_copy(namespace, raw) if self.replicas > 1 else []
        hot = [i for i, checksum in flagged if checksums.of_page(pages[i]) == checksum]   # not damaged on the way
        if not hot:
            return
        keys = [raw[i] for i in hot]
        parents = [raw[i - 1] if i else None for i in hot]   # keys[0]'s parent is not known to a get
        owners = placement.place(keys, placement.placeable(self._view.members(), time.time()), self.replicas,
                                 len(keys), chain_start=True)
        hot_pages = _picked(pages, hot)

        def copy_to(node_id: str, positions: list[int]) -> PutResult:
            return self._node(node_id).put(namespace, [keys[j] for j in positions], _picked(hot_pages, positions),
                                           parents=[parents[j] for j in positions], timeout_s=timeout_s)

        pieces = _pieces(owners, every_owner=True)
        fan_out(self._pool, [_quiet(lambda piece=piece: copy_to(*piece)) for piece in pieces], miss=None)
        self._hot.copied(namespace, keys)

    def _write_pieces(self, raw: list[bytes], parents: list[bytes] | None, parent: Key | None,
                      anchor: Key | None) -> list[tuple[str, list[int], list[bytes | None]]]:
        """Where a write's pages go: (node id, positions, each page's parent key), each page to every node it is
        placed on. Every page names its true parent (the page before it in the call; for the first, the call's
        parent or anchor, none at a chain's start, whose leading pages get replicas), wherever that lives, so a
        delete of it on any node finds the page here (Reserve's parent_keys)."""
        if parents is None:
            before = parent if parent is not None else anchor
            parents = [encode_key(before) if before is not None else b""] + raw[:-1]
        owners = self._place(raw, chain_start=not parents[0])
        return [(node_id, positions, [parents[i] or None for i in positions])
                for node_id, positions in _pieces(owners, every_owner=True)]

    def _serving(self) -> list[Member]:
        return [m for m in self.members() if m.state == "serving"]

    def _serving_clients(self) -> list[KVStoreClient]:
        """The clients of the serving members that can be opened (those opened already cost nothing)."""
        clients = []
        for member in self._serving():
            try:
                clients.append(self._node(member.node_id))
            except NODE_LOST:
                continue
        return clients

    def _each_member(self, call: Callable[[KVStoreClient], T], members: Sequence[Member],
                     raise_errors: bool = False) -> dict[str, T | None]:
        """call(client) on each member at once, by node id; a lost member answers None. Other errors are
        raised (once all ended) when `raise_errors`, else logged and answer None."""
        ids = [m.node_id for m in members]
        calls = [(lambda n=n: call(self._node(n))) for n in ids]
        if raise_errors:
            return dict(zip(ids, fan_out(self._pool, calls, miss=None)))
        return dict(zip(ids, fan_out(self._pool, [_quiet(c) for c in calls], miss=None)))

    def _clients(self, members: Sequence[Member]) -> dict[str, KVStoreClient]:
        """The clients of those members that can be reached now, by node id (a lost one is left out)."""
        clients = {}
        for member in members:
            try:
                clients[member.node_id] = self._node(member.node_id)
            except NODE_LOST as exc:
                log.info("node %s cannot be reached (%s: %s): counted as a miss", member.node_id,
                         type(exc).__name__, exc)
        return clients

    def _node(self, node_id: str) -> KVStoreClient:
        """The client of a member, opened on first use (and again when its record changed)."""
        member = next((m for m in self._view.members() if m.node_id == node_id), None)
        if member is None:
            raise errors.Unavailable(f"node {node_id} left the cluster")
        if not member.grpc_address:   # joining: a call that asks every member counts it as a miss
            raise errors.Unavailable(f"node {node_id} is joining and has not published its address yet")
        with self._lock:
            if self._closed:
                raise errors.InvalidArgument("this KVStoreCluster is closed: open a new one")
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
            registered = list(self._registered)
        if stale is not None:
            stale.close()
        for address, nbytes, owner in registered:
            client.register_buffer(address, nbytes, owner)
        return client

    def _open(self, member: Member) -> KVStoreClient:
        """A client of `member` over the data plane data_plane() picks for it."""
        plane = data_plane(member, self._host_id, self._transport, self._rdma is not None)
        who = self._credentials
        # RDMA: KVStoreClient's "auto" tries it, then TCP (shared memory, tried first, fails on another host:
        # the socket is absent or answers another node's instance id).
        transport = "tcp" if plane == "tcp" else "auto"
        client = KVStoreClient(member.grpc_address, timeout_s=self._timeout_s, transport=transport,
                               control=self._control if plane in ("shm", "tcp") else "grpc",
                               client_name=self._client_name,
                               tcp_congestion=self._tcp_congestion,
                               rdma=self._rdma if plane == "rdma" else None,
                               token=who.token, tls_ca=who.tls_ca, tls_cert=who.tls_cert, tls_key=who.tls_key,
                               tls_server_name=member.node_id if who.tls_ca else "", spin_us=self._spin_us)
        client.on_hot = self._hot.flag
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


def merged_stats(answers: Sequence[pb.StatsResponse]) -> pb.StatsResponse:
    """Several nodes' Stats as one: numbers summed; repeated entries merged by their first field (a name)."""
    total = pb.StatsResponse()
    for answer in answers:
        _add_into(total, answer)
    return total


def _add_into(total: Any, one: Any, name_field: str = "") -> None:
    """Numbers summed (an entry's name and enums kept), flags or'ed, text kept from the first that has it."""
    for field in one.DESCRIPTOR.fields:
        value = getattr(one, field.name)
        if field.name == name_field:
            continue
        if field.is_repeated:
            if field.type == field.TYPE_MESSAGE:
                _merge_entries(getattr(total, field.name), value)
        elif field.type == field.TYPE_MESSAGE:
            if one.HasField(field.name):
                _add_into(getattr(total, field.name), value)
        elif field.type == field.TYPE_BOOL:
            setattr(total, field.name, getattr(total, field.name) or value)
        elif isinstance(value, (int, float)) and field.enum_type is None:
            setattr(total, field.name, getattr(total, field.name) + value)
        elif not getattr(total, field.name):
            setattr(total, field.name, value)


def _merge_entries(merged: Any, entries: Any) -> None:
    """Repeated entries (tiers, namespaces, engines, tenants) merged by their first field, their name."""
    for entry in entries:
        name_field = entry.DESCRIPTOR.fields[0].name
        same = next((m for m in merged if getattr(m, name_field) == getattr(entry, name_field)), None)
        if same is None:
            merged.add().CopyFrom(entry)
        else:
            _add_into(same, entry, name_field)


def _staged_by_node(parts: Sequence[ClusterStaged]) -> dict[str, list[StagedPages]]:
    by_node: dict[str, list[StagedPages]] = {}
    for part in parts:
        for node_id, (_, staged) in part.pieces.items():
            by_node.setdefault(node_id, []).append(staged)
    return by_node


def _pieces(owners: Sequence[tuple[str, ...]], every_owner: bool) -> list[tuple[str, list[int]]]:
    """(node id, positions of the keys it gets), by node id: each key to all its owners, or its best."""
    by_node: dict[str, list[int]] = {}
    for i, nodes in enumerate(owners):
        for node_id in (nodes if every_owner else nodes[:1]):
            by_node.setdefault(node_id, []).append(i)
    return sorted(by_node.items())


def _picked(pages: Any, positions: list[int]) -> Any:
    """The pages at `positions`, without copying: a slice where they run on, else their segments."""
    first, last = positions[0], positions[-1]
    if last - first + 1 == len(positions):
        return pages[first:last + 1]
    return [pages[i] for i in positions]


def _slowest(costs: list[LoadCosts]) -> LoadCosts:
    """One estimate for pages spread over nodes: each tier's cost on its slowest node, the slowest data plane
    measured, the longest round trip (the nodes are asked at once)."""
    tiers = {tier for cost in costs for tier in cost.seconds_per_page}
    planes = [cost.plane_bytes_per_s for cost in costs if cost.plane_bytes_per_s > 0]
    return LoadCosts({tier: max(cost.seconds_per_page.get(tier, 0.0) for cost in costs) for tier in tiers},
                     min(planes, default=0.0), max(cost.round_trip_s for cost in costs))


def _leading_flags(count: int, total: int) -> list[bool]:
    return [True] * int(count) + [False] * (total - int(count))


def _answered(positions: list[int], flags: list[bool] | None, leading: bool) -> int:
    """How many of a node's positions its answer speaks for: all of them, or, for a leading count (a get's, a
    lookup's), those up to its first miss: the node stopped there, so the ones after are asked again."""
    if flags is None or not leading:
        return len(positions)
    return min(len(positions), _leading_run(flags) + 1)


def _leading_run(flags: Sequence[bool]) -> int:
    return next((i for i, hit in enumerate(flags) if not hit), len(flags))


def _quiet(call: Callable[[], T]) -> Callable[[], T | None]:
    def run() -> T | None:
        try:
            return call()
        except NODE_LOST:
            raise
        except errors.KVStoreError as exc:
            log.warning("a cluster member answered %s: %s", type(exc).__name__, exc)
            return None
    return run
