"""The few verbs the RDMA data plane uses, as one seam: a Protocol, and pyverbs behind it.

rdma_transport.py (client) and kvstore/transport/rdma.py (server) speak only to a `Verbs`
object. Two implement it: `PyverbsVerbs` here (rdma-core's pyverbs, Debian bookworm's
python3-pyverbs, rdma-core v44), kept as thin as possible because nothing here can run
it, and `verbs_model.VerbsModel`, a model of the verbs contract the tests drive the real
transport code against.

What the seam keeps from verbs, and nothing more:
  - a device: its limits (ibv_query_device: max_qp_wr, max_sge, max_qp_rd_atom,
    max_qp_init_rd_atom, max_cqe), a port's state, LID, MTU and GID table with each GID's
    type (RoCE v1 / RoCE v2, from sysfs gid_attrs/types as rdma-core's ibv_query_gid_type
    reads it);
  - memory regions (ibv_reg_mr / ibv_dereg_mr): (address, nbytes) -> lkey, rkey;
  - RC queue pairs with their own send CQ (ibv_create_qp with sq_sig_all=0, ibv_create_cq),
    connected INIT -> RTR -> RTS (ibv_modify_qp) to a peer's address, moved to ERROR
    (fencing, teardown);
  - post_send of a chain of RDMA WRITE / READ work requests (ibv_post_send: with ENOMEM
    when the send queue is full; the WRs before the bad one stay posted), and poll of the
    CQ (ibv_poll_cq).

Errors: a verbs call that fails raises VerbsError (errno and what failed), never pyverbs'
own exception types; the transports map it to the SDK's typed errors.
"""

from __future__ import annotations

import dataclasses
import errno as errno_module
import importlib
import importlib.machinery
import importlib.util
import os
import sys
from typing import Any, Protocol, Sequence

# ibv_wc_status values (verbs.h): the ones the transports tell apart.
WC_SUCCESS = 0
WC_LOC_LEN_ERR = 1
WC_LOC_PROT_ERR = 4
WC_WR_FLUSH_ERR = 5
WC_REM_ACCESS_ERR = 10
WC_RETRY_EXC_ERR = 12
WC_NAMES = {0: "success", 1: "local length error", 4: "local protection error", 5: "flushed (queue pair in error)",
            10: "remote access error", 12: "transport retry counter exceeded (peer unreachable)"}

OP_WRITE = "write"
OP_READ = "read"

GID_ROCE_V1 = "IB/RoCE v1"
GID_ROCE_V2 = "RoCE v2"

# ibv_mtu enum: 1=256 ... 5=4096
MTU_BYTES = {1: 256, 2: 512, 3: 1024, 4: 2048, 5: 4096}

SYSTEM_PACKAGE_DIRS = ("/usr/lib/python3/dist-packages",)
INSTALL_HINT = "RDMA needs pyverbs from rdma-core: apt install python3-pyverbs (not on PyPI)"


class VerbsError(Exception):
    """A verbs call failed locally (ibv_* returned an error): errno says why."""

    def __init__(self, what: str, errno: int):
        super().__init__(f"{what}: {os.strerror(errno) if errno else 'failed'} (errno {errno})")
        self.errno = errno


@dataclasses.dataclass(frozen=True)
class DeviceLimits:
    max_qp_wr: int            # send queue depth a QP may ask for
    max_sge: int              # scatter-gather entries per work request
    max_qp_rd_atom: int       # RDMA READs a QP may have outstanding as responder
    max_qp_init_rd_atom: int  # ... and as initiator
    max_cqe: int


@dataclasses.dataclass(frozen=True)
class Gid:
    index: int
    raw: bytes                # 16 bytes
    type: str                 # GID_ROCE_V1 or GID_ROCE_V2 ("" when unknown: InfiniBand)

    @property
    def ipv4_mapped(self) -> bool:
        return self.raw[:12] == b"\0" * 10 + b"\xff\xff"


@dataclasses.dataclass(frozen=True)
class PortInfo:
    active: bool
    lid: int
    mtu: int                  # ibv_mtu enum value
    gids: tuple[Gid, ...]


@dataclasses.dataclass(frozen=True)
class PeerAddress:
    """Where an RC queue pair is reached (exchanged over RdmaConnect)."""

    lid: int
    gid: bytes
    qp_num: int
    psn: int
    mtu: int


@dataclasses.dataclass(frozen=True)
class Route:
    """How packets reach the peer: RoCE v2 needs a global route with a hop limit past one router."""

    port: int
    gid_index: int
    hop_limit: int = 64
    traffic_class: int = 0
    service_level: int = 0


@dataclasses.dataclass(frozen=True)
class WorkRequest:
    wr_id: int
    opcode: str                               # OP_WRITE or OP_READ
    sges: tuple[tuple[int, int, int], ...]    # (address, nbytes, lkey)
    remote_addr: int
    rkey: int
    signaled: bool


@dataclasses.dataclass(frozen=True)
class Completion:
    wr_id: int
    status: int


