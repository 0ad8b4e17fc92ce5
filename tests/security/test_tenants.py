"""Tenants on a real node with tokens: each tenant hits its own pages, and another tenant misses them and
can neither read, delete nor learn of them, on every API; bad identities are refused with what to fix."""

from __future__ import annotations

import json
import signal
import socket
import time
import urllib.error
import urllib.request

import numpy as np
import pytest

from identities import Tokens, token_line
from kvstore_client import KVStoreClient, Namespace, errors
from kvstore_client.channel import GrpcChannel
from kvstore_client.credentials import Credentials
from kvstore_client.proto import pb

PAGE = 16384
NS = Namespace(model="tenant-model", page_bytes=PAGE, page_tokens=16)


def pages(n, seed=0):
    return np.random.default_rng(seed).integers(0, 256, (n, PAGE), dtype=np.uint8)


@pytest.fixture
def tokens(tmp_path):
    return Tokens(tmp_path)


@pytest.fixture
def node(start_server, tokens):
    return start_server({"auth.tokens_file": str(tokens.path)})


def channel(node, token: str) -> GrpcChannel:
    return GrpcChannel(node.address, 5.0, Credentials(token=token))


def stored(node, tokens, keys=("a0", "a1", "a2")):
    with KVStoreClient(node.address, token=tokens.alice) as alice:
        assert alice.put(NS, list(keys), pages(len(keys))) == len(keys)
        return alice.stats().namespaces[0].namespace_id


def test_same_tenant_hits_another_tenant_misses_and_cannot_delete(node, tokens):
    keys = ["a0", "a1", "a2"]
    data = pages(3)
    with KVStoreClient(node.address, token=tokens.alice) as alice, \
            KVStoreClient(node.address, token=tokens.bob) as bob:
        assert alice.put(NS, keys, data) == 3
        out = np.zeros_like(data)
        assert alice.lookup(NS, keys) == 3 and alice.get(NS, keys, out) == 3 and np.array_equal(out, data)
        # The same spec and keys from bob name bob's own key space: nothing is there.
        assert bob.lookup(NS, keys) == 0
        assert bob.get(NS, keys, np.zeros_like(data)) == 0
        assert bob.delete(NS, keys) == 0 and bob.clear(NS) == 0
        assert bob.route(NS, ["e0"], keys=keys).scores[0].dram_pages == 0
        assert alice.get(NS, keys, out) == 3 and np.array_equal(out, data)
        # bob's own pages under the same keys are his and do not disturb alice's
        assert bob.put(NS, keys, pages(3, seed=1)) == 3
        assert alice.get(NS, keys, out) == 3 and np.array_equal(out, data)


def test_another_tenants_namespace_id_is_answered_as_an_unknown_one(node, tokens):
    alice_ns = stored(node, tokens)
    bob = channel(node, tokens.bob)
    unknown = (alice_ns + 1) % (1 << 64)
    requests = {
        "Lookup": lambda ns: pb.LookupRequest(namespace_id=ns, keys=[b"a0"]),
        "Acquire": lambda ns: pb.AcquireRequest(namespace_id=ns, keys=[b"a0"]),
        "Reserve": lambda ns: pb.ReserveRequest(namespace_id=ns, keys=[b"x"], page_bytes=PAGE),
        "Delete": lambda ns: pb.DeleteRequest(namespace_id=ns, all_pages=True),
        "Route": lambda ns: pb.RouteRequest(namespace_id=ns, keys=[b"a0"], engine_ids=["e0"]),
    }
    for method, request in requests.items():
        answers = []
        for ns in (alice_ns, unknown):
            with pytest.raises(errors.NamespaceNotFound) as info:
                bob.call(method, request(ns))
            answers.append(str(info.value).replace(f"{ns:#018x}", "<id>"))
        assert answers[0] == answers[1], method
    with KVStoreClient(node.address, token=tokens.alice) as alice:
        assert alice.lookup(NS, ["a0", "a1", "a2"]) == 3


