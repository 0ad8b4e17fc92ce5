"""Mooncake's Transfer Engine over its TCP transport, as a peer in bench/tcp_throughput.py (never collected by pytest).

The transfer engine binds every interface and refuses to start without a non-loopback address,
so the benchmark first moves itself into a private network namespace (_mooncake_peer.private_network:
lo plus a veth pair; needs root), and every server of the run, kvstore's included, starts inside it.
A target process registers one buffer; this process is the initiator, with the benchmark's source
and destination arrays registered, and moves each batch with one batch_transfer_sync_write (put)
or batch_transfer_sync_read (get) of page-sized pieces: Mooncake's own pipelining of a batch.
Handshake without a metadata server (P2PHANDSHAKE).
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np

import _mooncake_peer

HOST = "10.99.0.1"   # the veth address private_network() gives this namespace


def unavailable_reason() -> str:
    """Why the Transfer Engine peer cannot run here ("" when it can)."""
    reason = _mooncake_peer.unavailable_reason()
    if reason:
        return reason
    try:
        from mooncake.engine import TransferEngine  # noqa: F401
    except ImportError as exc:
        return f"mooncake.engine (the Transfer Engine) does not import: {exc}"
    return ""


def _engine():
    from mooncake.engine import TransferEngine

    engine = TransferEngine()
    if engine.initialize(HOST, "P2PHANDSHAKE", "tcp", "") != 0:
        raise RuntimeError(f"Mooncake's Transfer Engine did not start on {HOST} over tcp")
    return engine


class TransferEnginePeer:
    """A target holding `nbytes` on `cpus`; put/get move pages between local arrays and it."""

    def __init__(self, nbytes: int, cpus: str):
        self.process = subprocess.Popen(["taskset", "-c", cpus, sys.executable, os.path.abspath(__file__),
                                         str(nbytes)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        port, self.remote = map(int, self.process.stdout.readline().split())
        self.target = f"{HOST}:{port}"
        self.engine = _engine()
        self.registered: list[int] = []

    def register(self, *arrays: np.ndarray) -> None:
        for array in arrays:
            if self.engine.register_memory(array.ctypes.data, array.nbytes) != 0:
                raise RuntimeError("Mooncake's Transfer Engine refused to register a buffer")
            self.registered.append(array.ctypes.data)

    def put(self, pages: np.ndarray, first_slot: int) -> None:
        self._move(self.engine.batch_transfer_sync_write, pages, first_slot)

    def get(self, out: np.ndarray, first_slot: int) -> None:
        self._move(self.engine.batch_transfer_sync_read, out, first_slot)

    def _move(self, transfer, local: np.ndarray, first_slot: int) -> None:
        count, page_bytes = local.shape
        rc = transfer(self.target, [local.ctypes.data + i * page_bytes for i in range(count)],
                      [self.remote + (first_slot + i) * page_bytes for i in range(count)], [page_bytes] * count)
        if rc != 0:
            raise RuntimeError(f"Mooncake's Transfer Engine batch failed (rc {rc})")

    def stop(self) -> None:
        for address in self.registered:
            self.engine.unregister_memory(address)
        self.process.stdin.close()
        self.process.wait(30)


def serve(nbytes: int) -> None:
    """The target: register one buffer, print its rpc port and address, serve until stdin closes."""
    engine = _engine()
    buffer = np.ones(nbytes, dtype=np.uint8)
    if engine.register_memory(buffer.ctypes.data, buffer.nbytes) != 0:
        raise RuntimeError("Mooncake's Transfer Engine refused to register the target buffer")
    sys.stdout.write(f"{engine.get_rpc_port()} {buffer.ctypes.data}\n")
    sys.stdout.flush()
    sys.stdin.read()


if __name__ == "__main__":
    serve(int(sys.argv[1]))
