"""The crash tests' workload: one client process that writes, reads and deletes chains of
pages through the SDK and journals what it did, for the harness to judge a restarted node
by (tests/fault/test_crash_failpoints.py). Every page's bytes follow from its namespace and
key, so any page, served or on disk, can be checked byte for byte.

    python crash_workload.py JOURNAL SEED FIRST_CHAIN KNOWN_CHAINS_JSON < address

It reads the node's address from stdin (so it can start, and import, while the node starts)
and runs until the node dies. A chain is `length` pages keyed b"<chain>.<i>"; it extends
the chain `parent` (its first page's parent is the parent chain's last page) or starts a
sequence. The journal holds one line per event, each written in one write:

    P chain tag parent length   before the put (parent: a chain id, or -)
    D chain                     before the Delete of the chain's pages (and all that extends them)
    d chain                     after the Delete answered
    V pages                     pages just read and found equal to their keys' bytes
    W chain index detail        a page served with bytes other than its key's
    E error                     the exception that ended the workload (the node is gone, or a bug)
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import random
import sys
import threading
from typing import TextIO

import numpy as np

from kvstore_client import KVStoreClient, Namespace, errors
from kvstore_client.gpu_device import HostDevice
from kvstore_client.proto import pb

# Two page sizes, so both slot sizes share the arena and both kinds of NVMe record exist.
NAMESPACES = {
    "s": Namespace(model="crash-8k", page_bytes=8 << 10),
    "l": Namespace(model="crash-64k", page_bytes=64 << 10),
}
PATH_PAGES_MAX = 12        # pages of a chain with all it extends (one Acquire, a few slabs)
CHAIN_PAGES_MAX = 5
THREADS = 2
# One operation in the loop: put a new chain, read an older one, or delete one.
PUT_SHARE, READ_SHARE = 0.40, 0.45   # the rest are deletes
EXTEND_SHARE = 0.3                   # of puts: extend a live chain instead of starting one
# Errors a live node may answer under this load; the workload goes on after them.
BENIGN = (errors.CapacityExhausted, errors.LeaseNotFound, errors.DeadlineExceeded)


def chain_keys(chain: int, length: int) -> list[bytes]:
    return [f"{chain}.{i}".encode() for i in range(length)]


def parse_key(key: bytes) -> tuple[int, int] | None:
    """(chain, index) of a key this workload wrote; None for any other key."""
    chain, dot, index = key.partition(b".")
    if not dot or not chain.isdigit() or not index.isdigit():
        return None
    return int(chain), int(index)


def page_bytes(tag: str, key: bytes) -> np.ndarray:
    """The bytes of page `key` of namespace `tag`: a generator seeded by both, so pages differ."""
    digest = hashlib.blake2b(tag.encode() + b"/" + key, digest_size=8).digest()
    generator = np.random.Generator(np.random.PCG64(int.from_bytes(digest, "little")))
    return np.frombuffer(generator.bytes(NAMESPACES[tag].page_bytes), np.uint8)


class Chains:
    """What the workload knows of chains (its own and those the harness passed in); thread-safe."""

    def __init__(self, known: dict[int, tuple[str, int | None, int]], journal: TextIO):
        self.lock = threading.Lock()
        self.info = dict(known)                      # chain -> (tag, parent, length)
        self.children: dict[int, list[int]] = {}
        for chain, (_, parent, _) in known.items():
            if parent is not None:
                self.children.setdefault(parent, []).append(chain)
        self.live = {tag: [c for c, (t, _, _) in known.items() if t == tag] for tag in NAMESPACES}
        self._journal = journal

    def note(self, line: str) -> None:
        """Lock held."""
        self._journal.write(line + "\n")
        self._journal.flush()

    def path(self, chain: int) -> list[bytes]:
        """Lock held. Keys from the first page of the sequence to the chain's last page."""
        keys: list[bytes] = []
        node: int | None = chain
        while node is not None:
            _, parent, length = self.info[node]
            keys[:0] = chain_keys(node, length)
            node = parent
        return keys

    def new(self, chain: int, rng: random.Random) -> tuple[str, list[bytes], bytes | None]:
        """Lock held: choose and journal a new chain; (tag, its own keys, the parent's last key)."""
        tag = rng.choice(sorted(NAMESPACES))
        parent, prefix = None, []
        if self.live[tag] and rng.random() < EXTEND_SHARE:
            candidate = rng.choice(self.live[tag])
            candidate_path = self.path(candidate)
            if len(candidate_path) < PATH_PAGES_MAX:
                parent, prefix = candidate, candidate_path
        length = rng.randint(1, min(CHAIN_PAGES_MAX, PATH_PAGES_MAX - len(prefix)))
        self.info[chain] = (tag, parent, length)
        if parent is not None:
            self.children.setdefault(parent, []).append(chain)
        self.note(f"P {chain} {tag} {'-' if parent is None else parent} {length}")
        return tag, chain_keys(chain, length), prefix[-1] if prefix else None

    def pick(self, rng: random.Random) -> int | None:
        """Lock held: a live chain of either namespace, or None."""
        tags = [tag for tag in sorted(NAMESPACES) if self.live[tag]]
        return rng.choice(self.live[rng.choice(tags)]) if tags else None

    def unlink(self, chain: int) -> None:
        """Lock held: the chain and everything extending it stop being read, extended or deleted."""
        todo = [chain]
        while todo:
            node = todo.pop()
            live = self.live[self.info[node][0]]
            if node in live:
                live.remove(node)
            todo += self.children.get(node, [])


