"""NVMe tier: pages in N LMDB environments ("shards"), one directory each: several in a path, so that a disk
takes several transactions at once (nvme_layout.py), and paths on several disks.

A page goes to the shard its key hashes to. Each shard has three named databases, and a
page's header and bytes are written in one transaction, so a page is on disk whole or not
at all:
    meta        ns_id(8 LE) + key -> header (format version, where the bytes are, namespace, page size,
                                          checksum, parent key)
    data        ns_id(8 LE) + key -> page bytes
    namespaces  ns_id(8 LE)       -> namespace spec (JSON), so a restart knows what pages mean
Start-up rebuilds the index from `meta` alone: dense B-tree leaves, no page bytes read.
A shard belongs to one node: start-up takes an exclusive flock on LOCK_FILE in its
directory and refuses, naming the holder's pid, if another kvstore-server has it.

LMDB flags, chosen for a cache whose pages must never be served corrupt:
- sync=True, metasync=False (MDB_NOMETASYNC): each write transaction flushes its data pages
  but not the meta page. A process crash (SIGKILL) loses nothing committed to LMDB; an OS
  crash or power loss may undo the last committed transaction, never more, and never
  corrupts. Pages committed to the node but not yet written down live only in DRAM and go
  with the process: a client that needs a page to survive a kill commits it with `durable`.
- writemap=False: a stray write through a mapping cannot reach the file, and the file grows
  only as pages are written (map_bytes is an upper bound, not an allocation).
- readahead=False: pages are not read through the mapping at all (see read_into), and
  B-tree lookups are random, so readahead on the mapping would only pull in neighbours.
Large page bodies are read with O_DIRECT at the place the header records (read_into): the
file's layout stays LMDB's own, so crash safety and start-up are LMDB's alone.
- max_readers sized for the server's threads; lock=True (readers and the writer in one process
  may be several threads).

A damaged shard costs its pages, never the node. Before LMDB maps data.mdb, its two meta pages
are checked (page flags, magic, version, page size) and the file must hold every page the
newer one claims: LMDB reads B-tree pages through the mapping, and a page past the file's end
is a SIGBUS. The same size check runs before each batch touches a shard mid-run (a file cut
while the node runs). A shard that fails it, whose meta pages are unreadable, or on which
LMDB reports damage (MDB_CORRUPTED, a page not found) is quarantined: its data.mdb is renamed
to data.mdb.quarantined-<UTC time> for an operator to inspect, nothing is deleted, and its
pages read as missing. At start-up a fresh empty shard takes its place (keys keep hashing
to the same shard, and the tier keeps its capacity); mid-run the shard is left out until
the next start-up, since other threads may be inside its environment.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import dataclasses
import fcntl
import json
import logging
import os
import struct
import threading
import time
from typing import Iterator

import lmdb
import numpy as np
import xxhash

from kvstore_client import native

log = logging.getLogger(__name__)

# py-lmdb holds the GIL through every LMDB call unless told otherwise, so a write-down's
# commit (its writes and fsync) would stall every other thread of the node, gets included.
lmdb.enable_drop_gil()

FORMAT_VERSION = 1
# version, parent key length, body page, namespace id, page bytes, checksum; then the parent key.
# The body page is the first LMDB page of the page's bytes in data.mdb (0: not recorded; page 0
# is LMDB's meta page, never a value's), so a read need not go through LMDB's value at all. It
# stays true because a header and its bytes are only ever written and deleted together, in one
# transaction, by the one node that holds the shard's lock.
HEADER = struct.Struct("<HHIQQQ")
# LMDB's page header, at the start of each run of overflow pages holding a large value: the
# value's bytes follow it. A read checks its page number (bytes 0-8) and its count of pages
# (bytes 12-16) against what it expects.
LMDB_PAGE_HEADER = 16
BODY_PAGE_MAX = (1 << 32) - 1
PARENT_BYTES_MAX = 64
# In each shard directory, flocked by the one node that uses it (its pid inside).
LOCK_FILE = "kvstore.lock"
DATA_FILE = "data.mdb"   # LMDB's file of a shard's pages, in its directory
# Page bodies at least this large are read with O_DIRECT, smaller ones through the page cache
# (for those, the block-aligned read and the extra copy would cost more than they save).
DIRECT_READ_MIN_BYTES = 64 << 10
DIRECT_ALIGN = 4096  # O_DIRECT offsets, lengths and buffers: multiples of this
# LMDB's meta pages (pages 0 and 1 of data.mdb): its page header (page number, pad, flags), then
# MDB_meta: magic, data version, map address, map size, the free and main DBs (48 bytes each; the
# free DB's first field holds the page size), the last page used, the transaction id.
LMDB_META = struct.Struct("<QHH4x" "IIQQ" "I44x" "48x" "QQ")
LMDB_MAGIC = 0xBEEFC0DE
LMDB_DATA_VERSION = 1
LMDB_P_META = 0x08
QUARANTINE_SUFFIX = ".quarantined-"
# What LMDB raises for a damaged file (as opposed to a full map or disk, or a bad argument).
LMDB_DAMAGE = (lmdb.CorruptedError, lmdb.PageNotFoundError, lmdb.InvalidError, lmdb.VersionMismatchError,
               lmdb.PanicError, lmdb.BadTxnError)
# A read of a page on a quarantined shard: no checksum (xxh3-64 is unsigned), so never a match.
MISSING = -1


class NvmeError(OSError):
    """A shard could not be written (I/O error, directory gone): the pages stay in DRAM only."""


class NvmeShardQuarantined(NvmeError):
    """The shard was quarantined (its file is damaged): its pages stay in DRAM only until a restart."""

    def __init__(self, shard: int):
        super().__init__(f"NVMe shard {shard} is quarantined")
        self.shard = shard


class NvmeFull(NvmeError):
    """A shard's map or its disk is full: evict pages from it, then write again."""

    def __init__(self, shard: int):
        super().__init__(f"NVMe shard {shard} is full")
        self.shard = shard


