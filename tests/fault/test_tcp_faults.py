"""Bad frames and bad peers on the TCP data plane of a real server: clear errors, bounded memory, nothing torn."""

import os
import signal
import socket
import time

import numpy as np
import pytest
import xxhash

from kvstore_client import KVStoreClient, Namespace, errors
from kvstore_client import tcp_framing as tf
from kvstore_client.channel import GrpcChannel
from kvstore_client.keys import namespace_id
from kvstore_client.proto import pb
from kvstore_client.tcp_framing import Op

PAGE = 64 << 10
NS = Namespace(model="tcp-faults", page_bytes=PAGE)


class Peer:
    """A hand-driven data-plane connection, to send what no well-behaved client sends."""

    def __init__(self, endpoint: str, rcvbuf: int = 0):
        host, _, port = endpoint.rpartition(":")
        self.sock = socket.socket()
        if rcvbuf:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        self.sock.settimeout(10)
        self.sock.connect((host, int(port)))

    def send(self, op, lease_id, token, slot, length, body=b""):
        self.sock.sendall(tf.encode_request(op, lease_id, token, slot, length) + body)

    def recv_exact(self, n):
        data = b""
        while len(data) < n:
            chunk = self.sock.recv(n - len(data))
            if not chunk:
                raise ConnectionError("closed")
            data += chunk
        return data

    def answer(self):
        status, op, length, _ = tf.decode_response(self.recv_exact(tf.RESPONSE.size))
        return status, op, self.recv_exact(length)


@pytest.fixture
def control(server):
    channel = GrpcChannel(server.address, 10)
    hello = channel.call("Hello", pb.HelloRequest())
    channel.call("OpenNamespace", pb.OpenNamespaceRequest(spec=NS.to_proto()))
    channel.endpoint = hello.tcp_endpoint
    yield channel
    channel.close()


def reserve(control, keys, ttl_ms=0):
    return control.call("Reserve", pb.ReserveRequest(namespace_id=namespace_id(NS), keys=keys, page_bytes=PAGE,
                                                     lease_ttl_ms=ttl_ms))


def stats(control):
    return control.call("Stats", pb.StatsRequest())


def wait_until(predicate, timeout_s=15.0):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)


def wait_until_writing(control, reserved, slot):
    """Until the server is receiving into the slot: a zero-length probe is then answered SLOT_BUSY."""
    probe = Peer(control.endpoint)
    try:
        def busy():
            probe.send(Op.PUT, reserved.lease_id, reserved.data_token, slot, 0)
            return probe.answer()[0] == pb.SLOT_BUSY
        wait_until(busy)
    finally:
        probe.sock.close()


def test_wrong_token_unknown_lease_and_expired_lease_are_refused_and_the_connection_goes_on(control):
    r = reserve(control, [b"a0"])
    short = reserve(control, [b"e0"], ttl_ms=100)
    peer = Peer(control.endpoint)
    peer.send(Op.PUT, r.lease_id, bytes(16), 0, PAGE, b"\x01" * PAGE)
    assert peer.answer()[:2] == (pb.TOKEN_MISMATCH, Op.PUT)
    peer.send(Op.GET, 0xDEAD, r.data_token, 0, PAGE)
    status, _, text = peer.answer()
    assert status == pb.LEASE_NOT_FOUND and b"unknown" in text
    time.sleep(0.2)
    peer.send(Op.PUT, short.lease_id, short.data_token, 0, PAGE, b"\x02" * PAGE)
    assert peer.answer()[0] == pb.LEASE_NOT_FOUND
    peer.send(Op.PUT, r.lease_id, r.data_token, 0, PAGE, b"\x03" * PAGE)  # the stream is still in step
    assert peer.answer() == (0, Op.PUT, b"")
    assert list(control.call("Commit", pb.CommitRequest(lease_id=r.lease_id)).states) == [pb.COMMITTED]


