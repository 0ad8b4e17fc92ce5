"""Pages in a shared page buffer are copied by the client and the node at once, and come back byte for byte.

A real node on loopback; the node's part of each move is checked by its effect: MOVE_PAGES sent by hand, with
the client claiming nothing, must leave every page copied by the node alone. Refusals are checked on a raw
local socket: a buffer the node must not map, offsets outside it, another connection's lease.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import socket
import struct
import threading

import numpy as np
import pytest

from kvstore_client import (KVStoreClient, Namespace, assisted_copy, errors, framing, native, shared_buffers,
                            shared_page_buffer)
from kvstore_client.arena import ArenaMapping
from kvstore_client.assisted_copy import _Bytes, _merged as _real_merged
from kvstore_client.channel import LocalChannel
from kvstore_client.pipeline import TAIL_COMMIT_BYTES
from kvstore_client.proto import pb

pytestmark = pytest.mark.skipif(native.copy_claimed is None, reason="kvstore_native is not installed")

PAGE = 256 << 10


def content(keys: list[str]) -> np.ndarray:
    """Each page's bytes derived from its key, so a page landed in another's place is seen."""
    return np.stack([np.random.default_rng(abs(hash(key)) % (1 << 32)).integers(0, 256, PAGE, dtype=np.uint8)
                     for key in keys])


@pytest.fixture
def ns():
    return Namespace(model="shared-buffers", page_bytes=PAGE, page_tokens=16, kv_dtype="bfloat16")


def test_puts_and_gets_through_a_shared_buffer_come_back_byte_for_byte(server, ns):
    keys = [f"shared{i}" for i in range(96)]
    data = content(keys)
    with KVStoreClient(server.address) as client:
        assert client.transport == "shm"
        source = shared_page_buffer(len(keys), PAGE)
        source[:] = data
        assert client.put(ns, keys, source) == len(keys)
        into = shared_page_buffer(len(keys), PAGE)
        assert client.get(ns, keys, into, verify=True) == len(keys)
        assert np.array_equal(into, data)
        plain = np.zeros_like(data)   # the same pages into a buffer the node cannot reach
        assert client.get(ns, keys, plain) == len(keys) and np.array_equal(plain, data)
        rows = [into[i] for i in range(0, len(keys), 2)]   # a list of rows, every other one
        for row in rows:
            row[:] = 0
        assert client.get(ns, keys[::2], rows) == len(rows)
        assert np.array_equal(into, data)


def test_the_node_copies_the_pages_the_client_leaves_it(server, ns, monkeypatch):
    """With the client's own part claiming nothing, the node alone puts every page in and gets it out."""
    keys = [f"node{i}" for i in range(16)]
    data = content(keys)
    moves = []

    def claims_nothing(cursor, into_buffer, arena, slot_offsets, buffer, buffer_offsets, page_bytes):
        moves.append(into_buffer)
        count = len(slot_offsets)
        return bytes(8 * count), bytes(count)

    monkeypatch.setattr(native, "copy_claimed", claims_nothing)
    with KVStoreClient(server.address) as client:
        source = shared_page_buffer(len(keys), PAGE)
        source[:] = data
        assert client.put(ns, keys, source) == len(keys)
        into = shared_page_buffer(len(keys), PAGE)
        assert client.get(ns, keys, into) == len(keys)
        assert np.array_equal(into, data)
    assert False in moves and True in moves
    with KVStoreClient(server.address) as client:   # what the node wrote was checked at commit as it is now
        out = np.zeros_like(data)
        assert client.get(ns, keys, out, verify=True) == len(keys) and np.array_equal(out, data)


def _memfd(size: int, seal: bool = True, fill: bool = True, read_only: bool = False) -> int:
    fd = os.memfd_create("test-buffer", os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    if fill:
        os.posix_fallocate(fd, 0, size)
    if seal:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | (fcntl.F_SEAL_WRITE if read_only else 0))
    return fd


