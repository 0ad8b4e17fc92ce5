"""The RDMA data plane through pyverbs: RDMA WRITE for put, RDMA READ for get, one RC queue pair.

NEVER RUN ON A DEVICE. It was written where no RDMA NIC exists and none can be emulated;
what is tested here is what runs without one: loading pyverbs (and the clear error when it
or a device is missing) and planning work requests (plan_work_requests). Queue-pair set-up
and posting follow the rdma-core pyverbs API (rdma-core 44, Debian python3-pyverbs) and
are exercised only by tests marked `rdma`, which run where a device exists.

pyverbs is not on PyPI: it comes from the system (apt install python3-pyverbs) and is
loaded from the system's dist-packages by itself, so nothing else there shadows this
environment's packages.

Protocol: the client creates an RC queue pair, sends its address in RdmaConnect (gRPC);
the server connects one of its own and answers with its address, the arena's virtual
address and the remote key of the arena's memory region. A slot's remote address is
arena_addr + the offset from Reserve/Acquire; commit and release go over gRPC as with
shared memory. The caller's buffers are registered on first use (bounded cache).
"""

from __future__ import annotations

import collections
import importlib
import importlib.machinery
import importlib.util
import secrets
import sys
from typing import Any

from kvstore_client import errors
from kvstore_client.buffers import Segment
from kvstore_client.data_path import NETWORK_SHAPE, Page
from kvstore_client.proto import pb

SYSTEM_PACKAGE_DIRS = ("/usr/lib/python3/dist-packages",)
INSTALL_HINT = "RDMA needs pyverbs from rdma-core: apt install python3-pyverbs (not on PyPI)"
QUEUE_DEPTH = 256          # work requests in flight on the send queue
MAX_SGE = 16               # scatter-gather entries per work request
MR_CACHE_ENTRIES = 1024    # registered caller buffers kept


