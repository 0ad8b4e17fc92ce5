"""A raw Python socket peer for bench/tcp_throughput.py: the same exchange as kvstore's TCP data plane, nothing else.

    python bench/_raw_peer.py BUFFER_BYTES [CONGESTION]

Prints its port, then serves one connection at a time from one page-aligned buffer:
    request  = u8 op | u32 slot | u32 length      (op 1: PUT, body follows; op 2: GET)
    response = 8-byte header, then the page for a GET
PUT bodies are received straight into the buffer (recv_into), GET pages sent straight out
of it (sendmsg of a memoryview): the floor any Python TCP data plane can reach.
"""

from __future__ import annotations

import socket
import struct
import sys

import numpy as np

REQUEST = struct.Struct("<BII")
RESPONSE = struct.Struct("<BBHI")


def recv_exact(conn: socket.socket, view: memoryview) -> bool:
    got = 0
    while got < len(view):
        n = conn.recv_into(view[got:])
        if n == 0:
            return False
        got += n
    return True


def serve(conn: socket.socket, buffer: memoryview) -> None:
    header = bytearray(REQUEST.size)
    while recv_exact(conn, memoryview(header)):
        op, slot, length = REQUEST.unpack(header)
        page = buffer[slot * length:(slot + 1) * length]
        if op == 1:
            if not recv_exact(conn, page):
                return
            conn.sendall(RESPONSE.pack(0, 1, 0, 0))
        else:
            conn.sendmsg([RESPONSE.pack(0, 2, 0, length), page])


def main() -> None:
    nbytes = int(sys.argv[1])
    congestion = sys.argv[2] if len(sys.argv) > 2 else ""
    raw = np.empty(nbytes + 4096, dtype=np.uint8)
    start = -raw.ctypes.data % 4096
    buffer = memoryview(raw[start:start + nbytes])
    buffer[:] = b"\x01" * nbytes
    listener = socket.create_server(("127.0.0.1", 0))
    sys.stdout.write(f"{listener.getsockname()[1]}\n")
    sys.stdout.flush()
    while True:
        conn, _ = listener.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if congestion:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, congestion.encode())
        with conn:
            serve(conn, buffer)


if __name__ == "__main__":
    main()
