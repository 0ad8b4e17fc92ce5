"""The RDMA data plane: RDMA WRITE for put, RDMA READ for get, one RC queue pair per connection.

EXPERIMENTAL, NEVER RUN ON A NIC. It speaks only to the verbs seam (verbs.py): pyverbs
(rdma-core v44, Debian python3-pyverbs) on a host with a device, and in the tests a model
of the verbs contract (verbs_model.py) that moves real bytes, lazily, with a bounded send
queue, signalled and unsignalled WRs, error state and flush, MR ranges and device limits.
What the tests prove is this file's logic against that model; the pyverbs layer under it
has never executed.

Protocol: the client opens a device, picks a port that is ACTIVE and a RoCE v2 GID on it
(IPv4-mapped first, never RoCE v1 link-local unless asked), creates an RC queue pair
clamped to the device's limits, and sends its address in RdmaConnect (gRPC); the server
connects one of its own and answers with its address, the arena's virtual address and the
rkey of the arena's memory region. The client then reads a few bytes of the arena (the
probe): a fabric that does not connect fails here, as TransportUnavailable, and
transport="auto" moves on to TCP. Commit and release go over gRPC, as with shared memory.

Completions: the queue pair has sq_sig_all=0; a call signals every `signal_every`-th WR
and its last, keeps at most `queue_depth` WRs outstanding (a credit window, refilled as
signalled completions arrive), and returns only once the completion of its last WR has
been polled, every status checked, every wr_id matched (ids never restart on a path).
Polling stops at the call's deadline (timeout_s).

Errors: the first failed WR, a verbs call that fails, or a deadline breaks the path: its
queue pair is moved to ERROR, the flushed completions are drained, and the call raises
Unavailable (DeadlineExceeded for the deadline); alive() is False from then on, so the
client opens a new connection on its next call (with transport="auto" that connection
falls back to TCP if RDMA fails again). Nothing of pyverbs escapes as its own type.

Memory: buffers registered with register() (whole buffers, once; the object is held alive
until unregister() or close()) are found by range containment. Segments outside every
registered buffer are registered for the call (adjacent segments merged into one MR) and
deregistered when it ends, after its last completion: never while a WR could still use
them, never cached by address (a freed buffer's address is reused by the next one).

Threads: one lock around a call's posting and polling; two threads on one client never
take each other's completions.
"""

from __future__ import annotations

import bisect
import ctypes
import dataclasses
import logging
import secrets
import threading
import time
from typing import Any, Sequence

from kvstore_client import errors, verbs as v
from kvstore_client.buffers import Segment
from kvstore_client.data_path import NETWORK_SHAPE, Page
from kvstore_client.proto import pb

log = logging.getLogger(__name__)

INSTALL_HINT = v.INSTALL_HINT
SYSTEM_PACKAGE_DIRS = v.SYSTEM_PACKAGE_DIRS
PROBE_BYTES = 64


@dataclasses.dataclass(frozen=True)
class RdmaOptions:
    """How a client uses its NIC; every limit is clamped to what the device reports."""

    device: str = ""          # "" = the first device with an ACTIVE port and a RoCE v2 GID
    port: int = 1
    gid_index: int = -1       # -1 = pick (RoCE v2 IPv4-mapped first); set it on odd fabrics
    traffic_class: int = 0    # IP DSCP/ECN byte of RoCE v2 packets (lossless class: ask your network team)
    service_level: int = 0    # maps to the 802.1p priority / PFC class
    hop_limit: int = 64       # RoCE v2 TTL; 1 would stop at the first router
    queue_depth: int = 256    # WRs outstanding on the send queue
    sge_max: int = 16         # scatter-gather entries per WR
    rd_atomic: int = 16       # RDMA READs outstanding
    signal_every: int = 32    # one signalled WR per this many

    def __post_init__(self) -> None:
        for name in ("port", "queue_depth", "sge_max", "rd_atomic", "signal_every"):
            if getattr(self, name) < 1:
                raise errors.InvalidArgument(f"RdmaOptions.{name} must be positive, got {getattr(self, name)}")
        if not 1 <= self.hop_limit <= 255 or not 0 <= self.traffic_class <= 255 or not 0 <= self.service_level <= 15:
            raise errors.InvalidArgument(
                "RdmaOptions: hop_limit in 1..255, traffic_class in 0..255, service_level in 0..15")