def _file(path, size: int) -> int:
    fd = os.open(path, os.O_RDWR | os.O_CREAT)
    os.posix_fallocate(fd, 0, size)
    return fd


def _share(channel: LocalChannel, fd: int) -> int:
    answer = channel.submit_frame("ShareBuffer", framing.encode(framing.SHARE_BUFFER, b""), _Bytes, fd=fd).result()
    return struct.unpack("<I", answer)[0]


@pytest.mark.parametrize("what, make, message", [
    ("unsealed", lambda tmp: _memfd(1 << 20, seal=False), "sealed against shrinking"),
    ("sparse", lambda tmp: _memfd(1 << 20, fill=False), "all its pages allocated"),
    ("a file", lambda tmp: _file(tmp / "buffer", 1 << 20), "sealed against shrinking"),
    ("one page", lambda tmp: _memfd(4096), "more than one"),
    ("sealed against writes", lambda tmp: _memfd(1 << 20, read_only=True), "cannot map to read and write"),
    ("a ragged size", lambda tmp: _memfd(3 * 4096 + 100), "whole 4 KiB pages"),
])
def test_the_node_maps_only_buffers_nothing_can_make_it_fault_on(server, tmp_path, what, make, message):
    channel = LocalChannel(server.socket_path, 5)
    fd = make(tmp_path)
    try:
        with pytest.raises(errors.InvalidArgument, match=message):
            _share(channel, fd)
        assert channel.call("Hello", pb.HelloRequest()).instance_id   # the connection goes on
        good = _memfd(1 << 20)
        assert _share(channel, good) >= 1
        os.close(good)
    finally:
        os.close(fd)
        channel.close()


def test_a_share_without_its_memfd_closes_the_connection(server):
    sock = socket.socket(socket.AF_UNIX)
    sock.connect(server.socket_path)
    sock.sendall(framing.encode(framing.SHARE_BUFFER, b"") + b"\0")
    sock.settimeout(10)
    assert sock.recv(16) == b""
    sock.close()
    with KVStoreClient(server.address) as client:   # the node serves on
        assert client.stats() is not None


