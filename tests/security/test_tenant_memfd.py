"""Each tenant's DRAM is a memfd of its own: a local client of one tenant, mapping the fd it is handed,
finds no byte of another tenant's pages, even in a slab that moved between them; both tenants move
pages over shared memory; a page changed through a mapping is refused by get and dropped by the node;
a memfd can be neither shrunk nor grown; and what a client mapped shows nothing once its token is
revoked."""

from __future__ import annotations

import concurrent.futures
import json
import mmap
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import numpy as np
import pytest

from identities import Tokens, token_line
from raw_socket import recv_exact
from kvstore.control.identity import token_digest
from kvstore_client import KVStoreClient, Namespace, errors
from kvstore_client.channel import LocalChannel
from kvstore_client.proto import pb
from kvstore_client.tcp_framing import RESPONSE, VOUCHED, Op, decode_response, encode_hello, encode_request

PAGE = 64 << 10
SLAB = 256 << 10            # four pages a slab
NS = Namespace(model="memfd-model", page_bytes=PAGE, page_tokens=16)
NOBODY = 65534

# Run as another uid (bob's): put, delete, or map its own memfd and look for markers.
TENANT_CLIENT = r'''
import json, mmap, os, socket, sys
import numpy as np
from kvstore_client import KVStoreClient, Namespace
from kvstore_client.channel import LocalChannel
from kvstore_client.proto import pb
address, token, command, arg = sys.argv[1:5]
# The node learns a local peer's uid from its effective uid at connect() (SO_PEERCRED): bob's is nobody's.
# Only the connect runs as nobody, as the interpreter lives where only root reads.
_connect = socket.socket.connect
def connect_as_nobody(sock, target):
    if sock.family != socket.AF_UNIX:
        return _connect(sock, target)
    os.seteuid(65534)
    try:
        return _connect(sock, target)
    finally:
        os.seteuid(0)
socket.socket.connect = connect_as_nobody
ns = Namespace(model="memfd-model", page_bytes=64 << 10, page_tokens=16)
with KVStoreClient(address, token=token) as client:
    answer = {"transport": client.transport}
    if command == "put":
        seed, count = map(int, arg.split(":"))
        data = np.random.default_rng(seed).integers(0, 256, (count, 64 << 10), dtype=np.uint8)
        answer["stored"] = client.put(ns, [f"b{i}" for i in range(count)], data)
    elif command == "delete":
        answer["deleted"] = client.delete(ns, ["b0"])
    else:
        hello = client._conn.hello
        local = LocalChannel(hello.shm_socket, 5.0, token)
        fd = local.map_arena_fd()
        size = os.fstat(fd).st_size
        answer["allocated_bytes"] = os.fstat(fd).st_blocks * 512
        view = mmap.mmap(fd, size, prot=mmap.PROT_READ)
        answer["found"] = [bytes(view).find(bytes.fromhex(m)) >= 0 for m in arg.split(",")]
        view.close(); os.close(fd); local.close()
print(json.dumps(answer))
'''


def pages(n, seed):
    return np.random.default_rng(seed).integers(0, 256, (n, PAGE), dtype=np.uint8)


def markers(data) -> list[bytes]:
    return [bytes(page[:64]) for page in data]


@pytest.fixture
def socket_dir():
    """The local socket where another uid can reach it (pytest's temp dir is root's alone)."""
    directory = tempfile.mkdtemp(prefix="kvstore-memfd-")
    os.chmod(directory, 0o755)
    yield directory
    for name in os.listdir(directory):
        os.unlink(os.path.join(directory, name))
    os.rmdir(directory)


@pytest.fixture
def two_tenants(start_server, tmp_path, socket_dir):
    return start_two_tenants(start_server, tmp_path, socket_dir)


def start_two_tenants(start_server, tmp_path, socket_dir, **settings: str):
    """A node telling alice (uid 0) and bob (nobody) apart, two slabs of DRAM; `settings`: more of its settings."""
    if os.getuid() != 0:
        pytest.skip("runs bob's client as another uid, which needs root")   # the project's test machines are root
    tokens = Tokens(tmp_path)
    node = start_server({"auth.tokens_file": str(tokens.path), "auth.local_uids": f"0:alice,{NOBODY}:bob",
                         "dram.arena_bytes": str(2 * SLAB), "dram.slab_bytes": str(SLAB),
                         "shm.socket_path": os.path.join(socket_dir, "kvstore.sock"), **settings})
    return node, tokens


