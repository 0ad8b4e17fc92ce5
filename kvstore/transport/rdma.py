"""The server side of the RDMA data plane: the arena registered as one memory region.

NEVER RUN ON A DEVICE (no RDMA NIC where this was written; see
kvstore_client/rdma_transport.py for what is and is not tested). The node registers the
arena once (remote read and write), and for each client's RdmaConnect connects one RC
queue pair of its own to the client's; the client then reads and writes slots with
one-sided operations and commits or releases over gRPC, exactly as with shared memory.

Trust: one-sided operations bypass the server's CPU, so the per-lease token of the TCP
data plane cannot be checked; a connected queue pair can reach the whole arena, as a
shared-memory client that maps it can. Offer RDMA only to trusted hosts. At most
queue_pairs_max queue pairs are kept; the oldest is closed to admit a new one.
"""

from __future__ import annotations

import collections
import ctypes
import logging
import threading

from kvstore.transport.slots import QueuePairAddress
from kvstore_client.rdma_transport import QueuePairEnd, open_device

log = logging.getLogger(__name__)


class RdmaServer:
    def __init__(self, device: str, port: int, gid_index: int, queue_pairs_max: int, arena: memoryview):
        self._context, self._pd = open_device(device)
        from pyverbs import enums as e, mr

        self.port, self.gid_index, self.queue_pairs_max = port, gid_index, queue_pairs_max
        self.arena_addr = ctypes.addressof(ctypes.c_char.from_buffer(arena))
        access = e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE | e.IBV_ACCESS_REMOTE_READ
        self._mr = mr.MR(self._pd, len(arena), access, address=self.arena_addr)
        self._ends: collections.OrderedDict[int, QueuePairEnd] = collections.OrderedDict()
        self._lock = threading.Lock()
        log.info("rdma arena registered device=%s bytes=%d rkey=%#x", device or "(first)", len(arena), self._mr.rkey)

    def accept(self, remote: QueuePairAddress) -> tuple[QueuePairAddress, int, int]:
        end = QueuePairEnd(self._context, self._pd, self.port, self.gid_index)
        end.connect(remote.lid, remote.gid, remote.qp_num, remote.psn, remote.mtu)
        with self._lock:
            self._ends[end.qp.qp_num] = end
            while len(self._ends) > self.queue_pairs_max:
                self._ends.popitem(last=False)[1].close()
        lid, gid, qp_num, psn, mtu = end.local
        return QueuePairAddress(lid, gid, qp_num, psn, mtu), self.arena_addr, self._mr.rkey

    def close(self) -> None:
        with self._lock:
            for end in self._ends.values():
                end.close()
            self._ends.clear()
        self._mr.close()
        self._pd.close()
        self._context.close()
