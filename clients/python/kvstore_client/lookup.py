"""Lookups of any length in one SDK call: a long prompt is split where one Lookup cannot hold it.

A node answers at most `lookup_pages_max` pages per Lookup (Hello's limits). Longer chains go in
parts, all sent at once (a Lookup changes nothing, so no part waits for another), and the hits
add up until the first part that is not wholly present. A lookup by tokens is hashed here, with
the namespace's chain (keys.prefix_hashes: the node's own, native where kvstore_native is built),
and looked up by keys: hashing 128k tokens costs about a millisecond, shipping them as protobuf
varints several.

A long chain goes in parts of at most PART_PAGES even where the node takes more in one Lookup:
the node looks up one part while the next is still on its way (or, by tokens, still being hashed
here: each part is hashed just before it is sent, its chain continuing from the last key of the
part before). One Lookup of 32768 keys took twice as long as the same keys in parts of 2048.

Keys of one length travel packed (LookupRequest.keys_packed): one buffer instead of a field, and
an object on each side, per key. Keys of mixed lengths, and any key to a node from before
keys_packed, go as the repeated field. Hex keys (a token chain's, SGLang's: 64 lowercase hex
digits) travel as the 32 bytes each spells (hex_digests): half the bytes to send, and none to
decode on the node: a lookup of 8,192 hex keys took 0.67-0.69 ms that way against 0.77-0.81 ms as
digits (32,768: 2.6-2.7 against 3.1-3.2 ms), the two alternated call by call on one node.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from typing import Any, Iterable, Iterator, Sequence, Union

import numpy as np

from kvstore_client import errors
from kvstore_client.keys import (HEX_DIGEST_BYTES, HEX_KEY_BYTES, Key, Namespace, encode_keys, hex_digests,
                                 pack_keys, prefix_hashes_packed, unpack_keys)
from kvstore_client.node_steps import Answer, Send, Steps
from kvstore_client.proto import pb
from kvstore_client.load_estimate import LoadCosts, TransferRate
from kvstore_client.residency import EngineHeld, Leading, Residency
from kvstore_client.tokens import token_array

PART_PAGES = 2048    # pages of one Lookup at most: the node looks up one part while the next comes


@dataclasses.dataclass(frozen=True)
class PackedKeys:
    """A chain of keys of one length, back to back."""

    buffer: bytes
    key_bytes: int

    def __len__(self) -> int:
        return len(self.buffer) // self.key_bytes

    def unpacked(self) -> list[bytes]:
        return unpack_keys(self.buffer, self.key_bytes)

    def part(self, start: int, stop: int) -> "PackedKeys":
        return PackedKeys(self.buffer[start * self.key_bytes:stop * self.key_bytes], self.key_bytes)


@dataclasses.dataclass(frozen=True)
class TokenChain:
    """The full pages of a lookup's tokens, hashed only as their parts are asked for. Ids given as a list or
    tuple stay one, and each part's ids are read (token_array) as it is hashed: reading 128k ids costs half a
    millisecond, which otherwise passes before the first part is sent, and part by part it overlaps the
    node's lookup of the part before. A part whose ids are not all valid raises there, InvalidArgument."""

    tokens: np.ndarray | list | tuple
    page_tokens: int
    hash_seed: str

    def __len__(self) -> int:
        return len(self.tokens) // self.page_tokens

    def parts(self, part_pages: int) -> Iterator[PackedKeys]:
        """The chain's keys, part_pages at a time, each part chained from the last key of the one before."""
        seed, step = self.hash_seed, part_pages * self.page_tokens
        for start in range(0, len(self) * self.page_tokens, step):
            packed = prefix_hashes_packed(self.tokens[start:start + step], self.page_tokens, seed)
            seed = packed[-HEX_KEY_BYTES:].decode("ascii")
            yield PackedKeys(packed, HEX_KEY_BYTES)


class SharedTokenChain:
    """A TokenChain several nodes are asked at once, from one thread (a cluster's residency): each part is hashed
    when the first node's Lookup takes it, while the nodes already sent the part before look it up, and is kept
    for the other nodes."""

    def __init__(self, chain: TokenChain):
        self.chain = chain
        self._hashed: dict[int, tuple[list[PackedKeys], Iterator[PackedKeys]]] = {}   # by part_pages

    def __len__(self) -> int:
        return len(self.chain)

    def parts(self, part_pages: int) -> Iterator[PackedKeys]:
        """TokenChain.parts, each part hashed once."""
        if part_pages not in self._hashed:
            self._hashed[part_pages] = ([], self.chain.parts(part_pages))
        hashed, rest = self._hashed[part_pages]
        for at in itertools.count():
            if at == len(hashed):
                part = next(rest, None)
                if part is None:
                    return
                hashed.append(part)
            yield hashed[at]