@dataclasses.dataclass(frozen=True)
class StoredPage:
    namespace_id: int
    key: bytes
    parent_key: bytes
    page_bytes: int
    checksum: int


def record_key(namespace_id: int, key: bytes) -> bytes:
    return namespace_id.to_bytes(8, "little") + key


def encode_header(page: StoredPage, body_page: int = 0) -> bytes:
    return HEADER.pack(FORMAT_VERSION, len(page.parent_key), body_page, page.namespace_id, page.page_bytes,
                       page.checksum) + page.parent_key


def _body_page(value: memoryview) -> int:
    """The LMDB page a value just put in this write transaction starts on, from the header of
    its overflow page (the dirty copy that commit writes at that page); 0 for a value small
    enough to sit in a B-tree leaf, or past what the header can record."""
    if len(value) < DIRECT_READ_MIN_BYTES:
        return 0
    address = np.frombuffer(value, np.uint8).ctypes.data - LMDB_PAGE_HEADER
    page = int.from_bytes(ctypes.string_at(address, 8), "little")
    return page if page <= BODY_PAGE_MAX else 0


def _free_bytes(path: str) -> int:
    try:
        stat = os.statvfs(path)
    except OSError:
        return 0
    return stat.f_bavail * stat.f_frsize


def _map_address(path: str, fd: int) -> int | None:
    """Where LMDB mapped data.mdb in this process (LMDB only reports it with MDB_FIXEDMAP).

    Read from /proc/self/maps and confirmed by comparing the mapping's first bytes with the
    file's; None (reads then go through the mapping) if either step fails.
    """
    real = os.path.realpath(path)
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                fields = line.split()
                if len(fields) >= 6 and fields[5] == real and int(fields[2], 16) == 0:
                    start = int(fields[0].split("-")[0], 16)
                    if ctypes.string_at(start, 64) == os.pread(fd, 64, 0):
                        return start
    except OSError:
        pass
    log.warning("mapping of %s not found; NVMe reads go through the mapping", path)
    return None


@dataclasses.dataclass(frozen=True)
class Quarantine:
    shard: int
    path: str        # the shard's directory
    moved_to: str    # where its data.mdb now is ("" if it could not be renamed)
    cause: str
    at_start: bool   # found at start-up (a fresh shard took its place) or mid-run (left out)


