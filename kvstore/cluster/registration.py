"""This node's record in etcd: claimed under a lease at start-up, kept alive, marked draining.

    registration = Registration(config.cluster, capacity_bytes, config.auth)
    registration.claim()                 # ClusterError: etcd unreachable, or the id is taken
    ...node starts...
    registration.serve(grpc_address, tcp_endpoint)
    ...SIGTERM...
    registration.drain(); ...drain...; registration.leave()

The claim is one etcd transaction, "create the key if it does not exist", so two nodes
started with the same node_id cannot both hold it: the second is refused. A thread renews
the lease every third of its TTL, and each time reads the record back: one that was deleted
or changed by anyone else is put back, so it is right again within a third of the TTL.

A node that serves gRPC over TLS signs its record (kvstore_client/record_trust.py) with its
certificate, which must name its node id: clients that trust the cluster's CA use no record
that cannot prove itself. A certificate that does not name the id refuses the start.

When etcd stops answering the node keeps serving (its clients place pages by the membership
they last saw), logs it once and reports it in `describe()` (the systemd status and the
health log line); when etcd answers again and the lease expired meanwhile, the node claims
its id again with a new lease.
"""

from __future__ import annotations

import dataclasses
import logging
import socket
import threading
import time
from typing import Any

from kvstore.config import AuthConfig, ClusterConfig
from kvstore_client import record_trust
from kvstore_client.credentials import EtcdTlsFiles
from kvstore_client.etcd import EtcdSession, EtcdUnavailable
from kvstore_client.membership import Member, local_host_id, node_key

log = logging.getLogger(__name__)


class ClusterError(Exception):
    """The node cannot join its cluster; the message says why and which setting to look at."""


class Registration:
    def __init__(self, config: ClusterConfig, capacity_bytes: int, auth: AuthConfig = AuthConfig()):
        self.config = config
        self.node_id = config.node_id or socket.gethostname()
        self._key = node_key(config.name, self.node_id)
        self._member = Member(node_id=self.node_id, host_id=config.host_id or local_host_id(), state="joining",
                              capacity_bytes=capacity_bytes, ramp_s=config.ramp_s)
        self._identity = _identity(auth, self.node_id)
        etcd_tls = (EtcdTlsFiles(config.etcd_tls_ca, config.etcd_tls_cert, config.etcd_tls_key)
                    if config.etcd_tls_ca or config.etcd_tls_cert else None)
        try:
            self._session = EtcdSession(config.endpoints, config.etcd_timeout_s, etcd_tls)
        except ImportError as exc:   # no use retrying: refuse the start, naming the setting and the install
            raise OSError(f"cluster.endpoints is set but {exc} (for a node: pip install 'kvstore[cluster]')") from None
        self._lock = threading.Lock()
        self._lease_id = 0                    # 0: not holding the id (etcd lost at start, or the lease expired)
        self.etcd_lost_since = 0.0            # monotonic; 0 while etcd answers
        self._written: bytes | None = None    # the record last put (what _restore compares etcd's with)
        self._stop = threading.Event()
        self._keeper = threading.Thread(target=self._keep_alive, name="cluster-lease", daemon=True)

    # -- the life of the record ---------------------------------------------------------

    def claim(self) -> None:
        """Take this node's id in etcd; ClusterError if etcd does not answer or another node holds the id."""
        try:
            self._session.call(self._claim)
        except EtcdUnavailable as exc:
            raise ClusterError(f"cannot join cluster {self.config.name!r}: {exc} (cluster.endpoints)") from None
        log.info("cluster %s: claimed node id %s at etcd %s (lease ttl %ds)", self.config.name, self.node_id,
                 self._session.endpoint, self.config.lease_ttl_s)

    def start_alone(self, problem: str) -> None:
        """etcd was unreachable and cluster.required is false: serve alone, keep trying to join."""
        self.etcd_lost_since = time.monotonic()
        log.warning("%s; serving alone (cluster.required = false) and trying to join every %.1fs",
                    problem, self._renew_interval_s)

    def serve(self, grpc_address: str, tcp_endpoint: str, rdma: bool, events: tuple[str, str] = ("", "")) -> None:
        """Serving from now on, at these endpoints; `events`: the page event stream's and its replay's."""
        self._update(grpc_address=grpc_address, tcp_endpoint=tcp_endpoint, rdma=rdma, state="serving",
                     serving_since=time.time(), events_endpoint=events[0], events_replay_endpoint=events[1])
        self._keeper.start()

    def drain(self) -> None:
        self._update(state="draining")

    def leave(self) -> None:
        """Delete the record (revoke the lease) and stop; bounded by etcd_timeout_s."""
        self._stop.set()
        if self._keeper.is_alive():
            self._keeper.join(self.config.etcd_timeout_s * 2)
        lease_id, self._lease_id = self._lease_id, 0
        if lease_id:
            try:
                self._session.call(lambda client: client.revoke_lease(lease_id))
                log.info("cluster %s: left (node id %s released)", self.config.name, self.node_id)
            except Exception as exc:   # the lease then expires on its own within its TTL
                log.warning("cluster %s: could not release node id %s (%s); it expires in %ds",
                            self.config.name, self.node_id, exc, self.config.lease_ttl_s)
        self._session.close()

    def collector(self) -> "ClusterCollector":
        """Prometheus gauges of this node's membership, for the node's /metrics."""
        return ClusterCollector(self)

    @property
    def registered(self) -> bool:
        return bool(self._lease_id)

    def describe(self) -> str:
        if self.etcd_lost_since:
            return (f"cluster={self.config.name} node={self.node_id} etcd=lost "
                    f"for_s={time.monotonic() - self.etcd_lost_since:.0f} (serving the membership last seen)")
        return f"cluster={self.config.name} node={self.node_id} state={self._member.state} etcd=ok"

    # -- etcd -----------------------------------------------------------------------------

    @property
    def _renew_interval_s(self) -> float:
        return self.config.lease_ttl_s / 3

    async def _claim(self, client: Any) -> None:
        lease = await client.lease(self.config.lease_ttl_s)
        tx = client.transactions
        created, responses = await client.transaction(
            compare=[tx.create(self._key) == 0],
            success=[tx.put(self._key, self._record(self._member), lease.id)],
            failure=[tx.get(self._key)])
        if not created:
            await client.revoke_lease(lease.id)
            holder = _holder(responses)
            raise ClusterError(f"node id {self.node_id!r} is already registered in cluster {self.config.name!r}"
                               f"{holder}: give each node its own cluster.node_id")
        self._lease_id = lease.id

    def _record(self, member: Member) -> bytes:
        """The record's bytes in etcd: signed when this node has a certificate of its own."""
        if self._identity is None:
            return member.encode()
        return record_trust.sign(member, *self._identity).encode()

    def _update(self, **changes: Any) -> None:
        with self._lock:
            self._member = dataclasses.replace(self._member, **changes)
            record = self._written = self._record(self._member)
        if not self._lease_id:
            return
        try:
            self._session.call(lambda client: client.put(self._key, record, lease=self._lease_id))
        except EtcdUnavailable as exc:
            self._lost(exc)

    async def _restore(self, client: Any) -> None:
        """Put the record back if anyone deleted or changed it (it is this node's own, under its lease)."""
        found = await client.get(self._key)
        value = found.value if found is not None else None
        with self._lock:
            written = self._written
        if written is not None and value != written:
            await client.put(self._key, written, lease=self._lease_id)
            log.warning("cluster %s: node id %s's record was %s in etcd by someone else; put back", self.config.name,
                        self.node_id, "deleted" if value is None else "changed")

    def _keep_alive(self) -> None:
        while not self._stop.wait(self._renew_interval_s):
            try:
                if self._lease_id:
                    reply = self._session.call(lambda client: client.refresh_lease(self._lease_id))
                    if reply is None or reply.TTL <= 0:
                        log.warning("cluster %s: the lease of node id %s expired while etcd was out of reach; "
                                    "claiming it again", self.config.name, self.node_id)
                        self._lease_id = 0
                if not self._lease_id:
                    self._session.call(self._claim)
                    with self._lock:
                        record = self._written = self._record(self._member)
                    self._session.call(lambda client: client.put(self._key, record, lease=self._lease_id))
                else:
                    self._session.call(self._restore)
                if self.etcd_lost_since:
                    log.info("cluster %s: etcd at %s answers again after %.1fs; node id %s registered",
                             self.config.name, self._session.endpoint, time.monotonic() - self.etcd_lost_since,
                             self.node_id)
                    self.etcd_lost_since = 0.0
            except EtcdUnavailable as exc:
                self._lost(exc)
            except ClusterError as exc:   # another node took the id while this one was cut off
                if not self.etcd_lost_since:
                    self.etcd_lost_since = time.monotonic()
                log.error("cluster %s: %s; serving alone until it is free", self.config.name, exc)
            except Exception:   # the keeper must outlive a library bug; the next pass tries again
                log.exception("cluster %s: renewing the lease failed", self.config.name)

    def _lost(self, exc: Exception) -> None:
        if not self.etcd_lost_since:
            self.etcd_lost_since = time.monotonic()
            log.warning("cluster %s: %s; serving on with the membership last seen (the node leaves it "
                        "for clients after %ds)", self.config.name, exc, self.config.lease_ttl_s)


