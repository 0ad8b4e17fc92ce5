"""Input checks of the control plane: sizes and identity, before any work is done.

Pure functions over the request messages and the node's limits; each raises the error
the caller gets, with a message that says what to change. A request is checked whole
before the store sees any of it, so a rejected request costs no more than reading it.
"""

from __future__ import annotations

from typing import Sequence

from kvstore.config import Config
from kvstore.limits import Limits
from kvstore_client import errors, native, packed
from kvstore_client.keys import HEX_DIGEST_BYTES, Namespace, encode_keys, prefix_hashes
from kvstore_client.proto import pb

_NAME_FIELDS = ("model", "tenant", "kv_dtype", "layout")
# Parts of one page group: a KV pool and its sidecar pools (SGLang has at most a handful).
GROUP_PARTS_MAX = 16


def namespace_spec(spec: pb.NamespaceSpec, limits: Limits, name_bytes_max: int) -> Namespace:
    if not spec.model:
        raise errors.InvalidArgument("spec.model is empty: name the model whose KV this is")
    for field in _NAME_FIELDS:
        size = len(getattr(spec, field).encode())
        if size > name_bytes_max:
            raise errors.InvalidArgument(
                f"spec.{field} has {size} bytes; names are at most {name_bytes_max} bytes (limits.name_bytes_max)")
    if not 0 < spec.page_bytes <= limits.page_bytes_max:
        raise errors.InvalidArgument(
            f"spec.page_bytes={spec.page_bytes} must be 1 to {limits.page_bytes_max} (limits.page_bytes_max)")
    if spec.tp_size and spec.tp_rank >= spec.tp_size:
        raise errors.InvalidArgument(f"spec.tp_rank={spec.tp_rank} must be below spec.tp_size={spec.tp_size}")
    if spec.hash_seed:
        if len(spec.hash_seed) > 128:
            raise errors.InvalidArgument("spec.hash_seed is at most 128 hex digits (a 64-byte digest)")
        try:
            bytes.fromhex(spec.hash_seed)
        except ValueError:
            raise errors.InvalidArgument("spec.hash_seed must be a hex string") from None
    return Namespace.from_proto(spec)


def keys(batch: Sequence[bytes], limits: Limits, what: str = "keys") -> list[bytes]:
    """Keys of a Reserve, Acquire or Delete: at most limits.batch_pages_max."""
    return _keys(batch, limits, limits.batch_pages_max, "batch_pages_max", what)


def lookup_keys(namespace: Namespace, request: pb.LookupRequest | pb.RouteRequest, limits: Limits,
                parent_key: bytes = b"") -> list[bytes]:
    """The keys a Lookup or Route names, by keys or by tokens; the page count is checked before hashing.

    By tokens, the chain starts from `parent_key` (the key of the page before them) when given,
    else from the namespace's hash_seed.
    """
    if request.keys and request.tokens:
        raise errors.InvalidArgument("give keys or tokens, not both")
    if parent_key and not request.tokens:
        raise errors.InvalidArgument("parent_key continues a chain of tokens: send it with tokens, not keys")
    if not request.tokens:
        return _keys(request.keys, limits, limits.lookup_pages_max, "lookup_pages_max", "keys")
    if not namespace.page_tokens:
        raise errors.InvalidArgument("lookup by tokens needs a namespace with page_tokens set")
    pages = len(request.tokens) // namespace.page_tokens
    if pages > limits.lookup_pages_max:
        raise errors.BatchTooLarge(f"{pages} pages of tokens; limits.lookup_pages_max is {limits.lookup_pages_max}: "
                                   "split the prompt, each part's parent_key the last key of the part before")
    seed = _chain_key(parent_key) if parent_key else namespace.hash_seed
    return encode_keys(prefix_hashes(request.tokens, namespace.page_tokens, seed))


