"""What the crash harness knows and checks: the workload's journals (which chains exist,
which were deleted), the NVMe shards read straight from disk while the node is dead, and
the checks of a restarted node against both (tests/fault/test_crash_failpoints.py).
"""

from __future__ import annotations

import dataclasses
import random
import struct
import time
from pathlib import Path

import lmdb
import numpy as np
import xxhash

from crash_workload import NAMESPACES, chain_keys, page_bytes, parse_key
from kvstore.tiers.nvme import FORMAT_VERSION, HEADER
from kvstore_client import KVStoreClient, namespace_id
from kvstore_client import errors

TAG_BY_NS_ID = {namespace_id(ns): tag for tag, ns in NAMESPACES.items()}
PageId = tuple[int, bytes]  # (namespace id, key), as on disk and in the node's index


@dataclasses.dataclass(frozen=True)
class ChainInfo:
    tag: str
    parent: int | None
    length: int


class Model:
    """Every chain the workloads journaled, and their deletes."""

    def __init__(self) -> None:
        self.chains: dict[int, ChainInfo] = {}
        self.children: dict[int, list[int]] = {}
        self.delete_started: set[int] = set()
        self.delete_done: set[int] = set()
        self.chains_of_cycle: dict[int, list[int]] = {}
        self.verified_pages = 0          # pages the workloads read and found right
        self.wrong: list[str] = []       # W lines: pages the workloads saw served wrong
        self.wrong_on_disk: set[PageId] = set()     # found and reported
        self.resurrected: set[PageId] = set()

    def read_journal(self, path: Path, cycle: int) -> list[str]:
        """Fold one journal in; returns its E lines (why its workload ended)."""
        ended = []
        if not path.exists():
            return ended
        for line in path.read_text().splitlines():
            kind, _, rest = line.partition(" ")
            fields = rest.split(" ")
            try:
                if kind == "P" and len(fields) == 4:
                    chain, parent = int(fields[0]), None if fields[2] == "-" else int(fields[2])
                    self.chains[chain] = ChainInfo(fields[1], parent, int(fields[3]))
                    self.chains_of_cycle.setdefault(cycle, []).append(chain)
                    if parent is not None:
                        self.children.setdefault(parent, []).append(chain)
                elif kind == "D" and len(fields) == 1:
                    self.delete_started.add(int(fields[0]))
                elif kind == "d" and len(fields) == 1:
                    self.delete_done.add(int(fields[0]))
                elif kind == "V" and len(fields) == 1:
                    self.verified_pages += int(fields[0])
                elif kind == "W":
                    self.wrong.append(f"the workload read chain {rest}")
                elif kind == "E":
                    ended.append(rest)
            except ValueError:  # a line cut by the kill
                continue
        return ended

    def path(self, chain: int) -> list[bytes]:
        keys: list[bytes] = []
        node: int | None = chain
        while node is not None:
            info = self.chains[node]
            keys[:0] = chain_keys(node, info.length)
            node = info.parent
        return keys

    def excluded(self) -> set[int]:
        """Chains a delete reached or may have reached: deleted ones and all that extend them."""
        todo, out = list(self.delete_started), set()
        while todo:
            chain = todo.pop()
            if chain not in out:
                out.add(chain)
                todo += self.children.get(chain, [])
        return out

    def known_for_workload(self, rng: random.Random, count: int) -> dict[str, list]:
        """Up to `count` chains not deleted, with their ancestors: what the next workload reads."""
        excluded = self.excluded()
        candidates = [c for c in self.chains if c not in excluded]
        out: dict[str, list] = {}
        for chain in rng.sample(candidates, min(count, len(candidates))):
            node: int | None = chain
            while node is not None and str(node) not in out:
                info = self.chains[node]
                out[str(node)] = [info.tag, info.parent, info.length]
                node = info.parent
        return out


@dataclasses.dataclass
class DiskPage:
    parent_key: bytes | None   # None: the header cannot be read
    page_bytes: int
    checksum_ok: bool          # the bytes hash to the header's checksum
    bytes_ok: bool | None      # the bytes are the key's (None: not a key the workload wrote)


