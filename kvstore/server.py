"""kvstore-server: the one module that wires the node together, and its `main`.

    kvstore-server --config kvstore.toml --set dram.arena_bytes=4GiB

Start-up either serves or exits non-zero with one line naming the problem. SIGHUP rereads
auth.tokens_file (a revoked token is refused from then on). SIGTERM
(or SIGINT) drains: health turns NOT_SERVING, new leases are refused, open ones may
finish until server.drain_timeout_s, then the node stops and exits 0. Under systemd
(Type=notify) the node sends READY=1 once it serves, WATCHDOG=1 while it is alive and
STOPPING=1 when the drain starts (kvstore/ops/).
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import signal
import ssl
import sys
import threading
import time
from typing import Any

from kvstore import __version__, config as config_module, failpoints
from kvstore.cluster.registration import ClusterError, Registration
from kvstore.config import Config, ConfigError
from kvstore.control.event_subscriber import EventSubscriber
from kvstore.control.store_events import StoreEvents
from kvstore.control import native_index, recovery
from kvstore.control.grpc_server import create_server
from kvstore.control.hbm_mover import HbmMover
from kvstore.control.identity import Authenticator
from kvstore.control.local_server import LocalServer
from kvstore.control.controller import CacheController
from kvstore.control.data_plane import SlotGrants
from kvstore.control.scrubber import Scrubber
from kvstore.control.service import KVStoreService
from kvstore.control.store import PageStore
from kvstore.invariants import stop_node
from kvstore.limits import Limits
from kvstore.ops import logs
from kvstore.ops.health import HealthState
from kvstore.ops.metrics import Metrics
from kvstore.ops.notify import Notifier
from kvstore.ops.supervise import serve_until_stopped
from kvstore.tiers.dram import Arena
from kvstore.tiers import host_memory, nvme_layout
from kvstore.tiers.hbm import open_pool
from kvstore.tiers.nvme import NvmeTier
from kvstore.transport import advertise
from kvstore.transport.tcp import TcpServer, TcpSettings
from kvstore_client import native
from kvstore_client.errors import TransportUnavailable
from kvstore_client.proto import pb

log = logging.getLogger("kvstore.server")


class Node:
    """Everything one kvstore-server process runs, started and stopped in order."""

    def __init__(self, config: Config):
        self.config = config
        host_memory.check_arena(config.dram.arena_bytes, config.dram.hugepages, pinned=config.rdma.enabled)
        try:
            # A memfd per tenant where tenants are told apart; one while RDMA pins the arena (tiers/dram.py).
            self.arena = Arena(config.dram.arena_bytes, config.dram.slab_bytes, config.dram.hugepages,
                               config.dram.prefault, tenants_apart=config.auth.enabled and not config.rdma.enabled)
        except OSError as exc:
            settings = "dram.arena_bytes, dram.hugepages" if config.dram.hugepages else "dram.arena_bytes"
            raise OSError(f"cannot allocate the DRAM arena of {config.dram.arena_bytes} bytes "
                          f"({settings}): {exc.strerror}") from None
        self.local: LocalServer | None = None
        self.tcp: TcpServer | None = None
        self.rdma = None
        self.nvme: NvmeTier | None = None
        self.hbm = None
        self.hbm_mover: HbmMover | None = None
        self.metrics: Metrics | None = None
        try:
            try:
                self.auth = Authenticator(config.auth)
            except ValueError as exc:
                raise OSError(f"auth.tokens_file: {exc}") from None
            except OSError as exc:
                raise OSError(f"cannot read auth.tokens_file {config.auth.tokens_file}: {exc.strerror}") from None
            if config.nvme.enabled:
                per_path = config.nvme.shards_per_path
                self.nvme = NvmeTier(nvme_layout.shard_directories(config.nvme_paths, per_path),
                                     config.nvme.map_bytes // per_path, config.nvme.io_threads)
            socket_path = config.shm_socket_path if config.shm.enabled else ""
            self.store = PageStore(config, self.arena)
            self.events_out = _events_out(config, self.store)
            if self.nvme:
                recovered = recovery.rebuild(self.nvme)
                self.store.adopt_recovered(recovered.namespaces, recovered.records)
            waiters_max = max(1, config.server.grpc_workers // 2)   # the other half always answers
            self.controller = CacheController(self.store, self.nvme, config.controller, waiters_max) if self.nvme else None
            self.scrubber = Scrubber(self.store, self.nvme, config.scrub.bytes_per_s)
            self.service = KVStoreService(self.store, self.controller, self.scrubber, shm_socket=socket_path)
            grpc_service = local_service = tcp_service = self.service
            if config.ops.metrics_address:
                self.metrics = Metrics(self.service, self.auth)
                grpc_service = self.metrics.instrument(self.service, "grpc")
                local_service = self.metrics.instrument(self.service, "local")
                tcp_service = self.metrics.instrument(self.service, "tcp")
            if socket_path:
                self.local = _listen_local(socket_path, local_service, self.arena, config, self.auth)
            self.grpc, self.grpc_port = create_server(grpc_service, config.server.grpc_address,
                                                      config.server.grpc_workers, self.auth)
            if config.tcp.enabled:
                self.tcp = _tcp_server(config, SlotGrants(self.store, self.auth, service=tcp_service))
                self.tcp.start()
                host = advertise.advertised_host(self.tcp.settings.host, config.tcp.advertise_host,
                                                 "tcp.advertise_host")
                if not config.tcp.advertise_host:   # an explicit one is taken as said (a published port, say)
                    advertise.check_reachable(config.grpc_host, host, "tcp.address")
                self.service.tcp_endpoint = advertise.endpoint(host, self.tcp.port)
                self.service.tcp_tls = self.tcp.settings.tls is not None
                self.service.tcp_calls = True
            if config.rdma.enabled:
                from kvstore.transport.rdma import RdmaServer  # pyverbs is optional: imported only when asked for
                try:
                    rdma = config.rdma
                    self.rdma = RdmaServer(rdma.device, rdma.port, rdma.gid_index, rdma.queue_pairs_max, self.arena.view,
                                           allowed_peers=rdma.allowed_peers, idle_evict_s=rdma.idle_evict_s,
                                           hop_limit=rdma.hop_limit, traffic_class=rdma.traffic_class,
                                           service_level=rdma.service_level)
                except TransportUnavailable as exc:
                    raise OSError(f"rdma.enabled is set but {exc}") from None
                self.service.rdma = self.rdma
            if config.hbm.pool_bytes:
                self.hbm = open_pool(config.hbm.device, config.hbm.pool_bytes, config.testing.hbm_on_host)
                self.service.hbm = pb.HbmRegion(ipc_handle=self.hbm.ipc_handle, nbytes=self.hbm.nbytes,
                                                device_uuid=self.hbm.device_uuid)
                self.service.hbm_mover = self.hbm_mover = HbmMover(
                    self.store, self.hbm, config.hbm.promote_hits, self.service.limits.page_bytes_max)
            self.health = HealthState(self.grpc, config.ops.reflection)
            if self.metrics is not None:
                if self.events_out is not None:
                    self.metrics.registry.register(self.events_out.collector())
                self.metrics.serve(config.ops.metrics_address)
            self.subscribers = _subscribers(config, self.service)
        except BaseException:
            if self.metrics is not None:
                self.metrics.close()
            if self.local is not None:
                self.local.close()
            if self.tcp is not None:
                self.tcp.close()
            if self.nvme is not None:
                self.nvme.close()
            if self.hbm is not None:
                self.hbm.close()
            self.arena.close()
            raise
        self._stop = threading.Event()
        self._reaper = threading.Thread(target=self._reap_loop, name="lease-reaper", daemon=True)

    @property
    def grpc_address(self) -> str:
        host = self.config.server.grpc_address.rsplit(":", 1)[0]
        return f"{host}:{self.grpc_port}"

    @property
    def metrics_port(self) -> int:
        return self.metrics.port if self.metrics is not None else 0

    def start(self) -> None:
        self.grpc.start()
        if self.local is not None:
            self.local.start()
        if self.controller:
            self.controller.start()
        if self.hbm_mover is not None:
            self.hbm_mover.start()
        self.scrubber.start()
        self._reaper.start()
        for subscriber in self.subscribers:
            subscriber.start()
        if self.events_out is not None:
            self.events_out.start()
        self.health.serving()

    def problem(self) -> str:
        """"" while the node works; what is wrong otherwise. Blocks if the service lock is stuck."""
        if not self._reaper.is_alive():
            return "the lease reaper thread died"
        if self.controller and not self.controller.alive():
            return "the cache controller thread died"
        if self.hbm_mover is not None and not self.hbm_mover.alive():
            return "the HBM mover thread died"
        if not self.scrubber.alive():
            return "the scrubber thread died"
        self.store.open_leases()  # takes the store's lock: a stuck lock stops the watchdog
        return ""

    def status(self) -> str:
        stats = self.service.handle("Stats", pb.StatsRequest())
        pages = sum(t.pages for t in stats.tiers)
        used = sum(t.used_bytes for t in stats.tiers)
        degraded = "".join(f" nvme_shard_quarantined={q.path}" for q in stats.nvme_quarantined)
        return f"serving pages={pages} used_bytes={used} leases_open={stats.leases_open}{degraded}"

    def drain_and_stop(self) -> None:
        started = time.monotonic()
        deadline = started + self.config.server.drain_timeout_s
        self.health.draining()
        self.service.start_draining()
        open_leases = self.service.open_leases()
        log.info("draining started open_leases=%d timeout_s=%.1f", open_leases, self.config.server.drain_timeout_s)
        while open_leases and time.monotonic() < deadline:
            time.sleep(0.05)
            open_leases = self.service.open_leases()
        self._stop.set()
        for subscriber in self.subscribers:
            subscriber.stop()
        if self.events_out is not None:
            self.events_out.stop()
        self.grpc.stop(grace=1.0).wait()
        if self.local is not None:
            self.local.close()
        if self.tcp is not None:
            self.tcp.close()
        if self.rdma is not None:
            self.rdma.close()
        self.scrubber.stop()
        if self.controller:
            self.controller.stop()
        if self.nvme is not None:
            self.nvme.close()
        if self.hbm_mover is not None:
            self.hbm_mover.stop()
        if self.hbm is not None:
            self.hbm.close()
        if self.metrics is not None:
            self.metrics.close()
        log.info("draining complete open_leases_left=%d duration_s=%.3f", open_leases, time.monotonic() - started)

    def _reap_loop(self) -> None:
        interval = self.config.leases.reap_interval_ms / 1000
        while not self._stop.wait(interval):
            try:
                self.service.reap_expired()
                if self.arena.tenants_apart:
                    if self.local is not None:   # memory a client may map no longer
                        self.local.cut_off_revoked()
                    self.store.trim_arena()      # memory a client allocated in its memfd's holes
            except AssertionError as exc:
                stop_node("lease reaper", exc)
            except Exception:  # the reaper must outlive a bug in one pass
                log.exception("lease reaping failed")


def _tcp_server(config: Config, resolver: SlotGrants) -> TcpServer:
    host, _, port = config.tcp_address.rpartition(":")
    host = host.strip("[]")   # [::] binds as ::
    limits = Limits.from_config(config)
    return TcpServer(TcpSettings(
        host=host, port=int(port), body_bytes_max=limits.page_bytes_max, connections_max=config.tcp.connections_max,
        idle_timeout_s=config.tcp.idle_timeout_s, write_buffer_high_bytes=config.tcp.write_buffer_high_bytes,
        write_buffer_low_bytes=config.tcp.write_buffer_low_bytes, congestion=config.tcp.congestion,
        hello_required=config.auth.enabled, tls=_tcp_tls(config), call_workers=config.server.grpc_workers), resolver)


def _tcp_tls(config: Config) -> ssl.SSLContext | None:
    """The data plane's TLS context, or None for plaintext; unreadable files stop start-up naming the setting."""
    if not config.tcp.tls_cert:
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        context.load_cert_chain(config.tcp.tls_cert, config.tcp.tls_key)
    except (OSError, ssl.SSLError) as exc:
        raise OSError(f"cannot load tcp.tls_cert {config.tcp.tls_cert} / tcp.tls_key {config.tcp.tls_key}: {exc}") from None
    return context


