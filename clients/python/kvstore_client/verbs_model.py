"""A model of the verbs contract the RDMA data plane relies on, behind the same seam as pyverbs.

Not a stub that always succeeds: it moves real bytes between real addresses of this process
(ctypes.memmove), only when the work request is executed, and executes lazily (a few work
requests per poll of the CQ), so a transport that returns before its last work request has
completed leaves torn pages behind, as a NIC would. Written from the verbs man pages and
rdma-core's sources; each rule names its source:

  - ibv_create_qp(3), ibv_create_cq(3): a QP asks for max_send_wr / max_send_sge, a CQ for
    cqe entries; above ibv_query_device(3)'s max_qp_wr / max_sge / max_cqe the call fails
    (EINVAL). The seam always creates QPs with sq_sig_all=0.
  - ibv_post_send(3) and the IB spec's QP state table: sends are posted in RTS (in ERROR
    they are accepted and complete flushed; before RTS the call fails). A send queue slot is
    free again only once the completion of its WR, or of a later signalled WR of the same
    queue, was polled (unsignalled WRs complete with the next signalled one; rdma-core's
    providers/mlx5/qp.c checks overflow as head - tail against the queue's size, the tail
    moving only when the CQ is polled): posting past max_send_wr fails with ENOMEM, the WRs
    before the bad one stay posted. num_sge above the QP's max_send_sge fails with EINVAL.
  - ibv_poll_cq(3): completions of one send queue come in posting order; a successful WR
    without IBV_SEND_SIGNALED produces none; an error always produces one. More completions
    than the CQ holds is a CQ overrun: the QP goes to ERROR (IBV_EVENT_CQ_ERR).
  - ibv_modify_qp(3), the IB spec's QP state machine: the first failed WR moves the QP to
    ERROR; every WR after it, queued or posted later, completes with IBV_WC_WR_FLUSH_ERR; a
    QP stays in ERROR until reset (this model never resets: make a new QP). max_rd_atomic /
    max_dest_rd_atomic above max_qp_init_rd_atom / max_qp_rd_atom fail (EINVAL).
  - ibv_reg_mr(3): an MR pins the pages mapped at registration; an SGE must lie inside an MR
    of its lkey (else IBV_WC_LOC_PROT_ERR); a remote address inside the peer's MR of the rkey
    with its access (else IBV_WC_REM_ACCESS_ERR). A deregistered MR's lkey is invalid for WRs
    still queued. If the buffer is freed and new memory mapped at the same virtual address,
    the MR still names the old pages: `unmapped()` tells the model so, and such an MR moves
    bytes from and to nowhere (reads leave zeros, writes send zeros), as stale pins do.
  - ibv_query_gid_type / sysfs gid_attrs/types (rdma-core libibverbs/verbs.c), Mooncake's
    findBestGidIndex and rdma-core tests/base.py: mlx5 lists per address a RoCE v1 GID and a
    RoCE v2 GID; index 0 is RoCE v1 link-local. Two QPs reach each other only when both use
    the same GID type, neither is link-local across a router, the hop limit exceeds the
    routers in between (GlobalRoute.hop_limit defaults to 1 in pyverbs addr.pyx), and both
    ports are ACTIVE; otherwise their WRs end in IBV_WC_RETRY_EXC_ERR, as on a NIC, after
    the retry timer rather than at once.
  - A responder QP in ERROR (fenced, closed) or unknown: the requester's WR ends in
    IBV_WC_RETRY_EXC_ERR.

Faults are armed by tests: `fail_after(n, status)` (the n-th WR executed from now fails),
`fail_call(name, errno)` (the next call of that verb fails locally), `ports_active`.
It lives in the SDK, next to the seam it implements, because both the client transport and
the server's (kvstore/transport/rdma.py) are tested against one model instance (one fabric),
and a deployment can run its own code against it without a NIC; it is never chosen at run time.
"""

from __future__ import annotations

import ctypes
import errno as errno_module
import itertools
import threading
import time
from typing import Sequence

from kvstore_client import verbs as v


