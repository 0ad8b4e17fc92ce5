"""Store and load a HF transformers KV cache (DynamicCache) page by page through kvstore.

    pages = TransformersKVPages(client, namespace_for(model.config, "my-llama", page_tokens=16))
    out = model(input_ids, past_key_values=DynamicCache(config=model.config), use_cache=True)
    pages.store(out.past_key_values, tokens)              # every full page of tokens
    cache, cached = pages.load(next_tokens)               # leading cached pages as a DynamicCache
    model(next_ids[:, cached:], past_key_values=cache)    # prefill only what was not cached

A page holds the K and V of `page_tokens` tokens for every layer, laid out page-first:
(layer, K|V, kv head, token, head dim), in the cache's dtype. Its key is the prefix hash of
the tokens up to and including it (kvstore_client.keys.prefix_hashes), so any client that
hashes the same tokens finds it. Batch size 1 (one sequence per cache); full-attention
layers only (a sliding-window layer does not keep every token's KV). torch and
transformers are imported only when this module is used.
"""

from __future__ import annotations

from typing import Any, Sequence

from kvstore_client.client import KVStoreClient
from kvstore_client.keys import Namespace, prefix_hashes

LAYOUT = "hf_page_first"


def namespace_for(config: Any, model: str, page_tokens: int, dtype: Any = None, tenant: str = "") -> Namespace:
    """The namespace of a transformers model's KV pages (fixes page_bytes from the config)."""
    import torch

    dtype = dtype or getattr(config, "dtype", None) or torch.float32
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    layers = config.num_hidden_layers
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    itemsize = torch.empty((), dtype=dtype).element_size()
    return Namespace(model=model, page_bytes=layers * 2 * kv_heads * page_tokens * head_dim * itemsize,
                     page_tokens=page_tokens, tenant=tenant, kv_dtype=str(dtype).removeprefix("torch."),
                     num_layers=layers, num_kv_heads=kv_heads, head_dim=head_dim, layout=LAYOUT)


class TransformersKVPages:
    def __init__(self, client: KVStoreClient, namespace: Namespace):
        if not namespace.page_tokens or not namespace.num_layers:
            raise ValueError("use namespace_for(config, ...) to build the namespace: it needs the KV shape")
        self.client = client
        self.namespace = namespace

    def store(self, cache: Any, tokens: Sequence[int], skip_pages: int = 0) -> int:
        """Store the full pages of `tokens` whose KV is in `cache`; returns leading pages now cached.

        `skip_pages` leading pages are known to be cached already (e.g. the ones just
        loaded) and are not copied again.
        """
        import torch

        ns = self.namespace
        length = min(len(tokens), cache.get_seq_length())
        keys = prefix_hashes(list(tokens[:length]), ns.page_tokens, ns.hash_seed)
        if len(keys) <= skip_pages:
            return len(keys)
        start, stop = skip_pages * ns.page_tokens, len(keys) * ns.page_tokens
        # (layer, K|V, batch=1, head, token, dim) -> (page, layer, K|V, head, token-in-page, dim)
        kv = torch.stack([torch.stack((layer.keys[0, :, start:stop], layer.values[0, :, start:stop]))
                          for layer in cache.layers])
        self._check_shape(kv)
        layers, _, heads, _, dim = kv.shape
        pages = kv.reshape(layers, 2, heads, len(keys) - skip_pages, ns.page_tokens, dim).permute(3, 0, 1, 2, 4, 5)
        pages = pages.contiguous().reshape(len(keys) - skip_pages, -1)
        parent = keys[skip_pages - 1] if skip_pages else None
        return skip_pages + self.client.put(ns, keys[skip_pages:], pages.view(torch.uint8), parent=parent)

    def cached_pages(self, tokens: Sequence[int]) -> int:
        """How many leading full pages of `tokens` the store holds (no data moves)."""
        return self.client.lookup(self.namespace, tokens=list(tokens))

    def load(self, tokens: Sequence[int], pages_max: int | None = None,
             recompute_s_per_token: float = 0.0) -> tuple[Any, int]:
        """(DynamicCache of the leading cached pages of `tokens`, tokens it covers); (None, 0) on a miss.

        `pages_max` caps the pages loaded; a caller that must prefill at least one token
        passes (len(tokens) - 1) // page_tokens. With `recompute_s_per_token` (what this model's
        prefill costs a token here, as the caller measured it), the store is asked first where the
        pages are and what loading them costs (client.residency), and only the leading pages whose
        loading is faster than prefilling them are loaded: none, on a tier slower than the model.
        """
        import torch
        from transformers import DynamicCache

        ns = self.namespace
        keys = prefix_hashes(list(tokens), ns.page_tokens, ns.hash_seed)[:pages_max]
        if keys and recompute_s_per_token > 0:
            here = self.client.residency(ns, keys=keys)
            keys = keys[:here.worth_loading(ns.page_bytes, ns.page_tokens, recompute_s_per_token)]
        if not keys:
            return None, 0
        dtype = getattr(torch, ns.kv_dtype)
        shape = (len(keys), ns.num_layers, 2, ns.num_kv_heads, ns.page_tokens, ns.head_dim)
        pages = torch.empty(shape, dtype=dtype)
        loaded = self.client.get(ns, keys, pages.view(len(keys), -1).view(torch.uint8))
        if not loaded:
            return None, 0
        # (page, layer, K|V, head, token-in-page, dim) -> per layer (batch=1, head, token, dim)
        kv = pages[:loaded].permute(1, 2, 3, 0, 4, 5).reshape(ns.num_layers, 2, ns.num_kv_heads, -1, ns.head_dim)
        layers = [(kv[i, 0].unsqueeze(0).contiguous(), kv[i, 1].unsqueeze(0).contiguous())
                  for i in range(ns.num_layers)]
        return DynamicCache(ddp_cache_data=layers), loaded * ns.page_tokens

    def _check_shape(self, kv: Any) -> None:
        ns = self.namespace
        want = (ns.num_layers, 2, ns.num_kv_heads, ns.head_dim)
        got = (kv.shape[0], kv.shape[1], kv.shape[2], kv.shape[4])
        if got != want or str(kv.dtype).removeprefix("torch.") != ns.kv_dtype:
            raise ValueError(f"cache of (layers, K|V, heads, head_dim)={got} {kv.dtype} does not match the "
                             f"namespace's {want} {ns.kv_dtype}")
