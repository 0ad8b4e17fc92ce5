"""Lookups of any length in one SDK call: a long prompt is split where one Lookup cannot hold it.

A node answers at most `lookup_pages_max` pages per Lookup (Hello's limits). Longer chains go in
parts, all sent at once (a Lookup changes nothing, so no part waits for another), and the hits
add up until the first part that is not wholly present. A lookup by tokens is hashed here, with
the namespace's chain (keys.prefix_hashes: the node's own, native where kvstore_native is built),
and looked up by keys: hashing 128k tokens costs about a millisecond, shipping them as protobuf
varints several.

Keys of one length travel packed (LookupRequest.keys_packed): one buffer instead of a field, and
an object on each side, per key. Keys of mixed lengths, and any key to a node from before
keys_packed, go as the repeated field.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable, Sequence, Union

from kvstore_client import errors
from kvstore_client.keys import Key, Namespace, encode_keys, pack_keys, prefix_hashes_packed
from kvstore_client.proto import pb

HEX_KEY_BYTES = 64   # a token chain's key: a SHA-256 digest in hex

@dataclasses.dataclass(frozen=True)
class PackedKeys:
    """A chain of keys of one length, back to back."""

    buffer: bytes
    key_bytes: int

    def __len__(self) -> int:
        return len(self.buffer) // self.key_bytes

    def unpacked(self) -> list[bytes]:
        step = self.key_bytes
        return [self.buffer[i:i + step] for i in range(0, len(self.buffer), step)]


Chain = Union[PackedKeys, list]


def chain_keys(namespace: Namespace, keys: Sequence[Key] | None, tokens: Any) -> list[bytes]:
    """The keys a lookup names, one by one: as given, or the namespace's chain over the tokens."""
    chain = lookup_chain(namespace, keys, tokens)
    return chain.unpacked() if isinstance(chain, PackedKeys) else chain


def lookup_chain(namespace: Namespace, keys: Sequence[Key] | None, tokens: Any) -> Chain:
    """The keys a lookup names, packed where they have one length (a token chain always has)."""
    if (keys is None) == (tokens is None):
        raise errors.InvalidArgument("pass exactly one of keys or tokens=")
    if keys is None:
        if not namespace.page_tokens:
            raise errors.InvalidArgument("lookup by tokens needs a namespace with page_tokens set")
        packed = prefix_hashes_packed(tokens, namespace.page_tokens, namespace.hash_seed)
        return PackedKeys(packed, HEX_KEY_BYTES) if packed else []
    packed = pack_keys(keys)
    return PackedKeys(*packed) if packed is not None else encode_keys(keys)


def leading_hits(control: Any, limits: pb.Limits, namespace_id: int, chain: Chain) -> int:
    """Leading pages of `chain` the node holds, over as many Lookups as its limit needs."""
    requests = lookup_requests(limits, namespace_id, chain)
    if len(requests) == 1:
        return control.call("Lookup", requests[0]).hit_pages
    parts = [control.submit("Lookup", request) for request in requests]
    return leading_sum((part.result().hit_pages for part in parts), limits)


def pages_per_lookup(limits: pb.Limits) -> int:
    return limits.lookup_pages_max or limits.batch_pages_max   # 0: a node from before lookup_pages_max


def lookup_requests(limits: pb.Limits, namespace_id: int, chain: Chain) -> list[pb.LookupRequest]:
    """The Lookups of `chain`, each at most pages_per_lookup; at least one (an empty chain is the
    node's to refuse)."""
    most = pages_per_lookup(limits)
    if isinstance(chain, PackedKeys) and not limits.lookup_keys_packed:
        chain = chain.unpacked()   # a node from before keys_packed
    return [_request(namespace_id, chain, start, start + most) for start in range(0, max(len(chain), 1), most)]


def leading_sum(hit_pages: Iterable[int], limits: pb.Limits) -> int:
    """The chain's leading hits from its parts' answers, in order: up to the first part not wholly present."""
    most, hits = pages_per_lookup(limits), 0
    for part_hits in hit_pages:
        hits += part_hits
        if part_hits < most:
            break
    return hits


def _request(namespace_id: int, chain: Chain, start: int, stop: int) -> pb.LookupRequest:
    if isinstance(chain, PackedKeys):
        step = chain.key_bytes
        return pb.LookupRequest(namespace_id=namespace_id, keys_packed=chain.buffer[start * step:stop * step],
                                key_bytes=step)
    return pb.LookupRequest(namespace_id=namespace_id, keys=chain[start:stop])