def test_frames_for_slots_outside_the_lease_are_refused(control):
    a = reserve(control, [b"s0", b"s1"])
    b = reserve(control, [b"t0"])
    peer = Peer(control.endpoint)
    peer.send(Op.PUT, a.lease_id, a.data_token, 2, PAGE, b"x" * PAGE)            # no such slot
    assert peer.answer()[0] == pb.SLOT_NOT_IN_LEASE
    peer.send(Op.PUT, b.lease_id, a.data_token, 0, PAGE, b"x" * PAGE)            # another lease's slot
    assert peer.answer()[0] == pb.TOKEN_MISMATCH
    peer.send(Op.GET, a.lease_id, a.data_token, 0, PAGE)                         # reading a write lease
    assert peer.answer()[0] == pb.SLOT_NOT_IN_LEASE
    peer.send(Op.PUT, a.lease_id, a.data_token, 0, PAGE, b"y" * PAGE)
    assert peer.answer()[0] == 0
    control.call("Commit", pb.CommitRequest(lease_id=a.lease_id, indices=[0]))
    peer.send(Op.PUT, a.lease_id, a.data_token, 0, PAGE, b"z" * PAGE)            # committed: no longer writable
    assert peer.answer()[0] == pb.SLOT_NOT_IN_LEASE
    acquired = control.call("Acquire", pb.AcquireRequest(namespace_id=namespace_id(NS), keys=[b"s0"]))
    peer.send(Op.GET, acquired.lease_id, acquired.data_token, 0, PAGE)
    assert peer.answer() == (0, Op.GET, b"y" * PAGE)                             # the refused write changed nothing
    peer.send(Op.GET, acquired.lease_id, acquired.data_token, 1, PAGE)
    assert peer.answer()[0] == pb.SLOT_NOT_IN_LEASE