def lookup_packed_keys(request: pb.LookupRequest, limits: Limits) -> tuple[bytes, int, bool]:
    """A Lookup's keys_packed, key_bytes and hex_digests, checked by size alone before any key is read: keys
    of 1 to key_bytes_max bytes (hex digests: 32), a whole number of them, at most lookup_pages_max."""
    if request.keys or request.tokens or request.parent_key:
        raise errors.InvalidArgument("keys_packed holds the whole chain: send it without keys, tokens or parent_key")
    key_bytes, packed, digests = request.key_bytes, request.keys_packed, request.hex_digests
    if digests and key_bytes != HEX_DIGEST_BYTES:
        raise errors.InvalidArgument(f"key_bytes={key_bytes} with hex_digests: a hex key's digest is "
                                     f"{HEX_DIGEST_BYTES} bytes; set key_bytes={HEX_DIGEST_BYTES}")
    if not 0 < key_bytes <= limits.key_bytes_max:
        raise errors.InvalidArgument(f"key_bytes={key_bytes}; keys are 1 to {limits.key_bytes_max} bytes "
                                     "(limits.key_bytes_max): set key_bytes to the length of each packed key")
    pages, rest = divmod(len(packed), key_bytes)
    if rest:
        raise errors.InvalidArgument(f"keys_packed holds {len(packed)} bytes, not a whole number of "
                                     f"key_bytes={key_bytes}: pack keys of one length back to back")
    if not pages:
        raise errors.InvalidArgument("keys_packed is empty: send at least one key")
    if pages > limits.lookup_pages_max:
        raise errors.BatchTooLarge(f"{pages} keys in one call; limits.lookup_pages_max is {limits.lookup_pages_max}: "
                                   "split it")
    return packed, key_bytes, digests


def parent_keys(request: pb.ReserveRequest, keys: Sequence[bytes],
                limits: Limits) -> tuple[bytes, dict[int, bytes] | None]:
    """A Reserve's parent of keys[0], and each other key's parent where it is not the key before it
    (parent_keys: a piece of a chain whose other pages live on other nodes); None without parent_keys."""
    if request.parent_key:
        _keys([request.parent_key], limits, 1, "batch_pages_max", "parent_key")
    if not request.parent_keys:
        return request.parent_key, None
    given = list(request.parent_keys)
    if len(given) != len(keys):
        raise errors.InvalidArgument(f"{len(given)} parent_keys for {len(keys)} keys: give one per key or none")
    if request.parent_key and request.parent_key != given[0]:
        raise errors.InvalidArgument("parent_key and parent_keys[0] differ: they name the same page, give one")
    for i, (parent, key) in enumerate(zip(given, keys)):
        if len(parent) > limits.key_bytes_max or (i and not parent):
            raise errors.InvalidArgument(f"parent_keys[{i}] has {len(parent)} bytes; a parent key is 1 to "
                                         f"{limits.key_bytes_max} bytes (only parent_keys[0] may be empty: a root)")
        if parent == key:
            raise errors.InvalidArgument(f"parent_keys[{i}] is keys[{i}]: a page cannot extend itself")
    return given[0], {i: parent for i, parent in enumerate(given) if i and parent != keys[i - 1]}


def _keys(batch: Sequence[bytes], limits: Limits, most: int, limit_name: str, what: str) -> list[bytes]:
    if not batch:
        raise errors.InvalidArgument(f"{what} is empty: send at least one key")
    if len(batch) > most:
        raise errors.BatchTooLarge(f"{len(batch)} keys in one call; limits.{limit_name} is {most}: split it")
    if native.distinct_keys is not None:   # one pass in C; None: some key is at fault, named below
        keys = native.distinct_keys(batch, limits.key_bytes_max)
        if keys is not None:
            return keys
    keys = list(batch)
    sizes = set(map(len, keys))
    if min(sizes) == 0 or max(sizes) > limits.key_bytes_max:
        position = next(i for i, key in enumerate(keys) if not 0 < len(key) <= limits.key_bytes_max)
        raise errors.InvalidArgument(
            f"{what}[{position}] has {len(keys[position])} bytes; keys are 1 to {limits.key_bytes_max} bytes")
    if len(set(keys)) != len(keys):
        raise errors.DuplicateKey(f"{what} holds the same key twice; a chain never repeats a page")
    return keys


