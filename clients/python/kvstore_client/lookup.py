"""Lookups of any length in one SDK call: a long prompt is split where one Lookup cannot hold it.

A node answers at most `lookup_pages_max` pages per Lookup (Hello's limits). Longer chains go in
parts, all sent at once (a Lookup changes nothing, so no part waits for another), and the hits
add up until the first part that is not wholly present. A lookup by tokens is hashed here, with
the namespace's chain (keys.prefix_hashes: the node's own, native where kvstore_native is built),
and looked up by keys: hashing 128k tokens costs about a millisecond, shipping them as protobuf
varints several.
"""

from __future__ import annotations

from typing import Any, Sequence

from kvstore_client import errors
from kvstore_client.keys import Key, Namespace, encode_keys, prefix_hashes
from kvstore_client.proto import pb


def chain_keys(namespace: Namespace, keys: Sequence[Key] | None, tokens: Any) -> list[bytes]:
    """The keys a lookup names: as given, or the namespace's chain over the tokens."""
    if (keys is None) == (tokens is None):
        raise errors.InvalidArgument("pass exactly one of keys or tokens=")
    if keys is not None:
        return encode_keys(keys)
    if not namespace.page_tokens:
        raise errors.InvalidArgument("lookup by tokens needs a namespace with page_tokens set")
    return [key.encode() for key in prefix_hashes(tokens, namespace.page_tokens, namespace.hash_seed)]


def leading_hits(control: Any, limits: pb.Limits, namespace_id: int, keys: list[bytes]) -> int:
    """Leading pages of `keys` the node holds, over as many Lookups as its limit needs."""
    most = limits.lookup_pages_max or limits.batch_pages_max   # 0: a node from before lookup_pages_max
    if len(keys) <= most:
        return control.call("Lookup", pb.LookupRequest(namespace_id=namespace_id, keys=keys)).hit_pages
    parts = [control.submit("Lookup", pb.LookupRequest(namespace_id=namespace_id, keys=keys[start:start + most]))
             for start in range(0, len(keys), most)]
    hits = 0
    for part in parts:
        part_hits = part.result().hit_pages
        hits += part_hits
        if part_hits < most:
            break
    return hits
