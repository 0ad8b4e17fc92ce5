"""A client shows nothing, its token least of all, to a Unix socket that cannot prove it is the node its Hello reached.

Someone else's socket sits at the path the node advertises, as it would on another host than the
node's, or after a takeover: it records every byte a client sends and answers as it pleases."""

from __future__ import annotations

import os
import socket
import threading

import numpy as np
import pytest

from identities import Tokens
from kvstore_client import KVStoreClient, Namespace, errors, framing
from kvstore_client.channel import LocalChannel

NS = Namespace(model="proof-test", page_bytes=64 << 10)


class Impostor:
    """A listener at `path` that keeps what each connection sends and answers each frame with `answer`."""

    def __init__(self, path: str, answer: bytes | None):
        self.received: list[bytes] = []
        self._answer = answer
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(path)
        self._listener.listen(8)
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            while chunk := conn.recv(1 << 16):
                self.received.append(chunk)
                if self._answer is None:
                    return                        # hangs up
                conn.sendall(self._answer)

    def close(self) -> None:
        self._listener.close()


@pytest.fixture
def node(start_server, tmp_path):
    tokens = Tokens(tmp_path)
    server = start_server({"auth.tokens_file": str(tokens.path), "auth.local_uids": f"{os.getuid()}:alice"})
    return server, tokens


@pytest.mark.parametrize("answer", [
    framing.encode(0, bytes(16)),          # a plausible answer, but not the node's
    framing.encode(0, b""),                # says yes to anything
    None,                                  # hangs up
], ids=["wrong-answer", "empty-answer", "hangs-up"])
def test_an_impostor_at_the_socket_path_gets_no_token(node, answer):
    server, tokens = node
    with KVStoreClient(server.address, token=tokens.alice) as client:
        assert client.transport == "shm"      # the node's own socket proves itself
    os.unlink(server.socket_path)
    impostor = Impostor(server.socket_path, answer)
    try:
        data = np.random.default_rng(3).integers(0, 256, (3, NS.page_bytes), dtype=np.uint8)
        with KVStoreClient(server.address, token=tokens.alice, timeout_s=5) as client:
            assert client.transport == "tcp"  # auto passed the socket over
            assert client.put(NS, ["a", "b", "c"], data) == 3
            out = np.zeros_like(data)
            assert client.get(NS, ["a", "b", "c"], out) == 3 and np.array_equal(out, data)
        with pytest.raises(errors.TransportUnavailable, match="is not the node's"):
            KVStoreClient(server.address, token=tokens.alice, transport="shm", timeout_s=5)
    finally:
        impostor.close()
    sent = b"".join(impostor.received)
    assert sent and tokens.alice.encode() not in sent
    assert set(frames(sent)) == {framing.PROVE}, "only the challenge, which proves nothing to its holder"


def frames(stream: bytes) -> list[int]:
    kinds = []
    while stream:
        length, kind = framing.decode_header(stream[:framing.HEADER.size])
        kinds.append(kind)
        stream = stream[framing.HEADER.size + length:]
    return kinds


def test_the_node_answers_a_challenge_only_first_and_once(node):
    server, tokens = node
    with KVStoreClient(server.address, token=tokens.alice) as client:
        hello = client._conn.hello
    proof = (hello.local_challenge, hello.local_answer)
    LocalChannel(server.socket_path, 5.0, tokens.alice, proof).close()           # proves, then the token
    with pytest.raises(errors.TransportUnavailable):
        LocalChannel(server.socket_path, 5.0, tokens.alice, (hello.local_challenge, bytes(16)))
    channel = LocalChannel(server.socket_path, 5.0, tokens.alice, proof)
    channel._sock.sendall(framing.encode(framing.PROVE, hello.local_challenge))   # again, after the token
    code, message = channel._answer_frame()
    assert isinstance(errors.error_from_code(code, ""), errors.MalformedRequest)
    assert b"PROVE is only the connection's first frame" in message
    channel.close()
