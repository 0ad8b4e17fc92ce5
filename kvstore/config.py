"""Configuration: one tree of frozen dataclasses, loaded once.

Order: defaults, then a TOML file, then KVSTORE_<SECTION>_<FIELD> environment variables,
then command-line `--set section.field=value` overrides. An unknown key or an unparsable
value stops start-up with a ConfigError naming the dotted path. Nothing else in the
server reads os.environ.
"""

from __future__ import annotations

import dataclasses
import fractions
import ipaddress
import math
import os
import re
import tempfile
import tomllib
import typing
from typing import Any, Mapping

ENV_PREFIX = "KVSTORE_"
# The client SDK's own variables (kvstore_client/credentials.py): a shell may export them for the
# `kvstore` CLI next to a node's, so the node's loader passes over them.
CLIENT_ENV = frozenset({"KVSTORE_TOKEN", "KVSTORE_TLS_CA", "KVSTORE_TLS_CERT", "KVSTORE_TLS_KEY"})
# A page's hit count saturates here in both page indexes (the C one keeps it in 32 bits): a
# controller.selective_hits above it would never be reached.
PAGE_HITS_MAX = 0xFFFFFFFF


class ConfigError(ValueError):
    """A setting is unknown or invalid; the message names its dotted path."""


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    grpc_address: str = "127.0.0.1:50051"   # host:port; port 0 picks a free one
    ready_file: str = ""                    # written with the bound endpoints once serving
    drain_timeout_s: float = 30.0           # SIGTERM waits this long for open leases
    log_level: str = "INFO"
    grpc_workers: int = 8
    native_index: bool = True               # the page index in C when kvstore_native has it (false: Python's)


@dataclasses.dataclass(frozen=True)
class DramConfig:
    arena_bytes: int = 1 << 30              # the whole DRAM tier, allocated at start-up
    slab_bytes: int = 64 << 20              # arena unit handed to one page size at a time
    hugepages: bool = False                 # MFD_HUGETLB; needs reserved huge pages
    prefault: bool = True                   # touch every page at start-up, fail early if short


@dataclasses.dataclass(frozen=True)
class NvmeConfig:
    enabled: bool = True
    paths: tuple[str, ...] = ()             # a directory per disk; () = <cache dir>/kvstore/nvme-0
    # LMDB shards in each path, written at once (tiers/nvme_layout.py). LMDB alone on one core of a virtual
    # disk: 2,900-3,700 pages of 64 KiB a second with one shard, 4,100-4,800 with two, 5,300-5,700 with four.
    # A node confined to one core (bench/writedown_latency.py) wrote down 1.4-1.6x the pages with four, and
    # 1.0-1.3x at writer_nice 19, but its writers took the CPU from serving: a reader's p99 under write-down
    # 5.0-7.5x idle at nice 0, 4.4-4.9 ms at 19, against 1.9-2.8 ms with one shard. Give a node with cores to
    # spare more than one.
    shards_per_path: int = 1
    map_bytes: int = 16 << 30               # upper bound of each path's files (its shards share it); full -> evict
    io_threads: int = 8                     # page reads in flight at once (promotion)


@dataclasses.dataclass(frozen=True)
class ControllerConfig:
    write_policy: str = "write_through"     # write_through | write_through_selective | write_back
    selective_hits: int = 2                 # write_through_selective: hits before a page is written down
    high_watermark: float = 0.9             # write_back: DRAM fill above which LRU pages are written down
    queue_pages_max: int = 8192             # pages waiting to be written down or prefetched
    write_batch_pages: int = 64             # pages the controller writes down per pass
    # Page bytes per LMDB transaction. A commit writes and syncs its pages in the kernel in one
    # stretch, and a get on the same core waits behind it: with the node on one core
    # (bench/writedown_latency.py) 4 MiB commits put a one-page get's p99 at 11 ms, 256 KiB
    # ones at 1.9 ms (idle: 0.5 ms), for 25% less write-down throughput (more fsyncs). Writers under
    # SCHED_IDLE (writer_idle) do not change this: a commit's copy into the page cache is one system call,
    # which a kernel without preemption inside system calls (PREEMPT_NONE) runs to its end. With idle
    # writers: 1 MiB commits, p99 4.7-4.9 ms and 1.3x the pages a second; 4 MiB, 10.3-10.8 ms and 1.3x.
    # Swept again in one hour, a reader's p99 loaded/idle and pages written down a second: 256 KiB 1.04-1.87x and
    # 3,027-3,462; 384 KiB 1.59-2.15x and 3,469-4,538; 512 KiB 1.29-3.06x and 4,672-5,005; 1 MiB 1.66-2.42x and
    # 5,677-5,856; two shards of 256 KiB, 2.41-2.42x and 3,642-3,885. A shard whose file still grows pays for it
    # in every commit's sync: LMDB alone committed the same transactions 1.45-1.6x faster into the freed pages of
    # a shard that had been written and emptied. Growing the file ahead (zeros written, or fallocate) gained
    # nothing overall: the zeros cost the disk what the commits saved. What a reader feels is the kernel's work
    # for these writes on its core, not the node's: a process doing nothing but such commits, under SCHED_IDLE on
    # the core of an otherwise idle node (2,200-2,400 pages/s), moved a one-page get from p50 222-309 us and p99
    # 427-1,264 us to 353-597 and 1,456-1,971. LMDB's writemap (the copy made in user space, which the kernel
    # can preempt) did worse: p99 under write-down 2.1-4.0 ms against 1.6-2.0, at 2,150-2,600 pages/s against
    # 3,070-3,310, alternated.
    write_txn_bytes: int = 256 << 10
    # The background's LMDB writes run on threads under SCHED_IDLE: a serving thread that wakes takes the core
    # from them at once (the kernel preempts an idle-policy thread for any other that wakes; a nice one only as
    # its fair share says, and with niceness alone the p99 below stayed 2.2-3.1 ms). They hold neither the
    # store's lock nor, in the kernel's copy into the page cache that is most of their CPU, the GIL; the
    # controller thread that claims and releases their batches keeps the node's priority. One shard, the node on
    # one core (bench/writedown_latency.py): a one-page get's p99 under write-down 1.7-2.3 ms against 2.6-3.1
    # ms, where the same loader with nothing written down puts it at 2.2-2.4 ms; 2,200-3,000 pages a second
    # written down against 2,700-3,200. A caller's own write-down (room for its Reserve, a durable commit) is
    # serving and runs on its thread. false: the writers run at the node's niceness plus writer_nice.
    writer_idle: bool = True
    # Niceness the background write-down threads add to the node's where writer_idle is false (0: the same).
    # Four shards, the node on one core: a reader's p99 under write-down 5.0-7.5x idle at 0, 1.9-4.3x at 10,
    # 1.4-3.0x at 19, for 10-25% fewer pages a second.
    writer_nice: int = 0
    prefetch_timeout_ms: int = 1000         # TIMEOUT policy default, and the bound of background prefetch
    promote_wait_ms_max: int = 10_000       # WAIT_COMPLETE waits at most this long