Chain = Union[PackedKeys, TokenChain, SharedTokenChain, list]


def chain_keys(namespace: Namespace, keys: Sequence[Key] | None, tokens: Any) -> list[bytes]:
    """The keys a lookup names, one by one: as given, or the namespace's chain over the tokens."""
    chain = lookup_chain(namespace, keys, tokens)
    if isinstance(chain, TokenChain):
        return [key for part in chain.parts(max(len(chain), 1)) for key in part.unpacked()]
    return chain.unpacked() if isinstance(chain, PackedKeys) else chain


def shared_chain(namespace: Namespace, keys: Sequence[Key] | None, tokens: Any) -> Chain:
    """lookup_chain for a chain several nodes are asked at once: its tokens hashed once (SharedTokenChain)."""
    chain = lookup_chain(namespace, keys, tokens)
    return SharedTokenChain(chain) if isinstance(chain, TokenChain) else chain


def lookup_chain(namespace: Namespace, keys: Sequence[Key] | None, tokens: Any) -> Chain:
    """The keys a lookup names, packed where they have one length; tokens as a TokenChain."""
    if (keys is None) == (tokens is None):
        raise errors.InvalidArgument("pass exactly one of keys or tokens=")
    if keys is None:
        if not namespace.page_tokens:
            raise errors.InvalidArgument("lookup by tokens needs a namespace with page_tokens set")
        if type(tokens) in (list, tuple):
            # The ids past the last full page are in no part: read them now, so a bad one there is refused too.
            token_array(tokens[len(tokens) - len(tokens) % namespace.page_tokens:])
            return TokenChain(tokens, namespace.page_tokens, namespace.hash_seed)
        return TokenChain(token_array(tokens), namespace.page_tokens, namespace.hash_seed)
    packed = pack_keys(keys)
    return PackedKeys(*packed) if packed is not None else encode_keys(keys)


def leading_hits(limits: pb.Limits, namespace_id: int, chain: Chain, stream: bool = True) -> Steps[int]:
    """Leading pages of `chain` the node holds, over as many Lookups as its limit needs, each sent
    as soon as its part is ready (steps of an attempt: node_steps.py). `stream`: pages_per_part's."""
    part_pages = pages_per_part(limits, stream)
    parts = []
    for request in lookup_requests(limits, namespace_id, chain, stream):
        parts.append((yield Send("Lookup", request)))
    hits = 0
    for part in parts:
        part_hits = (yield Answer(part)).hit_pages
        hits += part_hits
        if part_hits < part_pages:   # the chain ends in this part
            break
    return hits


def pages_per_part(limits: pb.Limits, stream: bool = True) -> int:
    """The keys of one Lookup: at most PART_PAGES on a stream (the local socket, whose answers come in order:
    the node looks up one part while the next arrives), else as many as the node takes, since each gRPC
    message costs more than looking up a part (a 128k-token residency over three nodes: 8.4 ms in parts of
    2048, 5.9 ms in one part each)."""
    most = limits.lookup_pages_max or limits.batch_pages_max   # 0: a node from before lookup_pages_max
    return min(most, PART_PAGES) if stream else most


def lookup_requests(limits: pb.Limits, namespace_id: int, chain: Chain,
                    stream: bool = True) -> Iterator[pb.LookupRequest]:
    """The Lookups of `chain`, each of at most pages_per_part, made one by one as they are taken; at
    least one (an empty chain is the node's to refuse)."""
    part_pages = pages_per_part(limits, stream)
    if isinstance(chain, (TokenChain, SharedTokenChain)):
        parts: Iterable[Any] = chain.parts(part_pages) if len(chain) else [PackedKeys(b"", HEX_KEY_BYTES)]
    else:
        parts = (chain[start:start + part_pages] if isinstance(chain, list) else chain.part(start, start + part_pages)
                 for start in range(0, max(len(chain), 1), part_pages))
    for part in parts:
        if isinstance(part, PackedKeys) and not limits.lookup_keys_packed:
            part = part.unpacked()   # a node from before keys_packed
        yield _request(namespace_id, part, limits.lookup_hex_digests)