def test_another_tenants_lease_is_answered_as_an_unknown_one(node, tokens):
    alice = channel(node, tokens.alice)
    bob = channel(node, tokens.bob)
    ns_id = alice.call("OpenNamespace", pb.OpenNamespaceRequest(spec=NS.to_proto())).namespace_id
    write = alice.call("Reserve", pb.ReserveRequest(namespace_id=ns_id, keys=[b"w"], page_bytes=PAGE))
    bob_ns = bob.call("OpenNamespace", pb.OpenNamespaceRequest(spec=NS.to_proto())).namespace_id
    for method, request in [("Reserve", pb.ReserveRequest(namespace_id=bob_ns, keys=[b"x"], page_bytes=PAGE,
                                                          lease_id=write.lease_id, parent_key=b"w")),
                            ("Commit", pb.CommitRequest(lease_id=write.lease_id)),
                            ("Abort", pb.AbortRequest(lease_id=write.lease_id)),
                            ("Release", pb.ReleaseRequest(lease_ids=[write.lease_id]))]:
        with pytest.raises(errors.LeaseNotFound, match="is unknown, already finished, or expired"):
            bob.call(method, request)
    assert alice.call("Abort", pb.AbortRequest(lease_id=write.lease_id)).aborted_pages == 1


def test_a_spec_naming_another_tenant_is_refused(node, tokens):
    bob = channel(node, tokens.bob)
    with pytest.raises(errors.PermissionDenied, match="leave spec.tenant empty"):
        bob.call("OpenNamespace", pb.OpenNamespaceRequest(spec=Namespace("m", PAGE, tenant="alice").to_proto()))
    own = bob.call("OpenNamespace", pb.OpenNamespaceRequest(spec=Namespace("m", PAGE, tenant="bob").to_proto()))
    filled = bob.call("OpenNamespace", pb.OpenNamespaceRequest(spec=Namespace("m", PAGE).to_proto()))
    assert own.namespace_id == filled.namespace_id   # the node filled in bob's tenant
    ops = channel(node, tokens.ops)
    ops.call("OpenNamespace", pb.OpenNamespaceRequest(spec=Namespace("m", PAGE, tenant="alice").to_proto()))


def test_stats_show_a_tenant_only_its_own(node, tokens):
    stored(node, tokens)
    with KVStoreClient(node.address, token=tokens.bob) as bob:
        assert bob.put(NS, ["b0"], pages(1)) == 1
        stats = bob.stats()
    assert [(ns.tenant, ns.pages) for ns in stats.namespaces] == [("bob", 1)] and stats.namespaces_total == 1
    assert not stats.tiers and stats.pages_committed == 0   # node-wide counters would tell of alice
    admin = channel(node, tokens.ops).call("Stats", pb.StatsRequest())
    assert sorted(ns.tenant for ns in admin.namespaces) == ["alice", "bob"] and admin.tiers[0].pages == 4


def test_admin_operations_need_the_admin_role(node, tokens):
    alice_ns = stored(node, tokens)
    with pytest.raises(errors.PermissionDenied, match="Scrub needs the admin role"):
        channel(node, tokens.bob).call("Scrub", pb.ScrubRequest())
    ops = channel(node, tokens.ops)
    assert ops.call("Scrub", pb.ScrubRequest()).pages_checked == 3
    assert ops.call("Delete", pb.DeleteRequest(namespace_id=alice_ns, all_pages=True)).deleted_pages == 3


@pytest.mark.parametrize("token, why", [
    (None, "needs a bearer token"),
    ("not-a-token", "not one this node knows"),
])
def test_missing_or_wrong_token_is_unauthenticated(node, token, why):
    with pytest.raises(errors.Unauthenticated, match=why):
        KVStoreClient(node.address, token=token or "")


def test_expired_token_is_unauthenticated(start_server, tokens):
    tokens.lines.append(token_line("old-token", "alice", "tenant", "2020-01-01T00:00:00"))
    tokens.write()
    node = start_server({"auth.tokens_file": str(tokens.path)})
    with pytest.raises(errors.Unauthenticated, match="expired"):
        KVStoreClient(node.address, token="old-token")


def test_a_token_revoked_on_sighup_is_refused_from_then_on(node, tokens):
    bob = channel(node, tokens.bob)
    bob.call("Hello", pb.HelloRequest())
    tokens.lines = [line for line in tokens.lines if " bob " not in line]
    tokens.write()
    node.process.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 10
    while "token file reloaded" not in node.log():
        assert time.monotonic() < deadline, node.log()
        time.sleep(0.02)
    with pytest.raises(errors.Unauthenticated, match="revoked"):
        bob.call("Hello", pb.HelloRequest())
    channel(node, tokens.alice).call("Hello", pb.HelloRequest())