@dataclasses.dataclass(frozen=True)
class ShmConfig:
    enabled: bool = True
    socket_path: str = ""                   # "" = <tmp>/kvstore-<uid>/kvstore.sock
    allowed_uids: tuple[int, ...] = ()      # () = only the server's own uid
    connections_max: int = 256              # local-channel connections at once (a thread each); more are refused
    # After answering, a connection polls this long for its next frame before it sleeps: a put's
    # next message mostly comes within it, and a sleeping thread's wake-up costs 25-45 us on a VM.
    # 0: sleep at once (a node sharing its cores with busy engines).
    spin_us: int = 200


@dataclasses.dataclass(frozen=True)
class LeaseConfig:
    read_ttl_ms: int = 10_000
    write_ttl_ms: int = 30_000
    ttl_ms_max: int = 300_000               # the most a client may ask for
    reap_interval_ms: int = 50
    per_tenant_max: int = 8192              # leases one tenant holds open at once; more: CapacityExhausted


@dataclasses.dataclass(frozen=True)
class LimitsConfig:
    batch_pages_max: int = 1024
    lookup_pages_max: int = 32768           # pages in one Lookup/Route: a 512k-token prompt at 16 tokens a page
    page_bytes_max: int = 0                 # 0 = dram.slab_bytes (a page fits in one slab)
    name_bytes_max: int = 256               # model, tenant, layout and dtype strings of a namespace
    namespaces_per_tenant_max: int = 1024   # open namespaces of one tenant; idle ones are reclaimed first
    namespaces_per_tenant_floor: int = 16   # a tenant opens this many even when others fill the node's 4096
    stats_namespaces_max: int = 1000        # namespaces in one Stats answer (the rest are paged)


@dataclasses.dataclass(frozen=True)
class TcpConfig:
    """The TCP data plane (clients on other hosts); see kvstore/transport/tcp.py."""

    enabled: bool = True
    address: str = ""                       # host:port to listen on (port 0: a free one); "" = grpc's host, port 0
    advertise_host: str = ""                # host put in Hello's tcp_endpoint; "" = derived (transport/advertise.py)
    connections_max: int = 1024             # connections at once; a client keeps two (pages, and its calls)
    idle_timeout_s: float = 300.0           # a connection with no frame for this long is closed
    write_buffer_high_bytes: int = 16 << 20  # stop reading a connection's requests above this queued output
    write_buffer_low_bytes: int = 4 << 20
    congestion: str = ""                    # TCP_CONGESTION of accepted sockets (e.g. cubic); "" = system's
    tls_cert: str = ""                      # PEM certificate chain; with tls_key the data plane speaks TLS only
    tls_key: str = ""                       # PEM private key of tls_cert


@dataclasses.dataclass(frozen=True)
class RdmaConfig:
    """The RDMA data plane (pyverbs); see kvstore/transport/rdma.py. Off unless asked for.

    EXPERIMENTAL: never run on an RDMA NIC. Its logic is tested only against a model of the
    verbs contract (kvstore_client/verbs_model.py); the pyverbs calls under it have never
    executed. Needs RLIMIT_MEMLOCK of at least dram.arena_bytes (the arena is pinned).
    """

    enabled: bool = False                   # EXPERIMENTAL, never run on a NIC (see the docstring above)
    device: str = ""                        # "" = the first device with an ACTIVE port and a RoCE v2 GID
    port: int = 1
    gid_index: int = -1                     # -1 (the default) = pick a RoCE v2 GID, IPv4-mapped first
    queue_pairs_max: int = 256              # one per client; full = evict one idle past idle_evict_s, else refuse
    allowed_peers: tuple[str, ...] = ()     # IP addresses/networks of clients' RoCE GIDs; () = refuse every peer
    idle_evict_s: float = 300.0             # a queue pair unused this long may be evicted for a new client
    hop_limit: int = 64                     # RoCE v2 TTL
    traffic_class: int = 0                  # RoCE v2 DSCP/ECN byte
    service_level: int = 0                  # 802.1p priority / PFC class


