"""The store event stream's wire: vLLM's KV-event batch classes (vllm.distributed.kv_events), as the
node encodes them (kvstore/control/events_out.py) and events.StoreInventory decodes them. msgspec is
the [events] extra, so this module is imported only where events are published or followed."""

from __future__ import annotations

from typing import Any, Callable

import msgspec


class BlockStored(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    ownership: str | None = None


class BlockRemoved(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    block_hashes: list[bytes]
    medium: str | None
    ownership: str | None = None


class AllBlocksCleared(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    pass


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


def decoder() -> Callable[[bytes], Any]:
    return msgspec.msgpack.Decoder(KVEventBatch, strict=False).decode
