"""KV-event batches encoded by vLLM's own event classes decode into the index's events."""

import msgspec
import pytest

# vLLM comes with `make test` (not `make install`): a tree made by `make install` alone skips these.
kv_events = pytest.importorskip("vllm.distributed.kv_events", reason="vllm is installed by `make test`")
AllBlocksCleared, BlockRemoved = kv_events.AllBlocksCleared, kv_events.BlockRemoved
BlockStored, KVEventBatch = kv_events.BlockStored, kv_events.KVEventBatch

from kvstore.control.engine_events import EventDecodeError, decode_batch
from kvstore.control.engine_index import Cleared, Removed, Stored


def encode(batch) -> bytes:
    return msgspec.msgpack.Encoder().encode(batch)  # what ZmqEventPublisher sends


def test_vllm_batch_decodes():
    digest = bytes(range(32))
    batch = KVEventBatch(ts=12.5, data_parallel_rank=0, events=[
        BlockStored(block_hashes=[7, 8], parent_block_hash=None, token_ids=list(range(32)), block_size=16,
                    lora_id=None, medium="GPU", lora_name=None),
        BlockStored(block_hashes=[digest], parent_block_hash=8, token_ids=list(range(16)), block_size=16,
                    lora_id=None, medium="CPU", lora_name=None, group_idx=0),
        BlockRemoved(block_hashes=[7], medium="GPU"),
        AllBlocksCleared(),
    ])
    ts, events = decode_batch(encode(batch))
    assert ts == 12.5
    assert events[0] == Stored(block_hashes=[7, 8], parent_block_hash=None, token_ids=list(range(32)),
                               block_size=16, medium="GPU", plain=True, group_idx=None)
    assert events[1].block_hashes == [digest] and events[1].parent_block_hash == 8 and events[1].medium == "CPU"
    assert events[2] == Removed(block_hashes=[7], medium="GPU")
    assert events[3] == Cleared()


@pytest.mark.parametrize("extra", [{"lora_name": "adapter"}, {"lora_id": 3}, {"extra_keys": [("salt",)]}])
def test_blocks_hashed_over_more_than_tokens_are_not_plain(extra):
    fields = dict(block_hashes=[1], parent_block_hash=None, token_ids=[1, 2], block_size=2, lora_id=None,
                  medium="GPU", lora_name=None)
    fields.update(extra)
    _, events = decode_batch(encode(KVEventBatch(ts=0.0, events=[BlockStored(**fields)])))
    assert events[0].plain is False


def test_array_like_events_of_the_earlier_layout_decode():
    # Earlier vLLM releases declared events array_like: [tag, block_hashes, parent, tokens, size, lora_id, medium].
    payload = msgspec.msgpack.encode([1.0, [["BlockStored", [5], None, [1, 2], 2, None, "GPU"],
                                            ["BlockRemoved", [5], "GPU"], ["AllBlocksCleared"]], None])
    _, events = decode_batch(payload)
    assert events[0].block_hashes == [5] and events[0].token_ids == [1, 2] and events[0].medium == "GPU"
    assert events[1] == Removed(block_hashes=[5], medium="GPU") and events[2] == Cleared()


@pytest.mark.parametrize("payload, why", [
    (b"\xc1", "not msgpack"),
    (msgspec.msgpack.encode({"ts": 1}), "array"),
    (msgspec.msgpack.encode([1.0, [{"type": "Nope"}]]), "unknown event type"),
    (msgspec.msgpack.encode([1.0, [{"type": "BlockStored", "block_hashes": [1]}]]), "BlockStored"),
    (msgspec.msgpack.encode([1.0, [{"type": "BlockRemoved", "block_hashes": ["x"], "medium": None}]]),
     "BlockRemoved"),
])
def test_malformed_payloads_are_refused_with_a_reason(payload, why):
    with pytest.raises(EventDecodeError, match=why):
        decode_batch(payload)


def test_per_block_extra_keys_that_are_all_none_are_plain_and_lookahead_tokens_are_read():
    """vLLM lists extra_keys per block (None for a plain block) and, with lookahead hashing, the
    tokens after each block its hash covers."""
    _, events = decode_batch(encode(KVEventBatch(ts=0.0, events=[BlockStored(
        block_hashes=[1, 2], parent_block_hash=None, token_ids=[1, 2, 3, 4], block_size=2, lora_id=None,
        medium="GPU", lora_name=None, extra_keys=[None, None], lookahead_token_ids=[[3], [5]])])))
    assert events[0].plain is True and events[0].lookahead == [[3], [5]]