def _ip_network(text: str) -> bool:
    try:
        ipaddress.ip_network(text, strict=False)
    except ValueError:
        return False
    return True


@dataclasses.dataclass(frozen=True)
class OpsConfig:
    metrics_address: str = "127.0.0.1:9452"  # Prometheus /metrics, host:port; port 0 picks one; "" = off
    log_format: str = "text"                 # text, json or logfmt (one line per event)
    reflection: bool = False                 # gRPC server reflection (grpc.reflection.v1alpha)


@dataclasses.dataclass(frozen=True)
class SystemdConfig:
    # Filled from systemd's own variables (NOTIFY_SOCKET, WATCHDOG_USEC, WATCHDOG_PID) when
    # it runs the unit; "" / 0 = not under systemd (no notifications, no watchdog).
    notify_socket: str = ""
    watchdog_usec: int = 0
    watchdog_pid: int = 0


@dataclasses.dataclass(frozen=True)
class EventsConfig:
    """Engines whose KV events (vLLM/SGLang --kv-events-config) feed the ENGINE tier."""
    engine_ids: tuple[str, ...] = ()        # one id per endpoint; Route names engines by these
    endpoints: tuple[str, ...] = ()         # each engine's ZMQ PUB endpoint, e.g. tcp://10.0.0.5:5557
    replay_endpoints: tuple[str, ...] = ()  # () or one per endpoint ("" = none): the engine's ROUTER
    topic: str = ""                         # the engines' kv-events topic
    hash_seed: str = ""                     # prior hash of the first page, as in the namespace
    blocks_max: int = 4_000_000             # engine pages indexed across engines; more are dropped
    replay_timeout_ms: int = 2_000          # wait for a replay answer at most this long
    # () or one per engine: the tokens per block it publishes (vLLM --block-size, SGLang --page-size).
    # Blocks of another size are refused at subscription; Route compares namespaces with it at once.
    block_tokens: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True)
class EventsOutConfig:
    """This store's own page events, in vLLM's KV-event wire format, for KV-aware routers (store_events.py)."""
    enabled: bool = False
    # ZMQ PUB and replay ROUTER endpoints. PUB cannot tell subscribers apart, so each tenant's stream is
    # scoped by topic only: bound to loopback or a Unix socket unless events_out.allow_remote says otherwise.
    endpoint: str = "tcp://127.0.0.1:5567"
    replay_endpoint: str = "tcp://127.0.0.1:5568"   # "" = no replay socket (a lost batch needs a snapshot)
    replay_batches: int = 10_000            # batches kept per tenant for replay
    batch_events_max: int = 1_024           # pages per published batch
    queue_pages_max: int = 1_000_000        # page events waiting to be published; past it a gap (see docs)
    hwm: int = 100_000                      # the PUB socket's high-water mark, in messages
    allow_remote: bool = False              # bind a non-loopback endpoint: any host that reaches it sees every topic


@dataclasses.dataclass(frozen=True)
class RouteConfig:
    """What a page is worth to Route, by where it is: in the engine's GPU it costs nothing to use."""
    weight_engine_gpu: float = 1.0
    weight_engine_host: float = 0.8         # the engine's own CPU offload
    weight_dram: float = 0.6                # this store's DRAM: one copy to the engine
    weight_nvme: float = 0.3                # this store's NVMe: a read, then a copy
    engines_max: int = 256                  # candidate engines in one Route


@dataclasses.dataclass(frozen=True)
class ScrubConfig:
    """Background integrity checks: re-read pages and compare them with their checksums."""
    bytes_per_s: int = 0                    # pages re-read per second, in bytes; 0 = off (one pass on demand only)


@dataclasses.dataclass(frozen=True)
class HbmConfig:
    """The HBM tier: a pool of one GPU's memory, allocated whole at start-up and exported over CUDA IPC
    to engines on this host (kvstore/tiers/hbm.py). pool_bytes 0 = no HBM tier."""
    pool_bytes: int = 0                     # at least dram.slab_bytes
    device: int = 0                         # CUDA device index, as this process sees them
    promote_hits: int = 2                   # reads by engines on this host before a page is copied in


@dataclasses.dataclass(frozen=True)
class AuthConfig:
    """Who may call the node, as which tenant (kvstore/control/identity.py). Nothing set = one trusted
    tenant on loopback and the local socket only, as a node without authentication always was."""
    tokens_file: str = ""                   # lines "<sha256 hex of a token> <tenant> <tenant|admin> [expires]"; SIGHUP rereads
    tls_cert: str = ""                      # PEM certificate chain of the gRPC port; with tls_key, gRPC speaks TLS only
    tls_key: str = ""                       # PEM private key of tls_cert
    tls_client_ca: str = ""                 # PEM CA of client certificates: mutual TLS, the certificate's CN is the tenant
    local_uids: tuple[str, ...] = ()        # "uid:tenant" or "uid:tenant:admin": the local socket's peers, by uid
    local_require_token: bool = False       # a local connection also shows a token of its uid's tenant, in its first frame
    allow_unauthenticated_remote: bool = False  # serve a non-loopback address with no authentication configured

    @property
    def enabled(self) -> bool:
        """Callers are told apart: every plane resolves an identity, and unknown callers are refused."""
        return bool(self.tokens_file or self.tls_client_ca or self.local_uids)

    @property
    def remote(self) -> bool:
        """A caller on another host can prove who it is (a token, or a client certificate)."""
        return bool(self.tokens_file or self.tls_client_ca)


