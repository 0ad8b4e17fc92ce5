"""Start-up: rebuild the index of NVMe pages from the shards' headers alone.

Committed pages survive a restart with their parent links. A page whose parent did not
survive (an OS crash undid the parent's transaction, or it sat on another shard whose write
never happened), whose namespace is unknown, or whose header is unreadable, is dropped from
disk, counted and logged: the rebuilt index is prefix-closed like the one it replaces.
"""

from __future__ import annotations

import collections
import dataclasses
import gc
import logging
import time

from kvstore import failpoints
from kvstore.control.index import NO_SLOT, PageRecord
from kvstore.tiers.dram import slot_bytes_for
from kvstore.tiers.nvme import NvmeTier
from kvstore_client.keys import Namespace

log = logging.getLogger(__name__)


@dataclasses.dataclass
class RecoveryReport:
    pages: int = 0
    orphans: int = 0
    unreadable: int = 0
    duration_s: float = 0.0


@dataclasses.dataclass
class Recovered:
    namespaces: dict[int, Namespace]
    records: list[PageRecord]        # linked to their parents, prefix-closed, for PageStore.adopt_recovered
    report: RecoveryReport


PROGRESS_S = 2.0   # at most one progress line this often


def rebuild(nvme: NvmeTier) -> Recovered:
    # Millions of long-lived records: the cyclic collector would rescan them over and over.
    gc.disable()
    try:
        return _rebuild(nvme)
    finally:
        gc.enable()
        gc.freeze()  # what start-up built stays; later collections skip it


def _rebuild(nvme: NvmeTier) -> Recovered:
    started = time.perf_counter()
    report = RecoveryReport()
    namespaces: dict[int, Namespace] = {}
    for ns_id, spec in nvme.load_namespaces().items():
        try:
            namespaces[ns_id] = Namespace(**spec)
        except TypeError:
            log.error("namespace record %016x does not match this version; its pages will be dropped", ns_id)
    records: dict[tuple[int, bytes], PageRecord] = {}
    parents: list[tuple[PageRecord, bytes]] = []
    unreadable: dict[int, list[bytes]] = collections.defaultdict(list)
    sizes = {ns_id: (ns.page_bytes, slot_bytes_for(ns.page_bytes)) for ns_id, ns in namespaces.items()}
    from_bytes, no_size = int.from_bytes, (0, 0)
    shown = started
    log.info("recovery started shards=%d", len(nvme.shards))
    for scanned, (rkey, parent_key, page_bytes, checksum, shard) in enumerate(nvme.scan()):  # start-up's hot loop
        if not scanned & 0xFFFF and time.perf_counter() - shown >= PROGRESS_S:   # a long rebuild shows progress
            shown = time.perf_counter()
            log.info("recovery scanning records=%d elapsed_s=%.1f", scanned, shown - started)
        ns_id = from_bytes(rkey[:8], "little")
        expected_bytes, slot_bytes = sizes.get(ns_id, no_size)
        if parent_key is None or page_bytes != expected_bytes:
            unreadable[shard].append(rkey)
            continue
        page_id = (ns_id, rkey[8:])
        record = records[page_id] = PageRecord(page_id, None, NO_SLOT, slot_bytes, checksum)
        record.on_nvme = True
        record.shard = shard
        if parent_key:
            parents.append((record, parent_key))
    failpoints.hit("recovery.after_scan")
    void = {q.shard for q in nvme.quarantined()}
    if void:   # a shard found damaged mid-scan: what it yielded went with it
        records = {page_id: r for page_id, r in records.items() if nvme.shard_of(*page_id) not in void}
        parents = [(r, parent_key) for r, parent_key in parents if nvme.shard_of(*r.page_id) not in void]
        unreadable = {shard: rkeys for shard, rkeys in unreadable.items() if shard not in void}
    orphans = _link(records, parents)
    for shard, rkeys in unreadable.items():
        nvme.drop_records(shard, rkeys)
    if orphans:
        nvme.delete(orphans)
    report.pages, report.orphans = len(records), len(orphans)
    report.unreadable = sum(len(v) for v in unreadable.values())
    report.duration_s = time.perf_counter() - started
    if report.orphans or report.unreadable:
        log.warning("recovery dropped orphan_pages=%d unreadable_records=%d", report.orphans, report.unreadable)
    log.info("recovery complete pages=%d duration_ms=%.1f pages_per_s=%.0f", report.pages,
             report.duration_s * 1e3, report.pages / report.duration_s if report.duration_s else 0)
    return Recovered(namespaces, list(records.values()), report)



def _link(records: dict[tuple[int, bytes], PageRecord], parents: list[tuple[PageRecord, bytes]]) -> list:
    """Attach each page to its parent; remove pages that do not reach a root. Returns their ids."""
    for record, parent_key in parents:
        parent = records.get((record.page_id[0], parent_key))
        if parent is None:
            record.alive = False  # its parent did not survive
            continue
        record.parent = parent
        if parent.children is None:
            parent.children = set()
        parent.children.add(record)
    # A page is an orphan if any ancestor is; settle each chain once, memoised on `alive`.
    settled: set[PageRecord] = set()
    for record, _ in parents:
        path = []
        node = record
        while node is not None and node not in settled and node.alive:
            path.append(node)
            node = node.parent
        dead = node is not None and not node.alive
        for walked in path:
            walked.alive = not dead
            settled.add(walked)
        if not record.alive:
            settled.add(record)
    orphans = [page_id for page_id, record in records.items() if not record.alive]
    for page_id in orphans:
        del records[page_id]
    return orphans