def as_bob(node, tokens, command: str, arg: str = "") -> dict:
    done = subprocess.run([sys.executable, "-c", TENANT_CLIENT, node.address, tokens.bob, command, arg],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def scan_own_memfd(node, token: str, wanted: list[bytes]) -> tuple[list[bool], int]:
    """Map the memfd this tenant's local connection is handed, whole; which markers it holds, and its bytes."""
    with KVStoreClient(node.address, token=token) as client:
        local = LocalChannel(client._conn.hello.shm_socket, 5.0, token)
    fd = local.map_arena_fd()
    try:
        view = mmap.mmap(fd, os.fstat(fd).st_size, prot=mmap.PROT_READ)
        try:
            content = bytes(view)
        finally:
            view.close()
        return [content.find(m) >= 0 for m in wanted], os.fstat(fd).st_blocks * 512
    finally:
        os.close(fd)
        local.close()


def test_a_tenants_fd_exposes_no_byte_of_another_tenant_even_after_a_slab_moves(two_tenants):
    node, tokens = two_tenants
    bob_data, alice_data = pages(2, seed=11), pages(5, seed=12)
    put = as_bob(node, tokens, "put", "11:2")
    assert put == {"transport": "shm", "stored": 2}            # bob, authenticated, on shared memory
    with KVStoreClient(node.address, token=tokens.alice) as alice:
        assert alice.transport == "shm"                         # and alice too
        assert alice.put(NS, [f"a{i}" for i in range(4)], alice_data[:4]) == 4   # her slab, full
    found, _ = scan_own_memfd(node, tokens.alice, markers(bob_data) + markers(alice_data[:4]))
    assert found == [False] * 2 + [True] * 4
    scan = as_bob(node, tokens, "scan", ",".join(m.hex() for m in markers(alice_data[:4]) + markers(bob_data)))
    assert scan["found"] == [False] * 4 + [True] * 2

    # Bob's pages go; his slab is free, and alice's fifth page can only go there: the slab moves to her.
    assert as_bob(node, tokens, "delete")["deleted"] == 2
    with KVStoreClient(node.address, token=tokens.alice) as alice:
        assert alice.put(NS, ["a4"], alice_data[4:], parent="a3") == 1
        out = np.zeros_like(alice_data)
        assert alice.get(NS, [f"a{i}" for i in range(5)], out) == 5 and np.array_equal(out, alice_data)
    found, alice_bytes = scan_own_memfd(node, tokens.alice, markers(bob_data) + markers(alice_data))
    assert found == [False] * 2 + [True] * 5
    assert alice_bytes <= 2 * SLAB
    scan = as_bob(node, tokens, "scan", ",".join(m.hex() for m in markers(alice_data) + markers(bob_data)))
    # Bob's copy of the moved slab was punched out: neither alice's bytes nor his own old ones, no memory.
    assert scan["found"] == [False] * 7 and scan["allocated_bytes"] == 0


def changed_page_is_refused(node_address: str, token: str | None, key_prefix: str, reader: str = "shm") -> None:
    """A client changes a committed page through its own shared mapping; a get over `reader` refuses it."""
    data = pages(3, seed=21)
    keys = [f"{key_prefix}{i}" for i in range(3)]
    with KVStoreClient(node_address, token=token) as client:
        assert client.transport == "shm"
        assert client.put(NS, keys, data) == 3
        # Find the second page's slot, then change one byte of it through this client's own mapping.
        acquired = client._conn.control.call("Acquire", pb.AcquireRequest(
            namespace_id=client._namespace_id(NS), keys=[k.encode() for k in keys]))
        client._conn.control.call("Release", pb.ReleaseRequest(lease_ids=[acquired.lease_id]))
        arena = client._conn.data.arena
        arena.view[acquired.offsets[1] + 100] ^= 0xFF
        out = np.zeros_like(data)
        with KVStoreClient(node_address, token=token, transport=reader) as reading:
            assert reading.transport == reader
            with pytest.raises(errors.ChecksumMismatch, match=r"pages \[1\] .* changed them in shared memory"):
                reading.get(NS, keys, out)
        # The node re-hashed the slot, found it changed and dropped the page with what extends it.
        assert client.lookup(NS, keys) == 1
        out = np.zeros_like(data)
        assert client.get(NS, keys, out) == 1 and np.array_equal(out[0], data[0])


def test_a_committed_page_changed_in_shared_memory_is_refused_on_get(two_tenants):
    node, tokens = two_tenants
    changed_page_is_refused(node.address, tokens.alice, "c")


def test_a_page_changed_in_shared_memory_is_refused_over_tcp_too(two_tenants):
    node, tokens = two_tenants
    changed_page_is_refused(node.address, tokens.alice, "t", reader="tcp")


def tcp_landed(client: KVStoreClient, keys: list[str], out: np.ndarray) -> tuple[list, list[int]]:
    """A TCP get of `keys` through the client's data path: (what each page landed as: its xxh3, or None where the
    node vouched for it, the pages' commit checksums)."""
    acquired = client._conn.control.call("Acquire", pb.AcquireRequest(
        namespace_id=client._namespace_id(NS), keys=[k.encode() for k in keys]))
    try:
        assert acquired.hit_pages == len(keys)
        moved = [(i, acquired.offsets[i], [(out[i].ctypes.data, PAGE)]) for i in range(len(keys))]
        return client._conn.data.get(acquired.lease_id, acquired.data_token, moved, PAGE), list(acquired.checksums)
    finally:
        client._conn.control.call("Release", pb.ReleaseRequest(lease_ids=[acquired.lease_id]))


def test_tcp_reads_go_unhashed_only_while_no_other_process_has_mapped_the_tenants_memory(two_tenants):
    node, tokens = two_tenants
    data, keys = pages(2, seed=9), ["v0", "v1"]
    with KVStoreClient(node.address, token=tokens.alice, transport="tcp") as alice:
        assert alice.put(NS, keys, data) == 2
        out = np.zeros_like(data)
        assert tcp_landed(alice, keys, out)[0] == [None, None] and np.array_equal(out, data)
        assert as_bob(node, tokens, "put", "3:1")["transport"] == "shm"    # another tenant's memfd goes out
        out[:] = 0
        assert tcp_landed(alice, keys, out)[0] == [None, None] and np.array_equal(out, data)
        with KVStoreClient(node.address, token=tokens.alice) as mapped:    # alice's own memfd goes out
            assert mapped.transport == "shm"
        out[:] = 0
        landed, committed = tcp_landed(alice, keys, out)
        assert landed == committed and np.array_equal(out, data)      # hashed as they landed, for good
        assert alice.get(NS, keys, out) == 2


def map_arena_fd(path: str, token: str) -> int:
    local = LocalChannel(path, 30.0, token)
    try:
        return local.map_arena_fd()
    finally:
        local.close()


def test_a_tcp_reader_that_stopped_reading_holds_back_the_first_mapping_until_its_lease_runs_out(
        start_server, tmp_path, socket_dir):
    """Alice's TCP reads go unhashed while no process maps her memfd; a reader that asked for pages and stopped
    reading holds vouched bytes in flight. Her memfd goes out only once no such read is left: the node cuts the
    stalled connection at its read lease's end, and only then answers MAP_ARENA."""
    node, tokens = start_two_tenants(start_server, tmp_path, socket_dir, **{"leases.read_ttl_ms": "2000"})
    with KVStoreClient(node.address, token=tokens.alice, transport="tcp") as alice:
        assert alice.put(NS, ["s0"], pages(1, seed=51)) == 1
        hello = alice._conn.hello
        acquired = alice._conn.control.call("Acquire", pb.AcquireRequest(
            namespace_id=alice._namespace_id(NS), keys=[b"s0"]))
        stalled = socket.create_connection(tuple(hello.tcp_endpoint.rsplit(":", 1)))
        try:
            stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            get = encode_request(Op.GET, acquired.lease_id, acquired.data_token, acquired.offsets[0], PAGE)
            stalled.sendall(encode_hello(hello.data_ticket) + get * 512)   # 32 MiB of answers, read no further
            stalled.settimeout(30)
            assert decode_response(recv_exact(stalled, RESPONSE.size)).op == Op.HELLO
            assert decode_response(recv_exact(stalled, RESPONSE.size)).flags & VOUCHED   # the node is answering
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                mapping = pool.submit(map_arena_fd, hello.shm_socket, tokens.alice)
                with pytest.raises(concurrent.futures.TimeoutError):
                    mapping.result(timeout=0.5)       # held back while the stalled reads are in flight
                os.close(mapping.result(timeout=30))  # ... until the lease's end cut the stalled connection
            with pytest.raises(ConnectionResetError):
                while stalled.recv(1 << 20):           # what the node had sent, then the cut
                    pass
        finally:
            stalled.close()
        out = np.zeros((1, PAGE), dtype=np.uint8)
        landed, committed = tcp_landed(alice, ["s0"], out)
        assert landed == committed and np.array_equal(out, pages(1, seed=51))   # hashed from now on


def test_the_default_tenant_gets_the_same_refusal(server):
    changed_page_is_refused(server.address, None, "d")
    assert "pages changed in shared memory" in server.log() and "reported=1 dropped=1" in server.log()


def test_memory_a_client_allocates_in_its_memfds_holes_is_punched_back(two_tenants):
    node, tokens = two_tenants
    with KVStoreClient(node.address, token=tokens.alice) as alice:
        assert alice.put(NS, ["h0"], pages(1, seed=31)) == 1
        local = LocalChannel(alice._conn.hello.shm_socket, 5.0, tokens.alice)
    fd = local.map_arena_fd()
    try:
        held = os.fstat(fd).st_blocks * 512
        assert held == SLAB                      # one slab, prefaulted when it became alice's
        view = mmap.mmap(fd, os.fstat(fd).st_size)
        view[:] = b"\x01" * len(view)            # touches the other slab, a hole of her memfd
        view.close()
        assert os.fstat(fd).st_blocks * 512 == 2 * SLAB
        deadline = time.monotonic() + 10
        while os.fstat(fd).st_blocks * 512 > held and time.monotonic() < deadline:
            time.sleep(0.05)
        assert os.fstat(fd).st_blocks * 512 == held   # the lease reaper's trim punched it out
    finally:
        os.close(fd)
        local.close()


@pytest.mark.parametrize("tenant", ["alice", "default"])
def test_a_client_cannot_shrink_or_grow_the_memfd_it_is_handed(request, tenant):
    """The memfd is sealed: ftruncate to 0 (which would kill the node with SIGBUS at its next touch) and
    growing it past the arena are refused; the node goes on storing and serving that tenant's pages."""
    if tenant == "alice":
        node, tokens = request.getfixturevalue("two_tenants")
        token = tokens.alice
    else:
        node, token = request.getfixturevalue("server"), None
    with KVStoreClient(node.address, token=token) as client:
        assert client.put(NS, ["s0"], pages(1, seed=41)) == 1
        local = LocalChannel(client._conn.hello.shm_socket, 5.0, token)
    fd = local.map_arena_fd()
    try:
        size = os.fstat(fd).st_size
        for change in (lambda: os.ftruncate(fd, 0), lambda: os.ftruncate(fd, 2 * size),
                       lambda: os.posix_fallocate(fd, size, 4096)):
            with pytest.raises(PermissionError):
                change()
        assert os.fstat(fd).st_size == size
    finally:
        os.close(fd)
        local.close()
    data = pages(3, seed=42)
    with KVStoreClient(node.address, token=token) as client:
        assert client.put(NS, ["s1", "s2", "s3"], data) == 3
        out = np.zeros_like(data)
        assert client.get(NS, ["s1", "s2", "s3"], out) == 3 and np.array_equal(out, data)
    assert node.process.poll() is None


def test_an_admin_maps_its_own_memfd_and_moves_other_tenants_pages_over_tcp(start_server, tmp_path):
    tokens = Tokens(tmp_path)
    node = start_server({"auth.tokens_file": str(tokens.path), "auth.local_uids": f"{os.getuid()}:ops:admin"})
    data = pages(1, seed=41)
    with KVStoreClient(node.address, token=tokens.alice, transport="tcp") as alice:
        assert alice.put(NS, ["x0"], data) == 1
    alices = Namespace(model=NS.model, page_bytes=PAGE, page_tokens=16, tenant="alice")
    out = np.zeros_like(data)
    with KVStoreClient(node.address, token=tokens.ops) as ops:
        assert ops.transport == "shm"
        with pytest.raises(errors.PermissionDenied, match="memfd of tenant 'ops'.*move them over TCP"):
            ops.get(alices, ["x0"], out)
    with KVStoreClient(node.address, token=tokens.ops, transport="tcp") as ops:
        assert ops.get(alices, ["x0"], out) == 1 and np.array_equal(out, data)


def test_a_group_get_refuses_a_changed_page_too(server):
    data = pages(2, seed=51)
    other = Namespace(model="memfd-other", page_bytes=PAGE, page_tokens=16)
    with KVStoreClient(server.address) as client:
        assert client.put(NS, ["g0", "g1"], data) == 2 and client.put(other, ["g0", "g1"], data) == 2
        acquired = client._conn.control.call("Acquire", pb.AcquireRequest(
            namespace_id=client._namespace_id(other), keys=[b"g0", b"g1"]))
        client._conn.control.call("Release", pb.ReleaseRequest(lease_ids=[acquired.lease_id]))
        client._conn.data.arena.view[acquired.offsets[0]] ^= 0x01
        outs = [np.zeros_like(data), np.zeros_like(data)]
        with pytest.raises(errors.ChecksumMismatch, match=r"pages \[0\]"):
            client.get_group([(NS, ["g0", "g1"], outs[0]), (other, ["g0", "g1"], outs[1])])
        assert client.lookup(other, ["g0", "g1"]) == 0 and client.lookup(NS, ["g0", "g1"]) == 2


def test_gpu_transfers_need_the_arena_in_one_memfd(start_server, tmp_path):
    """GpuPages registers the whole mapping with the device, which in a tenant's sparse memfd would fill
    its holes: such a client is told to load pages with get instead, before anything is registered."""
    from kv_layout_cases import cases
    from kvstore_client.gpu import GpuPages
    from kvstore_client.gpu_device import HostDevice

    tokens = Tokens(tmp_path)
    node = start_server({"auth.tokens_file": str(tokens.path), "auth.local_uids": f"{os.getuid()}:alice"})
    case = cases()[0]
    ns = Namespace(model="gpu-memfd", page_bytes=case.shape.page_bytes, page_tokens=case.shape.tokens, layout="lmcache")
    device = HostDevice()
    with KVStoreClient(node.address, token=tokens.alice) as alice, GpuPages(alice, device) as gpu_pages:
        assert alice.transport == "shm" and not alice._conn.data.arena.whole
        with pytest.raises(errors.InvalidArgument, match="needs the arena in one memfd"):
            gpu_pages.get_to_gpu(ns, ["k0"], case.cache, "lmcache", [0])
        with pytest.raises(errors.InvalidArgument, match="needs the arena in one memfd"):
            gpu_pages.put_from_gpu(ns, ["k0"], case.cache, "lmcache", [0])
    assert device.register_calls == 0


def test_a_client_whose_token_is_revoked_sees_none_of_its_tenants_pages_in_what_it_mapped(start_server, tmp_path):
    tokens = Tokens(tmp_path)
    revoked = "a-second-token-of-alice"
    tokens.lines.append(token_line(revoked, "alice"))
    tokens.write()
    node = start_server({"auth.tokens_file": str(tokens.path), "auth.local_uids": f"{os.getuid()}:alice",
                         "dram.arena_bytes": str(4 * SLAB), "dram.slab_bytes": str(SLAB)})
    before, after = pages(4, seed=11), pages(4, seed=12)
    with KVStoreClient(node.address, token=tokens.alice) as alice:
        assert alice.transport == "shm" and alice.put(NS, [f"old{i}" for i in range(4)], before) == 4
        local = LocalChannel(alice._conn.hello.shm_socket, 5.0, revoked)
        fd = local.map_arena_fd()
        kept = mmap.mmap(fd, os.fstat(fd).st_size, prot=mmap.PROT_READ)
        try:
            assert all(bytes(kept).find(m) >= 0 for m in markers(before)), "the mapping showed the tenant's pages"
            tokens.lines = [line for line in tokens.lines if not line.startswith(token_digest(revoked).hex())]
            tokens.write()
            node.process.send_signal(signal.SIGHUP)
            wait_for_log(node, "shared memory replaced")
            assert alice.put(NS, [f"new{i}" for i in range(4)], after) == 4
            seen = bytes(kept)
            assert not any(seen.find(m) >= 0 for m in markers(before) + markers(after)), \
                "a revoked client still sees its tenant's pages"
            out = np.zeros_like(before)
            assert alice.get(NS, [f"old{i}" for i in range(4)], out, verify=True) == 4 and np.array_equal(out, before)
            assert alice.get(NS, [f"new{i}" for i in range(4)], out, verify=True) == 4 and np.array_equal(out, after)
            assert alice.transport == "shm"
        finally:
            kept.close()
            os.close(fd)
            local.close()


def wait_for_log(node, words: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while words not in node.log():
        assert time.monotonic() < deadline, node.log()
        time.sleep(0.05)