@dataclasses.dataclass(frozen=True)
class TenantsConfig:
    """What each tenant may hold (kvstore/control/quotas.py). A tenant not listed is bounded only by the node."""
    # "tenant:dram_bytes:nvme_bytes" (sizes like 2g; 0 = no limit), or in a file the table
    # [tenants.quotas] with entries  tenant = {dram_bytes = "2g", nvme_bytes = "20g"}
    quotas: tuple[str, ...] = ()

    def quota_table(self) -> dict[str, tuple[int, int]]:
        """tenant -> (dram_bytes, nvme_bytes); 0 is no limit. Raises ValueError naming a bad entry."""
        table: dict[str, tuple[int, int]] = {}
        for entry in self.quotas:
            parts = entry.rsplit(":", 2)
            if len(parts) != 3 or not parts[0]:
                raise ValueError(f"{entry!r} is not tenant:dram_bytes:nvme_bytes")
            tenant, dram, nvme = parts
            if tenant in table:
                raise ValueError(f"tenant {tenant!r} is listed twice: give each tenant one entry")
            sizes = tuple(_parse(f"tenants.quotas[{tenant}]", int, size) for size in (dram, nvme))
            if min(sizes) < 0:
                raise ValueError(f"{entry!r}: a quota is a byte count, 0 for no limit")
            table[tenant] = sizes
        return table


@dataclasses.dataclass(frozen=True)
class ClusterConfig:
    """Membership in a cluster of nodes on etcd (kvstore/cluster/); no endpoints = a node alone."""
    endpoints: tuple[str, ...] = ()         # etcd client URLs, e.g. http://10.0.0.1:2379
    name: str = "kvstore"                   # the cluster: nodes and clients of one name form one pool
    node_id: str = ""                       # unique in the cluster; "" = the host name
    host_id: str = ""                       # nodes with the client's host id offer it shared memory; "" = machine id
    advertise_host: str = ""                # host clients reach gRPC at (the member record); "" = derived, as tcp's
    required: bool = True                   # etcd unreachable at start: exit (true) or serve alone and retry (false)
    lease_ttl_s: int = 10                   # a dead node leaves the membership this long after its last renewal
    ramp_s: float = 60.0                    # a new node's placement weight grows to full over this long
    etcd_timeout_s: float = 3.0             # each etcd call
    etcd_tls_ca: str = ""                   # PEM CA of etcd's certificate: etcd over TLS (https:// endpoints)
    etcd_tls_cert: str = ""                 # PEM certificate this node presents to etcd (--client-cert-auth)
    etcd_tls_key: str = ""                  # its private key
    # Replication by popularity (control/read_heat.py): a page read this often per half-life here is
    # flagged hot in Acquire's answer, and the cluster client copies it to its other replicas.
    hot_reads: int = 4                      # 0 = never flag a page
    hot_half_life_s: float = 60.0
    hot_pages_max: int = 65536              # pages whose reads are counted (the least recently read go)


@dataclasses.dataclass(frozen=True)
class TestingConfig:
    """Fault injection for the crash tests; empty in production (kvstore/failpoints.py)."""
    failpoints: str = ""                    # e.g. "commit.after_publish=kill@3"
    failpoints_seed: int = 0                # seeds the probabilistic (kill%P) points
    hbm_on_host: bool = False               # a host memfd stands in for the HBM pool's GPU (tests without CUDA)


@dataclasses.dataclass(frozen=True)
class Config:
    server: ServerConfig = ServerConfig()
    dram: DramConfig = DramConfig()
    nvme: NvmeConfig = NvmeConfig()
    controller: ControllerConfig = ControllerConfig()
    shm: ShmConfig = ShmConfig()
    leases: LeaseConfig = LeaseConfig()
    limits: LimitsConfig = LimitsConfig()
    tcp: TcpConfig = TcpConfig()
    rdma: RdmaConfig = RdmaConfig()
    ops: OpsConfig = OpsConfig()
    systemd: SystemdConfig = SystemdConfig()
    events: EventsConfig = EventsConfig()
    events_out: EventsOutConfig = EventsOutConfig()
    route: RouteConfig = RouteConfig()
    scrub: ScrubConfig = ScrubConfig()
    hbm: HbmConfig = HbmConfig()
    auth: AuthConfig = AuthConfig()
    tenants: TenantsConfig = TenantsConfig()
    cluster: ClusterConfig = ClusterConfig()
    testing: TestingConfig = TestingConfig()

    @property
    def shm_socket_path(self) -> str:
        if self.shm.socket_path:
            return self.shm.socket_path
        return os.path.join(tempfile.gettempdir(), f"kvstore-{os.getuid()}", "kvstore.sock")

    @property
    def nvme_paths(self) -> tuple[str, ...]:
        if self.nvme.paths:
            return self.nvme.paths
        cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        return (os.path.join(cache, "kvstore", "nvme-0"),)

    @property
    def grpc_host(self) -> str:
        """server.grpc_address's host ("" or 0.0.0.0: every interface)."""
        return self.server.grpc_address.rpartition(":")[0]

    @property
    def tcp_address(self) -> str:
        """Where the TCP data plane listens: tcp.address, else server.grpc_address's host on a free port."""
        return self.tcp.address or f"{self.grpc_host}:0"

    @property
    def allowed_uids(self) -> frozenset[int]:
        return frozenset(self.shm.allowed_uids or (os.getuid(),))