def _listen_local(path: str, service: KVStoreService, arena: Arena, config: Config, auth: Authenticator) -> LocalServer:
    try:
        return LocalServer(path, service, arena, config.allowed_uids, config.shm.connections_max, auth,
                           spin_s=config.shm.spin_us / 1e6)
    except OSError as exc:
        if exc.errno is None:  # already says what is wrong (another server, not a socket)
            raise
        raise OSError(f"cannot listen on {path} (shm.socket_path): {exc.strerror}") from None
def _events_out(config: Config, store: PageStore):
    """The publisher of the store's page events (events_out), its sockets bound; None when off."""
    out = config.events_out
    if not out.enabled:
        return None
    from kvstore.control.events_out import EventPublisher   # needs the [events] extra (pyzmq, msgspec)

    store.events = StoreEvents(out.batch_events_max, out.queue_pages_max,
                               page_tokens_of=lambda ns_id: store.namespaces[ns_id].page_tokens)
    for tenant in ["", *config.tenants.quota_table()]:   # streams of tenants known at start begin at once
        store.events.open_stream(tenant)
    try:
        return EventPublisher(out, store.events)
    except Exception as exc:   # zmq.ZMQError: address in use, a bad endpoint
        raise OSError(f"events_out: cannot bind {out.endpoint} / {out.replay_endpoint or '-'}: {exc}") from None


