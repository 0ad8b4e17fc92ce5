"""The RDMA data plane (client and server transports) driven against the verbs model: completions, errors, registrations, limits, threads, fencing."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from node_parts import ManualClock, make_service
from kvstore.transport.rdma import RdmaServer
from kvstore_client import errors
from kvstore_client.keys import Namespace
from kvstore_client.node_steps import drive, take_on
from kvstore_client.pipeline import PutBatch, get_batch
from kvstore_client.proto import pb
from kvstore_client.rdma_transport import RdmaDataPath, RdmaOptions
from kvstore_client.verbs_model import VerbsModel

PAGE = 4096


class _Done:
    def __init__(self, call):
        try:
            self._value, self._error = call(), None
        except errors.KVStoreError as exc:
            self._value, self._error = None, exc

    def result(self):
        if self._error is not None:
            raise self._error
        return self._value


class ServiceControl:
    """The service called in-process, as a control channel without order (like gRPC)."""

    answers_in_order = False

    def __init__(self, service, owner=None):
        self.service, self.owner = service, owner
        self.sent = []   # (method, request) of every call

    def call(self, name, request, timeout_s=None):
        self.sent.append((name, request))
        return self.service.handle(name, request, self.owner)

    def submit(self, name, request):
        return _Done(lambda: self.call(name, request))

    def post(self, name, request):
        _Done(lambda: self.call(name, request))

    def alive(self):
        return True


class Fabric:
    def __init__(self, model: VerbsModel | None = None, queue_pairs_max: int = 8, arena: str = "32MiB",
                 allowed_peers=("10.0.0.0/8",), ttl_ms: int = 30_000):
        self.model = model or VerbsModel()
        self.clock = ManualClock()
        self.service = make_service([f"dram.arena_bytes={arena}", "dram.slab_bytes=1MiB",
                                     f"leases.write_ttl_ms={ttl_ms}", f"leases.read_ttl_ms={ttl_ms}"], self.clock)
        self.server = RdmaServer("", 1, -1, queue_pairs_max, self.service.store.arena.view,
                                 allowed_peers=allowed_peers, verbs=self.model, clock=self.clock, idle_evict_s=60)
        self.service.rdma = self.server
        self.control = ServiceControl(self.service)
        self.hello = self.service.handle("Hello", pb.HelloRequest())
        self.ns = Namespace(model="rdma-model", page_bytes=PAGE)
        self.ns_id = self.service.handle("OpenNamespace", pb.OpenNamespaceRequest(spec=self.ns.to_proto())).namespace_id

    def client(self, options: RdmaOptions | None = None, timeout_s: float = 5.0) -> RdmaDataPath:
        return RdmaDataPath(self.control, timeout_s=timeout_s, options=options, verbs=self.model)

    def put(self, path, keys, segments, parent=b""):
        conn = self.connection(path)
        return drive(PutBatch(PAGE, parent, keys, segments, True, False).steps(conn, self.ns_id), take_on(conn))

    def get(self, path, keys, segments):
        request = pb.AcquireRequest(namespace_id=self.ns_id, policy=pb.WAIT_COMPLETE)
        conn = self.connection(path)
        return drive(get_batch(request, keys, segments, True)(conn), take_on(conn))

    def connection(self, path):
        """What the SDK's steps are taken on: this control channel, the node's Hello, and the data path under test."""
        return SimpleNamespace(control=self.control, grpc=self.control, data=path, hello=self.hello)

    def close(self):
        self.server.close()
        self.service.store.arena.close()


def pages(count: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (count, PAGE), dtype=np.uint8)


def whole_pages(array: np.ndarray):
    return [[(array[i].ctypes.data, PAGE)] for i in range(len(array))]


def keys(prefix: str, count: int) -> list[bytes]:
    return [f"{prefix}-{i}".encode() for i in range(count)]


import threading

import pytest

from kvstore_client import verbs as v
from kvstore_client.verbs_model import VerbsModel  # noqa: F811


@pytest.fixture
def fabric():
    f = Fabric()
    yield f
    f.close()


def roundtrip(f, path, name, count, seed=0):
    data = pages(count, seed)
    assert f.put(path, keys(name, count), whole_pages(data)) == count
    out = np.zeros_like(data)
    assert f.get(path, keys(name, count), whole_pages(out)) == count
    assert np.array_equal(out, data)


@pytest.mark.parametrize("node_packs", [True, False])
def test_a_put_sends_packed_fields_only_to_a_node_that_reads_them(fabric, node_packs):
    """Limits.pages_packed: a Reserve and an Acquire ask for their answers packed, and a Commit names a run and packs
    its checksums, only where the node's Hello says it reads them (else the node is older, and the pages move all
    the same)."""
    fabric.hello.limits.pages_packed = node_packs
    roundtrip(fabric, fabric.client(), "packs", 300)
    reserves = [r for name, r in fabric.control.sent if name == "Reserve"]
    commits = [r for name, r in fabric.control.sent if name == "Commit"]
    assert reserves and commits
    acquires = [r for name, r in fabric.control.sent if name == "Acquire"]
    assert acquires and all(r.packed_answer == node_packs for r in reserves + commits + acquires)
    assert sum(c.index_count if node_packs else len(c.indices) for c in commits) == 300
    assert all(bool(c.checksums_packed) == node_packs and bool(c.checksums) != node_packs for c in commits)


# -- completions (defect 1), leaks and batching (10) ----------------------------------------

def test_a_thousand_calls_in_a_row_leave_nothing_on_the_send_queue(fabric):
    fabric.model.wrs_per_poll = 1           # a WR runs only when polled: returning early tears pages
    path = fabric.client()
    for i in range(500):
        roundtrip(fabric, path, f"k{i}", 2, seed=i)
    qp = fabric.model.queue_pairs[path._qp.qp_num]
    assert qp.outstanding == 0 and not qp.cq
    assert path.alive()


@pytest.mark.parametrize("count", [129, 410, 1000])
def test_one_call_of_more_pages_than_the_send_queue_holds(fabric, count):
    fabric.model.wrs_per_poll = 3
    path = fabric.client()
    roundtrip(fabric, path, "big", count)
    assert fabric.model.queue_pairs[path._qp.qp_num].outstanding == 0


def test_unsignalled_work_requests_are_the_rule(fabric):
    path = fabric.client()
    before = fabric.model.calls.get("poll", 0)
    roundtrip(fabric, path, "sig", 256)
    # one signalled WR per signal_every, plus each call's last: far fewer completions than WRs
    polls = fabric.model.calls["poll"] - before
    assert polls < 256


# -- memory registration (3) ---------------------------------------------------------------

def test_pages_of_more_than_16_segments_and_over_1024_distinct_segments(fabric):
    path = fabric.client()
    count, parts = 80, 32                  # 80 pages x 32 segments = 2560 distinct segments, 2 WRs per page
    part = PAGE // parts
    backing = np.random.default_rng(5).integers(0, 256, count * parts * part * 2, dtype=np.uint8)
    base = backing.ctypes.data

    def segs(buffer_base):
        # every segment apart from its neighbours (a gap between), so none merge
        return [[(buffer_base + (p * parts + s) * part * 2, part) for s in range(parts)] for p in range(count)]
    assert fabric.put(path, keys("seg", count), segs(base)) == count
    out = np.zeros_like(backing)
    assert fabric.get(path, keys("seg", count), segs(out.ctypes.data)) == count
    mask = np.zeros(len(backing), bool)
    for page in segs(0):
        for address, nbytes in page:
            mask[address:address + nbytes] = True
    assert np.array_equal(out[mask], backing[mask])
    assert len(fabric.model.mrs) == 2       # the arena and the probe buffer: call MRs are gone


def test_a_fresh_buffer_at_a_reused_address_each_call(fabric):
    path = fabric.client()
    buffer = np.zeros((4, PAGE), np.uint8)
    for i in range(20):
        fabric.model.unmapped(buffer.ctypes.data, buffer.nbytes)   # freed; new pages at the same address
        buffer[:] = pages(4, seed=100 + i)
        assert fabric.put(path, keys(f"fresh{i}", 4), whole_pages(buffer)) == 4
        expected = buffer.copy()
        fabric.model.unmapped(buffer.ctypes.data, buffer.nbytes)
        buffer[:] = 0
        assert fabric.get(path, keys(f"fresh{i}", 4), whole_pages(buffer)) == 4
        assert np.array_equal(buffer, expected)


def test_a_registered_buffer_is_found_by_range_and_registered_once(fabric):
    path = fabric.client()
    pool = pages(64, 9)
    path.register(pool, pool.ctypes.data, pool.nbytes)
    before = fabric.model.calls["register"]
    for i in range(8):
        chunk = pool[i * 8:(i + 1) * 8]
        segments = [[(row.ctypes.data, PAGE // 2), (row.ctypes.data + PAGE // 2, PAGE // 2)] for row in chunk]
        assert fabric.put(path, keys(f"pool{i}", 8), segments) == 8
    assert fabric.model.calls["register"] == before
    path.unregister(pool.ctypes.data)
    with pytest.raises(errors.InvalidArgument):
        path.unregister(pool.ctypes.data)


def test_merged_ranges_and_region_lookup_by_containment():
    from kvstore_client.rdma_transport import RegionTable, merged_ranges

    assert merged_ranges([(100, 10), (110, 5), (50, 10), (105, 2)]) == [(50, 10), (100, 15)]

    class R:
        def __init__(self, address, nbytes):
            self.address, self.nbytes = address, nbytes
    table = RegionTable()
    big, small = R(0, 1000), R(100, 10)
    table.add(big)
    table.add(small)
    assert table.find(105, 5) in (big, small)
    assert table.find(105, 50) is big       # past the small one: found in the one that contains it
    assert table.find(990, 20) is None


# -- errors (2) ----------------------------------------------------------------------------

def test_a_queue_pair_error_mid_batch_breaks_the_path_and_commits_nothing(fabric):
    path = fabric.client()
    fabric.model.fail_after(7)
    data = pages(40, 3)
    with pytest.raises(errors.Unavailable, match="remote access error"):
        fabric.put(path, keys("err", 40), whole_pages(data))
    assert not path.alive()
    qp = fabric.model.queue_pairs[path._qp.qp_num]
    assert qp.state == "ERR" and not qp.queued and not qp.cq      # flushed completions drained
    assert len(fabric.model.mrs) == 2                              # call MRs released after the drain
    with pytest.raises(errors.Unavailable, match="broken"):
        fabric.put(path, keys("err", 1), whole_pages(data[:1]))
    lookup = fabric.service.handle("Lookup", pb.LookupRequest(namespace_id=fabric.ns_id, keys=keys("err", 40)))
    assert lookup.hit_pages == 0
    path.close()
    fresh = fabric.client()                                        # the client's reconnect
    roundtrip(fabric, fresh, "err", 40, seed=3)


def test_a_local_verbs_failure_is_a_typed_error_never_raw(fabric):
    path = fabric.client()
    fabric.model.fail_call("post_send")
    with pytest.raises(errors.Unavailable):
        fabric.put(path, keys("raw", 2), whole_pages(pages(2, 1)))
    assert not path.alive()


def test_polling_stops_at_the_deadline(fabric):
    path = fabric.client(timeout_s=0.2)
    fabric.model.wrs_per_poll = 0            # the NIC stops completing
    with pytest.raises(errors.DeadlineExceeded):
        fabric.put(path, keys("slow", 2), whole_pages(pages(2, 1)))
    assert not path.alive()


def test_a_completion_with_an_unexpected_wr_id_breaks_the_path(fabric):
    path = fabric.client()
    qp = fabric.model.queue_pairs[path._qp.qp_num]
    qp.cq.append((v.Completion(999_999, v.WC_SUCCESS), 0))         # a stale completion
    with pytest.raises(errors.Unavailable, match="wr_id"):
        fabric.put(path, keys("stale", 2), whole_pages(pages(2, 1)))


# -- threads (9) ---------------------------------------------------------------------------

def test_two_threads_on_one_path_never_take_each_others_completions(fabric):
    fabric.model.yield_in_poll = True
    fabric.model.wrs_per_poll = 1
    path = fabric.client()
    failures = []

    def work(name):
        try:
            for i in range(40):
                roundtrip(fabric, path, f"{name}{i}", 3, seed=hash(name) % 1000 + i)
        except Exception as exc:  # reported below
            failures.append(exc)
    threads = [threading.Thread(target=work, args=(n,)) for n in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures and path.alive()


# -- device limits (5), RoCE v2 addressing (4) -----------------------------------------------

def test_limits_are_clamped_to_the_device():
    model = VerbsModel(limits=v.DeviceLimits(max_qp_wr=64, max_sge=4, max_qp_rd_atom=2, max_qp_init_rd_atom=2,
                                             max_cqe=64))
    f = Fabric(model)
    try:
        path = f.client()
        assert (path.limits.queue_depth, path.limits.sge_max, path.limits.rd_atomic) == (64, 4, 2)
        f.model.wrs_per_poll = 2
        count = 100
        data = pages(count, 8)
        segments = [[(row.ctypes.data + s * 512, 512) for s in range(8)] for row in data]   # 8 SGEs > max_sge 4
        assert f.put(path, keys("lim", count), segments) == count
        out = np.zeros_like(data)
        assert f.get(path, keys("lim", count), whole_pages(out)) == count
        assert np.array_equal(out, data)
    finally:
        f.close()


def test_a_roce_v2_gid_is_chosen_and_routed_past_routers():
    f = Fabric(VerbsModel(routers=3))
    try:
        path = f.client()
        gid = f.model.queue_pairs[path._qp.qp_num].device.gid(path._qp.route.gid_index)
        assert gid.type == v.GID_ROCE_V2 and gid.ipv4_mapped
        roundtrip(f, path, "routed", 4)
    finally:
        f.close()


def test_addressing_that_cannot_reach_the_node_fails_the_probe_not_a_put():
    f = Fabric(VerbsModel(routers=3), allowed_peers=("10.0.0.0/8", "fe80::/10"))
    try:
        from kvstore_client.rdma_transport import RdmaOptions
        with pytest.raises(errors.TransportUnavailable, match="GIDs of one type"):
            f.client(RdmaOptions(gid_index=0))       # RoCE v1 against the node's v2: refused at connect
        with pytest.raises(errors.TransportUnavailable, match="probe"):
            f.client(RdmaOptions(hop_limit=1))       # dropped by the first router
        assert f.server.queue_pairs() == 1           # (the node keeps it until its session ends)
    finally:
        f.close()


def test_choose_gid_prefers_roce_v2_ipv4_mapped_and_refuses_v1_only():
    from kvstore_client.rdma_transport import choose_gid

    ll = b"\xfe\x80" + bytes(14)
    mapped = bytes(10) + b"\xff\xff" + bytes([10, 0, 0, 1])
    port = v.PortInfo(True, 0, 5, (v.Gid(0, ll, v.GID_ROCE_V1), v.Gid(1, ll, v.GID_ROCE_V2),
                                   v.Gid(2, mapped, v.GID_ROCE_V1), v.Gid(3, mapped, v.GID_ROCE_V2)))
    assert choose_gid(port, -1).index == 3
    assert choose_gid(port, 1).index == 1
    with pytest.raises(errors.TransportUnavailable):
        choose_gid(v.PortInfo(True, 0, 5, (v.Gid(0, ll, v.GID_ROCE_V1),)), -1)


def test_a_port_that_is_down_is_not_used():
    model = VerbsModel()
    model.ports_active = False
    with pytest.raises(errors.TransportUnavailable, match="not ACTIVE"):
        Fabric(model)


# -- server queue pairs (7) and trust (8) ----------------------------------------------------

def test_queue_pairs_max_one_with_two_clients():
    f = Fabric(queue_pairs_max=1)
    try:
        a = f.client()
        with pytest.raises(errors.TransportUnavailable, match="in use"):
            f.client()                       # refused, not evicting a busy client
        roundtrip(f, a, "a", 4)
        f.clock.advance(61)                  # a idle past idle_evict_s
        b = f.client()
        roundtrip(f, b, "b", 4)
        with pytest.raises(errors.Unavailable):
            f.put(a, keys("a2", 2), whole_pages(pages(2, 1)))   # a's QP is gone: a reconnects
        assert not a.alive() and f.server.queue_pairs() == 1
    finally:
        f.close()


def test_a_failed_connect_leaks_no_queue_pair(fabric):
    fabric.model.fail_call("connect")       # the first connect is the server's responder
    with pytest.raises(errors.TransportUnavailable):
        fabric.client()
    assert fabric.server.queue_pairs() == 0
    assert all(qp.device is not fabric.server._device for qp in fabric.model.queue_pairs.values())


def test_peers_outside_allowed_peers_are_refused():
    f = Fabric(allowed_peers=("192.168.0.0/16",))
    try:
        with pytest.raises(errors.TransportUnavailable, match="allowed_peers"):
            f.client()
        assert f.server.queue_pairs() == 0
    finally:
        f.close()


def test_an_expired_leases_late_write_is_refused():
    f = Fabric(ttl_ms=1000)
    try:
        path = f.client()
        reserved = f.service.handle("Reserve", pb.ReserveRequest(namespace_id=f.ns_id, keys=keys("late", 1),
                                                                 page_bytes=PAGE))
        offset = reserved.offsets[0]
        f.clock.advance(2)
        assert f.service.reap_expired() == 1
        f.server.fence(path.peer_qp_num)         # what the node does when a write lease of this client expires
        arena = np.frombuffer(f.service.store.arena.view, np.uint8)
        before = arena[offset:offset + PAGE].copy()
        with pytest.raises(errors.Unavailable):
            path.put(reserved.lease_id, reserved.data_token, [(0, offset, [(pages(1, 4).ctypes.data, PAGE)])], PAGE)
        assert np.array_equal(arena[offset:offset + PAGE], before)
    finally:
        f.close()


def test_disconnect_closes_the_responder_queue_pair(fabric):
    path = fabric.client()
    fabric.server.disconnect(path.peer_qp_num)
    assert fabric.server.queue_pairs() == 0
    with pytest.raises(errors.Unavailable):
        fabric.put(path, keys("gone", 1), whole_pages(pages(1, 1)))


def test_rdma_settings_are_checked_by_name():
    from kvstore import config

    for override, name in [("rdma.allowed_peers=10.0.0.0/8,not-an-address", "rdma.allowed_peers"),
                           ("rdma.hop_limit=0", "rdma.hop_limit"), ("rdma.service_level=16", "rdma.service_level")]:
        with pytest.raises(config.ConfigError, match=name):
            config.load(environ={}, overrides=[override])
    assert config.load(environ={}, overrides=[]).rdma.allowed_peers == ()     # no peer until named


def test_a_session_is_fenced_touched_and_disconnected_as_a_whole(fabric):
    # (the service does not pass the session to accept() yet: the test hands it over)
    owner, accept = object(), fabric.server.accept
    fabric.server.accept = lambda remote, _=None: accept(remote, owner)
    a, b = fabric.client(), fabric.client()
    fabric.server.accept = accept
    other = fabric.client()
    fabric.clock.advance(30)
    fabric.server.touch_owner(owner)
    assert {p.last_used for p in fabric.server._peers.values() if p.owner is owner} == {fabric.clock.now}
    fabric.server.fence_owner(owner)
    for path in (a, b):
        with pytest.raises(errors.Unavailable):
            fabric.put(path, keys(f"f{id(path)}", 1), whole_pages(pages(1, 1)))
    roundtrip(fabric, other, "unfenced", 2)
    fabric.server.disconnect_owner(owner)
    assert fabric.server.queue_pairs() == 1


def test_a_node_that_cannot_register_its_arena_says_why():
    model = VerbsModel()
    model.fail_call("register", 12)
    with pytest.raises(errors.TransportUnavailable, match="RLIMIT_MEMLOCK"):
        Fabric(model)
