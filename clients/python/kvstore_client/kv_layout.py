"""Where each byte of a stored page goes in an engine's paged KV cache, and back.

A page holds the KV of `tokens` tokens of every layer: logically a [kv, layer, token, head, dim]
grid, with kv = 2 (K and V) or 1 (MLA's latent). A PageFormat says in which order those axes lie in
the page's bytes; the engines differ (SGLang's HiCache pages are K then V, each token-major across
layers; LMCache's are layer-major; a vLLM block keeps each token's K and V side by side). A
CacheLayout says where a block of the engine's cache is: one [blocks, tokens, heads, dim] view per
(kv, layer), any strides, dim contiguous, built from the engine's own tensors (the functions
below). `plan` joins the two into a CopyPlan: the numbers the gather/scatter kernel
(native/kv_layout.cu) takes, one launch per call; `reference_pages_to_cache` and
`reference_cache_to_pages` run the same plan on the CPU (host addresses), and are what the kernel
is tested against.
"""

from __future__ import annotations

import ctypes
import dataclasses
import math
from typing import Any, Sequence

import numpy as np

from kvstore_client.errors import InvalidArgument

AXES = ("kv", "layer", "token", "head", "dim")


@dataclasses.dataclass(frozen=True)
class PageShape:
    kv: int           # 2 (K and V) or 1 (MLA: one latent per token)
    layers: int
    tokens: int       # tokens per page (the engine's page or block size)
    heads: int        # KV heads in this rank's share
    dim: int          # head dim (MLA: kv_lora_rank + rope dim)
    dtype_bytes: int  # bytes per element

    def __post_init__(self) -> None:
        for name in ("kv", "layers", "tokens", "heads", "dim", "dtype_bytes"):
            if getattr(self, name) <= 0:
                raise InvalidArgument(f"PageShape.{name} must be positive, got {getattr(self, name)}")
        if self.kv not in (1, 2):
            raise InvalidArgument(f"PageShape.kv must be 1 (MLA) or 2 (K and V), got {self.kv}")

    @property
    def page_bytes(self) -> int:
        return self.kv * self.layers * self.tokens * self.heads * self.dim * self.dtype_bytes

    def size(self, axis: str) -> int:
        return {"kv": self.kv, "layer": self.layers, "token": self.tokens, "head": self.heads, "dim": self.dim}[axis]


@dataclasses.dataclass(frozen=True)
class PageFormat:
    """The order of the logical axes in a page's bytes, outermost first; dim is always innermost."""

    order: tuple[str, ...]

    def __post_init__(self) -> None:
        if sorted(self.order) != sorted(AXES) or self.order[-1] != "dim":
            raise InvalidArgument(f"a page format orders {AXES} with dim last, got {self.order}")

    def strides_bytes(self, shape: PageShape) -> dict[str, int]:
        strides, step = {}, shape.dtype_bytes
        for axis in reversed(self.order):
            strides[axis] = step
            step *= shape.size(axis)
        return strides


# The formats engines write pages in (the bytes their storage back-ends hand over per page).
PAGE_FORMATS = {
    # K then V, each [token, layer, head, dim]: SGLang HiCache host pool "page_first" (zero-copy set/get).
    "sglang_page_first": PageFormat(("kv", "token", "layer", "head", "dim")),
    # K then V, each [layer, token, head, dim]: SGLang "page_first_direct"; LMCache's KV_2LTD chunks.
    "sglang_page_first_direct": PageFormat(("kv", "layer", "token", "head", "dim")),
    # Per layer K then V, each [token, head, dim]: SGLang "layer_first" (one K and one V pointer per layer).
    "sglang_layer_first": PageFormat(("layer", "kv", "token", "head", "dim")),
    # K then V, each [head, token, layer, dim]: SGLang "page_head".
    "sglang_page_head": PageFormat(("kv", "head", "token", "layer", "dim")),
    # Per layer [token, head, K|V, dim]: a vLLM block (per-layer [blocks, tokens, heads, 2 * head_size]).
    "vllm_block": PageFormat(("layer", "token", "head", "kv", "dim")),
}
PAGE_FORMATS["lmcache"] = PAGE_FORMATS["sglang_page_first_direct"]


@dataclasses.dataclass(frozen=True)
class CacheLayout:
    """An engine's paged KV cache: one [blocks, tokens, heads, dim] view per (kv, layer), kv-major."""

    bases: tuple[int, ...]                  # data_ptr of each view's block 0, index kv * layers + layer
    kv: int
    layers: int
    blocks: int
    tokens: int
    heads: int
    dim: int
    dtype_bytes: int
    strides_bytes: tuple[int, int, int]     # block, token, head
    device: str                             # "cpu" or "cuda:N"
    keepalive: tuple[Any, ...] = dataclasses.field(default=(), repr=False, compare=False)