class VerbsModel:
    """One fabric: every device opened on it can reach every other, subject to the addressing rules."""

    def __init__(self, limits: v.DeviceLimits | None = None, routers: int = 0, wrs_per_poll: int = 4,
                 yield_in_poll: bool = False, device_names: tuple[str, ...] = ("mlx5_0",)):
        self.limits = limits or v.DeviceLimits(max_qp_wr=8192, max_sge=30, max_qp_rd_atom=16,
                                               max_qp_init_rd_atom=16, max_cqe=4194303)
        self.routers = routers                  # IP routers between any two hosts
        self.wrs_per_poll = wrs_per_poll
        self.yield_in_poll = yield_in_poll      # let other threads run inside poll (races show up)
        self.names = list(device_names)
        self.ports_active = True
        self.lock = threading.RLock()
        self.queue_pairs: dict[int, ModelQueuePair] = {}
        self.executed = 0                       # WRs executed so far (all QPs)
        self.calls: dict[str, int] = {}         # verbs calls made, by name
        self._qp_nums = itertools.count(0x100)
        self._keys = itertools.count(0x1000)
        self._hosts = itertools.count(1)
        self._fail_at: tuple[int, int] | None = None
        self._fail_calls: dict[str, int] = {}
        self.mrs: dict[int, ModelRegion] = {}   # by lkey (== rkey)

    # -- faults -----------------------------------------------------------------------------

    def fail_after(self, wrs: int, status: int = v.WC_REM_ACCESS_ERR) -> None:
        """The wrs-th work request executed from now (1 = the next) fails with `status`."""
        self._fail_at = (self.executed + wrs, status)

    def fail_call(self, name: str, errno: int = errno_module.EIO) -> None:
        """The next call of `name` (open, register, create_queue_pair, connect, post_send, poll) fails locally."""
        self._fail_calls[name] = errno

    def unmapped(self, address: int, nbytes: int) -> None:
        """The process freed [address, address + nbytes): MRs over it now pin pages nobody sees."""
        with self.lock:
            for mr in self.mrs.values():
                if mr.address < address + nbytes and address < mr.address + mr.nbytes:
                    mr.stale = True

    def _call(self, name: str) -> None:
        self.calls[name] = self.calls.get(name, 0) + 1
        errno = self._fail_calls.pop(name, None)
        if errno is not None:
            raise v.VerbsError(f"{name} (armed fault)", errno)

    # -- Verbs -------------------------------------------------------------------------------

    def device_names(self) -> list[str]:
        return list(self.names)

    def open(self, name: str) -> "ModelDevice":
        with self.lock:
            self._call("open")
            if name not in self.names:
                raise v.VerbsError(f"ibv_open_device({name}): no such device", errno_module.ENODEV)
            return ModelDevice(self, name, next(self._hosts))

    # -- execution ---------------------------------------------------------------------------

    def _execute(self, qp: "ModelQueuePair", request: v.WorkRequest) -> int:
        """Run one WR now; returns its completion status."""
        self.executed += 1
        if self._fail_at is not None and self.executed == self._fail_at[0]:
            status, self._fail_at = self._fail_at[1], None
            return status
        peer = self.queue_pairs.get(qp.peer_qp_num)
        if peer is None or peer.state != "RTS" or not self._reachable(qp, peer):
            return v.WC_RETRY_EXC_ERR
        local = []
        for address, nbytes, lkey in request.sges:
            mr = self.mrs.get(lkey)
            if mr is None or mr.device is not qp.device or not mr.contains(address, nbytes):
                return v.WC_LOC_PROT_ERR
            local.append((mr, address, nbytes))
        total = sum(n for _, _, n in local)
        remote = self.mrs.get(request.rkey)
        if (remote is None or remote.device is not peer.device or not remote.remote
                or not remote.contains(request.remote_addr, total)):
            return v.WC_REM_ACCESS_ERR
        at = request.remote_addr
        for mr, address, nbytes in local:
            if request.opcode == v.OP_WRITE:
                _move(remote, at, mr, address, nbytes)
            else:
                _move(mr, address, remote, at, nbytes)
            at += nbytes
        return v.WC_SUCCESS

    def _reachable(self, qp: "ModelQueuePair", peer: "ModelQueuePair") -> bool:
        if not self.ports_active or qp.route is None or peer.route is None:
            return False
        mine, theirs = qp.device.gid(qp.route.gid_index), peer.device.gid(peer.route.gid_index)
        if mine is None or theirs is None or mine.type != theirs.type or qp.peer_gid != theirs.raw:
            return False
        if self.routers:
            if mine.type != v.GID_ROCE_V2 or mine.raw[:2] == b"\xfe\x80":
                return False
            if min(qp.route.hop_limit, peer.route.hop_limit) <= self.routers:
                return False
        return True


