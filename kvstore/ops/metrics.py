"""Prometheus metrics of a node, served over HTTP on their own port (ops.metrics_address).

Two kinds, chosen to keep the request path cheap:
- State (pages, bytes, hits, misses, evictions, leases, per tier and namespace) is read from
  the service's Stats at scrape time, never counted again per page. Every numeric field of
  TierStats and StatsResponse is exported, so counters a tier adds there (promotions,
  demotions) appear without a change here; fields in GAUGE_FIELDS are gauges, the rest
  are monotonic totals.
- Per call: one histogram observation per RPC, labelled by method and carrier (grpc,
  local, or tcp: the TCP data plane's call connections). Data-plane bytes come from the service's counters of bytes it granted to be
  copied; the server never sees a shared-memory copy, and shm is the only transport yet.

At most SCRAPES_MAX connections are served at once, each a thread for at most SCRAPE_TIMEOUT_S
of silence: idle peers cannot pile up threads.

The endpoint shows every tenant's namespaces and the node's totals, so it is an operator's
view: with authentication configured (auth.*) a scrape must carry an admin token
(`Authorization: Bearer <token>`, Prometheus' `authorization` scrape setting) and is
answered 401 without a known token, 403 with a tenant's. Refused callers are counted per
plane and error (kvstore_auth_refusals_total).

The series live in the node's own memory, whatever its environment says (_own_values).
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from typing import Any, Iterator
from wsgiref.simple_server import make_server

from google.protobuf.descriptor import FieldDescriptor
from prometheus_client import (CollectorRegistry, Counter, Histogram, ProcessCollector, disable_created_metrics,
                               make_wsgi_app, values)
from prometheus_client.exposition import ThreadingWSGIServer, _SilentHandler
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvstore import __version__
from kvstore.control.identity import Authenticator, bearer_token
from kvstore.control.service import KVStoreService
from kvstore_client import errors
from kvstore_client.proto import pb

log = logging.getLogger(__name__)

GAUGE_FIELDS = frozenset({"capacity_bytes", "used_bytes", "pages", "leases_open", "block_tokens",
                          "dram_bytes", "dram_pages", "nvme_bytes", "nvme_pages", "dram_quota_bytes",
                          "nvme_quota_bytes"})
# A local-channel round trip is tens of microseconds; a batched gRPC call about a millisecond.
LATENCY_BUCKETS_S = (25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 50e-3,
                     100e-3, 250e-3, 1.0, 2.5)
# Scrapes are few and short: a peer cannot hold more threads than this, or one longer.
SCRAPES_MAX = 16
SCRAPE_TIMEOUT_S = 10.0
_NUMERIC = {FieldDescriptor.TYPE_UINT64, FieldDescriptor.TYPE_UINT32, FieldDescriptor.TYPE_INT64,
            FieldDescriptor.TYPE_INT32, FieldDescriptor.TYPE_FIXED64, FieldDescriptor.TYPE_DOUBLE,
            FieldDescriptor.TYPE_FLOAT}


class Metrics:
    def __init__(self, service: KVStoreService, auth: Authenticator | None = None):
        disable_created_metrics()  # *_created series double the output and no dashboard reads them
        _own_values()
        self.auth = auth
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(StatsCollector(service, auth))
        ProcessCollector(registry=self.registry)
        self.rpc_seconds = Histogram(
            "kvstore_rpc_duration_seconds", "Time in the service per call, from parsed request to response",
            ["method", "carrier"], buckets=LATENCY_BUCKETS_S, registry=self.registry)
        self.rpc_errors = Counter("kvstore_rpc_errors", "Calls answered with an error, by error class",
                                  ["method", "carrier", "error"], registry=self.registry)
        self._http: Any = None
        self.port = 0

    def instrument(self, service: KVStoreService, carrier: str) -> "MeteredService":
        return MeteredService(service, self, carrier)

    def serve(self, address: str) -> int:
        """Bind the /metrics endpoint; raises OSError naming ops.metrics_address when it cannot."""
        host, _, port = address.rpartition(":")
        app = make_wsgi_app(self.registry)
        if self.auth is not None and self.auth.enabled:
            app = _admin_only(app, self.auth)
        host = host.strip("[]")

        class Server(_BoundedServer):
            address_family = socket.AF_INET6 if ":" in host else socket.AF_INET

        try:
            self._http = make_server(host, int(port), app, Server, handler_class=_PatientHandler)
            threading.Thread(target=self._http.serve_forever, name="metrics-http", daemon=True).start()
        except (OSError, ValueError) as exc:
            why = getattr(exc, "strerror", None) or exc
            raise OSError(f"cannot bind metrics to {address} (ops.metrics_address): {why}") from None
        self.port = self._http.server_address[1]
        return self.port

    def close(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None


class _BoundedServer(ThreadingWSGIServer):
    """At most SCRAPES_MAX connections at once, a thread each; one more is closed unanswered."""

    def __init__(self, *args: Any, **kwargs: Any):
        self._slots = threading.BoundedSemaphore(SCRAPES_MAX)
        super().__init__(*args, **kwargs)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            log.warning("metrics connection refused peer=%s: %d scrapes already open", client_address, SCRAPES_MAX)
            self.shutdown_request(request)
            return
        super().process_request(request, client_address)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()


class _PatientHandler(_SilentHandler):
    timeout = SCRAPE_TIMEOUT_S   # a peer silent this long mid-request loses its thread


def _own_values() -> None:
    """Keep the per-call series in this process's memory. prometheus_client keeps them instead in files named by
    pid in $PROMETHEUS_MULTIPROC_DIR wherever that is set (LMCache sets it for itself, and so for any node an
    engine's process starts): a node would go on from the counts of an earlier process that had its pid, and
    leave its own files behind."""
    if values.ValueClass is not values.MutexValue:
        log.warning("PROMETHEUS_MULTIPROC_DIR is set in the node's environment; the node's metrics stay in its own "
                    "memory and are served at ops.metrics_address only")
        values.ValueClass = values.MutexValue


class MeteredService:
    """The service as one carrier calls it: each call timed, errors counted.

    Anything else the carrier asks of the service (end_owner, ...) goes straight through.
    """

    def __init__(self, service: KVStoreService, metrics: Metrics, carrier: str):
        self._service = service
        self._metrics = metrics
        self._carrier = carrier
        self._observe: dict[str, Any] = {}

    def handle(self, method: str, request: Any, owner: object | None = None) -> Any:
        started = time.perf_counter()
        try:
            response = self._service.handle(method, request, owner)
        except errors.KVStoreError as exc:
            self._metrics.rpc_errors.labels(method, self._carrier, type(exc).__name__).inc()
            raise
        finally:
            elapsed = time.perf_counter() - started
            observe = self._observe.get(method)
            if observe is None:
                observe = self._observe[method] = self._metrics.rpc_seconds.labels(method, self._carrier).observe
            observe(elapsed)
        return response

    def __getattr__(self, name: str) -> Any:
        return getattr(self._service, name)


def _admin_only(app: Any, auth: Authenticator) -> Any:
    """The WSGI app behind a check that the scrape carries an admin token."""
    def guarded(environ: dict, start_response: Any) -> Any:
        header = environ.get("HTTP_AUTHORIZATION", "")
        try:
            token = bearer_token([("authorization", header)]) if header else None
            if token is None:
                raise errors.Unauthenticated("no token")
            if not auth.token_identity(token).admin:
                raise errors.PermissionDenied("a tenant's token")
        except errors.Unauthenticated as exc:
            auth.refused("metrics", exc)
            start_response("401 Unauthorized", [("Content-Type", "text/plain"), ("WWW-Authenticate", "Bearer")])
            return [b"metrics need an admin token: send 'Authorization: Bearer <token>' of an admin in "
                    b"auth.tokens_file\n"]
        except errors.PermissionDenied as exc:   # a known token, of a tenant: who it is is known, not enough
            auth.refused("metrics", exc)
            start_response("403 Forbidden", [("Content-Type", "text/plain")])
            return [b"metrics show every tenant's namespaces: scrape with the token of an admin in "
                    b"auth.tokens_file, not a tenant's\n"]
        return app(environ, start_response)
    return guarded


class StatsCollector(Collector):
    """Tier, namespace and lease state, read from the service's Stats at scrape time."""

    def __init__(self, service: KVStoreService, auth: Authenticator | None = None):
        self._service = service
        self._auth = auth

    def describe(self) -> list[Metric]:
        return []  # the metric set follows the Stats message; nothing to check at registration

    def collect(self) -> Iterator[Metric]:
        stats = self._service.handle("Stats", pb.StatsRequest())
        yield _info("kvstore_build_info", "kvstore version of this node", version=__version__)
        yield GaugeMetricFamily("kvstore_draining", "1 while the node drains for shutdown",
                                value=int(self._service.draining))
        yield from _fields(stats, "kvstore_", {})
        counters = self._service.counters
        dataplane = CounterMetricFamily(
            "kvstore_dataplane_bytes", "Page bytes granted to clients to copy: write = slots reserved, "
            "read = pages acquired", labels=["transport", "direction"])
        dataplane.add_metric(["shm", "write"], counters.bytes_reserved)
        dataplane.add_metric(["shm", "read"], counters.bytes_acquired)
        yield dataplane
        families: dict[str, Metric] = {}
        for tier in stats.tiers:
            _add_fields(families, tier, "kvstore_tier_", {"tier": pb.Tier.Name(tier.tier).lower()})
        for tenant in stats.tenants:
            _add_fields(families, tenant, "kvstore_tenant_", {"tenant": tenant.tenant})
        for engine in stats.engines:
            _add_fields(families, engine, "kvstore_engine_", {"engine_id": engine.engine_id})
        for ns in stats.namespaces:
            labels = {"namespace_id": f"{ns.namespace_id:016x}", "model": ns.model, "tenant": ns.tenant}
            _add(families, "kvstore_namespace_pages", "pages", labels, ns.pages)
            _add(families, "kvstore_namespace_bytes", "bytes", labels, ns.pages * ns.page_bytes)
        yield from families.values()
        quarantined = GaugeMetricFamily("kvstore_nvme_shard_quarantined", "1 for each NVMe shard found damaged "
                                        "since start-up (its file moved aside, its pages lost)",
                                        labels=["shard", "path", "moved_to"])
        for shard in stats.nvme_quarantined:
            quarantined.add_metric([str(shard.shard), shard.path, shard.moved_to], 1)
        yield quarantined
        if self._auth is not None:
            refusals = CounterMetricFamily("kvstore_auth_refusals", "Callers refused for their identity, by plane "
                                           "and error", labels=["plane", "error"])
            for (plane, error), count in sorted(self._auth.refusal_counts().items()):
                refusals.add_metric([plane, error], count)
            yield refusals


def _numeric_fields(message: Any) -> Iterator[tuple[str, float]]:
    for field in message.DESCRIPTOR.fields:
        if field.type in _NUMERIC and not field.is_repeated:
            yield field.name, getattr(message, field.name)


def _fields(message: Any, prefix: str, labels: dict[str, str]) -> Iterator[Metric]:
    families: dict[str, Metric] = {}
    _add_fields(families, message, prefix, labels)
    return iter(families.values())


def _add_fields(families: dict[str, Metric], message: Any, prefix: str, labels: dict[str, str]) -> None:
    for name, value in _numeric_fields(message):
        _add(families, prefix + name, name, labels, value)


def _add(families: dict[str, Metric], metric: str, field: str, labels: dict[str, str], value: float) -> None:
    family = families.get(metric)
    if family is None:
        kind = GaugeMetricFamily if field in GAUGE_FIELDS or field == "bytes" else CounterMetricFamily
        text = f"{field.replace('_', ' ')} ({'now' if kind is GaugeMetricFamily else 'since start'})"
        family = families[metric] = kind(metric, text, labels=list(labels))
    family.add_metric(list(labels.values()), value)


def _info(name: str, text: str, **labels: str) -> Metric:
    family = GaugeMetricFamily(name, text, labels=list(labels))
    family.add_metric(list(labels.values()), 1)
    return family
