"""Control calls carried on a TCP data-plane connection (tcp_framing.Op.CALL), as its identity.

A TCP client pays for each gRPC call from Python about 0.5-1 ms of its own CPU and as much of the
node's; a put or get of 64 MiB makes two (Reserve and Commit, Acquire and Release), about a tenth of
its time on loopback. On a connection of its own to the TCP data plane the same kvstore.v1 messages
cost tens of microseconds and pipeline, answered in order, like the local channel's
(local_server.py). The connection's identity is the one its HELLO showed (or the trusted one where
the node has no authentication); its token is checked before every call, and the leases its calls
open end when the connection closes, so a client killed mid-put frees its slots at once.
"""

from __future__ import annotations

from kvstore.control.identity import Caller, Identity, TokenStanding
from kvstore_client import framing


class ConnectionCalls:
    """The calls of one connection; `call` runs on a worker thread, one call of a connection at a time."""

    def __init__(self, service, identity: Identity, standing: TokenStanding):
        self._service = service
        self._owner = Caller(identity)
        self._standing = standing

    def call(self, method_id: int, payload: bytes | bytearray | memoryview) -> bytes:
        """The serialized response to one request; raises the KVStoreError it is refused with."""
        self._standing.check("tcp")
        name, request = framing.decode_call(method_id, payload)
        return self._service.handle(name, request, self._owner).SerializeToString()

    def holds_leases(self) -> bool:
        """Whether a lease its calls opened is still open (a put between its Reserve and its Commit)."""
        return self._service.store.owns_leases(self._owner)

    def close(self) -> None:
        """The connection closed: the leases its calls opened end now, not by their TTL."""
        self._service.end_owner(self._owner)
