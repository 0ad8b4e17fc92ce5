"""Cluster membership as etcd holds it: one record per node, and a live view of them.

Each node keeps `/kvstore/<cluster>/nodes/<node_id>` under an etcd lease; the key
disappears when the node stops renewing it (it died, or lost etcd for a lease TTL). The
value is the JSON of a Member. MembershipView keeps the records in memory from one
listing and then a watch, so placement never asks anyone: when etcd is lost the view
keeps the members it last saw, and lists again once etcd answers. Given a RecordTrust, the
view keeps only records that prove who wrote them (record_trust.py); one that cannot is
ignored, and logged once per content.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import socket
import threading
import time
from typing import Any, Sequence

from kvstore_client.credentials import EtcdTlsFiles
from kvstore_client.etcd import EtcdSession, EtcdUnavailable

log = logging.getLogger(__name__)

STATES = ("joining", "serving", "draining")


@dataclasses.dataclass(frozen=True)
class Member:
    node_id: str
    host_id: str                  # equal host ids: the node's shared-memory arena is reachable
    state: str                    # joining | serving | draining
    grpc_address: str = ""
    tcp_endpoint: str = ""
    rdma: bool = False
    capacity_bytes: int = 0
    serving_since: float = 0.0    # unix time the node began serving; weight ramps from it
    ramp_s: float = 0.0
    events_endpoint: str = ""     # its page events (events_out), "" when it publishes none
    events_replay_endpoint: str = ""
    cert: str = ""                # PEM of the node's certificate, naming its id (record_trust.py)
    signature: str = ""           # base64: the record signed with that certificate's key

    def encode(self) -> bytes:
        return json.dumps(dataclasses.asdict(self), sort_keys=True).encode()

    @classmethod
    def decode(cls, value: bytes) -> "Member":
        fields = {f.name for f in dataclasses.fields(cls)}
        record = json.loads(value)
        return cls(**{k: v for k, v in record.items() if k in fields})


def nodes_prefix(cluster: str) -> bytes:
    return f"/kvstore/{cluster}/nodes/".encode()


def node_key(cluster: str, node_id: str) -> bytes:
    return nodes_prefix(cluster) + node_id.encode()


def local_host_id() -> str:
    """This machine's id: /etc/machine-id, else the host name."""
    try:
        with open("/etc/machine-id") as f:
            machine = f.read().strip()
        if machine:
            return machine
    except OSError:
        pass
    return socket.gethostname()


class MembershipView:
    """The cluster's members, listed once and then kept current by an etcd watch."""

    def __init__(self, endpoints: Sequence[str], cluster: str, timeout_s: float = 3.0, resync_s: float = 5.0,
                 tls: EtcdTlsFiles | None = None, trust: Any = None):
        self.cluster = cluster
        self._prefix = nodes_prefix(cluster)
        self._trust = trust
        self._ignored: set[bytes] = set()     # records already logged as ignored
        self._session = EtcdSession(endpoints, timeout_s, tls)
        self._resync_s = resync_s
        self._lock = threading.Lock()
        self._members: dict[str, Member] = {}
        self._listed = threading.Event()
        self._stopping = False
        self.etcd_lost_since = 0.0            # monotonic time etcd stopped answering; 0 while it answers
        self._task = self._session.submit(self._follow())

    def members(self) -> list[Member]:
        with self._lock:
            return list(self._members.values())

    def wait_listed(self, timeout_s: float) -> bool:
        return self._listed.wait(timeout_s)

    def close(self) -> None:
        self._stopping = True
        self._task.cancel()
        self._session.close()

    async def _follow(self) -> None:
        while not self._stopping:
            try:
                revision = await self._session.run(self._list)
                if self.etcd_lost_since:
                    log.info("etcd at %s answers again: membership listed", self._session.endpoint)
                    self.etcd_lost_since = 0.0
                try:   # listed again every resync_s: a watch on a dead etcd may never say so
                    await asyncio.wait_for(self._session.run_watch(self._watch, revision + 1), self._resync_s)
                except asyncio.TimeoutError:
                    pass
            except asyncio.CancelledError:
                raise
            except EtcdUnavailable as exc:
                if not self.etcd_lost_since:
                    self.etcd_lost_since = time.monotonic()
                    log.warning("membership: %s; placing pages by the %d members last seen", exc, len(self.members()))
                await asyncio.sleep(0.5)
            except Exception as exc:   # a broken watch stream; listing again tells whether etcd is there
                log.info("membership watch ended (%s: %s); listing again", type(exc).__name__, exc)
                await asyncio.sleep(0.2)

    async def _list(self, client: Any) -> int:
        result = await client.get_prefix(self._prefix)
        members = {}
        for kv in result:
            member = self._trusted(kv.value)
            if member is not None and member.node_id == kv.key[len(self._prefix):].decode(errors="replace"):
                members[member.node_id] = member
        with self._lock:
            self._members = members
        self._listed.set()
        return result.header.revision

    async def _watch(self, client: Any, start_revision: int) -> None:
        """Apply events until the resync deadline (run() then raises a timeout and the loop lists again)."""
        watch = await client.watch_prefix(self._prefix, start_revision=start_revision)
        try:
            async for event in watch:
                node_id = event.kv.key[len(self._prefix):].decode()
                with self._lock:
                    if event.kind == "DELETE":
                        self._members.pop(node_id, None)
                    else:   # a record that cannot prove itself leaves the one before it in place
                        member = self._trusted(event.kv.value)
                        if member is not None and member.node_id == node_id:
                            self._members[node_id] = member
        finally:
            await watch.cancel()


    def _trusted(self, value: bytes) -> Member | None:
        """The record, unless it is no member record or (with a RecordTrust) cannot prove who wrote it."""
        member = _decode(value)
        if member is None or self._trust is None:
            return member
        problem = self._trust.problem(member)
        if not problem:
            return member
        if value not in self._ignored:
            if len(self._ignored) >= 1024:    # bounded, whatever is written to etcd
                self._ignored.clear()
            self._ignored.add(value)
            log.warning("ignoring the member record of %r in cluster %s (address %s): %s", member.node_id,
                        self.cluster, member.grpc_address or "none", problem)
        return None


def _decode(value: bytes) -> Member | None:
    try:
        return Member.decode(value)
    except (ValueError, TypeError) as exc:
        log.warning("ignoring a membership record that is not a kvstore member: %s", exc)
        return None