def test_moves_are_checked_before_any_byte_moves(server, ns):
    keys = [f"checked{i}" for i in range(4)]
    data = content(keys)
    with KVStoreClient(server.address) as client:
        assert client.put(ns, keys, data) == 4
        ns_id = client._namespace_id(ns)
    channel = LocalChannel(server.socket_path, 5)
    fd = _memfd(4096 + 4 * PAGE)
    buffer = mmap.mmap(fd, 4096 + 4 * PAGE)
    try:
        buffer_id = _share(channel, fd)
        acquired = channel.call("Acquire", pb.AcquireRequest(namespace_id=ns_id, keys=[k.encode() for k in keys]))
        offsets = np.arange(4, dtype=np.uint64) * PAGE + 4096
        indices = np.arange(4, dtype=np.uint32)

        def move(lease=acquired.lease_id, token=acquired.data_token, buffer=buffer_id, cursor=0, page=PAGE,
                 into=True, idx=indices, offs=offsets):
            frame = framing.encode(framing.MOVE_PAGES, framing.encode_move(lease, token, buffer, cursor, page, into,
                                                                            idx, offs))
            return channel.submit_frame("MovePages", frame, _Bytes).result()

        for call, error, message in [
            (lambda: move(buffer=buffer_id + 7), errors.InvalidArgument, "no shared buffer"),
            (lambda: move(cursor=64), errors.InvalidArgument, "claim counter"),
            (lambda: move(offs=offsets + 2 * PAGE), errors.InvalidArgument, "outside shared buffer"),
            (lambda: move(offs=offsets - 4096), errors.InvalidArgument, "outside shared buffer"),
            (lambda: move(token=bytes(len(acquired.data_token))), errors.TokenMismatch, "token"),
            (lambda: move(idx=indices + 2), errors.SlotNotInLease, "pins 4 pages"),
            (lambda: move(into=False), errors.SlotNotInLease, "read lease"),
            (lambda: move(page=PAGE // 2, offs=offsets[:1], idx=indices[:1]), errors.LengthMismatch, "whole pages"),
            (lambda: move(idx=np.zeros(5000, np.uint32), offs=np.full(5000, 4096, np.uint64)),
             errors.InvalidArgument, "batch_pages_max"),
            (lambda: move(idx=indices[:0], offs=offsets[:0]), errors.InvalidArgument, "1 to"),
            (lambda: move(page=0), errors.InvalidArgument, "at least a byte"),
        ]:
            with pytest.raises(error, match=message):
                call()
            assert not any(buffer[4096:])   # nothing was copied
        answer = move()   # the node copies all four: nobody else claims
        claimed = np.frombuffer(answer, np.uint8, 4)
        assert claimed.all()
        assert np.array_equal(np.frombuffer(buffer[4096:], np.uint8).reshape(4, PAGE), data)
        assert np.frombuffer(answer, np.uint64, 4, 4).tolist() == [native.module.xxh3_64(p.tobytes()) for p in data]
        channel.call("Release", pb.ReleaseRequest(lease_ids=[acquired.lease_id]))
    finally:
        buffer.close()
        os.close(fd)
        channel.close()


def test_a_commit_sent_before_its_moves_answer_takes_the_checksums_the_node_took(server, ns):
    """A put's Commit goes out before the answer to its move is read (CommitRequest.copied_by_node): the node has
    served the move by then, and records, for each page it copied, the checksum it took, never the writer's."""
    keys = [f"ahead{i}" for i in range(4)]
    data = content(keys)
    with KVStoreClient(server.address) as client:
        ns_id = client._namespace_id(ns)
    channel = LocalChannel(server.socket_path, 5)
    fd = _memfd(4096 + 4 * PAGE)
    buffer = mmap.mmap(fd, 4096 + 4 * PAGE)
    buffer[4096:] = data.tobytes()
    try:
        buffer_id = _share(channel, fd)

        def reserve(names: list[str]) -> pb.ReserveResponse:
            return channel.call("Reserve", pb.ReserveRequest(namespace_id=ns_id, keys=[k.encode() for k in names],
                                                             page_bytes=PAGE))

        def commit(lease_id: int, flags: bytes, **fields) -> pb.CommitResponse:   # of both pages of the lease
            fields = {"checksums_from_writer": True, **fields}
            return channel.call("Commit", pb.CommitRequest(lease_id=lease_id, checksums=[0, 0], copied_by_node=flags,
                                                           **fields))

        lease = reserve(keys[:2])
        for flags, fields, message in [
            (b"\1\1", {"checksums_from_writer": False}, "comes with checksums_from_writer"),
            (b"\1\2", {}, "each 0 or 1"),
            (b"\1", {}, "1 copied_by_node flags for 2 pages"),
            (b"\1\0", {}, "no move of this node copied it"),
        ]:
            with pytest.raises(errors.InvalidArgument, match=message):
                commit(lease.lease_id, flags, **fields)
        assert channel.call("Abort", pb.AbortRequest(lease_id=lease.lease_id)).aborted_pages == 2

        lease = reserve(keys)
        move = framing.encode_move(lease.lease_id, lease.data_token, buffer_id, 0, PAGE, False,
                                   np.arange(4, dtype=np.uint32), np.arange(4, dtype=np.uint64) * PAGE + 4096)
        moved = channel.submit_frame("MovePages", framing.encode(framing.MOVE_PAGES, move), _Bytes)
        committed = channel.submit("Commit", pb.CommitRequest(lease_id=lease.lease_id, checksums=[0] * 4,
                                                              checksums_from_writer=True, copied_by_node=b"\1" * 4))
        assert np.frombuffer(moved.result(), np.uint8, 4).all()   # nobody else claimed: the node copied all four
        assert list(committed.result().states) == [pb.COMMITTED] * 4
    finally:
        buffer.close()
        os.close(fd)
        channel.close()
    with KVStoreClient(server.address) as client:   # recorded as the node took them: 0 would fail every get
        out = np.zeros_like(data)
        assert client.get(ns, keys, out, verify=True) == 4 and np.array_equal(out, data)


class _Injected(Exception):
    pass


def _tail_copy_fails(*args):
    raise _Injected("the copy of the put's last run failed")


@pytest.mark.parametrize("how", ["commit refused", "copy after it failed"])
def test_a_put_that_fails_after_a_commit_sent_ahead_reads_its_moves_answer_first(server, ns, monkeypatch, how):
    """A Commit sent ahead of its move's answer may be refused, or a later step of the put may fail: either way the
    put reads that answer before it raises (the node is done with the buffer, and the claim counter goes back to
    it), and aborts its lease: what a Commit published before the failure stays, whole."""
    keys = [f"{how}{i}" for i in range(16)]   # a shared move of 12 pages, then the last 4 copied alone
    data = content(keys)
    made, settled = [], []

    class Watched(assisted_copy.MoveInFlight):
        def __init__(self, *args):
            super().__init__(*args)
            if how == "commit refused":
                self.copied_by_node = b"\2" * len(self.copied_by_node)   # refused by the node's checks
            made.append(self)

        def settle(self):
            settled.append(self)
            return super().settle()

    monkeypatch.setattr(assisted_copy, "MoveInFlight", Watched)
    if how == "copy after it failed":
        monkeypatch.setattr(ArenaMapping, "write_hashed", _tail_copy_fails)
    with KVStoreClient(server.address) as client:
        source = shared_page_buffer(len(keys), PAGE)
        source[:] = data
        with pytest.raises((errors.InvalidArgument, _Injected), match="each 0 or 1|last run failed"):
            client.put(ns, keys, source)
        assert len(made) == 1 and settled == made
        [shared] = [b for b in shared_buffers.live_buffers() if b.base <= source.ctypes.data < b.base + b.size]
        assert len(shared._free) == shared_buffers.CURSORS   # every claim counter is back
        # The refused Commit made nothing visible; the one sent before a later step failed stands, read whole.
        visible = client.lookup(ns, keys)
        assert visible == (0 if how == "commit refused" else 12)
        out = np.zeros_like(data)
        assert client.get(ns, keys, out, verify=True) == visible and np.array_equal(out[:visible], data[:visible])
        monkeypatch.undo()
        assert client.put(ns, keys, source) == len(keys)
        out = np.zeros_like(data)
        assert client.get(ns, keys, out, verify=True) == len(keys) and np.array_equal(out, data)


def test_a_dropped_buffer_is_unshared(server, ns, monkeypatch):
    """More buffers than a connection may share at once (peer_buffers.BUFFERS_MAX), each used and dropped in
    turn: every one is still moved with the node, as each dropped one was unshared."""
    import gc

    from kvstore_client import assisted_copy
    from kvstore.control.peer_buffers import BUFFERS_MAX

    moved = []
    monkeypatch.setattr(assisted_copy, "_merged", lambda mine, theirs, count: moved.append(count) or
                        _real_merged(mine, theirs, count))
    keys = [f"dropped{i}" for i in range(8)]
    data = content(keys)
    with KVStoreClient(server.address) as client:
        for _ in range(BUFFERS_MAX + 6):
            buffer = shared_page_buffer(len(keys), PAGE)
            buffer[:] = data
            client.put(ns, keys, buffer)
            out = shared_page_buffer(len(keys), PAGE)
            assert client.get(ns, keys, out) == len(keys) and np.array_equal(out, data)
            del buffer, out
            gc.collect()
    assert moved.count(len(keys)) == BUFFERS_MAX + 6   # each get (the puts after the first store nothing new)


def test_copy_claimed_claims_at_most_its_pages_whatever_the_counter_says():
    """The other process may rewind the counter over and over: a call still returns after as many claims as it
    has pages (a loop until the counter passes the end would never return), with each page it claimed whole."""
    pages, page = 8, 4096
    arena = np.zeros((pages, page), np.uint8)
    source = np.random.default_rng(3).integers(0, 256, (pages, page), dtype=np.uint8)
    counter = np.zeros(8, np.uint64)
    offsets = memoryview(np.arange(pages, dtype=np.uint64) * page).cast("B").cast("Q")
    stop, returned = threading.Event(), []

    def rewind():
        while not stop.is_set():
            counter[0] = 0

    def claim():
        for _ in range(200):
            returned.append(native.copy_claimed(counter.ctypes.data, False, arena.ctypes.data, offsets,
                                                source.ctypes.data, offsets, page))

    rewinder, claimer = threading.Thread(target=rewind), threading.Thread(target=claim)
    rewinder.start()
    claimer.start()
    claimer.join(60)
    stop.set()
    rewinder.join()
    assert not claimer.is_alive() and len(returned) == 200
    for sums, claimed in returned:
        for i in np.flatnonzero(np.frombuffer(claimed, np.uint8)):
            assert np.frombuffer(sums, np.uint64)[i] == native.module.xxh3_64(source[i].tobytes())
    assert np.array_equal(arena[[i for _, c in returned for i in np.flatnonzero(np.frombuffer(c, np.uint8))]],
                          source[[i for _, c in returned for i in np.flatnonzero(np.frombuffer(c, np.uint8))]])
    counter[0] = 0
    arena[:] = 0
    sums, claimed = native.copy_claimed(counter.ctypes.data, False, arena.ctypes.data, offsets,
                                        source.ctypes.data, offsets, page)
    assert all(claimed) and np.array_equal(arena, source) and counter[0] == pages
    assert np.frombuffer(sums, np.uint64).tolist() == [native.module.xxh3_64(p.tobytes()) for p in source]


def test_the_async_client_moves_shared_buffers_with_the_node(server, ns, monkeypatch):
    import asyncio

    from kvstore_client import AsyncKVStoreClient, assisted_copy

    moved = []
    monkeypatch.setattr(assisted_copy, "_merged", lambda mine, theirs, count: moved.append(count) or
                        _real_merged(mine, theirs, count))
    keys = [f"async{i}" for i in range(16)]
    data = content(keys)

    async def main():
        async with AsyncKVStoreClient(server.address) as client:
            source = shared_page_buffer(len(keys), PAGE)
            source[:] = data
            assert await client.put(ns, keys, buffers=source) == len(keys)
            into = shared_page_buffer(len(keys), PAGE)
            assert await client.get(ns, keys, into) == len(keys)
            return into

    assert np.array_equal(asyncio.run(main()), data)
    tail = TAIL_COMMIT_BYTES // PAGE   # the put's last Commit run, too small a move to share (MOVE_BYTES_MIN)
    assert sum(moved) == (len(keys) - tail) + len(keys)


def test_the_node_maps_a_buffer_whole_when_it_is_shared(server, ns):
    """The node fills in its page tables for a buffer as it takes it (else its first touch of each 4 KiB page is a
    fault inside its copy): after one move of 2 MiB out of a 16 MiB buffer, all 16 MiB are resident in the node."""
    keys = [f"mapped{i}" for i in range(12)]   # one move of 8 pages, then the last 1 MiB alone
    with KVStoreClient(server.address) as client:
        source = shared_page_buffer(64, PAGE)
        source[:12] = content(keys)
        assert client.put(ns, keys, source[:12]) == len(keys)
        assert _resident_bytes(server.process.pid, "/memfd:kvstore-shared-pages") >= 64 * PAGE


def _resident_bytes(pid: int, name: str) -> int:
    """What process `pid` has resident of its mappings of files named `name` (/proc/PID/smaps)."""
    total, counting = 0, False
    with open(f"/proc/{pid}/smaps") as smaps:
        for line in smaps:
            fields = line.split()
            if not fields[0].endswith(":"):   # a mapping's header: range, perms, offset, dev, inode, path
                counting = len(fields) >= 6 and fields[5] == name
            elif counting and fields[0] == "Rss:":
                total += int(fields[1]) * 1024
    return total
