"""A transformers DynamicCache stored page by page and loaded back through a real server gives the same logits."""

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from cluster_parts import cluster_pool, etcd, only_on, start_node  # noqa: F401  (three nodes in a real etcd)
from kvstore_client import KVStoreClient, prefix_hashes
from kvstore_client.adapters.transformers import TransformersKVPages, namespace_for

PAGE_TOKENS = 8


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    return LlamaForCausalLM(config).eval()


def prefill(model, ids, cache=None):
    with torch.no_grad():
        cache = cache if cache is not None else DynamicCache(config=model.config)
        return model(torch.tensor([ids]), past_key_values=cache, use_cache=True)


def test_store_then_load_reproduces_the_cache_and_the_logits(client, model):
    pages = TransformersKVPages(client, namespace_for(model.config, "tiny-llama", PAGE_TOKENS))
    prompt = torch.randint(0, 512, (45,), generator=torch.Generator().manual_seed(1)).tolist()
    out = prefill(model, prompt)
    assert pages.store(out.past_key_values, prompt) == 5              # 45 tokens: 5 full pages of 8
    assert pages.cached_pages(prompt) == 5

    follow_up = prompt + [7, 8, 9]
    cache, cached = pages.load(follow_up)
    assert cached == 40
    for stored, loaded in zip(out.past_key_values.layers, cache.layers):
        assert torch.equal(stored.keys[:, :, :40], loaded.keys) and torch.equal(stored.values[:, :, :40], loaded.values)

    reused = prefill(model, follow_up[cached:], cache)
    full = prefill(model, follow_up)
    assert torch.allclose(reused.logits[0, -1], full.logits[0, -1], atol=1e-4)
    assert reused.logits[0, -1].argmax() == full.logits[0, -1].argmax()


def test_a_cluster_serves_the_helper_and_a_lost_node_costs_only_a_shorter_hit(cluster_pool, model):
    import time
    with KVStoreClient(cluster_pool.address, replicated_pages=0) as pool:    # one copy of each page
        pages = TransformersKVPages(pool, namespace_for(model.config, "tiny-llama-pool", PAGE_TOKENS))
        prompt = torch.randint(0, 512, (96,), generator=torch.Generator().manual_seed(2)).tolist()
        out = prefill(model, prompt)
        assert pages.store(out.past_key_values, prompt) == 12
        assert pages.load(prompt + [1])[1] == 96
        lost = only_on(cluster_pool, prefix_hashes(prompt, PAGE_TOKENS, pages.namespace.hash_seed), "p1", False)
        cluster_pool.nodes["p1"].kill()                                    # SIGKILL, mid-run
        time.sleep(3)                                                      # past its 2 s lease
        follow_up = prompt + [7, 8, 9]
        cache, cached = pages.load(follow_up)
        assert cached == (lost.index(True) * PAGE_TOKENS if any(lost) else 96)   # up to p1's first page
        if cached:
            reused = prefill(model, follow_up[cached:], cache)
            assert torch.allclose(reused.logits[0, -1], prefill(model, follow_up).logits[0, -1], atol=1e-4)
        assert pages.store(out.past_key_values, prompt, skip_pages=cached // PAGE_TOKENS) == 12   # whole again
        assert pages.load(follow_up)[1] == 96


def test_miss_and_cap(client, model):
    pages = TransformersKVPages(client, namespace_for(model.config, "tiny-llama", PAGE_TOKENS))
    assert pages.load([1] * 30) == (None, 0)
    prompt = list(range(1, 17))
    pages.store(prefill(model, prompt).past_key_values, prompt)
    cache, cached = pages.load(prompt, pages_max=(len(prompt) - 1) // PAGE_TOKENS)
    assert cached == 8 and cache.get_seq_length() == 8


def test_cache_of_another_shape_is_refused(client, model):
    pages = TransformersKVPages(client, namespace_for(model.config, "tiny-llama", PAGE_TOKENS, dtype=torch.bfloat16))
    prompt = list(range(16))
    with pytest.raises(ValueError, match="does not match"):
        pages.store(prefill(model, prompt).past_key_values, prompt)
