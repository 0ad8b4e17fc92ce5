"""The server side of the RDMA data plane: the arena registered once, one small responder QP per client.

EXPERIMENTAL, NEVER RUN ON A NIC (see kvstore_client/rdma_transport.py for what is tested
and how: this file runs in the tests against the verbs model, kvstore_client/verbs_model.py).

The node registers the arena once (remote read and write; the process needs RLIMIT_MEMLOCK
of at least dram.arena_bytes) and, for each RdmaConnect, connects an RC queue pair of its
own to the client's. A responder QP never posts: its send queue is one WR deep, one SGE.

Trust: one-sided operations bypass the server's CPU, so no per-lease token can be checked;
a connected queue pair reaches the whole arena. So:
  - only peers in `allowed_peers` (IP addresses or networks, matched against the IPv4 or
    IPv6 address in the client's RoCE v2 GID) may connect; () refuses every peer;
  - fence(qp_num) moves a client's QP to ERROR: every later READ/WRITE of that client fails
    on its NIC (retry exceeded) and lands nowhere. The node fences a client whose write
    lease expired or was aborted while it may still write (a late write into a slot that
    was reused), and disconnect(qp_num) releases it when its session ends.
  - at most queue_pairs_max QPs: a new client evicts the one idle longest (no touch() for
    idle_evict_s); when every QP is in use it is refused (TransportUnavailable: the client
    falls back to TCP), so a client looping on RdmaConnect cannot evict everyone.
"""

from __future__ import annotations

import ctypes
import dataclasses
import ipaddress
import logging
import secrets
import threading
import time
from typing import Any, Callable

from kvstore.transport.slots import QueuePairAddress
from kvstore_client import errors, rdma_transport, verbs as v

log = logging.getLogger(__name__)

RESPONDER_CQ_ENTRIES = 1   # a responder posts nothing; its CQ only ever sees flushes


@dataclasses.dataclass(eq=False)
class _Peer:
    qp: Any
    address: str
    owner: object | None
    last_used: float


def peer_address(gid: bytes) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """The IP address a RoCE v2 GID carries (IPv4-mapped GIDs give the IPv4 address)."""
    address = ipaddress.IPv6Address(bytes(gid))
    return address.ipv4_mapped or address


def peer_allowed(gid: bytes, allowed: tuple[str, ...]) -> bool:
    if len(gid) != 16:
        return False
    address = peer_address(gid)
    return any(address in ipaddress.ip_network(entry, strict=False) for entry in allowed)