def _move(dst: "ModelRegion", dst_address: int, src: "ModelRegion", src_address: int, nbytes: int) -> None:
    if dst.stale:
        return                                  # lands in pages nobody maps any more
    if src.stale:
        ctypes.memset(dst_address, 0, nbytes)
        return
    ctypes.memmove(dst_address, src_address, nbytes)


class ModelRegion:
    def __init__(self, device: "ModelDevice", address: int, nbytes: int, remote: bool, key: int):
        self.device, self.address, self.nbytes, self.remote = device, address, nbytes, remote
        self.lkey = self.rkey = key
        self.stale = False
        self.closed = False

    def contains(self, address: int, nbytes: int) -> bool:
        return not self.closed and self.address <= address and address + nbytes <= self.address + self.nbytes

    def close(self) -> None:
        with self.device.model.lock:
            self.closed = True
            self.device.model.mrs.pop(self.lkey, None)


class ModelDevice:
    def __init__(self, model: VerbsModel, name: str, host: int):
        self.model, self.name, self.limits = model, name, model.limits
        ipv4 = bytes([10, 0, host >> 8, host & 0xFF])
        link_local = b"\xfe\x80" + b"\0" * 6 + b"\x02\x00\x00\xff\xfe\x00" + bytes([host >> 8, host & 0xFF])
        mapped = b"\0" * 10 + b"\xff\xff" + ipv4
        # mlx5's order: each address as RoCE v1 then RoCE v2; link-local first.
        self.gids = (v.Gid(0, link_local, v.GID_ROCE_V1), v.Gid(1, link_local, v.GID_ROCE_V2),
                     v.Gid(2, mapped, v.GID_ROCE_V1), v.Gid(3, mapped, v.GID_ROCE_V2))
        self.closed = False

    def gid(self, index: int) -> v.Gid | None:
        return self.gids[index] if 0 <= index < len(self.gids) else None

    def port(self, port: int) -> v.PortInfo:
        if port != 1:
            raise v.VerbsError(f"ibv_query_port({port}): no such port", errno_module.EINVAL)
        return v.PortInfo(self.model.ports_active, 0, 5, self.gids)

    def register(self, address: int, nbytes: int, remote: bool) -> ModelRegion:
        with self.model.lock:
            self.model._call("register")
            if address <= 0 or nbytes <= 0:
                raise v.VerbsError("ibv_reg_mr: bad range", errno_module.EINVAL)
            mr = ModelRegion(self, address, nbytes, remote, next(self.model._keys))
            self.model.mrs[mr.lkey] = mr
            return mr

    def create_queue_pair(self, send_wr: int, send_sge: int, cq_entries: int) -> "ModelQueuePair":
        with self.model.lock:
            self.model._call("create_queue_pair")
            limits = self.limits
            if send_wr > limits.max_qp_wr or send_sge > limits.max_sge or cq_entries > limits.max_cqe:
                raise v.VerbsError(f"ibv_create_qp(send_wr={send_wr}, send_sge={send_sge}, cqe={cq_entries}) "
                                   f"above the device's limits", errno_module.EINVAL)
            if send_wr < 1 or send_sge < 1 or cq_entries < 1:
                raise v.VerbsError("ibv_create_qp: empty queue", errno_module.EINVAL)
            qp = ModelQueuePair(self, next(self.model._qp_nums), send_wr, send_sge, cq_entries)
            self.model.queue_pairs[qp.qp_num] = qp
            return qp

    def close(self) -> None:
        self.closed = True