def check_data_file(path: str) -> str:
    """Why LMDB must not map this data.mdb ("" when it may): unreadable or inconsistent meta
    pages, or a file shorter than the pages its newer meta page claims. A missing or empty
    file is a new shard."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size == 0:
                return ""
            first = os.pread(f.fileno(), LMDB_META.size, 0)
            if len(first) < LMDB_META.size:
                return f"file is {size} bytes, shorter than a meta page"
            page_size = LMDB_META.unpack(first)[7]
            if page_size < 512 or page_size > 1 << 16 or page_size & (page_size - 1):
                return f"meta page 0 is damaged (page size {page_size})"
            metas = [first, os.pread(f.fileno(), LMDB_META.size, page_size)]
    except FileNotFoundError:
        return ""
    except OSError as exc:
        return f"cannot read its meta pages: {exc}"
    newest = None
    for number, raw in enumerate(metas):
        if len(raw) < LMDB_META.size:
            return f"file is {size} bytes, shorter than its second meta page"
        pgno, _, flags, magic, version, _, _, psize, last_page, txn_id = LMDB_META.unpack(raw)
        if pgno != number or not flags & LMDB_P_META or magic != LMDB_MAGIC:
            return f"meta page {number} is damaged (no LMDB meta page there)"
        if version != LMDB_DATA_VERSION or psize != page_size:
            return f"meta page {number} is damaged (version {version}, page size {psize})"
        if newest is None or txn_id > newest[1]:
            newest = (last_page, txn_id)
    needed = (newest[0] + 1) * page_size
    if size < needed:
        return f"file is {size} bytes, its meta page claims {needed} (last page {newest[0]}): truncated"
    return ""


def _move_aside(data_path: str) -> str:
    """Rename a damaged data.mdb to data.mdb.quarantined-<UTC time>; returns the new path ("" if it failed)."""
    moved_to = data_path + QUARANTINE_SUFFIX + time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    if os.path.exists(moved_to):   # damaged twice within a second: keep both
        moved_to += f".{time.time_ns()}"
    try:
        os.rename(data_path, moved_to)
    except OSError as exc:
        log.error("cannot move damaged NVMe shard file %s aside: %s", data_path, exc)
        return ""
    return moved_to


class _Shard:
    def __init__(self, index: int, path: str, map_bytes: int):
        self.index = index
        self.path = path
        self.data_path = os.path.join(path, DATA_FILE)
        self.quarantine: Quarantine | None = None
        try:
            os.makedirs(path, exist_ok=True)
        except OSError as exc:
            raise OSError(f"cannot open NVMe shard {path} (nvme.paths): {exc}") from None
        # Before LMDB: its own lock lets two processes share an environment, and two
        # nodes writing and evicting each other's pages would corrupt both indexes.
        self._lock_fd = _lock_shard(path)
        self._map_bytes = map_bytes
        self.lock = threading.Lock()
        self.page_bytes = 0        # bytes of the pages stored here, by this process's count
        try:
            cause = check_data_file(self.data_path)
            if cause:
                self.replace(cause)
            else:
                try:
                    self._open()
                except LMDB_DAMAGE as exc:
                    self.replace(f"LMDB cannot open it: {exc}")
        except (OSError, lmdb.Error) as exc:
            os.close(self._lock_fd)
            raise OSError(f"cannot open NVMe shard {path} (nvme.paths): {exc}") from None

    def _open(self) -> None:
        env = lmdb.open(self.path, map_size=self._map_bytes, subdir=True, max_dbs=3, sync=True, metasync=False,
                        writemap=False, readahead=False, max_readers=256, lock=True)
        try:
            # Named databases are records of the main B-tree: damage there shows here.
            self.meta = env.open_db(b"meta")
            self.data = env.open_db(b"data")
            self.namespaces = env.open_db(b"namespaces")
        except lmdb.Error:
            env.close()
            raise
        self.env = env
        self.data_fd = os.open(self.data_path, os.O_RDONLY | os.O_CLOEXEC)
        self.map_address = _map_address(self.data_path, self.data_fd)
        self.direct_fd = _open_direct(self.data_path)
        self.page_size = self.env.stat()["psize"]

    def replace(self, cause: str) -> None:
        """Start-up only (no other thread uses the shard): move the damaged file aside and open a
        fresh, empty shard in its place."""
        if getattr(self, "env", None) is not None:
            self._close_env()
        moved_to = _move_aside(self.data_path)
        self.quarantine = Quarantine(self.index, self.path, moved_to, cause, True)
        log.error("NVMe shard %s quarantined: %s; its file is now %s and a fresh empty shard serves in its place "
                  "(its pages are lost to this node)", self.data_path, cause, moved_to or "(not moved)")
        if not moved_to:
            raise OSError(f"damaged shard file {self.data_path} cannot be moved aside ({cause})")
        self._open()

    def quarantine_now(self, cause: str) -> None:
        """Mid-run: leave the shard out until the next start-up; its file is moved aside now.
        Its environment stays open (other threads may be inside it) but is no longer used."""
        with self.lock:
            if self.quarantine is not None:
                return
            self.quarantine = Quarantine(self.index, self.path, "", cause, False)
        moved_to = _move_aside(self.data_path)
        self.quarantine = dataclasses.replace(self.quarantine, moved_to=moved_to)
        log.error("NVMe shard %s quarantined: %s; its file is now %s; the shard is left out until the next start-up "
                  "(its pages read as missing)", self.data_path, cause, moved_to or "(not moved)")

    @property
    def left_out(self) -> bool:
        """Quarantined mid-run: no longer used until the next start-up."""
        return self.quarantine is not None and not self.quarantine.at_start

    def size_fault(self) -> str:
        """Why the mapped file cannot be read now ("" when it can): shorter than the pages LMDB
        may touch. Checked before touching the map, since a read past its end is a SIGBUS."""
        size = os.fstat(self.data_fd).st_size
        if size < 2 * self.page_size:   # the meta pages themselves are gone
            return f"file is {size} bytes, shorter than its meta pages: truncated"
        needed = (self.env.info()["last_pgno"] + 1) * self.page_size
        # The size again, read after the meta page: another thread's commit (write-down runs on the controller
        # and on RPC threads making room) may have grown the file and moved last_pgno between the two reads.
        # A file only grows, so read in this order a commit cannot pass for a cut: it once quarantined a
        # whole healthy shard under write-back load.
        size = os.fstat(self.data_fd).st_size
        if size < needed:
            return f"file is {size} bytes, its meta page claims {needed}: truncated"
        return ""

    def _close_env(self) -> None:
        os.close(self.data_fd)
        if self.direct_fd is not None:
            os.close(self.direct_fd)
        self.env.close()
        self.env = None

    def close(self) -> None:
        if self.env is not None:
            self._close_env()
        os.close(self._lock_fd)  # releases the flock, only once LMDB is closed


def _open_direct(path: str) -> int | None:
    """data.mdb opened with O_DIRECT, or None where its filesystem refuses direct reads (tmpfs)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT | os.O_CLOEXEC)
    except OSError:
        fd = None
    else:
        try:
            os.preadv(fd, [_aligned_buffer(DIRECT_ALIGN)], 0)
            return fd
        except OSError:
            os.close(fd)
    log.info("NVMe shard file %s does not take O_DIRECT reads; pages are read through the page cache", path)
    return None


