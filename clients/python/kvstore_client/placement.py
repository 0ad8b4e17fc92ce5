"""Where a page lives in a cluster: weighted rendezvous hashing over chain segments. Pure.

The unit of placement is a chain segment: pages [i*K, (i+1)*K) of a prefix chain go to
the node that scores highest for the segment's first key (its prefix hash names the
whole prefix up to there). A conversation of P pages touches ceil(P/K) nodes, all asked
at once in one round. The first S segments are where prefixes shared by many
conversations (system prompts, RAG documents) sit, so each is written to the R
highest-scoring nodes and each read goes to one of them: a shared prefix loads R nodes
instead of one. bench/placement_sim.py compares this with per-page and per-conversation
placement (100 nodes, 80% of conversations on one of 10 system prompts: K=16 asks about
4 nodes per lookup; replicating the first two segments halves the hottest node's load).

Rendezvous scoring (Schindelhauer and Schomaker's weighted form, -w / ln(u) with u the
key's and node's hash in (0, 1)) moves only the segments the changed node wins or loses:
about 1/N of them when one of N equal nodes joins or leaves. A node's weight is its
capacity times a ramp that grows linearly from `RAMP_FLOOR` to 1 over the node's ramp_s
after it starts serving, so an empty node does not take every new write at once.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import struct
from typing import Sequence

from kvstore_client.errors import InvalidArgument
from kvstore_client.membership import Member

RAMP_FLOOR = 0.05


@dataclasses.dataclass(frozen=True)
class Segment:
    start: int                  # index of the segment's first key in the chain
    stop: int
    nodes: tuple[str, ...]      # node ids, best first; more than one for a replicated segment


def weight(member: Member, now: float) -> float:
    """Capacity (GiB, at least a tiny share) times the join ramp."""
    capacity = max(member.capacity_bytes / (1 << 30), 1e-3)
    if member.ramp_s <= 0 or member.serving_since <= 0:
        return capacity
    ramp = (now - member.serving_since) / member.ramp_s
    return capacity * min(1.0, max(RAMP_FLOOR, ramp))


def score(key: bytes, node_id: str, node_weight: float) -> float:
    digest = hashlib.blake2b(key, digest_size=8, key=node_id.encode()[:64]).digest()
    u = (struct.unpack("<Q", digest)[0] + 0.5) / 2.0 ** 64      # in (0, 1)
    return -node_weight / math.log(u)


def rank(key: bytes, weights: dict[str, float], count: int) -> tuple[str, ...]:
    """The `count` highest-scoring node ids for `key`."""
    scored = sorted(weights, key=lambda node_id: score(key, node_id, weights[node_id]), reverse=True)
    return tuple(scored[:count])


def placeable(members: Sequence[Member], now: float) -> dict[str, float]:
    """Weights of the members that take pages: serving ones (joining and draining ones do not)."""
    return {m.node_id: weight(m, now) for m in members if m.state == "serving"}


def check_layout(segment_pages: int, replicas: int, replicated_segments: int) -> None:
    if segment_pages <= 0 or replicas <= 0 or replicated_segments < 0:
        raise InvalidArgument(f"segment_pages ({segment_pages}) and replicas ({replicas}) must be positive, "
                              f"replicated_segments ({replicated_segments}) not negative")


def plan(keys: Sequence[bytes], weights: dict[str, float], segment_pages: int, replicas: int,
         replicated_segments: int = 1) -> list[Segment]:
    """The segments of one chain (keys from its first page) and the nodes of each: the first
    `replicated_segments` on `replicas` nodes, the others on one."""
    check_layout(segment_pages, replicas, replicated_segments)
    segments = []
    for start in range(0, len(keys), segment_pages):
        count = replicas if start < replicated_segments * segment_pages else 1
        nodes = rank(keys[start], weights, count) if weights else ()
        segments.append(Segment(start, min(start + segment_pages, len(keys)), nodes))
    return segments
