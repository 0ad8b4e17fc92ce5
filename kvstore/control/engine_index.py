"""The ENGINE tier: which engine holds which pages in its own memory, from its KV events.

Engines (vLLM, SGLang) announce the blocks they cache as `BlockStored(block_hashes,
parent_block_hash, token_ids, block_size, medium, ...)` and drop them with `BlockRemoved`
or `AllBlocksCleared`. Their block hashes are their own (vLLM: the low 64 bits of a
SHA-256 over CBOR with a per-process seed; SGLang: its own), so they cannot be compared
with our keys directly. Each BlockStored carries the block's token ids and its parent's
hash, though, so this index rebuilds our key chain for every block,
`key = page_hash(tokens, key_of(parent))` (kvstore_client.keys, SGLang's chain), and keeps
both: (engine, engine hash) -> key to apply removals, and key -> engines to route.

Route must never credit an engine with a prefix it cannot reuse, so a block is indexed only
when its key is certain; every other block is counted as unattributable, per engine
(Stats.engines and the kvstore_engine_* metrics), never guessed at:
- its parent was never announced (the subscriber joined late and had no replay): no key,
  for it and its descendants (`orphans`, a part of `unattributable`);
- its hash depends on more than tokens (LoRA, multimodal inputs, cache salt, extra keys): a
  token-only key would claim a prefix the engine cannot reuse for a plain request;
- its tokens are pairs (SGLang's EAGLE bigram pages): the page is keyed by token pairs the
  plain chain does not hash;
- its block size is not the one the engine announced first (Route refuses a namespace whose
  page size differs from an engine's: their keys would never meet).
A block hashed with lookahead tokens (vLLM's num_hash_lookahead_tokens: the drafter's KV at
its last position depends on the next L tokens, published as lookahead_token_ids) is keyed by
its own tokens, and Route credits it only where the request goes on with those L tokens: the
engine also holds the next page (whose key fixes them), or the request's tokens show them.
Known limit: SGLang 0.5.23 publishes a request with an `extra_key` (and no LoRA or salt)
exactly as a plain one (same hashes, no field names it), so no subscriber can tell them
apart; such blocks are credited to the plain prefix.

Thread-safe: one subscriber thread per engine writes, Route reads.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from typing import Hashable, Iterable, Mapping, Sequence

from kvstore.control.key_sets import KeySet
from kvstore_client.keys import encode_key, page_hash, unpack_keys
from kvstore_client.tokens import TOKEN_ID_MAX   # past it (or below 0) the engine's hash is not SGLang's chain

log = logging.getLogger(__name__)

GPU = "GPU"
HOST = "HOST"
HELD = "HELD"      # either of them (a key set of its own, for leading runs)
# Medium names the engines use, mapped onto the two places an engine can hold a page.
# vLLM: GPU, CPU (its CPU offload), STORAGE; SGLang: GPU, CPU_PINNED, DISK, EXTERNAL.
# Pages an engine keeps on disk or in an external store are not in its memory: not indexed.
MEDIUMS = {None: GPU, "GPU": GPU, "CPU": HOST, "CPU_PINNED": HOST}


@dataclasses.dataclass(frozen=True)
class Stored:
    block_hashes: Sequence[Hashable]
    parent_block_hash: Hashable | None
    token_ids: Sequence[int]
    block_size: int
    medium: str | None = None
    plain: bool = True          # False when the engine's hash covers more than tokens (LoRA, mm, salt)
    # token_ids may hold pairs (SGLang EAGLE bigram pages): such a block is never keyed
    group_idx: int | None = None
    lookahead: Sequence[Sequence[int]] | None = None   # per block: tokens after it its hash covers


@dataclasses.dataclass(frozen=True)
class Removed:
    block_hashes: Sequence[Hashable]
    medium: str | None = None
    group_idx: int | None = None


@dataclasses.dataclass(frozen=True)
class Cleared:
    pass


Event = Stored | Removed | Cleared


@dataclasses.dataclass
class EngineCounters:
    seen: int = 0              # blocks announced by BlockStored
    stored: int = 0            # blocks indexed
    removed: int = 0
    unattributable: int = 0    # no certain key (see the module docstring); never credited
    orphans: int = 0           # of those: parent never announced
    not_in_memory: int = 0     # on disk or in an external store, or of another KV group
    dropped_full: int = 0      # refused because events.blocks_max was reached
    batches: int = 0
    gaps: int = 0              # sequence numbers the subscriber never received
    block_tokens: int = 0      # the block size the engine announced first
    refused: int = 0           # blocks of another size than its subscription declares (events.block_tokens)


class EngineIndex:
    def __init__(self, blocks_max: int, hash_seed: str = "", block_tokens: Mapping[str, int] | None = None):
        """`block_tokens`: the block size each engine's subscription declares (events.block_tokens)."""
        self.blocks_max = blocks_max
        self.hash_seed = hash_seed
        self.declared = dict(block_tokens or {})
        self._lock = threading.Lock()
        # engine -> place (GPU/HOST) -> engine block hash -> our key (hex str)
        self._blocks: dict[str, dict[str, dict[Hashable, str]]] = {}
        # our key (bytes) -> engine -> place -> engine blocks naming that key there (usually 1)
        self._holders: dict[bytes, dict[str, dict[str, int]]] = {}
        # engine -> place (GPU, HOST, or HELD for either) -> our keys it holds there: a chain's leading run is
        # then a walk in C that stops at the first key missing (leading())
        self._keys_in: dict[str, dict[str, KeySet]] = {}
        # (engine, our key) -> tokens after the page its block's hash covers (lookahead hashing)
        self._lookahead: dict[tuple[str, bytes], tuple[int, ...]] = {}
        self._count = 0
        self.counters: dict[str, EngineCounters] = {}

    def __len__(self) -> int:
        return self._count

    def apply(self, engine_id: str, events: Iterable[Event]) -> None:
        """Apply one batch of an engine's events, in order."""
        with self._lock:
            counters = self.counters.setdefault(engine_id, EngineCounters())
            counters.batches += 1
            for event in events:
                if isinstance(event, Stored):
                    self._store(engine_id, event, counters)
                elif isinstance(event, Removed):
                    self._remove(engine_id, event, counters)
                else:
                    self._clear(engine_id)

    def note_gap(self, engine_id: str, missed: int) -> None:
        with self._lock:
            self.counters.setdefault(engine_id, EngineCounters()).gaps += missed

    def snapshot(self) -> list[tuple[str, int, EngineCounters]]:
        """(engine id, pages indexed now, a copy of its counters) of every engine heard from."""
        with self._lock:
            return [(engine, sum(map(len, self._blocks.get(engine, {}).values())), dataclasses.replace(counters))
                    for engine, counters in sorted(self.counters.items())]

    def block_tokens(self, engine_id: str) -> int:
        """Tokens per block of the engine: as its subscription declares, else as it announces (0: not known)."""
        if engine_id in self.declared:
            return self.declared[engine_id]
        with self._lock:
            counters = self.counters.get(engine_id)
            return counters.block_tokens if counters is not None else 0

    def holders(self, keys: Sequence[bytes], engine_ids: Sequence[str], tokens: Sequence[int] | None = None,
                page_tokens: int = 0) -> dict[str, list[str | None]]:
        """For each engine, the best place (GPU over HOST) it holds each key, or None.

        A page the engine hashed with lookahead tokens counts only where the request goes on
        with them: the engine holds the next page too, or `tokens` (the request's, pages of
        `page_tokens`) show them; a Route by keys alone cannot tell, so it does not count."""
        with self._lock:
            result: dict[str, list[str | None]] = {engine: [None] * len(keys) for engine in engine_ids}
            for position, key in enumerate(keys):
                holding = self._holders.get(key)
                if not holding:
                    continue
                for engine, places in holding.items():
                    if engine in result:
                        result[engine][position] = GPU if GPU in places else HOST
            if self._lookahead:
                for engine, places in result.items():
                    for position, key in enumerate(keys):
                        following = position + 1 < len(keys) and places[position + 1] is not None
                        wanted = self._lookahead.get((engine, key))
                        if places[position] is None or wanted is None or following:
                            continue
                        start = (position + 1) * page_tokens
                        if tokens is None or not page_tokens or tuple(tokens[start:start + len(wanted)]) != wanted:
                            places[position] = None
            return result

    def heard_of(self, engine_ids: Sequence[str]) -> bool:
        """Whether any of these engines has told this node of a page it holds (one not heard of holds nothing)."""
        with self._lock:
            return any(engine in self._blocks for engine in engine_ids)

    def leading(self, keys: Sequence[bytes] | bytes, engine_ids: Sequence[str], tokens: Sequence[int] | None = None,
                page_tokens: int = 0, key_bytes: int = 0) -> list[tuple[int, int]]:
        """For each engine, the leading pages of `keys` it holds in its GPU, and in its GPU or host memory, as
        holders() places them; `keys` packed, `key_bytes` each, where key_bytes is set. The walk ends where
        every engine's run has ended (at most len(keys) steps, which the Lookup's limit bounds)."""
        with self._lock:
            if not self._lookahead:
                return self._leading_runs(keys, engine_ids, key_bytes)
        if key_bytes:
            keys = unpack_keys(keys, key_bytes)
        runs = []   # lookahead pages count only where the next page or the tokens follow: holders() decides
        for places in self.holders(keys, engine_ids, tokens, page_tokens).values():
            gpu = next((i for i, place in enumerate(places) if place != GPU), len(places))
            held = next((i for i, place in enumerate(places) if place is None), len(places))
            runs.append((gpu, held))
        return runs

    # -- with the lock held -------------------------------------------------------------

    def _leading_runs(self, keys: Sequence[bytes] | bytes, engine_ids: Sequence[str],
                      key_bytes: int) -> list[tuple[int, int]]:
        """Each engine's run ends at the chain's first key it does not hold (in its GPU: not held there): one
        walk of its KeySet that stops there. A key in the GPU is held, so the held run goes on from the
        GPU run's end."""
        runs: list[tuple[int, int]] = []
        for engine in engine_ids:
            held = self._keys_in.get(engine, {})
            gpu = held[GPU].leading(keys, key_bytes) if GPU in held else 0
            runs.append((gpu, gpu + held[HELD].leading(keys, key_bytes, gpu) if HELD in held else 0))
        return runs

    def _store(self, engine_id: str, event: Stored, counters: EngineCounters) -> None:
        place = MEDIUMS.get(event.medium)
        count = len(event.block_hashes)
        counters.seen += count
        if place is None or event.group_idx not in (None, 0):
            counters.not_in_memory += count
            return
        if event.block_size <= 0 or len(event.token_ids) != count * event.block_size:
            log.warning("engine %s sent BlockStored with %d tokens for %d blocks of %d; ignored",
                        engine_id, len(event.token_ids), count, event.block_size)
            counters.unattributable += count
            return
        if not counters.block_tokens:
            counters.block_tokens = event.block_size
        declared = self.declared.get(engine_id)
        if declared and event.block_size != declared:
            if not counters.refused:
                log.error("engine %s publishes %d-token blocks but its subscription declares %d "
                          "(events.block_tokens): its blocks are refused; run the engine with %d-token pages or "
                          "declare %d", engine_id, event.block_size, declared, declared, event.block_size)
            counters.refused += count
            return
        if (not event.plain or event.block_size != counters.block_tokens
                or not all(isinstance(token, int) and 0 <= token <= TOKEN_ID_MAX for token in event.token_ids)):
            counters.unattributable += count
            return
        blocks = self._blocks.setdefault(engine_id, {}).setdefault(place, {})
        if event.parent_block_hash is None:
            prior = self.hash_seed or None
        else:
            prior = self._key_of(engine_id, event.parent_block_hash)
            if prior is None:
                counters.orphans += count
                counters.unattributable += count
                return
        size = event.block_size
        for i, block_hash in enumerate(event.block_hashes):
            key = page_hash(event.token_ids[i * size:(i + 1) * size], prior)
            prior = key
            if block_hash in blocks:
                continue
            if self._count >= self.blocks_max:
                counters.dropped_full += count - i
                return
            blocks[block_hash] = key
            if event.lookahead is not None and i < len(event.lookahead) and event.lookahead[i]:
                self._lookahead[(engine_id, encode_key(key))] = tuple(event.lookahead[i])
            raw = encode_key(key)
            places = self._holders.setdefault(raw, {}).setdefault(engine_id, {})
            if not places.get(place):
                keys_in = self._keys_in.setdefault(engine_id, {})
                keys_in.setdefault(place, KeySet()).add(raw)
                keys_in.setdefault(HELD, KeySet()).add(raw)
            places[place] = places.get(place, 0) + 1
            self._count += 1
            counters.stored += 1

    def _key_of(self, engine_id: str, block_hash: Hashable) -> str | None:
        for blocks in self._blocks.get(engine_id, {}).values():
            key = blocks.get(block_hash)
            if key is not None:
                return key
        return None

    def _remove(self, engine_id: str, event: Removed, counters: EngineCounters) -> None:
        place = MEDIUMS.get(event.medium)
        if place is None or event.group_idx not in (None, 0):
            return
        blocks = self._blocks.get(engine_id, {}).get(place)
        if not blocks:
            return
        for block_hash in event.block_hashes:
            key = blocks.pop(block_hash, None)
            if key is not None:
                self._forget(encode_key(key), engine_id, place)
                counters.removed += 1

    def _clear(self, engine_id: str) -> None:
        for place, blocks in self._blocks.pop(engine_id, {}).items():
            for key in blocks.values():
                self._forget(encode_key(key), engine_id, place)

    def _forget(self, key: bytes, engine_id: str, place: str) -> None:
        holding = self._holders[key]
        places = holding[engine_id]
        places[place] -= 1
        if not places[place]:
            del places[place]
            self._keys_in[engine_id][place].discard(key)
        if not places:
            del holding[engine_id]
            self._keys_in[engine_id][HELD].discard(key)
            self._lookahead.pop((engine_id, key), None)
            if not holding:
                del self._holders[key]
        self._count -= 1