def load(path: str | None = None, environ: Mapping[str, str] | None = None,
         overrides: list[str] | None = None) -> Config:
    """Build the effective configuration; raises ConfigError naming the bad dotted path.

    Without `path`, the file named by KVSTORE_CONFIG is read, if set.
    """
    environ = os.environ if environ is None else environ
    path = path or environ.get(ENV_PREFIX + "CONFIG")
    tree: dict[str, dict[str, Any]] = {}
    if path:
        try:
            with open(path, "rb") as f:
                document = tomllib.load(f)
        except OSError as exc:
            raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
        for section, values in document.items():
            if not isinstance(values, dict):
                raise ConfigError(f"{section}: expected a [{section}] table")
            for key, value in values.items():
                _put(tree, f"{section}.{key}", value)
    for name, value in sorted(environ.items()):
        if name.startswith(ENV_PREFIX) and name != ENV_PREFIX + "CONFIG" and name not in CLIENT_ENV:
            try:
                _put(tree, _env_to_dotted(name), value)
            except ConfigError as exc:
                raise ConfigError(f"environment variable {name}: {exc}; every {ENV_PREFIX}<SECTION>_<FIELD> "
                                  f"variable is a setting: unset it or name a setting") from None
    for name, dotted in _SYSTEMD_ENV.items():
        if environ.get(name):
            _put(tree, dotted, environ[name])
    for item in overrides or ():
        dotted, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"override {item!r} must look like section.field=value")
        _put(tree, dotted.strip(), value.strip())
    return _build(tree)


# systemd's protocol variables (sd_notify(3), sd_watchdog_enabled(3)); the unit cannot rename them.
_SYSTEMD_ENV = {"NOTIFY_SOCKET": "systemd.notify_socket", "WATCHDOG_USEC": "systemd.watchdog_usec",
                "WATCHDOG_PID": "systemd.watchdog_pid"}


def _env_to_dotted(name: str) -> str:
    rest = name[len(ENV_PREFIX):].lower()
    # The longest section name that prefixes it: KVSTORE_EVENTS_OUT_ENDPOINT is events_out.endpoint.
    for section in sorted(_SECTION_TYPES, key=len, reverse=True):
        if rest.startswith(section + "_"):
            return f"{section}.{rest[len(section) + 1:]}"
    section, _, field = rest.partition("_")
    return f"{section}.{field}"


def _put(tree: dict[str, dict[str, Any]], dotted: str, value: Any) -> None:
    section, _, field = dotted.partition(".")
    if section not in _SECTION_TYPES or not field:
        raise ConfigError(f"{dotted}: unknown setting (sections: {', '.join(_SECTION_TYPES)})")
    section_cls = _SECTION_TYPES[section]
    fields = {f.name: f for f in dataclasses.fields(section_cls)}
    if field not in fields:
        raise ConfigError(f"{dotted}: unknown setting (known in [{section}]: {', '.join(fields)})")
    tree.setdefault(section, {})[field] = _parse(dotted, _FIELD_TYPES[section][field], value)


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def _parse(dotted: str, kind: Any, value: Any) -> Any:
    if typing.get_origin(kind) is tuple and isinstance(value, dict):   # a TOML table: [tenants.quotas]
        return tuple(_quota_entry(dotted, name, limits) for name, limits in value.items())
    try:
        if kind is bool:
            if isinstance(value, bool):
                return value
            text = str(value).strip().lower()
            if text in ("1", "true", "yes", "on"):
                return True
            if text in ("0", "false", "no", "off"):
                return False
            raise ValueError
        if kind is int:
            if isinstance(value, bool):
                raise ValueError
            if isinstance(value, int):
                return value
            match = _SIZE.match(str(value))
            if not match:
                raise ValueError
            number, unit = match.groups()
            scale = _UNITS[(unit or "")[:1].lower()]
            amount = fractions.Fraction(number) * scale
            if scale == 1 and amount.denominator != 1:     # a fraction of a byte or of a count
                raise ValueError
            return math.floor(amount)     # 21.9GiB: the whole bytes it names, as a refusal's "at most" quotes them
        if kind is float:
            if isinstance(value, bool):
                raise ValueError
            return float(value)
        if kind is str:
            if not isinstance(value, str):
                raise ValueError
            return value
        if typing.get_origin(kind) is tuple:
            items = value if isinstance(value, list) else [v.strip() for v in str(value).split(",") if v.strip()]
            return tuple(_parse(dotted, typing.get_args(kind)[0], v) for v in items)
    except (ValueError, TypeError):
        pass
    raise ConfigError(f"{dotted}: cannot read {value!r} as {getattr(kind, '__name__', kind)}")


