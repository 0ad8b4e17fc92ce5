"""Which data path a client tries, in order: a pure decision, tried by the client.

"auto": shared memory when the node offers it (it works only on the node's host, for an
allowed uid: the client tries it and moves on when it fails), then RDMA when the node has
registered its arena and this host has a device, then TCP. A named transport is the only
candidate: it works or the client fails with the reason.
"""

from __future__ import annotations

from kvstore_client import errors

TRANSPORTS = ("auto", "shm", "rdma", "tcp")


def candidates(requested: str, shm_offered: bool, rdma_offered: bool, tcp_offered: bool,
               rdma_device_here: bool) -> list[str]:
    if requested not in TRANSPORTS:
        raise errors.InvalidArgument(f"transport must be one of {', '.join(TRANSPORTS)}; got {requested!r}")
    offered = {"shm": shm_offered, "rdma": rdma_offered, "tcp": tcp_offered}
    if requested != "auto":
        if not offered[requested]:
            raise errors.TransportUnavailable(f"the node does not offer the {requested} data plane")
        return [requested]
    order = [name for name in ("shm", "rdma", "tcp") if offered[name]]
    if not rdma_device_here and "rdma" in order:
        order.remove("rdma")
    if not order:
        raise errors.TransportUnavailable("the node offers no data plane this client can use (shm, rdma, tcp)")
    return order