@dataclasses.dataclass(frozen=True)
class QueueLimits:
    queue_depth: int
    sge_max: int
    rd_atomic: int
    signal_every: int
    cq_entries: int


def clamp_limits(options: RdmaOptions, limits: v.DeviceLimits) -> QueueLimits:
    """What this QP asks for: the options, never above the device (ibv_query_device)."""
    depth = min(options.queue_depth, limits.max_qp_wr, limits.max_cqe)
    return QueueLimits(queue_depth=depth, sge_max=min(options.sge_max, limits.max_sge),
                       rd_atomic=max(1, min(options.rd_atomic, limits.max_qp_rd_atom, limits.max_qp_init_rd_atom)),
                       signal_every=min(options.signal_every, depth), cq_entries=depth)


def choose_gid(port: v.PortInfo, gid_index: int) -> v.Gid:
    """The GID to send from: the asked-for index, else RoCE v2 IPv4-mapped, v2 global, v2 link-local, IB."""
    if gid_index >= 0:
        for gid in port.gids:
            if gid.index == gid_index:
                return gid
        raise errors.TransportUnavailable(f"no GID at index {gid_index} on this port")

    def rank(gid: v.Gid) -> tuple[int, int]:
        link_local = gid.raw[:2] == b"\xfe\x80"
        if gid.type == v.GID_ROCE_V2:
            return (0 if gid.ipv4_mapped else 2 if link_local else 1), gid.index
        if gid.type == "":          # InfiniBand: GID 0 is the port GID
            return 3, gid.index
        return 4, gid.index         # RoCE v1: not routable
    if not port.gids:
        raise errors.TransportUnavailable("the port has no GID (no IP address on the RoCE interface?)")
    best = min(port.gids, key=rank)
    if rank(best)[0] == 4:
        raise errors.TransportUnavailable("the port has only RoCE v1 GIDs; set gid_index to use one")
    return best


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


def merged_ranges(segments: Sequence[Segment]) -> list[Segment]:
    """The segments as few disjoint ranges: overlapping or touching ones merged."""
    ranges: list[list[int]] = []
    for address, nbytes in sorted(s for s in segments if s[1] > 0):
        if ranges and address <= ranges[-1][1]:
            ranges[-1][1] = max(ranges[-1][1], address + nbytes)
        else:
            ranges.append([address, address + nbytes])
    return [(start, end - start) for start, end in ranges]


class RegionTable:
    """Registered memory by range: which MR contains (address, nbytes). Not thread-safe (the path's lock)."""

    def __init__(self) -> None:
        self._starts: list[int] = []
        self._regions: list[Any] = []

    def add(self, region: Any) -> None:
        at = bisect.bisect_left(self._starts, region.address)
        self._starts.insert(at, region.address)
        self._regions.insert(at, region)

    def remove(self, region: Any) -> None:
        at = self._regions.index(region)
        del self._starts[at], self._regions[at]

    def find(self, address: int, nbytes: int) -> Any | None:
        """An MR that contains the whole range; regions may overlap, so look back past shorter ones."""
        at = bisect.bisect_right(self._starts, address)
        for region in reversed(self._regions[:at]):
            if address + nbytes <= region.address + region.nbytes:
                return region
        return None

    def __len__(self) -> int:
        return len(self._regions)

    def __iter__(self):
        return iter(list(self._regions))


def default_verbs() -> v.Verbs:
    """The verbs the data plane uses: pyverbs (tests replace this with a model)."""
    return v.PyverbsVerbs()


def load_pyverbs() -> Any:
    """The pyverbs package, from this environment or the system's; TransportUnavailable when absent."""
    try:
        return v.load_pyverbs(SYSTEM_PACKAGE_DIRS)
    except ImportError as exc:
        raise errors.TransportUnavailable(str(exc)) from None