def _advertised_events(publisher: Any, host: str) -> tuple[str, str]:
    """The page event endpoints a cluster's members record names: as bound, a wildcard host replaced by the
    node's advertised one (ipc:// ones stay: only clients on this host can follow them)."""
    if publisher is None:
        return "", ""

    def named(endpoint: str) -> str:
        for wildcard in ("tcp://0.0.0.0:", "tcp://[::]:", "tcp://*:"):
            if endpoint.startswith(wildcard):
                return "tcp://" + advertise.endpoint(host.strip("[]"), int(endpoint[len(wildcard):]))
        return endpoint
    return named(publisher.endpoint), named(publisher.replay_endpoint) if publisher.replay_endpoint else ""


def _subscribers(config: Config, service: KVStoreService) -> list[EventSubscriber]:
    events = config.events
    replays = events.replay_endpoints or ("",) * len(events.endpoints)
    try:
        return [EventSubscriber(engine_id, endpoint, replay, events.topic, service.engines, events.replay_timeout_ms)
                for engine_id, endpoint, replay in zip(events.engine_ids, events.endpoints, replays)]
    except ImportError as exc:
        raise OSError(f"[events] needs pyzmq and msgspec ({exc}): pip install 'kvstore[events]'") from None


def _log_native_core(config: Config) -> None:
    """Say once, at start-up, whether the page index, prefix hashing and page copies run in C."""
    index = "c" if config.server.native_index and native_index.available() else "python"
    hashing = "c" if native.available() else "python"
    why = native.missing_reason or (native_index.missing_reason if config.server.native_index else "")
    if not why:
        log.info("native core index=%s hashing=%s copies=%s", index, hashing, hashing)
        return
    log.warning("native core index=%s hashing=%s copies=%s: %s, so this node runs its pure-Python paths: the same "
                "results, several times the CPU per page and, for the index, several times the memory per page "
                "(native/README.md); build it with `pip install ./native` (a C compiler and Python's headers)",
                index, hashing, hashing, why)