def _identity(auth: AuthConfig, node_id: str) -> tuple[bytes, bytes] | None:
    """(certificate, key) PEM that sign this node's record: its gRPC TLS files; None without them.
    ClusterError when the certificate does not name the node id (no client that checks would use it)."""
    if not (auth.tls_cert and auth.tls_key):
        return None
    with open(auth.tls_cert, "rb") as c, open(auth.tls_key, "rb") as k:
        cert, key = c.read(), k.read()
    named = record_trust.names(cert)
    if node_id not in named:
        raise ClusterError(f"auth.tls_cert names {', '.join(named) or 'no DNS name'}, not node id {node_id!r}: in a "
                           "cluster a node's certificate must carry its cluster.node_id as a DNS name (clients check "
                           "it before they send a token or a page)")
    return cert, key


def _holder(responses: list[Any]) -> str:
    try:
        value = responses[0][0][0]
        member = Member.decode(value)
        return f" by the node at {member.grpc_address or 'an address not yet published'}"
    except (IndexError, TypeError, ValueError):
        return ""


class ClusterCollector:
    """kvstore_cluster_*: whether etcd answers and whether this node holds its id, read at scrape time."""

    def __init__(self, registration: Registration):
        self._registration = registration

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Any:
        from prometheus_client.core import GaugeMetricFamily

        r = self._registration
        info = GaugeMetricFamily("kvstore_cluster_info", "This node's cluster and node id",
                                 labels=["cluster", "node_id", "state"])
        info.add_metric([r.config.name, r.node_id, r._member.state], 1)
        yield info
        yield GaugeMetricFamily("kvstore_cluster_etcd_reachable", "1 while etcd answers this node's lease renewals",
                                value=int(not r.etcd_lost_since))
        yield GaugeMetricFamily("kvstore_cluster_registered", "1 while this node holds its id under a live lease",
                                value=int(r.registered))
