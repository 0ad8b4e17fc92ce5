"""Identities: the token file's format and its errors, token and ticket resolution, and the tenancy rules
of the service on real stores (no sockets)."""

from __future__ import annotations

import time

import pytest

from identities import token_line
from kvstore.config import AuthConfig
from kvstore.control.identity import (ADMIN, TENANT, TRUSTED, Authenticator, Caller, Identity, TokenStanding,
                                      bearer_token, read_token_file, token_digest)
from kvstore_client import errors
from kvstore_client.keys import Namespace
from kvstore_client.proto import pb
from node_parts import ManualClock, make_service


def test_token_file_lines_and_their_errors(tmp_path):
    path = tmp_path / "tokens"
    path.write_text("# comment\n\n" + token_line("a", "alice") + token_line("o", "ops", "admin", "2030-01-01T00:00:00"))
    entries = read_token_file(str(path))
    assert [e.identity for e in entries] == [Identity("alice", TENANT), Identity("ops", ADMIN)]
    assert entries[1].expires_at == pytest.approx(1893456000.0)
    for text, why in [("abc alice tenant\n", "64 hex digits"), (token_line("a", "alice", "root"), "role 'root'"),
                      ("x" * 64 + " alice\n", "expected"), (token_line("a", "alice", "tenant", "soon"), "ISO 8601"),
                      (token_line("a", "t" * 256), "at most 255 bytes")]:
        path.write_text(text)
        with pytest.raises(ValueError, match=why) as info:
            read_token_file(str(path))
        assert f"{path}:1" in str(info.value)
    path.write_text(token_line("a", "alice") + token_line("a", "ops", "admin"))
    with pytest.raises(ValueError, match="the same token digest as line 1") as info:
        read_token_file(str(path))
    assert f"{path}:2" in str(info.value)


def test_tokens_resolve_expire_and_are_counted_when_refused(tmp_path):
    path = tmp_path / "tokens"
    path.write_text(token_line("good", "alice") + token_line("old", "bob", "tenant", "2020-01-01T00:00:00"))
    auth = Authenticator(AuthConfig(tokens_file=str(path)))
    assert auth.grpc_identity([("authorization", "Bearer good")], None) == Identity("alice", TENANT)
    for metadata, why in [([], "needs a bearer token"), ([("authorization", "Bearer bad")], "not one this node"),
                          ([("authorization", "Bearer old")], "expired"), ([("authorization", "Basic x")], "Bearer")]:
        with pytest.raises(errors.Unauthenticated, match=why):
            auth.grpc_identity(metadata, None)
    assert auth.refusals == {("grpc", "Unauthenticated"): 4}
    assert bearer_token([("x-other", "1")]) is None


def test_a_certificate_names_the_tenant_only_under_mutual_tls(tmp_path):
    path = tmp_path / "tokens"
    path.write_text(token_line("b", "bob"))
    plain = Authenticator(AuthConfig(tokens_file=str(path)))
    with pytest.raises(errors.Unauthenticated):   # no client CA: a certificate proves nothing here
        plain.grpc_identity([], "alice")
    mutual = Authenticator(AuthConfig(tokens_file=str(path), tls_cert="c", tls_key="k", tls_client_ca="ca"))
    assert mutual.grpc_identity([], "alice") == Identity("alice", TENANT)
    with pytest.raises(errors.PermissionDenied, match="certificate names tenant 'alice'"):
        mutual.grpc_identity([("authorization", "Bearer b")], "alice")


def test_data_tickets_are_sealed_per_process_and_expire():
    auth = Authenticator(AuthConfig(local_uids=("0:alice",)))
    ticket = auth.ticket(Identity("alice", TENANT))
    assert auth.ticket_identity(ticket) == Identity("alice", TENANT)
    for bad, why in [(ticket[:-1] + bytes([ticket[-1] ^ 1]), "not one this node issued"),
                     (Authenticator(AuthConfig(local_uids=("0:alice",))).ticket(Identity("alice", ADMIN)),
                      "not one this node issued"), (b"", "not one this node issued")]:
        with pytest.raises(errors.Unauthenticated, match=why):
            auth.ticket_identity(bad)
    with pytest.raises(errors.Unauthenticated, match="expired"):
        auth.ticket_identity(ticket, now=time.time() + 301)
    assert Authenticator(AuthConfig()).ticket(Identity("a", TENANT)) == b""   # no auth: no ticket needed
    assert Authenticator(AuthConfig()).ticket_identity(b"") is TRUSTED