class RdmaServer:
    def __init__(self, device: str, port: int, gid_index: int, queue_pairs_max: int, arena: memoryview, *,
                 allowed_peers: tuple[str, ...] = (), idle_evict_s: float = 300.0, hop_limit: int = 64,
                 traffic_class: int = 0, service_level: int = 0, verbs: v.Verbs | None = None,
                 clock: Callable[[], float] = time.monotonic):
        verbs = verbs or rdma_transport.default_verbs()
        self.port, self.queue_pairs_max = port, queue_pairs_max
        self.allowed_peers, self.idle_evict_s = tuple(allowed_peers), idle_evict_s
        for entry in self.allowed_peers:
            ipaddress.ip_network(entry, strict=False)  # a bad entry stops start-up here, by name
        self._clock = clock
        try:
            self._device = rdma_transport.open_device(verbs, device, port)
        except ImportError as exc:
            raise errors.TransportUnavailable(str(exc)) from None
        except v.VerbsError as exc:
            raise errors.TransportUnavailable(f"no usable RDMA device: {exc}") from None
        try:
            info = self._device.port(port)
            self.gid = rdma_transport.choose_gid(info, gid_index)
            self.lid, self.mtu = info.lid, info.mtu
            self.route = v.Route(port, self.gid.index, hop_limit, traffic_class, service_level)
            self.rd_atomic = max(1, min(16, self._device.limits.max_qp_rd_atom, self._device.limits.max_qp_init_rd_atom))
            self.arena_addr = ctypes.addressof(ctypes.c_char.from_buffer(arena))
            self.arena_bytes = len(arena)
            self._mr = self._device.register(self.arena_addr, len(arena), remote=True)
        except v.VerbsError as exc:
            self._device.close()
            raise errors.TransportUnavailable(f"the arena ({len(arena)} bytes) could not be registered: {exc} "
                                              "(RLIMIT_MEMLOCK must be at least dram.arena_bytes)") from None
        except BaseException:
            self._device.close()
            raise
        self._peers: dict[int, _Peer] = {}
        self._lock = threading.Lock()
        log.info("rdma arena registered device=%s gid_index=%d bytes=%d allowed_peers=%s",
                 self._device.name, self.gid.index, len(arena), ",".join(self.allowed_peers) or "(none)")

    @property
    def rkey(self) -> int:
        return self._mr.rkey

    def accept(self, remote: QueuePairAddress, owner: object | None = None) -> tuple[QueuePairAddress, int, int]:
        """Connect a responder QP to `remote`; returns (its address, arena_addr, rkey). Raises TransportUnavailable."""
        if not peer_allowed(remote.gid, self.allowed_peers):
            raise errors.PermissionDenied(f"RDMA peer {peer_address(remote.gid) if len(remote.gid) == 16 else '?'} "
                                          "is not in rdma.allowed_peers")
        if remote.gid_type and self.gid.type and remote.gid_type != self.gid.type:
            # RoCE v1 and v2 frames never meet: the connect would "work" and every WR time out.
            raise errors.TransportUnavailable(
                f"the client sends from a {remote.gid_type} GID and this node from a {self.gid.type} one: "
                "choose GIDs of one type (the client's gid_index, rdma.gid_index)")
        with self._lock:
            self._make_room()
            try:
                qp = self._device.create_queue_pair(1, 1, RESPONDER_CQ_ENTRIES)
            except v.VerbsError as exc:
                raise errors.TransportUnavailable(f"cannot create a queue pair: {exc}") from None
            psn = secrets.randbits(24)
            try:
                qp.connect(v.PeerAddress(remote.lid, remote.gid, remote.qp_num, remote.psn, min(remote.mtu, self.mtu)),
                           self.route, psn, self.rd_atomic, access_remote=True)
            except v.VerbsError as exc:
                qp.close()      # a failed connect leaks nothing
                raise errors.TransportUnavailable(f"cannot connect to the client's queue pair: {exc}") from None
            self._peers[qp.qp_num] = _Peer(qp, str(peer_address(remote.gid)), owner, self._clock())
        address = QueuePairAddress(self.lid, self.gid.raw, qp.qp_num, psn, self.mtu, self.gid.type)
        return address, self.arena_addr, self.rkey

    def _make_room(self) -> None:
        if len(self._peers) < self.queue_pairs_max:
            return
        now = self._clock()
        qp_num, peer = min(self._peers.items(), key=lambda item: item[1].last_used)
        if now - peer.last_used < self.idle_evict_s:
            raise errors.TransportUnavailable(f"all {self.queue_pairs_max} RDMA queue pairs are in use "
                                              "(rdma.queue_pairs_max); use TCP")
        log.info("rdma queue pair evicted qp_num=%d peer=%s idle_s=%.0f", qp_num, peer.address, now - peer.last_used)
        self._close(qp_num)

    def touch(self, qp_num: int) -> None:
        """The client of this QP is active (a Reserve or Acquire of its session): not idle."""
        with self._lock:
            peer = self._peers.get(qp_num)
            if peer is not None:
                peer.last_used = self._clock()

    def fence(self, qp_num: int) -> None:
        """Move a client's QP to ERROR: its READs and WRITEs from now on fail and land nowhere."""
        with self._lock:
            peer = self._peers.get(qp_num)
            if peer is not None:
                peer.qp.to_error()
                log.warning("rdma queue pair fenced qp_num=%d peer=%s", qp_num, peer.address)

    def fence_owner(self, owner: object) -> None:
        """Fence every QP of a session (a write lease of it expired or was aborted)."""
        with self._lock:
            qp_nums = [n for n, p in self._peers.items() if p.owner is owner]
        for qp_num in qp_nums:
            self.fence(qp_num)

    def touch_owner(self, owner: object) -> None:
        """Every QP of a session is in use (it reserved or acquired pages)."""
        with self._lock:
            now = self._clock()
            for peer in self._peers.values():
                if peer.owner is owner:
                    peer.last_used = now

    def disconnect(self, qp_num: int) -> None:
        with self._lock:
            self._close(qp_num)

    def disconnect_owner(self, owner: object) -> None:
        with self._lock:
            for qp_num in [n for n, p in self._peers.items() if p.owner is owner]:
                self._close(qp_num)

    def queue_pairs(self) -> int:
        return len(self._peers)

    def _close(self, qp_num: int) -> None:
        peer = self._peers.pop(qp_num, None)
        if peer is not None:
            peer.qp.to_error()
            peer.qp.close()

    def close(self) -> None:
        with self._lock:
            for qp_num in list(self._peers):
                self._close(qp_num)
        self._mr.close()
        self._device.close()
