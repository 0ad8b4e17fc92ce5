"""What a peer costs the node before it has shown anything: a length a local frame announces takes
memory only as its bytes arrive, a gRPC call without a token is refused before its message is
taken in, and the metrics endpoint holds a bounded number of threads, each for a bounded time."""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import urllib.request

import grpc
import pytest

from identities import Tokens
from kvstore.ops.metrics import SCRAPE_TIMEOUT_S, SCRAPES_MAX
from kvstore_client import framing

MiB = 1 << 20


def rss_bytes(server) -> int:
    with open(f"/proc/{server.process.pid}/status") as status:
        line = next(line for line in status if line.startswith("VmRSS:"))
    return int(line.split()[1]) * 1024


def threads(server) -> int:
    return len(os.listdir(f"/proc/{server.process.pid}/task"))


def settle(measure, rounds=10, pause_s=0.2) -> int:
    """The largest of a few readings, so growth that is still happening is seen."""
    seen = 0
    for _ in range(rounds):
        seen = max(seen, measure())
        time.sleep(pause_s)
    return seen


def test_lengths_local_frames_announce_cost_no_memory_until_their_bytes_arrive(start_server):
    server = start_server()
    before = rss_bytes(server)
    socks = []
    try:
        for _ in range(48):   # 48 x 16 MiB announced: 768 MiB if a frame's buffer were its announced length
            sock = socket.socket(socket.AF_UNIX)
            sock.connect(server.socket_path)
            sock.sendall(framing.HEADER.pack(framing.FRAME_BYTES_MAX, framing.METHOD_IDS["Lookup"]) + b"x")
            socks.append(sock)
        grown = settle(lambda: rss_bytes(server)) - before
    finally:
        for sock in socks:
            sock.close()
    assert grown < 64 * MiB, f"48 announced frames grew the node by {grown / MiB:.0f} MiB"


def test_grpc_calls_without_a_token_are_refused_before_their_messages_are_taken_in(start_server, tmp_path):
    tokens = Tokens(tmp_path)
    server = start_server({"auth.tokens_file": str(tokens.path)})
    before = rss_bytes(server)
    payload = b"\0" * (15 * MiB)   # under the 16 MiB a request may be
    codes: list[grpc.StatusCode] = []

    def call() -> None:
        with grpc.insecure_channel(server.address) as channel:
            lookup = channel.unary_unary("/kvstore.v1.KVStore/Lookup")
            try:
                lookup(payload, timeout=30)
            except grpc.RpcError as exc:
                codes.append(exc.code())

    callers = [threading.Thread(target=call) for _ in range(16)]
    for caller in callers:
        caller.start()
    peak = settle(lambda: rss_bytes(server), rounds=15, pause_s=0.1)
    for caller in callers:
        caller.join(60)
    assert codes == [grpc.StatusCode.UNAUTHENTICATED] * 16
    assert peak - before < 96 * MiB, f"16 tokenless 15 MiB calls grew the node by {(peak - before) / MiB:.0f} MiB"


def test_silent_metrics_peers_hold_a_bounded_number_of_threads_for_a_bounded_time(start_server):
    server = start_server({"ops.metrics_address": "127.0.0.1:0"})
    port = json.loads(server.ready_file.read_text())["metrics_port"]
    baseline = threads(server)
    silent = [socket.create_connection(("127.0.0.1", port), timeout=30) for _ in range(64)]
    try:
        assert settle(lambda: threads(server)) <= baseline + SCRAPES_MAX
        deadline = time.monotonic() + SCRAPE_TIMEOUT_S + 10
        while True:   # the silent ones time out and give their places back; a scrape gets in
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
                    assert response.status == 200 and b"kvstore_" in response.read()
                break
            except OSError:
                assert time.monotonic() < deadline, "no scrape got in after the silent peers timed out"
                time.sleep(0.5)
    finally:
        for sock in silent:
            sock.close()
    assert "scrapes already open" in server.log()


@pytest.mark.parametrize("first", [b"", b"GET /metrics HTTP/1.1\r\n"])
def test_a_metrics_peer_that_stops_mid_request_loses_its_thread(start_server, first):
    server = start_server({"ops.metrics_address": "127.0.0.1:0"})
    port = json.loads(server.ready_file.read_text())["metrics_port"]
    sock = socket.create_connection(("127.0.0.1", port), timeout=SCRAPE_TIMEOUT_S + 10)
    try:
        sock.sendall(first)
        assert sock.recv(1024) == b""   # the node closed it (else recv times out)
    finally:
        sock.close()
