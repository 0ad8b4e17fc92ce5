"""Decode the KV-event batches vLLM and SGLang publish into engine_index events. No I/O.

Wire format (vllm/distributed/kv_events.py, sglang/srt/disaggregation/kv_events.py):
a batch is a msgspec `array_like` struct, so msgpack `[ts, events, dp_rank]`; each event
is a tagged struct, a msgpack map whose "type" is the class name (`BlockStored`,
`BlockRemoved`, `AllBlocksCleared`) and whose default-valued fields may be omitted.
Engines of the earlier layout made events `array_like` too, `[tag, field, ...]` in
declaration order; both are read. Block hashes are ints (vLLM's low 64 bits, SGLang's)
or bytes (vLLM's full digests); both are kept as they are.
"""

from __future__ import annotations

from typing import Any

from kvstore.control.engine_index import Cleared, Event, Removed, Stored

# Field order of the array_like layout, for the fields we read.
_STORED_FIELDS = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium")
_REMOVED_FIELDS = ("block_hashes", "medium")
# Fields that make an engine's block hash depend on more than the tokens (vLLM lists extra_keys
# per block, None for a block that has none).
_NOT_PLAIN = ("lora_id", "lora_name", "extra_keys", "cache_salt")


class EventDecodeError(ValueError):
    """The payload is not a KV-event batch; the message says what was wrong."""


def decode_batch(payload: bytes) -> tuple[float, list[Event]]:
    """(timestamp, events) of one msgpack KVEventBatch payload."""
    import msgspec  # the [events] extra; only a server with engines to follow needs it

    try:
        batch = msgspec.msgpack.decode(payload)
    except msgspec.DecodeError as exc:
        raise EventDecodeError(f"not msgpack: {exc}") from None
    if not isinstance(batch, list) or len(batch) < 2 or not isinstance(batch[1], list):
        raise EventDecodeError("a KVEventBatch is an array [ts, events, dp_rank]")
    ts = batch[0]
    if not isinstance(ts, (int, float)):
        raise EventDecodeError("batch timestamp is not a number")
    return float(ts), [_event(raw) for raw in batch[1]]


def _event(raw: Any) -> Event:
    if isinstance(raw, dict):
        tag, fields = raw.get("type"), raw
    elif isinstance(raw, list) and raw and isinstance(raw[0], str):
        tag = raw[0]
        names = _STORED_FIELDS if tag == "BlockStored" else _REMOVED_FIELDS
        fields = dict(zip(names, raw[1:]))
    else:
        raise EventDecodeError(f"an event is a tagged map or array, got {type(raw).__name__}")
    try:
        if tag == "BlockStored":
            return Stored(
                block_hashes=_hashes(fields["block_hashes"]), parent_block_hash=fields.get("parent_block_hash"),
                token_ids=fields["token_ids"], block_size=int(fields["block_size"]), medium=fields.get("medium"),
                plain=not any(_present(fields.get(name)) for name in _NOT_PLAIN), group_idx=fields.get("group_idx"),
                lookahead=fields.get("lookahead_token_ids"))
        if tag == "BlockRemoved":
            return Removed(block_hashes=_hashes(fields["block_hashes"]), medium=fields.get("medium"),
                           group_idx=fields.get("group_idx"))
        if tag == "AllBlocksCleared":
            return Cleared()
    except (KeyError, TypeError, ValueError) as exc:
        raise EventDecodeError(f"{tag} is missing or mistypes a field: {exc!r}") from None
    raise EventDecodeError(f"unknown event type {tag!r}")


def _present(value: Any) -> bool:
    if isinstance(value, list):
        return any(item is not None and item != [] for item in value)
    return bool(value)


def _hashes(values: Any) -> list:
    if not isinstance(values, list) or not all(isinstance(v, (int, bytes)) for v in values):
        raise TypeError("block_hashes must be a list of ints or bytes")
    return values
