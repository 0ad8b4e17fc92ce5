"""The CPU reference of the layout kernel moves exactly the bytes a plain per-page copy does, every layout both ways."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kv_layout_cases import BLOCKS, cases, page_bytes
from kvstore_client import errors, kv_layout

FORMATS = sorted(kv_layout.PAGE_FORMATS)
CASES = [c.name for c in cases()]


def _arena(pages: int, page_bytes_: int, rng: np.random.Generator, misalign: int) -> tuple[np.ndarray, np.ndarray]:
    """A host buffer standing in for the arena, with pages at scattered slots (offset by `misalign` bytes)."""
    arena = rng.integers(0, 256, size=(2 * pages + 1) * page_bytes_ + misalign, dtype=np.uint8)
    slots = rng.permutation(2 * pages)[:pages]
    return arena, (arena.ctypes.data + misalign + slots * page_bytes_).astype(np.uint64)


def _case(name: str, dtype=torch.float16):
    return next(c for c in cases(dtype=dtype, seed=hash(name) % 1000) if c.name == name)


def _plan_for(case_name: str, page_format: str, seed: int, blocks: int):
    """A case, its page format and plan, a seeded generator, and `blocks` distinct cache blocks in random order."""
    case, fmt = _case(case_name), kv_layout.PAGE_FORMATS[page_format]
    rng = np.random.default_rng(seed)
    plan = kv_layout.plan(case.shape, fmt, case.cache)
    return case, fmt, rng, plan, rng.permutation(BLOCKS)[:blocks].astype(np.int64)


@pytest.mark.parametrize("page_format", FORMATS)
@pytest.mark.parametrize("case_name", CASES)
def test_gather_matches_plain_copy(case_name, page_format):
    case, fmt, rng, plan, blocks = _plan_for(case_name, page_format, seed=1, blocks=4)
    arena, addrs = _arena(len(blocks), plan.page_bytes, rng, misalign=0)
    kv_layout.reference_cache_to_pages(plan, addrs, blocks)
    for addr, block in zip(addrs.tolist(), blocks.tolist()):
        got = arena[addr - arena.ctypes.data:addr - arena.ctypes.data + plan.page_bytes].tobytes()
        assert got == page_bytes(case.logical(block), fmt)


@pytest.mark.parametrize("page_format", FORMATS)
@pytest.mark.parametrize("case_name", CASES)
def test_scatter_matches_plain_copy_and_touches_only_its_blocks(case_name, page_format):
    case, fmt, rng, plan, blocks = _plan_for(case_name, page_format, seed=2, blocks=3)
    before = {b: case.logical(b).clone() for b in range(BLOCKS)}
    arena, addrs = _arena(len(blocks), plan.page_bytes, rng, misalign=0)
    kv_layout.reference_pages_to_cache(plan, addrs, blocks)
    for b in range(BLOCKS):
        if b in blocks.tolist():
            addr = int(addrs[blocks.tolist().index(b)]) - arena.ctypes.data
            assert page_bytes(case.logical(b), fmt) == arena[addr:addr + plan.page_bytes].tobytes()
        else:
            assert torch.equal(case.logical(b).view(torch.uint8), before[b].view(torch.uint8))


def test_round_trip_through_unaligned_pages_uses_byte_words():
    case, fmt = _case("vllm_nhd"), kv_layout.PAGE_FORMATS["sglang_page_first"]
    rng = np.random.default_rng(3)
    plan = kv_layout.plan(case.shape, fmt, case.cache)
    arena, addrs = _arena(2, plan.page_bytes, rng, misalign=1)
    assert plan.word_bytes(addrs) == 1
    assert plan.word_bytes(addrs - 1) >= 2
    original = arena.copy()
    blocks = np.array([5, 0], dtype=np.int64)
    kv_layout.reference_pages_to_cache(plan, addrs, blocks)
    arena[:] = 0
    kv_layout.reference_cache_to_pages(plan, addrs, blocks)
    for addr in addrs.tolist():
        at = addr - arena.ctypes.data
        assert arena[at:at + plan.page_bytes].tobytes() == original[at:at + plan.page_bytes].tobytes()


def test_adjacent_heads_and_tokens_merge_into_one_chunk():
    # SGLang's page_first_direct pages against its page_first_direct host pool: each (kv, layer) is one run.
    case = _case("sglang_host_page_first_direct")
    plan = kv_layout.plan(case.shape, kv_layout.PAGE_FORMATS["sglang_page_first_direct"], case.cache)
    assert (plan.tokens, plan.heads, plan.chunk_bytes) == (1, 1, case.shape.tokens * case.shape.heads * case.shape.dim * 2)
    # vLLM's blocks keep K and V of a head together, so each chunk is one head's dim.
    case = _case("vllm_nhd")
    plan = kv_layout.plan(case.shape, kv_layout.PAGE_FORMATS["vllm_block"], case.cache)
    assert (plan.heads, plan.chunk_bytes) == (case.shape.heads, case.shape.dim * 2)


def test_mismatched_shapes_and_blocks_are_refused_with_their_names():
    case = _case("sglang_mha_nhd")
    wrong = kv_layout.PageShape(kv=2, layers=case.shape.layers + 1, tokens=case.shape.tokens, heads=case.shape.heads,
                                dim=case.shape.dim, dtype_bytes=2)
    with pytest.raises(errors.InvalidArgument, match="does not match"):
        kv_layout.plan(wrong, kv_layout.PAGE_FORMATS["lmcache"], case.cache)
    plan = kv_layout.plan(case.shape, kv_layout.PAGE_FORMATS["lmcache"], case.cache)
    with pytest.raises(errors.InvalidArgument, match="block ids must be in"):
        kv_layout.reference_pages_to_cache(plan, np.zeros(1, np.uint64), np.array([case.cache.blocks], np.int64))
    with pytest.raises(errors.InvalidArgument, match="dim last"):
        kv_layout.PageFormat(("dim", "kv", "layer", "token", "head"))
    with pytest.raises(errors.InvalidArgument, match="kv must be 1"):
        kv_layout.PageShape(kv=3, layers=1, tokens=1, heads=1, dim=1, dtype_bytes=1)