def _quota_entry(dotted: str, tenant: str, limits: Any) -> str:
    """One entry of a [tenants.quotas] table as "tenant:dram_bytes:nvme_bytes"."""
    if not isinstance(limits, dict) or set(limits) - {"dram_bytes", "nvme_bytes"}:
        raise ConfigError(f"{dotted}.{tenant}: expected {{dram_bytes = ..., nvme_bytes = ...}}, got {limits!r}")
    return f"{tenant}:{limits.get('dram_bytes', 0)}:{limits.get('nvme_bytes', 0)}"


def _build(tree: dict[str, dict[str, Any]]) -> Config:
    config = Config(**{name: _SECTION_TYPES[name](**values) for name, values in tree.items()})
    _validate(config)
    return config


def _validate(config: Config) -> None:
    checks = [
        ("dram.arena_bytes", config.dram.arena_bytes >= config.dram.slab_bytes,
         f"must be at least dram.slab_bytes ({config.dram.slab_bytes})"),
        ("dram.slab_bytes", config.dram.slab_bytes >= 4096 and config.dram.slab_bytes % 4096 == 0,
         "must be a positive multiple of 4096"),
        ("limits.page_bytes_max", 0 <= config.limits.page_bytes_max <= config.dram.slab_bytes,
         f"must be between 1 and dram.slab_bytes ({config.dram.slab_bytes}), or 0 for dram.slab_bytes"),
        ("limits.batch_pages_max", 0 < config.limits.batch_pages_max <= 65536, "must be 1 to 65536"),
        ("limits.lookup_pages_max", 0 < config.limits.lookup_pages_max <= 65536, "must be 1 to 65536"),
        ("leases.read_ttl_ms", 0 < config.leases.read_ttl_ms <= config.leases.ttl_ms_max,
         "must be positive and at most leases.ttl_ms_max"),
        ("leases.write_ttl_ms", 0 < config.leases.write_ttl_ms <= config.leases.ttl_ms_max,
         "must be positive and at most leases.ttl_ms_max"),
        ("leases.reap_interval_ms", config.leases.reap_interval_ms > 0, "must be positive"),
        ("server.drain_timeout_s", config.server.drain_timeout_s >= 0, "must not be negative"),
        ("server.grpc_workers", config.server.grpc_workers > 0, "must be positive"),
        ("server.log_level", config.server.log_level.upper() in ("DEBUG", "INFO", "WARNING", "ERROR"),
         "must be DEBUG, INFO, WARNING or ERROR"),
        ("server.grpc_address", ":" in config.server.grpc_address, "must look like host:port"),
        ("nvme.shards_per_path", 1 <= config.nvme.shards_per_path <= 64, "must be 1 to 64"),
        ("nvme.paths", max(len(config.nvme.paths), 1) * max(config.nvme.shards_per_path, 1) <= 256,
         "with nvme.shards_per_path, at most 256 shards in all (the page index numbers them in a byte)"),
        ("nvme.map_bytes", config.nvme.map_bytes // max(config.nvme.shards_per_path, 1) >= 2 << 20,
         f"must be at least 2MiB for each of a path's nvme.shards_per_path ({config.nvme.shards_per_path}) shards"),
        ("nvme.io_threads", 0 < config.nvme.io_threads <= 256, "must be 1 to 256"),
        ("controller.write_policy", config.controller.write_policy in
         ("write_through", "write_through_selective", "write_back"),
         "must be write_through, write_through_selective or write_back"),
        ("controller.selective_hits", 1 <= config.controller.selective_hits <= PAGE_HITS_MAX,
         f"must be 1 to {PAGE_HITS_MAX} (a page's hits saturate there)"),
        ("controller.high_watermark", 0 < config.controller.high_watermark <= 1, "must be in (0, 1]"),
        ("controller.queue_pages_max", config.controller.queue_pages_max > 0, "must be positive"),
        ("controller.write_batch_pages", config.controller.write_batch_pages > 0, "must be positive"),
        ("controller.write_txn_bytes", config.controller.write_txn_bytes >= 4096, "must be at least 4KiB"),
        ("controller.writer_nice", 0 <= config.controller.writer_nice <= 19, "must be 0 to 19"),
        ("tcp.address", not config.tcp.address or config.tcp.address.rpartition(":")[2].isdigit(),
         "must look like host:port"),
        ("tcp.connections_max", config.tcp.connections_max > 0, "must be positive"),
        ("tcp.tls_key", bool(config.tcp.tls_cert) == bool(config.tcp.tls_key), "needs tcp.tls_cert with it (both or neither)"),
        ("tcp.idle_timeout_s", config.tcp.idle_timeout_s > 0, "must be positive"),
        ("shm.connections_max", config.shm.connections_max > 0, "must be positive"),
        ("shm.spin_us", 0 <= config.shm.spin_us <= 10_000, "must be 0 (no polling) to 10000 microseconds"),
        ("limits.name_bytes_max", 16 <= config.limits.name_bytes_max <= 4096, "must be 16 to 4096"),
        ("limits.namespaces_per_tenant_max", config.limits.namespaces_per_tenant_max > 0, "must be positive"),
        ("limits.namespaces_per_tenant_floor", config.limits.namespaces_per_tenant_floor >= 0, "must not be negative"),
        ("limits.stats_namespaces_max", config.limits.stats_namespaces_max > 0, "must be positive"),
        ("leases.per_tenant_max", config.leases.per_tenant_max > 0, "must be positive"),
        ("scrub.bytes_per_s", config.scrub.bytes_per_s >= 0, "must not be negative (0 = off)"),
        ("tcp.write_buffer_low_bytes", 0 <= config.tcp.write_buffer_low_bytes <= config.tcp.write_buffer_high_bytes,
         "must be between 0 and tcp.write_buffer_high_bytes"),
        ("rdma.queue_pairs_max", config.rdma.queue_pairs_max > 0, "must be positive"),
        ("rdma.gid_index", config.rdma.gid_index >= -1, "must be -1 (pick) or a GID table index"),
        ("rdma.allowed_peers", all(_ip_network(p) for p in config.rdma.allowed_peers),
         "must be IP addresses or networks (10.1.0.0/16, fd00::/8)"),
        ("rdma.idle_evict_s", config.rdma.idle_evict_s > 0, "must be positive"),
        ("rdma.hop_limit", 1 <= config.rdma.hop_limit <= 255, "must be in 1..255"),
        ("rdma.traffic_class", 0 <= config.rdma.traffic_class <= 255, "must be in 0..255"),
        ("rdma.service_level", 0 <= config.rdma.service_level <= 15, "must be in 0..15"),
        ("ops.metrics_address", not config.ops.metrics_address or ":" in config.ops.metrics_address,
         'must look like host:port, or "" to serve no metrics'),
        ("ops.log_format", config.ops.log_format in ("text", "json", "logfmt"), "must be text, json or logfmt"),
        ("systemd.watchdog_usec", config.systemd.watchdog_usec >= 0, "must not be negative"),
        ("hbm.pool_bytes", config.hbm.pool_bytes >= 0, "must not be negative (0 = no HBM tier)"),
        ("hbm.pool_bytes", not config.hbm.pool_bytes or config.hbm.pool_bytes >= config.dram.slab_bytes,
         f"must be 0 or at least dram.slab_bytes ({config.dram.slab_bytes}): the pool is cut into slabs as the "
         "arena is"),
        ("hbm.promote_hits", config.hbm.promote_hits >= 1, "must be at least 1"),
        ("hbm.device", config.hbm.device >= 0, "must be a CUDA device index"),
    ]
    checks += _events_checks(config.events) + _events_out_checks(config.events_out)
    checks += _route_checks(config.route) + _auth_checks(config)
    checks += _cluster_checks(config.cluster)
    for dotted, ok, why in checks:
        if not ok:
            raise ConfigError(f"{dotted}: {why}")
    try:
        config.tenants.quota_table()
    except (ValueError, ConfigError) as exc:
        raise ConfigError(f"tenants.quotas: {exc}") from None


