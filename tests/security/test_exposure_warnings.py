"""Where a setting protects less than it may seem to, the node says so at start-up, and nothing a
client sends forges a line of the node's log."""

from __future__ import annotations

import pytest

from identities import Tokens
from kvstore_client import KVStoreClient, Namespace
from netns import NetnsServer, veth_namespace

PLAINTEXT = "bearer tokens reach server.grpc_address="
UIDS_ONLY = "shm.allowed_uids guards the local socket only"


def test_tokens_served_in_plaintext_beyond_loopback_are_warned_of(tmp_path):
    tokens = Tokens(tmp_path)
    with veth_namespace() as ns:
        (tmp_path / "node").mkdir()
        node = NetnsServer(tmp_path / "node", {"shm.enabled": "false", "auth.tokens_file": str(tokens.path),
                                               "server.grpc_address": f"{ns.ns_ip}:0"}, ns.name)
        try:
            log = node.log()
        finally:
            node.kill()
    assert PLAINTEXT in log and "set auth.tls_cert and auth.tls_key" in log, log


def test_tokens_on_loopback_draw_no_plaintext_warning(start_server, tmp_path):
    tokens = Tokens(tmp_path)
    assert PLAINTEXT not in start_server({"auth.tokens_file": str(tokens.path)}).log()


def test_a_uid_list_without_authentication_states_its_boundary(start_server):
    """Without auth, shm.allowed_uids decides the socket, and only it (README: Security)."""
    node = start_server({"shm.allowed_uids": "0"})
    assert UIDS_ONLY in node.log() and "configure auth.tokens_file" in node.log()
    assert UIDS_ONLY not in start_server().log()


@pytest.mark.parametrize("log_format", ["text", "logfmt", "json"])
def test_a_client_string_forges_no_log_line(start_server, log_format):
    node = start_server({"ops.log_format": log_format})
    forged = "m\n2026-12-02 00:00:00,000 ERROR kvstore.server node compromised\r\x1b[2K"
    with KVStoreClient(node.address) as client:
        client.lookup(Namespace(model=forged, page_bytes=4096), ["k"])   # the node logs the namespace it opens
    lines = [line for line in node.log().splitlines() if "node compromised" in line]
    assert lines, "the model name was not logged at all"
    assert all("namespace opened" in line for line in lines), f"a line of its own: {lines}"
    assert "\x1b" not in node.log() and "\r" not in node.log()