@dataclasses.dataclass
class Snapshot:
    """The pages on the shards of a dead node."""

    pages: dict[PageId, DiskPage]
    namespaces: set[int]

    def reachable(self) -> set[PageId]:
        """Pages whose whole chain of parents is on disk, each with a readable header."""
        memo: dict[PageId, bool] = {}
        for page_id in self.pages:
            walked: list[PageId] = []
            node: PageId | None = page_id
            while node is not None and node not in memo:
                page = self.pages.get(node)
                if page is None or page.parent_key is None or node in walked:  # gone, unreadable, a loop
                    memo[node] = False
                    break
                walked.append(node)
                node = (node[0], page.parent_key) if page.parent_key else None
            verdict = memo.get(node, True) if node is not None else True
            for walked_id in walked:
                memo[walked_id] = verdict
        return {page_id for page_id, ok in memo.items() if ok and page_id in self.pages}

    def path(self, page_id: PageId) -> list[bytes]:
        """Keys from the first page of the sequence to this one, by the headers on disk."""
        keys = [page_id[1]]
        parent = self.pages[page_id].parent_key
        while parent:
            keys.append(parent)
            parent = self.pages[(page_id[0], parent)].parent_key
        return keys[::-1]


def read_shards(paths: list[Path]) -> Snapshot:
    """Every page record of the shards, read-only, with its bytes checked against its key."""
    pages: dict[PageId, DiskPage] = {}
    namespaces: set[int] = set()
    for path in (shard for path in paths for shard in (path, *sorted(path.glob("shard-*")))):   # nvme.shards_per_path
        if not (path / "data.mdb").exists():
            continue
        env = lmdb.open(str(path), readonly=True, lock=False, max_dbs=3, subdir=True)
        try:
            meta, data, specs = (env.open_db(name, create=False) for name in (b"meta", b"data", b"namespaces"))
            with env.begin(buffers=True) as txn:
                namespaces.update(int.from_bytes(bytes(k), "little") for k, _ in txn.cursor(db=specs))
                for rkey, header in txn.cursor(db=meta):
                    rkey = bytes(rkey)
                    page_id = (int.from_bytes(rkey[:8], "little"), rkey[8:])
                    pages[page_id] = _disk_page(page_id, bytes(header), txn.get(rkey, db=data))
        finally:
            env.close()
    return Snapshot(pages, namespaces)


def _disk_page(page_id: PageId, header: bytes, value: memoryview | None) -> DiskPage:
    try:
        version, parent_len, _, ns_id, size, checksum = HEADER.unpack_from(header)
    except struct.error:
        return DiskPage(None, 0, False, None)
    if version != FORMAT_VERSION or len(header) != HEADER.size + parent_len or ns_id != page_id[0]:
        return DiskPage(None, 0, False, None)
    parent_key = header[HEADER.size:]
    if value is None:
        return DiskPage(parent_key, size, False, False)
    checksum_ok = len(value) == size and xxhash.xxh3_64_intdigest(value) == checksum
    tag = TAG_BY_NS_ID.get(page_id[0])
    if tag is None or parse_key(page_id[1]) is None:
        return DiskPage(parent_key, size, checksum_ok, None)
    expected = page_bytes(tag, page_id[1])
    return DiskPage(parent_key, size, checksum_ok, len(value) == len(expected) and
                    np.array_equal(np.frombuffer(value, np.uint8), expected))


@dataclasses.dataclass
class CheckResult:
    reachable_pages: int = 0     # pages on disk and reachable before the restart, not deleted
    pages_checked: int = 0       # pages served after the restart and compared byte for byte
    chains_checked: int = 0
    wrong: list[str] = dataclasses.field(default_factory=list)
    prefix: list[str] = dataclasses.field(default_factory=list)
    lost: list[str] = dataclasses.field(default_factory=list)
    resurrected: list[str] = dataclasses.field(default_factory=list)


def check_restarted(client: KVStoreClient, model: Model, snapshot: Snapshot, cycle: int,
                    rng: random.Random, chains_max: int) -> CheckResult:
    """Judge a node restarted on `snapshot`'s shards, before anything else touches it."""
    result = CheckResult()
    excluded = model.excluded()
    reachable = snapshot.reachable()
    for page_id, page in snapshot.pages.items():
        if page.bytes_ok is False and page_id not in model.wrong_on_disk:  # each such page once
            model.wrong_on_disk.add(page_id)
            result.wrong.append(f"on disk: {_name(page_id)} holds other bytes than its key's "
                                f"(checksum {'matches' if page.checksum_ok else 'differs'})")
    present = _present_reachable(client, snapshot, reachable)
    chain_of = {page_id: parse_key(page_id[1]) for page_id in snapshot.pages}
    for page_id in reachable:
        parsed = chain_of[page_id]
        if parsed is None or parsed[0] in excluded:
            continue
        result.reachable_pages += 1
        if page_id not in present:
            result.lost.append(f"{_name(page_id)} was on disk with its whole chain, not present after the restart")
    singles: dict[PageId, int] = {}
    for chain in _chains_to_check(model, snapshot, chain_of, cycle, rng, chains_max):
        _check_chain(client, model, chain, reachable, excluded, singles, result)
    for page_id, parsed in chain_of.items():
        if (parsed is not None and parsed[0] in model.delete_done and page_id[0] in TAG_BY_NS_ID
                and page_id not in model.resurrected and _lookup_one(client, page_id, singles)):
            model.resurrected.add(page_id)  # each such page once
            result.resurrected.append(f"{_name(page_id)}: its chain's Delete answered before the kill")
    return result