def revoke(node, tokens, tenant):
    tokens.lines = [line for line in tokens.lines if f" {tenant} " not in line]
    tokens.write()
    reloads = node.log().count("token file reloaded")
    node.process.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 10
    while node.log().count("token file reloaded") == reloads:
        assert time.monotonic() < deadline, node.log()
        time.sleep(0.02)


def test_a_token_revoked_on_sighup_refuses_the_next_frame_of_its_open_tcp_connection(node, tokens):
    bob = channel(node, tokens.bob)
    hello = bob.call("Hello", pb.HelloRequest())
    ns_id = bob.call("OpenNamespace", pb.OpenNamespaceRequest(spec=NS.to_proto())).namespace_id
    write = bob.call("Reserve", pb.ReserveRequest(namespace_id=ns_id, keys=[b"r0", b"r1"], page_bytes=PAGE))
    data = pages(2)
    path = tcp_path(node, hello)   # opened (HELLO accepted) while the token is in force
    path.put(write.lease_id, write.data_token, [(0, 0, [(data[0].ctypes.data, PAGE)])], PAGE)
    revoke(node, tokens, "bob")
    with pytest.raises(errors.Unauthenticated, match="revoked"):
        path.put(write.lease_id, write.data_token, [(1, 0, [(data[1].ctypes.data, PAGE)])], PAGE)
    with pytest.raises(errors.Unauthenticated, match="revoked"):   # its ticket, still sealed, opens no new one
        tcp_path(node, hello)
    # alice's connection, opened the same way, still moves pages
    with KVStoreClient(node.address, token=tokens.alice, transport="tcp") as alice:
        assert alice.put(NS, ["a0"], pages(1)) == 1


def test_a_token_file_that_does_not_parse_on_sighup_keeps_the_old_one(node, tokens):
    tokens.path.write_text("not a token line\n")
    node.process.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 10
    while "token file not reloaded" not in node.log():
        assert time.monotonic() < deadline, node.log()
        time.sleep(0.02)
    channel(node, tokens.bob).call("Hello", pb.HelloRequest())


def scrape(node, token: str | None) -> tuple[int, str]:
    port = json.loads(node.ready_file.read_text())["metrics_port"]
    request = urllib.request.Request(f"http://127.0.0.1:{port}/metrics")
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def test_metrics_need_an_admin_token_and_count_refusals(node, tokens):
    stored(node, tokens)
    assert scrape(node, None)[0] == 401
    status, text = scrape(node, tokens.alice)
    assert status == 403 and "admin" in text      # a known token, of a tenant: forbidden, not unknown
    with pytest.raises(errors.Unauthenticated):
        channel(node, "wrong").call("Hello", pb.HelloRequest())
    status, text = scrape(node, tokens.ops)
    assert status == 200 and 'tenant="alice"' in text
    assert 'kvstore_auth_refusals_total{error="Unauthenticated",plane="grpc"} 1.0' in text
    assert 'kvstore_auth_refusals_total{error="PermissionDenied",plane="metrics"} 1.0' in text


def test_non_loopback_address_without_authentication_refuses_to_start(start_server):
    with pytest.raises(RuntimeError, match="exited with 2") as info:
        start_server({"server.grpc_address": "0.0.0.0:0"})
    assert "auth.allow_unauthenticated_remote" in str(info.value)


def test_local_uid_mapping_decides_the_local_channel(start_server, tokens):
    import os
    uid = os.getuid()
    # A tenant's uid: the local channel serves it, with shared memory in its tenant's own memfd.
    tenant_node = start_server({"auth.tokens_file": str(tokens.path), "auth.local_uids": f"{uid}:alice"})
    with KVStoreClient(tenant_node.address, token=tokens.alice) as alice:
        assert alice.transport == "shm"
        assert alice.put(NS, ["a0"], pages(1)) == 1
    # An admin uid maps the arena.
    admin_node = start_server({"auth.tokens_file": str(tokens.path), "auth.local_uids": f"{uid}:ops:admin"})
    with KVStoreClient(admin_node.address, token=tokens.ops) as ops:
        assert ops.transport == "shm" and ops.put(NS, ["o0"], pages(1)) == 1
    # An unmapped uid is refused before any frame is read.
    other_node = start_server({"auth.tokens_file": str(tokens.path), "auth.local_uids": f"{uid + 1}:bob"})
    with pytest.raises(errors.PermissionDenied, match=f"uid {uid} maps to no tenant"):
        KVStoreClient(other_node.address, token=tokens.alice, transport="shm")


