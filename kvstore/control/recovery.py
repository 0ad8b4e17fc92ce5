"""Start-up: rebuild the index of NVMe pages from the shards' headers alone.

Committed pages survive a restart with their parent links. A page whose parent did not
survive (an OS crash undid the parent's transaction, or it sat on another shard whose write
never happened), whose namespace is unknown, or whose header is unreadable, is dropped from
disk, counted and logged: the rebuilt index is prefix-closed like the one it replaces.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import time

from kvstore.control.index import NO_SLOT, PageIndex, PageRecord
from kvstore.tiers.dram import slot_bytes_for
from kvstore.tiers.nvme import NvmeTier, StoredPage
from kvstore_client.keys import Namespace

log = logging.getLogger(__name__)


@dataclasses.dataclass
class RecoveryReport:
    pages: int = 0
    orphans: int = 0
    unreadable: int = 0
    duration_s: float = 0.0


def rebuild(nvme: NvmeTier, index: PageIndex, namespaces: dict[int, Namespace]) -> RecoveryReport:
    started = time.perf_counter()
    report = RecoveryReport()
    for ns_id, spec in nvme.load_namespaces().items():
        try:
            namespaces[ns_id] = Namespace(**spec)
        except TypeError:
            log.error("namespace record %016x does not match this version; its pages will be dropped", ns_id)
    pages: dict[tuple[int, bytes], StoredPage] = {}
    unreadable: dict[int, list[bytes]] = collections.defaultdict(list)
    for item in nvme.scan():
        if isinstance(item, StoredPage):
            pages[(item.namespace_id, item.key)] = item
        else:
            unreadable[item[0]].append(item[1])
    children: dict[tuple[int, bytes], list[tuple[int, bytes]]] = collections.defaultdict(list)
    roots = []
    for page_id, page in pages.items():
        if page.namespace_id not in namespaces or page.page_bytes != namespaces[page.namespace_id].page_bytes:
            continue
        if page.parent_key:
            children[(page.namespace_id, page.parent_key)].append(page_id)
        else:
            roots.append(page_id)
    restored: list[PageRecord] = []
    queue = collections.deque((page_id, None) for page_id in roots)
    while queue:  # parents before children
        page_id, parent = queue.popleft()
        page = pages.pop(page_id)
        record = index.add(page_id, parent, NO_SLOT, slot_bytes_for(page.page_bytes), page.checksum, on_nvme=True)
        restored.append(record)
        queue.extend((child, record) for child in children.get(page_id, ()))
    index.offer_recovered(restored)
    for shard, rkeys in unreadable.items():
        nvme.drop_records(shard, rkeys)
    if pages:  # never reached from a root: orphans
        nvme.delete(list(pages))
    report.pages, report.orphans = len(restored), len(pages)
    report.unreadable = sum(len(v) for v in unreadable.values())
    report.duration_s = time.perf_counter() - started
    if report.orphans or report.unreadable:
        log.warning("recovery dropped orphan_pages=%d unreadable_records=%d", report.orphans, report.unreadable)
    log.info("recovery complete pages=%d duration_ms=%.1f pages_per_s=%.0f", report.pages,
             report.duration_s * 1e3, report.pages / report.duration_s if report.duration_s else 0)
    return report

