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
gRPC; with TCP, on a call connection of the node's TCP data plane (tcp_control.py) when
`control="local"` and the node offers one, else over gRPC; with RDMA over gRPC. Every data plane runs the same
put/get pipeline (pipeline.py) over its own DataPath (data_path.py). Each call is written once, with
no I/O (node_calls.py); this client takes its steps with blocking I/O (node_steps.drive).

The client outlives its node's restarts. Before each call it checks, without a round trip,
that its connection (connection.py) still stands: the node closes the local channel, the
socket the arena came over and the TCP data connection when it stops. A lost connection is
replaced by a new one (Hello over a new gRPC channel, the data path opened again, namespaces
reopened as they are used), each step bounded by `timeout_s`, one attempt per call: while
the node is down a call fails at once with errors.Unavailable. A call that finds the node
gone while it runs fails with errors.Unavailable, and is made once more on a new connection
when that is safe: get, lookup, route, stats, and a put none of whose pages was reserved yet.

One client may be shared by any number of threads: calls run concurrently on one connection
(the local channel matches answers to requests in order; gRPC multiplexes), and a reconnect is
made once for all of them. Every call also takes its own `timeout_s`, one deadline for all the
messages it sends (channel.call_deadline); without it each message gets the client's timeout_s.
Token ids may be a list, a numpy array or a torch tensor wherever a call takes them; a bad
argument of any kind raises errors.InvalidArgument (a ValueError) before anything is sent.
For asyncio engines, async_client.AsyncKVStoreClient has the same methods as coroutines.

KVStoreClient("etcd://host:2379/<cluster>") is a KVStoreCluster (cluster.py) instead: the same
methods, arguments and results over every node of a cluster.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable, Sequence, TypeVar

from kvstore_client import errors, node_calls
from kvstore_client.arguments import SPIN_US_DEFAULT, check_spin_us, check_timeout_s, is_cluster_url, node_target
from kvstore_client.channel import call_deadline
from kvstore_client.connection import ConnectOptions, NodeConnection
from kvstore_client.credentials import Credentials
from kvstore_client.events import PageSnapshot
from kvstore_client.groups import GroupHits, GroupPart, StagedPages
from kvstore_client.keys import Key, Namespace
from kvstore_client.node_steps import OnNode, Steps, drive, lost_under, take_on
from kvstore_client.pipeline import PutResult
from kvstore_client.proto import pb
from kvstore_client.rdma_transport import RdmaOptions
from kvstore_client.residency import Residency

log = logging.getLogger(__name__)

T = TypeVar("T")