def _warn_of_exposure(config: Config) -> None:
    """Say at start-up where a setting protects less than it may seem to: tokens sent in the clear to
    another host, and a uid list that guards only the local socket."""
    auth = config.auth
    plain = [f"{name}={address}" for name, address, tls in
             (("server.grpc_address", config.server.grpc_address, bool(auth.tls_cert)),
              ("ops.metrics_address", config.ops.metrics_address, False))
             if address and not tls and not config_module.loopback_host(address.rpartition(":")[0])]
    if auth.tokens_file and plain:
        log.warning("bearer tokens reach %s in plaintext: whoever sees the traffic can act as their tenants; "
                    "set auth.tls_cert and auth.tls_key (gRPC), and scrape metrics over loopback or a trusted "
                    "network", ", ".join(plain))
    if not auth.enabled and config.shm.allowed_uids:
        log.warning("shm.allowed_uids guards the local socket only: without authentication every local user "
                    "reaches gRPC (%s) and the TCP data plane and may read, write and delete every page; "
                    "configure auth.tokens_file and auth.local_uids to tell users apart",
                    config.server.grpc_address)


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="kvstore-server", description="kvstore node: a tiered KV-cache store.")
    parser.add_argument("--config", help="TOML configuration file")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                        help="override one setting (repeatable); wins over the file and KVSTORE_* variables")
    parser.add_argument("--grpc-address", help="shortcut for --set server.grpc_address=...")
    parser.add_argument("--arena-bytes", help="shortcut for --set dram.arena_bytes=...")
    parser.add_argument("--shm-socket", help="shortcut for --set shm.socket_path=...")
    parser.add_argument("--ready-file", help="shortcut for --set server.ready_file=...")
    parser.add_argument("--version", action="version", version=f"kvstore-server {__version__}")
    return parser.parse_args(argv)