def device_names() -> list[str]:
    try:
        verbs = default_verbs()
        if isinstance(verbs, v.PyverbsVerbs):
            load_pyverbs()
        return verbs.device_names()
    except ImportError as exc:
        raise errors.TransportUnavailable(str(exc)) from None
    except (v.VerbsError, OSError) as exc:  # no RDMA subsystem in this kernel/container
        raise errors.TransportUnavailable(f"no RDMA device on this host: {exc}") from None


def device_present() -> bool:
    try:
        return bool(device_names())
    except errors.TransportUnavailable:
        return False


def open_device(verbs: v.Verbs, name: str, port: int) -> v.Device:
    """The named device, or the first with `port` ACTIVE and a routable GID; TransportUnavailable otherwise."""
    names = [name] if name else verbs.device_names()
    if not names:
        raise errors.TransportUnavailable("no RDMA device on this host")
    reasons = []
    for candidate in names:
        device = verbs.open(candidate)
        try:
            info = device.port(port)
            if not info.active:
                raise errors.TransportUnavailable(f"port {port} of {candidate} is not ACTIVE")
            if not name:
                choose_gid(info, -1)
            return device
        except (errors.TransportUnavailable, v.VerbsError) as exc:
            device.close()
            reasons.append(f"{candidate}: {exc}")
    raise errors.TransportUnavailable("no usable RDMA device: " + "; ".join(reasons))


class _Broken(Exception):
    """A WR failed, or the path's invariants broke: the path must not be used again."""