def _aligned_buffer(nbytes: int) -> np.ndarray:
    raw = np.empty(nbytes + DIRECT_ALIGN, np.uint8)
    start = -raw.ctypes.data % DIRECT_ALIGN
    return raw[start:start + nbytes]


def _copy_hashed(out: memoryview, source: np.ndarray) -> int:
    """Copy `source` into `out`; the xxh3-64 of the bytes, taken in the same pass where the
    native module is built."""
    if native.module is not None:
        return native.module.copy_hash(np.frombuffer(out, np.uint8).ctypes.data, [(source.ctypes.data, len(out))])
    np.frombuffer(out, np.uint8)[:] = source
    return xxhash.xxh3_64_intdigest(out)


def _lock_shard(path: str) -> int:
    """Hold an exclusive flock on the shard's lock file for this process's life; returns its fd.

    flock, not fcntl: a record lock would be dropped when any other fd of the file in this
    process closes. O_CLOEXEC keeps a spawned child from holding the lock after we exit.
    The holder's pid is written once the lock is held, so a refused node can name it.
    """
    lock_path = os.path.join(path, LOCK_FILE)
    try:
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        raise OSError(f"cannot open NVMe shard {path} (nvme.paths): {exc}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise OSError(f"NVMe shard directory {path} is in use by another kvstore-server (pid {holder}): "
                      f"give this node its own nvme.paths") from None
    except OSError as exc:
        os.close(fd)
        raise OSError(f"cannot lock NVMe shard {lock_path}: {exc}") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


