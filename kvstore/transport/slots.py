"""What a data-plane transport needs from the node: resolve a frame to slot bytes, and hand them back.

Transports move bytes in and out of arena slots; they know nothing of tiers, leases or
gRPC. The node (server.py) wires a SlotResolver (the service) into them. A frame names
(lease, token, slot, length); the resolver checks the token and that the slot belongs to
the lease, and grants a memoryview of exactly that slot. The grant holds the slot (it is
neither freed nor reused) until the transport calls finish_transfer, or cut_transfer
when a write stopped part-way, which ends the lease so the torn page is never visible.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol


@dataclasses.dataclass(eq=False)
class Grant:
    lease: Any              # opaque to transports
    slot: int
    view: memoryview        # exactly the page's bytes in the arena
    deadline: float         # time.monotonic() when the lease expires; a transfer must end by then
    write: bool
    # a read of memory no other process has been able to write since the page was committed: the node
    # vouches for its bytes, so the reader need not hash them (kvstore/control/store_exposure.py)
    vouched: bool = False


class SlotResolver(Protocol):
    def bind(self, ticket: bytes) -> "SlotResolver":
        """The resolver of one connection whose HELLO showed `ticket`: it grants slots of that identity's leases only."""
        ...

    def resolve_write(self, lease_id: int, token: bytes, slot: int, nbytes: int) -> Grant: ...
    def resolve_read(self, lease_id: int, token: bytes, slot: int, nbytes: int) -> Grant: ...
    def finish_transfer(self, grant: Grant, arrived_checksum: int | None = None) -> None:
        """Hand the slot back; for a write, `arrived_checksum` is the xxh3 of its bytes once all had landed
        (taken by the transport on this node), so the Commit need not read the slot again."""
        ...

    def cut_transfer(self, grant: Grant) -> None: ...

    def open_calls(self) -> "ControlCalls":
        """The control calls of one connection that carries calls (tcp_framing.Op.CALL), as this identity."""
        ...


class ControlCalls(Protocol):
    def call(self, method_id: int, payload: bytes | bytearray | memoryview) -> bytes:
        """Serve one kvstore.v1 request (on a worker thread); the response's bytes, or the KVStoreError refusing it."""
        ...

    def holds_leases(self) -> bool:
        """Whether a lease its calls opened is open: the connection is not idle, whatever its frames."""
        ...

    def close(self) -> None:
        """The connection closed: the leases its calls opened end."""
        ...


@dataclasses.dataclass(frozen=True)
class QueuePairAddress:
    """Where an RC queue pair is reached (exchanged over RdmaConnect)."""

    lid: int
    gid: bytes
    qp_num: int
    psn: int
    mtu: int
    gid_type: str = ""      # "RoCE v2", "RoCE v1", or "" (InfiniBand, or unknown)


class RdmaAcceptor(Protocol):
    def accept(self, remote: QueuePairAddress) -> tuple[QueuePairAddress, int, int]:
        """Connect a local queue pair to `remote`; returns (its address, arena_addr, rkey)."""
        ...

    def touch(self, qp_num: int) -> None:
        """The queue pair is in use (it reserved or acquired pages): not idle."""
        ...

    def fence(self, qp_num: int) -> None:
        """Move the queue pair to error: nothing it still has in flight reaches the arena."""
        ...

    def disconnect(self, qp_num: int) -> None: ...