def put_chain(client: KVStoreClient, chains: Chains, chain: int, rng: random.Random) -> None:
    with chains.lock:
        tag, keys, parent_key = chains.new(chain, rng)
    data = np.stack([page_bytes(tag, key) for key in keys])
    client.put(NAMESPACES[tag], keys, data, parent=parent_key)
    with chains.lock:
        chains.live[tag].append(chain)


def read_chain(client: KVStoreClient, chains: Chains, rng: random.Random) -> None:
    with chains.lock:
        chain = chains.pick(rng)
        if chain is None:
            return
        tag, path = chains.info[chain][0], chains.path(chain)
    out = np.zeros((len(path), NAMESPACES[tag].page_bytes), np.uint8)
    policy = rng.choice(("wait_complete", "best_effort", "gpu_engine"))
    try:
        if policy == "gpu_engine":
            loaded = read_as_gpu_engine(client, NAMESPACES[tag], path, out)
        else:
            loaded = client.get(NAMESPACES[tag], path, out, verify=True, policy=policy)
    except errors.ChecksumMismatch as exc:
        with chains.lock:
            chains.note(f"W {chain} -1 {policy}:checksum:{str(exc).replace(' ', '_')}")
        return
    wrong = [i for i in range(loaded) if not np.array_equal(out[i], page_bytes(tag, path[i]))]
    with chains.lock:
        for i in wrong:
            chains.note(f"W {chain} {i} {policy}:bytes")
        chains.note(f"V {loaded - len(wrong)}")


def read_as_gpu_engine(client: KVStoreClient, namespace: Namespace, path: list[bytes], out: np.ndarray) -> int:
    """A read as GpuPages makes one (Acquire with hbm_reader): each page from the node's HBM pool where it names
    an offset there (opened as GpuPages' host device opens it), else from the arena, copied as they are into
    `out` for the caller to check."""
    acquired = client._conn.call_in(namespace, "Acquire", pb.AcquireRequest(keys=path, hbm_reader=True))
    device, size = HostDevice(), namespace.page_bytes
    try:
        in_pool = list(acquired.hbm_offsets) or [-1] * acquired.hit_pages
        base = device.open_ipc(client._conn.hello.hbm.ipc_handle) if max(in_pool, default=-1) >= 0 else None
        arena = client._conn.data.arena.view
        for i, (hbm, offset) in enumerate(zip(in_pool, acquired.offsets)):
            page = device.opened[base][hbm:hbm + size] if hbm >= 0 else arena[offset:offset + size]
            out[i] = np.frombuffer(page, np.uint8)
        if base is not None:
            device.close_ipc(base)
    finally:
        if acquired.lease_id:
            client._conn.control.call("Release", pb.ReleaseRequest(lease_ids=[acquired.lease_id]))
    return acquired.hit_pages


def delete_chain(client: KVStoreClient, chains: Chains, rng: random.Random) -> None:
    with chains.lock:
        chain = chains.pick(rng)
        if chain is None:
            return
        chains.unlink(chain)
        tag, _, length = chains.info[chain]
        chains.note(f"D {chain}")
    client.delete(NAMESPACES[tag], chain_keys(chain, length)[:1])
    with chains.lock:
        chains.note(f"d {chain}")


def work(address: str, chains: Chains, ids: "itertools.count[int]", seed: int) -> None:
    rng = random.Random(seed)
    try:
        with KVStoreClient(address, timeout_s=15) as client:
            while True:
                op = rng.random()
                try:
                    if op < PUT_SHARE:
                        with chains.lock:
                            chain = next(ids)
                        put_chain(client, chains, chain, rng)
                    elif op < PUT_SHARE + READ_SHARE:
                        read_chain(client, chains, rng)
                    else:
                        delete_chain(client, chains, rng)
                except BENIGN:
                    continue
    except BaseException as exc:  # the node died (or a bug): journal why, end the whole process
        with chains.lock:
            chains.note(f"E {type(exc).__name__}: {' '.join(str(exc).split())[:300]}")
        os._exit(3)


def main(argv: list[str]) -> int:
    journal_path, seed, first_chain, known_path = argv[1], int(argv[2]), int(argv[3]), argv[4]
    with open(known_path) as f:
        known = {int(c): (tag, parent, length) for c, (tag, parent, length) in json.load(f).items()}
    address = sys.stdin.readline().strip()
    if not address:
        return 0
    journal = open(journal_path, "a", buffering=1)
    chains = Chains(known, journal)
    ids = itertools.count(first_chain)
    threads = [threading.Thread(target=work, args=(address, chains, ids, seed * THREADS + i), daemon=True)
               for i in range(THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