class NvmeTier:
    """Pages on local disks. Thread-safe: LMDB serializes writers and lets readers run alongside."""

    def __init__(self, paths: tuple[str, ...], map_bytes: int, io_threads: int = 8):
        self.map_bytes = map_bytes
        # Writes stop short of the map's end: LMDB deletes copy B-tree pages too, so a map
        # filled to its last page could not even evict. Pages are refused beyond this.
        self.page_bytes_max = map_bytes - max(map_bytes // 8, 1 << 20)
        self.shards: list[_Shard] = []
        try:
            for i, path in enumerate(paths):
                self.shards.append(_Shard(i, path, map_bytes))
        except OSError:
            for shard in self.shards:  # give back the shards (and their locks) already held
                shard.close()
            raise
        self._io = concurrent.futures.ThreadPoolExecutor(io_threads, thread_name_prefix="nvme-io")
        self._bounce = threading.local()  # each I/O thread's block-aligned buffer for O_DIRECT reads

    @property
    def capacity_bytes(self) -> int:
        return self.map_bytes * len(self.shards)

    def quarantined(self) -> list[Quarantine]:
        """The shards found damaged since start-up (at start-up or mid-run), in shard order."""
        return [shard.quarantine for shard in self.shards if shard.quarantine is not None]

    def _usable(self, shard: _Shard) -> bool:
        """False for a quarantined shard; quarantines one whose file was cut short under the map."""
        if shard.left_out:
            return False
        fault = shard.size_fault()
        if fault:
            shard.quarantine_now(fault)
            return False
        return True

    def _damaged(self, shard: _Shard, exc: lmdb.Error) -> None:
        shard.quarantine_now(f"LMDB reports damage: {exc}")

    def used_bytes(self) -> int:
        total = 0
        for shard in self.shards:
            if shard.left_out:
                continue
            info, stat = shard.env.info(), shard.env.stat()
            total += (info["last_pgno"] + 1) * stat["psize"]
        return total

    def shard_of(self, namespace_id: int, key: bytes) -> int:
        return xxhash.xxh3_64_intdigest(key, seed=namespace_id & 0xFFFFFFFFFFFFFFFF) % len(self.shards)

    def write(self, shard: int, pages: list[tuple[StoredPage, memoryview]]) -> None:
        """Write pages (header + bytes) to one shard in one transaction. Raises NvmeFull."""
        target = self.shards[shard]
        if not self._usable(target):
            raise NvmeShardQuarantined(shard)
        incoming = sum(len(view) for _, view in pages)
        if target.page_bytes + incoming > self.page_bytes_max:
            raise NvmeFull(shard)
        try:
            with target.env.begin(write=True, buffers=True) as txn:
                for page, view in pages:
                    rkey = record_key(page.namespace_id, page.key)
                    txn.put(rkey, view, db=target.data)
                    body_page = _body_page(txn.get(rkey, db=target.data))
                    txn.put(rkey, encode_header(page, body_page), db=target.meta)
        except lmdb.MapFullError:
            raise NvmeFull(shard) from None
        except LMDB_DAMAGE as exc:
            self._damaged(target, exc)
            raise NvmeShardQuarantined(shard) from None
        except lmdb.Error as exc:  # the transaction was aborted: nothing of it is on disk
            # A full disk surfaces as ENOSPC or, from the commit's write, as EIO.
            needed = sum(len(view) for _, view in pages) + (1 << 20)
            if "No space left" in str(exc) or _free_bytes(target.path) < needed:
                raise NvmeFull(shard) from None
            raise NvmeError(f"NVMe shard {target.path}: {exc}") from None
        with target.lock:
            target.page_bytes += incoming

    def read_into(self, pages: list[tuple[int, bytes, memoryview]]) -> list[int | None]:
        """Copy each page's bytes from disk into its `out` view; returns the xxh3-64 of the bytes
        copied, None where the page is absent, mis-sized or could not be read whole.

        A large page is found through its header, which records the LMDB page its bytes start
        on, and read with O_DIRECT, never through LMDB's value: py-lmdb touches every 4 KiB of
        a value it returns, one page fault and one small disk read each, and the page cache on a
        cold read costs more than the disk (pages promoted to DRAM need no second copy in it
        either). LMDB puts a value 16 bytes past a page boundary, so the read covers the value's
        whole overflow pages (block-aligned, none shared with another record) into a buffer; the
        page header read with them must name the recorded page, and the bytes are copied out
        into `out` and hashed in one pass. Small pages, and pages whose header records no place,
        are located through LMDB (their place in the map is their offset in data.mdb) and read
        with pread. The reads of a batch run on `io_threads` threads, so the disk sees several
        at once. The read transactions stay open across the reads, so LMDB cannot reuse those
        file pages meanwhile; O_DIRECT sees every committed write (LMDB writes with pwrite and
        syncs at commit, and a direct read flushes any dirty page cache of its range first).
        """
        sums: list[int | None] = []
        reads = []
        txns: dict[int, lmdb.Transaction | None] = {}
        try:
            for ns_id, key, out in pages:
                shard = self.shards[self.shard_of(ns_id, key)]
                if shard.index not in txns:
                    txns[shard.index] = shard.env.begin(buffers=True) if self._usable(shard) else None
                txn = txns[shard.index]
                if txn is None:
                    sums.append(MISSING)
                    continue
                rkey = record_key(ns_id, key)
                try:
                    header = txn.get(rkey, db=shard.meta)
                    body_page = self._direct_body_page(shard, header, len(out))
                    value = None if body_page else txn.get(rkey, db=shard.data)
                except LMDB_DAMAGE as exc:
                    self._damaged(shard, exc)
                    sums.append(MISSING)
                    continue
                if body_page:
                    reads.append((len(sums), shard, body_page, out))
                    sums.append(None)
                    continue
                if value is None or len(value) != len(out):
                    sums.append(None)
                elif shard.map_address is None:  # mapping not found: copy through it instead
                    out[:] = value
                    sums.append(xxhash.xxh3_64_intdigest(out))
                else:
                    offset = np.frombuffer(value, dtype=np.uint8).ctypes.data - shard.map_address
                    reads.append((len(sums), shard, -offset, out))
                    sums.append(None)
            futures = [(position, self._io.submit(self._read_page, shard, where, out))
                       for position, shard, where, out in reads]
            for position, read in futures:
                sums[position] = read.result()
        finally:
            for txn in txns.values():
                if txn is not None:
                    txn.abort()
        # A shard quarantined during this batch: none of its pages count, read or not.
        return [MISSING if self.shards[self.shard_of(ns_id, key)].left_out else checksum
                for (ns_id, key, _), checksum in zip(pages, sums)]

    @staticmethod
    def _direct_body_page(shard: _Shard, header: bytes | None, nbytes: int) -> int:
        """The LMDB page to read this page's bytes from with O_DIRECT, or 0 to go through LMDB."""
        if (shard.direct_fd is None or nbytes < DIRECT_READ_MIN_BYTES or header is None
                or len(header) < HEADER.size):
            return 0
        _, _, body_page, _, page_bytes, _ = HEADER.unpack_from(header)
        return body_page if page_bytes == nbytes else 0

    def _read_page(self, shard: _Shard, where: int, out: memoryview) -> int | None:
        """One page's bytes into `out`: `where` > 0 is the LMDB page they start on (O_DIRECT),
        `where` <= 0 minus their offset in data.mdb (pread). Their xxh3-64, or None if short."""
        if where <= 0:
            if os.preadv(shard.data_fd, [out], -where) != len(out):
                return None
            return xxhash.xxh3_64_intdigest(out)
        start = where * shard.page_size   # page sizes are multiples of DIRECT_ALIGN
        length = -(-(LMDB_PAGE_HEADER + len(out)) // DIRECT_ALIGN) * DIRECT_ALIGN
        bounce = getattr(self._bounce, "buffer", None)
        if bounce is None or len(bounce) < length:
            bounce = self._bounce.buffer = _aligned_buffer(length)
        if (os.preadv(shard.direct_fd, [bounce[:length]], start) < LMDB_PAGE_HEADER + len(out)
                or int.from_bytes(bounce[:8], "little") != where
                or int.from_bytes(bounce[12:16], "little") * shard.page_size < LMDB_PAGE_HEADER + len(out)):
            return None
        return _copy_hashed(out, bounce[LMDB_PAGE_HEADER:LMDB_PAGE_HEADER + len(out)])

    def delete(self, pages: list[tuple[int, bytes]]) -> None:
        by_shard: dict[int, list[bytes]] = {}
        for ns_id, key in pages:
            by_shard.setdefault(self.shard_of(ns_id, key), []).append(record_key(ns_id, key))
        for shard_index, rkeys in by_shard.items():
            self.drop_records(shard_index, rkeys)

    def save_namespace(self, namespace_id: int, spec: dict) -> None:
        value = json.dumps(spec, sort_keys=True).encode()
        for shard in self.shards:
            if not self._usable(shard):
                continue
            try:
                with shard.env.begin(write=True) as txn:
                    txn.put(namespace_id.to_bytes(8, "little"), value, db=shard.namespaces)
            except lmdb.MapFullError:
                raise NvmeFull(shard.index) from None
            except LMDB_DAMAGE as exc:
                self._damaged(shard, exc)

    def load_namespaces(self) -> dict[int, dict]:
        specs: dict[int, dict] = {}
        for shard in self.shards:
            try:
                with shard.env.begin() as txn:
                    found = list(txn.cursor(db=shard.namespaces))
            except LMDB_DAMAGE as exc:   # start-up: the shard is replaced by an empty one
                shard.replace(f"LMDB reports damage in its namespaces: {exc}")
                continue
            for rkey, value in found:
                try:
                    specs[int.from_bytes(rkey, "little")] = json.loads(value)
                except ValueError:
                    log.error("unreadable namespace record in %s; its pages will be dropped", shard.path)
        return specs

    def scan(self) -> Iterator[tuple[bytes, bytes | None, int, int, int]]:
        """(record key, parent key, page bytes, checksum, shard) of every page, headers only.

        It also counts the bytes stored per shard (what the write path checks its limit against).

        An unreadable header comes out with parent key None, for the caller to drop. This
        is the start-up path, so it stays lean: tuples, no objects per page.
        """
        for shard in self.shards:
            shard.page_bytes = 0
            try:
                yield from self._scan_shard(shard)
            except LMDB_DAMAGE as exc:
                # Start-up: what this shard yielded is void (the caller drops the pages of
                # quarantined shards) and an empty shard takes its place.
                shard.replace(f"LMDB reports damage in its index: {exc}")
                shard.page_bytes = 0

    @staticmethod
    def _scan_shard(shard: _Shard) -> Iterator[tuple[bytes, bytes | None, int, int, int]]:
        unpack, size = HEADER.unpack_from, HEADER.size
        with shard.env.begin() as txn:
            for rkey, value in txn.cursor(db=shard.meta).iternext():
                try:
                    version, parent_len, _, ns_id, page_bytes, checksum = unpack(value)
                    if (version != FORMAT_VERSION or parent_len > PARENT_BYTES_MAX or len(value) != size + parent_len
                            or page_bytes == 0
                            or int.from_bytes(rkey[:8], "little") != ns_id or len(rkey) <= 8):
                        raise ValueError
                except (ValueError, struct.error):
                    yield rkey, None, 0, 0, shard.index
                    continue
                shard.page_bytes += page_bytes
                yield rkey, value[size:], page_bytes, checksum, shard.index

    def drop_records(self, shard: int, rkeys: list[bytes]) -> None:
        """Delete records (header and bytes). Never raises for a full map: what cannot be
        deleted now is logged and stays on disk, unindexed, until the next start-up drops it."""
        target = self.shards[shard]
        if not self._usable(target):
            return   # its pages went with its file
        try:
            self._drop(target, rkeys)
        except LMDB_DAMAGE as exc:
            self._damaged(target, exc)
        except lmdb.MapFullError:
            undeleted = 0
            for rkey in rkeys:  # one record per transaction needs the fewest free pages
                try:
                    self._drop(target, [rkey])
                except lmdb.MapFullError:
                    undeleted += 1
            if undeleted:
                log.error("NVMe shard %s is too full to delete records=%d; they stay until the next start-up",
                          target.path, undeleted)

    @staticmethod
    def _drop(target: _Shard, rkeys: list[bytes]) -> None:
        freed = 0
        with target.env.begin(write=True) as txn:
            for rkey in rkeys:
                header = txn.get(rkey, db=target.meta)
                if header is not None and len(header) >= HEADER.size:
                    freed += HEADER.unpack_from(header)[4]
                txn.delete(rkey, db=target.meta)
                txn.delete(rkey, db=target.data)
        with target.lock:
            target.page_bytes -= freed

    def close(self) -> None:
        self._io.shutdown()
        for shard in self.shards:
            shard.close()