def load_pyverbs() -> Any:
    """The pyverbs package, from this environment or the system's; TransportUnavailable when absent."""
    if "pyverbs" in sys.modules:
        return sys.modules["pyverbs"]
    spec = importlib.util.find_spec("pyverbs") or importlib.machinery.PathFinder.find_spec(
        "pyverbs", list(SYSTEM_PACKAGE_DIRS))
    if spec is None or spec.loader is None:
        raise errors.TransportUnavailable(INSTALL_HINT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["pyverbs"] = module
    try:
        spec.loader.exec_module(module)
        for name in ("device", "pd", "cq", "qp", "mr", "wr", "addr", "enums"):
            importlib.import_module(f"pyverbs.{name}")
    except ImportError as exc:
        sys.modules.pop("pyverbs", None)
        raise errors.TransportUnavailable(f"{INSTALL_HINT}; importing it failed: {exc}") from None
    return module


def device_names() -> list[str]:
    pyverbs = load_pyverbs()
    try:
        return [d.name.decode() if isinstance(d.name, bytes) else d.name for d in pyverbs.device.get_device_list()]
    except Exception as exc:  # PyverbsRDMAError: no RDMA subsystem in this kernel/container
        raise errors.TransportUnavailable(f"no RDMA device on this host: {exc}") from None


def device_present() -> bool:
    try:
        return bool(device_names())
    except errors.TransportUnavailable:
        return False


def plan_work_requests(pages: list[Page], arena_addr: int, max_sge: int) -> list[tuple[int, list[Segment]]]:
    """(remote address, local segments) per work request: a page's segments, at most max_sge per request."""
    plan = []
    for _, offset, segments in pages:
        remote = arena_addr + offset
        for first in range(0, len(segments), max_sge):
            chunk = segments[first:first + max_sge]
            plan.append((remote, chunk))
            remote += sum(n for _, n in chunk)
    return plan


def open_device(device: str) -> tuple[Any, Any]:
    """(context, protection domain) of the named RDMA device, or of the first one."""
    load_pyverbs()
    from pyverbs import device as dev, pd

    names = device_names()
    if not names:
        raise errors.TransportUnavailable("no RDMA device on this host")
    context = dev.Context(name=device or names[0])
    return context, pd.PD(context)


class QueuePairEnd:
    """One RC queue pair, and how to connect it to a peer's (shared by client and server).

    Its memory regions must be in the same protection domain, so the caller opens the device.
    """

    def __init__(self, context: Any, pd: Any, port: int, gid_index: int):
        from pyverbs import addr, cq, enums as e, qp

        self.e = e
        self.context, self.pd = context, pd
        self.cq = cq.CQ(context, QUEUE_DEPTH)
        cap = qp.QPCap(max_send_wr=QUEUE_DEPTH, max_recv_wr=1, max_send_sge=MAX_SGE, max_recv_sge=1)
        self.qp = qp.QP(pd, qp.QPInitAttr(qp_type=e.IBV_QPT_RC, scq=self.cq, rcq=self.cq, cap=cap))
        self.port, self.gid_index = port, gid_index
        port_attr = context.query_port(port)
        gid = context.query_gid(port, gid_index)
        self.local = (port_attr.lid, bytes.fromhex(str(gid.gid).replace(":", "")), self.qp.qp_num,
                      secrets.randbits(24), port_attr.active_mtu)
        self._addr, self._qp_module = addr, qp
        self._access = e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE | e.IBV_ACCESS_REMOTE_READ

    def connect(self, lid: int, gid: bytes, qp_num: int, psn: int, mtu: int) -> None:
        """INIT -> RTR -> RTS against the peer's queue pair."""
        e, qp, addr = self.e, self._qp_module, self._addr
        attr = qp.QPAttr(qp_state=e.IBV_QPS_INIT)
        attr.qp_access_flags = self._access
        attr.port_num = self.port
        self.qp.to_init(attr)
        attr = qp.QPAttr(qp_state=e.IBV_QPS_RTR)
        attr.path_mtu = min(mtu, self.local[4])
        attr.dest_qp_num = qp_num
        attr.rq_psn = psn
        attr.max_dest_rd_atomic = 16
        attr.min_rnr_timer = 12
        dgid = addr.GID()
        dgid.gid = ":".join(gid.hex()[i:i + 4] for i in range(0, 32, 4))
        route = addr.GlobalRoute(dgid=dgid, sgid_index=self.gid_index)
        attr.ah_attr = addr.AHAttr(gr=route, is_global=1 if any(gid) else 0, dlid=lid, port_num=self.port)
        self.qp.to_rtr(attr)
        attr.qp_state = e.IBV_QPS_RTS
        attr.sq_psn = self.local[3]
        attr.timeout, attr.retry_cnt, attr.rnr_retry, attr.max_rd_atomic = 14, 7, 7, 16
        self.qp.to_rts(attr)

    def close(self) -> None:
        self.qp.close()
        self.cq.close()


class RdmaDataPath:
    """Put/get through one-sided RDMA operations on the node's arena."""

    name = "rdma"
    shape = NETWORK_SHAPE

    def __init__(self, control: Any, device: str = "", port: int = 1, gid_index: int = 0):
        self._context, self._pd = open_device(device)
        self.end = QueuePairEnd(self._context, self._pd, port, gid_index)
        lid, gid, qp_num, psn, mtu = self.end.local
        try:
            answer = control.call("RdmaConnect", pb.RdmaConnectRequest(queue_pair=pb.RdmaQueuePair(
                lid=lid, gid=gid, qp_num=qp_num, psn=psn, mtu=mtu)))
            remote = answer.queue_pair
            self.end.connect(remote.lid, bytes(remote.gid), remote.qp_num, remote.psn, remote.mtu)
        except BaseException:
            self.end.close()
            self._pd.close()
            self._context.close()
            raise
        self.arena_addr, self.rkey = answer.arena_addr, answer.rkey
        self._mrs: collections.OrderedDict[tuple[int, int], Any] = collections.OrderedDict()

    def put(self, lease_id: int, token: bytes, pages: list[Page], page_bytes: int) -> None:
        self._post(self.end.e.IBV_WR_RDMA_WRITE, pages)

    def get(self, lease_id: int, token: bytes, pages: list[Page], page_bytes: int) -> None:
        self._post(self.end.e.IBV_WR_RDMA_READ, pages)

    def alive(self) -> bool:
        """Always true: a queue pair has no cheap liveness check; a lost node fails the next work
        request (Unavailable), and the client reconnects then."""
        return True

    def close(self) -> None:
        for mr in self._mrs.values():
            mr.close()
        self.end.close()
        self._pd.close()
        self._context.close()

    def _post(self, opcode: int, pages: list[Page]) -> None:
        from pyverbs import wr as wr_module

        e = self.end.e
        plan = plan_work_requests(pages, self.arena_addr, MAX_SGE)
        for index, (remote, segments) in enumerate(plan):
            sges = [wr_module.SGE(address, nbytes, self._mr(address, nbytes).lkey) for address, nbytes in segments]
            last = index == len(plan) - 1
            signal = last or (index + 1) % (QUEUE_DEPTH // 2) == 0
            request = wr_module.SendWR(wr_id=index, opcode=opcode, num_sge=len(sges), sg=sges,
                                       send_flags=e.IBV_SEND_SIGNALED if signal else 0)
            request.set_wr_rdma(self.rkey, remote)
            self.end.qp.post_send(request)
            if signal:  # at most QUEUE_DEPTH / 2 requests outstanding
                self._wait_completion()

    def _wait_completion(self) -> None:
        e = self.end.e
        while True:
            count, completions = self.end.cq.poll(1)
            if count:
                if completions[0].status != e.IBV_WC_SUCCESS:
                    raise errors.Unavailable(f"RDMA work request failed with status {completions[0].status}")
                return

    def _mr(self, address: int, nbytes: int) -> Any:
        from pyverbs import mr as mr_module

        key = (address, nbytes)
        mr = self._mrs.get(key)
        if mr is None:
            e = self.end.e
            mr = mr_module.MR(self.end.pd, nbytes, e.IBV_ACCESS_LOCAL_WRITE, address=address)
            self._mrs[key] = mr
            if len(self._mrs) > MR_CACHE_ENTRIES:
                self._mrs.popitem(last=False)[1].close()
        else:
            self._mrs.move_to_end(key)
        return mr