def test_a_local_token_on_top_of_the_uid_mapping(start_server, tokens):
    import os
    from kvstore_client.channel import LocalChannel
    node = start_server({"auth.tokens_file": str(tokens.path), "auth.local_uids": f"{os.getuid()}:ops:admin",
                         "auth.local_require_token": "true"})
    with KVStoreClient(node.address, token=tokens.ops, transport="shm") as ops:   # the SDK shows its token
        assert ops.transport == "shm" and ops.put(NS, ["o0"], pages(1)) == 1 and ops.lookup(NS, ["o0"]) == 1
    socket_path = channel(node, tokens.ops).call("Hello", pb.HelloRequest()).shm_socket
    bare = LocalChannel(socket_path, 5.0)
    with pytest.raises(errors.Unauthenticated, match="auth.local_require_token.*pass token="):
        bare.map_arena_fd()
    bare.close()
    with pytest.raises(errors.PermissionDenied, match="maps to tenant 'ops' .* another tenant's"):
        LocalChannel(socket_path, 5.0, tokens.alice)
    with pytest.raises(errors.Unauthenticated, match="not one this node knows"):
        LocalChannel(socket_path, 5.0, "not-a-token")


def test_a_token_revoked_on_sighup_refuses_the_next_call_of_its_open_local_connection(start_server, tokens):
    import os
    from kvstore_client.channel import LocalChannel
    node = start_server({"auth.tokens_file": str(tokens.path), "auth.local_uids": f"{os.getuid()}:alice"})
    socket_path = channel(node, tokens.alice).call("Hello", pb.HelloRequest()).shm_socket
    local = LocalChannel(socket_path, 5.0, tokens.alice)
    assert local.call("Stats", pb.StatsRequest()).namespaces == []
    revoke(node, tokens, "alice")
    with pytest.raises(errors.Unauthenticated, match="revoked"):
        local.call("Stats", pb.StatsRequest())
    local.close()


def test_hello_offers_a_tenant_no_region_of_every_tenants_pages(start_server, tokens):
    node = start_server({"auth.tokens_file": str(tokens.path), "hbm.pool_bytes": "4MiB",
                         "testing.hbm_on_host": "true"})
    assert not channel(node, tokens.alice).call("Hello", pb.HelloRequest()).HasField("hbm")
    assert channel(node, tokens.ops).call("Hello", pb.HelloRequest()).HasField("hbm")


def test_a_tenant_reading_on_the_nodes_host_is_named_no_hbm_offset(start_server, tokens):
    """The pool holds every tenant's copies, so a tenant is given neither its handle nor an offset in it, and
    its reads bring nothing in (its pages are never copied where only admins can read them)."""
    import os
    node = start_server({"auth.tokens_file": str(tokens.path), "auth.local_uids": f"{os.getuid()}:alice",
                         "hbm.pool_bytes": "4MiB", "testing.hbm_on_host": "true", "hbm.promote_hits": 1})
    keys = ["h0", "h1", "h2"]
    with KVStoreClient(node.address, token=tokens.alice) as alice:
        assert alice.transport == "shm" and not alice._conn.hello.HasField("hbm")
        assert alice.put(NS, keys, pages(3)) == 3
        for _ in range(3):
            out = np.zeros((3, PAGE), np.uint8)
            assert alice.get(NS, keys, out, verify=True) == 3
            answer = alice._conn.call_in(NS, "Acquire", pb.AcquireRequest(keys=[k.encode() for k in keys],
                                                                           hbm_reader=True))
            assert answer.hit_pages == 3 and list(answer.hbm_offsets) == []
            alice._conn.control.call("Release", pb.ReleaseRequest(lease_ids=[answer.lease_id]))
        time.sleep(0.5)
        assert list(alice.residency(NS, keys=keys).tiers) == [pb.DRAM] * 3
    hbm = next(t for t in channel(node, tokens.ops).call("Stats", pb.StatsRequest()).tiers if t.tier == pb.HBM)
    assert hbm.pages == 0 and hbm.promotions == 0 and hbm.capacity_bytes == 4 << 20


