"""Engine KV caches of every supported layout, filled at random, and each block read out the plain way.

Shared by the CPU tests (tests/unit/test_kv_layout.py) and the kernel tests (tests/gpu/): each case
builds an engine's own tensors (on `device`) with the shapes SGLang and vLLM allocate, and a
`logical(block)` that indexes them directly into [kv, layer, token, head, dim], independent of
the stride arithmetic under test.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch

from kvstore_client import kv_layout

LAYERS, TOKENS, HEADS, DIM, BLOCKS = 3, 4, 2, 8, 6


@dataclasses.dataclass
class Case:
    name: str
    cache: kv_layout.CacheLayout
    logical: Callable[[int], Any]     # block -> [kv, layer, token, head, dim]
    shape: kv_layout.PageShape
    tensors: list[Any]


def _rand(shape: tuple[int, ...], dtype: Any, device: str, gen: torch.Generator) -> Any:
    raw = torch.randint(0, 256, (*shape[:-1], shape[-1] * torch.tensor([], dtype=dtype).element_size()),
                        dtype=torch.uint8, generator=gen)
    return raw.view(dtype).to(device)


def cases(device: str = "cpu", dtype: Any = torch.float16, seed: int = 0) -> list[Case]:
    gen = torch.Generator().manual_seed(seed)
    L, P, H, D, B = LAYERS, TOKENS, HEADS, DIM, BLOCKS
    item = torch.tensor([], dtype=dtype).element_size()
    mha = kv_layout.PageShape(kv=2, layers=L, tokens=P, heads=H, dim=D, dtype_bytes=item)
    mla = kv_layout.PageShape(kv=1, layers=L, tokens=P, heads=1, dim=D, dtype_bytes=item)
    out = []

    # SGLang device MHA, NHD: per layer [size + page_size, heads, dim], K and V apart.
    k = [_rand((B * P + P, H, D), dtype, device, gen) for _ in range(L)]
    v = [_rand((B * P + P, H, D), dtype, device, gen) for _ in range(L)]
    out.append(Case("sglang_mha_nhd", kv_layout.sglang_mha(k, v, P),
                    lambda b, k=k, v=v: torch.stack([torch.stack([t[b * P:(b + 1) * P] for t in side]) for side in (k, v)]),
                    mha, k + v))

    # SGLang device MHA, HND: per layer [pages, heads, page_size, dim].
    k = [_rand((B, H, P, D), dtype, device, gen) for _ in range(L)]
    v = [_rand((B, H, P, D), dtype, device, gen) for _ in range(L)]
    out.append(Case("sglang_mha_hnd", kv_layout.sglang_mha(k, v, P),
                    lambda b, k=k, v=v: torch.stack([torch.stack([t[b].transpose(0, 1) for t in side]) for side in (k, v)]),
                    mha, k + v))

    # SGLang device MLA: per layer [size + page_size, 1, dim].
    kv = [_rand((B * P + P, 1, D), dtype, device, gen) for _ in range(L)]
    out.append(Case("sglang_mla", kv_layout.sglang_mla(kv, P),
                    lambda b, kv=kv: torch.stack([t[b * P:(b + 1) * P] for t in kv]).unsqueeze(0), mla, kv))

    # SGLang host pools: [2, L, size, H, D], [2, size, L, H, D], [2, pages, L, P, H, D].
    host = _rand((2, L, B * P, H, D), dtype, device, gen)
    out.append(Case("sglang_host_layer_first", kv_layout.sglang_host(host, "layer_first", P),
                    lambda b, t=host: t[:, :, b * P:(b + 1) * P], mha, [host]))
    host = _rand((2, B * P, L, H, D), dtype, device, gen)
    out.append(Case("sglang_host_page_first", kv_layout.sglang_host(host, "page_first", P),
                    lambda b, t=host: t[:, b * P:(b + 1) * P].transpose(1, 2), mha, [host]))
    host = _rand((2, B, L, P, H, D), dtype, device, gen)
    out.append(Case("sglang_host_page_first_direct", kv_layout.sglang_host(host, "page_first_direct", P),
                    lambda b, t=host: t[:, b], mha, [host]))

    # vLLM, per layer [blocks, heads, block_size, 2 * head_size] logically; physically NHD (LBNHC) and HND.
    for name, physical in (("vllm_nhd", (B, P, H, 2 * D)), ("vllm_hnd", (B, H, P, 2 * D))):
        layers = [_rand(physical, dtype, device, gen) for _ in range(L)]
        logical_layers = [t.transpose(1, 2) if name == "vllm_nhd" else t for t in layers]   # [B, H, N, 2D]
        out.append(Case(name, kv_layout.vllm(logical_layers),
                        lambda b, ls=logical_layers: torch.stack([
                            torch.stack([t[b][..., :D].transpose(0, 1) for t in ls]),
                            torch.stack([t[b][..., D:].transpose(0, 1) for t in ls])]),
                        mha, layers))

    # vLLM's older per-layer [2, blocks, block_size, heads, head_size].
    layers = [_rand((2, B, P, H, D), dtype, device, gen) for _ in range(L)]
    out.append(Case("vllm_2bnhd", kv_layout.vllm(layers),
                    lambda b, ls=layers: torch.stack([torch.stack([t[kv, b] for t in ls]) for kv in range(2)]),
                    mha, layers))
    return out


def page_bytes(logical: Any, page_format: kv_layout.PageFormat) -> bytes:
    """The page, written the plain way: the logical block permuted into the format's axis order."""
    order = [kv_layout.AXES.index(axis) for axis in page_format.order]
    return logical.permute(order).contiguous().cpu().view(torch.uint8).numpy().tobytes()
