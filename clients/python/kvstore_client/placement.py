"""Where a page lives in a cluster: weighted rendezvous hashing of each page's own key. Pure.

Why each page by its own key, and not chain segments by their position: an engine's calls
rarely start at a chain's first page. SGLang stores the pages after its own cache hit, vLLM
stores whichever blocks a job holds and asks about keys one by one (held), LMCache names
chunks. A page's place must follow from what every caller knows of it, its key, so that a
writer mid-chain and a reader from the chain's start find it on the same node. A call's
pages are grouped by node and each node is asked once, all at once: one round, at most one
RPC per node. The cost is fan-out: a long prompt touches every node (bench/placement_sim.py
measures it beside segment placement).

A page many conversations share (a system prompt's, a shared RAG document's) would load its one
node, so such pages get copies on their `replicas` best nodes, chosen by measured popularity
(hot_pages.py); cold pages keep one. A caller may also ask that a put that starts a chain (no
parent or anchor) write its first `replicated_pages` pages to the `replicas` best nodes up front
(a mid-chain writer writes only the best node, which every read falls back to).

Rendezvous scoring (Schindelhauer and Schomaker's weighted form, -w / ln(u), u from the
key's and the node's hash in (0, 1)) moves only the pages the changed node wins or loses:
about 1/N when one of N equal nodes joins or leaves. The key is hashed once (BLAKE2b, 8-byte
digest; all keys of a call in one native call where kvstore_native is built) and mixed with
each node's salt in numpy, so placing 8,000 pages over 8 nodes costs about a millisecond. A node's weight is its capacity times a ramp that grows linearly from
`RAMP_FLOOR` to 1 over the node's ramp_s after it starts serving, so an empty node does not
take every new write at once; while it ramps, a read that misses a key there asks the node the key
had before it came (read_order).
"""

from __future__ import annotations

import hashlib
from typing import Sequence

import numpy as np

from kvstore_client import native
from kvstore_client.errors import InvalidArgument
from kvstore_client.membership import Member

RAMP_FLOOR = 0.05

_MIX_1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX_2 = np.uint64(0x94D049BB133111EB)


def weight(member: Member, now: float) -> float:
    """Capacity (GiB, at least a tiny share) times the join ramp."""
    capacity = max(member.capacity_bytes / (1 << 30), 1e-3)
    if member.ramp_s <= 0 or member.serving_since <= 0:
        return capacity
    ramp = (now - member.serving_since) / member.ramp_s
    return capacity * min(1.0, max(RAMP_FLOOR, ramp))


def placeable(members: Sequence[Member], now: float) -> dict[str, float]:
    """Weights of the members that take pages: serving ones (joining and draining ones do not)."""
    return {m.node_id: weight(m, now) for m in members if m.state == "serving"}


def settled(members: Sequence[Member], now: float) -> dict[str, float]:
    """Weights of the serving members whose ramp is over: where pages were placed before the ramping ones came."""
    return {m.node_id: weight(m, now) for m in members
            if m.state == "serving" and (m.ramp_s <= 0 or now - m.serving_since >= m.ramp_s)}


def read_order(keys: Sequence[bytes], members: Sequence[Member], now: float, replicas: int,
               replicated_pages: int) -> list[tuple[str, ...]]:
    """The nodes a read asks for each key, in order: its nodes as a write now places them, then, where the best
    of those is still ramping up, the node the key had before (a ramping node has few pages yet)."""
    weights = placeable(members, now)
    owners = place(keys, weights, replicas, replicated_pages, chain_start=True)
    before = settled(members, now)
    if len(before) == len(weights) or not before:
        return owners
    earlier = place(keys, before, 1, 0, chain_start=False)
    return [nodes + earlier[i] if nodes and nodes[0] not in before and earlier[i][0] not in nodes else nodes
            for i, nodes in enumerate(owners)]


def check_layout(replicas: int, replicated_pages: int) -> None:
    if replicas <= 0 or replicated_pages < 0:
        raise InvalidArgument(f"replicas ({replicas}) must be positive and replicated_pages "
                              f"({replicated_pages}) not negative")


def _hash64(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def key_hashes(keys: Sequence[bytes]) -> np.ndarray:
    """_hash64 of each key: in one native call where kvstore_native is built (8,192 keys in a fraction of a
    millisecond, against several key by key)."""
    if native.key_hashes is not None:
        return np.frombuffer(native.key_hashes(keys), dtype=np.uint64)
    return np.fromiter((_hash64(k) for k in keys), dtype=np.uint64, count=len(keys))


def _scores(keys: Sequence[bytes], node_ids: Sequence[str], weights: Sequence[float]) -> np.ndarray:
    """scores[i, j]: key i's rendezvous score on node j (splitmix64 of key hash ^ node salt)."""
    hashed = key_hashes(keys)
    salts = np.array([_hash64(b"node:" + n.encode()) for n in node_ids], dtype=np.uint64)
    with np.errstate(over="ignore"):
        z = hashed[:, None] ^ salts[None, :]
        z = (z ^ (z >> np.uint64(30))) * _MIX_1
        z = (z ^ (z >> np.uint64(27))) * _MIX_2
        z = z ^ (z >> np.uint64(31))
    u = ((z >> np.uint64(11)).astype(np.float64) + 0.5) / float(1 << 53)     # in (0, 1)
    return -np.asarray(weights, dtype=np.float64)[None, :] / np.log(u)


def rank(key: bytes, weights: dict[str, float], count: int) -> tuple[str, ...]:
    """The `count` highest-scoring node ids for `key`, best first."""
    return place([key], weights, count, 1, chain_start=True)[0]


def place(keys: Sequence[bytes], weights: dict[str, float], replicas: int, replicated_pages: int,
          chain_start: bool) -> list[tuple[str, ...]]:
    """Each key's nodes, best first: `replicas` of them for the first `replicated_pages` keys of a call that
    starts a chain, one for every other key; () for every key when no node takes pages."""
    check_layout(replicas, replicated_pages)
    if not weights or not keys:
        return [() for _ in keys]
    node_ids = sorted(weights)
    scores = _scores(keys, node_ids, [weights[n] for n in node_ids])
    best = np.argmax(scores, axis=1)
    placed = [(node_ids[j],) for j in best.tolist()]
    copies = min(replicas, len(node_ids))
    if chain_start and copies > 1:
        for i in range(min(replicated_pages, len(keys))):
            order = np.argsort(-scores[i], kind="stable")[:copies]
            placed[i] = tuple(node_ids[j] for j in order.tolist())
    return placed
