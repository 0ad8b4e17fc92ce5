"""How a node proves, on its Unix socket, that it is the node a client's Hello reached over gRPC.

A client learns the socket's path from Hello and dials it on its own host. Whoever listens at that
path there (another user's socket, or anything at all when the client runs on another host than
the node) would receive the client's first frames, its bearer token among them. So Hello hands
each caller a fresh random challenge and the answer to it, HMAC-SHA256 under a key this process
drew at start and never shows; the client's first frame on the socket shows the challenge, and it
goes on only if the socket answers exactly that. Nobody else can compute the answer, and a relay
would need the node's own socket, which is where the client already is.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

CHALLENGE_BYTES = 16
ANSWER_BYTES = 16


class LocalProof:
    def __init__(self) -> None:
        self._key = secrets.token_bytes(32)

    def issue(self) -> tuple[bytes, bytes]:
        """(challenge, answer) for one Hello."""
        challenge = secrets.token_bytes(CHALLENGE_BYTES)
        return challenge, self.answer(challenge)

    def answer(self, challenge: bytes) -> bytes:
        return hmac.new(self._key, challenge, hashlib.sha256).digest()[:ANSWER_BYTES]