def tcp_path(node, hello, ticket=None):
    from kvstore_client.tcp_transport import TcpDataPath
    return TcpDataPath(hello.tcp_endpoint, 5.0, "", hello.data_ticket if ticket is None else ticket)


def test_tcp_frames_are_bound_to_the_tenant_of_the_connection(node, tokens):
    from kvstore_client.tcp_framing import RESPONSE, Op, decode_response, encode_request

    alice, bob = channel(node, tokens.alice), channel(node, tokens.bob)
    alice_hello, bob_hello = alice.call("Hello", pb.HelloRequest()), bob.call("Hello", pb.HelloRequest())
    assert alice_hello.data_ticket and alice_hello.data_ticket != bob_hello.data_ticket
    ns_id = alice.call("OpenNamespace", pb.OpenNamespaceRequest(spec=NS.to_proto())).namespace_id
    write = alice.call("Reserve", pb.ReserveRequest(namespace_id=ns_id, keys=[b"t0"], page_bytes=PAGE))
    data = pages(1)
    segment = [(data.ctypes.data, PAGE)]
    # alice's data token replayed on bob's connection: an unknown lease, nothing written
    with pytest.raises(errors.LeaseNotFound, match="is unknown"):
        tcp_path(node, bob_hello).put(write.lease_id, write.data_token, [(0, 0, segment)], PAGE)
    tcp_path(node, alice_hello).put(write.lease_id, write.data_token, [(0, 0, segment)], PAGE)
    alice.call("Commit", pb.CommitRequest(lease_id=write.lease_id))
    read = alice.call("Acquire", pb.AcquireRequest(namespace_id=ns_id, keys=[b"t0"]))
    out = np.zeros_like(data)
    with pytest.raises(errors.LeaseNotFound, match="is unknown"):
        tcp_path(node, bob_hello).get(read.lease_id, read.data_token, [(0, 0, [(out.ctypes.data, PAGE)])], PAGE)
    assert not out.any()
    tcp_path(node, alice_hello).get(read.lease_id, read.data_token, [(0, 0, [(out.ctypes.data, PAGE)])], PAGE)
    assert np.array_equal(out, data)
    # a forged ticket, and a connection whose first frame is not a HELLO
    forged = bytearray(alice_hello.data_ticket)
    forged[-1] ^= 1
    with pytest.raises(errors.Unauthenticated, match="not one this node issued"):
        tcp_path(node, alice_hello, bytes(forged))
    host, port = alice_hello.tcp_endpoint.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        sock.sendall(encode_request(Op.GET, read.lease_id, read.data_token, 0, PAGE))
        status, _, length, _ = decode_response(sock.recv(RESPONSE.size, socket.MSG_WAITALL))
        assert status == pb.UNAUTHENTICATED and b"first frame to be a HELLO" in sock.recv(length, socket.MSG_WAITALL)
        assert sock.recv(1) == b""   # closed