def test_a_length_that_does_not_match_is_refused_and_its_body_skipped(control):
    r = reserve(control, [b"l0"])
    peer = Peer(control.endpoint)
    peer.send(Op.PUT, r.lease_id, r.data_token, 0, PAGE // 2, b"q" * (PAGE // 2))
    status, _, text = peer.answer()
    assert status == pb.LENGTH_MISMATCH and b"whole pages" in text
    peer.send(Op.PUT, r.lease_id, r.data_token, 0, PAGE, b"w" * PAGE)
    assert peer.answer()[0] == 0


def test_pipelined_frames_are_answered_in_order_when_put_answers_go_out_together(control):
    """PUT answers are gathered over a loop pass; a refusal or a GET answer among them keeps its place."""
    r = reserve(control, [b"o0", b"o1", b"o2", b"o3"])
    g = reserve(control, [b"g0"])
    peer = Peer(control.endpoint)
    peer.send(Op.PUT, g.lease_id, g.data_token, 0, PAGE, b"\x09" * PAGE)
    assert peer.answer() == (0, Op.PUT, b"")
    control.call("Commit", pb.CommitRequest(lease_id=g.lease_id))
    acquired = control.call("Acquire", pb.AcquireRequest(namespace_id=namespace_id(NS), keys=[b"g0"]))
    frames = [tf.encode_request(Op.PUT, r.lease_id, r.data_token, 0, PAGE) + b"\x01" * PAGE,
              tf.encode_request(Op.PUT, r.lease_id, r.data_token, 1, PAGE) + b"\x02" * PAGE,
              tf.encode_request(Op.PUT, r.lease_id, bytes(16), 2, PAGE) + b"\x03" * PAGE,     # refused
              tf.encode_request(Op.GET, acquired.lease_id, acquired.data_token, 0, PAGE),
              tf.encode_request(Op.PUT, r.lease_id, r.data_token, 2, PAGE) + b"\x04" * PAGE,
              tf.encode_request(Op.PUT, r.lease_id, r.data_token, 3, PAGE) + b"\x05" * PAGE]
    peer.sock.sendall(b"".join(frames))              # one stream: the node reads them back to back
    answers = [peer.answer() for _ in frames]
    assert [(status, op) for status, op, _ in answers] == [
        (0, Op.PUT), (0, Op.PUT), (pb.TOKEN_MISMATCH, Op.PUT), (0, Op.GET), (0, Op.PUT), (0, Op.PUT)]
    assert answers[3][2] == b"\x09" * PAGE
    committed = control.call("Commit", pb.CommitRequest(lease_id=r.lease_id))
    assert list(committed.states) == [pb.COMMITTED] * 4
    assert list(committed.checksums) == [xxhash.xxh3_64_intdigest(bytes([i]) * PAGE) for i in (1, 2, 4, 5)]


def test_a_length_over_the_largest_page_closes_the_connection(server, control):
    peer = Peer(control.endpoint)
    peer.send(Op.PUT, 1, bytes(16), 0, 1 << 30)
    status, op, text = peer.answer()
    assert status == pb.MALFORMED_REQUEST and b"exceeds the largest page" in text
    assert peer.sock.recv(1) == b""
    assert "unreadable frame" in server.log()


def test_a_connection_dropped_mid_page_never_exposes_the_page_and_frees_the_lease(control):
    r = reserve(control, [b"d0", b"d1"])
    peer = Peer(control.endpoint)
    peer.send(Op.PUT, r.lease_id, r.data_token, 0, PAGE, b"\x07" * PAGE)  # one whole page
    assert peer.answer()[0] == 0
    peer.send(Op.PUT, r.lease_id, r.data_token, 1, PAGE, b"\x07" * (PAGE // 2))  # half of the next
    wait_until_writing(control, r, 1)
    with pytest.raises(errors.SlotBusy):
        control.call("Commit", pb.CommitRequest(lease_id=r.lease_id))
    peer.sock.close()
    wait_until(lambda: stats(control).leases_open == 0)
    assert stats(control).tiers[0].used_bytes == 0
    with pytest.raises(errors.LeaseNotFound):
        control.call("Commit", pb.CommitRequest(lease_id=r.lease_id))
    assert control.call("Lookup", pb.LookupRequest(namespace_id=namespace_id(NS), keys=[b"d0"])).hit_pages == 0


def test_a_slot_is_committed_only_after_its_body_is_in(control):
    r = reserve(control, [b"b0"])
    peer = Peer(control.endpoint)
    peer.send(Op.PUT, r.lease_id, r.data_token, 0, PAGE, b"\x09" * (PAGE - 1))
    wait_until_writing(control, r, 0)
    with pytest.raises(errors.SlotBusy):
        control.call("Commit", pb.CommitRequest(lease_id=r.lease_id))
    peer.sock.sendall(b"\x09")
    assert peer.answer()[0] == 0
    assert list(control.call("Commit", pb.CommitRequest(lease_id=r.lease_id)).states) == [pb.COMMITTED]


def rss_anon_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no RssAnon")


def test_a_client_that_stops_reading_holds_bounded_memory_and_slows_no_one(start_server):
    server = start_server({"dram.arena_bytes": "256MiB", "dram.slab_bytes": "16MiB"})
    page = 1 << 20
    ns = Namespace(model="slow", page_bytes=page)
    data = np.random.default_rng(5).integers(0, 256, (32, page), dtype=np.uint8)
    with KVStoreClient(server.address, transport="tcp", timeout_s=30) as writer:
        assert writer.put(ns, [f"p{i}" for i in range(32)], data) == 32
        control = writer._grpc
        acquired = control.call("Acquire", pb.AcquireRequest(
            namespace_id=namespace_id(ns), keys=[f"p{i}".encode() for i in range(32)], lease_ttl_ms=8000))
        baseline = rss_anon_bytes(server.process.pid)
        slow = Peer(control.call("Hello", pb.HelloRequest()).tcp_endpoint, rcvbuf=64 << 10)
        requested = 1000  # 1000 MiB of answers asked for, none read
        slow.sock.sendall(b"".join(tf.encode_request(Op.GET, acquired.lease_id, acquired.data_token, i % 32, page)
                                   for i in range(requested)))
        time.sleep(0.5)
        # Another client is served in full while the slow one is stalled.
        other_keys = [f"o{i}" for i in range(16)]
        with KVStoreClient(server.address, transport="tcp", timeout_s=30) as other:
            assert other.put(ns, other_keys, data[:16]) == 16
            out = np.zeros((16, page), np.uint8)
            assert other.get(ns, other_keys, out, verify=True) == 16
            assert np.array_equal(out, data[:16])
        assert "still moving a page when its lease expired" not in server.log()  # the slow one is still stalled
        grown = rss_anon_bytes(server.process.pid) - baseline
        assert grown < 48 << 20, f"server anonymous memory grew {grown >> 20} MiB for a reader that stopped"
        # At its lease's deadline the stalled connection is closed and its pins let go.
        wait_until(lambda: "still moving a page when its lease expired" in server.log(), timeout_s=30)
        wait_until(lambda: writer.stats().leases_open == 0)
        received = 0
        try:
            while chunk := slow.sock.recv(1 << 20):
                received += len(chunk)
        except ConnectionResetError:
            pass
        assert received < requested * page


def test_put_and_get_across_a_network_namespace(start_server):
    """A client in its own network namespace reaches the node over a veth pair, as another host would."""
    import subprocess
    import sys

    from netns import veth_namespace

    with veth_namespace() as ns:
        # A veth address is not loopback: the node serves it without tokens only when told to.
        server = start_server({"server.grpc_address": f"{ns.host_ip}:0", "auth.allow_unauthenticated_remote": "true"})
        script = (
            "import sys, numpy as np\n"
            "from kvstore_client import KVStoreClient, Namespace\n"
            "ns = Namespace(model='netns', page_bytes=1 << 20)\n"
            "data = np.random.default_rng(1).integers(0, 256, (12, 1 << 20), dtype=np.uint8)\n"
            "with KVStoreClient(sys.argv[1], transport='tcp', timeout_s=30) as c:\n"
            "    keys = [f'n{i}' for i in range(12)]\n"
            "    assert c.put(ns, keys, data, verify=True) == 12\n"
            "    out = np.zeros_like(data)\n"
            "    assert c.get(ns, keys, out, verify=True) == 12 and np.array_equal(out, data)\n"
            "    print('peer-ok', c.transport, flush=True)\n")
        result = subprocess.run([*ns.exec_prefix, sys.executable, "-c", script, server.address],
                                capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stderr
        assert result.stdout.strip() == "peer-ok tcp"
        assert server.address.startswith(ns.host_ip)


def _stopped(pid: int) -> None:
    """SIGSTOP the node and wait until the kernel says it is stopped (the signal is delivered asynchronously)."""
    os.kill(pid, signal.SIGSTOP)
    while open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "T":
        time.sleep(0.01)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("verb", ["get", "put"])
def test_a_calls_timeout_s_bounds_its_pages_on_the_tcp_data_plane(start_server, monkeypatch, verb):
    """The node stops (SIGSTOP) after it granted the slots and before their bytes move: the call fails with
    DeadlineExceeded after its own timeout_s, not the client's 60 s per step; the next call reconnects."""
    from kvstore_client.tcp_transport import TcpDataPath

    server = start_server()
    data = np.random.default_rng(2).integers(0, 256, (4, PAGE), dtype=np.uint8)
    original = getattr(TcpDataPath, verb)

    def stop_then_move(self, *args):
        _stopped(server.process.pid)
        return original(self, *args)

    with KVStoreClient(server.address, transport="tcp", timeout_s=60) as client:
        assert client.put(NS, ["d0", "d1"], data[:2]) == 2
        monkeypatch.setattr(TcpDataPath, verb, stop_then_move)
        started = time.monotonic()
        try:
            with pytest.raises(errors.DeadlineExceeded, match="timeout_s"):
                if verb == "get":
                    client.get(NS, ["d0", "d1"], np.zeros((2, PAGE), np.uint8), timeout_s=1)
                else:
                    client.put(NS, ["d2"], data[2:3], parent="d1", timeout_s=1)
            elapsed = time.monotonic() - started
        finally:
            os.kill(server.process.pid, signal.SIGCONT)
        assert elapsed < 10
        monkeypatch.setattr(TcpDataPath, verb, original)
        out = np.zeros((2, PAGE), np.uint8)
        assert client.get(NS, ["d0", "d1"], out, timeout_s=30) == 2 and np.array_equal(out, data[:2])
        assert client.put(NS, ["d3"], data[3:], parent="d1", timeout_s=30) == 1