def _events_checks(events: EventsConfig) -> list[tuple[str, bool, str]]:
    ids = events.engine_ids
    return [
        ("events.endpoints", len(events.endpoints) == len(ids), "needs one endpoint per events.engine_ids entry"),
        ("events.engine_ids", len(set(ids)) == len(ids) and all(ids), "must be distinct, non-empty ids"),
        ("events.replay_endpoints", len(events.replay_endpoints) in (0, len(ids)),
         "must be empty or hold one entry per events.engine_ids entry"),
        ("events.endpoints", all(e.startswith(("tcp://", "ipc://")) for e in events.endpoints),
         "each must be a ZMQ tcp:// or ipc:// endpoint"),
        ("events.blocks_max", events.blocks_max > 0, "must be positive"),
        ("events.replay_timeout_ms", events.replay_timeout_ms > 0, "must be positive"),
        ("events.block_tokens", len(events.block_tokens) in (0, len(ids)) and all(t > 0 for t in events.block_tokens),
         "must be empty or hold one positive count of tokens per events.engine_ids entry"),
        ("events.hash_seed", _is_hex(events.hash_seed), "must be a hex string"),
    ]


def _events_out_checks(out: EventsOutConfig) -> list[tuple[str, bool, str]]:
    endpoints = [("events_out.endpoint", out.endpoint)] + (
        [("events_out.replay_endpoint", out.replay_endpoint)] if out.replay_endpoint else [])
    checks = [(dotted, endpoint.startswith(("tcp://", "ipc://")), "must be a ZMQ tcp:// or ipc:// endpoint")
              for dotted, endpoint in endpoints]
    checks += [(dotted, out.allow_remote or _zmq_local(endpoint),
                f"{endpoint} is not a loopback address or a Unix socket, and a ZMQ PUB socket cannot check who "
                "subscribes (every tenant's topic would reach any host): bind 127.0.0.1 or ipc://, or set "
                "events_out.allow_remote = true") for dotted, endpoint in endpoints]
    return checks + [
        ("events_out.replay_endpoint", out.replay_endpoint != out.endpoint, "must differ from events_out.endpoint"),
        ("events_out.replay_batches", out.replay_batches > 0, "must be positive"),
        ("events_out.batch_events_max", 0 < out.batch_events_max <= 65_536, "must be 1 to 65536"),
        ("events_out.queue_pages_max", out.queue_pages_max >= out.batch_events_max,
         "must be at least events_out.batch_events_max"),
        ("events_out.hwm", out.hwm > 0, "must be positive"),
    ]


def _zmq_local(endpoint: str) -> bool:
    if endpoint.startswith("ipc://"):
        return True
    return _loopback(endpoint.removeprefix("tcp://"))