def test_tcp_calls_are_served_as_the_tenant_of_the_connection(node, tokens):
    """A call connection of the TCP data plane (tcp_control.py) is the identity its HELLO showed: another
    tenant's lease is an unknown one there, nothing is served before a HELLO, and a revoked token's next
    call is refused and closes it."""
    from kvstore_client import framing
    from kvstore_client.tcp_control import TcpControlChannel
    from kvstore_client.tcp_framing import RESPONSE, decode_response, encode_call

    alice_hello = channel(node, tokens.alice).call("Hello", pb.HelloRequest())
    bob_hello = channel(node, tokens.bob).call("Hello", pb.HelloRequest())
    alice = TcpControlChannel(alice_hello.tcp_endpoint, 5.0, ticket=alice_hello.data_ticket)
    bob = TcpControlChannel(bob_hello.tcp_endpoint, 5.0, ticket=bob_hello.data_ticket)
    ns_id = alice.call("OpenNamespace", pb.OpenNamespaceRequest(spec=NS.to_proto())).namespace_id
    write = alice.call("Reserve", pb.ReserveRequest(namespace_id=ns_id, keys=[b"c0"], page_bytes=PAGE))
    with pytest.raises(errors.LeaseNotFound, match="is unknown"):
        bob.call("Commit", pb.CommitRequest(lease_id=write.lease_id))
    with pytest.raises(errors.NamespaceNotFound):
        bob.call("Lookup", pb.LookupRequest(namespace_id=ns_id, keys=[b"c0"]))
    stats = bob.call("Stats", pb.StatsRequest())
    assert not stats.namespaces and not stats.tiers   # node-wide counters would tell of alice
    alice.call("Abort", pb.AbortRequest(lease_id=write.lease_id))
    host, port = alice_hello.tcp_endpoint.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        sock.sendall(encode_call(framing.METHOD_IDS["Stats"], b""))
        status, _, length, _ = decode_response(sock.recv(RESPONSE.size, socket.MSG_WAITALL))
        assert status == pb.UNAUTHENTICATED and b"first frame to be a HELLO" in sock.recv(length, socket.MSG_WAITALL)
        assert sock.recv(1) == b""   # closed
    revoke(node, tokens, "bob")
    with pytest.raises(errors.Unauthenticated, match="revoked"):
        bob.call("Stats", pb.StatsRequest())
    with pytest.raises((errors.Unavailable, errors.Unauthenticated)):   # closed by the node
        bob.call("Stats", pb.StatsRequest())
    assert alice.call("Lookup", pb.LookupRequest(namespace_id=ns_id, keys=[b"c0"])).hit_pages == 0
    alice.close()
    bob.close()


def kvstore_cli(node, *args, token=""):
    import os
    import subprocess
    import sys
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    env["KVSTORE_TOKEN"] = token
    target = node.address if node is not None else "127.0.0.1:1"   # `token` reaches no node
    return subprocess.run([sys.executable, "-m", "kvstore.admin.cli", "--target", target, "--json", *args],
                          capture_output=True, text=True, timeout=60, env=env)


def test_the_cli_shows_a_tenant_only_its_own_and_mints_tokens(start_server, tokens):
    minted = kvstore_cli(None, "token", "--tenant", "carol")
    token, line = minted.stdout.splitlines()
    tokens.lines.append(line + "\n")
    tokens.write()
    node = start_server({"auth.tokens_file": str(tokens.path)})
    stored(node, tokens)
    with KVStoreClient(node.address, token=token) as carol:
        assert carol.put(NS, ["c0"], pages(1)) == 1
    own = kvstore_cli(node, "namespaces", token=token)
    assert own.returncode == 0, own.stderr
    assert [row["tenant"] for row in json.loads(own.stdout)] == ["carol"]
    everyone = kvstore_cli(node, "namespaces", token=tokens.ops)
    assert sorted(row["tenant"] for row in json.loads(everyone.stdout)) == ["alice", "carol"]
    refused = kvstore_cli(node, "scrub", token=token)
    assert refused.returncode == 1 and "PermissionDenied: Scrub needs the admin role" in refused.stderr
    anonymous = kvstore_cli(node, "namespaces")
    assert anonymous.returncode == 1 and "Unauthenticated" in anonymous.stderr