def _chain_key(key: bytes) -> str:
    """A key the token chain made (hex digits), as the seed its next page is hashed from."""
    try:
        text = key.decode("ascii")
        bytes.fromhex(text)
    except ValueError:
        raise errors.InvalidArgument("parent_key must be a key of the token chain (hex digits), "
                                     f"got {key[:16]!r}...") from None
    return text


def lease_ttl_ms(asked_ms: int, default_ms: int, config: Config) -> int:
    if asked_ms > config.leases.ttl_ms_max:
        raise errors.InvalidArgument(
            f"lease_ttl_ms={asked_ms} exceeds leases.ttl_ms_max={config.leases.ttl_ms_max}")
    return asked_ms or default_ms


def commit_indices(request: pb.CommitRequest) -> Sequence[int]:
    """The indices named, as a list or a run (none: every uncommitted one; the store checks them, and the
    checksums, against the lease)."""
    if request.index_count:
        if request.indices:
            raise errors.InvalidArgument("give indices or a run of them (first_index, index_count), not both")
        return range(request.first_index, request.first_index + request.index_count)
    if request.first_index:
        raise errors.InvalidArgument(f"first_index={request.first_index} with index_count=0: a run names "
                                     "index_count indices from first_index on; send index_count too")
    indices = list(request.indices)
    if len(set(indices)) != len(indices):
        raise errors.DuplicateKey("an index appears twice in indices")
    return indices


def commit_checksums(request: pb.CommitRequest) -> list[int]:
    """The checksums a Commit (or a CommitGroup part) gives, repeated or packed."""
    if not request.checksums_packed:
        return list(request.checksums)
    if request.checksums:
        raise errors.InvalidArgument("give checksums or checksums_packed, not both")
    try:
        return packed.read_u64s(request.checksums_packed, "checksums_packed").tolist()
    except ValueError as exc:
        raise errors.InvalidArgument(f"{exc}: send one little-endian uint64 per index") from None


def copied_by_node(request: pb.CommitRequest) -> bytes:
    """A Commit's copied_by_node flags (a byte per index, 0 or 1), which only a writer's checksums come with."""
    flags = request.copied_by_node
    if flags and not request.checksums_from_writer:
        raise errors.InvalidArgument("copied_by_node comes with checksums_from_writer: without it the node hashes "
                                     "every slot, and takes what it recorded where it copied a page itself")
    if flags.translate(None, b"\x00\x01"):
        raise errors.InvalidArgument("copied_by_node holds a byte per index, each 0 or 1")
    return flags


def promote_wait_s(request: pb.AcquireRequest, config: Config) -> float:
    """How long an Acquire may wait for promotions: never beyond controller.promote_wait_ms_max."""
    controller = config.controller
    if request.policy == pb.TIMEOUT:
        return min(request.timeout_ms or controller.prefetch_timeout_ms, controller.promote_wait_ms_max) / 1000
    return controller.promote_wait_ms_max / 1000


def prefetch_policy(policy: int, what: str = "policy") -> None:
    if policy not in pb.PrefetchPolicy.values():
        names = ", ".join(f"{name} ({value})" for name, value in pb.PrefetchPolicy.items())
        raise errors.InvalidArgument(f"{what}={policy} is not a PrefetchPolicy: send one of {names}")


def commit_wait_s(request: pb.AcquireRequest, config: Config) -> float:
    """How long an Acquire may wait for pages not yet committed: wait_ms, at most controller.promote_wait_ms_max."""
    most = config.controller.promote_wait_ms_max
    if request.wait_ms > most:
        raise errors.InvalidArgument(f"wait_ms {request.wait_ms} exceeds controller.promote_wait_ms_max ({most}): "
                                     f"ask for at most {most}")
    return request.wait_ms / 1000