def residency_of(limits: pb.Limits, namespace_id: int, chain: Chain, engine_ids: list[str],
                 transfer: TransferRate | None = None, stream: bool = True) -> Steps[Residency]:
    """How long a prefix of `chain` the node holds, each page's tier, each engine's prefix, and what loading it
    would cost (residency.py), over as many Lookups as the node's limit needs, all sent at once. `transfer`:
    this connection's recent data-plane rate, the client's half of the cost."""
    parts = []
    sent_at = time.monotonic()
    for request in lookup_requests(limits, namespace_id, chain, stream):
        request.engine_ids.extend(engine_ids)
        request.load_rates = not parts   # the node's costs once, with the first part
        size = len(request.keys_packed) // request.key_bytes if request.key_bytes else len(request.keys)
        parts.append((size, (yield Send("Lookup", request))))
    leading, rates, round_trip_s = Leading(engine_ids), [], 0.0
    for size, part in parts:
        answer = yield Answer(part)
        if not rates:
            rates, round_trip_s = list(answer.load_rates), time.monotonic() - sent_at
        leading.add(size, answer)
        if leading.done():
            break
    plane = transfer.bytes_per_s() if transfer is not None else 0.0
    return leading.residency(LoadCosts({rate.tier: rate.seconds_per_page for rate in rates}, plane, round_trip_s))


def tiers_each_of(limits: pb.Limits, namespace_id: int, chain: Chain, engine_ids: list[str],
                  transfer: TransferRate | None = None, stream: bool = True
                  ) -> Steps[tuple[bytes, dict[str, EngineHeld], LoadCosts]]:
    """Where each page of `chain` is on the node, each on its own (one byte a key: 0 not held, else its Tier),
    each engine's leading pages of it, and what loading from the node costs, over as many Lookups (each_key)
    as the node's limit needs, all sent at once (the node answers one part while the next is on its way)."""
    parts = []
    sent_at = time.monotonic()
    for request in lookup_requests(limits, namespace_id, chain, stream):
        request.each_key = True
        request.engine_ids.extend(engine_ids)
        request.load_rates = not parts
        size = len(request.keys_packed) // request.key_bytes if request.key_bytes else len(request.keys)
        parts.append((size, (yield Send("Lookup", request))))
    engines, tiers, rates, round_trip_s = Leading(engine_ids), [], None, 0.0
    for size, part in parts:
        answer = yield Answer(part)
        if rates is None:
            rates, round_trip_s = list(answer.load_rates), time.monotonic() - sent_at
        tiers.append(answer.held)
        engines.add_engines(size, answer.engines)
    plane = transfer.bytes_per_s() if transfer is not None else 0.0
    costs = LoadCosts({rate.tier: rate.seconds_per_page for rate in rates or ()}, plane, round_trip_s)
    return b"".join(tiers), engines.engines_held(), costs


def held_each(limits: pb.Limits, namespace_id: int, keys: list[bytes]) -> Steps[list[bool]]:
    """Whether each key is held, its parts sent at once and read in order."""
    parts = []
    for request in held_requests(limits, namespace_id, keys):
        parts.append((yield Send("Lookup", request)))
    held = []
    for part in parts:
        held += [bool(b) for b in (yield Answer(part)).held]
    return held


def held_requests(limits: pb.Limits, namespace_id: int, keys: list[bytes]) -> list[pb.LookupRequest]:
    """Lookups asking whether each key is held (each_key), at most pages_per_part keys each, packed as
    lookup_requests packs them; none for no keys."""
    if not keys:
        return []
    packed = pack_keys(keys)
    requests = list(lookup_requests(limits, namespace_id, PackedKeys(*packed) if packed is not None else keys))
    for request in requests:
        request.each_key = True
    return requests


def _request(namespace_id: int, part: PackedKeys | list, digests_read: bool) -> pb.LookupRequest:
    """A part's Lookup: hex keys as their digests where the node reads them (digests_read), else as given."""
    if not isinstance(part, PackedKeys):
        return pb.LookupRequest(namespace_id=namespace_id, keys=part)
    digests = hex_digests(part.buffer) if digests_read and part.key_bytes == HEX_KEY_BYTES else None
    if digests is not None:
        return pb.LookupRequest(namespace_id=namespace_id, keys_packed=digests, key_bytes=HEX_DIGEST_BYTES,
                                hex_digests=True)
    return pb.LookupRequest(namespace_id=namespace_id, keys_packed=part.buffer, key_bytes=part.key_bytes)