class ModelQueuePair:
    def __init__(self, device: ModelDevice, qp_num: int, send_wr: int, send_sge: int, cq_entries: int):
        self.device, self.model = device, device.model
        self.qp_num, self.send_wr, self.send_sge, self.cq_entries = qp_num, send_wr, send_sge, cq_entries
        self.state = "RESET"
        self.route: v.Route | None = None
        self.peer_qp_num = 0
        self.peer_gid = b""
        self.queued: list[v.WorkRequest] = []     # posted, not yet executed
        self.unretired: list[v.WorkRequest] = []  # executed, send queue slot not yet free
        self.cq: list[tuple[v.Completion, int]] = []  # (completion, slots it frees)
        self.posted = 0

    @property
    def outstanding(self) -> int:
        """Send queue slots in use: posted WRs whose completion (or a later signalled one's) is not polled."""
        return len(self.queued) + len(self.unretired) + sum(n for _, n in self.cq)

    def connect(self, peer: v.PeerAddress, route: v.Route, psn: int, rd_atomic: int, access_remote: bool) -> None:
        with self.model.lock:
            self.model._call("connect")
            limits = self.device.limits
            if rd_atomic > min(limits.max_qp_rd_atom, limits.max_qp_init_rd_atom) or rd_atomic < 1:
                raise v.VerbsError(f"ibv_modify_qp(max_rd_atomic={rd_atomic}) above the device's limits",
                                   errno_module.EINVAL)
            if self.device.gid(route.gid_index) is None or route.port != 1:
                raise v.VerbsError(f"ibv_modify_qp(RTR): no GID {route.gid_index} on port {route.port}",
                                   errno_module.EINVAL)
            if not 1 <= route.hop_limit <= 255:
                raise v.VerbsError("ibv_modify_qp(RTR): bad hop_limit", errno_module.EINVAL)
            self.route, self.peer_qp_num, self.peer_gid = route, peer.qp_num, peer.gid
            self.state = "RTS"

    def post_send(self, requests: Sequence[v.WorkRequest]) -> None:
        with self.model.lock:
            self.model._call("post_send")
            if self.state not in ("RTS", "ERR"):
                raise v.VerbsError(f"ibv_post_send: queue pair in {self.state}", errno_module.EINVAL)
            for request in requests:
                if len(request.sges) > self.send_sge or not request.sges:
                    raise v.VerbsError(f"ibv_post_send: {len(request.sges)} SGEs, the QP takes "
                                       f"{self.send_sge}", errno_module.EINVAL)
                if self.outstanding >= self.send_wr:
                    raise v.VerbsError("ibv_post_send: send queue full", errno_module.ENOMEM)
                self.queued.append(request)
                self.posted += 1

    def poll(self, entries_max: int) -> list[v.Completion]:
        if self.model.yield_in_poll:
            time.sleep(0)
        with self.model.lock:
            self.model._call("poll")
            for _ in range(self.model.wrs_per_poll):
                if not self.queued:
                    break
                self._run(self.queued.pop(0))
            taken, self.cq = self.cq[:entries_max], self.cq[entries_max:]
        return [completion for completion, _ in taken]

    def _run(self, request: v.WorkRequest) -> None:
        status = v.WC_WR_FLUSH_ERR if self.state == "ERR" else self.model._execute(self, request)
        if status != v.WC_SUCCESS and self.state != "ERR":
            self._to_error()
        self.unretired.append(request)
        if request.signaled or status != v.WC_SUCCESS:
            if len(self.cq) >= self.cq_entries:   # CQ overrun: the completion is lost, the QP breaks
                self._to_error()
                return
            self.cq.append((v.Completion(request.wr_id, status), len(self.unretired)))
            self.unretired = []

    def _to_error(self) -> None:
        self.state = "ERR"

    def to_error(self) -> None:
        with self.model.lock:
            self._to_error()

    def close(self) -> None:
        with self.model.lock:
            self.state = "CLOSED"
            self.model.queue_pairs.pop(self.qp_num, None)