def listing_max(field: str, asked: int, limits: Limits) -> int:
    """How many entries one page of a listing (ListKeys' keys_max, ListPages' pages_max) answers: as
    asked, at most limits.lookup_pages_max; 0 asks for that many."""
    if asked > limits.lookup_pages_max:
        raise errors.InvalidArgument(f"{field}={asked} exceeds limits.lookup_pages_max={limits.lookup_pages_max}: "
                                     "page through with the answer's cursor")
    return asked or limits.lookup_pages_max


def list_cursor(cursor: int) -> int:
    """A ListKeys cursor: a position in the page index, which has fewer than 2**32."""
    if cursor >= 1 << 32:
        raise errors.InvalidArgument(f"cursor={cursor} is not one a ListKeys answer gave: start from 0 and "
                                     "pass each answer's cursor to the next call")
    return cursor


def stats_page(request: pb.StatsRequest, config: Config) -> tuple[int, int]:
    most = config.limits.stats_namespaces_max
    if request.namespaces_max > most:
        raise errors.InvalidArgument(
            f"namespaces_max={request.namespaces_max} exceeds limits.stats_namespaces_max={most}: page through")
    return request.namespaces_offset, request.namespaces_max or most


def group_parts(parts: Sequence, what: str) -> None:
    """A group request names 1 to GROUP_PARTS_MAX parts."""
    if not parts:
        raise errors.InvalidArgument(f"{what} is empty: name at least one part")
    if len(parts) > GROUP_PARTS_MAX:
        raise errors.BatchTooLarge(f"{len(parts)} parts in one group; a group has at most {GROUP_PARTS_MAX}")


def commit_group(request: pb.CommitGroupRequest) -> list[list[int]]:
    """Each part's indices, as commit_indices checks them; every lease once, none durable."""
    group_parts(request.parts, "parts")
    if len({part.lease_id for part in request.parts}) != len(request.parts):
        raise errors.InvalidArgument("a lease appears twice in parts: name each lease once, with all its indices")
    if any(part.durable for part in request.parts):
        raise errors.InvalidArgument("durable is not taken by CommitGroup: commit the group, then ask for "
                                     "durability with a get or by waiting for write-down")
    return [commit_indices(part) for part in request.parts]


def lookup_group(request: pb.LookupGroupRequest, limits: Limits) -> list[bytes]:
    """The chain a LookupGroup names; its parts, each a namespace once, the first one bounding the answer."""
    group_parts(request.parts, "parts")
    if len({part.namespace_id for part in request.parts}) != len(request.parts):
        raise errors.InvalidArgument("a namespace appears twice in parts: a group has one part per namespace")
    if request.parts[0].hit_policy != pb.GROUP_ALL_PAGES:
        raise errors.InvalidArgument("parts[0] bounds the answer with its leading pages: its hit_policy must be "
                                     "GROUP_ALL_PAGES (put the KV pool first)")
    for i, part in enumerate(request.parts):
        if part.hit_policy not in (pb.GROUP_ALL_PAGES, pb.GROUP_TRAILING_PAGES):
            raise errors.InvalidArgument(f"parts[{i}].hit_policy={part.hit_policy} is not a GroupHitPolicy")
    return _keys(request.keys, limits, limits.lookup_pages_max, "lookup_pages_max", "keys")


def acquire_group(request: pb.AcquireGroupRequest, limits: Limits) -> list[list[bytes]]:
    """Each part's keys; a part waits for no commit and names no queue pair (those are single Acquire's)."""
    group_parts(request.parts, "parts")
    for i, part in enumerate(request.parts):
        prefetch_policy(part.policy, f"parts[{i}].policy")
        if part.wait_ms or part.rdma_qp_num:
            raise errors.InvalidArgument(f"parts[{i}] sets wait_ms or rdma_qp_num, which AcquireGroup does not take: "
                                         "send 0")
    if len({part.namespace_id for part in request.parts}) != len(request.parts):
        raise errors.InvalidArgument("a namespace appears twice in parts: a group has one part per namespace")
    return [keys(part.keys, limits, what=f"parts[{i}].keys") for i, part in enumerate(request.parts)]