def from_views(views: Sequence[Sequence[Any]]) -> CacheLayout:
    """views[kv][layer]: torch tensors [blocks, tokens, heads, dim], dim contiguous, all of one shape and strides."""
    flat = [view for per_kv in views for view in per_kv]
    if not flat or any(len(per_kv) != len(views[0]) for per_kv in views):
        raise InvalidArgument("a cache layout needs the same number of layers (at least one) for K and V")
    first = flat[0]
    if first.dim() != 4 or first.stride(3) != 1:
        raise InvalidArgument(f"a cache view is [blocks, tokens, heads, dim] with dim contiguous; "
                              f"got shape {tuple(first.shape)}, strides {first.stride()}")
    for view in flat:
        if tuple(view.shape) != tuple(first.shape) or view.stride() != first.stride() or view.dtype != first.dtype \
                or view.device != first.device:
            raise InvalidArgument("every (kv, layer) view of a cache must have one shape, strides, dtype and device")
    item = first.element_size()
    blocks, tokens, heads, dim = first.shape
    return CacheLayout(bases=tuple(view.data_ptr() for view in flat), kv=len(views), layers=len(views[0]),
                       blocks=blocks, tokens=tokens, heads=heads, dim=dim, dtype_bytes=item,
                       strides_bytes=(first.stride(0) * item, first.stride(1) * item, first.stride(2) * item),
                       device=str(first.device), keepalive=tuple(flat))


def sglang_mha(k_buffer: Sequence[Any], v_buffer: Sequence[Any], page_size: int) -> CacheLayout:
    """SGLang's MHATokenToKVPool: per layer [rows, heads, dim] (NHD, row = token slot) or
    [pages, heads, page_size, dim] (HND); block b is token slots b * page_size ...; K and V apart."""
    return from_views([[_sglang_blocks(t, page_size) for t in k_buffer], [_sglang_blocks(t, page_size) for t in v_buffer]])


def sglang_mla(kv_buffer: Sequence[Any], page_size: int) -> CacheLayout:
    """SGLang's MLATokenToKVPool: per layer [rows, 1, kv_lora_rank + rope_dim]."""
    return from_views([[_sglang_blocks(t, page_size) for t in kv_buffer]])


def sglang_host(kv_buffer: Any, layout: str, page_size: int) -> CacheLayout:
    """SGLang's MHATokenToKVPoolHost: [2, layers, size, heads, dim] ("layer_first"), [2, size, layers, heads, dim]
    ("page_first") or [2, pages, layers, page_size, heads, dim] ("page_first_direct")."""
    if layout == "layer_first":
        views = [[kv_buffer[k, l].unflatten(0, (-1, page_size)) for l in range(kv_buffer.shape[1])] for k in range(2)]
    elif layout == "page_first":
        views = [[kv_buffer[k, :, l].unflatten(0, (-1, page_size)) for l in range(kv_buffer.shape[2])] for k in range(2)]
    elif layout == "page_first_direct":
        views = [[kv_buffer[k, :, l] for l in range(kv_buffer.shape[2])] for k in range(2)]
    else:
        raise InvalidArgument(f"SGLang host layout must be layer_first, page_first or page_first_direct, got {layout!r}")
    return from_views(views)


def vllm(kv_caches: Sequence[Any]) -> CacheLayout:
    """vLLM's per-layer caches: [blocks, heads, block_size, 2 * head_size] (logical order, any physical
    stride order; K and V split from the last axis as vLLM's attention does) or the older
    [2, blocks, block_size, heads, head_size]."""
    first = kv_caches[0]
    if first.dim() == 5 and first.shape[0] == 2:
        return from_views([[t[0] for t in kv_caches], [t[1] for t in kv_caches]])
    if first.dim() != 4 or first.shape[3] % 2:
        raise InvalidArgument(f"a vLLM layer cache is [blocks, heads, block_size, 2 * head_size], got {tuple(first.shape)}")
    head_size = first.shape[3] // 2
    halves = [t.transpose(1, 2).split(head_size, dim=-1) for t in kv_caches]
    return from_views([[k for k, _ in halves], [v for _, v in halves]])


def _sglang_blocks(t: Any, page_size: int) -> Any:
    if t.dim() == 4:   # HND: [pages, heads, page_size, dim]
        return t.transpose(1, 2)
    rows = t.shape[0] - t.shape[0] % page_size
    return t[:rows].unflatten(0, (-1, page_size))


# The kernel's parameters before its three arrays, in order (native/kv_layout.cu, PLAN_PARAMS).
PLAN_FIELDS = ("kv", "layers", "tokens", "heads", "chunk_bytes", "page_kv", "page_layer", "page_token", "page_head",
               "cache_block", "cache_token", "cache_head")


