"""Where a prompt's pages are: the answer of a residency query (KVStoreClient.residency, KVStoreCluster.residency).

For a chain of keys (a prompt's full pages), how long a prefix the store holds, the tier each of those
pages is read from (the fastest that holds it), the node serving it (a cluster), and how long a prefix
each named engine holds in its own memory, GPU or host, as the KV events it publishes told the nodes.
A router reads it to send a request where its prefix already is; an engine, to weigh loading a hit
against recomputing it. One SDK call for a prompt of any length: a long chain goes as several Lookups,
all sent at once (lookup.py), and a cluster asks every node at once.

An engine's prefix is asked by keys: a page an engine hashed with lookahead tokens counts only where it
holds the next page too (as Route by keys counts it), and at the seam of two Lookups of a long chain
such a page may count one short.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from kvstore_client.load_estimate import NO_COSTS, LoadCosts, pages_worth_loading
from kvstore_client.proto import pb

TIER_NAMES = {pb.HBM: "hbm", pb.DRAM: "dram", pb.NVME: "nvme"}


@dataclasses.dataclass(frozen=True)
class EngineHeld:
    """The leading pages of the chain one engine holds: in its GPU, and in its GPU or host memory."""

    gpu_pages: int
    held_pages: int


@dataclasses.dataclass(frozen=True)
class Residency:
    pages: int                          # leading pages of the chain the store holds
    tiers: bytes                        # the tier (a pb.Tier) each of those pages is read from
    engines: dict[str, EngineHeld]      # per engine asked about, in the order asked
    costs: LoadCosts = NO_COSTS         # what loading them costs lately (load_estimate.py)
    node_ids: tuple[str, ...] = ()      # a cluster's: the members that answered
    node_of: bytes = b""                # a cluster's: for each of those pages, the position in node_ids (uint16)
                                        # of the node it is read from

    @property
    def nodes(self) -> tuple[str, ...]:
        """A cluster's: the node each of the leading pages is read from."""
        return tuple(map(self.node_ids.__getitem__, np.frombuffer(self.node_of, dtype=np.uint16).tolist()))

    def load_seconds(self, page_bytes: int, pages: int | None = None) -> float:
        """The estimated time to load the first `pages` (all) of the leading pages, 0 for none."""
        count = self.pages if pages is None else min(pages, self.pages)
        return float(self.costs.cumulative(self.tiers[:count], page_bytes)[-1]) if count else 0.0

    def worth_loading(self, page_bytes: int, page_tokens: int, recompute_s_per_token: float) -> int:
        """The leading pages worth loading rather than recomputing (load_estimate.pages_worth_loading): 0 when
        loading them is slower than a prefill that takes `recompute_s_per_token` a token."""
        return pages_worth_loading(self.tiers, self.costs, page_bytes, page_tokens, recompute_s_per_token)

    def tier_pages(self) -> dict[str, int]:
        """How many of the leading pages are read from each tier: {"hbm": .., "dram": .., "nvme": ..}."""
        return {name: self.tiers.count(tier) for tier, name in TIER_NAMES.items()}

    def node_pages(self) -> dict[str, int]:
        """A cluster's: how many of the leading pages each node serves."""
        counts = np.bincount(np.frombuffer(self.node_of, dtype=np.uint16), minlength=len(self.node_ids))
        return {node_id: int(count) for node_id, count in zip(self.node_ids, counts) if count}


class Leading:
    """A residency answer put together from the answers to a chain's parts, in chain order."""

    def __init__(self, engine_ids: Sequence[str]):
        self.tiers = bytearray()
        self.store_open = True   # every page so far held: the next part's hits extend the prefix
        self.engines = {engine_id: [0, 0, True, True] for engine_id in engine_ids}   # gpu, held, each still open

    def add(self, part_pages: int, answer: pb.LookupResponse) -> None:
        """Fold in the answer to the next part of the chain (`part_pages` keys)."""
        if self.store_open:
            self.tiers += answer.tiers_packed or bytes(answer.tiers)
            self.store_open = answer.hit_pages == part_pages
        self.add_engines(part_pages, answer.engines)

    def add_engines(self, part_pages: int, prefixes: Sequence[pb.EnginePrefix]) -> None:
        """Fold in the engines' leading pages of the next part: a run goes on only past a part it covers whole."""
        for prefix in prefixes:
            run = self.engines[prefix.engine_id]
            for slot, pages in ((0, prefix.gpu_pages), (1, prefix.held_pages)):
                if run[slot + 2]:
                    run[slot] += pages
                    run[slot + 2] = pages == part_pages

    def done(self) -> bool:
        """Whether no later part can add to any prefix."""
        return not self.store_open and not any(run[2] or run[3] for run in self.engines.values())

    def engines_held(self) -> dict[str, EngineHeld]:
        return {engine_id: EngineHeld(run[0], run[1]) for engine_id, run in self.engines.items()}

    def residency(self, costs: LoadCosts = NO_COSTS) -> Residency:
        return Residency(len(self.tiers), bytes(self.tiers), self.engines_held(), costs=costs)