def _write_ready_file(path: str, node: Node) -> None:
    info = {"pid": os.getpid(), "grpc_address": node.grpc_address, "grpc_port": node.grpc_port,
            "shm_socket": node.local.path if node.local else "", "tcp_endpoint": node.service.tcp_endpoint,
            "metrics_port": node.metrics_port}
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(info, f)
    os.replace(tmp, path)  # readers never see a half-written file


def _join_cluster(config: Config) -> Registration:
    """Claim this node's id in etcd; ClusterError unless it may serve alone (cluster.required = false)."""
    registration = Registration(config.cluster, config.dram.arena_bytes, config.auth)
    try:
        registration.claim()
    except ClusterError as exc:
        if config.cluster.required or "already registered" in str(exc):
            registration.leave()
            raise
        registration.start_alone(str(exc))
    return registration


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    shortcuts = {"server.grpc_address": args.grpc_address, "dram.arena_bytes": args.arena_bytes,
                 "shm.socket_path": args.shm_socket, "server.ready_file": args.ready_file}
    overrides = [f"{k}={v}" for k, v in shortcuts.items() if v is not None] + args.set
    try:
        config = config_module.load(args.config, overrides=overrides)
    except ConfigError as exc:
        sys.stderr.write(f"kvstore-server: configuration error: {exc}\n")
        return 2
    try:
        failpoints.arm(config.testing.failpoints, config.testing.failpoints_seed)
    except ValueError as exc:
        sys.stderr.write(f"kvstore-server: configuration error: testing.failpoints: {exc}\n")
        return 2
    logs.configure(config.ops.log_format, config.server.log_level)
    log.info("effective configuration", extra={"fields": {"config": config_module.as_dict(config)}})
    _log_native_core(config)
    _warn_of_exposure(config)
    started = time.monotonic()
    notifier = Notifier(config.systemd)
    registration = None
    if config.cluster.endpoints:
        try:
            grpc_host = advertise.advertised_host(config.grpc_host, config.cluster.advertise_host,
                                                  "cluster.advertise_host")
            registration = _join_cluster(config)
        except (ClusterError, OSError) as exc:
            log.error("cannot start: %s", exc)
            return 1
    try:
        node = Node(config)
    except (OSError, RuntimeError) as exc:
        log.error("cannot start: %s", exc)
        if registration is not None:
            registration.leave()
        return 1
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    signal.signal(signal.SIGHUP, lambda *_: threading.Thread(target=node.auth.reload, name="auth-reload").start())
    node.start()
    # What start-up built (modules, the service, recovered records) lives as long as the node: out of
    # the collector's sight, a full collection no longer rescans it (tens of thousands of objects,
    # 12-15 ms with serving stalled, several times a second under small puts).
    gc.freeze()
    if config.server.ready_file:
        _write_ready_file(config.server.ready_file, node)
    log.info("serving version=%s grpc=%s shm_socket=%s metrics_port=%d arena_bytes=%d startup_s=%.3f",
             __version__, node.grpc_address, node.local.path if node.local else "-", node.metrics_port,
             config.dram.arena_bytes, time.monotonic() - started)
    status = node.status
    if registration is not None:
        registration.serve(advertise.endpoint(grpc_host.strip("[]"), node.grpc_port), node.service.tcp_endpoint,
                           node.rdma is not None, _advertised_events(node.events_out, grpc_host))
        if node.metrics is not None:
            node.metrics.registry.register(registration.collector())
        status = lambda: f"{node.status()} {registration.describe()}"  # noqa: E731
    notifier.ready(status())
    serve_until_stopped(stop, notifier, node.problem, status)
    notifier.stopping(f"draining open_leases={node.service.open_leases()}")
    if registration is not None:
        registration.drain()
    node.drain_and_stop()
    if registration is not None:
        registration.leave()
    notifier.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