def _route_checks(route: RouteConfig) -> list[tuple[str, bool, str]]:
    return [
        ("route.weight_engine_gpu", route.weight_engine_gpu > route.weight_dram,
         "must exceed route.weight_dram: a page in the engine's GPU is worth more than one to copy"),
        ("route.weight_engine_host", 0 < route.weight_engine_host <= route.weight_engine_gpu,
         "must be positive and at most route.weight_engine_gpu"),
        ("route.weight_dram", route.weight_dram > route.weight_nvme,
         "must exceed route.weight_nvme: DRAM is nearer than NVMe"),
        ("route.weight_nvme", route.weight_nvme > 0, "must be positive"),
        ("route.engines_max", 0 < route.engines_max <= 4096, "must be 1 to 4096"),
    ]


def _auth_checks(config: Config) -> list[tuple[str, bool, str]]:
    auth = config.auth
    # The planes that answer questions. The TCP data plane is not among them: a frame moves bytes
    # only with a lease's 128-bit data token, and only the control plane hands those out.
    remote = [f"{name}={address}" for name, address in
              (("server.grpc_address", config.server.grpc_address), ("ops.metrics_address", config.ops.metrics_address))
              if address and not _loopback(address)]
    return [
        ("auth.tls_key", bool(auth.tls_cert) == bool(auth.tls_key), "needs auth.tls_cert with it (both or neither)"),
        ("auth.tls_client_ca", not auth.tls_client_ca or bool(auth.tls_cert),
         "mutual TLS needs the server's own auth.tls_cert and auth.tls_key"),
        ("auth.local_uids", all(_uid_entry(e) for e in auth.local_uids),
         'each entry must be "uid:tenant" or "uid:tenant:admin"'),
        ("auth.local_uids", len({e.split(":")[0] for e in auth.local_uids}) == len(auth.local_uids),
         "names a uid twice: give each uid one tenant"),
        ("auth.local_uids", not auth.local_uids or auth.remote,
         "needs auth.tokens_file or auth.tls_client_ca with it: every client says Hello over gRPC before it "
         "opens the local socket, and with authentication on, a gRPC call proves its tenant by a token or a "
         "client certificate"),
        ("auth.local_require_token", not auth.local_require_token or (auth.tokens_file and auth.local_uids),
         "needs auth.tokens_file (the tokens it checks) and auth.local_uids (the uid mapping it adds to)"),
        ("auth.allow_unauthenticated_remote", auth.remote or auth.allow_unauthenticated_remote or not remote,
         f"{', '.join(remote)} is not a loopback address and no authentication is configured "
         "(auth.tokens_file or auth.tls_client_ca): configure one, or set auth.allow_unauthenticated_remote = true "
         "to serve it to anyone who reaches it"),
    ]


def _loopback(address: str) -> bool:
    return loopback_host(address.rpartition(":")[0])


def loopback_host(host: str) -> bool:
    """Only this host reaches `host` (127.0.0.0/8, ::1, localhost; [::1] as well)."""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False   # a name or a wildcard ("", 0.0.0.0, ::) may reach other hosts


def _uid_entry(entry: str) -> bool:
    parts = entry.split(":")
    return len(parts) in (2, 3) and parts[0].isdigit() and bool(parts[1]) and parts[2:] in ([], ["admin"])


def _cluster_checks(cluster: ClusterConfig) -> list[tuple[str, bool, str]]:
    return [
        ("cluster.name", bool(re.fullmatch(r"[A-Za-z0-9_.-]+", cluster.name)), "must be letters, digits, _ . or -"),
        ("cluster.node_id", re.fullmatch(r"[A-Za-z0-9_.-]*", cluster.node_id) is not None,
         "must be letters, digits, _ . or - (or empty for the host name)"),
        ("cluster.lease_ttl_s", 2 <= cluster.lease_ttl_s <= 3600, "must be 2 to 3600 (etcd's lease granularity)"),
        ("cluster.ramp_s", cluster.ramp_s >= 0, "must not be negative (0 = full weight at once)"),
        ("cluster.hot_reads", 0 <= cluster.hot_reads <= 1 << 20, "must be 0 (off) to 1048576"),
        ("cluster.hot_half_life_s", 0 < cluster.hot_half_life_s <= 86400, "must be above 0 and at most 86400"),
        ("cluster.hot_pages_max", 1 <= cluster.hot_pages_max <= 1 << 24, "must be 1 to 16777216"),
        ("cluster.etcd_timeout_s", cluster.etcd_timeout_s > 0, "must be positive"),
    ]


def _is_hex(text: str) -> bool:
    try:
        bytes.fromhex(text)
    except ValueError:
        return False
    return True


def as_dict(config: Config) -> dict[str, Any]:
    return dataclasses.asdict(config)


_SECTION_TYPES: dict[str, type] = {
    "server": ServerConfig, "dram": DramConfig, "nvme": NvmeConfig, "controller": ControllerConfig,
    "shm": ShmConfig, "leases": LeaseConfig, "limits": LimitsConfig,
    "tcp": TcpConfig, "rdma": RdmaConfig,
    "ops": OpsConfig, "systemd": SystemdConfig,
    "events": EventsConfig, "events_out": EventsOutConfig, "route": RouteConfig, "scrub": ScrubConfig,
    "hbm": HbmConfig,
    "auth": AuthConfig, "tenants": TenantsConfig, "cluster": ClusterConfig, "testing": TestingConfig,
}
_FIELD_TYPES: dict[str, dict[str, Any]] = {
    name: typing.get_type_hints(cls) for name, cls in _SECTION_TYPES.items()
}
