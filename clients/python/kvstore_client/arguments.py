"""A call's arguments checked and turned into what goes on the wire, the same for the sync and async clients.

Each raises errors.InvalidArgument (a ValueError) naming what to pass instead, before anything is sent.
"""

from __future__ import annotations

from typing import Any, Sequence

from kvstore_client import errors
from kvstore_client.buffers import PageSegments, page_segments
from kvstore_client.keys import Key, Namespace, encode_key, encode_keys, prefix_hashes
from kvstore_client.proto import pb
from kvstore_client.tokens import wire_tokens

_PREFETCH_POLICIES = {"wait_complete": pb.WAIT_COMPLETE, "best_effort": pb.BEST_EFFORT, "timeout": pb.TIMEOUT}


def is_cluster_url(target: Any) -> bool:
    return isinstance(target, str) and target.startswith("etcd://")


def node_target(target: Any) -> str:
    """One node's gRPC address; a cluster URL (etcd://...) is refused with the classes that take it."""
    if not isinstance(target, str) or not target:
        raise errors.InvalidArgument(f"target must be a node's address like '127.0.0.1:50051', got {target!r}")
    if is_cluster_url(target):
        raise errors.InvalidArgument(
            f"{target!r} names a cluster, not a node: KVStoreClient({target!r}) and AsyncKVStoreClient take it "
            "(a subclass of them takes one node's address only)")
    return target


def check_timeout_s(timeout_s: Any) -> None:
    """A client's or a call's timeout_s: a positive number of seconds."""
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
        raise errors.InvalidArgument(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")


SPIN_US_DEFAULT = 200   # a client's wait for a local answer polls this long before it sleeps (channel.py)
SPIN_US_MAX = 10_000


def check_spin_us(spin_us: Any) -> None:
    """A client's spin_us: whole microseconds, 0 (never spin) to SPIN_US_MAX."""
    if isinstance(spin_us, bool) or not isinstance(spin_us, int) or not 0 <= spin_us <= SPIN_US_MAX:
        raise errors.InvalidArgument(f"spin_us must be a whole number of microseconds from 0 (never spin) to "
                                     f"{SPIN_US_MAX}, got {spin_us!r}")


def keys_or_tokens(keys: Sequence[Key] | None, tokens: Any) -> dict[str, list]:
    """A Lookup's or Route's keys or tokens field (the node hashes tokens itself)."""
    if (keys is None) == (tokens is None):
        raise errors.InvalidArgument("pass exactly one of keys= or tokens=")
    if keys is not None:
        return {"keys": encode_keys(keys)}
    return {"tokens": wire_tokens(tokens)}


def page_keys(namespace: Namespace, keys: Sequence[Key] | None, tokens: Any) -> list[bytes]:
    """The keys a put or get names: given, or those of the full pages of `tokens` (as the node hashes them)."""
    if (keys is None) == (tokens is None):
        raise errors.InvalidArgument("pass exactly one of keys or tokens=")
    if keys is not None:
        return encode_keys(keys)
    if not namespace.page_tokens:
        raise errors.InvalidArgument("keys by tokens need a namespace with page_tokens set")
    return encode_keys(prefix_hashes(tokens, namespace.page_tokens, namespace.hash_seed))


def engine_id_list(engine_ids: Sequence[str]) -> list[str]:
    if isinstance(engine_ids, str) or not all(isinstance(e, str) for e in engine_ids):
        raise errors.InvalidArgument(f"engine_ids must be a list of engine id strings, got {engine_ids!r}")
    return list(engine_ids)


def prefetch_policy(policy: str) -> int:
    if policy not in _PREFETCH_POLICIES:
        raise errors.InvalidArgument(f"policy must be one of {sorted(_PREFETCH_POLICIES)}, got {policy!r}")
    return _PREFETCH_POLICIES[policy]


def put_pages(namespace: Namespace, keys: Sequence[Key] | None, buffers: Any, tokens: Any,
              parent: Key | None, anchor: Key | None) -> tuple[list[bytes], PageSegments, list[Any]]:
    """A put's keys, its pages' segments and the objects that keep those segments' memory alive."""
    raw_keys = page_keys(namespace, keys, tokens)
    if buffers is None:
        raise errors.InvalidArgument("put needs the pages' buffers")
    segments, keepalive = page_segments(buffers, len(raw_keys), namespace.page_bytes, writable=False)
    if parent is not None and anchor is not None:
        raise errors.InvalidArgument("give parent or anchor, not both: anchor is a parent the node may not hold")
    return raw_keys, segments, keepalive


def parent_list(parents: Sequence[Key | None] | None, count: int, parent: Key | None,
                anchor: Key | None) -> list[bytes] | None:
    """put(parents=): the key of the page before each key, encoded (None: not given). Only the first may be
    None, a chain's start; it replaces parent and anchor."""
    if parents is None:
        return None
    if parent is not None or anchor is not None:
        raise errors.InvalidArgument("give parents, or parent or anchor: parents names the first key's parent too")
    given = list(parents)
    if len(given) != count:
        raise errors.InvalidArgument(f"{len(given)} parents for {count} keys: give one per key")
    if any(p is None for p in given[1:]):
        raise errors.InvalidArgument("only parents[0] may be None (a chain's start): every later page has a parent")
    return [encode_key(p) if p is not None else b"" for p in given]


def get_pages(namespace: Namespace, keys: Sequence[Key] | None, out: Any,
              tokens: Any) -> tuple[list[bytes], PageSegments, list[Any]]:
    """A get's keys, the segments of `out` its pages are copied into and the objects that keep them alive."""
    raw_keys = page_keys(namespace, keys, tokens)
    if out is None:
        raise errors.InvalidArgument("get needs the buffers to copy pages into (out)")
    segments, keepalive = page_segments(out, len(raw_keys), namespace.page_bytes, writable=True)
    return raw_keys, segments, keepalive