class MemoryRegion(Protocol):
    address: int
    nbytes: int
    lkey: int
    rkey: int

    def close(self) -> None: ...


class QueuePair(Protocol):
    qp_num: int

    def connect(self, peer: PeerAddress, route: Route, psn: int, rd_atomic: int, access_remote: bool) -> None: ...
    def post_send(self, requests: Sequence[WorkRequest]) -> None: ...
    def poll(self, entries_max: int) -> list[Completion]: ...
    def to_error(self) -> None: ...
    def close(self) -> None: ...


class Device(Protocol):
    name: str
    limits: DeviceLimits

    def port(self, port: int) -> PortInfo: ...
    def register(self, address: int, nbytes: int, remote: bool) -> MemoryRegion: ...
    def create_queue_pair(self, send_wr: int, send_sge: int, cq_entries: int) -> QueuePair: ...
    def close(self) -> None: ...


class Verbs(Protocol):
    def device_names(self) -> list[str]: ...
    def open(self, name: str) -> Device: ...


# -- pyverbs ------------------------------------------------------------------------------
# Untestable here (no NIC): kept to one-to-one calls of the pyverbs API, no logic.


def load_pyverbs(system_dirs: Sequence[str] = SYSTEM_PACKAGE_DIRS) -> Any:
    """The pyverbs package, from this environment or the system's; raises ImportError with the install hint.

    It is loaded from the system's dist-packages by itself, so nothing else there shadows
    this environment's packages.
    """
    if "pyverbs" in sys.modules:
        return sys.modules["pyverbs"]
    spec = importlib.util.find_spec("pyverbs") or importlib.machinery.PathFinder.find_spec(
        "pyverbs", list(system_dirs))
    if spec is None or spec.loader is None:
        raise ImportError(INSTALL_HINT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["pyverbs"] = module
    try:
        spec.loader.exec_module(module)
        for name in ("device", "pd", "cq", "qp", "mr", "wr", "addr", "enums", "pyverbs_error"):
            importlib.import_module(f"pyverbs.{name}")
    except ImportError as exc:
        sys.modules.pop("pyverbs", None)
        raise ImportError(f"{INSTALL_HINT}; importing it failed: {exc}") from None
    return module


def _verbs_call(what: str, call: Any, *args: Any, **kwargs: Any) -> Any:
    """Run a pyverbs call; PyverbsRDMAError / PyverbsError become VerbsError (never escape raw)."""
    from pyverbs.pyverbs_error import PyverbsError

    try:
        return call(*args, **kwargs)
    except PyverbsError as exc:
        raise VerbsError(f"{what} ({exc})", getattr(exc, "error_code", 0) or errno_module.EIO) from None


class PyverbsVerbs:
    def device_names(self) -> list[str]:
        pyverbs = load_pyverbs()
        names = _verbs_call("ibv_get_device_list", pyverbs.device.get_device_list)
        return [d.name.decode() if isinstance(d.name, bytes) else d.name for d in names]

    def open(self, name: str) -> Device:
        return _PyverbsDevice(name)


class _PyverbsDevice:
    def __init__(self, name: str):
        from pyverbs import device, pd

        self.name = name
        self.context = _verbs_call(f"ibv_open_device({name})", device.Context, name=name)
        self.pd = _verbs_call("ibv_alloc_pd", pd.PD, self.context)
        attr = _verbs_call("ibv_query_device", self.context.query_device)
        self.limits = DeviceLimits(attr.max_qp_wr, attr.max_sge, attr.max_qp_rd_atom, attr.max_qp_init_rd_atom,
                                   attr.max_cqe)

    def port(self, port: int) -> PortInfo:
        from pyverbs import enums as e

        attr = _verbs_call("ibv_query_port", self.context.query_port, port)
        gids = []
        for index in range(attr.gid_tbl_len):
            try:
                gid = self.context.query_gid(port, index)
            except Exception:  # unpopulated entry
                continue
            raw = bytes.fromhex(str(gid.gid).replace(":", ""))
            if any(raw):
                gids.append(Gid(index, raw, _sysfs_gid_type(self.name, port, index)))
        return PortInfo(attr.state == e.IBV_PORT_ACTIVE, attr.lid, attr.active_mtu, tuple(gids))

    def register(self, address: int, nbytes: int, remote: bool) -> MemoryRegion:
        from pyverbs import enums as e, mr

        access = e.IBV_ACCESS_LOCAL_WRITE
        if remote:
            access |= e.IBV_ACCESS_REMOTE_WRITE | e.IBV_ACCESS_REMOTE_READ
        region = _verbs_call(f"ibv_reg_mr({nbytes} bytes)", mr.MR, self.pd, nbytes, access, address=address)
        return _PyverbsRegion(region, address, nbytes)

    def create_queue_pair(self, send_wr: int, send_sge: int, cq_entries: int) -> QueuePair:
        return _PyverbsQueuePair(self, send_wr, send_sge, cq_entries)

    def close(self) -> None:
        self.pd.close()
        self.context.close()


class _PyverbsRegion:
    def __init__(self, region: Any, address: int, nbytes: int):
        self._region, self.address, self.nbytes = region, address, nbytes
        self.lkey, self.rkey = region.lkey, region.rkey

    def close(self) -> None:
        self._region.close()


class _PyverbsQueuePair:
    def __init__(self, device: _PyverbsDevice, send_wr: int, send_sge: int, cq_entries: int):
        from pyverbs import cq, enums as e, qp

        self.e, self.device = e, device
        self.cq = _verbs_call("ibv_create_cq", cq.CQ, device.context, cq_entries)
        cap = qp.QPCap(max_send_wr=send_wr, max_recv_wr=1, max_send_sge=send_sge, max_recv_sge=1)
        init = qp.QPInitAttr(qp_type=e.IBV_QPT_RC, scq=self.cq, rcq=self.cq, cap=cap, sq_sig_all=0)
        try:
            self.qp = _verbs_call("ibv_create_qp", qp.QP, device.pd, init)
        except VerbsError:
            self.cq.close()
            raise
        self.qp_num = self.qp.qp_num
        self._reusable: dict[int, Any] = {}

    def connect(self, peer: PeerAddress, route: Route, psn: int, rd_atomic: int, access_remote: bool) -> None:
        from pyverbs import addr, qp

        e = self.e
        attr = qp.QPAttr(qp_state=e.IBV_QPS_INIT)
        attr.qp_access_flags = e.IBV_ACCESS_LOCAL_WRITE | (
            e.IBV_ACCESS_REMOTE_WRITE | e.IBV_ACCESS_REMOTE_READ if access_remote else 0)
        attr.port_num = route.port
        _verbs_call("modify_qp(INIT)", self.qp.to_init, attr)
        attr = qp.QPAttr(qp_state=e.IBV_QPS_RTR)
        attr.path_mtu = peer.mtu
        attr.dest_qp_num = peer.qp_num
        attr.rq_psn = peer.psn
        attr.max_dest_rd_atomic = rd_atomic
        attr.min_rnr_timer = 12
        dgid = addr.GID()
        dgid.gid = ":".join(peer.gid.hex()[i:i + 4] for i in range(0, 32, 4))
        gr = addr.GlobalRoute(dgid=dgid, sgid_index=route.gid_index, hop_limit=route.hop_limit,
                              traffic_class=route.traffic_class)
        attr.ah_attr = addr.AHAttr(gr=gr, is_global=1, dlid=peer.lid, sl=route.service_level, port_num=route.port)
        _verbs_call("modify_qp(RTR)", self.qp.to_rtr, attr)
        attr.qp_state = e.IBV_QPS_RTS
        attr.sq_psn = psn
        attr.timeout, attr.retry_cnt, attr.rnr_retry, attr.max_rd_atomic = 14, 7, 7, rd_atomic
        _verbs_call("modify_qp(RTS)", self.qp.to_rts, attr)

    def post_send(self, requests: Sequence[WorkRequest]) -> None:
        # One ibv_post_send for the chain (SendWR's next_wr, rdma-core pyverbs/wr.pyx). pyverbs 44's
        # SGE and SendWR free their memory only in close() (their __dealloc is misspelled
        # upstream): SendWR copies the SGEs, so each is closed once, after the post returns
        # (the provider has copied the WRs into the send queue by then: ibv_post_send(3)).
        from pyverbs import wr

        e = self.e
        made: list[Any] = []

        def post() -> None:
            head = None
            for request in reversed(requests):
                sges = [wr.SGE(address, nbytes, lkey) for address, nbytes, lkey in request.sges]
                made.extend(sges)
                opcode = e.IBV_WR_RDMA_WRITE if request.opcode == OP_WRITE else e.IBV_WR_RDMA_READ
                send = wr.SendWR(wr_id=request.wr_id, opcode=opcode, num_sge=len(sges), sg=sges,
                                 send_flags=e.IBV_SEND_SIGNALED if request.signaled else 0, next_wr=head)
                made.append(send)
                send.set_wr_rdma(request.rkey, request.remote_addr)
                head = send
            if head is not None:
                self.qp.post_send(head)
        try:
            _verbs_call("ibv_post_send", post)
        finally:
            for obj in made:
                obj.close()

    def poll(self, entries_max: int) -> list[Completion]:
        count, completions = _verbs_call("ibv_poll_cq", self.cq.poll, entries_max)
        return [Completion(wc.wr_id, wc.status) for wc in completions[:count]]

    def to_error(self) -> None:
        from pyverbs import qp

        attr = qp.QPAttr(qp_state=self.e.IBV_QPS_ERR)
        _verbs_call("modify_qp(ERR)", self.qp.modify, attr, self.e.IBV_QP_STATE)

    def close(self) -> None:
        self.qp.close()
        self.cq.close()


def _sysfs_gid_type(device: str, port: int, index: int) -> str:
    """The GID's type as the kernel reports it (what ibv_query_gid_type reads)."""
    path = f"/sys/class/infiniband/{device}/ports/{port}/gid_attrs/types/{index}"
    try:
        with open(path) as file:
            return file.read().strip()
    except OSError:
        return ""