class KVStoreClient:
    def __new__(cls, target: str = "", **options: Any) -> Any:
        """A cluster URL (etcd://host:2379/<cluster>) gives a KVStoreCluster (cluster.py): the same methods,
        over every node etcd lists. Anything else is one node's gRPC address."""
        if cls is KVStoreClient and is_cluster_url(target):
            from kvstore_client.cluster import KVStoreCluster   # here: cluster.py builds on this module
            return KVStoreCluster(target, **options)
        return super().__new__(cls)

    def __init__(self, target: str, *, timeout_s: float = 5.0, control: str = "local", client_name: str = "",
                 transport: str = "auto", tcp_congestion: str = "", rdma: RdmaOptions | None = None,
                 token: str | None = None, tls_ca: str | None = None, tls_cert: str | None = None,
                 tls_key: str | None = None, tls_server_name: str = "", spin_us: int = SPIN_US_DEFAULT):
        """`rdma`: device, port, GID index, traffic class, service level and queue sizes of the RDMA data plane
        (experimental: see rdma_transport.py); None = defaults (first ACTIVE port, a RoCE v2 GID).
        `token`, `tls_ca`, `tls_cert`, `tls_key`: who this client is to the node (credentials.py); each
        one left None is read from KVSTORE_TOKEN, KVSTORE_TLS_CA, KVSTORE_TLS_CERT, KVSTORE_TLS_KEY.
        `tls_server_name`: the name the node's gRPC certificate must carry ("" = the host dialled).
        `spin_us`: how long a wait for the node's answer on its local channel polls, keeping this thread's core
        busy, before it sleeps (0: it sleeps at once). A sleeping thread wakes 30-100 us after its answer comes,
        more than the node takes to answer most calls (channel.py). Busy clients sharing one core slow each
        other while they poll: give them 0 (a put loader beside a reader on one core took the reader's
        one-page get from a median of 0.41-0.48 ms to 0.69-0.72, bench/writedown_latency.py --no-nvme)."""
        target = node_target(target)
        if control not in ("local", "grpc"):
            raise errors.InvalidArgument(f"control must be 'local' or 'grpc', got {control!r}")
        check_timeout_s(timeout_s)
        check_spin_us(spin_us)
        self._options = ConnectOptions(target=target, timeout_s=timeout_s, control=control, transport=transport,
                                       client_name=client_name, tcp_congestion=tcp_congestion,
                                       rdma=rdma or RdmaOptions(), credentials=Credentials.resolve(
                                           token=token, tls_ca=tls_ca, tls_cert=tls_cert, tls_key=tls_key,
                                           tls_server_name=tls_server_name), spin_us=spin_us)
        self._lock = threading.Lock()            # guards _conn and _closed; a call enters _conn under it
        self._replace_lock = threading.Lock()    # one reconnect at a time; the other callers then use it
        self._closed = False
        self._registered: list[tuple[int, int, Any]] = []   # register_buffer's, applied to every new connection
        self._conn = NodeConnection(self._options)
        # Told (namespace, [(key, checksum)]) of the pages a get loaded that the node flagged hot
        # (KVStoreCluster copies them to other nodes).
        self.on_hot: Callable[[Namespace, list[tuple[bytes, int]]], None] | None = None

    @property
    def transport(self) -> str:
        """The data plane pages move over: "shm", "rdma" or "tcp"."""
        return self._conn.data.name

    @property
    def limits(self) -> pb.Limits:
        return self._conn.hello.limits

    @property
    def server_version(self) -> str:
        return self._conn.hello.server_version

    # -- public API: each call is written once, in node_calls.py ------------------------

    def put(self, namespace: Namespace, keys: Sequence[Key] | None = None, buffers: Any = None,
            parent: Key | None = None, verify: bool = False, durable: bool = False, *,
            tokens: Any = None, timeout_s: float | None = None, anchor: Key | None = None,
            parents: Sequence[Key | None] | None = None) -> PutResult:
        """Store pages under their keys (or under the keys of `tokens`' full pages); returns how many
        leading keys are now stored: a PutResult, an int that also says why it is short (`reason`,
        e.g. "NO_SPACE: the node is full ...").

        `parent` is the key of the page before keys[0] (None at the start of a sequence); the
        node refuses the pages when it does not hold it. `anchor`, instead of `parent`, names a
        page before keys[0] that the node may have evicted (an engine backs up the pages after its
        own cache hit): the pages are stored anyway, anchored at it (see the README). `parents`,
        instead of both, names each key's parent (None for parents[0] at a chain's start): for pages
        that are not one run of a chain (a cluster's piece of it, which KVStoreCluster sends); a page
        whose parent the node does not hold is stored anchored at it.
        A key already stored (or being written by another client) is not copied again and
        counts as stored. The server always checksums a page at commit; `verify=True` also
        hashes each page here, so the server refuses a slot that does not hold what this
        process handed over (needs xxhash).

        `durable=True` asks the node to answer each commit only once its pages are on NVMe
        (a node without an NVMe tier refuses it: InvalidArgument). The count then means: leading keys whose page this
        call wrote and the node reported on NVMe, or that were already stored or being
        written by another client (those count as stored, whether or not they are on NVMe
        yet). A page this call wrote that is committed but not on NVMe ends the count.
        """
        return self._run(node_calls.put(namespace, keys, buffers, parent, verify, durable, tokens, anchor, parents),
                         timeout_s)

    def get(self, namespace: Namespace, keys: Sequence[Key] | None = None, out: Any = None, verify: bool = False,
            policy: str = "wait_complete", timeout_ms: int = 0, *, tokens: Any = None,
            timeout_s: float | None = None, wait_ms: int = 0) -> int:
        """Copy the leading stored pages into `out`; returns how many were loaded.

        Pages only on the node's NVMe tier come up into DRAM first; `policy` says how long
        to wait for them: "wait_complete" (all), "best_effort" (only what is in DRAM now;
        the rest is prefetched for next time) or "timeout" (up to `timeout_ms`). When the
        call fails, `out` may hold anything. `wait_ms` waits up to that long for keys not yet
        committed (another client writing them now: a prefill engine handing a prompt to this
        decode engine); the count is then what was committed by the deadline.
        """
        return self._run(node_calls.get(namespace, keys, out, verify, policy, timeout_ms, tokens, wait_ms,
                                        self.on_hot), timeout_s)

    def lookup(self, namespace: Namespace, keys: Sequence[Key] | None = None, tokens: Any = None, *,
               timeout_s: float | None = None) -> int:
        """How many leading pages are stored, by keys or by token ids (a list, numpy array or tensor).

        One call for a prompt of any length: parts beyond the node's limit go as several Lookups
        (lookup.py). Extends no lease.
        """
        return self._run(node_calls.lookup(namespace, keys, tokens), timeout_s)

    def held(self, namespace: Namespace, keys: Sequence[Key], *, timeout_s: float | None = None) -> list[bool]:
        """Whether the node holds each key's page, each key on its own (keys of several chains at once, not
        only a leading run): one Lookup per limits.lookup_pages_max keys. Extends no lease."""
        return self._run(node_calls.held(namespace, keys), timeout_s)

    def residency(self, namespace: Namespace, keys: Sequence[Key] | None = None, tokens: Any = None,
                  engine_ids: Sequence[str] = (), *, timeout_s: float | None = None) -> Residency:
        """Where a prompt's pages are (residency.py): the leading pages this node holds and the tier each is read
        from, and for each of `engine_ids` the leading pages it holds in its own memory (from its KV events).
        By keys or token ids; one call for a prompt of any length. Extends no lease."""
        return self._run(node_calls.residency(namespace, keys, tokens, engine_ids), timeout_s)

    def route(self, namespace: Namespace, engine_ids: Sequence[str], keys: Sequence[Key] | None = None,
              tokens: Any = None, *, timeout_s: float | None = None) -> pb.RouteResponse:
        """Score candidate engines by how much of this prefix each can reuse (its GPU, then this store)."""
        return self._run(node_calls.route(namespace, engine_ids, keys, tokens), timeout_s)

    def delete(self, namespace: Namespace, keys: Sequence[Key], *, timeout_s: float | None = None) -> int:
        """Remove pages and every page that extends them; returns pages removed."""
        return self._run(node_calls.delete(namespace, keys), timeout_s)

    def _removing(self, namespace: Namespace, keys: Sequence[Key], *,
                  timeout_s: float | None = None) -> tuple[int, list[bytes], bool]:
        """delete(), answering also the removed pages' keys (node_calls.removing), for a cluster's delete."""
        return self._run(node_calls.removing(namespace, keys), timeout_s)

    def clear(self, namespace: Namespace, *, timeout_s: float | None = None) -> int:
        """Remove every page of the namespace; returns pages removed."""
        return self._run(node_calls.clear(namespace), timeout_s)

    def list_keys(self, namespace: Namespace, *, timeout_s: float | None = None) -> list[bytes]:
        """Keys of every page of the namespace, in byte order, each once (several ListKeys calls for a
        large one: a page held throughout is listed; one stored or removed meanwhile may be or not)."""
        return self._run(node_calls.list_keys(namespace), timeout_s)

    def list_pages(self, namespace: Namespace, *, timeout_s: float | None = None) -> PageSnapshot:
        """The namespace's pages with their tiers and parent keys (several ListPages calls for a large one),
        and the sequence number of the tenant's event stream that completes them (events.StoreInventory)."""
        return self._run(node_calls.list_pages(namespace), timeout_s)

    def events_run(self, namespace: Namespace, *, timeout_s: float | None = None) -> bytes:
        """The node's run as ListPages names it (events_run): it changes when the node restarts, and with it
        the numbering of its event streams. One call, no walk."""
        return self._run(node_calls.events_run(namespace), timeout_s)

    # -- page groups (groups.py): the parts of one position, visible and read together -----

    def stage(self, namespace: Namespace, keys: Sequence[Key] | None = None, buffers: Any = None,
              parent: Key | None = None, verify: bool = False, *, tokens: Any = None, anchor: Key | None = None,
              timeout_s: float | None = None, parents: Sequence[Key | None] | None = None) -> StagedPages:
        """Write pages into slots of the node (as put does) without making them visible: a part of a group,
        published with the other parts by commit_group(). At most limits.batch_pages_max keys (one lease).
        Pages staged and never committed are aborted by the node when their write lease expires.
        `parents` as put's."""
        return self._run(node_calls.stage(namespace, keys, buffers, parent, verify, tokens, anchor, parents),
                         timeout_s)

    def commit_group(self, parts: Sequence[StagedPages], *, timeout_s: float | None = None) -> list[PutResult]:
        """Make every staged page of every part visible in one step, or none (one CommitGroup); returns each
        part's count. When the node refuses the group (a lease expired, a parent left: the error names it),
        every lease of the group is aborted, the error raised, and nothing of the group is visible."""
        return self._run(node_calls.commit_group(parts), timeout_s)

    def abort_staged(self, parts: Sequence[StagedPages], *, timeout_s: float | None = None) -> None:
        """Give up staged parts: their leases are aborted and their pages never become visible."""
        return self._run(node_calls.abort_staged(parts), timeout_s)

    def put_group(self, keys: Sequence[Key], parts: Sequence[tuple[Namespace, Any]], parent: Key | None = None,
                  verify: bool = False, *, anchor: Key | None = None, timeout_s: float | None = None) -> PutResult:
        """Store the pages of several namespaces under the same keys (a KV page and its sidecar pages per
        key) so that each key's pages become visible together, in one commit; returns the leading keys
        stored in every part. `parts`: (namespace, that namespace's pages for the keys)."""
        return self._run(node_calls.put_group(keys, parts, parent, verify, anchor), timeout_s)

    def lookup_group(self, keys: Sequence[Key], parts: Sequence[GroupPart], *,
                     timeout_s: float | None = None) -> GroupHits:
        """Which prefixes of `keys` can be restored in every part (each under its hit policy), answered by the
        node from one snapshot: a group committed together is seen whole or not at all. Extends no lease."""
        return self._run(node_calls.lookup_group(keys, parts), timeout_s)

    def get_group(self, parts: Sequence[tuple[Namespace, Sequence[Key], Any]], verify: bool = False,
                  policy: str = "wait_complete", *, timeout_s: float | None = None) -> list[int]:
        """Copy the leading pages of several namespaces into their buffers, every part pinned in one step
        (one AcquireGroup), a key loaded in every part that names it or in none; returns each part's count.
        `parts`: (namespace, keys, out)."""
        return self._run(node_calls.get_group(parts, verify, policy), timeout_s)

    def stats(self, *, timeout_s: float | None = None) -> pb.StatsResponse:
        return self._run(node_calls.stats(), timeout_s)

    def register_buffer(self, address: int, nbytes: int, owner: Any = None) -> None:
        """Register [address, address + nbytes) (an engine's host KV pool) with the data plane once.

        Only RDMA uses it: pages inside the buffer are then moved without registering them per
        call. `owner` (the array or tensor) is held until the client closes; the buffer must
        stay allocated as long. Other data planes ignore it. It holds across reconnects.
        """
        if address <= 0 or nbytes <= 0:
            raise errors.InvalidArgument(f"bad buffer to register: address {address:#x}, {nbytes} bytes")
        with self._lock:
            self._check_open()
            self._registered.append((address, nbytes, owner))
            conn = self._conn
        _register_on(conn, [(address, nbytes, owner)])

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            conn = self._conn
        conn.retire()

    def __enter__(self) -> "KVStoreClient":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- the connection ---------------------------------------------------------------

    def _run(self, call: Steps[T], timeout_s: float | None) -> T:
        """Drive a call (node_calls.py) to its end. With `timeout_s`, every message it sends must be answered
        within it from now."""
        with call_deadline(timeout_s):
            return drive(call, self._on_node)

    def _on_node(self, step: OnNode) -> Any:
        """Take a call's OnNode step: its attempt driven on a connection (_with_connection)."""
        return self._with_connection(lambda conn: drive(step.attempt(conn), take_on(conn)), step.may_retry)

    def _with_connection(self, action: Callable[[NodeConnection], T], retry_if: Callable[[], bool]) -> T:
        """Run action(connection) on a standing connection; if the node was lost under it and retry_if(), once more
        on a new one."""
        conn = self._enter_connection()
        try:
            return _attempt(action, conn)
        except errors.Unavailable:
            if not retry_if():
                raise
            log.info("the connection to %s was lost during a call; calling again on a new one", self._options.target)
        finally:
            conn.leave()
        conn = self._enter_connection(lost=conn)
        try:
            return _attempt(action, conn)
        finally:
            conn.leave()

    def _enter_connection(self, lost: NodeConnection | None = None) -> NodeConnection:
        """The current connection, entered; replaced first if it is `lost` or found lost (one attempt)."""
        with self._lock:
            self._check_open()
            conn = self._conn
            if conn is not lost and conn.alive():
                conn.enter()
                return conn
        self._replace(conn)
        with self._lock:
            self._check_open()
            self._conn.enter()
            return self._conn

    def _replace(self, stale: NodeConnection) -> None:
        """Open a new connection in place of `stale` (unless another call just did); raises Unavailable while the node is down."""
        with self._replace_lock:
            if self._conn is not stale:
                return
            fresh = NodeConnection(self._options)
            try:
                _register_on(fresh, self._registered)
            except errors.KVStoreError as exc:   # calls still register their pages one by one
                log.warning("buffers could not be registered on the new connection: %s", exc)
            with self._lock:
                self._conn = fresh
        stale.retire()
        if fresh.instance_id != stale.instance_id:
            log.warning("kvstore node at %s restarted: connected to the new instance over %s",
                        self._options.target, fresh.data.name)
        else:
            log.info("connection to the kvstore node at %s opened again over %s", self._options.target, fresh.data.name)

    def _check_open(self) -> None:
        if self._closed:
            raise errors.InvalidArgument("this KVStoreClient is closed: open a new one")

    # -- for tests and tools that speak the protocol directly -------------------------

    @property
    def _grpc(self) -> Any:
        return self._conn.grpc

    @property
    def _local(self) -> Any:
        return self._conn.local

    @property
    def _control(self) -> Any:
        return self._conn.control

    @property
    def _arena(self) -> Any:
        return getattr(self._conn.data, "arena", None)

    def _namespace_id(self, namespace: Namespace) -> int:
        return self._conn.namespace_id(namespace)


def _attempt(action: Callable[[NodeConnection], T], conn: NodeConnection) -> T:
    """Run `action`; an error raised because the connection was lost under it becomes Unavailable (lost_under)."""
    try:
        return action(conn)
    except errors.KVStoreError as exc:
        reported = lost_under(exc, conn)
        if reported is exc:
            raise
        raise reported from exc


def _register_on(conn: NodeConnection, buffers: Sequence[tuple[int, int, Any]]) -> None:
    register = getattr(conn.data, "register", None)
    if register is not None:
        for address, nbytes, owner in buffers:
            register(owner, address, nbytes)
