"""A vLLM engine's KV events without its GPU: vLLM's own ZmqEventPublisher, event classes and prefix-cache hashing.

Each FakeEngine publishes (PUB + replay ROUTER) the KVEventBatches a vLLM engine would for the prompts it
prefills, with block hashes from vLLM's hashing (sha256_cbor, as `--prefix-caching-hash-algo sha256_cbor`;
call `kv_cache_utils.init_none_hash(sha256_cbor)` first). Only the scheduler that would call publish() is
absent: it needs a GPU model runner.
"""

from __future__ import annotations

import time

from vllm.distributed.kv_events import BlockStored, KVEventBatch, ZmqEventPublisher
from vllm.utils.hashing import sha256_cbor
from vllm.v1.core import kv_cache_utils

BLOCK = 16


class FakeEngine:
    """What a vLLM engine publishes for the prompts it prefills: one BlockStored per prefill, chained."""

    def __init__(self, workdir, name: str, int_hashes: bool = True):
        self.endpoint = f"ipc://{workdir}/{name}-pub"
        self.replay = f"ipc://{workdir}/{name}-replay"
        self.publisher = ZmqEventPublisher(data_parallel_rank=0, endpoint=self.endpoint,
                                           replay_endpoint=self.replay, buffer_steps=100)
        self.int_hashes = int_hashes
        self.hashes: list = []

    def block_hashes(self, tokens):
        hashes, parent = [], None
        for start in range(0, len(tokens) - BLOCK + 1, BLOCK):
            parent = kv_cache_utils.hash_block_tokens(sha256_cbor, parent, tokens[start:start + BLOCK])
            hashes.append(kv_cache_utils.maybe_convert_block_hash(parent) if self.int_hashes else bytes(parent))
        return hashes

    def prefill(self, tokens, cached_blocks=0):
        """Publish the blocks of `tokens` past the first `cached_blocks` (already announced)."""
        hashes = self.block_hashes(tokens)
        new = hashes[cached_blocks:]
        self.publish(BlockStored(
            block_hashes=new, parent_block_hash=hashes[cached_blocks - 1] if cached_blocks else None,
            token_ids=list(tokens[cached_blocks * BLOCK:len(hashes) * BLOCK]), block_size=BLOCK,
            lora_id=None, medium="GPU", lora_name=None))
        return hashes

    def publish(self, *events):
        self.publisher.publish(KVEventBatch(ts=time.time(), events=list(events)))

    def close(self):
        self.publisher.shutdown()
