"""Engine salts: vLLM's cache_salt reaches the keys the vLLM secondary tier stores pages under (vLLM's
OffloadKeys, taken as they are), so a salted request never shares a page with an unsalted one or with
another salt, on a real node. Block hashes come from vLLM's own hashing functions."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
from vllm.utils.hashing import sha256_cbor
from vllm.v1.core import kv_cache_utils
from vllm.v1.kv_offload.base import make_offload_key

from kvstore_client import KVStoreClient, Namespace

PAGE = 4096
BLOCK_TOKENS = 16
NS = Namespace(model="salted-model", page_bytes=PAGE, layout="vllm-tier")


def offload_keys(tokens: list[int], cache_salt: str | None) -> list[bytes]:
    """The tier's keys of a prompt's full blocks, as vLLM hashes them for a request with this salt."""
    kv_cache_utils.init_none_hash(sha256_cbor)
    request = SimpleNamespace(lora_request=None, prompt_embeds=None, cache_salt=cache_salt, mm_features=[])
    keys, parent = [], None
    for start in range(0, len(tokens) - BLOCK_TOKENS + 1, BLOCK_TOKENS):
        extra, _ = kv_cache_utils.generate_block_hash_extra_keys(request, start, start + BLOCK_TOKENS, 0)
        parent = kv_cache_utils.hash_block_tokens(sha256_cbor, parent, tokens[start:start + BLOCK_TOKENS], extra)
        keys.append(bytes(make_offload_key(parent, 0)))
    return keys


def test_salted_requests_share_no_page_with_unsalted_ones(server):
    tokens = list(range(4 * BLOCK_TOKENS))
    plain, salted, other = (offload_keys(tokens, salt) for salt in (None, "tenant-a", "tenant-b"))
    assert not set(plain) & set(salted) and not set(salted) & set(other)
    with KVStoreClient(server.address) as client:
        data = np.random.default_rng(1).integers(0, 256, (4, PAGE), dtype=np.uint8)
        assert client.put(NS, plain, data) == 4
        assert client.lookup(NS, plain) == 4
        assert client.lookup(NS, salted) == 0 and client.lookup(NS, other) == 0
        assert client.put(NS, salted, data[::-1].copy()) == 4
        out = np.zeros_like(data)
        assert client.get(NS, plain, out) == 4 and np.array_equal(out, data)
        assert client.get(NS, salted, out) == 4 and np.array_equal(out, data[::-1])
        assert client.lookup(NS, other) == 0
