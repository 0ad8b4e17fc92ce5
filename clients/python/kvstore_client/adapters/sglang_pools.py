"""SGLang's sidecar host pools (HiCache v2): where their pages go and what a lookup answers.

Hybrid and sparse models keep state beside the KV pool (Mamba/SSM states, sliding-window KV,
the DSA indexer, MTP draft pools); SGLang 0.5.23 moves it with batch_set_v2 / batch_get_v2 /
batch_exists_v2, one PoolTransfer per pool, the pages named by the same prefix keys as the KV
page of their position. Each pool gets a namespace of its own (its page size is its own), so a
pool's page is stored under the KV page's key in that pool's namespace, and a chain of them
hangs off the prefix keys SGLang names (a trailing-only pool's pages are anchored at the page
before them: the store keeps them although it holds no state for that page).
The ranks of an MLA model share a pool's pages as they share the KV (the writer rank backs
them up), except Mamba states, which are TP-sharded: each rank keeps its own.

A position is the KV page and the sidecar pages named by one prefix key: its page group. The
store holds each part as a page of its own namespace (evicted leaf-first on its own) and offers
three group calls (kvstore_client/groups.py): CommitGroup publishes several write leases in one
step, all or nothing; LookupGroup answers from one snapshot which prefixes every part can restore
under its pool's hit policy; AcquireGroup pins every part's pages at once. On top of them:

- A backup becomes visible one position whole. SGLang's hybrid backup writes the sidecars through
  batch_set_v2 first and the KV pages afterwards through batch_set_v1 (or batch_set), in batches.
  On a rank that writes the KV, batch_set_v2 stages each sidecar page (copied into its slot under a
  write lease, not visible) and answers True; the KV batch that names the same keys stages its
  pages and commits them with the held sidecar pages of those keys in one CommitGroup. Where the
  KV page is already stored, the sidecar pages are published alone, which completes the position
  in one step too. A rank that writes no KV (a non-writer MLA rank's TP-sharded Mamba states)
  commits its sidecar pages at once: there is no KV write to wait for.
- A sidecar page whose KV write never comes (the KV batch failed, or SGLang stopped the backup)
  stays held until its write lease's TTL (leases.write_ttl_ms); the node then aborts it and it
  never becomes visible. SGLang was told True for it, so its per-pool belief is too high until its
  next query, which answers the position absent (never a KV page paired with a missing state).
  When a group commit is refused (a held lease expired), the KV pages are stored alone: the
  position then answers absent in every lookup whose pools need the missing part.
- batch_exists_v2 is one LookupGroup: the KV pool bounds the answer with its leading pages and each
  pool's hit policy (ALL_PAGES, TRAILING_PAGES: SGLang's) is applied by the node to the same
  snapshot, so the answer equals the file backend's fold on the same pages, and a group committed
  together is seen whole or not at all. A position with a part evicted or deleted answers absent.
- batch_get_v2 is one AcquireGroup over every pool of the call: every part is pinned in one step,
  and a key loads in every pool that names it or in none (a pool stops at the first key another
  pool of the call missed; SGLang counts each pool's leading successes).
- batch_exists (v1) answers the KV pages alone, as the file backend does: SGLang asks it only for
  a prefetch that moves no sidecar (one with no pool transfers).

What is not guaranteed: SGLang loads the KV pages through batch_get_v1 before it asks for their
sidecars through batch_get_v2, in separate calls; no lease holds a group between those calls, or
between batch_exists_v2 and the loads. A part evicted in between fails its pool's get, and SGLang's
own clamp (the minimum of the pools' hits) keeps the KV page from being used without it.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Any, Callable, Optional, Sequence

import torch
from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer, PoolTransferResult

from kvstore_client.buffers import Segment
from kvstore_client.groups import GroupHits, GroupPart, StagedPages
from kvstore_client.keys import Namespace


@dataclasses.dataclass(frozen=True)
class SidecarPool:
    """One registered sidecar host pool and the namespace of its pages."""

    name: str
    host_pool: Any
    namespace: Namespace
    zero_copy: bool            # get_page_buffer_meta addresses its pages (else: SGLang's flat page)
    per_rank: bool             # TP-sharded state: every rank writes its own pages, even beside MLA KV

    def page_segments(self, keys: Sequence[str], host_indices: torch.Tensor) -> list[list[Segment]]:
        """(pointer, nbytes) segments of each page in the pool, in the order of its flat page."""
        page_tokens = self.host_pool.page_size or 1
        if host_indices is None or host_indices.numel() != len(keys) * page_tokens:
            raise ValueError(f"pool {self.name}: {0 if host_indices is None else host_indices.numel()} host "
                             f"indices for {len(keys)} pages of {page_tokens}")
        pointers, sizes = self.host_pool.get_page_buffer_meta(host_indices)
        per_page = len(pointers) // max(len(keys), 1)
        return [list(zip(pointers[p * per_page:(p + 1) * per_page], sizes[p * per_page:(p + 1) * per_page]))
                for p in range(len(keys))]

    def first_indices(self, keys: Sequence[str], host_indices: torch.Tensor) -> list[int]:
        page_tokens = self.host_pool.page_size or 1
        if host_indices is None or host_indices.numel() != len(keys) * page_tokens:
            raise ValueError(f"pool {self.name}: host indices do not cover {len(keys)} pages")
        return [int(host_indices[i * page_tokens]) for i in range(len(keys))]


def sidecar_pool(name: str, host_pool: Any, kv_namespace: Namespace, tp_rank: int, tp_size: int) -> SidecarPool:
    """The namespace of a sidecar pool's pages: the KV namespace's identity, this pool's name and layout.

    A pool is shared by the TP ranks exactly when the KV is (MLA: one writer rank backs it up, every rank
    reads it, as SGLang's hybrid backup and its file backend's keys have it), except Mamba states, which
    are TP-sharded even where the KV is replicated: every rank writes and reads its own."""
    flat_bytes = host_pool.get_dummy_flat_data_page().nbytes
    zero_copy = _addressable(host_pool, flat_bytes)
    layout = f"{kv_namespace.layout};pool={name}:{type(host_pool).__name__}:{getattr(host_pool, 'layout', '')}"
    per_rank = str(name) == str(PoolName.MAMBA)
    namespace = dataclasses.replace(kv_namespace, page_bytes=flat_bytes, page_tokens=host_pool.page_size or 1,
                                    kv_dtype=str(getattr(host_pool, "dtype", "")).removeprefix("torch."),
                                    layout=layout,
                                    tp_rank=tp_rank if per_rank else kv_namespace.tp_rank,
                                    tp_size=tp_size if per_rank else kv_namespace.tp_size)
    return SidecarPool(str(name), host_pool, namespace, zero_copy, per_rank)


def _addressable(host_pool: Any, flat_bytes: int) -> bool:
    """Whether the pool's zero-copy segments are its flat page's parts, in the flat page's order.

    Checked on the pool's structure, not its bytes (a fresh pool is all zeros): the pools that
    build their flat page from _iter_page_tensors (Mamba states) must hand out exactly those
    tensors' memory as segments. Other pools move through SGLang's flat page (one copy more)."""
    iter_tensors = getattr(host_pool, "_iter_page_tensors", None)
    if iter_tensors is None:
        return False
    slot = 1 if getattr(host_pool, "size", 0) > 1 else 0
    try:
        pointers, sizes = host_pool.get_page_buffer_meta(torch.tensor([slot] * (host_pool.page_size or 1)))
        parts = list(iter_tensors(slot))
    except (NotImplementedError, ValueError, AttributeError):
        return False
    if not all(part.is_contiguous() for part in parts):
        return False
    spans = [(part.data_ptr(), part.numel() * part.element_size()) for part in parts]
    return spans == list(zip(pointers, sizes)) and sum(sizes) == flat_bytes


def group_parts(kv_namespace: Namespace, transfers: Sequence[PoolTransfer],
                pool_of: Callable[[Any], "SidecarPool"]) -> tuple[list[GroupPart], list[PoolTransfer]]:
    """batch_exists_v2's LookupGroup parts: the KV pool first, then each sidecar pool with its hit policy
    (the transfers in the order of the parts after the first)."""
    parts, asked = [GroupPart(kv_namespace)], []
    for transfer in transfers:
        if str(transfer.name) == str(PoolName.KV):
            continue   # the KV pool bounds the answer already
        if transfer.hit_policy == PoolHitPolicy.ALL_PAGES:
            parts.append(GroupPart(pool_of(transfer.name).namespace))
        elif transfer.hit_policy == PoolHitPolicy.TRAILING_PAGES:
            trailing = max(1, len(transfer.keys) if transfer.keys else 1)
            parts.append(GroupPart(pool_of(transfer.name).namespace, "trailing_pages", trailing))
        else:
            raise ValueError(f"unsupported pool hit policy {transfer.hit_policy} for pool {transfer.name}: "
                             "kvstore serves ALL_PAGES and TRAILING_PAGES")
        asked.append(transfer)
    return parts, asked


def span_hits(lookup: Callable[[Sequence[str], list[GroupPart]], GroupHits], keys: Sequence[str],
              parts: Sequence[GroupPart], window: int) -> GroupHits:
    """The group answer for a span of any length, from LookupGroups of at most `window` keys each
    (limits.lookup_pages_max): one snapshot where the span fits. A longer span is read in windows
    while the KV pool holds all of one, each window asking every sidecar pool beside the KV pool
    alone (so each answer is that pool's own acceptance), then folded as the node folds one lookup
    (kvstore_client/groups.py). A window overlaps the one before by the longest trailing need less
    one, so whether a trailing pool accepts a prefix is judged where every page it needs lies in one
    window. (Windows are separate snapshots: a lookup is advice; the get that follows answers from
    what it pins.)"""
    if len(keys) <= window:
        return lookup(keys, list(parts))
    overlap = max((part.trailing_pages for part in parts if part.hit_policy == "trailing_pages"), default=1) - 1
    if window <= overlap:
        raise ValueError(f"a trailing pool needs {overlap + 1} pages, more than one group lookup holds ({window})")
    kv, sidecars = parts[0], list(parts[1:])
    accepted: list[set[int]] = [set() for _ in sidecars]
    broken = [False] * len(sidecars)    # an ALL_PAGES pool that missed a page accepts no longer prefix
    start = leading = 0
    while True:
        span = keys[start:start + window]
        judged_before = overlap if start else 0   # the window before judged these positions, with their pages
        window_leading = lookup(span, [kv]).hit_pages if not sidecars else None
        for i, part in enumerate(sidecars):
            if broken[i]:
                continue
            hits = lookup(span, [kv, part])
            window_leading = hits.part_hit_pages[0]
            accepted[i] |= {start + length for length in hits.restorable_pages if length > judged_before}
            broken[i] = part.hit_policy == "all_pages" and hits.part_hit_pages[1] < window_leading
        if window_leading is None:   # every sidecar pool broke in an earlier window: the KV pool alone
            window_leading = lookup(span, [kv]).hit_pages
        leading = start + window_leading
        if window_leading < len(span) or start + len(span) == len(keys):
            break
        start += window - overlap
    restorable, part_hits = set(range(1, leading + 1)), [leading]
    for found in accepted:
        found = {length for length in found if length <= leading}
        part_hits.append(max(found, default=0) if restorable else 0)
        restorable &= found
    ordered = sorted(restorable)
    return GroupHits(ordered[-1] if ordered else 0, part_hits, ordered)


def exists_result(asked: Sequence[PoolTransfer], hits: GroupHits) -> PoolTransferResult:
    """SGLang's PoolTransferResult from a LookupGroup's answer (a pool that accepts no prefix is left out,
    as SGLang's own backends leave it out)."""
    hit_count: dict[Any, int] = {PoolName.KV: hits.part_hit_pages[0]} if hits.part_hit_pages[0] else {}
    for transfer, part_hits in zip(asked, hits.part_hit_pages[1:]):
        if part_hits:
            hit_count[transfer.name] = part_hits
    return PoolTransferResult(hits.hit_pages, hit_count, list(hits.restorable_pages))


class HeldSidecars:
    """Sidecar pages staged by batch_set_v2 and held, uncommitted, until the KV pages of the same keys are
    committed with them (one group commit). Shared by SGLang's backup threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._staged: list[StagedPages] = []

    def hold(self, staged: StagedPages) -> None:
        if staged.slots:
            with self._lock:
                self._staged.append(staged)

    def take(self, keys: Sequence[str]) -> list[StagedPages]:
        """The held pages of these keys, one part per lease; they are no longer held. Parts whose lease may
        have expired are dropped (the node aborts them)."""
        now = time.monotonic()
        with self._lock:
            self._staged = [staged for staged in self._staged if staged.slots and staged.commit_by > now]
            taken = [staged.take(keys) for staged in self._staged]
        return [part for part in taken if part.slots]

    def __len__(self) -> int:
        with self._lock:
            return sum(len(staged.slots) for staged in self._staged)


def parent_of(extra_info: Optional[Any]) -> str | None:
    if extra_info is not None and getattr(extra_info, "prefix_keys", None):
        return extra_info.prefix_keys[-1]
    return None