def test_a_tenant_can_change_no_committed_page_of_another(start_server, tokens):
    """Committed pages of one tenant are out of another's reach: a tenant maps only its own memfd (which
    holds none of another's bytes: test_tenant_memfd.py), no tenant gets the RDMA region, and the TCP
    data plane writes only uncommitted slots of the connection's own write leases."""
    import mmap
    import os
    from kvstore_client.channel import LocalChannel
    node = start_server({"auth.tokens_file": str(tokens.path), "auth.local_uids": f"{os.getuid()}:alice"})
    data = pages(2, seed=5)
    with KVStoreClient(node.address, token=tokens.bob) as bob:
        assert bob.put(NS, ["b0", "b1"], data) == 2
    hello = channel(node, tokens.alice).call("Hello", pb.HelloRequest())
    local = LocalChannel(hello.shm_socket, 5.0)
    fd = local.map_arena_fd()
    alices = mmap.mmap(fd, os.fstat(fd).st_size)
    assert bytes(alices).find(data[0][:64].tobytes()) < 0   # bob's page is not in alice's memfd
    alices[:] = b"\x07" * len(alices)                       # so nothing alice writes there reaches it
    alices.close()
    os.close(fd)
    local.close()
    for method, request in (("RdmaConnect", pb.RdmaConnectRequest()), ("RdmaDisconnect", pb.RdmaDisconnectRequest())):
        with pytest.raises(errors.PermissionDenied, match="whole arena"):
            channel(node, tokens.alice).call(method, request)
    with KVStoreClient(node.address, token=tokens.bob) as bob:
        ns_id = bob._namespace_id(NS)
        read = bob._grpc.call("Acquire", pb.AcquireRequest(namespace_id=ns_id, keys=[b"b0"]))
        junk = np.full(PAGE, 7, np.uint8)
        # bob's own read lease cannot write the page either
        with pytest.raises(errors.SlotNotInLease):
            tcp_path(node, hello=bob._conn.hello).put(read.lease_id, read.data_token,
                                                      [(0, 0, [(junk.ctypes.data, PAGE)])], PAGE)
        out = np.zeros_like(data)
        assert bob.get(NS, ["b0", "b1"], out) == 2 and np.array_equal(out, data)


@pytest.mark.parametrize("setting, code, words", [
    ("auth.tokens_file={tmp}/absent", 1, "cannot read auth.tokens_file {tmp}/absent"),
    ("auth.tokens_file={tmp}/bad", 1, "auth.tokens_file: {tmp}/bad:1: the first field must be a token's SHA-256 digest"),
    ("auth.tls_cert={tmp}/bad", 2, "auth.tls_key: needs auth.tls_cert with it"),
    ("auth.local_require_token=true", 2, "auth.local_require_token: needs auth.tokens_file"),
])
def test_auth_settings_that_cannot_work_stop_start_up(start_server, tmp_path, setting, code, words):
    (tmp_path / "bad").write_text("deadbeef alice tenant\n")
    name, value = setting.format(tmp=tmp_path).split("=", 1)
    with pytest.raises(RuntimeError, match=f"exited with {code}") as info:
        start_server({name: value})
    assert words.format(tmp=tmp_path) in str(info.value)


def test_a_tenant_filling_its_dram_quota_evicts_only_its_own_pages(start_server, tokens):
    quota = 8 * PAGE
    node = start_server({"auth.tokens_file": str(tokens.path), "tenants.quotas": f"alice:{quota}:0"})
    bob_keys, bob_data = [f"b{i}" for i in range(8)], pages(8, seed=7)
    chains = [[f"a{c}-{i}" for i in range(4)] for c in range(6)]   # 24 pages into a quota of 8
    with KVStoreClient(node.address, token=tokens.alice) as alice, \
            KVStoreClient(node.address, token=tokens.bob) as bob:
        assert bob.put(NS, bob_keys, bob_data) == 8
        for c, keys in enumerate(chains):
            assert alice.put(NS, keys, pages(4, seed=c)) == 4
        out = np.zeros_like(bob_data)
        assert bob.get(NS, bob_keys, out) == 8 and np.array_equal(out, bob_data), "alice's quota took bob's pages"
        assert [alice.lookup(NS, keys) for keys in chains][-2:] == [4, 4]
        mine = {t.tenant: t for t in alice.stats().tenants}
        theirs = {t.tenant: t for t in bob.stats().tenants}
    assert set(mine) == {"alice"} and set(theirs) == {"bob"}, "a tenant saw another tenant's figures"
    assert mine["alice"].dram_quota_bytes == quota and 0 < mine["alice"].dram_bytes <= quota
    assert mine["alice"].evictions >= 16
    assert theirs["bob"].evictions == 0 and theirs["bob"].dram_pages == 8
    status, text = scrape(node, tokens.ops)
    assert status == 200
    assert f'kvstore_tenant_dram_quota_bytes{{tenant="alice"}} {float(quota)}' in text
    assert 'kvstore_tenant_dram_pages{tenant="bob"} 8.0' in text
    assert f'kvstore_tenant_evictions_total{{tenant="alice"}} {float(mine["alice"].evictions)}' in text