def test_a_ticket_carries_its_token_and_the_connection_falls_with_it(tmp_path):
    path = tmp_path / "tokens"
    expires_at = int(time.time()) + 2
    soon = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(expires_at))
    path.write_text(token_line("good", "alice") + token_line("brief", "bob", "tenant", soon))
    auth = Authenticator(AuthConfig(tokens_file=str(path)))
    alice = auth.ticket_identity(auth.ticket(auth.grpc_identity([("authorization", "Bearer good")], None)))
    assert alice == Identity("alice", TENANT) and alice.token_digest == token_digest("good")
    standing = TokenStanding(auth, alice)
    standing.check("tcp")
    path.write_text(token_line("brief", "bob", "tenant", soon))   # alice's line removed, then SIGHUP
    auth.reload()
    with pytest.raises(errors.Unauthenticated, match="revoked"):
        standing.check("tcp")
    bob = TokenStanding(auth, auth.grpc_identity([("authorization", "Bearer brief")], None))
    bob.check("tcp")
    time.sleep(max(0.0, expires_at - time.time()) + 0.05)
    with pytest.raises(errors.Unauthenticated, match="expired"):
        bob.check("tcp")
    assert auth.refusals[("tcp", "Unauthenticated")] == 2
    TokenStanding(auth, Identity("carol", TENANT)).check("local")   # a uid's identity: nothing to revoke


def test_local_uids_map_to_tenants_or_refuse():
    auth = Authenticator(AuthConfig(local_uids=("1001:alice", "0:ops:admin")))
    assert auth.local_identity(1001) == Identity("alice", TENANT) and auth.local_identity(0).admin
    with pytest.raises(errors.PermissionDenied, match="uid 7 maps to no tenant"):
        auth.local_identity(7)
    assert Authenticator(AuthConfig()).local_identity(7) is TRUSTED


def test_service_rules_for_a_tenant_and_for_an_unknown_method():
    service = make_service(["dram.arena_bytes=8MiB", "dram.slab_bytes=1MiB"], ManualClock())
    alice, bob = Caller(Identity("alice", TENANT)), Caller(Identity("bob", TENANT))
    spec = Namespace("m", 4096).to_proto()
    ns_id = service.handle("OpenNamespace", pb.OpenNamespaceRequest(spec=spec), alice).namespace_id
    assert service.store.namespaces[ns_id].tenant == "alice"
    assert service.handle("Lookup", pb.LookupRequest(namespace_id=ns_id, keys=[b"k"]), alice).hit_pages == 0
    with pytest.raises(errors.NamespaceNotFound):
        service.handle("Lookup", pb.LookupRequest(namespace_id=ns_id, keys=[b"k"]), bob)
    with pytest.raises(errors.PermissionDenied, match="Scrub needs the admin role; the caller is tenant 'bob'"):
        service.handle("Scrub", pb.ScrubRequest(), bob)
    # No identity (no authentication configured): today's behaviour, the spec's tenant as given.
    other = service.handle("OpenNamespace", pb.OpenNamespaceRequest(spec=Namespace("m", 4096, tenant="x").to_proto()))
    assert service.store.namespaces[other.namespace_id].tenant == "x"


@pytest.mark.parametrize("method", ["Reserve", "Acquire"])
def test_a_tenant_names_no_rdma_queue_pair(method):
    # Queue pairs are opened by RdmaConnect, an admin's call; a lease naming one has it kept
    # alive, and fenced (moved to error) when the lease ends uncommitted. A tenant naming an
    # admin's queue pair could break that admin's RDMA connection.
    service = make_service(["dram.arena_bytes=8MiB", "dram.slab_bytes=1MiB"], ManualClock())
    alice = Caller(Identity("alice", TENANT))
    spec = Namespace("m", 4096).to_proto()
    ns_id = service.handle("OpenNamespace", pb.OpenNamespaceRequest(spec=spec), alice).namespace_id
    request = (pb.ReserveRequest(namespace_id=ns_id, keys=[b"k"], page_bytes=4096, rdma_qp_num=77)
               if method == "Reserve" else pb.AcquireRequest(namespace_id=ns_id, keys=[b"k"], rdma_qp_num=77))
    with pytest.raises(errors.PermissionDenied, match="rdma_qp_num"):
        service.handle(method, request, alice)
    assert service.store.open_leases() == 0
    request.rdma_qp_num = 0
    service.handle(method, request, alice)
    service.store.arena.close()