class RdmaDataPath:
    """Put/get through one-sided RDMA operations on the node's arena."""

    name = "rdma"
    shape = NETWORK_SHAPE

    def __init__(self, control: Any, timeout_s: float = 5.0, options: RdmaOptions | None = None,
                 verbs: v.Verbs | None = None):
        """Connect and probe; every failure (verbs, pyverbs missing, the node's answer) is TransportUnavailable."""
        self.options = options or RdmaOptions()
        self.timeout_s = timeout_s
        self.rdma_qp_num = 0       # the node's queue pair, named in Reserve/Acquire (kept alive, fenced)
        self._control = control
        self._lock = threading.Lock()
        self._broken = ""
        self._next_wr_id = 1
        self._posted_id = 0        # highest wr_id handed to post_send
        self._completed_id = 0     # highest wr_id whose completion was polled
        self._registered = RegionTable()       # whole buffers from register(), held alive
        self._owners: dict[int, tuple[Any, Any]] = {}   # id(region) -> (region, owner)
        self._quarantine: list[Any] = []       # call MRs a broken QP might still use: closed with the QP
        self._device: v.Device | None = None
        self._qp: Any = None
        self._probe_region: Any = None
        try:
            self._open(control, verbs or default_verbs())
        except BaseException as exc:
            self._teardown()
            if isinstance(exc, errors.TransportUnavailable):
                raise
            if isinstance(exc, (v.VerbsError, ImportError, OSError, errors.KVStoreError, _Broken)):
                raise errors.TransportUnavailable(f"RDMA could not be set up: {exc}") from None
            raise

    def _open(self, control: Any, verbs: v.Verbs) -> None:
        options = self.options
        self._device = device = open_device(verbs, options.device, options.port)
        port = device.port(options.port)
        gid = choose_gid(port, options.gid_index)
        self.limits = limits = clamp_limits(options, device.limits)
        self._qp = device.create_queue_pair(limits.queue_depth, limits.sge_max, limits.cq_entries)
        psn = secrets.randbits(24)
        answer = control.call("RdmaConnect", pb.RdmaConnectRequest(queue_pair=pb.RdmaQueuePair(
            lid=port.lid, gid=gid.raw, qp_num=self._qp.qp_num, psn=psn, mtu=port.mtu, gid_type=gid.type)))
        remote = answer.queue_pair
        if remote.gid_type and gid.type and remote.gid_type != gid.type:
            raise errors.TransportUnavailable(f"this client sends from a {gid.type} GID and the node from a "
                                              f"{remote.gid_type} one: choose GIDs of one type (gid_index)")
        route = v.Route(options.port, gid.index, options.hop_limit, options.traffic_class, options.service_level)
        self._qp.connect(v.PeerAddress(remote.lid, bytes(remote.gid), remote.qp_num, remote.psn,
                                       min(remote.mtu, port.mtu) or port.mtu),
                         route, psn, limits.rd_atomic, access_remote=False)
        self.arena_addr, self.rkey, self.arena_bytes = answer.arena_addr, answer.rkey, answer.arena_bytes
        self.peer_qp_num = self.rdma_qp_num = remote.qp_num
        self._probe_buffer = ctypes.create_string_buffer(PROBE_BYTES)
        address = ctypes.addressof(self._probe_buffer)
        self._probe_region = device.register(address, PROBE_BYTES, remote=False)
        try:
            self._transfer(v.OP_READ, [(0, 0, [(address, min(PROBE_BYTES, self.arena_bytes or PROBE_BYTES))])])
        except errors.KVStoreError as exc:
            raise errors.TransportUnavailable(f"RDMA connected but a probe READ of the node's arena failed "
                                              f"(wrong fabric, GID or routing?): {exc}") from None
        log.info("rdma connected device=%s gid_index=%d qp_num=%d peer_qp_num=%d depth=%d sge=%d",
                 device.name, gid.index, self._qp.qp_num, remote.qp_num, limits.queue_depth, limits.sge_max)

    # -- DataPath -------------------------------------------------------------------------

    def put(self, lease_id: int, token: bytes, pages: list[Page], page_bytes: int) -> None:
        self._transfer(v.OP_WRITE, pages)

    def get(self, lease_id: int, token: bytes, pages: list[Page], page_bytes: int) -> None:
        self._transfer(v.OP_READ, pages)

    def alive(self) -> bool:
        """False once a WR failed or a verbs call broke the queue pair: the client then reconnects."""
        return not self._broken

    def close(self) -> None:
        with self._lock:
            self._broken = self._broken or "closed"
            self._teardown()
        if self.rdma_qp_num:  # the node's queue pair goes now, not at idle eviction
            self._control.post("RdmaDisconnect", pb.RdmaDisconnectRequest(qp_num=self.rdma_qp_num))
            self.rdma_qp_num = 0

    # -- registration ---------------------------------------------------------------------

    def register(self, owner: Any, address: int, nbytes: int) -> None:
        """Register [address, address + nbytes) once, for every later call; `owner` is held alive until unregister."""
        with self._lock:
            self._check_usable()
            try:
                region = self._device.register(address, nbytes, remote=False)
            except v.VerbsError as exc:
                raise errors.TransportUnavailable(f"registering {nbytes} bytes failed (RLIMIT_MEMLOCK?): {exc}") \
                    from None
            self._registered.add(region)
            self._owners[id(region)] = (region, owner)

    def unregister(self, address: int) -> None:
        """Deregister the buffer registered at `address` (no call is using it: the lock is held)."""
        with self._lock:
            for region in self._registered:
                if region.address == address:
                    self._registered.remove(region)
                    self._owners.pop(id(region))
                    region.close()
                    return
            raise errors.InvalidArgument(f"no buffer registered at {address:#x}")

    # -- moving pages ---------------------------------------------------------------------

    def _check_usable(self) -> None:
        if self._broken:
            raise errors.Unavailable(f"the RDMA path is broken ({self._broken}); the client reconnects on its next call")

    def _transfer(self, opcode: str, pages: list[Page]) -> None:
        with self._lock:
            self._check_usable()
            plan = plan_work_requests(pages, self.arena_addr, self.limits.sge_max)
            call_regions: list[Any] = []
            drained = True
            try:
                keyed = self._keyed_plan(plan, call_regions)
                drained = False
                self._post_and_poll(opcode, keyed, time.monotonic() + self.timeout_s)
                drained = True
            except (v.VerbsError, _Broken) as exc:
                drained = self._break(str(exc))
                raise errors.Unavailable(f"RDMA {opcode} failed: {exc}") from None
            except errors.DeadlineExceeded as exc:
                drained = self._break(str(exc))
                raise
            finally:
                if drained:
                    for region in call_regions:
                        region.close()
                else:
                    self._quarantine += call_regions

    def _keyed_plan(self, plan: list[tuple[int, list[Segment]]], call_regions: list[Any]) -> list[tuple[int, tuple]]:
        """The plan with an lkey per segment: registered buffers by containment, the rest registered for this call."""
        table = RegionTable()
        missing = [s for _, segments in plan for s in segments if self._registered.find(*s) is None]
        for address, nbytes in merged_ranges(missing):
            region = self._device.register(address, nbytes, remote=False)
            call_regions.append(region)
            table.add(region)
        keyed = []
        for remote, segments in plan:
            sges = []
            for address, nbytes in segments:
                region = self._registered.find(address, nbytes) or table.find(address, nbytes)
                assert region is not None, "a segment outside every registered range"
                sges.append((address, nbytes, region.lkey))
            keyed.append((remote, tuple(sges)))
        return keyed

    def _post_and_poll(self, opcode: str, keyed: list[tuple[int, tuple]], deadline: float) -> None:
        """Post the WRs in chains within the credit window; return once the last one's completion is polled."""
        limits, qp = self.limits, self._qp
        first_id = self._next_wr_id
        last_id = first_id + len(keyed) - 1
        self._next_wr_id = last_id + 1
        retired = first_id - 1       # every WR up to this id has left the send queue
        posted = first_id - 1
        pending: list[int] = []      # signalled wr_ids not yet completed, in order
        idle_polls = 0
        while retired < last_id:
            room = limits.queue_depth - (posted - retired)
            if room > 0 and posted < last_id:
                chain = []
                for wr_id in range(posted + 1, min(last_id, posted + room) + 1):
                    remote, sges = keyed[wr_id - first_id]
                    signaled = wr_id == last_id or (wr_id - first_id + 1) % limits.signal_every == 0 \
                        or wr_id == posted + room   # the window's last: credits come back through it
                    chain.append(v.WorkRequest(wr_id, opcode, sges, remote, self.rkey, signaled))
                    if signaled:
                        pending.append(wr_id)
                self._posted_id = chain[-1].wr_id      # set first: a failed post may have posted some
                qp.post_send(chain)
                posted = chain[-1].wr_id
            completions = qp.poll(16)
            for completion in completions:
                self._completed_id = max(self._completed_id, completion.wr_id)
                if completion.status != v.WC_SUCCESS:
                    raise _Broken(f"work request {completion.wr_id} ended with "
                                  f"{v.WC_NAMES.get(completion.status, completion.status)}")
                if not pending or completion.wr_id != pending[0]:
                    raise _Broken(f"completion of wr_id {completion.wr_id} where {pending[:1]} was due")
                retired = pending.pop(0)
            if completions:
                idle_polls = 0
                continue
            if time.monotonic() > deadline:
                raise errors.DeadlineExceeded(f"RDMA work requests not complete after {self.timeout_s} s")
            idle_polls += 1
            if idle_polls > 64:
                time.sleep(0.0001)
        assert not pending, "signalled work requests left after the last one completed"

    def _break(self, reason: str) -> bool:
        """Mark the path broken, move the QP to ERROR and drain what it flushes; True if nothing is left in flight."""
        self._broken = reason
        log.warning("rdma path broken: %s", reason)
        try:
            self._qp.to_error()
            deadline = time.monotonic() + min(self.timeout_s, 1.0)
            while self._completed_id < self._posted_id and time.monotonic() < deadline:
                completions = self._qp.poll(64)   # after ERROR every WR completes (flushed), signalled or not
                for completion in completions:
                    self._completed_id = max(self._completed_id, completion.wr_id)
                if not completions:
                    time.sleep(0.0001)
            return self._completed_id >= self._posted_id
        except v.VerbsError as exc:
            log.warning("rdma queue pair could not be drained: %s", exc)
        return False

    def _teardown(self) -> None:
        """Destroy the QP first: only then can no WR use a region, so the regions go after it."""
        if self._qp is not None:
            self._qp.close()
            self._qp = None
        for region in self._quarantine:
            region.close()
        self._quarantine = []
        for region in self._registered:
            region.close()
        self._registered = RegionTable()
        self._owners.clear()
        if self._probe_region is not None:
            self._probe_region.close()
            self._probe_region = None
        if self._device is not None:
            self._device.close()
            self._device = None