def _present_reachable(client: KVStoreClient, snapshot: Snapshot, reachable: set[PageId]) -> set[PageId]:
    """Which reachable pages the node holds: one Lookup per chain end."""
    parents = {(page_id[0], snapshot.pages[page_id].parent_key) for page_id in reachable}
    present: set[PageId] = set()
    for page_id in reachable - parents:
        tag = TAG_BY_NS_ID.get(page_id[0])
        if tag is None:
            continue
        path = snapshot.path(page_id)
        hits = client.lookup(NAMESPACES[tag], path)
        present.update((page_id[0], key) for key in path[:hits])
    return present


def _chains_to_check(model: Model, snapshot: Snapshot, chain_of: dict, cycle: int, rng: random.Random,
                     chains_max: int) -> list[int]:
    """This cycle's chains, chains with pages on disk, and older ones: a bounded sample of each."""
    on_disk = sorted({parsed[0] for parsed in chain_of.values() if parsed is not None and parsed[0] in model.chains})
    recent = model.chains_of_cycle.get(cycle, [])
    older = list(model.chains)
    third = max(chains_max // 3, 1)
    picked = (rng.sample(recent, min(third, len(recent))) + rng.sample(on_disk, min(third, len(on_disk)))
              + rng.sample(older, min(third, len(older))))
    return list(dict.fromkeys(picked))


def _check_chain(client: KVStoreClient, model: Model, chain: int, reachable: set[PageId], excluded: set[int],
                 singles: dict[PageId, int], result: CheckResult) -> None:
    """Prefix: each page alone is present only if its parent is; bytes: each page served is its key's."""
    tag = model.chains[chain].tag
    namespace, ns_id = NAMESPACES[tag], namespace_id(NAMESPACES[tag])
    path = model.path(chain)
    alone = [_lookup_one(client, (ns_id, key), singles) for key in path]
    leading = next((i for i, hit in enumerate(alone) if not hit), len(alone))
    whole = client.lookup(namespace, path)
    if any(alone[leading:]) or whole != leading:
        result.prefix.append(f"chain {chain}: pages present alone {alone}, Lookup of the chain {whole}")
    result.chains_checked += 1
    out = np.zeros((len(path), namespace.page_bytes), np.uint8)
    loaded = 0
    for attempt, policy in enumerate(("best_effort", "wait_complete", "wait_complete")):
        if attempt == 2:
            if loaded >= whole:
                break
            time.sleep(0.2)  # a promotion may have lost a race for slots: once more
        try:
            loaded = client.get(namespace, path, out, verify=True, policy=policy)
        except errors.ChecksumMismatch as exc:
            result.wrong.append(f"chain {chain} ({policy}): served bytes fail their checksum: {exc}")
            return
        if loaded > whole:
            result.prefix.append(f"chain {chain}: Get ({policy}) served {loaded} pages, Lookup said {whole}")
        for i in range(loaded):
            if not np.array_equal(out[i], page_bytes(tag, path[i])):
                result.wrong.append(f"chain {chain} ({policy}): page {i} ({path[i].decode()}) served other bytes")
        result.pages_checked += loaded
    for key in path[loaded:whole]:
        page_id = (ns_id, key)
        parsed = parse_key(key)
        if page_id in reachable and parsed is not None and parsed[0] not in excluded:
            result.lost.append(f"{_name(page_id)} is present but a wait_complete Get could not load it")


def _lookup_one(client: KVStoreClient, page_id: PageId, cache: dict[PageId, int]) -> int:
    if page_id not in cache:
        cache[page_id] = client.lookup(NAMESPACES[TAG_BY_NS_ID[page_id[0]]], [page_id[1]])
    return cache[page_id]


def _name(page_id: PageId) -> str:
    return f"page {page_id[1].decode(errors='replace')} of {TAG_BY_NS_ID.get(page_id[0], hex(page_id[0]))}"
