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

A position is the KV page and the sidecar pages named by one prefix key: its page group.
Each part is a page of its own namespace, committed by its own call (SGLang's hybrid backup
writes the sidecars through batch_set_v2 first and the KV page afterwards through v1; a rank
that is not the storage writer makes only the sidecar calls) and evicted on its own. What the
adapter guarantees on top of that, so that a hit never pairs a KV page with a missing state:

- batch_exists_v2 answers from one set of Lookups, the KV pool's and then every asked
  pool's, issued back to back and folded into one answer after the last of them returns: a
  position counts only when its KV page and every part its pools' hit policies require were
  found (SGLang's own fold, the file backend's answer on the same pages).
- batch_get_v2 reports a position all or nothing: when any part named in the call failed to
  load (evicted or deleted since the lookup), the position fails in every pool of the call,
  and so does every later position (SGLang counts each pool's leading run of successes).
  The host slots of a failed position may hold some parts' bytes; SGLang does not use them.
- batch_exists (v1) answers the KV pages alone, as the file backend does: SGLang asks it only
  for a prefetch that moves no sidecar (one with no pool transfers).

What is not guaranteed: the Lookups are not one snapshot of the store, and no lease holds a
group between the lookup and the load. A part evicted after a hit is answered as a failed
get of its position, never as a load paired with a stale or missing part. A position whose
KV page SGLang loads through batch_get_v1 before asking for its KV-derived sidecars through
batch_get_v2 relies on SGLang's own clamp (the minimum of the pools' hits) for that pairing.
A backup is not one commit: a lookup between the sidecar write and the KV write finds the
sidecars without their KV page, which answers the position absent.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, List, Optional, Sequence

import torch
from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer, PoolTransferResult

from kvstore_client.buffers import Segment
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


def pool_hits(keys: Sequence[str], kv_pages: int, transfers: Sequence[PoolTransfer],
              present: Callable[[str, Sequence[str]], List[bool]]) -> PoolTransferResult:
    """batch_exists_v2's answer: the usable KV prefix under every pool's hit policy (SGLang's rules)."""
    hit_count: dict[str, int] = {PoolName.KV: kv_pages} if kv_pages else {}
    restorable = list(range(1, kv_pages + 1))
    for transfer in transfers:
        if not restorable:
            break
        name = str(transfer.name)
        found = present(name, keys[:kv_pages]) if kv_pages else []
        if transfer.hit_policy == PoolHitPolicy.ALL_PAGES:
            boundary = next((i for i in range(kv_pages) if not found[i]), kv_pages)
            pool_restorable = set(range(1, boundary + 1))
        elif transfer.hit_policy == PoolHitPolicy.TRAILING_PAGES:
            trailing = max(1, len(transfer.keys) if transfer.keys else 1)
            pool_restorable = {length for length in range(1, kv_pages + 1)
                               if all(found[max(0, length - trailing):length])}
            boundary = max(pool_restorable, default=0)
        else:
            raise ValueError(f"unsupported pool hit policy {transfer.hit_policy} for pool {name}: "
                             "kvstore serves ALL_PAGES and TRAILING_PAGES")
        if boundary:
            hit_count[transfer.name] = boundary
        restorable = [length for length in restorable if length in pool_restorable]
    return PoolTransferResult(restorable[-1] if restorable else 0, hit_count, restorable)


def whole_positions(transfers: Sequence[PoolTransfer], loaded: dict[Any, List[bool]]) -> dict[Any, List[bool]]:
    """batch_get_v2's answer: a key counts as loaded in a pool only when every pool of the call that names it
    loaded it, and every earlier key of that pool counts as loaded too (all or nothing per position)."""
    failed = {key for transfer in transfers
              for key, ok in zip(transfer.keys or [], loaded.get(transfer.name, [])) if not ok}
    answers: dict[Any, List[bool]] = {}
    for transfer in transfers:
        keys = list(transfer.keys or [])
        ran = loaded.get(transfer.name, [False] * len(keys))
        whole = next((i for i, key in enumerate(keys) if key in failed or not ran[i]), len(keys))
        answers[transfer.name] = [i < whole for i in range(len(keys))]
    return answers


def parent_of(extra_info: Optional[Any]) -> str | None:
    if extra_info is not None and getattr(extra_info, "prefix_keys", None):
        return extra_info.prefix_keys[-1]
    return None
