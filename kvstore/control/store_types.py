"""What the page store's parts share: its limits on work under the lock, its counters, the
listener it tells, and the records of a reservation, a promotion claim and a group commit."""

from __future__ import annotations

import dataclasses
import enum
from typing import Callable, Protocol

from kvstore.control.index import PageRecord
from kvstore.control.leases import Lease
from kvstore_client import errors

# Namespaces over all tenants; beyond it (and a tenant's own limit) idle ones are reclaimed, and a
# tenant past limits.namespaces_per_tenant_floor is refused: at most this plus each tenant's floor.
NAMESPACES_MAX = 4096
# Work under the lock for whole-index walks (ListKeys, the scrubber, Delete of a namespace): index
# positions scanned per lock section (a call takes at most SCAN_SECTIONS of them), and pages removed
# per section (each removal also frees its slot and tells its tenant's ledger: a few µs a page).
SCAN_POSITIONS = 16384
SCAN_SECTIONS = 16
REMOVE_PAGES = 1024
Clock = Callable[[], float]
PageId = tuple[int, bytes]


def namespace_not_found(ns_id: int) -> errors.KVStoreError:
    """The one answer for a namespace id a caller may not use: never opened, or another tenant's."""
    return errors.NamespaceNotFound(
        f"namespace {ns_id:#018x} is not open on this server; call OpenNamespace with its spec first")


def lease_not_found(lease_id: int) -> errors.KVStoreError:
    """The one answer for a lease a caller may not use: unknown, ended, or another tenant's."""
    return errors.LeaseNotFound(f"lease {lease_id:#x} is unknown, already finished, or expired")


class Evict(enum.Enum):
    """What allocation may drop to free a slot."""

    # Only DRAM copies of pages also on NVMe, each older than every page held only in DRAM (write_back's first
    # choice: a hot page already written down stays while colder unsaved pages can be written down instead).
    COLD = "cold"
    CLEAN = "clean"  # only DRAM copies of pages also on NVMe (write_back keeps the rest until written)
    ANY = "any"      # also least recently used leaves held only in DRAM (they leave the cache)

    @property
    def clean_only(self) -> bool:
        """The page index's clean_only: a page held only in DRAM is never taken."""
        return self is not Evict.ANY

    @property
    def cold(self) -> bool:
        """The page index's older_than_unsaved."""
        return self is Evict.COLD


class Counters:
    def __init__(self) -> None:
        self.dram_hits = 0          # pages served from DRAM as they were
        self.nvme_hits = 0          # pages served after promotion from NVMe
        self.misses = 0
        self.evictions = 0          # DRAM copies dropped (pages only in DRAM leave the index)
        self.nvme_evictions = 0
        self.promotions = 0
        self.promoted_bytes = 0
        self.demotions = 0
        self.demoted_bytes = 0
        self.corrupt_pages = 0
        self.leases_expired = 0
        self.pages_committed = 0
        self.checksum_failures = 0
        self.write_queue_drops = 0
        self.nvme_write_errors = 0
        self.recovered_pages = 0
        self.scrub_pages_checked = 0
        self.scrub_pages_bad = 0
        self.scrub_passes = 0
        self.bytes_reserved = 0      # page bytes of slots granted for writing (clients copy into them)
        self.bytes_acquired = 0      # page bytes of pages leased for reading (clients copy out of them)


class StoreListener(Protocol):
    """Told of page events with the store's lock held: queue work, never call the store back."""

    # Whether on_commit is called: a record per committed page costs more than indexing the page.
    wants_commits: bool

    def on_commit(self, records: list[PageRecord]) -> None: ...
    def on_hit(self, records: list[PageRecord]) -> None: ...
    def on_wanted(self, records: list[PageRecord]) -> None: ...
    def on_dram_short(self) -> None: ...


class NoListener:
    wants_commits = False

    def on_commit(self, records: list[PageRecord]) -> None: pass
    def on_hit(self, records: list[PageRecord]) -> None: pass
    def on_wanted(self, records: list[PageRecord]) -> None: pass
    def on_dram_short(self) -> None: pass


@dataclasses.dataclass(eq=False)
class Reservation:
    """A Reserve in two steps: what the index said, then slots for the pages wanted."""

    lease: Lease | None
    first_index: int
    states: list[int]
    offsets: list[int]
    wanted: list[int]            # positions still to be given a slot
    slot_bytes: int
    extending: bool
    tenant: str = ""
    refusal: str = ""            # why pages past the granted ones got no slot, when a quota is the reason


@dataclasses.dataclass(eq=False)
class Claim:
    """NVMe pages taken for promotion: each has a DRAM slot of its own size, and is busy and pinned."""

    records: list[PageRecord]
    slots: list[int]
    short: int                   # pages that got no slot (DRAM is full of pinned or unsaved pages)


@dataclasses.dataclass(frozen=True)
class CommitPart:
    """One lease of a group commit: as a Commit names it (indices, checksums, whose checksums)."""

    lease_id: int
    indices: list[int]
    checksums: list[int]
    from_writer: bool