@dataclasses.dataclass(frozen=True)
class CopyPlan:
    """One page's grid of contiguous chunks on both sides, in bytes; see native/kv_layout.cu."""

    kv: int
    layers: int
    tokens: int
    heads: int
    chunk_bytes: int
    page_kv: int
    page_layer: int
    page_token: int
    page_head: int
    cache_block: int
    cache_token: int
    cache_head: int
    cache_bases: np.ndarray        # uint64, kv * layers
    page_bytes: int
    cache_blocks: int
    cache_device: str

    def word_bytes(self, page_addrs: np.ndarray) -> int:
        """The widest word (16, 8, 4 or 1 bytes) that divides every address and stride of a call."""
        values = [getattr(self, name) for name in PLAN_FIELDS[4:]]
        bits = np.bitwise_or.reduce(np.concatenate([np.asarray(values, dtype=np.uint64), self.cache_bases,
                                                    page_addrs.astype(np.uint64)]))
        for word in (16, 8, 4):
            if int(bits) % word == 0:
                return word
        return 1

    def kernel_args(self, word: int) -> tuple[int, ...]:
        """The plan's numbers as the kernel takes them: counts, then strides in words."""
        counts = (self.kv, self.layers, self.tokens, self.heads)
        return counts + tuple(getattr(self, name) // word for name in PLAN_FIELDS[4:])

    def check_blocks(self, block_ids: np.ndarray) -> None:
        if block_ids.size and (int(block_ids.min()) < 0 or int(block_ids.max()) >= self.cache_blocks):
            raise InvalidArgument(f"block ids must be in [0, {self.cache_blocks}), got {int(block_ids.min())} to "
                                  f"{int(block_ids.max())}")


def plan(shape: PageShape, page_format: PageFormat, cache: CacheLayout) -> CopyPlan:
    """Join a page format and an engine's cache; raises InvalidArgument when their shapes differ."""
    want = (shape.kv, shape.layers, shape.tokens, shape.heads, shape.dim, shape.dtype_bytes)
    have = (cache.kv, cache.layers, cache.tokens, cache.heads, cache.dim, cache.dtype_bytes)
    if want != have:
        raise InvalidArgument(f"the page shape (kv, layers, tokens, heads, dim, dtype bytes) {want} does not match "
                              f"the engine's cache {have}")
    page = page_format.strides_bytes(shape)
    block, token, head = cache.strides_bytes
    chunk, tokens, heads = shape.dim * shape.dtype_bytes, shape.tokens, shape.heads
    if heads > 1 and page["head"] == head == chunk:      # heads adjacent on both sides: one chunk per token
        chunk, heads = chunk * heads, 1
    if heads == 1 and tokens > 1 and page["token"] == token == chunk:   # and tokens too: one chunk per slab
        chunk, tokens = chunk * tokens, 1
    if tokens * heads * chunk >= 1 << 31:
        raise InvalidArgument(f"one (kv, layer) of a page holds {tokens * heads * chunk} bytes; the kernel takes under 2 GiB")
    return CopyPlan(kv=shape.kv, layers=shape.layers, tokens=tokens, heads=heads, chunk_bytes=chunk,
                    page_kv=page["kv"], page_layer=page["layer"], page_token=page["token"], page_head=page["head"],
                    cache_block=block, cache_token=token, cache_head=head,
                    cache_bases=np.asarray(cache.bases, dtype=np.uint64), page_bytes=shape.page_bytes,
                    cache_blocks=cache.blocks, cache_device=cache.device)


def reference_pages_to_cache(p: CopyPlan, page_addrs: np.ndarray, block_ids: np.ndarray) -> None:
    """The gather kernel's work on the CPU, over host addresses: each page into its block."""
    _copy_slabs(p, page_addrs, block_ids, to_cache=True)


def reference_cache_to_pages(p: CopyPlan, page_addrs: np.ndarray, block_ids: np.ndarray) -> None:
    """The scatter kernel's work on the CPU, over host addresses: each block out into its page."""
    _copy_slabs(p, page_addrs, block_ids, to_cache=False)


def _copy_slabs(p: CopyPlan, page_addrs: np.ndarray, block_ids: np.ndarray, to_cache: bool) -> None:
    """Slab by slab, as native/kv_layout.cu's copy_slab does."""
    p.check_blocks(block_ids)
    for page, (page_addr, block) in enumerate(zip(page_addrs.tolist(), block_ids.tolist())):
        for k in range(p.kv):
            for layer in range(p.layers):
                page_view = _strided(page_addr + k * p.page_kv + layer * p.page_layer, p, p.page_token, p.page_head)
                cache_view = _strided(int(p.cache_bases[k * p.layers + layer]) + block * p.cache_block, p,
                                      p.cache_token, p.cache_head)
                if to_cache:
                    cache_view[...] = page_view
                else:
                    page_view[...] = cache_view


def _strided(address: int, p: CopyPlan, token_stride: int, head_stride: int) -> np.ndarray:
    """A [tokens, heads, chunk_bytes] uint8 view of host memory at `address`."""
    extent = (p.tokens - 1) * token_stride + (p.heads - 1) * head_stride + p.chunk_bytes
    buffer = (ctypes.c_uint8 * extent).from_address(address)
    return np.ndarray((p.tokens, p.heads, p.chunk_bytes), dtype=np.uint8, buffer=buffer,
                      strides=(token_stride, head_stride, 1))


def launch_grid(p: CopyPlan, pages: int, word: int, threads: int) -> tuple[int, int]:
    """grid.x: one slab per (page, kv, layer); grid.y: enough blocks per slab for ~8 words a thread."""
    slab_words = p.tokens * p.heads * (p.chunk_bytes // word)
    return pages * p.kv * p.layers, max(1, min(65535, math.ceil(slab_words / (threads * 8))))
