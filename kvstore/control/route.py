"""Route scoring: which engine can reuse the most of a request's prefix, and from where.

For each candidate engine, walk the request's pages in chain order. A page is usable
from the best place that holds it: the engine's own GPU memory, the engine's host
memory (its CPU offload), this store's DRAM, or this store's NVME; the walk stops at the
first page no place holds, because an engine only skips the prefill of a leading run.
The score is the sum of the usable pages' weights (config [route]: a page already in
the engine's GPU costs nothing to use, one in our DRAM costs a copy, one on NVME a read
and a copy). Pure: the caller gathers where each page is.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Sequence

from kvstore.control.engine_index import GPU, HOST
from kvstore_client import errors
from kvstore_client.proto import pb


@dataclasses.dataclass(frozen=True)
class Weights:
    engine_gpu: float
    engine_host: float
    dram: float
    nvme: float


_PLACES = ("engine_gpu", "engine_host", "dram", "nvme")


def score_engines(engine_ids: Sequence[str], store_tiers: Sequence[int], engine_places: Mapping[str, Sequence[str | None]],
                  pages: int, weights: Weights) -> list[pb.EngineScore]:
    """One EngineScore per engine id, in order.

    store_tiers: the tier (pb.DRAM / pb.NVME) of each leading page this store holds.
    engine_places: per engine, GPU / HOST / None for each of the `pages` pages.
    """
    weight_of = {GPU: ("engine_gpu", weights.engine_gpu), HOST: ("engine_host", weights.engine_host),
                 pb.DRAM: ("dram", weights.dram), pb.NVME: ("nvme", weights.nvme)}
    scores = []
    for engine_id in engine_ids:
        places = engine_places.get(engine_id) or [None] * pages
        counts = dict.fromkeys(_PLACES, 0)
        score = 0.0
        prefix = 0
        for i in range(pages):
            candidates = [weight_of[place] for place in (places[i], store_tiers[i] if i < len(store_tiers) else None)
                          if place is not None]
            if not candidates:
                break
            name, weight = max(candidates, key=lambda candidate: candidate[1])
            counts[name] += 1
            score += weight
            prefix += 1
        scores.append(pb.EngineScore(
            engine_id=engine_id, score=score, prefix_pages=prefix, engine_gpu_pages=counts["engine_gpu"],
            engine_host_pages=counts["engine_host"], dram_pages=counts["dram"], nvme_pages=counts["nvme"]))
    return scores


def best_engine(scores: Sequence[pb.EngineScore]) -> str:
    """The highest score; the first listed wins a tie (the caller's order is its preference)."""
    best = None
    for score in scores:
        if best is None or score.score > best.score:
            best = score
    return best.engine_id if best is not None else ""


def check_engine_ids(engine_ids: Sequence[str], engines_max: int) -> list[str]:
    if not engine_ids:
        raise errors.InvalidArgument("engine_ids is empty: name the candidate engines to score")
    if len(engine_ids) > engines_max:
        raise errors.InvalidArgument(
            f"{len(engine_ids)} candidate engines; route.engines_max is {engines_max}: send fewer")
    if len(set(engine_ids)) != len(engine_ids):
        raise errors.InvalidArgument("engine_ids names the same engine twice")
    if not all(engine_ids):
        raise errors.InvalidArgument("engine_ids holds an empty id")
    return list(engine_ids)


def check_block_tokens(page_tokens: int, block_tokens: Mapping[str, int]) -> None:
    """Refuse to score engines whose blocks hold another number of tokens than the namespace's pages:
    their keys never meet ours, so they would score 0 however much of the prefix they hold."""
    if not page_tokens:
        return
    for engine_id, tokens in block_tokens.items():
        if tokens and tokens != page_tokens:
            raise errors.InvalidArgument(
                f"engine {engine_id!r} publishes {tokens}-token blocks but this namespace's pages hold "
                f"{page_tokens} tokens: Route cannot compare them; open the namespace with page_tokens={tokens} "
                "or run the engine with the namespace's page size")
